"""Reuse of the engine's scratch arrays.

Why: a fresh large allocation is page-faulted on first touch, every call; a
training loop reduces the same few bucket sizes over and over, so keeping
their scratch arrays saves that. But a job whose sizes vary (a benchmark sweep,
a stress run) must not grow without bound: the pool keeps only arrays of at
least ``MIN_BYTES`` (small ones come cheaply from malloc's arena), at most
``PER_SIZE`` arrays of a size, the ``SIZES`` most recently used sizes, and
``LIMIT_BYTES`` in all, evicting the least recently used size first.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

MIN_BYTES = 64 << 10
PER_SIZE = 4
SIZES = 16
LIMIT_BYTES = 512 << 20


class ScratchPool:
    """take() an array of (dtype, count); give() it back when done."""

    def __init__(self) -> None:
        self._free: OrderedDict[tuple[np.dtype, int], list[np.ndarray]] = OrderedDict()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes held for reuse."""
        return self._bytes

    def take(self, dtype: np.dtype, count: int) -> np.ndarray:
        key = (np.dtype(dtype), count)
        stack = self._free.get(key)
        if stack:
            arr = stack.pop()
            self._bytes -= arr.nbytes
            if not stack:
                del self._free[key]
            return arr
        return np.empty(count, dtype=dtype)

    def give(self, arr: np.ndarray) -> None:
        if arr.nbytes < MIN_BYTES or arr.nbytes > LIMIT_BYTES:
            return
        key = (arr.dtype, arr.size)
        stack = self._free.setdefault(key, [])
        self._free.move_to_end(key)
        if len(stack) >= PER_SIZE:
            return
        stack.append(arr)
        self._bytes += arr.nbytes
        while len(self._free) > SIZES or self._bytes > LIMIT_BYTES:
            _, evicted = self._free.popitem(last=False)
            self._bytes -= sum(a.nbytes for a in evicted)


__all__ = ["ScratchPool", "MIN_BYTES", "PER_SIZE", "SIZES", "LIMIT_BYTES"]
