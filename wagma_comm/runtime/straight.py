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
checks that each receive got as many bytes as it expected (MPI accepts a
shorter message silently: ranks that passed different counts would get a
wrong result), and returns None when done, or ``(LATE | EXPIRED, wait)`` when
a wait ran out of patience or the deadline: :meth:`StraightLine.state` then
rebuilds the dataflow run state at that wait, so the engine takes over with
the very same requests.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from ..errors import MessageSizeError, TransportError
from ..schedule.ir import DATA, Scale, Schedule, Slot
from ..schedule.straight import LOCAL, POST, StraightOrder
from ..transport.base import Transport
from .inline import CLOCK_EVERY, NATIVE, RECV, SEND, Program, ProgramRun, check_clock, view


def wait(requests: list[Any], test_all: Callable[[list[Any], Any], bool], statuses: Any,
         deadline: float, patience: float) -> str | None:
    """After a failed test of ``requests``: poll until all completed (None),
    ``deadline`` (monotonic) passed (EXPIRED) or ``patience`` seconds went by
    (LATE). ``statuses`` go to every test."""
    polls = 0
    since = 0.0
    while True:
        os.sched_yield()  # the CPU we do not burn is what a late peer needs
        if test_all(requests, statuses):
            return None
        polls += 1
        if polls % CLOCK_EVERY == 0:
            overdue, since = check_clock(since, deadline, patience)
            if overdue:
                return overdue


class _Missized(Exception):
    """Raised by the generated function: receive ``op`` got ``received`` bytes."""

    def __init__(self, op: int, received: int) -> None:
        super().__init__(op, received)
        self.op, self.received = op, received


class StraightLine:
    """``program``'s schedule in the straight-line ``order``, compiled to one
    function posting on ``channel`` of ``transport``. :meth:`bind` gives it
    the program's scratch views (again after the program made new scratch);
    :meth:`run` runs it over a caller's buffer."""

    __slots__ = ("program", "order", "source", "requests", "_fn", "_globals", "_nones",
                 "_scratch_slots", "_transport", "_tag_base", "_waits")

    def __init__(self, program: Program, order: StraightOrder, transport: Transport,
                 channel: str) -> None:
        self.program, self.order = program, order
        self._transport, self._tag_base = transport, transport.tag_base
        self._scratch_slots: list[tuple[Slot, bool]] = []  # (slot, received into)
        # Per wait: the statuses its test fills (None: the transport cannot
        # tell sizes) and (position in the wait, op) of each receive in it.
        self._waits: list[tuple[list[Any] | None, list[tuple[int, int]]]] = []
        self._nones = [None] * len(program.schedule.ops)
        self.requests: list[Any] = list(self._nones)
        isend, irecv = transport.posters(channel)
        # Everything but the buffer, the tags and the deadlines is a global of
        # the generated function: no argument to pass per call.
        self._globals: dict[str, Any] = {
            "q": self.requests, "s": (), "isend": isend, "irecv": irecv,
            "test_all": transport.tester(), "wait": wait, "Missized": _Missized,
            "rb": transport.receive_buffer}
        self.source = self._generate(program.schedule, self._globals)
        exec(compile(self.source, f"<straight {program.schedule.collective}>", "exec"),
             self._globals)
        self._fn = self._globals["run"]

    def _expr(self, slot: Slot, count: int, receive: bool = False) -> str:
        """The expression for ``slot``; a receive's as the transport's
        receive buffer (made once, in :meth:`bind`, for scratch)."""
        if slot.buf != DATA:
            self._scratch_slots.append((slot, receive))
            return f"s[{len(self._scratch_slots) - 1}]"
        expr = "data" if slot.offset == 0 and slot.count == count else \
            f"data[{slot.offset}:{slot.offset + slot.count}]"
        return f"rb({expr})" if receive else expr

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
                    lines.append(f"    q[{i}] = irecv({self._expr(op.dst, count, True)}, "
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
                lines += self._wait_lines(what, point, constants)  # type: ignore[arg-type]
                point += 1
        lines.append("    return None")
        return "\n".join(lines) + "\n"

    def _wait_lines(self, ops: tuple[int, ...], point: int,
                    constants: dict[str, Any]) -> list[str]:
        """Wait ``point``: test ``ops`` together, then check the size of each
        receive among them (the statuses ``t{point}`` are a constant)."""
        program = self.program
        recvs = [(j, i) for j, i in enumerate(ops) if program.kinds[i] == RECV]
        # Only a wait with a receive fills statuses (copied on every test).
        statuses = self._transport.statuses(len(ops)) if recvs else None
        self._waits.append((statuses, recvs))
        constants[f"t{point}"] = statuses
        lines = [f"    w = [{', '.join(f'q[{i}]' for i in ops)}]",
                 f"    if not test_all(w, t{point}):",
                 f"        o = wait(w, test_all, t{point}, deadline, patience)",
                 "        if o is not None:",
                 f"            return o, {point}"]
        if statuses is not None and recvs:
            constants["size"] = self._transport.received_bytes
            for j, i in recvs:
                lines += [f"    if size(t{point}[{j}]) != {self._recv_bytes(i)}:",
                          f"        raise Missized({i}, size(t{point}[{j}]))"]
        return lines

    def _recv_bytes(self, op: int) -> int:
        return self.program.schedule.ops[op].dst.count * self.program.dtype.itemsize  # type: ignore[union-attr]

    def bind(self, scratch: dict[str, np.ndarray]) -> None:
        """Use ``scratch`` (the program's arrays by name) from now on."""
        receive_buffer = self._transport.receive_buffer
        self._globals["s"] = tuple(receive_buffer(view(scratch, slot)) if receive
                                   else view(scratch, slot)
                                   for slot, receive in self._scratch_slots)

    def run(self, data: np.ndarray, seq: int, deadline: float,
            patience: float) -> tuple[str, int] | None:
        """Run over ``data`` as the collective numbered ``seq``: None when
        done, else ``(outcome, wait)`` with the requests left in
        :attr:`requests`. The transport's own errors come out as its
        TransportError, a message of the wrong size as MessageSizeError."""
        self.requests[:] = self._nones
        try:
            return self._fn(data, self._tag_base(seq), deadline, patience)
        except _Missized as wrong:
            raise self._size_error(seq, wrong.op, wrong.received) from None
        except self._transport.raw_errors as exc:
            error = self._transport.error_of(exc)
            raise self._overlong(error, seq) or error from exc

    def forget_requests(self) -> None:
        """Clear :attr:`requests` (``run`` clears them too, on entry): after a
        run ended elsewhere, so that :meth:`state` of a run that raised before
        posting anything sees nothing posted."""
        self.requests[:] = self._nones

    def _size_error(self, seq: int, op: int, received: int | None) -> MessageSizeError:
        return MessageSizeError(self.program.schedule.collective, seq, self.program.peers[op],
                                self._recv_bytes(op), received)

    def _overlong(self, error: BaseException, seq: int) -> MessageSizeError | None:
        """The receive a failed test reports truncated, if any. A test of
        all fills every status in request order, and only the failed test's
        can carry an error (any earlier failure ended the run), so the waits'
        statuses are searched in turn."""
        if not isinstance(error, TransportError):
            return None
        for statuses, recvs in self._waits:
            if statuses is None or not recvs:
                continue
            position = dict(recvs)
            for j, _, _ in self._transport.overlong(error, statuses):
                if j in position:
                    return self._size_error(seq, position[j], None)
        return None

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
        # A run state of its own, not the program's reusable one: after a
        # failure that posted nothing the engine keeps the program as it is,
        # and the program would then hold the caller's buffer for good (the
        # straight line never resets that state), so ndarray.resize failed.
        program.prepare()
        run = ProgramRun(program, program._args)
        run.data = data
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
