"""The flat bucket and the DLPack intake of the training layer (no MPI)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from wagma_comm import BufferError, InvalidArgumentError
from wagma_comm.train import FlatBucket, TensorSpec, host_view
from wagma_comm.train.pytorch import TorchBucket
from wagma_comm.train.specs import _signature, describe_layout, layout


def test_one_flat_buffer_per_dtype_in_list_order() -> None:
    tensors = [np.arange(6, dtype=np.float32).reshape(2, 3),
               torch.arange(3, dtype=torch.bfloat16),
               torch.full((2, 2), 7.0),
               np.ones(1, ml_dtypes.bfloat16)]
    b = FlatBucket(tensors, ["a", "b", "c", "d"])
    assert [s.dtype for s in b.specs] == ["float32", "bfloat16", "float32", "bfloat16"]
    assert [(s.offset, s.count) for s in b.specs] == [(0, 6), (0, 3), (6, 4), (3, 1)]
    assert list(b.flats) == ["float32", "bfloat16"]
    b.pack(tensors)
    assert b.flats["float32"].tolist() == [0, 1, 2, 3, 4, 5, 7, 7, 7, 7]
    assert b.flats["bfloat16"].astype(np.float32).tolist() == [0, 1, 2, 1]
    assert describe_layout(b.specs) == "4 tensors, 2 buckets: float32 x 10, bfloat16 x 4"


def test_unpack_writes_in_place_and_views_have_the_tensor_shapes() -> None:
    w = torch.nn.Parameter(torch.zeros(2, 3))  # requires grad: detached for DLPack
    h = torch.zeros(4, dtype=torch.bfloat16)
    a = np.zeros(5, np.float64)
    b = FlatBucket([w, h, a])
    for flat in b.buffers():
        flat[...] = 2.5
    b.unpack([w, h, a])
    assert bool((w == 2.5).all()) and bool((h == 2.5).all()) and (a == 2.5).all()
    assert [v.shape for v in b.views()] == [(2, 3), (4,), (5,)]
    copies = b.copies()
    copies[0][...] = 0
    assert b.views()[0][0, 0] == 2.5  # copies are not views


def test_none_packs_as_zeros() -> None:
    b = FlatBucket([np.ones(3, np.float32), np.ones(2, np.float32)])
    b.flats["float32"][...] = 9
    b.pack([None, np.full(2, 4, np.float32)])
    assert b.flats["float32"].tolist() == [0, 0, 0, 4, 4]


def test_layout_is_checked_on_every_pack_and_names_the_parameter() -> None:
    b = FlatBucket([np.zeros((2, 3), np.float32), np.zeros(4, np.float32)], ["w", "b"])
    with pytest.raises(InvalidArgumentError, match=r"params\[0\]: parameter 0 \('w'\) was set "
                       r"up as shape \(2, 3\) float32, got shape \(3, 2\) float32"):
        b.pack([np.zeros((3, 2), np.float32), np.zeros(4, np.float32)])
    with pytest.raises(InvalidArgumentError, match=r"params\[1\].*float64"):
        b.pack([np.zeros((2, 3), np.float32), np.zeros(4, np.float64)])
    with pytest.raises(InvalidArgumentError, match="expected 2 tensors"):
        b.unpack([np.zeros((2, 3), np.float32)])


def test_bad_tensors_are_refused_naming_the_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="at least one tensor"):
        FlatBucket([])
    with pytest.raises(InvalidArgumentError, match="sequence of tensors"):
        FlatBucket(np.zeros(3))  # type: ignore[arg-type] - an array, not a list of them
    with pytest.raises(BufferError, match=r"params\[1\].*C-contiguous"):
        FlatBucket([np.zeros(2), torch.zeros(3, 3).t()])
    with pytest.raises(BufferError, match=r"params\[0\].*DLPack"):
        FlatBucket([[1.0, 2.0]])
    with pytest.raises(BufferError, match="unsupported dtype"):
        FlatBucket([np.zeros(2, np.complex64)])
    with pytest.raises(InvalidArgumentError, match="names"):
        FlatBucket([np.zeros(2)], ["a", "b"])


def test_read_only_tensors_are_read_but_never_written() -> None:
    ro = np.ones(3, np.float32)
    ro.flags.writeable = False
    b = FlatBucket([ro])
    b.pack([ro])
    with pytest.raises(BufferError, match="read-only"):
        b.unpack([ro])
    assert host_view(ro, "x", writable=False).tolist() == [1, 1, 1]


def test_jax_arrays_are_read_through_dlpack_and_never_written() -> None:
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.arange(4.0, dtype=jnp.float32)
    b = FlatBucket([x])
    b.pack([x])
    assert b.flats["float32"].tolist() == [0, 1, 2, 3]
    with pytest.raises(BufferError, match="read-only"):
        b.unpack([x])  # JAX arrays are immutable


def test_torch_bucket_round_trip_on_cpu() -> None:
    params = [torch.randn(3, 2), torch.randn(4, dtype=torch.bfloat16), torch.randn(5)]
    specs = layout([tuple(p.shape) for p in params], ["float32", "bfloat16", "float32"],
                   [None] * 3)
    tb = TorchBucket(specs, torch.device("cpu"))
    tb.pack(params)
    bufs = tb.buffers()
    assert [b.dtype for b in bufs] == [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)]
    assert np.array_equal(bufs[0][:6], params[0].numpy().ravel())
    out = [torch.zeros_like(p) for p in params]
    bufs[1][...] = 3
    tb.unpack(out)
    assert torch.equal(out[0], params[0]) and bool((out[1] == 3).all())
    grads_of = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    tb.unpack_grads(grads_of)
    assert torch.equal(grads_of[2].grad, params[2])


def test_torch_bucket_zeros_missing_grads_and_writes_leaf_params() -> None:
    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.tensor(1.5))]
    specs = layout([tuple(p.shape) for p in params], ["float32", "float32"], [None] * 2)
    tb = TorchBucket(specs, torch.device("cpu"))
    flat = tb.buffers()[0]
    flat[...] = 9
    tb.pack([None, params[1]])  # a parameter without a gradient packs as zeros
    assert flat.tolist() == [0.0] * 6 + [1.5]
    flat[...] = np.arange(7, dtype=np.float32)
    tb.unpack(params)  # in place on leaf tensors that require grad
    assert params[0].tolist() == [[0, 1, 2], [3, 4, 5]] and params[1].item() == 6
    assert params[0].requires_grad and params[0].grad is None
    for changed in (torch.ones(1, 3), torch.ones(6)):  # never broadcast or reshaped
        with pytest.raises(InvalidArgumentError, match=r"parameter 0 is now"):
            tb.pack([changed, params[1]])


def test_device_bucket_hands_the_flat_tensors_themselves_to_the_collectives() -> None:
    """A device bucket's buffers are its flat torch tensors (here on the CPU,
    the same code as on a GPU): writes to them are what unpack reads."""
    params = [torch.randn(3, 2), torch.randn(4, dtype=torch.bfloat16), torch.randn(5)]
    specs = layout([tuple(p.shape) for p in params], ["float32", "bfloat16", "float32"],
                   [None] * 3)
    tb = TorchBucket(specs, torch.device("cpu"), on_device=True)
    tb.pack(params)
    bufs = tb.buffers()
    assert all(isinstance(b, torch.Tensor) for b in bufs)
    assert [b.dtype for b in bufs] == [torch.float32, torch.bfloat16]
    assert torch.equal(bufs[0][6:], params[2])
    bufs[1].fill_(-2)
    out = [torch.zeros_like(p) for p in params]
    tb.unpack(out)
    assert torch.equal(out[0], params[0]) and bool((out[1] == -2).all())


def test_method_buffer_helpers_keep_the_memory_kind() -> None:
    from wagma_comm.train.methods.base import any_bit_set, clone, zeros_like

    for buf in (np.arange(4, dtype=np.float32), torch.arange(4, dtype=torch.bfloat16)):
        c = clone(buf)
        assert type(c) is type(buf) and c is not buf and (c == buf).all()
        c[0] = 7
        assert buf[0] == 0  # a copy, not a view
        z = zeros_like(buf)
        assert type(z) is type(buf) and z.dtype == buf.dtype and not any_bit_set(z)
        z[2] = -0.0  # the sign bit is an update some rank made
        assert any_bit_set(z)


def test_signature_depends_on_shape_and_dtype_only() -> None:
    def spec(shape: tuple[int, ...], dtype: str, name: str | None) -> TensorSpec:
        return TensorSpec(0, name, shape, dtype, 0, int(np.prod(shape)))
    a = _signature(spec((2, 3), "float32", "a"))
    assert a == _signature(spec((2, 3), "float32", "other name"))
    assert a != _signature(spec((3, 2), "float32", "a"))
    assert a != _signature(spec((2, 3), "bfloat16", "a"))
    assert a != _signature(spec((2, 3, 1), "float32", "a"))
    assert 0 <= a < 2**62


def test_device_staging_copies_through_torch_views() -> None:
    """The CUDA path's copies (torch.from_dlpack view <-> host bucket), run on
    CPU tensors: no GPU here, the copy logic and dtypes are what is checked."""
    from wagma_comm.train.bucket import DeviceView

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        src = torch.arange(6, dtype=dtype).reshape(2, 3)
        view = DeviceView(src, "params[0]", writable=True)
        assert view.size == 6 and view.dtype == str(dtype).split(".")[1]
        host = np.zeros(6, dtype=np.float32 if dtype == torch.float32 else
                        (ml_dtypes.bfloat16 if dtype == torch.bfloat16 else np.float16))
        view.read_into(host)
        assert host.astype(np.float32).tolist() == [0, 1, 2, 3, 4, 5]
        host[...] = 9
        view.write_from(host)
        assert bool((src == 9).all())
    with pytest.raises(BufferError, match="C-contiguous"):
        DeviceView(torch.zeros(3, 2).t(), "params[1]", writable=False)


class _Exporter:
    """A DLPack exporter's device report alone: enough for common_device,
    which reads nothing else."""

    def __init__(self, kind: int, index: int) -> None:
        self.device = (kind, index)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


def test_common_device_names_the_one_device_or_none() -> None:
    from wagma_comm.train.bucket import common_device

    host = [np.zeros(2), torch.zeros(3), _Exporter(3, 0)]  # CUDA-pinned host counts as host
    assert common_device(host) == ("cpu", 0)
    assert common_device([_Exporter(2, 1), _Exporter(2, 1)]) == ("cuda", 1)
    assert common_device([_Exporter(2, 0), _Exporter(2, 1)]) is None
    assert common_device([np.zeros(2), _Exporter(2, 0)]) is None


def test_device_bucket_keeps_torch_buffers_and_checks_like_the_host_one() -> None:
    from wagma_comm.train.bucket import DeviceBucket

    h = np.arange(3, dtype=ml_dtypes.bfloat16)
    ro = np.arange(2, dtype=np.float32)
    ro.flags.writeable = False
    params = [torch.arange(6.0).reshape(2, 3), h, ro]
    b = DeviceBucket(params, ["w", "h", "ro"])
    assert FlatBucket.layout_of(params, ["w", "h", "ro"]) == b.specs
    assert all(isinstance(f, torch.Tensor) for f in b.buffers())
    assert b.device == torch.device("cpu")
    b.pack(params)
    assert b.flats["float32"].tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    b.pack([None, h, ro])  # a missing gradient packs as zeros
    assert b.flats["float32"][:6].tolist() == [0] * 6
    for f in b.buffers():
        f.fill_(5)
    out = [torch.zeros(2, 3), np.zeros(3, ml_dtypes.bfloat16), np.zeros(2, np.float32)]
    b.unpack(out)
    assert out[0].tolist() == [[5] * 3] * 2 and out[1].astype(np.float32).tolist() == [5] * 3
    with pytest.raises(BufferError, match="read-only"):
        b.unpack(params)
    copies = b.copies()
    copies[0].fill_(-1)  # fresh tensors, not views of the bucket
    assert b.flats["float32"][0].item() == 5
    with pytest.raises(InvalidArgumentError, match=r"params\[1\]"):
        b.pack([params[0], np.zeros(3, np.float32), ro])  # bfloat16 was set up
    with pytest.raises(InvalidArgumentError, match=r"params\[0\]"):
        b.pack([torch.zeros(3, 2), h, ro])


def test_torch_bucket_refuses_a_sparse_gradient_naming_it() -> None:
    """copy_ from a sparse tensor (nn.Embedding(sparse=True)'s gradient)
    raised a bare RuntimeError from inside the backward pass."""
    specs = layout([(5, 2)], ["float32"], ["emb.weight"])
    tb = TorchBucket(specs, torch.device("cpu"))
    sparse = torch.sparse_coo_tensor([[1, 3]], torch.ones(2, 2), (5, 2), check_invariants=True)
    with pytest.raises(InvalidArgumentError, match=r"params\[0\]: parameter 0 \('emb.weight'\) "
                       r"is a torch.sparse_coo tensor"):
        tb.pack([sparse])
    with pytest.raises(InvalidArgumentError, match=r"params\[0\].*sparse"):
        tb.unpack_grads([_with_grad(sparse)])


def _with_grad(grad: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(grad.shape))
    p.grad = grad
    return p


def test_torch_bucket_leaves_an_empty_dtype_out_and_names_its_argument() -> None:
    """A dtype whose tensors are all empty has nothing to send; its
    zero-length buffer went to the collectives, which refuse it ("buf:
    buffer is empty"). Errors name the bucket's argument (buffers[i] for the
    set-up broadcast of a model's buffers, not params[i])."""
    tensors = [torch.ones(3), torch.zeros(0, dtype=torch.float64), torch.ones(2)]
    specs = layout([tuple(t.shape) for t in tensors], ["float32", "float64", "float32"],
                   [None] * 3)
    for on_device in (False, True):
        tb = TorchBucket(specs, torch.device("cpu"), on_device, argument="buffers")
        tb.pack(tensors)
        assert [len(b) for b in tb.buffers()] == [5]
        tb.unpack(tensors)
        with pytest.raises(InvalidArgumentError, match=r"buffers\[2\]"):
            tb.pack([tensors[0], tensors[1], torch.ones(3)])


class _ForeignCuda:
    """A CUDA tensor behind DLPack alone, as a CuPy or JAX array would be:
    not a torch tensor, so DeviceBucket.unpack must wait for its copies."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.shape = tuple(tensor.shape)

    def __dlpack__(self, **kw: object) -> object:
        return self.tensor.__dlpack__(**kw)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.tensor.__dlpack_device__()


def test_device_bucket_unpack_takes_an_iterator_once() -> None:
    """unpack walked ``tensors`` twice (the copies, then the check for
    targets that are no torch tensors): with a generator the second walk
    was empty, so on CUDA the stream was not synchronized and a foreign
    framework could read its arrays before the copies landed. On the CPU
    the generator is unpacked like a list."""
    from wagma_comm.train.bucket import DeviceBucket

    b = DeviceBucket([torch.zeros(4), torch.zeros(2)])
    for f in b.buffers():
        f.fill_(3)
    out = [torch.zeros(4), torch.zeros(2)]
    b.unpack(t for t in out)
    assert [t.tolist() for t in out] == [[3.0] * 4, [3.0] * 2]
    if not torch.cuda.is_available():
        return  # the synchronization itself needs a GPU
    dev = torch.device("cuda", 0)
    targets = [torch.zeros(1 << 20, device=dev)]
    b = DeviceBucket(targets)
    b.buffers()[0].fill_(7)
    torch.cuda.synchronize(dev)
    torch.cuda._sleep(1 << 30)  # a spin kernel ahead of the copies (about half a second)
    b.unpack(_ForeignCuda(t) for t in targets)
    assert torch.cuda.current_stream(dev).query(), "unpack returned before its copies"
    assert targets[0][:3].tolist() == [7.0] * 3


def test_names_that_are_no_sequence_of_names_are_refused_naming_names() -> None:
    """A string was taken as a list of one-letter names (``names="ab"`` for
    two tensors named 'a' and 'b'), and a number raised a bare TypeError."""
    params = [np.zeros(2, np.float32), np.zeros(3, np.float32)]
    for bad in ("ab", b"ab", 2):
        with pytest.raises(InvalidArgumentError, match="names: expected a sequence") as info:
            FlatBucket(params, bad)  # type: ignore[arg-type]
        assert info.value.argument == "names"
    assert [s.name for s in FlatBucket(params, ("a", None)).specs] == ["a", None]


def test_an_empty_tensor_keeps_its_place_in_the_layout_with_no_elements() -> None:
    """An empty tensor (a zero-size bias, an empty pytree leaf) was refused
    ("buffer is empty; nothing to reduce") while DistributedOptimizer leaves
    such parameters out of its buckets. It keeps its place in the layout
    (shape and dtype checked, naming it) with no elements, and a dtype
    whose tensors are all empty has no buffer for the collectives."""
    from wagma_comm.train.bucket import DeviceBucket

    tensors = [np.arange(3, dtype=np.float32), np.zeros((0, 2), np.float32),
               torch.zeros(0, dtype=torch.bfloat16), np.zeros((2, 0), ml_dtypes.bfloat16),
               torch.nn.Parameter(torch.zeros(4, 0, dtype=torch.float64))]
    for kind in (FlatBucket, DeviceBucket):
        b = kind(tensors)
        assert [(s.dtype, s.offset, s.count) for s in b.specs] == [
            ("float32", 0, 3), ("float32", 3, 0), ("bfloat16", 0, 0), ("bfloat16", 0, 0),
            ("float64", 0, 0)]
        assert [len(f) for f in b.buffers()] == [3]  # the empty dtypes are left out
        b.pack(tensors)
        b.buffers()[0][...] = b.buffers()[0] * 2
        out = [np.zeros(3, np.float32)] + tensors[1:]
        b.unpack(out)
        assert out[0].tolist() == [0.0, 2.0, 4.0]
        assert [tuple(c.shape) for c in b.copies()] == [(3,), (0, 2), (0,), (2, 0), (4, 0)]
        with pytest.raises(InvalidArgumentError, match=r"params\[1\].*got shape \(2, 0\)"):
            b.pack([tensors[0], np.zeros((2, 0), np.float32), *tensors[2:]])
        with pytest.raises(InvalidArgumentError, match=r"params\[2\].*float16"):
            b.pack([*tensors[:2], torch.zeros(0, dtype=torch.float16), *tensors[3:]])
    for bad in (np.zeros(0, np.complex64), torch.zeros(0, dtype=torch.complex64),
                np.zeros(0, bool)):
        with pytest.raises(BufferError, match=r"params\[1\]: unsupported dtype"):
            FlatBucket([tensors[0], bad])


def test_jax_empty_arrays_keep_their_place_too() -> None:
    jnp = pytest.importorskip("jax.numpy")
    tensors = [jnp.ones(2, jnp.float32), jnp.zeros((0, 3), jnp.bfloat16)]
    b = FlatBucket(tensors)
    assert [(s.dtype, s.count) for s in b.specs] == [("float32", 2), ("bfloat16", 0)]
    b.pack(tensors)
    assert [len(f) for f in b.buffers()] == [2]


def test_writable_leaves_out_only_the_tensors_that_cannot_be_written() -> None:
    """Unpacking validates every target before copying, so one read-only
    tensor stopped every write: the Averager's set-up broadcast then left
    each rank's writable tensors at its own values. ``writable`` keeps the
    ones that can be written, for an unpack that writes them all."""
    ro = np.ones(2, np.float32)
    ro.flags.writeable = False
    w, h = np.zeros(3, np.float32), np.zeros(2, ml_dtypes.bfloat16)
    b = FlatBucket([w, ro, h])
    assert [t is None for t in b.writable([w, ro, h])] == [False, True, False]
    b.pack([np.full(3, 5.0, np.float32), ro, np.full(2, 6.0, ml_dtypes.bfloat16)])
    b.unpack(b.writable([w, ro, h]))
    assert w.tolist() == [5.0] * 3 and h.astype(np.float32).tolist() == [6.0] * 2
    b.check([w, ro, h])  # read: the read-only one is fine
    with pytest.raises(BufferError, match=r"params\[1\].*read-only"):
        b.check([w, ro, h], writable=True)
    with pytest.raises(InvalidArgumentError, match=r"params\[0\]"):
        b.writable([np.zeros(4, np.float32), ro, h])  # the layout is still checked
