"""What a list of parameters looks like, and the set-up check that every rank
has the same list.

A model travels as one flat message per dtype, so every rank must lay its
parameters out identically: same count, and the same shape and dtype at every
index. A difference would otherwise surface much later as a truncated message or,
worse, as silently mixed weights. :func:`check_consistent` finds it at set-up
with three small allreduces (they carry the communicator's timeout, unlike a
plain MPI allgather) and names the parameter and the ranks on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import dtypes
from .._splitmix import splitmix64
from ..errors import InvalidArgumentError

__all__ = ["TensorSpec", "ParameterMismatchError", "check_consistent", "describe_layout"]

# Shapes are exchanged with up to this many dimensions; deeper tensors are
# compared by a hash of the full shape (and reported by that hash's dims).
_MAX_DIMS = 8
_DTYPE_CODES = {name: k + 1 for k, name in enumerate(sorted(dtypes.BY_NAME))}
_CODE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}
_MASK62 = (1 << 62) - 1


@dataclass(frozen=True)
class TensorSpec:
    """One parameter's place in the flat buckets.

    ``index``: position in the caller's list; ``name``: its name if known;
    ``dtype``: wagma_comm dtype name (one bucket per dtype); ``offset``: first
    element in that bucket; ``count``: elements.
    """

    index: int
    name: str | None
    shape: tuple[int, ...]
    dtype: str
    offset: int
    count: int

    def label(self) -> str:
        """``parameter 3 ('fc.weight')``: how errors name a parameter."""
        return f"parameter {self.index}" + (f" ({self.name!r})" if self.name else "")

    def describe(self) -> str:
        return f"shape {self.shape} {self.dtype}"


class ParameterMismatchError(InvalidArgumentError):
    """The ranks disagree on the parameter list (count, shape or dtype).

    Raised on every rank, at set-up, before any weights move. ``index`` is the
    first differing parameter (``None`` when only the count differs beyond the
    shorter list), ``ranks`` the ranks whose view differs from the majority
    (all ranks involved when there is no majority).
    """

    def __init__(self, message: str, index: int | None, ranks: Sequence[int]) -> None:
        super().__init__("params", message)
        self.index = index
        self.ranks = tuple(sorted(ranks))


def layout(shapes: Sequence[tuple[int, ...]], dtype_names: Sequence[str],
           names: Sequence[str | None]) -> tuple[TensorSpec, ...]:
    """Specs with offsets: parameters are packed per dtype, in list order."""
    fill: dict[str, int] = {}
    out = []
    for i, (shape, dt, name) in enumerate(zip(shapes, dtype_names, names)):
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        out.append(TensorSpec(i, name, tuple(int(s) for s in shape), dt, fill.get(dt, 0),
                              count))
        fill[dt] = fill.get(dt, 0) + count
    return tuple(out)


def bucket_sizes(specs: Sequence[TensorSpec]) -> dict[str, int]:
    """Elements per dtype bucket, in order of first appearance."""
    sizes: dict[str, int] = {}
    for s in specs:
        sizes[s.dtype] = sizes.get(s.dtype, 0) + s.count
    return sizes


def describe_layout(specs: Sequence[TensorSpec]) -> str:
    """One line: ``3 tensors, 1 bucket: float32 x 4810``."""
    sizes = bucket_sizes(specs)
    parts = ", ".join(f"{dt} x {n}" for dt, n in sizes.items())
    return f"{len(specs)} tensors, {len(sizes)} bucket{'s' if len(sizes) != 1 else ''}: {parts}"


def check_names(names: Any, n: int) -> list[str | None]:
    """``names`` is None or a sequence of n strings (or None entries)."""
    if names is None:
        return [None] * n
    if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
        # A string is iterable, but as one-letter names.
        raise InvalidArgumentError("names", f"expected a sequence of names (str or None), "
                                   f"got {type(names).__name__}")
    names = list(names)
    if len(names) != n:
        raise InvalidArgumentError("names", f"expected {n} names (one per tensor), got "
                                   f"{len(names)}")
    for i, name in enumerate(names):
        if name is not None and not isinstance(name, str):
            raise InvalidArgumentError("names", f"names[{i}] must be a str or None, got "
                                       f"{type(name).__name__}")
    return names


# ---------------------------------------------------------------- cross-rank check


def _signature(spec: TensorSpec) -> int:
    """A 62-bit hash of (shape, dtype): equal on every rank for equal specs
    (Python's str hash is salted per process, so only integers go in)."""
    h = splitmix64(_DTYPE_CODES[spec.dtype])
    h = splitmix64(h ^ len(spec.shape))
    for d in spec.shape:
        h = splitmix64(h ^ d)
    return h & _MASK62


def allgather_ints(comm: Any, row: Sequence[int], width: int) -> np.ndarray:
    """Every rank's ``row`` (``width`` int64s): a sum-allreduce of a P x width
    matrix that is zero outside this rank's row, so it is exact."""
    table = np.zeros((comm.size, width), dtype=np.int64)
    table[comm.rank, :len(row)] = row
    comm.allreduce(table, "sum")
    return table


def agree_on_failure(comm: Any, error: BaseException | None, argument: str, what: str,
                     mark: int = 0) -> list[int]:
    """Collective: tell every rank which ranks failed ``what`` (one small
    allreduce, with the communicator's deadline), so a local failure (a
    full disk, a missing file, a state that does not load) is an
    InvalidArgumentError naming ``argument`` on every rank instead of an
    error on one rank and a timeout that breaks the communicator on the
    others. Returns every rank's ``mark``."""
    table = allgather_ints(comm, [int(error is not None), mark], 2)
    failed = [r for r in range(comm.size) if table[r, 0]]
    if error is not None:
        if isinstance(error, InvalidArgumentError):
            raise error
        raise InvalidArgumentError(argument, f"could not {what}: {error}") from error
    if failed:
        raise InvalidArgumentError(argument, f"{'rank' if len(failed) == 1 else 'ranks'} "
                                   f"{failed} could not {what} (their errors say why)")
    return [int(m) for m in table[:, 1]]


def minority(values: Sequence[Any]) -> tuple[Any, list[int]]:
    """The most common value and the ranks that differ from it (ties: lowest
    value wins, so every rank picks the same)."""
    counts: dict[Any, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    common = sorted(counts, key=lambda v: (-counts[v], v))[0]
    odd = [r for r, v in enumerate(values) if v != common]
    return common, odd


def _ranks_by(values: Sequence[Any]) -> dict[Any, list[int]]:
    out: dict[Any, list[int]] = {}
    for r, v in enumerate(values):
        out.setdefault(v, []).append(r)
    return out


def _describe_row(row: np.ndarray) -> str:
    code, ndim = int(row[0]), int(row[1])
    dims = tuple(int(d) for d in row[2:2 + min(ndim, _MAX_DIMS)])
    more = ", ..." if ndim > _MAX_DIMS else ""
    shape = f"({', '.join(map(str, dims))}{',' if ndim == 1 else ''}{more})"
    return f"shape {shape} {_CODE_NAMES.get(code, f'dtype #{code}')}"


def check_consistent(comm: Any, specs: Sequence[TensorSpec]) -> None:
    """Collective: raise :class:`ParameterMismatchError` on every rank unless all
    ranks have the same number of parameters with the same shapes and dtypes.

    Names are not compared (ranks may legitimately name things differently);
    they are used to say which parameter differs.
    """
    if comm.size == 1:
        return
    counts = [int(c) for c in allgather_ints(comm, [len(specs)], 1)[:, 0]]
    if len(set(counts)) > 1:
        common, odd = minority(counts)
        first = min(counts)
        mine = specs[first].label() if first < len(specs) else None
        per = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        raise ParameterMismatchError(
            f"the ranks have different numbers of parameters ({per}); the first "
            f"parameter not present everywhere is index {first}"
            + (f" ({mine} on this rank)" if mine and specs[first].name else "")
            + f"; ranks that differ from the majority: {odd}", first, odd)
    n = len(specs)
    if n == 0:
        return
    sig = np.array([_signature(s) for s in specs], dtype=np.int64)
    both = np.concatenate([sig, -sig])
    comm.allreduce(both, "max")
    differ = np.nonzero(both[:n] != -both[n:])[0]  # max != min
    if differ.size == 0:
        return
    i = int(differ[0])
    spec = specs[i]
    row = [_DTYPE_CODES[spec.dtype], len(spec.shape), *spec.shape[:_MAX_DIMS]]
    table = allgather_ints(comm, row, 2 + _MAX_DIMS)
    views = [_describe_row(table[r]) for r in range(comm.size)]
    if len(set(views)) == 1:  # dims beyond _MAX_DIMS differ: fall back to hashes
        views = [f"{v} (hash {h})" for v, h in
                 zip(views, allgather_ints(comm, [int(sig[i])], 1)[:, 0])]
    _, odd = minority(views)
    groups = "; ".join(f"{v} on ranks {rs}" for v, rs in _ranks_by(views).items())
    more = f" ({differ.size - 1} more parameters differ after it)" if differ.size > 1 else ""
    raise ParameterMismatchError(
        f"{spec.label()} differs between ranks: {groups}{more}", i, odd or range(comm.size))
