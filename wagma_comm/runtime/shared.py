"""Reductions through the shared-memory segment: one exchange per piece.

A buffer is cut into pieces of at most one row (transport/shm.py). Each piece
gets the next index ``k`` (in submission order, the same on every rank, as
sequence numbers are) and uses row set ``s = k % DEPTH``. With ``M`` its
members (all ranks, or this rank's group):

1. *post* (under the submission lock, so indices start in order): first
   finish this rank's own piece ``k - DEPTH`` if nobody has (it used set ``s``
   too), then wait until every member of that piece has marked it done (read
   this rank's row), write the row, its description, and ``arrive = k + 1``;
2. *complete*, for a small piece: wait until every member of ``M`` has
   ``arrive == k + 1``, check that they all describe the same call, reduce
   their rows in member order (the same bits on every member) into the
   caller's buffer, then mark ``done = k + 1``;
3. *complete*, for a piece whose rows add up to SPLIT_MIN_BYTES (a reduce-scatter and
   an allgather through the rows): as 2., but each member reduces only its
   own share of the piece (a range no other member reads in the rows), into
   the caller's buffer and back into that range of its own row, and marks
   ``reduced = k + 1``; then it copies each other member's share from that
   member's row once its ``reduced`` says so, and marks ``done = k + 1``.
   Each rank reduces 1/M of the piece instead of all of it.

A broadcast takes steps 1 and 2 with these differences: only its root
writes its row; every other member waits for the root's ``arrive`` alone,
checks the root's description alone, and copies the root's row where a
reduction would reduce every row; the root waits for nobody (its call
finishes at its post, as an eager send does), so it finds no mismatch
itself. The root's row is still not rewritten before every member marked
it done.

A row is never rewritten before every reader marked it done, so a
row is never read torn. Up to DEPTH pieces are in flight at once: the post of
piece ``k`` finishes piece ``k - DEPTH``, so a call of many pieces pipelines.
A blocking call completes on its own thread. A
non-blocking one completes on the progress thread (the exchange is an engine
service while such calls are in flight), or on whichever thread first waits
for or tests its handle, posts call ``k + DEPTH``, or closes the communicator;
its handle completes with its last piece, after all the others. Its post
copies only the pieces within EAGER_BYTES; the progress thread (woken for
them), a waiter or the next post publishes the rest.
Waits yield the core (ranks may outnumber cores) and end at the call's
deadline with an error naming the ranks still missing, or within a nap of
close(cancel=True) (:meth:`SharedExchange.cancel`) with its error.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from ..dtypes import DType
from ..errors import (CollectiveTimeoutError, InvalidArgumentError, MismatchError,
                      RankFailedError, WagmaError)
from ..kernels import host as host_kernels
from ..transport.shm import (ARRIVE, DEPTH, DONE, PIECES, PRINT, REDUCED, TEXT_BYTES,
                             TEXT_OFFSET, Segment)
from .handle import Handle

ALGORITHM = "shared_memory"

_SPIN_S = 0.02  # yield the core this long before napping (the peer may be computing)
_NAP_MAX_S = 1e-3
_CLOCK_EVERY = 64  # failed polls between two looks at the clock
_LIVENESS_EVERY_S = 0.25  # while napping, how often dead members are looked for

SPLIT_MIN_BYTES = 1 << 20
"""A piece whose members' rows add up to at least this much is reduced in
shares (step 3 above): reading every row would cost each rank more than the
second wait does (docs/benchmarks.md, "Shared memory for every size")."""
_SHARE_ALIGN = 64  # shares start on cache lines: no two members write one line

EAGER_BYTES = 64 << 10
"""A non-blocking post copies at most this much into its rows on the caller's
thread; later pieces are published by the progress thread (or a waiter), so
the post returns before the copy the compute could hide (a 1 MiB copy is
about 70 us here: docs/benchmarks.md, "Non-blocking posts")."""

DEFAULT_MAX_BYTES = 1 << 20
OVERSUBSCRIBED_MAX_BYTES = 16 << 20
"""The largest buffer ``algorithm=None`` sends through the segment: 1 MiB
where every rank of the host can have a core, 16 MiB where ranks outnumber
cores (each message round then waits for a peer to be scheduled, which the
exchange's two waits per piece do not). Measured on 2 and 8 ranks of a 2-core
machine: docs/benchmarks.md, "Shared memory for every size"."""
MAX_BYTES_VARIABLE = "WAGMA_SHM_MAX_BYTES"


def max_bytes_override() -> int | None:
    """WAGMA_SHM_MAX_BYTES as a number of bytes, or None where unset
    (``init()`` checks it before any MPI call, on every rank)."""
    override = os.environ.get(MAX_BYTES_VARIABLE, "").strip()
    if not override:
        return None
    try:
        value = int(override)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidArgumentError(MAX_BYTES_VARIABLE,
                                   f"expected a number of bytes >= 0, got {override!r}")
    return value


def default_max_bytes(ranks_on_host: int) -> int:
    """The default algorithm's limit for the segment (bytes per rank), from
    what every rank of the host sees alike: its rank and CPU counts, or
    WAGMA_SHM_MAX_BYTES (which must then be set alike on every rank)."""
    override = max_bytes_override()
    if override is not None:
        return override
    cores = os.cpu_count() or 1
    return OVERSUBSCRIBED_MAX_BYTES if ranks_on_host > cores else DEFAULT_MAX_BYTES


class SharedCall:
    """What one kind of call (collective, members, count, dtype, op) needs,
    worked out once: its description and checksum (a peer describing another
    call is a MismatchError), its pieces, and per row set and piece length a
    plan (:class:`_Plan` or :class:`_SplitPlan`)."""

    __slots__ = ("collective", "members", "count", "dtype", "op", "text", "print",
                 "encoded", "flat", "nbytes", "pieces", "plans", "root")

    def __init__(self, collective: str, members: tuple[int, ...], count: int, dtype: DType,
                 op: str, text: str, flat: bool = False, root: int | None = None) -> None:
        self.collective, self.members, self.count = collective, members, count
        self.dtype, self.op, self.text = dtype, op, text
        self.root = root  # a broadcast's root (its row is every member's result); else None
        self.nbytes = count * dtype.itemsize
        self.encoded = text.encode()[:TEXT_BYTES - 1]
        self.print = zlib.crc32(text.encode())
        self.flat = flat  # for the small-call path: the array is its own flat storage view
        self.pieces: tuple[tuple[int, int], ...] | None = None  # (offset, length), at first post
        self.plans: dict[tuple[int, int], _Plan] = {}


class _Plan:
    """One piece length of a call kind in one row set: this rank's row
    (typed), the control words it writes and polls, and the reduction of
    ``share`` (here every element: step 2) over the rows of ``sources`` (the
    members). A broadcast's sources are its root alone (none on the root
    itself), its reduction a copy of the root's row (nothing on the root),
    and only the root writes its row."""

    __slots__ = ("row", "sources", "arrive", "done", "prints", "my_arrive", "my_done",
                 "my_print", "my_pieces", "share", "reduce", "writes_row")

    def __init__(self, call: SharedCall, exchange: "SharedExchange", row_set: int,
                 length: int, share: slice = slice(None)) -> None:
        rank, word, root = exchange.rank, exchange.word, call.root
        self.row = exchange.row(row_set, rank, call.dtype, length)
        self.sources = (call.members if root is None
                        else () if root == rank else (root,))
        self.arrive = [word(row_set, q, ARRIVE) for q in self.sources]
        self.prints = [word(row_set, q, PRINT) for q in self.sources]
        self.done = [word(row_set, q, DONE) for q in call.members]  # who reads this row
        self.my_arrive, self.my_done, self.my_print, self.my_pieces = (
            word(row_set, rank, ARRIVE), word(row_set, rank, DONE), word(row_set, rank, PRINT),
            word(row_set, rank, PIECES))
        self.share = share
        self.writes_row = root is None or root == rank
        if root is not None:
            self.reduce = (_keep if root == rank
                           else _copier(exchange.row(row_set, root, call.dtype, length)))
            return
        rows = [exchange.row(row_set, q, call.dtype, length)[share] for q in call.members]
        divisor = len(rows) if call.op == "avg" else 1
        self.reduce = host_kernels.rows_reducer(call.op, call.dtype, rows, divisor)


def _keep(data: np.ndarray) -> None:
    """A broadcast's root: its buffer is the result already."""


def _copier(source: np.ndarray) -> Callable[[np.ndarray], None]:
    """A broadcast's other members: the result is the root's row."""
    def copy(data: np.ndarray) -> None:
        np.copyto(data, source)
    return copy


class _SplitPlan(_Plan):
    """As :class:`_Plan`, for a piece reduced in shares (step 3): member
    ``i`` reduces elements ``bounds[i]:bounds[i + 1]``, this rank ``share``."""

    __slots__ = ("reduced", "my_reduced", "shares")

    def __init__(self, call: SharedCall, exchange: "SharedExchange", row_set: int,
                 length: int) -> None:
        bounds = split_bounds(length, len(call.members), call.dtype.itemsize)
        mine = call.members.index(exchange.rank)
        super().__init__(call, exchange, row_set, length, slice(bounds[mine], bounds[mine + 1]))
        word = exchange.word
        self.reduced = [word(row_set, q, REDUCED) for q in call.members]
        self.my_reduced = word(row_set, exchange.rank, REDUCED)
        # (member, its reduced word, its share as this rank reads it, where it goes)
        self.shares = [(q, self.reduced[i], exchange.row(row_set, q, call.dtype, length)[
            bounds[i]:bounds[i + 1]], slice(bounds[i], bounds[i + 1]))
            for i, q in enumerate(call.members) if i != mine]


def _lock_timeout(until: float) -> float:
    """A lock's wait until ``until``: at most threading.TIMEOUT_MAX (a valid
    timeout such as 1e10 s would make acquire() raise OverflowError)."""
    return min(threading.TIMEOUT_MAX, max(0.0, until - time.monotonic()))


def _copied_at_post(index: int, end_bytes: int) -> bool:
    """Whether a non-blocking post publishes its piece ``index`` (ending
    ``end_bytes`` into the buffer) itself rather than queue it."""
    return index < DEPTH and end_bytes <= EAGER_BYTES


def split_bounds(length: int, members: int, itemsize: int) -> list[int]:
    """Where each member's share of ``length`` elements starts (and, last,
    ``length``): as equal as whole cache lines allow, none empty when
    ``length`` has a cache line per member."""
    unit = max(1, _SHARE_ALIGN // itemsize)
    units = -(-length // unit)
    return [min(length, units * i // members * unit) for i in range(members)] + [length]


def splits(call: SharedCall, length: int) -> bool:
    """Whether a piece of ``length`` elements is reduced in shares: the same
    answer on every member (it depends on the call alone)."""
    members = len(call.members)
    unit = max(1, _SHARE_ALIGN // call.dtype.itemsize)
    return (call.root is None and members > 1
            and length * call.dtype.itemsize * members >= SPLIT_MIN_BYTES
            and length >= members * unit)


class SharedExchange:
    """This rank's side of the protocol over one segment (per communicator)."""

    def __init__(self, segment: Segment, rank: int, on_failure: Callable[[WagmaError], None],
                 engine: Any) -> None:
        self.segment, self.rank, self.size = segment, rank, segment.size
        self.max_bytes = default_max_bytes(self.size)  # what algorithm=None sends here
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
        self._next = 0  # index of the next piece posted here
        self._calls = 0  # calls posted here
        self._post_lock = threading.Lock()  # publishing: indices, rows, _last, _queue
        self._queue: deque[Pending] = deque()  # reserved pieces not yet published, in order
        self._last: list[Pending | None] = [None] * DEPTH  # last call of each row set
        self._texts: list[bytes] = [b""] * DEPTH  # description last written per set
        self._cancel: WagmaError | None = None  # set by cancel(): every wait raises it

    @property
    def posted(self) -> int:
        """Calls posted on this rank (a call of several pieces counts once)."""
        return self._calls

    def word(self, row_set: int, rank: int, which: int) -> int:
        return ((row_set * self.size + rank) * self._stride) + which

    def row(self, row_set: int, rank: int, dtype: DType, length: int) -> np.ndarray:
        """The first ``length`` elements of ``rank``'s row in ``row_set``."""
        return self.segment.rows[row_set, rank, :length * dtype.itemsize].view(dtype.storage)

    def post(self, seq: int, call: SharedCall, data: np.ndarray, deadline: float,
             timeout: float, lazy: bool = False) -> "Pending":
        """Publish this rank's ``data`` (flat) for call ``seq``, piece by
        piece (under the communicator's submission lock); returns the last
        piece, which finishes after the others. Each piece may wait, until
        ``deadline``, for the members of this rank's piece DEPTH earlier to
        have read its row, finishing that piece first if nobody has.
        ``lazy`` (a non-blocking call): publish now only the first pieces
        within EAGER_BYTES (and DEPTH); the others wait in a queue for the
        progress thread, a waiter or the next post, so the post neither waits
        for its own pieces nor makes a long copy."""
        pieces = call.pieces
        if pieces is None:
            per = max(1, self.segment.slot_bytes // call.dtype.itemsize)
            pieces = call.pieces = tuple(
                (offset, min(per, call.count - offset))
                for offset in range(0, call.count, per)) or ((0, 0),)
        with self._post_lock:
            # Indices are published in order; the waits for earlier calls'
            # queued pieces are this call's, ending at its own deadline.
            self._publish_queued(None, behalf=(call.collective, seq, deadline))
            self._calls += 1
            if len(pieces) == 1:
                pending = self._reserve(seq, call, data, pieces[0][1], deadline, timeout)
                if lazy and not _copied_at_post(0, call.nbytes):
                    self._queue.append(pending)
                else:
                    try:
                        self._publish(pending, None)
                    except WagmaError as exc:
                        pending.abandon(exc)  # counted failed, as a call failing later is
                        raise
                return pending
            last = len(pieces) - 1
            reserved = [self._reserve(seq, call, data[offset:offset + length], length, deadline,
                                      timeout, counted=i == last)
                        for i, (offset, length) in enumerate(pieces)]
            reserved[last].earlier = reserved[:last]
            for piece in reserved[:last]:
                piece.whole = reserved[last]  # one watchdog line for the call
            itemsize = call.dtype.itemsize
            try:
                for i, (pending, (offset, length)) in enumerate(zip(reserved, pieces)):
                    if lazy and not _copied_at_post(i, (offset + length) * itemsize):
                        self._queue.extend(reserved[i:])
                        break
                    self._publish(pending, None)
            except WagmaError as exc:
                # The caller gets the error and may reuse its buffer: the
                # pieces already published (finished later by a waiter on
                # their row set, or by close) must never reduce into it.
                for piece in reserved:
                    piece.abandon(exc)
                raise
            return reserved[last]

    def _reserve(self, seq: int, call: SharedCall, data: np.ndarray, length: int,
                 deadline: float, timeout: float, counted: bool = True) -> "Pending":
        """The next index and its plan, for a piece to publish in turn."""
        k = self._next
        self._next = k + 1
        row_set = k % DEPTH
        plan = call.plans.get((row_set, length))
        if plan is None:
            kind = _SplitPlan if splits(call, length) else _Plan
            plan = call.plans[(row_set, length)] = kind(call, self, row_set, length)
        pending = (SplitPending if type(plan) is _SplitPlan else Pending)(
            self, k, seq, call, plan, data, deadline, timeout)
        pending.counted = counted
        return pending

    def publish_through(self, pending: "Pending | None", until: float, wait_turn: bool) -> bool:
        """Publish the queued pieces up to ``pending`` (None: all of them);
        False at ``until``, or at once if another thread is publishing and
        not ``wait_turn``."""
        # Until ``until`` at most: another thread's post may hold the lock
        # while it waits for late peers, and wait(timeout=) keeps its timeout.
        lock = self._post_lock
        if not (lock.acquire(False)  # the common case, without a timed acquire's cost
                or wait_turn and lock.acquire(timeout=_lock_timeout(until))):
            return False
        try:
            return self._publish_queued(pending, until, wait_turn)
        finally:
            self._post_lock.release()

    def _publish_queued(self, through: "Pending | None", until: float | None = None,
                        wait_turn: bool = True,
                        behalf: tuple[str, int, float] | None = None) -> bool:
        """Publish queued pieces in order, all or up to ``through``
        (``_post_lock`` held); False at ``until``. ``behalf``: as for
        :meth:`_publish`."""
        queue = self._queue
        while queue and not (through is not None and through.published):
            if not self._publish(queue[0], until, wait_turn, behalf):  # (drops a failed one)
                return False
            queue.popleft()
        return True

    def _publish(self, pending: "Pending", until: float | None, wait_turn: bool = True,
                 behalf: tuple[str, int, float] | None = None) -> bool:
        """Step 1 for one reserved piece; False at ``until`` if the members
        of the piece DEPTH earlier have not all read this rank's row (or, not
        ``wait_turn``, another thread is finishing that piece). ``behalf``:
        the (collective, round, deadline) of a later call whose post
        publishes this queued piece: its waits end at that deadline too, and
        their errors name that call (the one that raises them)."""
        call, plan, k = pending.call, pending.plan, pending.k
        data = pending.data  # None: it finished (failed) unpublished, so it is dropped
        if data is None:
            return True
        collective, seq, deadline = (
            (call.collective, pending.seq, pending.deadline) if behalf is None
            else (behalf[0], behalf[1], min(behalf[2], pending.deadline)))
        row_set = k % DEPTH
        previous = self._last[row_set]
        if previous is not None:
            try:
                # Bounded by this call's deadline too: an earlier call may have
                # a longer timeout than this one.
                if not previous.finished and not previous.complete(
                        min(previous.deadline, deadline) if until is None else until,
                        False, wait_turn):
                    if until is not None and time.monotonic() <= deadline:
                        return False
                    raise CollectiveTimeoutError(
                        collective, seq, previous.waiting_for(),
                        f"round {previous.seq} before it on this rank's row set did not "
                        "finish in time (shared-memory exchange)")
                if not self.wait(previous.plan.done, previous.call.members, previous.k + 1,
                                 deadline, collective, seq,
                                 f"they had not yet read this rank's part of round "
                                 f"{previous.seq} (shared-memory exchange)", until,
                                 pending):
                    return False
            except (CollectiveTimeoutError, RankFailedError) as exc:
                self._on_failure(exc)  # this call never arrives: the others' time out too
                raise
        if plan.writes_row:
            np.copyto(plan.row, data)
        words = self._words
        if self._texts[row_set] is not call.encoded:
            text = self.segment.control[row_set, self.rank, TEXT_OFFSET:]
            text[:] = 0
            text[:len(call.encoded)] = np.frombuffer(call.encoded, np.uint8)
            self._texts[row_set] = call.encoded
        words[plan.my_print] = call.print
        words[plan.my_pieces] = len(call.pieces or ())
        # Last: x86-64 makes every store above visible before this one.
        words[plan.my_arrive] = k + 1
        pending.published = True
        if pending.finished:  # failed meanwhile on another thread, which saw it unpublished
            words[plan.my_done] = k + 1
        self._last[row_set] = pending
        return True

    def track(self, pending: "Pending") -> None:
        """Have the progress thread finish the non-blocking ``pending``.
        Still registered from an earlier call, the service may have the
        thread napping long (nothing was busy): a call with pieces left to
        publish wakes it, since the peers wait for them. A published one
        does not (its caller usually waits soon and reduces it then; waking
        a thread costs more than a small call, docs/benchmarks.md)."""
        with self._async_lock:
            self._async.extend(pending.earlier)
            self._async.append(pending)
            registered = self._serviced
            if not registered:
                try:
                    self._engine.add_service(self)  # wakes the thread
                    self._serviced = True
                except WagmaError:
                    pass  # closed or broken: its handle (or close) finishes it
        if registered and not pending.published:
            self._engine.wake()

    # -- Service (runtime/engine.py), on the progress thread --------------------
    def progress(self) -> bool:
        """Finish every tracked call whose rows all arrived; leave the engine
        once none is left (an idle service would keep its thread turning)."""
        progressed = False
        if self._queue:  # publish what can be, so the peers need not wait for a waiter
            queued = len(self._queue)
            try:
                self.publish_through(None, 0.0, False)
            except WagmaError as exc:  # a deadline passed: the communicator is broken
                self._fail_queued(exc)
            progressed = len(self._queue) < queued
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

    def _fail_queued(self, error: WagmaError) -> None:
        """Fail every piece still waiting to be published: their calls'
        handles complete with ``error``."""
        with self._post_lock:
            queued, self._queue = list(self._queue), deque()
        for pending in queued:
            pending.fail(error)

    def busy(self) -> bool:
        """Unfinished calls nobody is finishing: one a waiter is finishing
        (its lock held) needs no spinning progress thread beside it."""
        return any(not p.finished and not p._lock.locked() for p in self._async)

    def fail(self, error: WagmaError) -> None:
        """The engine broke or closed: the tracked calls finish on their
        handles' threads (or at close) instead; nothing is failed here."""
        with self._async_lock:
            self._serviced = False

    def release(self) -> None:
        """At close, every call finished: drop this exchange's views of the
        segment (and the last calls, whose handles hold callers' buffers),
        so the segment can be unmapped while the communicator lives on. A
        thread still on its way out of a call (its error being raised) may
        read the words: it gets a copy of them, not None."""
        self._words = memoryview(np.array(self._words))
        self._last = [None] * DEPTH
        self._queue.clear()
        with self._async_lock:
            self._async = []

    def in_flight(self) -> list["Pending"]:
        """Pieces not finished: published ones, then the queue in order."""
        return ([p for p in self._last if p is not None and not p.finished]
                + [p for p in list(self._queue) if not p.finished])

    def cancel(self, error: WagmaError) -> None:
        """close(cancel=True), before it takes any lock: from now on every
        wait here for a peer (a blocking call's, a post's, a waiter's) raises
        a copy of ``error`` within a nap, releasing the locks it holds, so
        neither close nor its drain waits for a call's deadline."""
        self._cancel = error

    def cancelled(self) -> WagmaError | None:
        """A fresh copy of close(cancel=True)'s error once it was given, else
        None: what other waits on this host (the WAGMA board's) raise too."""
        return None if self._cancel is None else self._cancelled()

    def _cancelled(self) -> WagmaError:
        """A fresh copy of the cancel's error (threads may raise it at once)."""
        error = self._cancel
        assert error is not None
        return type(error)(*error.args)

    def drain(self, error: WagmaError | None, until: float | None = None) -> int:
        """At close: finish every call in flight, each within its deadline (or
        ``until``), and fail the rest with ``error`` (``error`` alone: fail
        them all, a cancel). Either way the published ones are marked done,
        so no peer waits for this rank to read its row. Returns how many
        pieces the cancel failed (here, or on the thread that was finishing
        them)."""
        flight = self.in_flight()
        if error is None or until is not None:
            for pending in flight:
                limit = pending.deadline if until is None else min(until, pending.deadline)
                pending.complete(limit, raise_error=False)
        if error is None:
            return 0
        # Cancelled first: a thread finishing a call (its lock held) while it
        # waits for a peer lets go within a nap instead of at the deadline.
        self.cancel(error)
        left = self.in_flight()
        for pending in left:
            pending.fail(error)  # once its lock is free: each is finished after this
        flight += [p for p in left if p not in flight]
        return sum(p.error is not None and p.error.args == error.args for p in flight)

    def wait(self, indices: Sequence[int], ranks: Sequence[int], want: int, deadline: float,
             collective: str, seq: int, what: str, until: float | None = None,
             watched: "Pending | None" = None) -> bool:
        """Until every control word ``indices[i]`` (of ``ranks[i]``) is at
        least ``want`` (True), one peer at a time: a failed poll yields the
        core, and after _SPIN_S naps (up to _NAP_MAX_S). Returns False at
        ``until`` (< deadline; 0.0: after one look, so a poller too sees
        the deadline pass, and every _LIVENESS_EVERY_S of ``watched``'s
        polls the watchdog and dead members). Past ``deadline``
        CollectiveTimeoutError names the ranks still missing; a dead one,
        RankFailedError; after :meth:`cancel`, its error (looked at with the
        clock). ``watched``: the call the watchdog line is about."""
        words = self._words
        started = looked = nap = 0.0
        polls = 0
        for n, i in enumerate(indices):
            while words[i] < want:
                if until == 0.0:
                    now = time.monotonic()
                    if now <= deadline:
                        if watched is not None and now - watched.looked > _LIVENESS_EVERY_S:
                            watched.looked = now  # a poller too learns of a dead member
                            self._look_around(indices, ranks, want, n, collective, seq, what,
                                              watched, now)
                        return False  # one look; past the deadline a poll raises too
                polls += 1
                if nap or until == 0.0 or polls % _CLOCK_EVERY == 0:
                    if self._cancel is not None:  # close(cancel=True)
                        raise self._cancelled()
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
        if watched is not None:
            watched = watched.whole  # its call's line, once for all its pieces
        if (watched is not None and not watched.warned
                and watch.overdue(watched.deadline, watched.timeout, now)):
            watched.warned = True
            # The line is about the watched call (a later call's post may be
            # waiting for it: collective and seq then name the poster).
            watch.warn(watched.call.collective, watched.seq, watched.deadline,
                       watched.timeout, now, "shared-memory exchange", missing)
        rank_failed = watch.dead_among(missing)
        if rank_failed is not None:
            raise rank_failed(collective, seq)


class Pending:
    """One posted piece until this rank has read every member's row (and the
    pieces before it in ``earlier``, for the last piece of a call).
    ``handle``/``value``/``on_done``: set on a non-blocking call's last piece."""

    __slots__ = ("exchange", "k", "seq", "call", "plan", "data", "deadline", "timeout",
                 "finished", "error", "handle", "value", "on_done", "warned", "looked",
                 "earlier", "counted", "published", "abandoned", "whole", "_lock")

    def __init__(self, exchange: SharedExchange, k: int, seq: int, call: SharedCall,
                 plan: _Plan, data: np.ndarray, deadline: float, timeout: float) -> None:
        self.exchange, self.k, self.seq, self.call = exchange, k, seq, call
        self.plan = plan
        self.data: np.ndarray | None = data
        self.deadline, self.timeout = deadline, timeout
        self.warned = False  # the watchdog logged this call already
        self.looked = deadline - timeout  # last look for dead members while polled
        self.finished = False
        self.error: BaseException | None = None
        self.handle: Handle | None = None
        self.value: Any = None
        self.on_done: Callable[[], None] | None = None
        self.earlier: Sequence[Pending] = ()  # the call's other pieces (its last piece only)
        self.counted = True  # counts as a call in statistics (a call's last piece)
        self.published = False  # its row and arrive word are written (step 1)
        self.abandoned: WagmaError | None = None  # its call failed: reduce nothing
        self.whole: Pending = self  # the call's last piece: its ``warned`` is the call's
        self._lock = threading.Lock()  # one completer: a waiter, a later post, close

    def complete(self, until: float, raise_error: bool = True, wait_turn: bool = True) -> bool:
        """Wait for every member's row until ``until``; reduce them into the
        buffer. True once finished; raises its error (``raise_error``).
        ``wait_turn=False``: False at once if another thread is finishing it."""
        # Published first (and every piece before it): a piece that fails
        # must still have its row and words out, or its peers would wait for
        # them. Before taking this piece's lock: a post holding the queue's
        # lock may publish this piece and, DEPTH pieces on, wait for its
        # lock, which a waiter holding it while waiting for the queue's lock
        # would keep from it until the deadline.
        published_error: WagmaError | None = None
        if not (self.finished or self.published):
            try:
                if not self.exchange.publish_through(self, until, wait_turn):
                    return False
            except WagmaError as exc:
                published_error = exc  # recorded as its error, under its lock
        if not self._take_turn(until, wait_turn):
            return False
        try:
            if not self.finished:
                try:
                    if published_error is not None:
                        raise published_error
                    if not (self._earlier_finished(until, wait_turn) and self._run(until)):
                        return False
                    if self.on_done is not None:
                        self.on_done()
                except WagmaError as exc:
                    self.error = exc
                    if isinstance(exc, (CollectiveTimeoutError, RankFailedError)):
                        self.exchange._on_failure(exc)  # a member is gone or stuck
                    for piece in self.earlier:  # none may write the buffer after this
                        piece.abandon(exc)
                self._finish()
        finally:
            self._lock.release()
        if self.error is not None and raise_error:
            raise self.error
        return True

    def _take_turn(self, until: float, wait_turn: bool) -> bool:
        """This piece's lock: at once, or (``wait_turn``) until ``until``.
        (A timed acquire costs 0.6 us even when the lock is free.)"""
        if self._lock.acquire(False):
            return True
        return wait_turn and self._lock.acquire(timeout=_lock_timeout(until))

    def abandon(self, error: WagmaError) -> None:
        """Its call failed: never reduce into the caller's buffer now. Failed
        here unless another thread is finishing it, which then checks
        ``abandoned`` before it reduces."""
        self.abandoned = error
        if self._lock.acquire(False):
            try:
                if not self.finished:
                    self.error = error
                    self._finish()
            finally:
                self._lock.release()

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

    def waiting_for(self) -> list[int]:
        """The ranks this unfinished piece (or an earlier piece of its call)
        still waits for: their part, or (in shares) their reduced share. For
        an error naming them: every part may have arrived."""
        exchange = self.exchange
        words = exchange._words
        for piece in (*self.earlier, self):
            if piece.finished:
                continue
            plan, want = piece.plan, piece.k + 1
            missing = exchange._missing(plan.arrive, plan.sources, want, 0)
            if not missing and isinstance(plan, _SplitPlan):
                missing = [q for q, word, _, _ in plan.shares if words[word] < want]
            if missing:
                return missing
        return []

    def _earlier_finished(self, until: float, wait_turn: bool) -> bool:
        """Finish the call's other pieces (in order) first; their error is
        the call's."""
        for piece in self.earlier:
            if not piece.finished and not piece.complete(until, False, wait_turn):
                return False
            if piece.error is not None:
                raise piece.error
        return True

    def _run(self, until: float) -> bool:
        """Step 2: every row arrived (False at ``until``), reduce them all."""
        if not self._arrived(until):
            return False
        self._reduce()
        return True

    def _arrived(self, until: float) -> bool:
        call, plan = self.call, self.plan
        return self.exchange.wait(plan.arrive, plan.sources, self.k + 1, self.deadline,
                                  call.collective, self.seq,
                                  "their part did not arrive (shared-memory exchange)", until,
                                  self)

    def _reduce(self) -> None:
        self._check_prints()
        self._check_abandoned()
        self.plan.reduce(self.data)

    def _check_abandoned(self) -> None:
        if self.abandoned is not None:
            raise self.abandoned

    def _check_prints(self) -> None:
        """Every member describes the same call (else MismatchError)."""
        exchange, call, plan = self.exchange, self.call, self.plan
        words, mine = exchange._words, call.print
        for i in plan.prints:
            if words[i] != mine:
                control, row_set = exchange.segment.control, self.k % DEPTH
                details = {q: bytes(control[row_set, q, TEXT_OFFSET:]).rstrip(b"\0").decode(
                    errors="replace") for q, i in zip(plan.sources, plan.prints)
                    if words[i] != mine}
                error = MismatchError(call.collective, self.seq, details, call.text)
                pieces = len(call.pieces or ())
                if any(words[exchange.word(row_set, q, PIECES)] != pieces for q in details):
                    # Calls of other piece counts leave the indices out of
                    # step on every later call: the communicator is broken.
                    exchange._on_failure(error)
                raise error

    def _finish(self) -> None:
        """Mark the rows read (after every read above: x86-64 keeps a store
        after earlier loads) and hand the outcome to the handle. A piece
        failed before it was published marks nothing: no peer can get past
        it without its row, and the word would also say this rank read
        pieces of its row set it may still be reading."""
        exchange = self.exchange
        self.finished = True  # before looking at published: _publish looks the other way
        if self.published:
            exchange._words[self.plan.my_done] = self.k + 1
        if self.counted:  # a call's last piece
            if self.error is None:
                exchange.completed += 1
            else:
                exchange.failed += 1
        self.data = None
        handle = self.handle
        if handle is not None:
            # Let go of the handle (its result is the caller's buffer): this
            # piece stays the row set's last call until the next one.
            self.handle, self.on_done = None, None
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
        self.complete(0.0, raise_error=False, wait_turn=False)  # never waits for a waiter
        if not self.finished:
            os.sched_yield()


class SplitPending(Pending):
    """A piece reduced in shares (step 3): reduce this rank's share once every
    row arrived, then gather the others' shares as they are reduced."""

    __slots__ = ("shared", "gathered")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.shared = False  # this rank's share is reduced and published
        self.gathered = 0  # other members' shares copied so far

    def _run(self, until: float) -> bool:
        exchange, plan, data = self.exchange, self.plan, self.data
        words, want = exchange._words, self.k + 1
        if not self.shared:
            if not self._arrived(until):
                return False
            self._check_prints()
            self._check_abandoned()
            share = plan.share
            plan.reduce(data[share])
            np.copyto(plan.row[share], data[share])  # no other member reads it before this
            # After the share's stores (x86-64 keeps their order).
            words[plan.my_reduced] = want
            self.shared = True
        call = self.call
        while self.gathered < len(plan.shares):
            member, word, share, where = plan.shares[self.gathered]
            if words[word] < want and not exchange.wait(
                    (word,), (member,), want, self.deadline, call.collective, self.seq,
                    "its share was not reduced (shared-memory exchange)", until, self):
                return False
            self._check_abandoned()
            np.copyto(data[where], share)
            self.gathered += 1
        return True


def describe(collective: str, members: Sequence[int], count: int, dtype: DType, op: str,
             extra: str) -> str:
    """The description a call is checked against its members' with (``op``
    empty: a broadcast, whose ``extra`` names the root)."""
    op_text = f",op={op}" if op else ""
    return (f"{collective}(count={count},dtype={dtype.name}{op_text}{extra},"
            f"algorithm={ALGORITHM},members={list(members)})")


__all__ = ["ALGORITHM", "EAGER_BYTES", "SPLIT_MIN_BYTES", "default_max_bytes", "SharedCall",
           "SharedExchange", "Pending", "SplitPending", "describe", "split_bounds", "splits"]
