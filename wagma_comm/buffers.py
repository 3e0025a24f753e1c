"""DLPack intake: any exporting object -> a :class:`Buffer` view.

Parsing is done by NVIDIA's cuda-core (``StridedMemoryView.from_dlpack``), which
reads address, shape, strides, dtype (bfloat16 included), device and the
read-only flag on host and device alike without needing a GPU. We separate "not
my protocol" (no ``__dlpack__``) from "my protocol but unusable" (strided,
read-only, unsupported dtype, empty, wrong device), and every message names the
argument and what was expected.
"""

from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import dtypes
from .dtypes import DType
from .errors import BufferError, UnsupportedError

# DLPack device types (dlpack.h, DLDeviceType).
DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 1, 2, 3, 13
_HOST_DEVICES = (DL_CPU, DL_CUDA_HOST)
_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan",
                 8: "metal", 10: "rocm", 13: "cuda_managed", 14: "oneapi"}


@dataclass(eq=False, slots=True)
class Buffer:
    """A validated, contiguous view of a user buffer (treat it as read-only;
    not frozen because a frozen dataclass costs a microsecond to make, on
    every collective call).

    ``owner`` is the user's object and ``view`` the parsed memory view; both are
    kept here so the memory stays alive while a collective uses it.
    """

    owner: Any
    view: Any
    address: int | None  # None for a NumPy array: asking it costs microseconds
    count: int
    dtype: DType
    shape: tuple[int, ...]
    device: str  # "cpu" or "cuda"
    device_id: int

    @property
    def ptr(self) -> int:
        """Address of the first element."""
        if self.address is None:
            return int(self.owner.ctypes.data)
        return self.address

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    def host_array(self) -> np.ndarray:
        """A flat writable NumPy view (kernel storage dtype) of host memory."""
        owner = self.owner
        if type(owner) is np.ndarray:
            storage = self.dtype.storage
            if owner.ndim == 1 and owner.dtype == storage:
                return owner
            return owner.reshape(-1).view(storage)
        raw = (ctypes.c_char * self.nbytes).from_address(self.ptr)
        return np.frombuffer(raw, dtype=self.dtype.storage)


def _device_of(obj: Any, argument: str) -> tuple[int, int]:
    try:
        dev_type, dev_id = obj.__dlpack_device__()
        return int(dev_type), int(dev_id)  # inside: ("cpu", 0) is no DLPack device
    except Exception as exc:  # the exporter itself refused
        raise BufferError(argument, f"__dlpack_device__() failed: {_describe(exc)}") from exc


def cuda_device(obj: Any) -> int | None:
    """The CUDA device id of a DLPack buffer, or None for anything else (host
    memory, no DLPack): which path, host or GPU, a collective takes. Managed
    memory goes the GPU way: NCCL and the kernels take its pointers as they
    are, and the host path would refuse it as a GPU buffer."""
    if type(obj) is np.ndarray or not hasattr(obj, "__dlpack_device__"):
        return None
    try:
        dev_type, dev_id = obj.__dlpack_device__()
    except Exception:  # noqa: BLE001 -- as_buffer reports it properly
        return None
    return int(dev_id) if int(dev_type) in (DL_CUDA, DL_CUDA_MANAGED) else None


def _is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None) -> bool:
    if strides is None:
        return True
    expected = 1
    for extent, stride in zip(reversed(shape), reversed(strides)):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


def as_buffer(
    obj: Any,
    argument: str = "buf",
    *,
    writable: bool = True,
    gpu_available: bool = False,
    stream: int | None = None,
) -> Buffer:
    """Validate ``obj`` and return its :class:`Buffer`.

    ``stream``: for a GPU buffer, the stream that will use it (the consumer's
    stream in DLPack's terms). It is passed to ``__dlpack__``, so the producer
    orders its pending work on the buffer before anything we enqueue there.

    Raises :class:`~wagma_comm.errors.BufferError` for anything that is not a
    usable contiguous DLPack buffer, and UnsupportedError for a GPU buffer when
    no GPU transport is available. Nothing is communicated.
    """
    if not hasattr(obj, "__dlpack__") or not hasattr(obj, "__dlpack_device__"):
        raise BufferError(
            argument,
            f"expected an object exporting DLPack (__dlpack__/__dlpack_device__, "
            f"e.g. a NumPy array or a torch tensor), got {type(obj).__name__}",
        )
    if type(obj) is np.ndarray:
        return _from_numpy(obj, argument, writable)
    if isinstance(obj, np.ndarray):  # np.memmap, np.matrix, ...: see _from_numpy_subclass
        return _from_numpy_subclass(obj, argument, writable)
    if writable:
        _refuse_immutable(obj, argument)
    dev_type, dev_id = _device_of(obj, argument)
    if dev_type not in _HOST_DEVICES:
        name = _DEVICE_NAMES.get(dev_type, f"device type {dev_type}")
        if dev_type in (DL_CUDA, DL_CUDA_MANAGED) and not gpu_available:
            raise UnsupportedError(
                argument,
                f"{name}:{dev_id} buffer given but no GPU transport is available "
                "(install the cuda12/cuda13 extra and run on a GPU machine)",
            )
        if dev_type not in (DL_CUDA, DL_CUDA_MANAGED):
            raise UnsupportedError(argument, f"{name} buffers are not supported")
    _refuse_lazy_negation(obj, argument)
    host = dev_type in _HOST_DEVICES
    view = _parse(obj, argument, stream=-1 if host or stream is None else stream)
    try:
        view_dtype = view.dtype
    except Exception as exc:  # a DLPack type code NumPy has no dtype for (float8, ...)
        raise BufferError(
            argument, f"unsupported dtype ({exc}); expected one of {sorted(dtypes.BY_NAME)}"
        ) from exc
    dtype = dtypes.from_numpy(view_dtype)
    if dtype is None:
        raise BufferError(argument, dtypes.unsupported(view_dtype))
    try:  # cuda-core checks the layout lazily: a negative extent raises here
        shape = tuple(int(s) for s in view.shape)
        strides = None if view.strides is None else tuple(int(s) for s in view.strides)
    except Exception as exc:
        raise BufferError(argument, f"unusable DLPack shape/strides: {_describe(exc)}") from exc
    count = math.prod(shape)  # exact (an int64 product wrapped to "empty"); 1 for 0-d
    if count == 0:
        raise BufferError(argument, f"buffer is empty (shape {shape}); nothing to reduce")
    if count * dtype.itemsize > sys.maxsize:
        raise BufferError(argument, f"shape {shape} spans more bytes than memory can hold")
    if not _is_c_contiguous(shape, strides):
        raise BufferError(
            argument,
            f"buffer must be C-contiguous; got shape {shape} with element strides "
            f"{strides} (call .contiguous() / np.ascontiguousarray first)",
        )
    if writable and view.readonly:
        raise BufferError(
            argument, "buffer is read-only but the collective writes its result in place"
        )
    ptr = int(view.ptr)
    if ptr == 0:  # host_array() would silently read and write other memory
        raise BufferError(argument, f"DLPack export has a NULL data pointer for {count} "
                          "elements")
    if not host and ptr % dtype.itemsize:
        # Host buffers are checked where MPI needs it (comm._host_buffer); the
        # training layer copies from unaligned host memory. On the GPU our
        # kernels load whole elements: a misaligned one is a sticky CUDA error
        # that ends the process's context, so refuse it before any launch.
        raise BufferError(
            argument, f"GPU buffer is not aligned to its element size ({dtype.itemsize} bytes "
            f"for {dtype.name}; address {ptr:#x}); pass an aligned copy")
    device = "cpu" if host else "cuda"
    return Buffer(obj, view, ptr, count, dtype, shape, device, dev_id)


def _from_numpy(arr: np.ndarray, argument: str, writable: bool) -> Buffer:
    """NumPy arrays describe themselves (the same facts DLPack would carry), and
    NumPy refuses to export ml_dtypes' bfloat16 through DLPack at all: read the
    array directly. Also the cheapest path for the most common host buffer."""
    dtype = dtypes.from_array(arr)
    if dtype is None:
        raise BufferError(argument, dtypes.unsupported(arr.dtype))
    if arr.size == 0:
        raise BufferError(argument, f"buffer is empty (shape {arr.shape}); nothing to reduce")
    flags = arr.flags
    if not flags.c_contiguous:
        strides = tuple(s // arr.itemsize for s in arr.strides)
        raise BufferError(
            argument,
            f"buffer must be C-contiguous; got shape {arr.shape} with element strides "
            f"{strides} (call .contiguous() / np.ascontiguousarray first)",
        )
    if writable and not flags.writeable:
        raise BufferError(
            argument, "buffer is read-only but the collective writes its result in place"
        )
    return Buffer(arr, arr, None, arr.size, dtype, arr.shape, "cpu", 0)


def _from_numpy_subclass(arr: np.ndarray, argument: str, writable: bool) -> Buffer:
    """An ndarray subclass is read like an ndarray: through DLPack, NumPy
    refuses bfloat16 (so a bfloat16 ``np.memmap`` was refused although NumPy
    bfloat16 arrays are supported). A masked array is refused: the reduction
    would combine the values under its mask as if they were data."""
    ma = sys.modules.get("numpy.ma")  # not imported: no masked array exists
    if ma is not None and isinstance(arr, ma.MaskedArray):
        raise BufferError(argument, "masked arrays are not supported (the mask would be "
                          "ignored and masked values reduced); pass arr.filled(...) or "
                          "arr.data")
    return _from_numpy(arr, argument, writable)


def is_jax_array(obj: Any) -> bool:
    """Whether ``obj`` is a JAX array (by its type's package: no JAX import)."""
    return type(obj).__module__.split(".")[0] in ("jax", "jaxlib")


def _refuse_immutable(obj: Any, argument: str) -> None:
    """JAX arrays are immutable, yet JAX exports them through DLPack (a legacy,
    unversioned capsule) without the read-only flag: writing the result in
    place would change an array JAX assumes constant (a jitted function that
    captured it keeps the old values; ``np.asarray(x)`` is read-only). The
    training layer never writes them (train/bucket.py); refuse them here as
    read-only too."""
    if is_jax_array(obj):
        raise BufferError(argument, "buffer is read-only (JAX arrays are immutable) but the "
                          "collective writes its result in place; pass a writable copy "
                          "(np.array(x)) and convert the result back (jnp.asarray)")


def _refuse_lazy_negation(obj: Any, argument: str) -> None:
    """PyTorch marks some views as lazily negated (``x.conj().imag``) and still
    exports the un-negated memory through DLPack: reducing it would use -x."""
    is_neg = getattr(obj, "is_neg", None)
    if callable(is_neg) and is_neg():
        raise BufferError(argument, "tensor has its negative bit set (a lazily negated "
                          "view); call .resolve_neg() first")


def _parse(obj: Any, argument: str, *, stream: int) -> Any:
    from cuda.core.utils import StridedMemoryView  # deferred: import is not free

    try:
        # -1: no stream ordering (host memory has none); the GPU path passes
        # its own stream, which the producer then makes wait for its work.
        return StridedMemoryView.from_dlpack(obj, stream_ptr=stream)
    except Exception as exc:
        raise BufferError(argument, f"DLPack export failed: {_describe(exc)}") from exc


def _describe(exc: BaseException) -> str:
    """An exception's message, or its type where it has none (cuda-core's bare
    AssertionError for a CPU device id other than 0 read "failed: ")."""
    return str(exc) or f"{type(exc).__name__} (no message)"
