"""What the engine checks on every turn that no message will tell it.

* a collective past its deadline: CollectiveTimeoutError naming the ranks it
  still waited for;
* a collective in flight longer than the watchdog threshold: one log line
  (logger ``wagma_comm``) naming those ranks, well before the timeout fires, so
  a stuck job says where it is stuck while it can still be inspected;
* a dead peer (runtime/liveness.py): RankFailedError at once, instead of the
  timeout minutes later.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Sequence

from ..errors import (CollectiveError, CollectiveTimeoutError, InvalidArgumentError,
                      RankFailedError)
from ..schedule.ir import Native, Recv, Send
from .liveness import PERIOD_S, Liveness

log = logging.getLogger("wagma_comm")

SETTLE_S = 0.5  # how long an MPI error waits for /proc to show a dead peer

WATCHDOG_FRACTION = 0.5
"""Default watchdog threshold, as a fraction of each collective's timeout
(``WAGMA_WATCHDOG_S`` sets seconds instead)."""


def waiting_ranks(rank: int, ops: Sequence[Any], posted: dict[int, Any]) -> list[int]:
    """The ranks whose messages ``posted`` (op index -> request) still wait for:
    the senders of pending receives, else every peer of what is pending."""
    waiting = sorted({ops[i].peer for i in posted if isinstance(ops[i], Recv)})
    if waiting:
        return waiting
    peers: set[int] = set()
    for i in posted:
        op = ops[i]
        if isinstance(op, Send):
            peers.add(op.peer)
        elif isinstance(op, Native):
            peers.update(r for r in op.ranks if r != rank)
    return sorted(peers)


def stage_phase(stage: Any) -> str:
    return {"debug": "debug fingerprint exchange", "setup": "group set-up"}.get(
        stage.channel, stage.label or "data exchange")


def timeout_error(work: Any, stage: Any, ops: Sequence[Any],
                  posted: dict[int, Any]) -> CollectiveTimeoutError:
    """The error of ``work`` timed out in ``stage`` with ``posted`` outstanding."""
    waiting = waiting_ranks(stage.schedule.rank, ops, posted)
    round, call = work.shown()
    return CollectiveTimeoutError(
        work.collective, round, waiting,
        f"{call}timed out after {work.timeout:g} s in its {stage_phase(stage)}, "
        f"still waiting for messages from {len(waiting)} rank(s)",
    )


def watchdog_seconds() -> float | None:
    """``WAGMA_WATCHDOG_S`` (seconds; ``inf``: never), or None where unset
    (WATCHDOG_FRACTION of each timeout). Anything but a number > 0 is an
    InvalidArgumentError naming the variable: before, ``abc`` was a bare
    ValueError from the engine's start and ``0``, ``-1`` or ``nan`` silently
    meant the default."""
    raw = os.environ.get("WAGMA_WATCHDOG_S", "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:  # also NaN
        raise InvalidArgumentError(
            "WAGMA_WATCHDOG_S", f"expected seconds as a number > 0, got {raw!r}")
    return value


class Watch:
    """Deadlines, the watchdog and dead peers for one engine. ``scan`` is
    called by the engine's driver (one thread at a time)."""

    def __init__(self, liveness: Liveness | None) -> None:
        self.liveness = liveness
        self._watchdog_s = watchdog_seconds()
        self._next_liveness = 0.0

    def scan(self, runs: Sequence[Any]) -> list[tuple[Any, CollectiveError]]:
        """(run, error) for every run that must fail now; logs the watchdog
        line of runs in flight too long (once per run)."""
        now = time.monotonic()
        failed: list[tuple[Any, CollectiveError]] = []
        if self.liveness is not None and now >= self._next_liveness:
            self._next_liveness = now + PERIOD_S
            failed = self.dead_peers(runs)
            if failed:
                return failed
        for run in runs:
            work = run.work
            if work.patient:
                continue  # nobody waits for it yet: no deadline (Work.patient)
            if now > work.deadline:
                failed.append((run, timeout_error(work, run.stage, run.ops, run.posted)))
            elif not run.warned and self.overdue(work.deadline, work.timeout, now):
                run.warned = True
                self.warn(work.collective, work.shown()[0], work.deadline, work.timeout, now,
                          stage_phase(run.stage),
                          waiting_ranks(run.stage.schedule.rank, run.ops, run.posted))
        return failed

    def overdue(self, deadline: float, timeout: float, now: float) -> bool:
        """Whether a collective with this ``deadline`` and ``timeout`` has
        been in flight past the watchdog threshold at ``now``."""
        limit = self._watchdog_s if self._watchdog_s is not None else timeout * WATCHDOG_FRACTION
        return now - (deadline - timeout) > limit

    @staticmethod
    def warn(collective: str, seq: int, deadline: float, timeout: float, now: float,
             phase: str, waiting: Sequence[int]) -> None:
        """The watchdog's one log line for a collective (once per collective)."""
        log.warning("%s (round %d) in flight for %.1f s (timeout %g s) in its %s; "
                    "ranks not yet seen: %s", collective, seq, now - (deadline - timeout),
                    timeout, phase, list(waiting))

    def dead_peers(self, runs: Sequence[Any],
                   settle: bool = False) -> list[tuple[Any, CollectiveError]]:
        """(run, RankFailedError) for every run, if a member of any is gone.
        ``settle``: MPI just failed, so look again for a while (SETTLE_S): a
        killed process closes its connections before it turns into a zombie."""
        if self.liveness is None:
            return []
        members = sorted({r for run in runs for r in run.stage.schedule.ranks})
        dead = self._dead(members, settle)
        if not dead:
            return []
        return [(run, self._rank_failed(dead, run.stage.schedule.ranks)(
            run.work.collective, run.work.shown()[0])) for run in runs]

    def dead_among(self, ranks: Sequence[int],
                   settle: bool = False) -> Callable[[str, int], RankFailedError] | None:
        """A maker of the RankFailedError for a collective over ``ranks`` if
        one of them is gone, else None (``settle`` as in dead_peers)."""
        dead = self.dead_ranks(ranks, settle)
        return self._rank_failed(dead, ranks) if dead else None

    def dead_ranks(self, ranks: Sequence[int], settle: bool = False) -> list[int]:
        """The ranks among ``ranks`` that are gone (and every other rank known
        gone with them); [] where none is, or nobody can tell."""
        return [] if self.liveness is None else self._dead(ranks, settle)

    def _dead(self, ranks: Sequence[int], settle: bool) -> list[int]:
        """Dead ranks among ``ranks``; if there are any, every other rank known
        to be gone too (a death often takes others down with it, and the
        first one is the one to blame)."""
        assert self.liveness is not None
        give_up = time.monotonic() + (SETTLE_S if settle else 0.0)
        while True:
            dead = self.liveness.dead(ranks)
            if dead:
                return sorted(set(dead) | set(self.liveness.dead(self.liveness.checkable)))
            if time.monotonic() >= give_up:
                return []
            time.sleep(0.01)

    def _rank_failed(self, dead: list[int],
                     ranks: Sequence[int]) -> Callable[[str, int], RankFailedError]:
        assert self.liveness is not None
        describe = self.liveness.describe
        inside = [describe(r) for r in dead if r in ranks]
        outside = [describe(r) for r in dead if r not in ranks]
        message = (f"{', '.join(inside)} gone (killed or exited) while this collective "
                   "was in flight" if inside else "")
        if outside:
            message += ("; also " if inside else "") + (
                f"{', '.join(outside)} gone, so the communicator cannot go on")
        return lambda collective, seq: RankFailedError(collective, seq, dead, message)


__all__ = ["Watch", "timeout_error", "stage_phase", "waiting_ranks", "watchdog_seconds",
           "WATCHDOG_FRACTION"]
