"""The few data operations a partial collective's rounds need, for host memory.

The rounds' logic (partial/base.py, wagma.py, eager.py) is written once against
this interface; partial/device.py gives the same operations on GPU memory (our
CUDA kernels on a stream), so WAGMA, solo and majority run unchanged on either.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..dtypes import DType
from ..kernels import host as host_kernels


class HostMemory:
    """NumPy arrays; every operation is complete when it returns."""

    def __init__(self, dtype: DType) -> None:
        self.dtype = dtype

    def empty(self, count: int) -> np.ndarray:
        return np.empty(count, dtype=self.dtype.storage)

    def zeros(self, count: int) -> np.ndarray:
        return np.zeros(count, dtype=self.dtype.storage)

    def clone(self, src: np.ndarray) -> np.ndarray:
        return np.array(src, copy=True)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def zero(self, dst: np.ndarray) -> None:
        dst.fill(0)

    def add(self, dst: np.ndarray, src: np.ndarray) -> None:
        """``dst += src`` (integers wrap)."""
        host_kernels.reduce_into(dst, src, "sum", self.dtype)

    def average(self, out: np.ndarray, parts: Sequence[np.ndarray], divisor: int) -> None:
        """``out = sum(parts) / divisor`` (host_kernels.average_into)."""
        host_kernels.average_into(out, parts, divisor, self.dtype)

    def set_flags(self, flags: np.ndarray, index: int | None, one: Any) -> None:
        """Zero the member flags, then set ``index``'s to ``one`` (if any)."""
        flags.fill(0)
        if index is not None:
            flags[index] = one

    def warm(self) -> None:
        """Run ``add`` and ``average`` once, on one element, at creation. Why:
        the first use of a numba kernel compiles it (0.3-0.7 s each without
        numba's disk cache); later that happened inside ``step()`` under the
        collective's lock, or on the progress thread during a round (the
        engine's sum is the same kernel), holding up peers that may time out."""
        one = self.zeros(1)
        self.add(one, one)
        self.average(one, [one], 1)

    def to_host(self, arr: np.ndarray) -> np.ndarray:
        return arr

    def settle(self) -> None:
        """Wait until every operation issued so far is done (nothing to wait for)."""
