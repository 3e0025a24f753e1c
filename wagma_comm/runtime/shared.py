"""Small reductions through the shared-memory segment: one exchange per call.

A call gets the next index ``k`` (in submission order, the same on every rank,
as sequence numbers are) and uses row set ``s = k % DEPTH``
(transport/shm.py). With ``M`` its members (all ranks, or this rank's group):

1. *post* (under the submission lock, so indices start in order): first
   finish this rank's own call ``k - DEPTH`` if nobody has (it used set ``s``
   too), then wait until every member of that call has marked it done (read
   this rank's row), write the row, its description, and ``arrive = k + 1``;
2. *complete*: wait until every member of ``M`` has ``arrive == k + 1``,
   check that they all describe the same call, reduce their rows in member
   order (the same bits on every member) into the caller's buffer, then mark
   ``done = k + 1``.

A row is never rewritten before every reader marked it done, so a
row is never read torn. A blocking call completes on its own thread. A
non-blocking one completes on the progress thread (the exchange is an engine
service while such calls are in flight), or on whichever thread first waits
for or tests its handle, posts call ``k + DEPTH``, or closes the communicator.
Waits yield the core (ranks may outnumber cores) and end at the call's
deadline with an error naming the ranks still missing.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from ..dtypes import DType
from ..errors import CollectiveTimeoutError, MismatchError, RankFailedError, WagmaError
from ..kernels import host as host_kernels
from ..transport.shm import ARRIVE, DEPTH, DONE, PRINT, TEXT_BYTES, TEXT_OFFSET, Segment
from .handle import Handle

ALGORITHM = "shared_memory"

_SPIN_S = 0.02  # yield the core this long before napping (the peer may be computing)
_NAP_MAX_S = 1e-3
_CLOCK_EVERY = 64  # failed polls between two looks at the clock
_LIVENESS_EVERY_S = 0.25  # while napping, how often dead members are looked for


class SharedCall:
    """What one kind of call (collective, members, count, dtype, op) needs,
    worked out once: its description and checksum (a peer describing another
    call is a MismatchError), and per row set a :class:`_Plan`."""

    __slots__ = ("collective", "members", "count", "dtype", "op", "text", "print",
                 "encoded", "flat", "nbytes", "plans")

    def __init__(self, collective: str, members: tuple[int, ...], count: int, dtype: DType,
                 op: str, text: str, flat: bool = False) -> None:
        self.collective, self.members, self.count = collective, members, count
        self.dtype, self.op, self.text = dtype, op, text
        self.nbytes = count * dtype.itemsize
        self.encoded = text.encode()[:TEXT_BYTES - 1]
        self.print = zlib.crc32(text.encode())
        self.flat = flat  # for the small-call path: the array is its own flat storage view
        self.plans: list[_Plan | None] = [None] * DEPTH


class _Plan:
    """One call kind in one row set: this rank's row (typed), the control
    words it writes and polls, and the reduction over the members' rows."""

    __slots__ = ("row", "arrive", "done", "prints", "my_arrive", "my_done", "my_print",
                 "reduce")

    def __init__(self, call: SharedCall, exchange: "SharedExchange", row_set: int) -> None:
        segment, rank, word = exchange.segment, exchange.rank, exchange.word
        storage = call.dtype.storage
        rows = [segment.rows[row_set, q, :call.nbytes].view(storage) for q in call.members]
        self.row = segment.rows[row_set, rank, :call.nbytes].view(storage)
        self.arrive = [word(row_set, q, ARRIVE) for q in call.members]
        self.done = [word(row_set, q, DONE) for q in call.members]
        self.prints = [word(row_set, q, PRINT) for q in call.members]
        self.my_arrive, self.my_done, self.my_print = (
            word(row_set, rank, ARRIVE), word(row_set, rank, DONE), word(row_set, rank, PRINT))
        divisor = len(rows) if call.op == "avg" else 1
        self.reduce = host_kernels.rows_reducer(call.op, call.dtype, rows, divisor)


class SharedExchange:
    """This rank's side of the protocol over one segment (per communicator)."""

    def __init__(self, segment: Segment, rank: int, on_failure: Callable[[WagmaError], None],
                 engine: Any) -> None:
        self.segment, self.rank, self.size = segment, rank, segment.size
        self._engine = engine  # runtime.engine.Engine: progress for non-blocking calls
        self._watch = engine.watch  # the watchdog threshold and line, dead peers
        self._async: list[Pending] = []  # non-blocking calls not finished
        self._async_lock = threading.Lock()
        self._serviced = False  # registered with the engine as a service
        self.completed = self.failed = 0  # calls finished here, for statistics()
        self._on_failure = on_failure  # a timeout or a death breaks the communicator
        # Control words as Python ints without NumPy scalars: a poll is one
        # index into this memoryview.
        self._words = memoryview(segment.flags.reshape(-1))
        self._stride = segment.flags.shape[2]  # words per control block
        self._next = 0  # index of the next call posted here
        self._last: list[Pending | None] = [None] * DEPTH  # last call of each row set
        self._texts: list[bytes] = [b""] * DEPTH  # description last written per set

    @property
    def posted(self) -> int:
        """Calls posted on this rank."""
        return self._next

    def word(self, row_set: int, rank: int, which: int) -> int:
        return ((row_set * self.size + rank) * self._stride) + which

    def post(self, seq: int, call: SharedCall, data: np.ndarray, deadline: float,
             timeout: float) -> "Pending":
        """Publish this rank's ``data`` for call ``seq`` (under the
        communicator's submission lock). May wait, until ``deadline``, for
        the members of this rank's call ``DEPTH`` earlier to have read its row."""
        k = self._next
        self._next = k + 1
        row_set = k % DEPTH
        plan = call.plans[row_set]
        if plan is None:
            plan = call.plans[row_set] = _Plan(call, self, row_set)
        previous = self._last[row_set]
        if previous is not None:
            if not previous.finished:
                previous.complete(previous.deadline, raise_error=False)
            try:
                self.wait(previous.plan.done, previous.call.members, previous.k + 1, deadline,
                          call.collective, seq,
                          f"they had not yet read this rank's part of round {previous.seq} "
                          "(shared-memory exchange)")
            except (CollectiveTimeoutError, RankFailedError) as exc:
                self._on_failure(exc)  # this call never arrives: the others' time out too
                raise
        np.copyto(plan.row, data)
        words = self._words
        if self._texts[row_set] is not call.encoded:
            text = self.segment.control[row_set, self.rank, TEXT_OFFSET:]
            text[:] = 0
            text[:len(call.encoded)] = np.frombuffer(call.encoded, np.uint8)
            self._texts[row_set] = call.encoded
        words[plan.my_print] = call.print
        # Last: x86-64 makes every store above visible before this one.
        words[plan.my_arrive] = k + 1
        pending = Pending(self, k, seq, call, plan, data, deadline, timeout)
        self._last[row_set] = pending
        return pending

    def track(self, pending: "Pending") -> None:
        """Have the progress thread finish the non-blocking ``pending``."""
        with self._async_lock:
            self._async.append(pending)
            if not self._serviced:
                try:
                    self._engine.add_service(self)
                    self._serviced = True
                except WagmaError:
                    pass  # closed or broken: its handle (or close) finishes it

    # -- Service (runtime/engine.py), on the progress thread --------------------
    def progress(self) -> bool:
        """Finish every tracked call whose rows all arrived; leave the engine
        once none is left (an idle service would keep its thread turning)."""
        progressed = False
        tracked = self._async
        for pending in tracked:
            progressed |= pending.try_complete()
        # Calls a waiter finished are dropped here too: a finished call left
        # in the list would keep the service busy, and the thread spinning.
        if not tracked or any(p.finished for p in tracked):
            with self._async_lock:
                self._async = [p for p in self._async if not p.finished]
                if not self._async:
                    self._serviced = False
                    self._engine.remove_service(self)
        return progressed

    def busy(self) -> bool:
        """Unfinished calls nobody is finishing: one a waiter is finishing
        (its lock held) needs no spinning progress thread beside it."""
        return any(not p.finished and not p._lock.locked() for p in self._async)

    def fail(self, error: WagmaError) -> None:
        """The engine broke or closed: the tracked calls finish on their
        handles' threads (or at close) instead; nothing is failed here."""
        with self._async_lock:
            self._serviced = False

    def in_flight(self) -> list["Pending"]:
        return [p for p in self._last if p is not None and not p.finished]

    def drain(self, error: WagmaError | None, until: float | None = None) -> int:
        """At close: finish every call in flight, each within its deadline (or
        ``until``), and fail the rest with ``error`` (``error`` alone: fail
        them all, a cancel). Either way they are marked done, so no peer
        waits for this rank to read its row. Returns how many were failed
        with ``error``."""
        cancelled = 0
        for pending in self.in_flight():
            if error is None or until is not None:
                limit = pending.deadline if until is None else min(until, pending.deadline)
                if pending.complete(limit, raise_error=False):
                    continue
            if error is not None:
                cancelled += pending.fail(error)
        return cancelled

    def wait(self, indices: Sequence[int], ranks: Sequence[int], want: int, deadline: float,
             collective: str, seq: int, what: str, until: float | None = None,
             watched: "Pending | None" = None) -> bool:
        """Until every control word ``indices[i]`` (of ``ranks[i]``) is at
        least ``want`` (True), one peer at a time: a failed poll yields the
        core, and after _SPIN_S naps (up to _NAP_MAX_S). Returns False at
        ``until`` (< deadline; 0.0: after one look). Past ``deadline``
        CollectiveTimeoutError names the ranks still missing; a dead one,
        RankFailedError. ``watched``: the call the watchdog line is about."""
        words = self._words
        started = looked = nap = 0.0
        polls = 0
        for n, i in enumerate(indices):
            while words[i] < want:
                if until == 0.0:
                    return False
                polls += 1
                if nap or polls % _CLOCK_EVERY == 0:
                    now = time.monotonic()
                    if not started:
                        started = looked = now
                    if now > deadline or (until is not None and now > until):
                        if now <= deadline:
                            return False
                        raise CollectiveTimeoutError(
                            collective, seq, self._missing(indices, ranks, want, n),
                            f"{what}; deadline passed")
                    if now - started >= _SPIN_S:
                        if now - looked > _LIVENESS_EVERY_S:
                            looked = now
                            self._look_around(indices, ranks, want, n, collective, seq, what,
                                              watched, now)
                        nap = min(_NAP_MAX_S, nap * 2 or 2e-5)
                        time.sleep(nap)
                        continue
                os.sched_yield()
        return True

    def _missing(self, indices: Sequence[int], ranks: Sequence[int], want: int,
                 first: int) -> list[int]:
        """The ranks whose word has not reached ``want`` (from ``first`` on:
        the ones before it were seen)."""
        words = self._words
        return [ranks[m] for m in range(first, len(indices)) if words[indices[m]] < want]

    def _look_around(self, indices: Sequence[int], ranks: Sequence[int], want: int, first: int,
                     collective: str, seq: int, what: str, watched: "Pending | None",
                     now: float) -> None:
        """A long wait's periodic look, as the engine's own runs get
        (runtime/watch.py): the watchdog line once, and dead members."""
        watch = self._watch
        missing = self._missing(indices, ranks, want, first)
        if (watched is not None and not watched.warned
                and watch.overdue(watched.deadline, watched.timeout, now)):
            watched.warned = True
            watch.warn(collective, seq, watched.deadline, watched.timeout, now,
                       "shared-memory exchange", missing)
        rank_failed = watch.dead_among(missing)
        if rank_failed is not None:
            raise rank_failed(collective, seq)


class Pending:
    """One posted call until this rank has read every member's row.
    ``handle``/``value``/``on_done``: set for a non-blocking call."""

    __slots__ = ("exchange", "k", "seq", "call", "plan", "data", "deadline", "timeout",
                 "finished", "error", "handle", "value", "on_done", "warned", "_lock")

    def __init__(self, exchange: SharedExchange, k: int, seq: int, call: SharedCall,
                 plan: _Plan, data: np.ndarray, deadline: float, timeout: float) -> None:
        self.exchange, self.k, self.seq, self.call = exchange, k, seq, call
        self.plan = plan
        self.data: np.ndarray | None = data
        self.deadline, self.timeout = deadline, timeout
        self.warned = False  # the watchdog logged this call already
        self.finished = False
        self.error: BaseException | None = None
        self.handle: Handle | None = None
        self.value: Any = None
        self.on_done: Callable[[], None] | None = None
        self._lock = threading.Lock()  # one completer: a waiter, a later post, close

    def complete(self, until: float, raise_error: bool = True, wait_turn: bool = True) -> bool:
        """Wait for every member's row until ``until``; reduce them into the
        buffer. True once finished; raises its error (``raise_error``).
        ``wait_turn=False``: False at once if another thread is finishing it."""
        if not self._lock.acquire(wait_turn):
            return False
        try:
            if not self.finished:
                try:
                    if not self._arrived(until):
                        return False
                    self._reduce()
                    if self.on_done is not None:
                        self.on_done()
                except WagmaError as exc:
                    self.error = exc
                    if isinstance(exc, (CollectiveTimeoutError, RankFailedError)):
                        self.exchange._on_failure(exc)  # a member is gone or stuck
                self._finish()
        finally:
            self._lock.release()
        if self.error is not None and raise_error:
            raise self.error
        return True

    def try_complete(self) -> bool:
        """The progress thread's poll: finish if every row is there, never
        waiting for another thread finishing it. True if this call did."""
        return not self.finished and self.complete(0.0, raise_error=False, wait_turn=False)

    def fail(self, error: WagmaError) -> bool:
        """Fail it with ``error`` unless it finished; True if this failed it."""
        with self._lock:
            if self.finished:
                return False
            self.error = error
            self._finish()
            return True

    def _arrived(self, until: float) -> bool:
        call = self.call
        return self.exchange.wait(self.plan.arrive, call.members, self.k + 1, self.deadline,
                                  call.collective, self.seq,
                                  "their part did not arrive (shared-memory exchange)", until,
                                  self)

    def _reduce(self) -> None:
        exchange, call, plan = self.exchange, self.call, self.plan
        words, mine = exchange._words, call.print
        for i in plan.prints:
            if words[i] != mine:
                control, row_set = exchange.segment.control, self.k % DEPTH
                details = {q: bytes(control[row_set, q, TEXT_OFFSET:]).rstrip(b"\0").decode(
                    errors="replace") for q, i in zip(call.members, plan.prints)
                    if words[i] != mine}
                raise MismatchError(call.collective, self.seq, details, call.text)
        plan.reduce(self.data)

    def _finish(self) -> None:
        """Mark the rows read (after every read above: x86-64 keeps a store
        after earlier loads) and hand the outcome to the handle."""
        exchange = self.exchange
        exchange._words[self.plan.my_done] = self.k + 1
        self.finished = True
        if self.error is None:
            exchange.completed += 1
        else:
            exchange.failed += 1
        self.data = None
        handle = self.handle
        if handle is not None:
            handle._complete(self.value, self.error)
            self.value = None

    # -- Handle hooks (non-blocking calls) ------------------------------------
    def drive(self, handle: Handle, until: float) -> None:
        """Handle.wait: finish here (the error goes to the handle)."""
        self.complete(until, raise_error=False)

    def nudge(self, handle: Handle) -> None:
        """Handle.test: finish if every row is there, without waiting; if not,
        yield the core, as a failed poll does elsewhere (a loop of test()
        calls would otherwise keep it from the peers it waits for)."""
        self.complete(0.0, raise_error=False)
        if not self.finished:
            os.sched_yield()


def describe(collective: str, members: Sequence[int], count: int, dtype: DType, op: str,
             extra: str) -> str:
    """The description a call is checked against its members' with."""
    return (f"{collective}(count={count},dtype={dtype.name},op={op}{extra},"
            f"algorithm={ALGORITHM},members={list(members)})")


__all__ = ["ALGORITHM", "SharedCall", "SharedExchange", "Pending", "describe"]
