"""What every training method provides, and what one iteration reports.

A method averages either the *model* (weights, before the optimizer step:
WAGMA-SGD's order, also D-PSGD's) or the *gradients* (before the optimizer step)
of one iteration. It works on the flat buffers of a bucket (one per dtype, in
the same order on every rank): NumPy arrays for host buckets, or, for the
PyTorch adapter's device buckets, torch tensors the collectives take as they
are (CUDA tensors go through NCCL and our kernels). It touches them only
through the communicator and the three helpers below, so it never depends on
a framework: the adapters pack, call :meth:`Method.start` as early as they can
(so communication overlaps the rest of the backward pass), then
:meth:`Method.finish` before the optimizer step, and unpack.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np

from ...errors import CommunicatorClosedError, InvalidArgumentError
from ...partial.info import RoundInfo

MODEL, GRADIENTS = "model", "gradients"

BucketBuffer = Any
"""One dtype's flat buffer: a NumPy array, or a torch tensor of a device bucket."""


def clone(buf: BucketBuffer) -> BucketBuffer:
    """A private copy, in the same memory (host or device) as ``buf``."""
    return buf.copy() if isinstance(buf, np.ndarray) else buf.clone()


def zeros_like(buf: BucketBuffer) -> BucketBuffer:
    """Zeros shaped and typed like ``buf``, in the same memory."""
    return np.zeros_like(buf) if isinstance(buf, np.ndarray) else buf.new_zeros(buf.shape)


def any_bit_set(buf: BucketBuffer) -> bool:
    """Whether any byte of ``buf`` is non-zero (so -0.0 counts: it is an update
    that some rank contributed, and every rank sees the same bytes)."""
    if isinstance(buf, np.ndarray):
        return bool(np.any(buf.view(np.uint8)))
    import torch

    return bool(buf.view(torch.uint8).any())


@dataclass(frozen=True)
class AveragingInfo:
    """What one iteration's averaging did on this rank.

    ``averaged``: ``"model"``, ``"gradients"`` or ``None`` (nothing communicated
    this iteration, e.g. a local step of local SGD). ``synchronized``: a
    blocking round over all ranks. ``wait_s``: seconds the caller was blocked
    waiting for the result. ``rounds``: the partial collectives' RoundInfo, one
    per bucket (empty for other methods). ``staleness``: rounds this rank was
    behind (0 for blocking methods).
    """

    iteration: int
    method: str
    averaged: str | None
    synchronized: bool
    wait_s: float
    rounds: tuple[RoundInfo, ...] = ()
    staleness: int = 0


def bucket_statistics(colls: Sequence[Any]) -> dict[str, Any]:
    """The telemetry of one persistent collective per bucket, as one dict.

    The top-level keys are the first bucket's (every bucket steps in every
    iteration, so its counters count the iterations; summing them would
    count each iteration once per dtype), except two that must not hide
    another bucket: ``broken`` is the first ``broken`` that is not None, in
    bucket order (a broken second bucket breaks the method), and ``max_staleness`` the
    largest over the buckets (as :attr:`AveragingInfo.staleness`).
    ``per_bucket`` lists every bucket's own statistics, in bucket order.
    ``{}`` before set-up."""
    per = [c.statistics() for c in colls]
    if not per:
        return {}
    out = dict(per[0])
    out["broken"] = next((s.get("broken") for s in per if s.get("broken") is not None), None)
    if all("max_staleness" in s for s in per):
        out["max_staleness"] = max(s["max_staleness"] for s in per)
    out["per_bucket"] = per
    return out


def release(colls: Sequence[Any], error: BaseException | None = None) -> BaseException | None:
    """Close persistent collectives in order, collectively while that goes
    well; once one failed (or given ``error``: a set-up that failed after
    making some), release the rest locally (their ``__exit__`` with that
    error), as the peers may never come to close them: a collective close
    each would wait a timeout apiece, and leaving them open kept their
    progress-thread work and channels for the communicator's lifetime.
    Returns the first error (``error`` if given), for the caller to raise."""
    first = error
    for c in colls:
        if first is None:
            try:
                c.close()
            except BaseException as exc:  # noqa: BLE001 - raised by the caller
                first = exc
            continue
        try:
            c.__exit__(type(first), first, first.__traceback__)
        except Exception:  # noqa: BLE001 - a local release; the first error is the answer
            pass
    return first


def check_int(argument: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(argument, f"expected an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidArgumentError(argument, f"must be >= {minimum}, got {value}")
    return int(value)


class Method(ABC):
    """One averaging scheme. Life cycle (all collective except start/finish
    bookkeeping): ``setup`` once, then per iteration ``start`` + ``finish``
    (every rank, same order), ``finalize`` once at the end, ``close``."""

    name: ClassVar[str] = "method"
    averages: ClassVar[str] = MODEL
    deterministic: ClassVar[bool] = True  # same inputs -> same trajectory
    # Whether the buffers may live on a GPU (device buckets): every collective
    # the method calls takes CUDA buffers.
    device_buffers: ClassVar[bool] = True

    def __init__(self) -> None:
        self.comm: Any = None
        self.first_iteration = 0
        self._t: int | None = None
        self._live = False  # set up and not closed since

    # -- life cycle ---------------------------------------------------------------
    def setup(self, comm: Any, buffers: Sequence[BucketBuffer],
              first_iteration: int = 0) -> None:
        """Collective: bind to ``comm`` and the bucket layout; ``first_iteration``
        is the training iteration the next ``start`` belongs to (non-zero on
        resume). ``buffers`` hold the current model (model methods)."""
        self.comm = comm
        self.first_iteration = check_int("first_iteration", first_iteration, 0)
        self._live = False
        self._setup(comm, list(buffers))
        self._live = True

    def _setup(self, comm: Any, buffers: list[BucketBuffer]) -> None:
        """Subclass hook: create persistent collectives."""

    def check_size(self, size: int) -> None:
        """Knob errors that need only the number of ranks (a group larger
        than the job): the wrappers call this before their set-up
        communicates (broadcasting the weights), so the error comes first."""

    def communicates(self, t: int) -> bool:
        """Whether iteration ``t`` communicates at all (local SGD: every H-th)."""
        return True

    def start(self, t: int, buffers: Sequence[BucketBuffer]) -> None:
        """Begin iteration ``t``'s averaging of ``buffers`` in place; returns
        without waiting where the method allows. Leave the buffers alone until
        :meth:`finish`."""
        if self._t is not None:
            raise InvalidArgumentError("start", f"{self.name}: iteration {self._t} was "
                                       "started and not finished")
        if self.communicates(t):
            self._check_live("start")
        self._t = t
        if self.communicates(t):
            try:
                self._start(t, list(buffers))
            except BaseException:
                self._t = None  # not started: the error stays the answer, not "in flight"
                raise

    def finish(self) -> AveragingInfo:
        """Block until the buffers hold this iteration's result."""
        if self._t is None:
            raise InvalidArgumentError("finish", f"{self.name}: no iteration was started")
        t, self._t = self._t, None
        if not self.communicates(t):
            return AveragingInfo(t, self.name, None, False, 0.0)
        return self._finish(t)

    def _check_live(self, call: str) -> None:
        """Refuse work without a set-up: after close() or a failed setup()
        (a failed restart in load_state_dict) the persistent collectives are
        gone, and start/finish failed with a bare IndexError, finalize()
        returned without averaging anything."""
        if not self._live:
            raise CommunicatorClosedError(
                f"{self.name}: {call}() needs setup() first (the method is closed, or "
                "its set-up failed)")

    @property
    def in_flight(self) -> bool:
        return self._t is not None

    @abstractmethod
    def _start(self, t: int, buffers: list[BucketBuffer]) -> None: ...

    @abstractmethod
    def _finish(self, t: int) -> AveragingInfo: ...

    def finalize(self, buffers: Sequence[BucketBuffer]) -> bool:
        """Collective, at the end of training. Model methods: replace the
        buffers by the global mean of every rank's model (replicas then agree).
        Gradient methods: put what never reached a round into the buffers and
        return True if that is a non-zero update the caller should apply."""
        self._check_live("finalize")
        if self.averages == MODEL:
            for b in buffers:
                self.comm.allreduce(b, "avg")
        return False

    def close(self) -> None:
        """Collective: release persistent collectives (idempotent). Subclasses
        call this too: it marks the method closed."""
        self._live = False

    def checkpoint_error(self, t: int) -> str | None:
        """Why a checkpoint taken before iteration ``t`` could not be resumed
        exactly (None: it can)."""
        return None

    def statistics(self) -> dict[str, Any]:
        return {}

    def describe(self) -> str:
        return self.name
