"""The flat bucket: a list of tensors from any framework as one host buffer per
dtype, so a model travels as one message per dtype instead of one per tensor.

Tensors come in through DLPack (NumPy, PyTorch CPU, JAX CPU, CuPy host, ...).
Reading a tensor goes through ``numpy.from_dlpack`` (a few microseconds) and
falls back to wagma_comm's own DLPack intake for what NumPy cannot view
(bfloat16), which also gives the error messages: the argument is named as
``params[3]``. Framework objects that require grad are detached first.

Device tensors (CUDA, from any framework) are staged: PyTorch consumes them
through ``torch.from_dlpack`` and copies them to and from the host bucket
(the partial collectives take GPU buffers too, docs/gpu.md, but device
buckets are not built yet). (Written for CUDA but not run on a GPU yet; on
the CPU the same copies are tested.)

The bucket owns its buffers; packing copies in, unpacking copies out. Copies
(rather than re-pointing the tensors into the bucket) are deliberate: a
wait-avoiding round reads the bucket on the progress thread while the
application keeps using its tensors, and frameworks with immutable arrays (JAX)
could not be re-pointed anyway. The copy costs one pass over the model, small
next to the message it saves.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .. import dtypes
from ..buffers import DL_CPU, DL_CUDA_HOST, as_buffer
from ..errors import BufferError, InvalidArgumentError, UnsupportedError
from ..torch_views import torch_of
from .specs import TensorSpec, bucket_sizes, check_names, layout

__all__ = ["FlatBucket", "host_view"]


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
            raise UnsupportedError(argument, "device tensors are staged through host memory "
                                   "with PyTorch, which is not installed") from None
        if writable and type(obj).__module__.split(".")[0] in ("jax", "jaxlib"):
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


def tensor_view(obj: Any, argument: str, *, writable: bool) -> np.ndarray | DeviceView:
    """:func:`host_view` for host tensors, a :class:`DeviceView` for device ones."""
    obj = _exportable(obj)
    if _on_device(obj):
        return DeviceView(obj, argument, writable=writable)
    return host_view(obj, argument, writable=writable)


def _dtype_of(v: np.ndarray | DeviceView) -> str:
    return v.dtype if isinstance(v, DeviceView) else dtype_name(v)


class FlatBucket:
    """One flat NumPy buffer per dtype holding a fixed list of tensors.

    ``specs`` (the layout) is fixed at construction from ``tensors``; every
    later :meth:`pack`/:meth:`unpack` must pass tensors of the same shapes and
    dtypes (checked locally, naming the parameter). ``flats`` maps a dtype name
    to its buffer; :meth:`buffers` lists them in a fixed order, the order every
    rank communicates them in.
    """

    def __init__(self, tensors: Sequence[Any], names: Sequence[str | None] | None = None,
                 *, argument: str = "params") -> None:
        tensors = self._check_list(tensors, argument)
        names = check_names(names, len(tensors))
        views = [tensor_view(t, f"{argument}[{i}]", writable=False)
                 for i, t in enumerate(tensors)]
        shapes = [self._shape(t, v) for t, v in zip(tensors, views)]
        self.specs: tuple[TensorSpec, ...] = layout(
            shapes, [_dtype_of(v) for v in views], names)
        self.argument = argument
        self.flats: dict[str, np.ndarray] = {
            dt: np.zeros(n, dtype=dtypes.BY_NAME[dt].numpy)
            for dt, n in bucket_sizes(self.specs).items()}

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

    def buffers(self) -> list[np.ndarray]:
        """The flat buffers, one per dtype, in the order of first appearance."""
        return list(self.flats.values())

    def views(self) -> list[np.ndarray]:
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
        v = tensor_view(tensor, arg, writable=writable)
        shape = self._shape(tensor, v)
        if shape != spec.shape or _dtype_of(v) != spec.dtype:
            raise InvalidArgumentError(
                arg, f"{spec.label()} was set up as {spec.describe()}, got "
                f"shape {shape} {_dtype_of(v)}")
        return v

    def _slot(self, spec: TensorSpec) -> np.ndarray:
        return self.flats[spec.dtype][spec.offset:spec.offset + spec.count]

    def pack(self, tensors: Sequence[Any]) -> None:
        """Copy ``tensors`` into the bucket; a ``None`` entry (a gradient that was
        never computed) becomes zeros."""
        tensors = self._check_count(tensors)
        views = [None if t is None else self._view(s, t, False)
                 for s, t in zip(self.specs, tensors)]  # validate all before copying
        for spec, v in zip(self.specs, views):
            if v is None:
                self._slot(spec).fill(0)
            elif isinstance(v, DeviceView):
                v.read_into(self._slot(spec))
            else:
                np.copyto(self._slot(spec), v)

    def unpack(self, tensors: Sequence[Any]) -> None:
        """Copy the bucket into ``tensors``, in place (they must be writable)."""
        tensors = self._check_count(tensors)
        views = [self._view(s, t, True) for s, t in zip(self.specs, tensors)]
        for spec, v in zip(self.specs, views):
            if isinstance(v, DeviceView):
                v.write_from(self._slot(spec))
            else:
                np.copyto(v, self._slot(spec))
