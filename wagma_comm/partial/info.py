"""What a partial collective reports: per call (RoundInfo) and over time
(Telemetry, behind ``statistics()``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RoundInfo:
    """What one ``step()`` (or ``flush()``) got.

    ``round``: the round whose result was applied. ``iteration``: the caller's
    own iteration (its count of ``step`` calls, 0-based); for a wait-avoiding
    group allreduce a late caller gets the most recent completed round, so
    ``round >= iteration`` there. ``step``: the shifting-group step (None for a
    synchronous round). ``group``: the ranks of the round. ``activator``: the rank
    whose arrival started the round here (None for synchronous rounds).
    ``fresh``: ranks whose contribution was current (their step or publish for
    that round came before the round started on them). ``staleness``: how many
    rounds this caller was behind when it called (0: on time, its contribution
    to the round it got was current, even if that round ran before its step;
    else its contribution was that many iterations old). A late wait-avoiding
    group allreduce caller counts it to the round it got, ``round - iteration
    + 1`` (as on the board), even if a newer round was running here when it
    called; solo and majority, which deliver the caller's own round, count the
    rounds started here from its own on. A flush is not counted
    as a step in Telemetry. ``synchronized``: a blocking round over all
    ranks (the periodic sync or a flush).
    """

    round: int
    step: int | None
    group: tuple[int, ...]
    activator: int | None
    fresh: tuple[int, ...]
    staleness: int
    synchronized: bool
    iteration: int


@dataclass
class Telemetry:
    """Counters a user reads to tell a tolerated straggler from a fault: a
    straggler shows up as stale-but-present participation and a staleness
    histogram with a tail; a fault ends in a timeout naming the rank."""

    size: int
    steps: int = 0
    late_steps: int = 0  # steps with staleness > 0
    rounds: int = 0
    sync_rounds: int = 0
    flushes: int = 0
    activated_here: int = 0
    activated_elsewhere: int = 0
    ready_starts: int = 0  # rounds started here by a ready publish
    tokens_sent: int = 0
    tokens_received: int = 0
    fresh_contributions: int = 0
    stale_contributions: int = 0
    wait_time_s: float = 0.0
    sync_wait_time_s: float = 0.0
    grace_waits: int = 0  # shared-memory WAGMA: rounds whose first member waited its grace
    grace_wait_time_s: float = 0.0
    staleness: dict[int, int] = field(default_factory=dict)
    seen_rounds: dict[int, int] = field(default_factory=dict)  # rank -> rounds shared
    seen_fresh: dict[int, int] = field(default_factory=dict)   # rank -> of them fresh

    def record_round(self, group: tuple[int, ...], fresh: tuple[int, ...],
                     synchronized: bool) -> None:
        self.rounds += 1
        self.sync_rounds += synchronized
        for r in group:
            self.seen_rounds[r] = self.seen_rounds.get(r, 0) + 1
        for r in fresh:
            self.seen_fresh[r] = self.seen_fresh.get(r, 0) + 1

    def record_call(self, staleness: int, waited_s: float, synchronized: bool) -> None:
        self.steps += 1
        self.late_steps += staleness > 0
        self.staleness[staleness] = self.staleness.get(staleness, 0) + 1
        self.wait_time_s += waited_s
        if synchronized:
            self.sync_wait_time_s += waited_s

    def as_dict(self) -> dict[str, Any]:
        participation = {
            r: {"rounds": n, "fresh": self.seen_fresh.get(r, 0),
                "stale": n - self.seen_fresh.get(r, 0)}
            for r, n in sorted(self.seen_rounds.items())}
        return {
            "steps": self.steps,
            "late_steps": self.late_steps,
            "rounds": self.rounds,
            "sync_rounds": self.sync_rounds,
            "flushes": self.flushes,
            "activated_here": self.activated_here,
            "activated_elsewhere": self.activated_elsewhere,
            "ready_starts": self.ready_starts,
            "tokens_sent": self.tokens_sent,
            "tokens_received": self.tokens_received,
            "fresh_contributions": self.fresh_contributions,
            "stale_contributions": self.stale_contributions,
            "staleness_histogram": dict(sorted(self.staleness.items())),
            "max_staleness": max(self.staleness, default=0),
            "wait_time_s": self.wait_time_s,
            "sync_wait_time_s": self.sync_wait_time_s,
            "grace_waits": self.grace_waits,
            "grace_wait_time_s": self.grace_wait_time_s,
            "participation": participation,
        }
