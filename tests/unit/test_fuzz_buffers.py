"""Property-based tests of DLPack intake (``wagma_comm.buffers.as_buffer``).

Arrays and tensors of random shapes (0-d and empty included), layouts (sliced
with steps, transposed, negative and zero strides, extent-1 axes with odd
strides) and dtypes go in. The expected outcome is worked out here from first
principles, never by asking the library: accepted exactly when the dtype is one
the library reduces, the buffer is non-empty, its elements are laid out densely
in C order, and it is writable (when a writable buffer is asked for). Accepted
buffers must describe the object and alias its memory; refused ones must raise
a typed error naming the argument.
"""

from __future__ import annotations

import array
import math
import string
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

from wagma_comm import BufferError, UnsupportedError
from wagma_comm.buffers import Buffer, as_buffer

try:
    import ml_dtypes
except ImportError:  # optional here: numpy bfloat16 cases are then skipped
    ml_dtypes = None

# Deterministic in CI (derandomize), no example database written into the tree.
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

# -- the expected dtype tables (written out here, not read from wagma_comm.dtypes) --
# element dtype -> the name intake must report
_NP_SUPPORTED: dict[np.dtype, str] = {
    np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
    np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64",
    np.dtype(np.uint8): "uint8",
}
if ml_dtypes is not None:
    _NP_SUPPORTED[np.dtype(ml_dtypes.bfloat16)] = "bfloat16"

# name -> the dtype host_array() must have (the 16-bit floats are documented to
# be handed to kernels as their uint16 bit patterns)
_STORAGE: dict[str, np.dtype] = {
    "float16": np.dtype(np.uint16), "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32), "float64": np.dtype(np.float64),
    "int32": np.dtype(np.int32), "int64": np.dtype(np.int64), "uint8": np.dtype(np.uint8),
}

_NP_UNSUPPORTED: list[np.dtype] = [np.dtype(d) for d in (
    np.complex64, np.complex128, np.bool_, np.int8, np.int16, np.uint16, np.uint32,
    np.uint64, np.longdouble, "M8[ns]",
    # Non-native byte order: same kind and width as a supported type, but the
    # bytes are not what a reduction kernel or MPI expects.
    ">f2", ">f4", ">f8", ">i4", ">i8",
)]
if ml_dtypes is not None:
    _NP_UNSUPPORTED.append(np.dtype(ml_dtypes.float8_e4m3fn))
if np.dtype(np.longdouble) == np.dtype(np.float64):  # platforms where they coincide
    _NP_UNSUPPORTED.remove(np.dtype(np.longdouble))

_TORCH_SUPPORTED: dict[torch.dtype, str] = {
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
    torch.float64: "float64", torch.int32: "int32", torch.int64: "int64",
    torch.uint8: "uint8",
}
_TORCH_UNSUPPORTED: list[torch.dtype] = [
    torch.bool, torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64,
    torch.complex64, torch.complex128,
    # float8 (refused with BufferError since test_torch_float8_is_refused_with_buffer_error)
    *(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)),
]

# Mostly non-empty shapes (empty ones also arise from slicing), 0-d included.
_SHAPES = array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=5) | array_shapes(
    min_dims=1, max_dims=3, min_side=0, max_side=3)
# Layout changes applied in turn; views (which keep or break density) outweigh
# the copies that make a fresh dense buffer again.
_STEPS = ("slice", "slice", "transpose", "transpose", "axis", "axis", "copy", "flat")
_ARGUMENTS = st.text(alphabet=string.ascii_letters + "_", min_size=1, max_size=12)


# -- the oracle --------------------------------------------------------------------
def dense_c_order(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Brute force: the byte offsets of the elements, visited in C index order,
    are exactly 0, itemsize, 2*itemsize, ... (so every element is where a
    C-contiguous buffer of this shape keeps it). Only meaningful when non-empty."""
    if not shape:
        return True
    grids = np.indices(shape).reshape(len(shape), -1)
    offsets = (grids * np.asarray(strides, dtype=np.int64)[:, None]).sum(axis=0)
    return bool(np.array_equal(offsets, np.arange(math.prod(shape)) * itemsize))


@dataclass(frozen=True)
class Expected:
    """Why intake must refuse the object (empty set: it must accept it)."""

    reasons: frozenset[str]
    name: str | None  # expected dtype name when supported


# Words the error message uses for each reason (one of the reasons present must
# be named: the library reports the first problem it finds).
_REASON_WORDS = {"dtype": "dtype", "empty": "empty", "strided": "contiguous",
                 "readonly": "read-only", "grad": "DLPack export failed"}


def expect(name: str | None, shape: tuple[int, ...], strides: tuple[int, ...],
           itemsize: int, readonly: bool, writable: bool, grad: bool = False) -> Expected:
    reasons = set()
    if name is None:
        reasons.add("dtype")
    if math.prod(shape) == 0:
        reasons.add("empty")
    elif not dense_c_order(shape, strides, itemsize):
        reasons.add("strided")
    if readonly and writable:
        reasons.add("readonly")
    if grad:
        reasons.add("grad")
    return Expected(frozenset(reasons), name)


def check_refused(obj: Any, argument: str, exp: Expected, **kw: Any) -> None:
    event("refused: " + "+".join(sorted(exp.reasons)))
    with pytest.raises((BufferError, UnsupportedError)) as info:
        as_buffer(obj, argument, **kw)
    assert info.value.argument == argument
    message = str(info.value)
    assert any(_REASON_WORDS[r] in message for r in exp.reasons), (exp.reasons, message)


def check_accepted(buf: Buffer, obj: Any, exp: Expected, ptr: int, itemsize: int,
                   raw_bytes: Callable[[], bytes], can_write: bool) -> None:
    """``buf`` describes ``obj``, and host_array() is a flat alias of its memory."""
    event(f"accepted ({'writable' if can_write else 'read-only'})")
    count = math.prod(tuple(obj.shape))  # 1 for a 0-d object
    assert isinstance(buf, Buffer)
    assert buf.dtype.name == exp.name
    assert buf.shape == tuple(obj.shape)
    assert buf.count == count and buf.nbytes == count * itemsize
    assert buf.ptr == ptr and buf.device == "cpu"
    host = buf.host_array()
    assert host.ndim == 1 and host.size == count
    assert host.dtype == _STORAGE[exp.name]
    assert host.ctypes.data == ptr
    assert host.view(np.uint8).tobytes() == raw_bytes()
    if can_write:  # flip every bit through the view: the object must see each change
        flipped = ~np.frombuffer(raw_bytes(), dtype=np.uint8)
        host.view(np.uint8)[:] = flipped
        assert raw_bytes() == flipped.tobytes()


# -- NumPy -------------------------------------------------------------------------
def _np_base(dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    values = np.arange(math.prod(shape)) % 100
    return values.astype(dtype).reshape(shape)


@st.composite
def numpy_arrays(draw: st.DrawFn) -> np.ndarray:
    """A fresh array reshaped, sliced, transposed, broadcast or copied a few times,
    and possibly made read-only."""
    dtype = draw(st.sampled_from(sorted(_NP_SUPPORTED, key=str))
                 | st.sampled_from(_NP_UNSUPPORTED))
    a = _np_base(dtype, draw(_SHAPES))
    for _ in range(draw(st.integers(0, 4))):
        step = draw(st.sampled_from(_STEPS))
        if step == "slice" and a.ndim:
            axis = draw(st.integers(0, a.ndim - 1))
            lo = draw(st.none() | st.integers(-6, 6))
            hi = draw(st.none() | st.integers(-6, 6))
            by = draw(st.sampled_from([1, 1, 2, 3, -1, -2]))
            index = [slice(None)] * a.ndim
            index[axis] = slice(lo, hi, by)
            a = a[tuple(index)]
        elif step == "transpose" and a.ndim > 1:
            a = a.transpose(draw(st.permutations(range(a.ndim))))
        elif step == "axis":  # a new axis: zero stride (broadcast) or extent 1, any stride
            at = draw(st.integers(0, a.ndim))
            extent = draw(st.integers(1, 3))
            stride = 0 if extent > 1 else a.itemsize * draw(st.integers(-7, 7))
            a = np.lib.stride_tricks.as_strided(
                a, a.shape[:at] + (extent,) + a.shape[at:],
                a.strides[:at] + (stride,) + a.strides[at:], writeable=a.flags.writeable)
        elif step == "copy":
            a = np.array(a, order=draw(st.sampled_from("CF")))
        elif step == "flat":
            a = a.reshape(-1)  # a copy when the layout requires one
    if draw(st.booleans()):
        a = a.view()
        a.flags.writeable = False
    return a


@FUZZ
@given(numpy_arrays(), _ARGUMENTS, st.booleans(), st.booleans())
def test_numpy_intake_matches_the_oracle(a: np.ndarray, argument: str, writable: bool,
                                         gpu: bool) -> None:
    """NumPy arrays: accepted iff supported, non-empty, dense C order and (when
    asked) writable; then the Buffer aliases the array."""
    exp = expect(_NP_SUPPORTED.get(a.dtype), a.shape, a.strides, a.itemsize,
                 readonly=not a.flags.writeable, writable=writable)
    if exp.reasons:
        check_refused(a, argument, exp, writable=writable, gpu_available=gpu)
        return
    buf = as_buffer(a, argument, writable=writable, gpu_available=gpu)
    check_accepted(buf, a, exp, ptr=a.__array_interface__["data"][0], itemsize=a.itemsize,
                   raw_bytes=a.tobytes, can_write=a.flags.writeable)
    assert np.shares_memory(buf.host_array(), a)


# -- PyTorch -----------------------------------------------------------------------
def _torch_base(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype in _TORCH_SUPPORTED or dtype in (torch.bool, torch.int8, torch.int16):
        return (torch.arange(math.prod(shape)) % 100).to(dtype).reshape(shape)
    return torch.zeros(shape, dtype=dtype)  # no arange for the wide unsigned types


@st.composite
def torch_tensors(draw: st.DrawFn) -> tuple[torch.Tensor, bool]:
    """(tensor, requires_grad) built like numpy_arrays (torch has no negative
    strides); gradients are possible for floating dtypes only."""
    dtype = draw(st.sampled_from(list(_TORCH_SUPPORTED)) | st.sampled_from(_TORCH_UNSUPPORTED))
    t = _torch_base(dtype, draw(_SHAPES))
    for _ in range(draw(st.integers(0, 4))):
        step = draw(st.sampled_from(_STEPS))
        if step == "slice" and t.dim():
            axis = draw(st.integers(0, t.dim() - 1))
            lo = draw(st.none() | st.integers(-6, 6))
            hi = draw(st.none() | st.integers(-6, 6))
            index: list[slice] = [slice(None)] * t.dim()
            index[axis] = slice(lo, hi, draw(st.sampled_from([1, 1, 2, 3])))
            t = t[tuple(index)]
        elif step == "transpose" and t.dim() > 1:
            t = t.permute(*draw(st.permutations(range(t.dim()))))
        elif step == "axis":
            at = draw(st.integers(0, t.dim()))
            extent = draw(st.integers(1, 3))
            if extent == 1 and draw(st.booleans()):
                t = t.unsqueeze(at)  # torch's own choice of stride
            else:
                stride = 0 if extent > 1 else draw(st.integers(0, 7))
                t = t.as_strided(tuple(t.shape[:at]) + (extent,) + tuple(t.shape[at:]),
                                 t.stride()[:at] + (stride,) + t.stride()[at:],
                                 t.storage_offset())
        elif step == "copy":
            t = t.contiguous() if draw(st.booleans()) else t.clone()
        elif step == "flat":
            t = t.reshape(-1)
    grad = (dtype.is_floating_point or dtype.is_complex) and draw(st.booleans())
    if grad:
        t = t.detach().requires_grad_(True)  # same storage and strides, now a leaf
    return t, grad


def _tensor_bytes(t: torch.Tensor) -> Callable[[], bytes]:
    # Only called for dense tensors: the same elements as a 1-D unit-stride view
    # (reshape(-1) would keep an odd stride of an extent-1 axis).
    flat = t.detach().as_strided((t.numel(),), (1,), t.storage_offset())
    return lambda: flat.view(torch.uint8).numpy().tobytes()


@FUZZ
@given(torch_tensors(), _ARGUMENTS, st.booleans(), st.booleans())
def test_torch_intake_matches_the_oracle(case: tuple[torch.Tensor, bool], argument: str,
                                         writable: bool, gpu: bool) -> None:
    """CPU tensors take the DLPack path: same rule as NumPy, plus tensors that
    require grad (torch refuses to export them)."""
    t, grad = case
    exp = expect(_TORCH_SUPPORTED.get(t.dtype), tuple(t.shape), t.stride(), 1,
                 readonly=False, writable=writable, grad=grad)
    if exp.reasons:
        check_refused(t, argument, exp, writable=writable, gpu_available=gpu)
        return
    buf = as_buffer(t, argument, writable=writable, gpu_available=gpu)
    assert buf.owner is t
    check_accepted(buf, t, exp, ptr=t.data_ptr(), itemsize=t.element_size(),
                   raw_bytes=_tensor_bytes(t), can_write=True)


# -- objects that do not speak DLPack -----------------------------------------------
class _DeviceOnly:
    """Half of the protocol: a device but no export."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class _ExportOnly:
    """The other half: an export but no device."""

    def __dlpack__(self, **_: object) -> object:
        raise AssertionError("must not be called")


_NOT_DLPACK = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.complex_numbers(),
    st.text(max_size=5), st.binary(max_size=5), st.binary(max_size=5).map(bytearray),
    st.binary(max_size=8).map(memoryview),
    st.lists(st.floats(allow_nan=False), max_size=4),
    st.lists(st.integers(0, 9), max_size=4).map(tuple),
    st.lists(st.floats(allow_nan=False), max_size=4).map(lambda v: array.array("d", v)),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.builds(object), st.builds(_DeviceOnly), st.builds(_ExportOnly),
)


@settings(FUZZ, max_examples=100)
@given(_NOT_DLPACK, _ARGUMENTS, st.booleans(), st.booleans())
def test_objects_without_dlpack_are_refused(obj: object, argument: str, writable: bool,
                                            gpu: bool) -> None:
    """Anything lacking __dlpack__/__dlpack_device__ is a BufferError naming the
    argument (not an AttributeError from deep inside)."""
    with pytest.raises(BufferError) as info:
        as_buffer(obj, argument, writable=writable, gpu_available=gpu)
    assert info.value.argument == argument
    assert "DLPack" in str(info.value)


# -- library bugs found by fuzzing (these fail until fixed) --------------------------
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_torch_float8_is_refused_with_buffer_error(dtype: torch.dtype) -> None:
    """KNOWN BUG (found by this fuzzer): a float8 tensor's dtype cannot be mapped
    by cuda-core, whose ``StridedMemoryView.dtype`` raises TypeError("Unsupported
    dtype. dtype code: 10"); as_buffer reads ``view.dtype`` outside any
    try-block, so the raw TypeError escapes instead of BufferError(argument,
    "unsupported dtype ...")."""
    with pytest.raises(BufferError) as info:
        as_buffer(torch.zeros(4, dtype=dtype), "grads")
    assert info.value.argument == "grads"


def test_torch_negative_view_is_not_taken_at_face_value() -> None:
    """KNOWN BUG (found by this fuzzer): torch exports a tensor with the lazy
    negation bit (``x.conj().imag``, ``torch._neg_view``) through DLPack as its
    raw memory, which holds the values negated. A one-element one is contiguous,
    so intake accepts it and a collective would reduce -v where the user holds v.
    It must be refused (as torch itself refuses the conjugate bit), or resolved
    by the caller with ``torch.resolve_neg``."""
    t = torch.tensor([1 + 2j], dtype=torch.complex64).conj().imag
    assert t.is_neg() and float(t[0]) == -2.0
    try:
        buf = as_buffer(t, "grads")
    except BufferError as exc:
        assert exc.argument == "grads"
        return
    assert float(buf.host_array()[0]) == float(t[0]), "intake reads the un-negated memory"


# -- dtype lookup of arbitrary objects ---------------------------------------------
_NAMES = sorted(_STORAGE)
_DTYPE_LIKE = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
    st.sampled_from(_NAMES).flatmap(lambda n: st.sampled_from(
        [n, n.upper(), n.title(), f" {n}", f"{n} ", f"{n}\n"])),
    st.sampled_from(sorted(_NP_SUPPORTED, key=str) + _NP_UNSUPPORTED),
    st.sampled_from([np.float32, np.int64, np.bool_, bool, int, float, object]),
    st.tuples(st.sampled_from(["f4", "i8", "u1", "V"]), st.integers(-3, 3)),
    st.lists(st.tuples(st.sampled_from("ab"), st.sampled_from(["f4", "i8"])), max_size=3),
    st.dictionaries(st.sampled_from(["names", "formats", "offsets"]),
                    st.lists(st.sampled_from(["a", "f4", -1, 0]), max_size=2), max_size=3),
)


@settings(FUZZ, max_examples=300)
@given(_DTYPE_LIKE, _ARGUMENTS)
def test_dtype_lookup_is_a_row_or_a_typed_error(x: object, argument: str) -> None:
    """``dtypes.lookup`` of anything: a supported row, or InvalidArgumentError
    naming the argument (never NumPy's own TypeError/ValueError). Names are
    exact (no case folding or trimming) and None is no dtype (NumPy reads it
    as float64)."""
    from wagma_comm import InvalidArgumentError, dtypes

    try:
        row = dtypes.lookup(x, argument)
    except InvalidArgumentError as exc:
        event("refused")
        assert exc.argument == argument
        assert not (isinstance(x, str) and x in _NAMES)
        return
    event("accepted")
    assert row in dtypes.ALL and x is not None
    if isinstance(x, str):
        assert x == row.name
