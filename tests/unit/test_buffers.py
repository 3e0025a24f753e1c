"""DLPack intake: what is accepted, and what is refused with which message."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from wagma_comm import dtypes
from wagma_comm.buffers import as_buffer
from wagma_comm.errors import BufferError, InvalidArgumentError, UnsupportedError


@pytest.mark.parametrize("name", sorted(dtypes.BY_NAME))
def test_numpy_every_dtype(name: str) -> None:
    dt = dtypes.BY_NAME[name]
    a = np.arange(6).astype(dt.numpy).reshape(2, 3)
    b = as_buffer(a)
    assert (b.count, b.dtype, b.shape, b.device) == (6, dt, (2, 3), "cpu")
    assert b.host_array().ctypes.data == a.ctypes.data
    np.testing.assert_array_equal(b.host_array(), a.reshape(-1).view(dt.storage))


@pytest.mark.parametrize("tdt,name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"),
                                      (torch.float32, "float32"), (torch.int64, "int64"),
                                      (torch.uint8, "uint8")])
def test_torch_tensors_share_memory(tdt: torch.dtype, name: str) -> None:
    t = torch.arange(10).to(tdt)
    b = as_buffer(t)
    assert b.dtype.name == name and b.ptr == t.data_ptr()
    b.host_array()[:] = 0  # writes land in the tensor
    assert bool((t == 0).all())


def test_numpy_bfloat16_via_ml_dtypes() -> None:
    """NumPy cannot export ml_dtypes' bfloat16 through DLPack; intake reads the
    array's own metadata instead."""
    a = np.arange(5, dtype=np.float32).astype(dtypes.BFLOAT16.numpy)
    b = as_buffer(a)
    assert b.dtype is dtypes.BFLOAT16 and b.ptr == a.ctypes.data


def test_zero_dim_tensor_is_one_element() -> None:
    assert as_buffer(torch.tensor(3.0)).count == 1


def _raises(obj: object, exc: type, text: str, **kw: object) -> None:
    with pytest.raises(exc) as info:
        as_buffer(obj, "grads", **kw)
    assert info.value.argument == "grads"
    assert text in str(info.value)


def test_no_dlpack() -> None:
    _raises([1.0, 2.0], BufferError, "expected an object exporting DLPack")


def test_strided_numpy() -> None:
    _raises(np.arange(10.0)[::2], BufferError, "C-contiguous")


def test_fortran_order() -> None:
    _raises(np.asfortranarray(np.ones((3, 4))), BufferError, "C-contiguous")


def test_transposed_tensor() -> None:
    _raises(torch.ones(3, 4).t(), BufferError, "C-contiguous")


def test_read_only() -> None:
    a = np.ones(4)
    a.flags.writeable = False
    _raises(a, BufferError, "read-only")
    assert as_buffer(a, writable=False).count == 4


def test_empty() -> None:
    _raises(np.ones((3, 0)), BufferError, "empty")


@pytest.mark.parametrize("dt", [np.complex64, np.int16, np.uint32, np.int8])
def test_unsupported_dtype(dt: type) -> None:
    _raises(np.zeros(3, dtype=dt), BufferError, "unsupported dtype")


def test_requires_grad() -> None:
    _raises(torch.ones(3, requires_grad=True), BufferError, "DLPack export failed")


class _CudaExporter:
    """Claims to live on a CUDA device: intake must refuse it before parsing."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    def __dlpack__(self, **_: object) -> object:
        raise AssertionError("must not be parsed without a GPU transport")


def test_gpu_buffer_without_gpu_transport() -> None:
    _raises(_CudaExporter(), UnsupportedError, "no GPU transport")


def test_jax_arrays_are_refused_as_read_only() -> None:
    """JAX arrays are immutable but JAX's DLPack export carries no read-only
    flag: intake must not hand their memory to a collective that writes in
    place (it did: a jitted function that captured the array then disagreed
    with the array itself). Reading them (writable=False) stays allowed."""
    pytest.importorskip("jax")
    # In a child process: JAX starts threads, and later tests in this
    # process fork (tests/unit/test_shm_board.py).
    code = (
        "import jax.numpy as jnp\n"
        "from wagma_comm.buffers import as_buffer\n"
        "from wagma_comm.errors import BufferError\n"
        "x = jnp.arange(4, dtype=jnp.float32)\n"
        "try:\n"
        "    as_buffer(x, 'buf')\n"
        "except BufferError as e:\n"
        "    assert e.argument == 'buf' and 'read-only' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('accepted a JAX array as writable')\n"
        "b = as_buffer(x, 'grads', writable=False)\n"
        "assert b.count == 4 and b.host_array().tolist() == [0, 1, 2, 3]\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_bfloat16_ndarray_subclass_is_accepted(tmp_path: Path) -> None:
    """An ndarray subclass (np.memmap here) of bfloat16 is a NumPy bfloat16
    array, which the docs accept; through DLPack NumPy refuses bfloat16, so
    intake must read the array's own metadata as for a plain ndarray."""
    m = np.memmap(str(tmp_path / "m.bin"), dtype=dtypes.BFLOAT16.numpy, mode="w+", shape=(2, 3))
    m[:] = 1.5
    b = as_buffer(m, "grads")
    assert (b.dtype, b.count, b.shape) == (dtypes.BFLOAT16, 6, (2, 3))
    assert b.ptr == m.ctypes.data
    assert b.host_array().tolist() == [0x3FC0] * 6  # 1.5 in bfloat16
    b.host_array()[:] = 0x4000  # 2.0: writes land in the memmap
    assert m.astype(np.float32).tolist() == [[2.0] * 3] * 2
    ro = np.memmap(str(tmp_path / "m.bin"), dtype=np.float32, mode="r", shape=(3,))
    _raises(ro, BufferError, "read-only")
    _raises(np.ones((3, 4), np.float32).view(np.memmap)[:, 1], BufferError, "C-contiguous")


def test_masked_array_is_refused() -> None:
    """A masked array would be reduced as its raw data, masked values included."""
    a = np.ma.masked_array(np.ones(4, np.float32), mask=[0, 1, 0, 0])
    _raises(a, BufferError, "masked")


# -- hand-made DLPack capsules: fields no NumPy array or torch tensor exports ----------
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # left NULL: nothing to free


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _Capsules:
    """Exports float32 memory of ``base`` with the DLPack fields given (a
    versioned capsule when the consumer asks with max_version >= 1.0)."""

    def __init__(self, base: np.ndarray, shape: tuple[int, ...], *,
                 strides: tuple[int, ...] | None = None, byte_offset: int = 0,
                 data: int | None = None, device: tuple[object, object] = (1, 0),
                 readonly: bool = False, capsule_device: int = 1) -> None:
        self.base, self.shape, self.strides = base, shape, strides
        self.capsule_device = capsule_device  # the DLDevice type inside the capsule
        self.byte_offset, self.readonly, self.device = byte_offset, readonly, device
        self.data = base.ctypes.data if data is None else data
        self._alive: list[object] = []  # the structs the capsules point into

    def __dlpack_device__(self) -> tuple[object, object]:
        return self.device

    def __dlpack__(self, *, stream: object = None, max_version: tuple[int, int] | None = None,
                   dl_device: object = None, copy: object = None) -> object:
        n = max(1, len(self.shape))
        shape = (ctypes.c_int64 * n)(*self.shape)
        strides = None if self.strides is None else (ctypes.c_int64 * n)(*self.strides)
        t = _DLTensor(self.data, _DLDevice(self.capsule_device, int(self.device[1])),
                      len(self.shape),
                      _DLDataType(2, 32, 1), ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)),
                      None if strides is None
                      else ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)),
                      self.byte_offset)
        if max_version is not None and max_version[0] >= 1:
            m: ctypes.Structure = _DLManagedTensorVersioned(
                1, 0, None, _DELETER(), int(self.readonly), t)
            name = b"dltensor_versioned"
        else:
            m, name = _DLManagedTensor(t, None, _DELETER()), b"dltensor"
        self._alive += [shape, strides, m]
        return _capsule_new(ctypes.addressof(m), name, None)


def test_dlpack_capsule_fields_are_honoured() -> None:
    """byte_offset moves the first element, the versioned read-only flag is
    respected, a 0-d capsule is one element and NULL strides mean C order."""
    base = np.arange(8, dtype=np.float32)
    b = as_buffer(_Capsules(base, (4,), byte_offset=8), "grads")
    assert (b.ptr - base.ctypes.data, b.count) == (8, 4)
    assert b.host_array().tolist() == [2, 3, 4, 5]
    assert as_buffer(_Capsules(base, ()), "grads").count == 1
    assert as_buffer(_Capsules(base, (2, 4)), "grads").shape == (2, 4)
    _raises(_Capsules(base, (4,), readonly=True), BufferError, "read-only")
    assert as_buffer(_Capsules(base, (4,), readonly=True), writable=False).count == 4


@pytest.mark.parametrize("kw,text", [
    # cuda-core checks extents lazily: a raw ValueError escaped from view.shape
    ({"shape": (-4,)}, "shape/strides"),
    # the element count was an int64 product, which wrapped to 0: "empty"
    ({"shape": (2**32, 2**32)}, "more bytes than memory"),
    # accepted; host_array() then wrote somewhere else entirely
    ({"shape": (4,), "data": 0}, "NULL data pointer"),
    # int("cpu") raised a raw ValueError outside the exporter's try-block
    ({"shape": (4,), "device": ("cpu", 0)}, "__dlpack_device__() failed"),
    # cuda-core asserts a CPU device id of 0: the message ended "failed: "
    ({"shape": (4,), "device": (1, 5)}, "AssertionError"),
])
def test_broken_dlpack_exports_are_buffer_errors(kw: dict[str, Any], text: str) -> None:
    """An exporter's impossible shape, NULL pointer or device is refused as a
    BufferError naming the argument, with a message that says what is wrong."""
    shape = kw.pop("shape")
    _raises(_Capsules(np.arange(8, dtype=np.float32), shape, **kw), BufferError, text)


def test_a_gpu_buffer_not_aligned_to_its_element_size_is_refused() -> None:
    """A CUDA export (a CuPy array made at pointer+2 bytes, say) reached NCCL
    and our kernels, whose misaligned loads are a sticky CUDA error. The
    capsule says CUDA; cuda-core parses it without a GPU, and the check comes
    before anything touches the memory."""
    base = np.zeros(16, dtype=np.float32)

    def cuda(offset: int) -> _Capsules:
        return _Capsules(base, (4,), data=base.ctypes.data + offset, device=(2, 0),
                         capsule_device=2)

    assert as_buffer(cuda(4), "grads", gpu_available=True).device == "cuda"
    with pytest.raises(BufferError, match="not aligned to its element size") as info:
        as_buffer(cuda(2), "grads", gpu_available=True)
    assert info.value.argument == "grads"


@pytest.mark.parametrize("bad", [None, {"names": ["a", "b"], "formats": ["f4"]},
                                 [("a", "f4"), ("a", "f4")], ("f4", -1)])
def test_dtype_lookup_of_odd_objects_is_a_typed_error(bad: object) -> None:
    """``lookup(None)`` answered float64 (NumPy's default dtype) and objects
    NumPy refuses with ValueError escaped raw instead of naming the argument."""
    assert dtypes.from_numpy(bad) is None
    with pytest.raises(InvalidArgumentError) as info:
        dtypes.lookup(bad, "--dtype")
    assert info.value.argument == "--dtype"


def test_use_local_gpu_without_a_gpu_names_the_device() -> None:
    """On a rank that sees no GPU, ``use_local_gpu`` divided by the device
    count: a bare ZeroDivisionError. (A child process that really sees none.)"""
    code = (
        "from wagma_comm.torch_views import use_local_gpu\n"
        "from wagma_comm.errors import UnsupportedError\n"
        "try:\n"
        "    use_local_gpu()\n"
        "except UnsupportedError as e:\n"
        "    print(e.argument, 'no CUDA device' in str(e))\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.stdout.strip() == "device True", done.stderr[-2000:]
