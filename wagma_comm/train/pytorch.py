"""PyTorch integration: :class:`DistributedOptimizer` wraps any ``torch.optim``
optimizer so a training loop adopts WAGMA-SGD (or a baseline) in a few lines::

    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                               momentum=0.9),
                               comm, "wagma", model=model, group_size=4, sync_every=10)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # averaging starts during backward
        opt.step()                        # wait, apply the average, optimizer step
    opt.finalize(); opt.close()

Order per iteration (ALGORITHMS.md section 2): the gradient is taken at the
pre-averaging weights, the weights (or, for gradient methods, the gradients) are
averaged, then the wrapped optimizer steps. Model averaging needs only the
weights, which nothing changes between ``step()`` and the next ``step()``, so it
starts as early as the wrapper hears of the iteration: at ``zero_grad()``, or
else at the first gradient hook of the backward pass, and overlaps the forward
and backward passes. Gradient averaging starts at the hook that completes the
last gradient (one flat message per dtype cannot leave earlier).
``overlap=False`` starts everything in ``step()`` instead.

Parameters travel as one flat bucket per dtype. For CUDA parameters the
buckets stay on the GPU where the method allows (``buckets="auto"``): the
collectives, partial ones included, then run on them through NCCL and our
kernels; otherwise they are staged through pinned host memory.
"""

from __future__ import annotations

import operator
import threading
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .. import dtypes
from ..errors import CommunicatorClosedError, InvalidArgumentError
from ..torch_views import numpy_of
from .methods import MODEL, AveragingInfo, Method, make_method
from .placement import BUCKET_MEMORY, agree_at_setup, check_choice
from .specs import TensorSpec, agree_on_failure, bucket_sizes, check_consistent, layout
from .stats import WaitStats

__all__ = ["BUCKET_MEMORY", "DistributedOptimizer", "TorchBucket", "torch_dtype",
           "torch_dtype_name"]

_TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16",
                 torch.float32: "float32", torch.float64: "float64",
                 torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8"}
_BY_NAME = {v: k for k, v in _TORCH_DTYPES.items()}
_STATE_FORMAT = 1


def torch_dtype_name(dtype: torch.dtype, argument: str) -> str:
    name = _TORCH_DTYPES.get(dtype)
    if name is None:
        raise InvalidArgumentError(argument, f"unsupported dtype {dtype}; expected one of "
                                   f"{sorted(_TORCH_DTYPES.values())}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wagma dtype name (one the training layer takes)."""
    return _BY_NAME[name]


def _specs(tensors: Sequence[torch.Tensor], names: Sequence[str | None],
           argument: str) -> tuple[TensorSpec, ...]:
    return layout([tuple(t.shape) for t in tensors],
                  [torch_dtype_name(t.dtype, f"{argument}[{i}]")
                   for i, t in enumerate(tensors)], names)


class TorchBucket:
    """Flat buckets for torch tensors on one device, one tensor per dtype.

    ``on_device=False`` (host buckets): the collectives run on NumPy views of
    host memory; for CUDA tensors that is a pinned host mirror, copied across
    at every pack and unpack. ``on_device=True`` (device buckets): the
    collectives take the flat tensors themselves (CUDA: NCCL and our kernels,
    no host copy; the stream contract of docs/gpu.md orders them after the
    packing copies, so nothing here synchronizes)."""

    def __init__(self, specs: Sequence[TensorSpec], device: torch.device,
                 on_device: bool = False, *, argument: str = "params") -> None:
        self.specs = tuple(specs)
        self.argument = argument  # how errors name a tensor: params[3], buffers[0]
        self.device = device
        self.on_device = on_device
        staged = device.type != "cpu" and not on_device
        self._flat: dict[str, torch.Tensor] = {}
        self._host: dict[str, torch.Tensor] = {}  # the pinned mirror, when staged
        self._np: dict[str, np.ndarray] = {}
        for dt, n in bucket_sizes(self.specs).items():
            flat = torch.zeros(n, dtype=_BY_NAME[dt], device=device)
            self._flat[dt] = flat
            if staged:
                self._host[dt] = torch.zeros(n, dtype=_BY_NAME[dt], pin_memory=True)
            if not on_device:
                self._np[dt] = numpy_of(self._host.get(dt, flat))
                assert dtypes.from_numpy(self._np[dt].dtype) is dtypes.BY_NAME[dt]
        # Each tensor's slot, shaped like it: made once, because building the
        # views every call cost more than the copies (about 30 us per pack
        # of a 4-tensor model against 8 us).
        self._views = [self._flat[spec.dtype].narrow(0, spec.offset, spec.count).view(spec.shape)
                       for spec in self.specs]

    def buffers(self) -> list[Any]:
        """The collectives' buffers, one per dtype, in layout order: NumPy
        views of host memory, or the flat tensors of a device bucket."""
        # A dtype whose tensors are all empty has nothing to send (and the
        # collectives refuse empty buffers); every rank has the same layout.
        if self.on_device:
            return [b for b in self._flat.values() if b.numel()]
        return [b for b in self._np.values() if b.size]

    def _check(self, tensors: Sequence[torch.Tensor | None]) -> None:
        """Each tensor still has its set-up shape, dtype and device: ``copy_``
        would broadcast a shape, cast a dtype (``model.double()``) and move
        across devices without a word."""
        for spec, view, t in zip(self.specs, self._views, tensors):
            if t is None:
                continue
            arg = f"{self.argument}[{spec.index}]"
            if t.layout != torch.strided:  # copy_ would raise a bare RuntimeError
                raise InvalidArgumentError(
                    arg, f"{spec.label()} is a {t.layout} tensor (a sparse gradient: "
                    "nn.Embedding(sparse=True)?); only dense tensors are averaged")
            if t.shape != view.shape or t.dtype != view.dtype or t.device != self.device:
                raise InvalidArgumentError(
                    arg, f"{spec.label()} is now {tuple(t.shape)} "
                    f"{t.dtype} on {t.device}; set-up saw {spec.describe()} on {self.device}")

    @torch.no_grad()
    def pack(self, tensors: Sequence[torch.Tensor | None]) -> None:
        """Copy tensors in (``None`` -> zeros), then to the host mirror."""
        self._check(tensors)
        for view, t in zip(self._views, tensors):
            if t is None:
                view.zero_()
            else:
                view.copy_(t)
        for dt, host in self._host.items():
            host.copy_(self._flat[dt])

    def _from_host(self) -> None:
        """The collectives wrote the host mirror: copy it to the device buffers."""
        for dt, host in self._host.items():
            self._flat[dt].copy_(host)

    @torch.no_grad()
    def unpack(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the result into ``tensors`` in place."""
        self._check(tensors)
        self._from_host()
        for view, t in zip(self._views, tensors):
            t.copy_(view)

    @torch.no_grad()
    def unpack_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Write the result as each trainable parameter's ``.grad`` (created if
        missing). Frozen parameters (``requires_grad=False``) keep theirs, as
        in plain torch: a zero gradient would let weight decay and momentum
        move them."""
        self._check([p.grad for p in params])
        self._from_host()
        for view, p in zip(self._views, params):
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(view)


def _model_extras(model: torch.nn.Module | None, params: Sequence[torch.Tensor]
                  ) -> tuple[list[torch.Tensor], tuple[TensorSpec, ...]]:
    """What the set-up broadcast sends besides the optimizer's parameters:
    ``model``'s buffers and the parameters the optimizer does not hold,
    checked here, before any communication (they were checked after the
    parameters' broadcast). A dtype the collectives do not take (a bool
    mask, int8) travels as its bytes: a broadcast only copies them."""
    if model is None:
        return [], ()
    own = {id(p) for p in params}
    named = [(n, p) for n, p in model.named_parameters() if id(p) not in own]
    named += list(model.named_buffers())
    tensors = []
    for i, (name, t) in enumerate(named):
        if t.dtype not in _TORCH_DTYPES:
            if t.layout != torch.strided or not t.is_contiguous():
                raise InvalidArgumentError(
                    f"buffers[{i}]", f"{name!r} is a non-contiguous or sparse {t.dtype} "
                    "tensor; the set-up broadcast sends such dtypes as the tensor's bytes")
            t = t.detach().view(-1).view(torch.uint8)  # a view: unpacking writes into it
        if t.device != (tensors[0].device if tensors else t.device):
            raise InvalidArgumentError(
                "model", f"buffers[{i}] ({name!r}) is on {t.device} but buffers[0] "
                f"({named[0][0]!r}) is on {tensors[0].device}; the set-up broadcast "
                "needs every buffer on one device")
        tensors.append(t)
    return tensors, (_specs(tensors, [n for n, _ in named], "buffers") if tensors else ())


def _unique_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class DistributedOptimizer:
    """Wraps ``optimizer`` with a training method (WAGMA-SGD by default).

    Collective to create. It checks every rank has the same parameters (a
    :class:`~wagma_comm.train.ParameterMismatchError` names the first one that
    differs and the ranks), broadcasts rank 0's weights (and ``model``'s
    buffers) so all replicas start equal, and sets up the method.

    ``model`` (optional) gives parameter names for errors and its buffers
    (e.g. BatchNorm statistics) for the initial broadcast. ``buckets``: where
    the flat buckets the collectives run on live: ``"device"`` (the
    parameters' own device: no host copies; every method but ``dpsgd`` and
    ``sgp``, whose exchange is host-only), ``"host"`` (staged through pinned
    host memory for CUDA parameters) or ``"auto"`` (device buckets for CUDA
    parameters when the method and every rank's NCCL allow, host otherwise;
    CPU parameters use host buckets, whose NumPy views take the fastest path). ``knobs`` go to
    :func:`~wagma_comm.train.make_method`: ``group_size``, ``sync_every``,
    ``activation``, ``normalization``, ``round_start``, ``seed``, ``mpi_comm``.
    Use ``opt.optimizer`` for learning-rate schedulers.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Any,
                 method: str | Method = "wagma", *, model: torch.nn.Module | None = None,
                 overlap: bool = True, broadcast: bool = True, buckets: str = "auto",
                 **knobs: Any) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError("optimizer", f"expected a torch.optim.Optimizer, got "
                                       f"{type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            # Its step re-evaluates the closure (a backward each time) several
            # times: one averaging per iteration cannot serve it, and step()
            # without the closure failed with a bare TypeError.
            raise InvalidArgumentError("optimizer", "LBFGS evaluates its closure several "
                                       "times per step; wrap an optimizer whose step "
                                       "takes one gradient (SGD, Adam, ...)")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError("model", f"expected a torch.nn.Module, got "
                                       f"{type(model).__name__}")
        for name in ("size", "rank", "allreduce", "broadcast"):
            if not hasattr(comm, name):
                raise InvalidArgumentError("comm", f"expected a wagma_comm Communicator "
                                           f"(wagma_comm.init()), got {type(comm).__name__}")
        for name, flag in (("overlap", overlap), ("broadcast", broadcast)):
            if not isinstance(flag, bool):  # a truthy string or None would be taken silently
                raise InvalidArgumentError(name, f"expected a bool, got {type(flag).__name__}")
        self.optimizer = optimizer
        self.comm = comm
        self.method = make_method(method, **knobs)
        check_choice(buckets, self.method)  # before check_consistent communicates
        self.params = _unique_params(optimizer)
        if not self.params:
            raise InvalidArgumentError("optimizer", "has no parameters")
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self.names = [names.get(id(p)) for p in self.params]
        self.specs = _specs(self.params, self.names, "params")
        if not any(spec.count for spec in self.specs):
            raise InvalidArgumentError("optimizer", "its parameters hold no elements")
        device = self.params[0].device
        for spec, p in zip(self.specs, self.params):
            if p.device != device:
                raise InvalidArgumentError(
                    "optimizer", f"{spec.label()} is on {p.device} but parameter 0 is on "
                    f"{device}; all parameters must share one device")
        self.method.check_size(comm.size)  # not after the weights' broadcast
        extras = _model_extras(model, self.params) if broadcast else ([], ())
        check_consistent(comm, self.specs)
        self._on_device = agree_at_setup(comm, buckets, device.type, self.method)
        # Each bucket only where it is used: a model method never uses a
        # gradient bucket, a gradient method uses the weights' bucket only
        # for the set-up broadcast (kept, it held a whole copy of the model,
        # for staged CUDA parameters another in pinned host memory, for
        # nothing). What is kept is released at close().
        model_method = self.method.averages == MODEL
        self._weights: TorchBucket | None = (
            TorchBucket(self.specs, device, self._on_device)
            if model_method or broadcast else None)
        self._grads: TorchBucket | None = (
            None if model_method else TorchBucket(self.specs, device, self._on_device))
        # The parameters each group held when wrapped: a group added since
        # (opt.optimizer.add_param_group) or a parameter replaced by another
        # tensor would be stepped, never averaged.
        self._group_params = [list(g["params"]) for g in optimizer.param_groups]
        if broadcast:
            self._broadcast(*extras)
        if not model_method:
            self._weights = None
        self.iteration = 0
        self.last_info: AveragingInfo | None = None
        self.stats = WaitStats()
        self._lock = threading.Lock()
        self._started = False
        self._ready: set[int] = set()
        self._needs_grad = sum(p.requires_grad for p in self.params)
        self._synced: AveragingInfo | None = None  # synchronize() ran this iteration
        self._packed_versions: list[tuple[int, int] | None] = []
        self._closed = False
        self._final_statistics: dict[str, Any] = {}  # the collectives' at close()
        self._overlap = overlap
        self._setup()
        self._hooks: dict[int, Any] = {}
        self._hook_trainable()

    # -- set-up -----------------------------------------------------------------------
    def _broadcast(self, buffers: list[torch.Tensor], specs: Sequence[TensorSpec]) -> None:
        """Rank 0's weights everywhere: the optimizer's parameters, and
        ``buffers`` (:func:`_model_extras`: ``model``'s buffers and the
        parameters the optimizer does not hold, a frozen backbone, which
        nothing would ever average)."""
        weights = self._weights
        assert weights is not None  # made before the broadcast
        weights.pack(self.params)
        for b in weights.buffers():
            self.comm.broadcast(b, root=0)
        weights.unpack(self.params)
        if buffers:
            check_consistent(self.comm, specs)
            bucket = TorchBucket(specs, buffers[0].device, self._on_device, argument="buffers")
            bucket.pack(buffers)
            for b in bucket.buffers():
                self.comm.broadcast(b, root=0)
            bucket.unpack(buffers)

    @property
    def _work(self) -> TorchBucket:
        """The bucket the method averages: the weights' or the gradients'
        (released at close(), after which every use is refused)."""
        work = self._weights if self.method.averages == MODEL else self._grads
        assert work is not None, "the buckets are released at close()"
        return work

    def _setup(self) -> None:
        work = self._work
        if self.method.averages == MODEL:
            work.pack(self.params)
        self.method.setup(self.comm, work.buffers(), self.iteration)

    # -- per iteration -------------------------------------------------------------------
    def _hook_trainable(self) -> None:
        """With ``overlap``: a gradient hook on every trainable parameter that
        has none yet. A parameter unfrozen after wrapping gets its hook here
        (at the next zero_grad() or step()); until then averaging starts in
        step(), once its gradient exists, since the count of gradients to wait
        for includes it. None after close(): the hook kept the closed wrapper
        (its method, its buckets) alive from the parameter."""
        if not self._overlap or self._closed:
            return
        for p in self.params:
            if p.requires_grad and id(p) not in self._hooks:
                self._hooks[id(p)] = p.register_post_accumulate_grad_hook(self._on_grad)

    def _check_groups(self) -> None:
        """The wrapped optimizer still has the parameter groups it was wrapped
        with: a group added since (``opt.optimizer.add_param_group``), or a
        parameter replaced in a group by another tensor, was stepped with
        each rank's own gradient, never broadcast nor averaged (the buckets
        kept averaging the old tensor), and the replicas diverged silently.
        Local (an identity check per parameter), before any communication."""
        groups = self.optimizer.param_groups
        wrapped = self._group_params
        if len(groups) == len(wrapped) and all(  # every iteration: C-level identity checks
                len(g["params"]) == len(w) and all(map(operator.is_, g["params"], w))
                for g, w in zip(groups, wrapped)):
            return
        if len(groups) != len(wrapped) or any(
                len(g["params"]) != len(w) for g, w in zip(groups, wrapped)):
            raise InvalidArgumentError(
                "optimizer", f"its parameter groups changed after wrapping ({len(groups)} "
                f"groups of {[len(g['params']) for g in groups]} parameters; wrapped with "
                f"{[len(w) for w in wrapped]}): parameters outside the set-up layout would "
                "be stepped but never averaged; add groups to the optimizer before "
                "wrapping it")
        for k, (g, w) in enumerate(zip(groups, wrapped)):
            for j, (p, q) in enumerate(zip(g["params"], w)):
                if p is not q:
                    i = next(n for n, x in enumerate(self.params) if x is q)
                    raise InvalidArgumentError(
                        "optimizer", f"param_groups[{k}]['params'][{j}] was "
                        f"{self.specs[i].label()} when wrapped and is now another tensor: "
                        "it would be stepped but never averaged (the buckets hold the old "
                        "one); change a parameter's data in place, or wrap the optimizer "
                        "again")

    def _start(self) -> None:
        """(under _lock) Begin this iteration: pack what the method averages."""
        t = self.iteration
        bucket = self._work
        if self.method.averages == MODEL:
            tensors = list(self.params)
        else:
            tensors = [p.grad for p in self.params]
            # What step() compares to see the gradients changed meanwhile.
            self._packed_versions = [None if g is None else (id(g), g._version)
                                     for g in tensors]
        try:
            self._check_groups()
            if self.method.communicates(t):
                bucket.pack(tensors)
            self.method.start(t, bucket.buffers())
        except BaseException:
            # Nothing started: the next backward counts its gradients afresh
            # (stale entries would start it at its first gradient hook).
            self._ready.clear()
            raise
        self._started = True

    def _changed_grad(self) -> int | None:
        """The first parameter whose gradient changed since it was packed
        (clipping, unscaling or scaling it after backward), or None."""
        if self.method.averages == MODEL or not self._packed_versions:
            return None
        for i, (p, packed) in enumerate(zip(self.params, self._packed_versions)):
            g = p.grad
            if (None if g is None else (id(g), g._version)) != packed:
                return i
        return None

    def _on_grad(self, p: torch.Tensor) -> None:
        """Backward hook: a parameter's gradient is complete."""
        with self._lock:
            if self._closed:
                return
            if self.method.averages != MODEL:  # new gradients: the synchronized
                self._end_unstepped()              # iteration is over (not the weights')
            key = id(p)
            if self._started and self.method.averages != MODEL and key in self._ready:
                i = next(k for k, q in enumerate(self.params) if q is p)
                self._packed_versions = []  # reported here: step() need not again
                raise InvalidArgumentError(
                    "overlap", f"{self.specs[i].label()} received a second gradient after "
                    "its averaging started (gradient accumulation over several backward "
                    "passes needs overlap=False)")
            if not self._ready:  # the first gradient of this iteration
                self._needs_grad = sum(q.requires_grad for q in self.params)
            self._ready.add(key)
            if self._started:
                return
            if self.method.averages == MODEL or len(self._ready) >= self._needs_grad:
                self._start()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; with ``overlap``, model averaging
        of the coming iteration starts here (the weights are final until
        ``step()``), so it overlaps the forward and the backward pass."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._hook_trainable()
        with self._lock:
            if self._closed:
                return
            self._end_unstepped()
            if self._overlap and self.method.averages == MODEL and not self._started:
                self._start()

    def _end_unstepped(self) -> None:
        """(under _lock) The next iteration begins (``zero_grad()``; for a
        gradient method also its first new gradient) while the last one was
        averaged (``synchronize()``, or a ``step()`` whose optimizer step
        raised) but never stepped: AMP's ``GradScaler.step`` skips the step of
        an iteration whose gradients overflowed. That iteration is over: its
        round ran on every rank, so it counts. Left open, the next iteration
        reused its average instead of averaging its own gradients (replicas
        diverged silently), or its backward was refused as a second gradient."""
        info, self._synced = self._synced, None
        if info is None:
            return
        self._started = False
        self._ready.clear()
        self.iteration += 1
        self.last_info = info
        self.stats.record(info)

    def _drain(self) -> None:
        """Finish an iteration that was started (``zero_grad``) but will not be
        stepped -- before finalize, close or a restart -- discarding its result:
        every rank started it, so every rank drains it. Its round is used up,
        so it counts as an iteration: the method's rounds (WAGMA's sync
        rounds among them) stay on the iterations they belong to. It counts
        in ``last_info`` and statistics() too, as an iteration averaged by
        synchronize() and never stepped does (statistics() fell behind
        ``iteration``)."""
        with self._lock:
            started, self._started = self._started, False
            synced, self._synced = self._synced, None
            self._ready.clear()
            if started:
                self.iteration += 1
        if synced is not None:  # synchronize() finished it
            self.last_info = synced
            self.stats.record(synced)
        if self.method.in_flight:  # not when synchronize() or a failed finish ended it
            info = self.method.finish()
            self.last_info = info
            self.stats.record(info)

    def _end_iteration(self) -> None:
        with self._lock:
            self._started = False
            self._ready.clear()
            self.iteration += 1

    def _average(self) -> AveragingInfo:
        """Finish this iteration's averaging and write its result into the
        weights or the ``.grad`` s."""
        with self._lock:
            if not self._started:
                self._start()
        changed = self._changed_grad()
        try:
            info = self.method.finish()
            if changed is not None:  # the round is over on every rank: count it
                raise InvalidArgumentError(
                    "step", f"the gradient of {self.specs[changed].label()} changed after its "
                    "averaging started (clip_grad_norm_, GradScaler.unscale_ or scaling after "
                    "backward would be undone); call opt.synchronize() before changing "
                    "gradients, or wrap with overlap=False")
            if info.averaged == MODEL:
                self._work.unpack(self.params)
            elif info.averaged is not None:
                self._work.unpack_grads(self.params)
        except BaseException:
            # The method holds nothing in flight any more (finish() consumed
            # the round, even when it raised): end the iteration, so a retry
            # starts afresh and meets the method's or the communicator's own
            # error, and close() does not wait for a round that is gone.
            self._end_iteration()
            raise
        return info

    def synchronize(self) -> AveragingInfo:
        """Collective: finish this iteration's averaging and apply it now
        (averaged gradients in ``.grad``, or averaged weights), so that the
        gradients may be changed before :meth:`step` -- clipping with
        ``clip_grad_norm_``, AMP's ``GradScaler.unscale_`` -- which then only
        steps the optimizer. Idempotent until that step. An iteration whose
        step is skipped (``GradScaler`` on overflow) ends at the next
        ``zero_grad()`` (gradient methods: also at the next gradient)."""
        self._check_open()
        if self._synced is None:
            self._check_groups()
            self._synced = self._average()
        return self._synced

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finish this iteration's averaging, apply it, then the optimizer step.
        ``closure`` (re-computes the loss and gradients) runs first, as in torch,
        and its gradients are the ones averaged: an iteration already averaged
        by :meth:`synchronize` (or whose optimizer step raised) ends first, as
        at ``zero_grad()``. For a gradient method, a closure after a backward
        whose gradients are being averaged (``overlap``) is refused before it
        runs (InvalidArgumentError naming ``closure``)."""
        self._check_open()
        self._check_groups()  # before the closure's backward and the optimizer step
        loss = None
        if closure is not None:
            self._closure_begins()
            with torch.enable_grad():
                loss = closure()
        if self._synced is None:
            self._synced = self._average()
        # Averaged and applied: if the optimizer step raises, this stays as
        # after synchronize(): a retry only steps, the next zero_grad() or
        # backward moves on (_end_unstepped).
        self.optimizer.step()
        info, self._synced = self._synced, None
        self._end_iteration()
        self._hook_trainable()
        self.last_info = info
        self.stats.record(info)
        return loss

    def _closure_begins(self) -> None:
        """A closure recomputes this iteration's gradients. A gradient method
        whose hooks already took this iteration's gradients (a backward before
        ``step(closure)``) cannot average them again: refused before the
        closure runs (its backward was refused from inside as a "second
        gradient", naming ``overlap``). An iteration :meth:`synchronize`
        averaged ends here, as at ``zero_grad()``: with ``overlap=False``
        and a closure that does not call ``opt.zero_grad()``, step() applied
        the closure's own gradients, unaveraged, and the replicas diverged."""
        with self._lock:
            if self._synced is None and self.method.averages != MODEL and (
                    self._started or self._ready):
                raise InvalidArgumentError(
                    "closure", "a backward of this iteration already started averaging "
                    "its gradients; the closure's backward would not be averaged: call "
                    "step() without a closure, or do not call backward() before "
                    "step(closure)")
            self._end_unstepped()

    # -- end ----------------------------------------------------------------------------
    def finalize(self) -> None:
        """Collective, after the last step. Model methods: every replica becomes
        the global mean (bitwise identical). Gradient methods: what missed its
        rounds is applied with one more optimizer step (if non-zero)."""
        self._check_open()
        self._check_groups()  # before the drain waits
        self._drain()
        work = self._work
        if self.method.averages == MODEL:
            work.pack(self.params)
            self.method.finalize(work.buffers())
            work.unpack(self.params)
        elif self.method.finalize(work.buffers()):
            work.unpack_grads(self.params)
            self.optimizer.step()

    def close(self) -> None:
        """Collective: release the method's collectives, the buckets and the
        hooks (idempotent). :meth:`statistics` keeps the collectives'
        telemetry as it was when they were released."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for h in self._hooks.values():
            h.remove()
        try:
            self._drain()
        finally:
            try:
                self._final_statistics = self.method.statistics()
            finally:
                self._weights = self._grads = None
                self.method.close()

    def __enter__(self) -> "DistributedOptimizer":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # close() is collective and the other ranks may not come; the
            # hooks are local: left on, a later backward of this model (under
            # a new wrapper, say) started this one's collectives.
            for h in self._hooks.values():
                h.remove()

    def _check_open(self) -> None:
        """Refuse work after :meth:`close`, as a closed Averager or
        communicator does (it was an InvalidArgumentError before session 44)."""
        if self._closed:
            raise CommunicatorClosedError(
                f"DistributedOptimizer ({self.method.describe()}) is closed")

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What resuming needs besides the model: the wrapped optimizer's state
        and the round counter. Raises if this iteration could not be resumed
        exactly (partial-collective methods: only after a sync round).

        An iteration averaged by :meth:`synchronize` whose step never came
        (``GradScaler.step`` skipped it) is over, as the next ``zero_grad()``
        will count it: the state is of the iteration after it. Saved as of
        that iteration, a rank whose step was skipped disagreed with the
        others (a checkpoint no rank could load), and a gradient method
        refused the checkpoint as "being averaged"."""
        with self._lock:
            unstepped = self._synced is not None
            if self._started and not unstepped and self.method.averages != MODEL:
                raise InvalidArgumentError("state_dict", "gradients are being averaged; take "
                                           "checkpoints between step() and the next backward")
            iteration = self.iteration + unstepped
        # A model average started by zero_grad() only read the weights, which
        # the checkpoint holds: resuming starts that iteration again.
        err = self.method.checkpoint_error(iteration)
        if err:
            raise InvalidArgumentError("state_dict", err)
        return {"format": _STATE_FORMAT, "optimizer": self.optimizer.state_dict(),
                "iteration": iteration, "method": self.method.name,
                "rank": self.comm.rank, "size": self.comm.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Collective: restore the optimizer and round counter, and restart the
        method's collectives at that iteration from the current weights (load
        the model's state first; :func:`load_checkpoint` does).

        Every rank checks its ``state`` and loads the wrapped optimizer's
        before any collective step, then the ranks agree (one small
        allreduce): a rank that cannot (a bad state, another optimizer's
        layout, a parameter whose dtype changed) or ranks at different
        iterations make every rank raise InvalidArgumentError naming
        ``state_dict`` (``params[i]`` for a changed parameter) and the ranks,
        with the old optimizer state and round counter kept.
        Before, the other ranks loaded theirs (a method with no persistent
        collectives went on diverged) or waited in the restart until the
        communicator's timeout broke it."""
        self._check_open()  # closed: the method's collectives would be made again, never closed
        error: BaseException | None = None
        before: dict[str, Any] | None = None
        iteration = -1
        try:
            iteration = self._checked_iteration(state)
            if self.method.averages == MODEL:  # what _setup packs, checked before the restart
                self._work._check(self.params)
            before = self.optimizer.state_dict()
            self.optimizer.load_state_dict(state["optimizer"])
        except Exception as exc:  # noqa: BLE001 - every rank hears of it in _agree_on
            error = exc
        try:
            self._agree_on(error, iteration)
            self._drain()
        except BaseException:
            if before is not None:  # the state this rank loaded (or half loaded) goes
                self.optimizer.load_state_dict(before)
            raise
        with self._lock:
            self.iteration = iteration
        self.method.close()
        self._setup()

    def _checked_iteration(self, state: Any) -> int:
        """The iteration of ``state``, if this optimizer can resume it."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise InvalidArgumentError("state_dict", "not a DistributedOptimizer state "
                                       f"(format {_STATE_FORMAT})")
        if state.get("method") != self.method.name:
            raise InvalidArgumentError("state_dict", f"saved with method {state.get('method')!r}"
                                       f", this optimizer runs {self.method.name!r}")
        if state.get("size") != self.comm.size:
            raise InvalidArgumentError("state_dict", f"saved on {state.get('size')} ranks, "
                                       f"resuming on {self.comm.size}")
        iteration = state.get("iteration")
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise InvalidArgumentError("state_dict", f"bad iteration {iteration!r}")
        err = self.method.checkpoint_error(iteration)
        if err:
            raise InvalidArgumentError("state_dict", err)
        if not isinstance(state.get("optimizer"), dict):
            raise InvalidArgumentError("state_dict", "holds no optimizer state "
                                       "(expected a dict under 'optimizer')")
        return iteration

    def _agree_on(self, error: BaseException | None, iteration: int) -> None:
        """Collective (one small allreduce, the communicator's deadline): raise
        on every rank if any rank failed to load its state (``error``), or if
        the ranks would resume at different iterations."""
        iterations = agree_on_failure(self.comm, error, "state_dict",
                                      "load their optimizer state", iteration)
        if len(set(iterations)) > 1:
            per = ", ".join(f"rank {r}: {i}" for r, i in enumerate(iterations))
            raise InvalidArgumentError(
                "state_dict", f"the ranks' states are of different iterations ({per}); "
                "load states saved together")

    # -- telemetry & delegation ------------------------------------------------------------
    @property
    def buckets(self) -> str:
        """Where the buckets live, as agreed at set-up: ``"device"`` or ``"host"``."""
        return "device" if self._on_device else "host"

    def statistics(self) -> dict[str, Any]:
        """Iterations, waiting time, staleness, and the method's collective's
        own telemetry; after close() (the collectives are gone) as it was then."""
        out = self.stats.as_dict()
        out["method"] = self.method.describe()
        out["buckets"] = self.buckets
        out["collective"] = self._final_statistics if self._closed else self.method.statistics()
        return out

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def add_param_group(self, group: dict[str, Any]) -> None:
        raise InvalidArgumentError("param_group", "the parameter layout is fixed at set-up; "
                                   "add groups to the optimizer before wrapping it")

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, "
                f"{self.method.describe()}, iteration {self.iteration})")

