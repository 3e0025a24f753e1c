"""DLPack intake: what is accepted, and what is refused with which message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from wagma_comm import dtypes
from wagma_comm.buffers import as_buffer
from wagma_comm.errors import BufferError, UnsupportedError


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
