"""The framework-agnostic training layer: one iteration's averaging of a list of
tensors, whatever framework they come from (through DLPack).

::

    avg = Averager(comm, params, "wagma", group_size=4, sync_every=10)
    for t in range(steps):
        grads = gradient(params)              # at the pre-averaging weights
        avg.average(params, grads)            # model methods: params <- group mean
        for w, g in zip(params, grads):       # gradient methods: grads <- mean
            w -= lr * g                       # the optimizer step
    avg.finalize(params); avg.close()

NumPy arrays and PyTorch CPU tensors are updated in place. Immutable arrays
(JAX) are only read: pass ``copy=True`` and use the returned arrays.

CUDA tensors (CuPy, PyTorch, JAX, ...) get their flat buckets on the GPU
where every rank can (``buckets="auto"``): the collectives then run on GPU
memory through NCCL, with no host copy (this needs torch for the device
copies). Otherwise they are staged through host buckets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import CommunicatorClosedError, InvalidArgumentError
from .bucket import DeviceBucket, FlatBucket, common_device
from .methods import MODEL, AveragingInfo, Method, make_method
from .methods.base import check_int
from .placement import agree_at_setup, check_choice
from .specs import check_consistent
from .stats import WaitStats

__all__ = ["Averager", "Averaged"]


def _listed(tensors: Any, argument: str) -> Any:
    """``tensors`` as a list or tuple (None stays None): a generator would be
    used up by its first reading, and the next (the layout after the check,
    finish after start) would find no tensors."""
    if tensors is None or isinstance(tensors, (list, tuple)):
        return tensors
    return FlatBucket._check_list(tensors, argument)


def _flag(argument: str, value: Any) -> bool:
    """A bool argument, refused otherwise: None or a string was taken for
    its truth value without a word (``copy=None`` wrote in place)."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(argument, f"expected a bool, got {type(value).__name__}")
    return value


def _check_comm(comm: Any) -> None:
    """What the Averager calls on ``comm``, checked as DistributedOptimizer
    does (``None`` failed with a bare AttributeError)."""
    for name in ("size", "rank", "allreduce", "broadcast"):
        if not hasattr(comm, name):
            raise InvalidArgumentError("comm", f"expected a wagma_comm Communicator "
                                       f"(wagma_comm.init()), got {type(comm).__name__}")


@dataclass(frozen=True)
class Averaged:
    """What :meth:`Averager.average` / :meth:`Averager.finalize` return.

    ``params``/``grads``: the tensors to use from now on (the caller's own
    objects when updated in place; with ``copy=True`` fresh NumPy arrays, or
    torch tensors on the device with device buckets).
    ``apply``: after :meth:`Averager.finalize` of a gradient method, whether
    ``grads`` hold a leftover averaged gradient the caller should apply.
    """

    info: AveragingInfo | None
    params: list[Any]
    grads: list[Any] | None
    apply: bool = False


class Averager:
    """Averages a fixed list of tensors once per iteration with a method.

    Collective to create: checks that every rank has the same tensors (count,
    shapes, dtypes; :class:`~wagma_comm.train.ParameterMismatchError` names
    the first difference), broadcasts rank 0's values (``broadcast=True``;
    written into ``params`` when they are writable, else read them back with
    :meth:`model`), and sets up the method. ``knobs`` go to
    :func:`~wagma_comm.train.make_method` (group_size, sync_every, ...).

    ``buckets``: where the flat buckets live. ``"device"``: on the tensors'
    own device, as torch tensors the collectives take directly (every
    tensor on one device; every method but ``dpsgd`` and ``sgp``, whose
    exchange is host-only). ``"host"``: NumPy buffers, device tensors staged
    through them. ``"auto"`` (default): device buckets for CUDA tensors when
    the method and every rank's NCCL allow, host buckets otherwise. Agreed
    by every rank at creation; :attr:`buckets` says what was chosen.
    """

    def __init__(self, comm: Any, params: Sequence[Any], method: str | Method = "wagma", *,
                 names: Sequence[str | None] | None = None, broadcast: bool = True,
                 first_iteration: int = 0, buckets: str = "auto", **knobs: Any) -> None:
        params = _listed(params, "params")  # walked several times below
        if names is not None and not isinstance(names, (str, bytes, list, tuple)) \
                and hasattr(names, "__iter__"):
            names = list(names)  # read three times below (a generator was empty the second)
        self.method = make_method(method, **knobs)
        _check_comm(comm)
        broadcast = _flag("broadcast", broadcast)
        self.comm = comm
        self.iteration = check_int("first_iteration", first_iteration, 0)
        check_choice(buckets, self.method)
        self.method.check_size(comm.size)  # before the set-up communicates
        # Every tensor is checked (and the layout made) before any communication.
        specs = FlatBucket.layout_of(params, names, argument="params")
        if not any(spec.count for spec in specs):
            raise InvalidArgumentError("params", "its tensors hold no elements; nothing to "
                                       "average")
        device = common_device(params)
        if buckets == "device" and device is None:
            raise InvalidArgumentError("buckets", "device buckets need every tensor on one "
                                       "device; these are on several (use 'host' or 'auto')")
        self._on_device = agree_at_setup(comm, buckets, device and device[0], self.method)
        bucket = DeviceBucket if self._on_device else FlatBucket
        self._model = bucket(params, names, argument="params")
        # A model method never uses a gradient bucket: a whole copy of the
        # model (on the GPU, with device buckets) was allocated for nothing.
        self._grads = (None if self.method.averages == MODEL
                       else bucket(params, names, argument="grads"))
        check_consistent(comm, specs)
        self._model.pack(params)
        if broadcast:
            for b in self._model.buffers():
                comm.broadcast(b, root=0)
            # Into every writable tensor; immutable ones (JAX) are read back
            # with model(). One read-only tensor used to stop every write, so
            # each rank kept its own values of the writable ones.
            self._model.unpack(self._model.writable(params))
        self.stats = WaitStats()
        self._closed = False
        self._final_statistics: dict[str, Any] = {}  # the collectives' at close()
        self.method.setup(comm, self._work.buffers(), self.iteration)

    @property
    def _work(self) -> FlatBucket:
        """The bucket the method averages: the model's, or the gradients'
        (released at close(), after which every use is refused)."""
        work = self._model if self.method.averages == MODEL else self._grads
        assert work is not None, "the gradient bucket is released at close()"
        return work

    @property
    def specs(self) -> tuple[Any, ...]:
        """The layout: one TensorSpec per tensor (index, name, shape, dtype, offset)."""
        return self._model.specs

    @property
    def averages(self) -> str:
        """``"model"`` or ``"gradients"``: which list the method changes."""
        return self.method.averages

    @property
    def buckets(self) -> str:
        """Where the buckets live, as agreed at creation: ``"device"`` or ``"host"``."""
        return "device" if self._on_device else "host"

    def model(self) -> list[Any]:
        """Copies of the model as last packed (after construction: rank 0's):
        NumPy arrays, or torch tensors on the device with device buckets."""
        return self._model.copies()

    # -- one iteration --------------------------------------------------------------
    def _target(self, params: Sequence[Any], grads: Sequence[Any] | None) -> Sequence[Any]:
        if self.method.averages == MODEL:
            return self._whole_model(params)
        if grads is None:
            raise InvalidArgumentError("grads", f"{self.method.name} averages gradients; "
                                       "pass the gradients")
        return grads

    def start(self, params: Sequence[Any], grads: Sequence[Any] | None = None) -> None:
        """Begin this iteration's averaging (packs what the method averages);
        the inputs are read now and may change before :meth:`finish`."""
        self._check_open()
        if self.method.in_flight:  # before packing: the round in flight reads the buckets
            raise InvalidArgumentError("start", f"{self.method.name}: iteration "
                                       f"{self.iteration} was started and not finished")
        t = self.iteration
        params, grads = _listed(params, "params"), _listed(grads, "grads")
        target = self._target(params, grads)  # checked every iteration, alike
        if self.method.communicates(t):
            self._work.pack(target)
        self.method.start(t, self._work.buffers())

    def finish(self, params: Sequence[Any], grads: Sequence[Any] | None = None, *,
               copy: bool = False) -> Averaged:
        """Wait for the result and write it into ``params`` or ``grads`` (in place),
        or with ``copy=True`` return it as new arrays, leaving the inputs alone.
        Where the result would go is checked first: a missing or read-only
        target raises with the iteration still in flight (finish again, or
        with ``copy=True``) instead of after the wait, its result lost."""
        self._check_open()  # close() drained the iteration (and released the gradients)
        copy = _flag("copy", copy)
        params, grads = _listed(params, "params"), _listed(grads, "grads")  # read twice
        if self.method.in_flight:  # else the method says that nothing was started
            self._check_writable(params, grads, copy)
        return self._finish(params, grads, copy)

    def _finish(self, params: Sequence[Any], grads: Sequence[Any] | None,
                copy: bool) -> Averaged:
        info = self.method.finish()
        self.iteration += 1
        self.stats.record(info)
        return self._deliver(info, info.averaged is not None, params, grads, copy)

    def average(self, params: Sequence[Any], grads: Sequence[Any] | None = None, *,
                copy: bool = False) -> Averaged:
        """:meth:`start` then :meth:`finish`: one iteration's averaging."""
        self._check_open()
        copy = _flag("copy", copy)
        params, grads = _listed(params, "params"), _listed(grads, "grads")  # read twice
        self._check_writable(params, grads, copy)  # before the round: nothing communicated
        self.start(params, grads)
        return self._finish(params, grads, copy)

    def _check_writable(self, params: Sequence[Any], grads: Sequence[Any] | None,
                        copy: bool, communicates: bool | None = None) -> None:
        """Local check that the result can be written in place (``copy=False``)
        where it will be: a read-only target (a JAX array) or a gradient
        method's missing ``grads`` raised only after the round, its result
        lost (for ``grads``, as a bare AssertionError)."""
        if communicates is None:
            communicates = self.method.communicates(self.iteration)
        if copy or not communicates:
            return
        if self.method.averages == MODEL:
            self._work.check_writable(params)
        elif grads is None:
            raise InvalidArgumentError("grads", f"{self.method.name} averages gradients: pass "
                                       "the gradients to write the average into, or "
                                       "copy=True")
        else:
            self._work.check_writable(grads)

    @staticmethod
    def _whole_model(params: Sequence[Any]) -> Sequence[Any]:
        """A model method averages every tensor: a ``None`` is refused here,
        before any communication (it would be averaged as zeros)."""
        if isinstance(params, (list, tuple)):
            for i, p in enumerate(params):
                if p is None:
                    raise InvalidArgumentError(f"params[{i}]", "is None; a model method "
                                               "averages every tensor of the model")
        return params

    def _deliver(self, info: AveragingInfo | None, changed: bool, params: Sequence[Any],
                 grads: Sequence[Any] | None, copy: bool, apply: bool = False) -> Averaged:
        params = list(params)
        grads = None if grads is None else list(grads)
        if changed:
            model = self.method.averages == MODEL
            if copy:
                out = self._work.copies()
                params, grads = (out, grads) if model else (params, out)
            else:
                target = params if model else grads
                assert target is not None
                self._work.unpack(target)
                if any(t is None for t in target):  # a gradient never computed:
                    fresh = self._work.copies()     # its average comes back new
                    target[:] = [f if t is None else t for t, f in zip(target, fresh)]
        return Averaged(info, params, grads, apply)

    # -- end ------------------------------------------------------------------------
    def finalize(self, params: Sequence[Any], grads: Sequence[Any] | None = None, *,
                 copy: bool = False) -> Averaged:
        """Collective, after the last iteration. Model methods: every replica
        becomes the global mean (bitwise identical). Gradient methods: what
        missed its rounds lands in ``grads``; apply it when ``apply`` is True.
        Everything it reads and writes is checked before any wait (the
        drain of an iteration in flight included)."""
        self._check_open()
        copy = _flag("copy", copy)
        params, grads = _listed(params, "params"), _listed(grads, "grads")  # read twice
        if self.method.averages == MODEL:
            # What pack reads (a None, a changed tensor) and, in place, where
            # the result goes: these were found after the drain had waited.
            self._work.check(self._whole_model(params), writable=not copy)
        elif grads is not None:
            self._check_writable(params, grads, copy, communicates=True)
        self._drain()
        if self.method.averages == MODEL:
            self._work.pack(params)
            self.method.finalize(self._work.buffers())
            return self._deliver(None, True, params, grads, copy)
        if grads is None:
            grads = self._work.copies()  # only the shapes matter; contents are replaced
            copy = True
        leftover = self.method.finalize(self._work.buffers())
        return self._deliver(None, leftover, params, grads, copy, apply=leftover)

    def _drain(self) -> None:
        """Finish an iteration that was started and will not be finished
        (``start`` then ``finalize`` or ``close``), discarding its result, as
        DistributedOptimizer does: every rank started it, so every rank drains
        it, and its round is used up, so it counts (the method's sync rounds
        stay on their iterations), in the statistics too (they fell behind
        ``iteration``). Left in flight, its round was never waited for, the
        buffers were repacked under it, and the next ``start`` was refused."""
        if self.method.in_flight:
            info = self.method.finish()
            self.iteration += 1
            self.stats.record(info)

    def _check_open(self) -> None:
        """Refuse work after :meth:`close`, locally: the method's collectives
        are gone (a bare IndexError or AssertionError from inside the method
        before), or a blocking method would start a collective alone."""
        if self._closed:
            raise CommunicatorClosedError(f"Averager ({self.method.describe()}) is closed")

    def close(self) -> None:
        """Collective: finish an iteration left in flight, then release the
        method's collectives and the gradient bucket (idempotent). The
        model bucket stays for :meth:`model`, and :meth:`statistics` keeps
        the collectives' telemetry as it was when they were released."""
        if self._closed:
            return
        self._closed = True
        try:
            self._drain()
        finally:
            try:
                self._final_statistics = self.method.statistics()
            finally:
                self._grads = None
                self.method.close()

    def __enter__(self) -> "Averager":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()

    def statistics(self) -> dict[str, Any]:
        """Iterations, waiting time, staleness, and the method's collective's own
        telemetry (partial collectives: see docs/partial.md)."""
        out = self.stats.as_dict()
        out["method"] = self.method.describe()
        out["buckets"] = self.buckets
        # After close() the method's collectives are gone ({}): their last telemetry.
        out["collective"] = self._final_statistics if self._closed else self.method.statistics()
        return out
