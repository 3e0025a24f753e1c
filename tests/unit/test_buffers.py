"""DLPack intake: what is accepted, and what is refused with which message."""

from __future__ import annotations

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
