"""The scratch pool stays bounded however the sizes vary (runtime/pool.py)."""

from __future__ import annotations

import numpy as np

from wagma_comm.runtime import pool


def _arr(nbytes: int) -> np.ndarray:
    return np.empty(nbytes // 4, np.float32)


def test_reuses_the_same_large_array() -> None:
    p = pool.ScratchPool()
    a = _arr(pool.MIN_BYTES)
    p.give(a)
    assert p.take(np.float32, a.size) is a
    assert p.nbytes == 0
    assert p.take(np.float32, a.size) is not a  # nothing left: a fresh one


def test_small_arrays_are_not_kept() -> None:
    p = pool.ScratchPool()
    p.give(_arr(pool.MIN_BYTES - 4))
    assert p.nbytes == 0


def test_at_most_per_size_arrays_of_one_size() -> None:
    p = pool.ScratchPool()
    for _ in range(pool.PER_SIZE + 3):
        p.give(_arr(pool.MIN_BYTES))
    assert p.nbytes == pool.PER_SIZE * pool.MIN_BYTES


def test_many_sizes_evict_the_least_recently_used() -> None:
    p = pool.ScratchPool()
    sizes = [pool.MIN_BYTES + 4 * k for k in range(3 * pool.SIZES)]
    for nbytes in sizes:
        p.give(_arr(nbytes))
    kept = sum(sizes[-pool.SIZES:])
    assert p.nbytes == kept
    oldest = sizes[0] // 4
    assert p.take(np.float32, oldest).base is None  # fresh: was evicted
    newest = p.take(np.float32, sizes[-1] // 4)
    assert p.nbytes == kept - newest.nbytes


def test_byte_limit(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(pool, "LIMIT_BYTES", 3 * pool.MIN_BYTES)
    p = pool.ScratchPool()
    for k in range(6):
        p.give(_arr(pool.MIN_BYTES + 4 * k))
    assert p.nbytes <= 3 * pool.MIN_BYTES
