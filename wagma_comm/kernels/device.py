"""Device kernels: cuda/wagma_kernels.cu loaded with CuPy RawModule (NVRTC).

Every launch goes on a stream the caller names (the communicator's own stream),
so kernels order with the NCCL calls around them without any host wait. The
16-byte vector variant of a kernel is used when every pointer it touches is
16-byte aligned; otherwise the element-wise variant, so any length and any
offset works (a slot of a schedule can start anywhere in the buffer).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..dtypes import DType
from ..errors import InvalidArgumentError, UnsupportedError

SOURCE = Path(__file__).resolve().parents[2] / "cuda" / "wagma_kernels.cu"

_CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float",
          "float64": "double", "int32": "wagma::i32", "int64": "wagma::i64",
          "uint8": "wagma::u8"}
_OP_CODE = {"sum": 0, "prod": 1, "max": 2, "min": 3}
_AVERAGE_TYPES = ("float16", "bfloat16", "float32", "float64")
_THREADS = 256
_MAX_POINTER_CACHE = 256


def _reduce_name(dtype: str, op: int, vec: bool) -> str:
    return f"wagma::reduce_into<{_CTYPE[dtype]}, {op}, {'true' if vec else 'false'}>"


def _scale_name(dtype: str, vec: bool) -> str:
    return f"wagma::scale_by<{_CTYPE[dtype]}, {'true' if vec else 'false'}>"


def _average_name(dtype: str, vec: bool) -> str:
    return f"wagma::average_of<{_CTYPE[dtype]}, {'true' if vec else 'false'}>"


def _all_names() -> list[str]:
    names = []
    for dt in _CTYPE:
        for vec in (True, False):
            names.extend(_reduce_name(dt, code, vec) for code in _OP_CODE.values())
            names.append(_scale_name(dt, vec))
            if dt in _AVERAGE_TYPES:
                names.append(_average_name(dt, vec))
    return names


def _aligned(*pointers: int) -> bool:
    return all(p % 16 == 0 for p in pointers)


class DeviceKernels:
    """The compiled module for one device, and launchers for its kernels.

    Launchers take raw device addresses (ints) and element counts, so the
    runtime can address any slot of a buffer; they never synchronize."""

    def __init__(self, device_id: int = 0) -> None:
        import cupy

        self._cp = cupy
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            self._module = cupy.RawModule(
                code=SOURCE.read_text(), options=("-std=c++17",),
                name_expressions=_all_names())
            self._sms = cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]
        self._functions: dict[str, Any] = {}
        self._pointer_arrays: dict[tuple[int, tuple[int, ...]], Any] = {}
        self._lock = threading.Lock()

    def _fn(self, name: str) -> Any:
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = self._module.get_function(name)
        return fn

    def _grid(self, count: int, dtype: DType, vec: bool) -> tuple[int]:
        """Blocks for ``count`` elements: one thread per 16-byte vector (or
        element), at most enough to fill the chip several times over (the
        kernels are grid-stride loops; more would only add scheduling work)."""
        items = max(1, count // (16 // dtype.itemsize) if vec else count)
        return (max(1, min((items + _THREADS - 1) // _THREADS, self._sms * 16)),)

    def reduce(self, dst: int, src: int, count: int, op: str, dtype: DType,
               stream: Any) -> None:
        """``dst[:count] = op(dst, src)`` on ``stream``."""
        code = _OP_CODE.get(op)
        if code is None:
            raise InvalidArgumentError("op", f"device reduce has no op {op!r}; "
                                       f"expected one of {list(_OP_CODE)}")
        if count <= 0:
            return
        vec = _aligned(dst, src)
        fn = self._fn(_reduce_name(dtype.name, code, vec))
        fn(self._grid(count, dtype, vec), (_THREADS,),
           (np.uint64(dst), np.uint64(src), np.uint64(count)), stream=stream)

    def scale(self, dst: int, count: int, divisor: int, dtype: DType, stream: Any) -> None:
        """``dst[:count] /= divisor`` (floor division for integers) on ``stream``."""
        if count <= 0 or divisor == 1:
            return
        vec = _aligned(dst)
        self._fn(_scale_name(dtype.name, vec))(
            self._grid(count, dtype, vec), (_THREADS,),
            (np.uint64(dst), np.uint64(count), np.float64(divisor)), stream=stream)

    def average(self, out: int, inputs: Sequence[int], count: int, divisor: float,
                dtype: DType, stream: Any) -> None:
        """The fused average ``out = sum(inputs) / divisor`` in one pass
        (float32 accumulation for 16-bit floats). ``out`` may be one of the
        inputs."""
        if dtype.name not in _AVERAGE_TYPES:
            raise UnsupportedError("dtype", f"the fused average takes floating types "
                                   f"{list(_AVERAGE_TYPES)}, got {dtype.name}")
        if not inputs:
            raise InvalidArgumentError("inputs", "expected at least one input")
        if count <= 0:
            return
        table = self._pointer_array(tuple(int(p) for p in inputs), stream)
        vec = _aligned(out, *inputs)
        self._fn(_average_name(dtype.name, vec))(
            self._grid(count, dtype, vec), (_THREADS,),
            (np.uint64(out), table, np.int32(len(inputs)), np.uint64(count),
             np.float64(divisor)), stream=stream)

    def copy_segments(self, dsts: Sequence[int], srcs: Sequence[int],
                      sizes: Sequence[int], stream: Any) -> None:
        """Copy ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` for every i
        in one launch: packs tensors into a flat buffer, or unpacks it."""
        if not (len(dsts) == len(srcs) == len(sizes)):
            raise InvalidArgumentError("sizes", "dsts, srcs and sizes differ in length")
        if not sizes or max(sizes) == 0:
            return
        if len(sizes) > 65535:
            raise UnsupportedError("srcs", f"{len(sizes)} segments in one copy; at most 65535")
        tables = [self._pointer_array(tuple(int(x) for x in seq), stream)
                  for seq in (dsts, srcs, sizes)]
        blocks = max(1, min((max(sizes) // 16 + _THREADS - 1) // _THREADS, self._sms * 4))
        self._fn("copy_segments")((blocks, len(sizes)), (_THREADS,), tuple(tables),
                                  stream=stream)

    def _pointer_array(self, values: tuple[int, ...], stream: Any) -> Any:
        """A device copy of ``values`` (uint64) for kernels on ``stream``,
        cached: a trainer passes the same buffers every iteration, so the copy
        happens once. One table per stream: its copy is queued on ``stream``
        and its memory is in that stream's pool, so a kernel on another stream
        could read it before the copy ran, or after an eviction let the pool
        hand it out again."""
        key = (int(stream.ptr), values)
        with self._lock:
            table = self._pointer_arrays.get(key)
            if table is None:
                if len(self._pointer_arrays) >= _MAX_POINTER_CACHE:
                    self._pointer_arrays.clear()
                with self._cp.cuda.Device(self.device_id), stream:
                    table = self._cp.asarray(np.array(values, dtype=np.uint64))
                self._pointer_arrays[key] = table
            return table


_KERNELS: dict[int, DeviceKernels] = {}
_KERNELS_LOCK = threading.Lock()


def kernels(device_id: int = 0) -> DeviceKernels:
    """The (lazily compiled) kernels of ``device_id``, one module per device."""
    with _KERNELS_LOCK:
        k = _KERNELS.get(device_id)
        if k is None:
            k = _KERNELS[device_id] = DeviceKernels(device_id)
        return k
