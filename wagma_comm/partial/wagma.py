"""WAGMA-SGD's wait-avoiding group allreduce of models (ALGORITHMS.md s. 2-3).

Each rank *publishes* the model it passes to ``step`` (a copy the progress
thread owns), or earlier with ``publish``: a trainer publishes its model as
soon as it is final (the start of an iteration) and steps once its gradient is
ready, so a round a faster peer starts meanwhile averages this rank's current
model instead of the previous iteration's. Round ``r`` sums the published
models of this round's group (shifting groups, ``groups.py``) and the caller
combines that sum with its own current model:

* ``normalization="wagma"`` (default, the paper's): ``(sum + w) / (S + 1)``, so
  an on-time rank's own model weighs ``2/(S+1)``;
* ``"mean"``: ``sum / S``, the plain group mean.

(``S`` is the round's actual group size, which may be below ``group_size`` when
the groups cannot all be that large.) A late caller -- its round already ran
with its stale published model -- gets the *most recent completed* round at
once, the freshest models available, and keeps one result buffer instead of
one per missed round (late again before a newer round completes, it gets
the same round's sum again, combined with its current model). Every
``sync_every``-th step is a blocking global mean,
after which every rank holds a bitwise-identical model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import groups as groups_mod
from ..errors import InvalidArgumentError
from ..runtime.activation import FLAT_MAX, group_step
from .base import PartialCollective, Result, _Call

ACTIVATION_SCOPES = ("global", "group")
NORMALIZATIONS = ("wagma", "mean")
GRACE_MAX = 1.0
"""The longest grace: this rank's whole compute time (beyond it a round would
wait longer for a peer than the peer's lateness could cost)."""


def check_ready(ready: Any) -> None:
    """``publish(ready=)`` is a promise: only True or False makes it (a
    truthy ``"no"`` promised a step, and a later flush() was refused)."""
    if not isinstance(ready, (bool, np.bool_)):
        raise InvalidArgumentError("ready", f"expected True or False, got {ready!r}")


def check_grace(grace: Any) -> None:
    """``grace`` is a fraction of the caller's compute time (docs/partial.md)."""
    if (isinstance(grace, bool) or not isinstance(grace, (int, float))
            or not 0 <= grace <= GRACE_MAX):
        raise InvalidArgumentError(
            "grace", f"expected a fraction of the compute time in [0, {GRACE_MAX:g}], "
            f"got {grace!r}")


def check_options(size: int, group_size: Any, activation: Any, normalization: Any,
                  grace: Any = 0.0) -> None:
    """The arguments both paths share, checked before any communication."""
    groups_mod.check_group_size(size, group_size)
    check_grace(grace)
    if activation not in ACTIVATION_SCOPES:
        raise InvalidArgumentError(
            "activation", f"expected one of {list(ACTIVATION_SCOPES)}, got {activation!r}")
    if normalization not in NORMALIZATIONS:
        raise InvalidArgumentError(
            "normalization", f"expected one of {list(NORMALIZATIONS)}, got {normalization!r}")


class WaitAvoidingGroupAllreduce(PartialCollective):
    """Created by :meth:`Communicator.wait_avoiding_group_allreduce`."""

    kind = "wait_avoiding_group_allreduce"

    def __init__(self, comm: Any, buf: Any, group_size: int, sync_every: int, *,
                 activation: str = "global", normalization: str = "wagma",
                 timeout: float | None = None, algorithm: str | None = None,
                 first_round: int = 0, grace: float = 0.0) -> None:
        check_options(comm.size, group_size, activation, normalization, grace)
        # This rank's group at each step (they repeat every num_steps), made
        # once: each round then hands the schedule caches the very tuple
        # they compiled from, and builds nothing.
        self._groups = tuple(groups_mod.group_of(comm.rank, comm.size, group_size, k)
                             for k in range(groups_mod.num_steps(comm.size, group_size)))
        # Round r has round first_round + r's group (check_first_round).
        super().__init__(comm, buf, sync_every, timeout, algorithm, first_round)
        self.group_size = group_size
        self.activation = activation
        self.normalization = normalization
        # Accepted for a uniform interface; a message round's own latency
        # already gives a peer a moment behind the time to publish.
        self.grace = float(grace)
        # Before anything is published the contribution is the initial model
        # (the creation buffer, which all ranks share), never uninitialised memory.
        self._published = self._mem.clone(self._template_data()[0])
        self._published_round = -1
        # Contributions a later one replaced before their round started here
        # (step(async_op=True), then publish() or step()): round -> model.
        self._held: dict[int, Any] = {}
        self._spare: list[Any] = []  # buffers of taken held contributions, reused
        self._latest: Result | None = None

    def publish(self, buf: Any, *, ready: bool = False) -> None:
        """Make ``buf`` (copied now) this rank's contribution to its next round
        without arriving at it: a round a peer starts before this rank's
        :meth:`step` uses it and counts it fresh. ``step`` publishes its own
        buffer again. Why: in WAGMA-SGD the model is final before the gradient
        is computed, so it can be handed over while the application computes
        (docs/partial.md, the ``publish`` entry of the WAGMA section).

        ``ready=True`` also promises that this is the contribution (no later
        publish before the step changes it): the round then starts here at
        once, and runs as soon as every member of its group has started it
        (by a ready publish of its own, or by an arrival's activation), so
        when the whole group publishes in time the round finishes during the
        compute and the steps return without waiting. Group rounds only; a
        synchronous round still starts at the steps."""
        check_ready(ready)
        data, _ = self._check_buf(buf)
        with self._lock:
            self._check_usable()
            t = self._app_round
            self._contribute(data, t)
            self._mem.settle()  # the caller may change ``buf`` once we return
        if ready:
            self._ready_promised = t
            # No wake-up from a nap (at most 1 ms: a wake-up here costs a
            # context switch), only from a longer sleep on the doorbell.
            self._inbox.append(("ready", t))
            self._engine.wake_if_calm()

    # -- who -----------------------------------------------------------------
    def _members(self, r: int) -> tuple[int, ...]:
        step = group_step(self.first_round + r, self.sync_every)
        return self._groups[step % len(self._groups)]

    def _token_scope(self, r: int) -> tuple[int, ...]:
        if self.activation == "group":
            return self._members(r)
        return tuple(range(self.size))

    def _flat_tokens(self, n: int) -> bool:
        return self.activation == "group" and n <= FLAT_MAX

    # -- what ----------------------------------------------------------------
    def _contribute(self, data: np.ndarray, t: int) -> None:
        """(under _lock) ``data`` is this rank's model of round ``t``. A model
        of an earlier round that has not started here yet is set aside for
        it (a buffer swap, no copy): that round's input is the model of its
        own step, not of a later one."""
        last = self._published_round
        if self._started < last < t:
            self._held[last] = self._published
            self._published = self._spare.pop() if self._spare else self._mem.empty(self.count)
        self._mem.copy(self._published, data)
        self._published_round = t

    def _snapshot(self, dst: np.ndarray, r: int) -> bool:
        held = self._held.pop(r, None)
        if held is not None:
            self._mem.copy(dst, held)
            self._spare.append(held)
            return True
        self._mem.copy(dst, self._published)
        return self._published_round == r

    def _flush_needs_data(self) -> bool:
        return False  # flush() without a buffer only waits for the rounds

    def _flush_snapshot(self, dst: np.ndarray, call: _Call) -> None:
        assert call.data is not None
        self._mem.copy(dst, call.data)

    def _late_result(self, t: int) -> Result:
        res = self._latest
        assert res is not None and res.round >= t
        res.readers += 1
        return res

    def _store(self, res: Result, wanted: bool) -> None:
        self._retire(self._latest)
        self._latest = res

    def _deliver(self, call: _Call, res: Result) -> None:
        """A late step's staleness counts to the round it gets, the newest
        completed one (``round - iteration + 1``, as on the board), not to a
        newer round already running here when it called (RoundInfo)."""
        if call.kind == "step":
            call.staleness = min(call.staleness, max(0, res.round - call.iteration + 1))
        super()._deliver(call, res)

    def _finalize(self, call: _Call, res: Result) -> None:
        total = res.array[:self.count]
        n = len(res.group)
        out = call.data
        assert out is not None
        if res.synchronized or self.normalization == "mean":
            self._mem.average(out, [total], n)
        else:
            self._mem.average(out, [total, out], n + 1)
        if res.synchronized:
            with self._lock:  # the synchronized model is what this rank now has
                if self._published_round <= res.round:
                    self._mem.copy(self._published, out)

    def _extra_statistics(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "activation": self.activation,
                "normalization": self.normalization}
