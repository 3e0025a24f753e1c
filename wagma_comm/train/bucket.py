"""The flat bucket: a list of tensors from any framework as one host buffer per
dtype, so a model travels as one message per dtype instead of one per tensor.

Tensors come in through DLPack (NumPy, PyTorch CPU, JAX CPU, CuPy host, ...).
Reading a tensor goes through ``numpy.from_dlpack`` (a few microseconds) and
falls back to wagma_comm's own DLPack intake for what NumPy cannot view
(bfloat16), which also gives the error messages: the argument is named as
``params[3]``. Framework objects that require grad are detached first.

Device tensors (CUDA, from any framework) are staged in a
:class:`FlatBucket`: PyTorch consumes them through ``torch.from_dlpack`` and
copies them to and from the host bucket. A :class:`DeviceBucket` keeps the
flat buffers on the tensors' own device instead (torch tensors there), so the
collectives run on GPU memory through NCCL with no host copy. (Both written
for CUDA; on the CPU the same copies are tested, the GPU runs are pending.)

The bucket owns its buffers; packing copies in, unpacking copies out. Copies
(rather than re-pointing the tensors into the bucket) are deliberate: a
wait-avoiding round reads the bucket on the progress thread while the
application keeps using its tensors, and frameworks with immutable arrays (JAX)
could not be re-pointed anyway. The copy costs one pass over the model, small
next to the message it saves.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np

from .. import dtypes
from ..buffers import DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED, as_buffer, is_jax_array
from ..errors import BufferError, InvalidArgumentError, UnsupportedError
from ..torch_views import torch_of
from .specs import TensorSpec, bucket_sizes, check_names, layout

__all__ = ["DeviceBucket", "FlatBucket", "host_view", "common_device"]


def _exportable(obj: Any) -> Any:
    """Tensors that require grad refuse DLPack export; their data is what we want."""
    if getattr(obj, "requires_grad", False) and hasattr(obj, "detach"):
        return obj.detach()
    return obj


def host_view(obj: Any, argument: str, *, writable: bool) -> np.ndarray:
    """A flat NumPy view of a host tensor's memory, typed as the wagma dtype's
    NumPy dtype (``ml_dtypes.bfloat16`` for bfloat16). No copy.

    Raises BufferError/UnsupportedError naming ``argument`` for anything that is
    not a usable contiguous host buffer (device tensors: :func:`tensor_view`).
    """
    obj = _exportable(obj)
    if type(obj) is np.ndarray and obj.size > 0 and obj.flags.c_contiguous \
            and dtypes.from_numpy(obj.dtype) is not None \
            and (obj.flags.writeable or not writable):
        return obj.reshape(-1)  # the common case, checked here in a microsecond
    if not isinstance(obj, np.ndarray) and hasattr(obj, "__dlpack__"):
        try:
            arr = np.from_dlpack(obj)
        except Exception:  # noqa: BLE001 - NumPy cannot view it: use our intake below
            arr = None
        if arr is not None and writable and not arr.flags.writeable:
            # The exporter says read-only (JAX arrays are immutable): never write.
            raise BufferError(argument, f"{type(obj).__name__} is read-only but would be "
                              "written in place (for immutable arrays such as JAX's, use "
                              "the copying API: Averager.average(..., copy=True))")
        if arr is not None and dtypes.from_numpy(arr.dtype) is not None \
                and arr.size > 0 and arr.flags.c_contiguous:
            return arr.reshape(-1)
    buffer = as_buffer(obj, argument, writable=writable)
    if buffer.device != "cpu":
        raise BufferError(argument, "expected a host tensor (device tensors: tensor_view)")
    return buffer.host_array().view(buffer.dtype.numpy)


def dtype_name(arr: np.ndarray) -> str:
    row = dtypes.from_numpy(arr.dtype)
    assert row is not None
    return row.name


_DEVICE_KINDS = {DL_CPU: "cpu", DL_CUDA_HOST: "cpu", DL_CUDA: "cuda", DL_CUDA_MANAGED: "cuda"}


def common_device(tensors: Sequence[Any]) -> tuple[str, int] | None:
    """The device every tensor is on, as (kind, index): ``("cpu", 0)`` for
    host memory (pinned included), ``("cuda", 1)``, ...; None when they are
    spread over several. Objects that are no DLPack exporter count as host
    memory (the host intake names what is wrong with them)."""
    found = set()
    for obj in tensors:
        try:
            kind, index = (int(x) for x in _exportable(obj).__dlpack_device__())
        except Exception:  # noqa: BLE001 - not DLPack: the host path decides
            kind, index = DL_CPU, 0
        name = _DEVICE_KINDS.get(kind, f"dlpack-{kind}")
        found.add((name, 0 if name == "cpu" else index))
    return found.pop() if len(found) == 1 else None


def _on_device(obj: Any) -> bool:
    """Whether a DLPack exporter lives outside host memory (CUDA, ROCm, ...)."""
    try:
        return int(obj.__dlpack_device__()[0]) not in (DL_CPU, DL_CUDA_HOST)
    except Exception:  # noqa: BLE001 - not DLPack at all: the host path says so
        return False


class DeviceView:
    """A device tensor of any framework, seen through ``torch.from_dlpack``,
    copied to and from host buffers (flat, same dtype)."""

    def __init__(self, obj: Any, argument: str, *, writable: bool) -> None:
        try:
            import torch
        except ImportError:
            raise UnsupportedError(argument, "device tensors (and device buckets) go through "
                                   "PyTorch (torch.from_dlpack), which is not installed") from None
        if writable and is_jax_array(obj):
            raise BufferError(argument, "JAX arrays are immutable; use the copying API: "
                              "Averager.average(..., copy=True)")
        tensor = obj if isinstance(obj, torch.Tensor) else torch.from_dlpack(obj)
        if not tensor.is_contiguous():
            raise BufferError(argument, f"buffer must be C-contiguous; got shape "
                              f"{tuple(tensor.shape)} with strides {tensor.stride()}")
        from .pytorch import torch_dtype_name

        self.dtype = torch_dtype_name(tensor.dtype, argument)
        self.tensor = tensor.detach().reshape(-1)
        self.size = self.tensor.numel()

    def read_into(self, dst: np.ndarray) -> None:
        torch_of(dst).copy_(self.tensor)

    def write_from(self, src: np.ndarray) -> None:
        self.tensor.copy_(torch_of(src))


def _is_empty(obj: Any) -> bool:
    """Whether a DLPack exporter (or NumPy array) holds no elements."""
    if not isinstance(obj, np.ndarray) and not hasattr(obj, "__dlpack__"):
        return False  # the host intake names what it is
    try:
        return any(int(s) == 0 for s in obj.shape)
    except (AttributeError, TypeError, ValueError):
        return False


def _empty_view(obj: Any, argument: str) -> np.ndarray:
    """A stand-in for an empty host tensor: a zero-length array of its dtype.
    The collectives refuse empty buffers ("nothing to reduce"), so a bucket
    keeps an empty tensor in its layout (shape and dtype are still checked)
    but gives it no elements, as DistributedOptimizer leaves parameters
    with no elements out of its buckets; reading or writing it moves
    nothing, and the dtype is all it needs."""
    if isinstance(obj, np.ndarray):
        row, shown = dtypes.from_array(obj), obj.dtype
    else:
        from ..buffers import _parse  # DLPack's own view: NumPy cannot read bfloat16

        view = _parse(obj, argument, stream=-1)
        try:
            shown = view.dtype
        except Exception as exc:  # noqa: BLE001 - a type code NumPy has no dtype for
            raise BufferError(argument, f"unsupported dtype ({exc}); expected one of "
                              f"{sorted(dtypes.BY_NAME)}") from exc
        row = dtypes.from_numpy(shown)
    if row is None:
        raise BufferError(argument, dtypes.unsupported(shown))
    return np.zeros(0, dtype=row.numpy)


def tensor_view(obj: Any, argument: str, *, writable: bool) -> np.ndarray | DeviceView:
    """:func:`host_view` for host tensors, a :class:`DeviceView` for device
    ones; an empty host tensor is seen as a zero-length array (:func:`_empty_view`)."""
    obj = _exportable(obj)
    if _on_device(obj):
        return DeviceView(obj, argument, writable=writable)
    if _is_empty(obj):
        return _empty_view(obj, argument)
    return host_view(obj, argument, writable=writable)


def _dtype_of(v: np.ndarray | DeviceView) -> str:
    return v.dtype if isinstance(v, DeviceView) else dtype_name(v)


class FlatBucket:
    """One flat NumPy buffer per dtype holding a fixed list of tensors.

    ``specs`` (the layout) is fixed at construction from ``tensors``; every
    later :meth:`pack`/:meth:`unpack` must pass tensors of the same shapes and
    dtypes (checked locally, naming the parameter). ``flats`` maps a dtype name
    to its buffer; :meth:`buffers` lists them in a fixed order, the order every
    rank communicates them in. Empty tensors keep their place in the layout
    with no elements (a dtype whose tensors are all empty has no buffer to
    communicate), as in DistributedOptimizer's buckets.
    """

    def __init__(self, tensors: Sequence[Any], names: Sequence[str | None] | None = None,
                 *, argument: str = "params") -> None:
        self.argument = argument
        self.specs, views = self._layout(tensors, names, argument)
        self.flats: dict[str, Any] = self._allocate(bucket_sizes(self.specs), views)

    @classmethod
    def layout_of(cls, tensors: Sequence[Any], names: Sequence[str | None] | None = None,
                  *, argument: str = "params") -> tuple[TensorSpec, ...]:
        """The layout a bucket of ``tensors`` would have, every tensor checked
        (errors name ``argument[i]``), without allocating the bucket."""
        return cls._layout(tensors, names, argument)[0]

    @classmethod
    def _layout(cls, tensors: Any, names: Sequence[str | None] | None,
                argument: str) -> tuple[tuple[TensorSpec, ...], list[Any]]:
        tensors = cls._check_list(tensors, argument)
        names = check_names(names, len(tensors))
        views = [cls._intake(t, f"{argument}[{i}]", writable=False)
                 for i, t in enumerate(tensors)]
        shapes = [cls._shape(t, v) for t, v in zip(tensors, views)]
        return layout(shapes, [_dtype_of(v) for v in views], names), views

    # -- what a subclass keeps elsewhere (DeviceBucket: torch tensors) ----------
    _intake = staticmethod(tensor_view)

    def _allocate(self, sizes: dict[str, int], views: list[Any]) -> dict[str, Any]:
        return {dt: np.zeros(n, dtype=dtypes.BY_NAME[dt].numpy) for dt, n in sizes.items()}

    @staticmethod
    def _zero(slot: np.ndarray) -> None:
        slot.fill(0)

    @staticmethod
    def _copy_in(slot: np.ndarray, view: np.ndarray | DeviceView) -> None:
        if isinstance(view, DeviceView):
            view.read_into(slot)
        else:
            np.copyto(slot, view)

    @staticmethod
    def _copy_out(view: np.ndarray | DeviceView, slot: np.ndarray) -> None:
        if isinstance(view, DeviceView):
            view.write_from(slot)
        else:
            np.copyto(view, slot)

    # -- layout ---------------------------------------------------------------
    @staticmethod
    def _check_list(tensors: Any, argument: str) -> list[Any]:
        if isinstance(tensors, (str, bytes)) or not hasattr(tensors, "__iter__") \
                or hasattr(tensors, "__dlpack__"):  # one tensor, not a list of them
            raise InvalidArgumentError(argument, f"expected a sequence of tensors, got "
                                       f"{type(tensors).__name__}")
        tensors = list(tensors)
        if not tensors:
            raise InvalidArgumentError(argument, "expected at least one tensor, got none")
        return tensors

    @staticmethod
    def _shape(obj: Any, view: np.ndarray | DeviceView) -> tuple[int, ...]:
        shape = getattr(obj, "shape", None)
        try:
            return tuple(int(s) for s in shape) if shape is not None else (view.size,)
        except TypeError:
            return (view.size,)

    def buffers(self) -> list[Any]:
        """The flat buffers, one per dtype, in the order of first appearance.
        A dtype whose tensors are all empty is left out: the collectives
        refuse an empty buffer, and every rank has the same layout."""
        return [b for b in self.flats.values() if len(b)]

    def views(self) -> list[Any]:
        """One view per tensor into the flat buffers, shaped like the tensor."""
        return [self.flats[s.dtype][s.offset:s.offset + s.count].reshape(s.shape)
                for s in self.specs]

    def copies(self) -> list[np.ndarray]:
        """Fresh arrays (not views) of every tensor's current bucket contents:
        what a framework with immutable arrays (JAX) imports."""
        return [np.array(v, copy=True) for v in self.views()]

    # -- moving data ------------------------------------------------------------
    def _check_count(self, tensors: Any) -> list[Any]:
        tensors = self._check_list(tensors, self.argument)
        if len(tensors) != len(self.specs):
            raise InvalidArgumentError(
                self.argument, f"expected {len(self.specs)} tensors (the set-up layout), "
                f"got {len(tensors)}")
        return tensors

    def _view(self, spec: TensorSpec, tensor: Any, writable: bool) -> np.ndarray | DeviceView:
        arg = f"{self.argument}[{spec.index}]"
        v = self._intake(tensor, arg, writable=writable)
        shape = self._shape(tensor, v)
        if shape != spec.shape or _dtype_of(v) != spec.dtype:
            raise InvalidArgumentError(
                arg, f"{spec.label()} was set up as {spec.describe()}, got "
                f"shape {shape} {_dtype_of(v)}")
        return v

    def _slot(self, spec: TensorSpec) -> Any:
        return self.flats[spec.dtype][spec.offset:spec.offset + spec.count]

    def pack(self, tensors: Sequence[Any]) -> None:
        """Copy ``tensors`` into the bucket; a ``None`` entry (a gradient that was
        never computed) becomes zeros."""
        tensors = self._check_count(tensors)
        views = [None if t is None else self._view(s, t, False)
                 for s, t in zip(self.specs, tensors)]  # validate all before copying
        for spec, v in zip(self.specs, views):
            if v is None:
                self._zero(self._slot(spec))
            else:
                self._copy_in(self._slot(spec), v)

    def check(self, tensors: Sequence[Any], *, writable: bool = False) -> None:
        """The checks of :meth:`pack` (count, layout) or, ``writable``, of
        :meth:`unpack` (also writable), copying nothing: a caller runs them
        before a round it packs for or whose result it unpacks."""
        tensors = self._check_count(tensors)
        for spec, t in zip(self.specs, tensors):
            if t is not None:
                self._view(spec, t, writable)

    def check_writable(self, tensors: Sequence[Any]) -> None:
        """:meth:`check` with ``writable``."""
        self.check(tensors, writable=True)

    def writable(self, tensors: Sequence[Any]) -> list[Any]:
        """``tensors`` with None for each that cannot be written in place
        (read-only: JAX arrays), for an :meth:`unpack` that writes every
        other one (it validates all before copying, so one read-only tensor
        stopped every write)."""
        tensors = self._check_count(tensors)
        out = []
        for spec, t in zip(self.specs, tensors):
            try:
                if t is not None:
                    self._view(spec, t, True)
            except BufferError:
                t = None
            out.append(t)
        return out

    def unpack(self, tensors: Sequence[Any]) -> None:
        """Copy the bucket into ``tensors``, in place (they must be writable);
        ``None`` entries are skipped (:class:`Averager` hands out copies)."""
        tensors = self._check_count(tensors)
        views = [None if t is None else self._view(s, t, True)
                 for s, t in zip(self.specs, tensors)]  # validate all before copying
        for spec, v in zip(self.specs, views):
            if v is not None:
                self._copy_out(v, self._slot(spec))


class DeviceBucket(FlatBucket):
    """A :class:`FlatBucket` whose flat buffers are torch tensors on the
    tensors' own device (every tensor must be on that one device). Packing
    and unpacking are copies on the device, and the collectives take the flat
    tensors themselves: for CUDA, NCCL and our kernels with no host copy,
    ordered after the packing copies by the stream contract (docs/gpu.md).
    Host tensors (on the CPU, where the tests run this code) are seen as CPU
    torch tensors over their memory. :meth:`copies` returns torch tensors."""

    @staticmethod
    def _intake(obj: Any, argument: str, *, writable: bool) -> DeviceView:  # type: ignore[override]
        view = tensor_view(obj, argument, writable=writable)
        if isinstance(view, DeviceView):
            return view
        with warnings.catch_warnings():  # a read-only array is only read: host_view said so
            warnings.simplefilter("ignore", UserWarning)
            return DeviceView(torch_of(view), argument, writable=writable)

    def _allocate(self, sizes: dict[str, int], views: list[Any]) -> dict[str, Any]:
        import torch

        from .pytorch import torch_dtype

        self.device = views[0].tensor.device
        for i, v in enumerate(views):
            if v.tensor.device != self.device:
                raise InvalidArgumentError(
                    f"{self.argument}[{i}]", f"is on {v.tensor.device} but "
                    f"{self.argument}[0] is on {self.device}; device buckets need one device")
        return {dt: torch.zeros(n, dtype=torch_dtype(dt), device=self.device)
                for dt, n in sizes.items()}

    @staticmethod
    def _zero(slot: Any) -> None:
        slot.zero_()

    @staticmethod
    def _copy_in(slot: Any, view: Any) -> None:
        slot.copy_(view.tensor)

    @staticmethod
    def _copy_out(view: Any, slot: Any) -> None:
        view.tensor.copy_(slot)

    def unpack(self, tensors: Sequence[Any]) -> None:
        """As :meth:`FlatBucket.unpack`. The copies run on torch's current
        stream, which a CuPy or JAX kernel on its own stream would not wait
        for: with any target not a torch tensor, wait for them here.
        ``tensors`` is walked twice, so an iterator is listed first (the
        second walk found it empty and never waited)."""
        tensors = self._check_list(tensors, self.argument)
        super().unpack(tensors)
        if self.device.type == "cuda":
            import torch

            if any(not isinstance(t, torch.Tensor) for t in tensors):
                torch.cuda.current_stream(self.device).synchronize()

    def copies(self) -> list[Any]:
        """Fresh torch tensors on the bucket's device (any framework imports
        them through DLPack, e.g. ``jnp.from_dlpack``)."""
        return [v.clone() for v in self.views()]
