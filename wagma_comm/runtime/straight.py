"""A schedule's straight-line order as one generated Python function.

Why: a small blocking collective on an oversubscribed host costs the Python
it runs and the objects it touches, amplified by the cache misses after each
context switch (docs/benchmarks.md). The dataflow executor
(:class:`~wagma_comm.runtime.inline.ProgramRun`) pays per op for generality it
rarely needs; the same schedule in its straight-line order
(schedule/straight.py), written out as straight Python with its peers, tags,
kernels and buffers as constants, costs what a hand-written MPI loop costs.
The engine uses it only for schedules whose order is proven deadlock-free
with their peers' (``straight_safe``).

The function posts each message into ``q[op]`` with the transport's bare
posters, waits with its bare test-all (``sched_yield`` between failed tests, the clock read every 64),
and returns None when done, or ``(LATE | EXPIRED, wait)`` when a wait ran out
of patience or the deadline: :meth:`StraightLine.state` then rebuilds the
dataflow run state at that wait, so the engine takes over with the very same
requests.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from ..schedule.ir import DATA, Scale, Schedule, Slot
from ..schedule.straight import LOCAL, POST, StraightOrder
from ..transport.base import Transport
from .inline import CLOCK_EVERY, NATIVE, RECV, SEND, Program, ProgramRun, check_clock, view


def wait(requests: list[Any], test_all: Callable[[list[Any]], bool], deadline: float,
         patience: float) -> str | None:
    """After a failed test of ``requests``: poll until all completed (None),
    ``deadline`` (monotonic) passed (EXPIRED) or ``patience`` seconds went by
    (LATE)."""
    polls = 0
    since = 0.0
    while True:
        os.sched_yield()  # the CPU we do not burn is what a late peer needs
        if test_all(requests):
            return None
        polls += 1
        if polls % CLOCK_EVERY == 0:
            overdue, since = check_clock(since, deadline, patience)
            if overdue:
                return overdue


class StraightLine:
    """``program``'s schedule in the straight-line ``order``, compiled to one
    function posting on ``channel`` of ``transport``. :meth:`bind` gives it
    the program's scratch views (again after the program made new scratch);
    :meth:`run` runs it over a caller's buffer."""

    __slots__ = ("program", "order", "source", "requests", "_fn", "_globals", "_nones",
                 "_scratch_slots", "_errors", "_translate")

    def __init__(self, program: Program, order: StraightOrder, transport: Transport,
                 channel: str) -> None:
        self.program, self.order = program, order
        self._errors, self._translate = transport.raw_errors, transport.error_of
        self._scratch_slots: list[Slot] = []
        self._nones = [None] * len(program.schedule.ops)
        self.requests: list[Any] = list(self._nones)
        isend, irecv = transport.posters(channel)
        # Everything but the buffer, the tags and the deadlines is a global of
        # the generated function: no argument to pass per call.
        self._globals: dict[str, Any] = {
            "q": self.requests, "s": (), "isend": isend, "irecv": irecv,
            "test_all": transport.tester(), "wait": wait}
        self.source = self._generate(program.schedule, self._globals)
        exec(compile(self.source, f"<straight {program.schedule.collective}>", "exec"),
             self._globals)
        self._fn = self._globals["run"]

    def _expr(self, slot: Slot, count: int) -> str:
        if slot.buf != DATA:
            self._scratch_slots.append(slot)
            return f"s[{len(self._scratch_slots) - 1}]"
        if slot.offset == 0 and slot.count == count:
            return "data"
        return f"data[{slot.offset}:{slot.offset + slot.count}]"

    def _generate(self, schedule: Schedule, constants: dict[str, Any]) -> str:
        program, count = self.program, schedule.count
        lines = ["def run(data, base, deadline, patience):"]
        point = 0
        for kind, what in self.order.steps:
            if kind == POST:
                i = what
                op = schedule.ops[i]  # type: ignore[index]
                k = program.kinds[i]  # type: ignore[index]
                if k == SEND:
                    lines.append(f"    q[{i}] = isend({self._expr(op.src, count)}, "
                                 f"{program.peers[i]}, base | {program.msgs[i]})")  # type: ignore[index]
                elif k == RECV:
                    lines.append(f"    q[{i}] = irecv({self._expr(op.dst, count)}, "
                                 f"{program.peers[i]}, base | {program.msgs[i]})")  # type: ignore[index]
                else:
                    assert k == NATIVE
                    constants[f"native{i}"] = program.actions[i]  # type: ignore[index]
                    lines.append(f"    q[{i}] = native{i}({self._expr(op.buf, count)})")
            elif kind == LOCAL:
                i = what
                op = schedule.ops[i]  # type: ignore[index]
                constants[f"local{i}"] = program.actions[i]  # type: ignore[index]
                src = "None" if type(op) is Scale else self._expr(op.src, count)
                lines.append(f"    local{i}({self._expr(op.dst, count)}, {src})")
            else:
                needed = ", ".join(f"q[{i}]" for i in what)  # type: ignore[union-attr]
                lines += [f"    w = [{needed}]",
                          "    if not test_all(w):",
                          "        o = wait(w, test_all, deadline, patience)",
                          "        if o is not None:",
                          f"            return o, {point}"]
                point += 1
        lines.append("    return None")
        return "\n".join(lines) + "\n"

    def bind(self, scratch: dict[str, np.ndarray]) -> None:
        """Use ``scratch`` (the program's arrays by name) from now on."""
        self._globals["s"] = tuple(view(scratch, slot) for slot in self._scratch_slots)

    def run(self, data: np.ndarray, base: int, deadline: float,
            patience: float) -> tuple[str, int] | None:
        """Run over ``data``, the messages tagged ``base | msg``
        (``Transport.tag_base`` of the collective's sequence number): None
        when done, else ``(outcome, wait)`` with the requests left in
        :attr:`requests`. The transport's own errors come out as its
        TransportError."""
        self.requests[:] = self._nones
        try:
            return self._fn(data, base, deadline, patience)
        except self._errors as exc:
            raise self._translate(exc) from exc

    # -- the run state a hand-over or a failure needs (rare paths) -------------
    def state(self, data: np.ndarray, point: int | None) -> ProgramRun:
        """The dataflow run state after this function stopped at wait
        ``point``, or, with ``point=None``, after it raised (then every posted
        message counts as outstanding)."""
        program = self.program
        q = self.requests
        if point is None:
            done: frozenset[int] = frozenset()
            outstanding = tuple(i for i, req in enumerate(q) if req is not None)
        else:
            done, outstanding = self.order.done[point], self.order.outstanding[point]
        schedule = program.schedule
        started = done | set(outstanding)
        run = program.start(data)
        run.remaining[:] = [sum(1 for d in deps if d not in done) for deps in schedule.deps]
        issued = sorted(started)
        run.ready[:] = issued + [i for i in range(len(schedule.ops))
                                 if i not in started and run.remaining[i] == 0]
        run.pos = len(issued)
        run.completed = len(done)
        run.requests[:] = [q[i] for i in outstanding]
        run.owners[:] = list(outstanding)
        return run


__all__ = ["StraightLine", "wait"]
