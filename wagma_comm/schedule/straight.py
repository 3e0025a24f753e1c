"""Straight-line order of a schedule, and a proof that it cannot deadlock.

The progress engine runs a schedule as a dataflow graph: post each op once its
dependencies completed, whatever order completions come in. That generality
costs Python per op, which is what a small blocking collective pays for on an
oversubscribed host (docs/benchmarks.md, "Which layer costs what"). Most
schedules are phases (post a round's messages, wait for them, reduce) that a
fixed order runs just as well, the way a hand-written MPI loop does:

* ops are taken in index order (a topological order, schedule/ir.py);
* a local op (reduce, copy, scale) first waits for the messages it depends on;
  before that wait, every message posted since the last wait goes out,
  receives first;
* a message that depends on an earlier message waits for it the same way;
* at the end, every message not waited for yet is waited for.

A fixed order can deadlock where the dataflow one cannot: a rank may wait for a
message whose sender first waits for one this rank posts only later.
:func:`check_straight` runs every member's order together, with the worst case
of no buffering (a send completes only once its receive is posted), and
raises ScheduleError if some member can never finish. :func:`straight_safe`
answers it for one rank's schedule by compiling its peers' (the compiler is
deterministic), cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from ..errors import ScheduleError, WagmaError
from .algorithms import compile_group
from .ir import Native, Recv, Schedule, Send

POST, WAIT, LOCAL = 0, 1, 2
"""Step kinds: ``(POST, op)``, ``(WAIT, ops)``, ``(LOCAL, op)``."""


@dataclass(frozen=True)
class StraightOrder:
    """One rank's straight-line order. ``steps[k]`` is ``(kind, op)`` for a
    post or a local op, ``(WAIT, ops)`` for a wait. For the ``p``-th wait,
    ``done[p]`` are the ops finished before it and ``outstanding[p]`` the
    messages posted and not yet waited for when it starts, its own included:
    what a run interrupted there hands to the engine."""

    steps: tuple[tuple[int, object], ...]
    done: tuple[frozenset[int], ...]
    outstanding: tuple[tuple[int, ...], ...]


def straight_order(schedule: Schedule) -> StraightOrder:
    """The straight-line order of ``schedule`` (see the module docstring)."""
    ops, deps = schedule.ops, schedule.deps
    steps: list[tuple[int, object]] = []
    done_at: list[frozenset[int]] = []
    outstanding_at: list[tuple[int, ...]] = []
    finished: set[int] = set()
    posted: list[int] = []  # posted, not yet waited for, in posting order
    pending: list[int] = []  # messages whose post waits for the next wait

    def wait_for(needed: list[int]) -> None:
        if not needed:
            return
        pending.sort(key=lambda i: type(ops[i]) is not Recv)
        for i in pending:
            steps.append((POST, i))
            posted.append(i)
        pending.clear()
        done_at.append(frozenset(finished))
        outstanding_at.append(tuple(posted))
        steps.append((WAIT, tuple(needed)))
        finished.update(needed)
        posted[:] = [i for i in posted if i not in finished]

    for i, op in enumerate(ops):
        wait_for([d for d in deps[i] if d not in finished and _is_message(ops[d])])
        if _is_message(op):
            pending.append(i)
        else:
            steps.append((LOCAL, i))
            finished.add(i)
    wait_for(posted + pending)
    return StraightOrder(tuple(steps), tuple(done_at), tuple(outstanding_at))


def _is_message(op: object) -> bool:
    return type(op) in (Send, Recv, Native)


def check_straight(schedules: Mapping[int, Schedule]) -> None:
    """Raise ScheduleError unless every member (global rank -> schedule) runs
    its straight-line order to the end when all run together, with no
    buffering: a receive completes once its send is posted, a send once its
    receive is posted, a native collective once every member posted it."""
    orders = {r: straight_order(s).steps for r, s in schedules.items()}
    posted: set[tuple[object, ...]] = set()
    native_count: dict[int, dict[tuple[int, ...], int]] = {r: {} for r in orders}
    native_key: dict[tuple[int, int], tuple[object, ...]] = {}
    pcs = dict.fromkeys(orders, 0)

    def key(rank: int, i: int) -> tuple[object, ...]:
        op = schedules[rank].ops[i]
        if type(op) is Send:
            return ("send", rank, op.peer, op.msg)
        if type(op) is Recv:
            return ("recv", op.peer, rank, op.msg)
        if (rank, i) not in native_key:  # the k-th native of a group, per member
            k = native_count[rank].get(op.ranks, 0)
            native_count[rank][op.ranks] = k + 1
            native_key[(rank, i)] = ("native", op.ranks, k, rank)
        return native_key[(rank, i)]

    def complete(rank: int, i: int) -> bool:
        op = schedules[rank].ops[i]
        if type(op) is Send:
            return ("recv", rank, op.peer, op.msg) in posted
        if type(op) is Recv:
            return ("send", op.peer, rank, op.msg) in posted
        _, ranks, k, _ = key(rank, i)
        return all(("native", ranks, k, r) in posted for r in ranks)  # type: ignore[union-attr]

    progressed = True
    while progressed:
        progressed = False
        for rank, steps in orders.items():
            pc = pcs[rank]
            while pc < len(steps):
                kind, what = steps[pc]
                if kind == POST:
                    posted.add(key(rank, what))  # type: ignore[arg-type]
                elif kind == WAIT and not all(complete(rank, i) for i in what):  # type: ignore[union-attr]
                    break
                pc += 1
                progressed = True
            pcs[rank] = pc
    stuck = {r: orders[r][pc][1] for r, pc in pcs.items() if pc < len(orders[r])}
    if stuck:
        some = sorted(stuck)[:4]
        raise ScheduleError(
            "the straight-line order deadlocks: " + "; ".join(
                f"rank {r} waits for ops {list(stuck[r])}" for r in some))  # type: ignore[call-overload]


@lru_cache(maxsize=256)
def straight_safe(schedule: Schedule) -> bool:
    """Whether ``schedule``'s straight-line order is proven deadlock-free with
    its peers' (compiled here, as the same compiler makes them). False for a
    schedule the compiler cannot reproduce (then run it as a dataflow graph).
    Cached: the engine asks once per program it makes."""
    if schedule.collective not in ("allreduce", "broadcast", "barrier"):
        return False
    try:
        members = dict(zip(schedule.ranks, compile_group(
            schedule.collective, schedule.ranks, schedule.count, schedule.op,
            schedule.root, schedule.algorithm)))
        if members.get(schedule.rank) != schedule:
            return False
        check_straight(members)
    except WagmaError:  # not the compiler's, or a deadlock
        return False
    return True


__all__ = ["StraightOrder", "straight_order", "check_straight", "straight_safe",
           "POST", "WAIT", "LOCAL"]
