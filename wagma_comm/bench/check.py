"""Result checking shared by every benchmark (`-c`, the #wrong column).

Each rank contributes small integers that are exact in every supported dtype
(sums over 8 ranks included), so the expected reduction is known exactly and
any wrong element is counted, not hidden by a tolerance.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def _values(rank: int, count: int) -> np.ndarray:
    """Rank ``rank``'s input values, in [1, 6], as float64. Element i holds
    base-4 digit ``i % 4`` of the rank (+1), so two ranks below 256 differ in
    some element of a buffer of 4 or more (``rank % 4`` alone made ranks r and
    r+4 equal: at 8 ranks a result of the other group of 4, or rank 0 counted
    twice and rank 4 dropped, went unseen); ``+ i % 3`` shows a misplaced chunk."""
    i = np.arange(count)
    digit = (rank >> (2 * (i % 4))) & 3
    return (digit + 1 + (i % 3)).astype(np.float64)


def pattern(rank: int, count: int, dtype: Any) -> np.ndarray:
    """Rank ``rank``'s input, typed as ``dtype.numpy``."""
    return _values(rank, count).astype(np.float32).astype(dtype.numpy)


def expected_result(collective: str, ranks: Sequence[int], count: int, op: str,
                    root: int = 0) -> np.ndarray:
    """What ``collective`` over ``ranks``' patterns gives, in float64."""
    if collective == "broadcast":
        return _values(root, count)
    stack = np.stack([_values(r, count) for r in ranks])
    return {"sum": stack.sum(0), "avg": stack.sum(0) / len(ranks), "max": stack.max(0),
            "min": stack.min(0), "prod": stack.prod(0)}[op]


def count_wrong(arr: np.ndarray, dtype: Any, expected: np.ndarray) -> int:
    """Elements of ``arr`` (typed or storage view) that differ from
    ``expected`` as ``dtype`` stores it (integer avg is floor division)."""
    if not dtype.is_float:
        expected = np.floor(expected)
    want = expected.astype(dtype.numpy).astype(np.float64)
    got = np.asarray(arr).view(dtype.numpy).astype(np.float64)
    tol = 1e-2 if dtype.is_half else 1e-6
    bad = ~(np.isclose(got, want, rtol=tol, atol=0.0) | (got == want))
    return int(np.count_nonzero(bad))
