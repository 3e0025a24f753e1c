"""A lean executor for one schedule, run on the calling thread.

Why: on a loaded machine a small collective costs what its Python costs per
call (docs/benchmarks.md, "Why small messages miss"). The engine's general
turn walks services, queues, deadlines and every active run for each message
round; a blocking small collective with nothing else in flight needs none of
that. A :class:`Program` is a schedule lowered once (op kinds, peers, message
numbers, reduce kernels and views of its own scratch resolved); each call
binds the caller's buffer and runs the same dataflow (post what is ready, test
one outstanding request per poll and all of them once one completed, yield
the CPU between polls), and stops early when a peer is late, so the engine
can take the rest over with the very same requests (:class:`ProgramRun`).
The engine stays the only issuer: see ``Engine.run_inline``.

The local ops (reduce, copy, scale) live here too; the engine runs them the
same way.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..dtypes import DType
from ..errors import MessageSizeError, TransportError
from ..kernels import host as host_kernels
from ..schedule.ir import DATA, Copy, Native, Recv, Reduce, Scale, Schedule, Send, Slot
from ..transport.base import Transport

if TYPE_CHECKING:  # runtime/straight.py builds on this module
    from .straight import StraightLine

CLOCK_EVERY = 64  # failed tests between two looks at the clock

SEND, RECV, NATIVE, LOCAL = 0, 1, 2, 3

Plan = tuple[tuple[tuple[int, ...], ...], list[int], list[int]]


def plan(schedule: Schedule) -> Plan:
    """(successors of each op, in-degree of each op, the ops ready at the start
    with receives first: a receive posted before the peer's send arrives is
    matched in place instead of through MPI's unexpected-message queue)."""
    succ: list[list[int]] = [[] for _ in schedule.ops]
    for i, deps in enumerate(schedule.deps):
        for d in deps:
            succ[d].append(i)
    indegree = [len(d) for d in schedule.deps]
    first = [i for i, d in enumerate(indegree) if d == 0]
    first.sort(key=lambda i: not isinstance(schedule.ops[i], Recv))
    return tuple(tuple(s) for s in succ), indegree, first


def view(arrays: dict[str, np.ndarray], slot: Slot) -> np.ndarray:
    arr = arrays[slot.buf]
    if slot.offset == 0 and slot.count == arr.size:
        return arr  # the whole buffer: no view object to make
    return arr[slot.offset:slot.offset + slot.count]


def run_local(op: Any, arrays: dict[str, np.ndarray], dtype: DType) -> None:
    """Run a reduce, copy or scale op on the host."""
    if isinstance(op, Reduce):
        host_kernels.reduce_views(view(arrays, op.dst), view(arrays, op.src), op.op, dtype)
    elif isinstance(op, Copy):
        np.copyto(view(arrays, op.dst), view(arrays, op.src))
    elif isinstance(op, Scale):
        host_kernels.scale_into(view(arrays, op.dst), op.divisor, dtype)
    else:
        raise TypeError(f"unknown op {op!r}")


def post(op: Any, arrays: dict[str, np.ndarray], dtype: DType, transport: Transport,
         channel: str, seq: int) -> Any:
    """Post a Send, Recv or Native op and return its request; None for a local
    op (which the caller runs with :func:`run_local`)."""
    kind = type(op)
    if kind is Send:
        return transport.isend(view(arrays, op.src), op.peer, channel, seq, op.msg)
    if kind is Recv:
        return transport.irecv(view(arrays, op.dst), op.peer, channel, seq, op.msg)
    if kind is Native:
        arr = view(arrays, op.buf)
        if op.kind == "allreduce":
            return transport.native_allreduce(arr, op.op, dtype, op.ranks)
        return transport.native_broadcast(arr, op.root, op.ranks)
    return None


def overlong_receive(transport: Transport, error: TransportError, statuses: list[Any],
                     receives: list[tuple[int, int, int]]) -> int | None:
    """After ``error`` from a test that filled ``statuses``: the index of a
    receive among ``receives`` ((index, peer, tag) triples) that got a message
    longer than its buffer, or None. The statuses come in completion order,
    so the sender and the tag name the receive."""
    for _, sender, tag in transport.overlong(error, statuses):
        for k, peer, t in receives:
            if (peer, t) == (sender, tag):
                return k
    return None


def _local_kernel(op: Any, dtype: DType) -> Callable[[np.ndarray, Any], object]:
    """``fn(dst, src)`` running a local op on its two views (src None for Scale)."""
    if isinstance(op, Reduce):
        return host_kernels.reducer(op.op, dtype, op.dst.count)
    if isinstance(op, Copy):
        return np.copyto
    if isinstance(op, Scale):
        divisor = op.divisor
        return lambda d, _: host_kernels.scale_into(d, divisor, dtype)
    raise TypeError(f"unknown op {op!r}")


def _slots(op: Any) -> tuple[Slot, ...]:
    kind = type(op)
    if kind is Send:
        return (op.src,)
    if kind is Recv:
        return (op.dst,)
    if kind is Native:
        return (op.buf,)
    if kind is Scale:
        return (op.dst,)
    return (op.dst, op.src)


def _spec(slot: Slot, scratch: dict[str, np.ndarray], data_size: int) -> Any:
    """How a run finds a slot's array: a view of the program's own scratch
    (made once), None for the whole caller's buffer, or (lo, hi) of it. No
    reference to the caller's buffer is kept between calls."""
    if slot.buf != DATA:
        return view(scratch, slot)
    if slot.offset == 0 and slot.count == data_size:
        return None
    return (slot.offset, slot.offset + slot.count)


def _resolve(spec: Any, data: np.ndarray) -> np.ndarray:
    if spec is None:
        return data
    if type(spec) is tuple:
        return data[spec[0]:spec[1]]
    return spec


class Program:
    """A schedule over ``"data"`` and scratch, lowered for repeated inline runs
    over ``dtype`` on ``transport`` (native ops bound to their group, which
    must exist already).

    Why: on a loaded machine a call's cost is dominated by the Python objects
    it makes and touches (docs/benchmarks.md), so everything that does not
    depend on the caller's buffer is made once: op kinds, peers, message
    numbers, kernels, the scratch arrays and their views, and the run state,
    reset in place. Only one inline run is under way at a time
    (Engine.run_inline). :meth:`drop_scratch` when a run did not finish here
    (handed over or failed): MPI or the engine may still use the old arrays.
    ``runs`` counts the runs finished here, for the engine's statistics."""

    __slots__ = ("schedule", "dtype", "plan", "kinds", "peers", "msgs", "actions",
                 "sends", "bytes_sent", "recvs", "bytes_received", "local_ops", "runs",
                 "line", "scratch", "expected", "status", "statuses", "_args", "_run")

    def __init__(self, schedule: Schedule, dtype: DType, transport: Transport,
                 schedule_plan: Plan) -> None:
        self.schedule, self.dtype = schedule, dtype
        self.plan = schedule_plan  # plan(schedule), shared with the engine's cache
        kinds: list[int] = []
        peers: list[int] = []
        msgs: list[int] = []
        actions: list[Any] = []
        for op in schedule.ops:
            kind = type(op)
            kinds.append(SEND if kind is Send else RECV if kind is Recv
                         else NATIVE if kind is Native else LOCAL)
            peers.append(getattr(op, "peer", -1))
            msgs.append(getattr(op, "msg", 0))
            actions.append(_local_kernel(op, dtype) if kinds[-1] == LOCAL
                           else transport.native_starter(op, dtype) if kinds[-1] == NATIVE
                           else None)
        self.kinds, self.peers, self.msgs = tuple(kinds), tuple(peers), tuple(msgs)
        self.actions = tuple(actions)
        itemsize = dtype.itemsize
        self.sends = kinds.count(SEND)
        self.recvs = kinds.count(RECV)
        self.local_ops = kinds.count(LOCAL)
        self.bytes_sent = sum(op.src.count for op in schedule.ops if type(op) is Send) * itemsize
        self.bytes_received = sum(op.dst.count for op in schedule.ops
                                  if type(op) is Recv) * itemsize
        self.runs = 0
        # The bytes each receive expects (None: not a receive, or the
        # transport cannot tell sizes; 0 is an empty chunk's receive, checked
        # like any other), and what the test calls fill: one status for a
        # single request's test, a list for the test of all outstanding.
        statuses = transport.statuses(1)
        self.status = statuses[0] if statuses is not None else None
        self.statuses = transport.statuses(0)
        self.expected: tuple[int | None, ...] = tuple(
            op.dst.count * itemsize if kind == RECV and statuses is not None else None
            for op, kind in zip(schedule.ops, kinds))
        # The same schedule as straight Python (runtime/straight.py), set by the
        # engine where its order is proven deadlock-free; runs prefer it.
        self.line: StraightLine | None = None
        # None until prepare(): callers on the hot path test it themselves.
        self.scratch: dict[str, np.ndarray] | None = None
        self._args: list[Any] = []
        self._run: ProgramRun | None = None

    def drop_scratch(self) -> None:
        self.scratch = None
        self._run = None
        if self.line is not None:
            # Its requests are the engine's now, or given up: a run that fails
            # before it posts (in prepare) must not count them as its own.
            self.line.forget_requests()

    def arrays(self, data: np.ndarray) -> dict[str, np.ndarray]:
        """Every buffer the schedule names (for the engine, on a hand-over)."""
        return {**(self.scratch or {}), DATA: data}

    def prepare(self) -> None:
        """Make the scratch arrays and everything that refers to them, unless
        they exist (a run that did not finish here dropped them). The arrays
        are published last: a prepare cut short (Ctrl-C) is redone in full
        by the next call instead of leaving it views of nothing."""
        if self.scratch is not None:
            return
        storage = self.dtype.storage
        scratch = {name: np.empty(count, storage) for name, count in self.schedule.scratch}
        count = self.schedule.count
        self._args = [
            (_spec(op.dst, scratch, count),
             None if type(op) is Scale else _spec(op.src, scratch, count))
            if self.kinds[i] == LOCAL else _spec(_slots(op)[0], scratch, count)
            for i, op in enumerate(self.schedule.ops)]
        self._run = None
        if self.line is not None:
            self.line.bind(scratch)
        self.scratch = scratch

    def start(self, data: np.ndarray) -> ProgramRun:
        """The dataflow run over ``data`` (the caller's buffer,
        ``schedule.count`` elements), reset to the beginning."""
        self.prepare()
        run = self._run
        if run is None:
            self._run = run = ProgramRun(self, self._args)
        else:
            run.reset()
        run.data = data
        return run


DONE, LATE, EXPIRED = "done", "late", "expired"


def check_clock(since: float, deadline: float, patience: float) -> tuple[str | None, float]:
    """A waiting loop's look at the clock, every CLOCK_EVERY failed polls:
    (EXPIRED once ``deadline`` passed, LATE once ``patience`` seconds went by
    since the first look ``since`` (0.0 before it), else None; ``since``)."""
    now = time.monotonic()
    if now > deadline:
        return EXPIRED, since
    if not since:
        return None, now
    return (LATE if now - since > patience else None), since


class ProgramRun:
    """Where one run of a :class:`Program` stands: ops are issued in the order
    of ``ready`` (``ready[:pos]`` are issued), ``requests[k]`` belongs to op
    ``owners[k]``. A late run is handed to the engine from these facts."""

    __slots__ = ("program", "data", "args", "remaining", "ready", "pos", "completed",
                 "requests", "owners")

    def __init__(self, program: Program, args: list[Any]) -> None:
        succ, indegree, first = program.plan
        self.program, self.args = program, args
        self.data: np.ndarray | None = None
        self.remaining = list(indegree)
        self.ready = list(first)
        self.pos = 0
        self.completed = 0
        self.requests: list[Any] = []
        self.owners: list[int] = []

    def reset(self) -> None:
        succ, indegree, first = self.program.plan
        self.remaining[:] = indegree
        self.ready[:] = first
        self.pos = self.completed = 0
        self.requests.clear()
        self.owners.clear()

    def retire(self, done: Sequence[int]) -> None:
        """Drop the requests at indices ``done`` (completed) and their owners,
        in place (``execute`` holds the lists under local names)."""
        finished = set(done)
        keep = [k for k in range(len(self.requests)) if k not in finished]
        self.requests[:] = [self.requests[k] for k in keep]
        self.owners[:] = [self.owners[k] for k in keep]

    def execute(self, transport: Transport, channel: str, seq: int, deadline: float,
                patience: float) -> str:
        """Advance until every op is done (DONE), ``deadline`` (monotonic)
        passes (EXPIRED), or ``patience`` seconds go by without any completion
        (LATE). Exceptions propagate with the run's state current; the
        transport's own (posting included) as its TransportError."""
        program = self.program
        kinds, peers, msgs, actions = program.kinds, program.peers, program.msgs, program.actions
        succ = program.plan[0]
        args, data, remaining, ready = self.args, self.data, self.remaining, self.ready
        requests, owners = self.requests, self.owners
        isend, irecv = transport.posters(channel)
        base = transport.tag_base(seq)
        test_one, test_some = transport.test_one, transport.test_some
        expected, status, statuses = program.expected, program.status, program.statuses
        size, receive_buffer = transport.received_bytes, transport.receive_buffer
        total = len(kinds)
        pos, completed = self.pos, self.completed
        try:
            while True:
                while pos < len(ready):
                    i = ready[pos]
                    pos += 1
                    kind = kinds[i]
                    if kind == LOCAL:
                        dst, src = args[i]
                        actions[i](_resolve(dst, data), _resolve(src, data))
                        completed += 1
                        for s in succ[i]:
                            remaining[s] -= 1
                            if remaining[s] == 0:
                                ready.append(s)
                        continue
                    arr = args[i]
                    if arr is None:
                        arr = data
                    elif type(arr) is tuple:
                        arr = data[arr[0]:arr[1]]
                    if kind == SEND:
                        requests.append(isend(arr, peers[i], base | msgs[i]))
                    elif kind == RECV:
                        requests.append(irecv(receive_buffer(arr), peers[i], base | msgs[i]))
                    else:
                        requests.append(actions[i](arr))
                    owners.append(i)
                if completed == total:
                    self.data = None  # the caller's buffer is not ours to keep
                    return DONE
                # A failed poll is the common case and, on a loaded machine,
                # its cost is paid once per poll per rank: test one request
                # at a time, in turn (any test drives the transport's progress
                # for all), and look at all of them only once one completed.
                polls = 0
                since = 0.0
                k = 0
                try:
                    while not test_one(requests[k], status):
                        polls += 1
                        if polls % CLOCK_EVERY == 0:
                            overdue, since = check_clock(since, deadline, patience)
                            if overdue:
                                return overdue
                        k += 1
                        if k == len(requests):
                            k = 0
                        os.sched_yield()  # the CPU we do not burn is what a late peer needs
                    if len(requests) == 1:
                        done = [0]
                    else:
                        # the others that completed meanwhile, statuses in this order
                        done = test_some(requests, statuses)
                        done.append(k)
                except TransportError as error:
                    raise self._overlong(transport, error, k, seq) or error
                last = len(done) - 1
                for j, k in enumerate(done):
                    i = owners[k]
                    if expected[i] is not None:
                        received = size(status if j == last else statuses[j])
                        if received != expected[i]:
                            raise MessageSizeError(program.schedule.collective, seq, peers[i],
                                                   expected[i], received)
                    completed += 1
                    for s in succ[i]:
                        remaining[s] -= 1
                        if remaining[s] == 0:
                            ready.append(s)
                if len(done) == len(requests):
                    requests.clear()
                    owners.clear()
                else:
                    self.retire(done)
        except transport.raw_errors as exc:  # a bare poster's: as the straight line's
            raise transport.error_of(exc) from exc
        finally:
            self.pos, self.completed = pos, completed

    # -- the facts a hand-over or a failure needs (rare paths) ----------------
    def _overlong(self, transport: Transport, error: TransportError, k: int,
                  seq: int) -> MessageSizeError | None:
        """The receive that ``error`` reports truncated, if any: request
        ``k``'s own test (one status), or the test of all outstanding."""
        program, owners = self.program, self.owners
        if program.expected[owners[k]] is not None \
                and transport.overlong(error, [program.status]):
            i = owners[k]
        else:
            receives = [(j, program.peers[i], transport.tag(seq, program.msgs[i]))
                        for j, i in enumerate(owners) if program.expected[i] is not None]
            found = overlong_receive(transport, error, program.statuses or [], receives)
            if found is None:
                return None
            i = owners[found]
        return MessageSizeError(program.schedule.collective, seq, program.peers[i],
                                program.expected[i], None)

    def posted(self, transport: Transport) -> dict[int, Any]:
        """Outstanding requests by op index, sends as the transport marks them."""
        kinds = self.program.kinds
        return {i: transport.as_send(req) if kinds[i] == SEND else req
                for i, req in zip(self.owners, self.requests)}

    def issued_any_message(self) -> bool:
        kinds = self.program.kinds
        return any(kinds[i] != LOCAL for i in self.ready[:self.pos])

    def counts(self) -> tuple[int, int, int, int, int]:
        """(messages sent, bytes sent, messages received, bytes received, local
        ops) so far, as the engine counts them: sends when posted, receives
        when complete."""
        program = self.program
        ops, kinds, itemsize = program.schedule.ops, program.kinds, program.dtype.itemsize
        outstanding = set(self.owners)
        sent = bytes_sent = received = bytes_received = local = 0
        for i in self.ready[:self.pos]:
            if kinds[i] == SEND:
                sent += 1
                bytes_sent += ops[i].src.count * itemsize
            elif kinds[i] == RECV and i not in outstanding:
                received += 1
                bytes_received += ops[i].dst.count * itemsize
            elif kinds[i] == LOCAL:
                local += 1
        return sent, bytes_sent, received, bytes_received, local


__all__ = ["Program", "ProgramRun", "plan", "run_local", "post", "view",
           "DONE", "LATE", "EXPIRED"]
