"""Methods that average the model over groups: local SGD, WAGMA-SGD, and an
AD-PSGD-style pairwise gossip built on the same wait-avoiding collective.

All average the weights *before* the optimizer step, with the gradient taken at
the pre-averaging weights (WAGMA-SGD's order, ALGORITHMS.md section 2), so the
averaging can run during the backward pass.
"""

from __future__ import annotations

import time
from typing import Any

from ... import groups as groups_mod
from ...errors import InvalidArgumentError
from ...partial.wagma import ACTIVATION_SCOPES, NORMALIZATIONS, check_grace
from ...runtime.activation import is_sync_round
from .base import (
    MODEL,
    AveragingInfo,
    BucketBuffer,
    Method,
    bucket_statistics,
    check_int,
    clone,
    release,
)

ROUND_STARTS = ("gradient", "iteration", "publish")
# A sync period no run reaches: a wait-avoiding collective with no sync rounds.
NO_SYNC = 1 << 62
WAGMA_GRACE = 0.5
"""WagmaSGD's default ``grace`` (docs/training.md, "The grace")."""


def default_group_size(size: int) -> int:
    """``2**ceil(log2(sqrt(P)))`` capped at P: two group steps mix every model
    (P=64 -> 8, the paper's setting; P=8 -> 4; P=4 -> 2)."""
    s = 1
    while s * s < size:
        s *= 2
    return min(s, size)


class LocalSGD(Method):
    """Local steps, and a blocking global model average every ``period``
    iterations (iterations period-1, 2*period-1, ...)."""

    name = "local_sgd"

    def __init__(self, period: int = 10) -> None:
        super().__init__()
        self.period = check_int("sync_every", period, 1)
        self._handles: list[Any] = []

    def communicates(self, t: int) -> bool:
        return (t + 1) % self.period == 0

    def _start(self, t: int, buffers: list[BucketBuffer]) -> None:
        self._handles = [self.comm.allreduce(b, "avg", async_op=True) for b in buffers]

    def _finish(self, t: int) -> AveragingInfo:
        t0 = time.perf_counter()
        for h in self._handles:
            h.wait()
        self._handles = []
        return AveragingInfo(t, self.name, MODEL, True, time.perf_counter() - t0)

    def describe(self) -> str:
        return f"local_sgd (average every {self.period})"


class WagmaSGD(Method):
    """WAGMA-SGD: the wait-avoiding group allreduce of the model over shifting
    groups, a blocking global mean every ``sync_every`` iterations (after which
    every replica's averaged model is bitwise identical).

    ``round_start`` says when a round starts (the first member to arrive
    activates it; the others' progress threads contribute what they last
    published):

    * ``"publish"`` (default): :meth:`start` publishes the model *ready* (it
      is final before the gradient is computed; ``publish(ready=True)``) and
      :meth:`finish` arrives. The round runs as soon as every member of the
      group has published, during the compute, so on-time members do not wait
      for it at all; a member that has not published when the first one
      arrives is activated and contributes its previous model.
    * ``"gradient"``: the same publish without ``ready``: the round starts at
      the first arrival, so a peer still computing its gradient contributes
      its current model, but the first member to finish its gradient waits
      for the round's messages.
    * ``"iteration"``: :meth:`start` publishes and arrives at once, so the
      round runs during this rank's compute, but a peer that has not yet
      finished its previous iteration contributes that iteration's model.

    docs/training.md compares the two."""

    name = "wagma"
    deterministic = False

    def __init__(self, group_size: int | None = None, sync_every: int = 10, *,
                 activation: str = "global", normalization: str = "wagma",
                 round_start: str = "publish", grace: float = WAGMA_GRACE) -> None:
        super().__init__()
        self.group_size = None if group_size is None else check_int("group_size", group_size, 1)
        self.sync_every = check_int("sync_every", sync_every, 1)
        if activation not in ACTIVATION_SCOPES:
            raise InvalidArgumentError("activation", f"expected one of "
                                       f"{list(ACTIVATION_SCOPES)}, got {activation!r}")
        if normalization not in NORMALIZATIONS:
            raise InvalidArgumentError("normalization", f"expected one of "
                                       f"{list(NORMALIZATIONS)}, got {normalization!r}")
        if round_start not in ROUND_STARTS:
            raise InvalidArgumentError("round_start", f"expected one of "
                                       f"{list(ROUND_STARTS)}, got {round_start!r}")
        self.activation, self.normalization = activation, normalization
        self.round_start = round_start
        check_grace(grace)
        self.grace = grace
        self._colls: list[Any] = []
        self._handles: list[Any] = []
        self._buffers: list[BucketBuffer] = []  # published, not yet stepped

    def check_size(self, size: int) -> None:
        if self.group_size is None:  # so describe() says what a default stands for
            self.group_size = default_group_size(size)
        groups_mod.check_group_size(size, self.group_size)

    def _setup(self, comm: Any, buffers: list[BucketBuffer]) -> None:
        if self.group_size is None:
            self.group_size = default_group_size(comm.size)
        self.check_size(comm.size)
        if self.first_iteration % self.sync_every and self.sync_every != NO_SYNC:
            raise InvalidArgumentError(
                "first_iteration", f"{self.name} resumes only at a multiple of sync_every="
                f"{self.sync_every}, got {self.first_iteration}")
        # The creation buffer is what a rank contributes before it has published
        # anything: the current (identical) model, copied.
        made: list[Any] = []
        try:
            for b in buffers:
                made.append(comm.wait_avoiding_group_allreduce(
                    clone(b), self.group_size, self.sync_every, activation=self.activation,
                    normalization=self.normalization, grace=self.grace,
                    first_round=self.first_iteration))
        except BaseException as exc:
            release(made, exc)  # the earlier buckets' collectives, made for nothing
            raise
        self._colls = made

    def _start(self, t: int, buffers: list[BucketBuffer]) -> None:
        # A sync round blocks for everyone anyway: arriving early costs nothing.
        if self.round_start != "iteration" and not is_sync_round(t, self.sync_every):
            ready = self.round_start == "publish"
            for c, b in zip(self._colls, buffers):
                c.publish(b, ready=ready)
            self._buffers = buffers
            return
        self._handles = [c.step(b, async_op=True) for c, b in zip(self._colls, buffers)]

    def _finish(self, t: int) -> AveragingInfo:
        t0 = time.perf_counter()
        if self._buffers:
            self._handles = [c.step(b, async_op=True)
                             for c, b in zip(self._colls, self._buffers)]
            self._buffers = []
        infos = tuple(h.wait() for h in self._handles)
        self._handles = []
        return AveragingInfo(t, self.name, MODEL, infos[0].synchronized,
                             time.perf_counter() - t0, infos,
                             max(i.staleness for i in infos))

    def finalize(self, buffers: Any) -> bool:
        self._check_live("finalize")
        self._keep_promise()
        for c, b in zip(self._colls, buffers):
            c.flush(b)  # one extra global mean: replicas agree bitwise
        return False

    def close(self) -> None:
        """Collective (idempotent). Every bucket's collective is released even
        when keeping the promise or an earlier bucket's close fails: the
        first error is raised after."""
        error: BaseException | None = None
        try:
            self._keep_promise()
        except BaseException as exc:  # noqa: BLE001 - raised below
            error = exc
            self._buffers = []
        colls, self._colls, self._handles = self._colls, [], []
        super().close()
        error = release(colls, error)
        if error is not None:
            raise error

    def _keep_promise(self) -> None:
        """start() published ready and no finish() followed: step copies, so
        the rounds those publishes started can finish (a ready publish is a
        promise to step) without touching the caller's weights."""
        if self._buffers:
            for c, b in zip(self._colls, self._buffers):
                c.step(clone(b))
            self._buffers = []

    def checkpoint_error(self, t: int) -> str | None:
        if t % self.sync_every and self.sync_every != NO_SYNC:
            return (f"{self.name} checkpoints resume only at iterations that are a multiple "
                    f"of sync_every={self.sync_every} (after a sync round), not {t}")
        return None

    def statistics(self) -> dict[str, Any]:
        """Every bucket's collective (:func:`~.base.bucket_statistics`)."""
        return bucket_statistics(self._colls)

    def describe(self) -> str:
        """Name and every knob that changes the result (the set-up compares
        it across ranks); ``grace`` as a float, so 0 and 0.0 read alike."""
        return (f"{self.name} (groups of {self.group_size}, sync every {self.sync_every}, "
                f"{self.activation} activation, {self.normalization} normalization, "
                f"grace {float(self.grace)!r}, rounds start at the {self.round_start})")


class ADPSGD(WagmaSGD):
    """AD-PSGD as feasible here: wait-avoiding *pairwise* model averaging
    (groups of 2, plain mean) with a partner that rotates every iteration (the
    shifting groups: r XOR 2**s), run once both have published their models
    ready or activated by the first of the pair to arrive (the default
    ``round_start``), and no global sync. The partner's progress thread answers with its last
    published model while its application computes, as in AD-PSGD; unlike
    AD-PSGD the pairs of an iteration are fixed in advance."""

    name = "ad_psgd"

    def __init__(self) -> None:
        super().__init__(2, NO_SYNC, activation="group", normalization="mean",
                         grace=0.0)

    def check_size(self, size: int) -> None:
        pass  # pairs, or the one rank alone: any size will do

    def _setup(self, comm: Any, buffers: list[BucketBuffer]) -> None:
        self.group_size = min(2, comm.size)
        super()._setup(comm, buffers)

    def describe(self) -> str:
        return "ad_psgd (rotating pairs, wait-avoiding, no global sync)"
