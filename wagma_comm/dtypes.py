"""One table of the element types wagma_comm reduces.

Each :class:`DType` row ties together the names the layers use for one type:
the DLPack (code, bits) pair buffers arrive with, the NumPy dtype that views the
memory, the NumPy dtype kernels compute on (float16/bfloat16 are handled as
uint16 bit patterns, since neither NumPy nor numba does bfloat16 arithmetic),
the MPI datatype for native MPI reductions and the NCCL enum value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .errors import InvalidArgumentError

# DLPack type codes (dlpack.h, DLDataTypeCode).
DL_INT, DL_UINT, DL_FLOAT, DL_BFLOAT = 0, 1, 2, 4


@dataclass(frozen=True)
class DType:
    name: str
    dl_code: int
    bits: int
    numpy: np.dtype  # how the memory is viewed by NumPy-aware callers
    storage: np.dtype  # what kernels compute on (uint16 for 16-bit floats)
    mpi_name: str | None  # mpi4py datatype attribute; None: MPI cannot reduce it
    nccl: int  # ncclDataType_t value
    is_float: bool

    @property
    def itemsize(self) -> int:
        return self.bits // 8

    @property
    def is_half(self) -> bool:
        """float16 or bfloat16: kernels widen to float32 and round back (RNE)."""
        return self.is_float and self.bits == 16


def _row(name: str, code: int, bits: int, npdt: Any, storage: Any, mpi: str | None,
         nccl: int) -> DType:
    return DType(name, code, bits, np.dtype(npdt), np.dtype(storage), mpi, nccl,
                 code in (DL_FLOAT, DL_BFLOAT))


FLOAT16 = _row("float16", DL_FLOAT, 16, np.float16, np.uint16, None, 6)
BFLOAT16 = _row("bfloat16", DL_BFLOAT, 16, ml_dtypes.bfloat16, np.uint16, None, 9)
FLOAT32 = _row("float32", DL_FLOAT, 32, np.float32, np.float32, "FLOAT", 7)
FLOAT64 = _row("float64", DL_FLOAT, 64, np.float64, np.float64, "DOUBLE", 8)
INT32 = _row("int32", DL_INT, 32, np.int32, np.int32, "INT32_T", 2)
INT64 = _row("int64", DL_INT, 64, np.int64, np.int64, "INT64_T", 4)
UINT8 = _row("uint8", DL_UINT, 8, np.uint8, np.uint8, "UINT8_T", 1)

ALL: tuple[DType, ...] = (FLOAT16, BFLOAT16, FLOAT32, FLOAT64, INT32, INT64, UINT8)
BY_NAME: dict[str, DType] = {d.name: d for d in ALL}
_BY_DL: dict[tuple[int, int], DType] = {(d.dl_code, d.bits): d for d in ALL}
_BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in ALL}

OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "prod")


def from_dlpack_code(code: int, bits: int, lanes: int = 1) -> DType | None:
    """The row for a DLPack (code, bits, lanes) triple, or None if unsupported."""
    if lanes != 1:
        return None
    return _BY_DL.get((code, bits))


def from_numpy(dtype: Any) -> DType | None:
    """The row for a NumPy dtype (bfloat16 via ml_dtypes), or None. None is
    no dtype here (``np.dtype(None)`` would make it float64), and what NumPy
    cannot read as a dtype (TypeError, or ValueError for e.g. a bad field
    list) is unsupported, not an error of its own."""
    if dtype is None:
        return None
    try:
        return _BY_NUMPY.get(np.dtype(dtype))
    except (TypeError, ValueError):
        return None


def from_array(arr: np.ndarray) -> DType | None:
    """The row for a NumPy array's dtype, or None: :func:`from_numpy` without
    the dtype conversion (once per collective call)."""
    return _BY_NUMPY.get(arr.dtype)


def unsupported(dtype: Any) -> str:
    """Why a buffer of ``dtype`` is refused (a BufferError's text): its name
    and the supported ones. A supported type in non-native byte order
    (``'>f4'``) says so: its bytes are not the numbers the kernels and MPI
    would read, and "unsupported dtype >f4; expected ... float32" read as a
    contradiction."""
    text = f"unsupported dtype {dtype}"
    try:
        native = np.dtype(dtype).newbyteorder("=")
    except (TypeError, ValueError):
        native = None
    if native is not None and native != dtype and from_numpy(native) is not None:
        text += (f" ({native.name} in non-native byte order, which would be reduced as "
                 "other numbers; pass x.astype(x.dtype.newbyteorder('=')))")
    return f"{text}; expected one of {sorted(BY_NAME)}"


def lookup(name: str | DType, argument: str = "dtype") -> DType:
    """Resolve a dtype given by name (``"bfloat16"``) or row; typed error otherwise."""
    if isinstance(name, DType):
        return name
    row = BY_NAME.get(str(name))
    if row is None:
        row = from_numpy(name) if not isinstance(name, str) else None
    if row is None:
        raise InvalidArgumentError(
            argument, f"unsupported dtype {name!r}; expected one of {sorted(BY_NAME)}"
        )
    return row


def check_op(op: Any, argument: str = "op") -> str:
    """Validate a reduction name; returns it."""
    if not isinstance(op, str) or op not in OPS:
        raise InvalidArgumentError(argument, f"unknown op {op!r}; expected one of {list(OPS)}")
    return op
