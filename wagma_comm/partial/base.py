"""The machinery every persistent partial collective shares.

A partial collective is created once (a collective call) and stepped once per
training iteration; step ``t`` belongs to round ``t``. Rounds run on the
progress thread, one at a time and in order, each as a small engine Work:

* a *group round* starts here as soon as it is activated -- by this rank's own
  arrival or by a token from another rank's progress thread -- and contributes
  whatever this rank last gave (``_snapshot``), even while its application
  thread is still computing. Nobody waits for a slow application thread;
* a *synchronous round* (every ``sync_every``-th) starts only when this rank's
  application arrives; an all-to-all arrival check comes first, so a rank that
  stopped stepping is named by the timeout;
* ``flush()`` and ``close()`` are synchronous rounds outside the iteration count.

Each round's buffer carries one flag element per member after the data: a
member sets its own flag to 1 when its contribution was current, so after the
sum every member knows which contributions were fresh, at no extra message.

Message identity is explicit: each partial collective gets its own channels
(MPI communicators), data tags are the round number, and tokens carry
(collective id, round, root, sender) in their payload.
"""

from __future__ import annotations

import threading
import time
import warnings
import zlib
from collections import deque
from typing import Any, Callable

import numpy as np

from ..buffers import as_buffer
from ..dtypes import INT64
from ..errors import (
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
    MismatchError,
    RankFailedError,
    WagmaError,
)
from ..kernels import host as host_kernels
from ..runtime import activation
from ..runtime.engine import Stage, Work
from ..runtime.handle import Handle
from ..runtime.liveness import PERIOD_S
from ..schedule import algorithms
from ..schedule.ir import DATA
from .info import RoundInfo, Telemetry
from .memory import HostMemory

_TOKEN_WORDS = 4  # collective id, round, root, sender
# The round of a token that says "closed: no more tokens from me" (close()).
_CLOSED_MARK = -1
# A synchronous round's arrival check times out this fraction of the
# timeout before its data exchange, so its error (naming the ranks that never
# arrived) is the one the round fails with.
_ARRIVAL_LEAD = 0.02
_ARRIVAL_LEAD_MIN_S = 0.005  # and at least this (engine turns, naps of 1 ms)
# A token for a round this many rounds before the last one completed here is
# dropped, not forwarded: that round ran long ago, and any rank the token
# would still have reached is activated by a later round's token (activation
# covers the rounds before it). Keeps the routing state bounded when
# synchronous rounds, which clear it, are rare.
TOKEN_HORIZON = 256


FLUSH, FLUSH_ROUND, CLOSE = 1, 2, 3
"""What a rank called at the end (flush without a synchronous round, flush
with one, close), exchanged with its step count so that ranks that called
different ones are named at once instead of waiting for a round only some
of them run."""
FINAL_CALL_NAMES = {FLUSH: "flush() without a round", FLUSH_ROUND: "flush() with a round",
                    CLOSE: "close()"}


def final_call_differences(table: np.ndarray, rank: int) -> tuple[dict[int, str], str]:
    """``table``: one row (step count, FLUSH/FLUSH_ROUND/CLOSE) per rank, as
    exchanged at a flush or close. The ranks whose row differs from
    ``rank``'s, described, and ``rank``'s own description."""
    def describe(row: np.ndarray) -> str:
        steps, call = (int(v) for v in row)
        return f"{FINAL_CALL_NAMES.get(call, f'call {call}')} after {steps} steps"
    mine = table[rank]
    differ = {r: describe(row) for r, row in enumerate(table) if not np.array_equal(row, mine)}
    return differ, describe(mine)


def broken_error(kind: str, round: int, call: str | None, cause: WagmaError, *,
                 communicator: bool, note: str = "") -> WagmaError:
    """What a partial collective's step, publish, flush or close raises once
    the collective (``communicator=False``) or its communicator (True) is
    broken by ``cause``, naming the collective and the round (``call``: the
    flush or close instead). A rank death stays one: RankFailedError naming
    the dead ranks, as the round that met it raised (rank-death cases in
    tests/unit/test_rank_death.py); anything else is CommunicatorClosedError.
    ``note``: what the call could not deliver. Both paths raise these
    (this module and shared_wagma.py), with ``cause`` as their cause."""
    how = "communicator is broken" if communicator else "is broken"
    if isinstance(cause, RankFailedError):
        error: WagmaError = RankFailedError(
            kind, round, cause.ranks,
            f"{call + ': ' if call else ''}{how}: {cause.where}: {cause.detail}{note}")
    else:
        what = call or f"round {round}"
        error = CommunicatorClosedError(
            f"{kind} ({what}){': ' if communicator else ' '}{how}: {cause}{note}")
    error.__cause__ = cause
    return error


def unusable(kind: str, round: int, call: str | None, closed: bool,
             error: WagmaError | None, comm: Any, note: str = "") -> WagmaError | None:
    """Whether a partial collective may take a step, publish or flush
    (``call``, else round ``round``): raises CommunicatorClosedError when it
    is ``closed`` or its communicator is, its :func:`broken_error` when it is
    broken (``error``); returns the error that breaks it now when its
    communicator is broken (a timeout, a dead rank or a failed transport
    in any of the communicator's collectives: the caller breaks the
    collective with it, and raises it), else None. A round needs nothing
    from the communicator, but before session 48 rounds went on averaging
    on it (with peers that may be failing) as if nothing had happened, on
    the message path sync rounds and flushes too."""
    if closed:
        raise CommunicatorClosedError(f"{kind} is closed")
    if error is not None:
        raise broken_error(kind, round, call, error, communicator=False, note=note)
    if comm.closed:
        raise CommunicatorClosedError(f"{kind} ({call or f'round {round}'}): "
                                      "its communicator is closed")
    broken = comm._engine.broken
    return None if broken is None else broken_error(kind, round, call, broken,
                                                    communicator=True, note=note)


def check_sync_every(sync_every: Any) -> int:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int):
        raise InvalidArgumentError("sync_every", f"expected an int, got {sync_every!r}")
    if sync_every < 1:
        raise InvalidArgumentError("sync_every", f"must be >= 1, got {sync_every}")
    return sync_every


def check_first_round(first_round: Any) -> int:
    """``first_round``: the round (training iteration) this object's round 0
    stands for. Round r is round first_round + r in every rule that depends
    on the round: its group, its activator, whether it is synchronous; so a
    run resumed at iteration ``first_round`` does what the uninterrupted run
    would have done."""
    if isinstance(first_round, bool) or not isinstance(first_round, int):
        raise InvalidArgumentError("first_round", f"expected an int, got {first_round!r}")
    if first_round < 0:
        raise InvalidArgumentError("first_round", f"must be >= 0, got {first_round}")
    return first_round


_DESCRIPTION_BYTES = 256  # per rank in agree(): a CRC of the whole text, then its start


def agree(comm: Any, kind: str, count: int, dtype: Any, timeout: float | None,
          **options: Any) -> None:
    """Collective, at creation: every rank created ``kind`` with the same
    count, dtype and ``options`` (sync_every, first_round, ...), else
    MismatchError on every rank, naming the ranks that differ and what they
    asked for. Why: ranks that disagree on the rounds' groups or sizes would
    otherwise meet only in a timeout, or in rounds over different groups."""
    settings = "".join(f", {name}={value!r}" for name, value in options.items())
    description = f"{kind}(count={count}, dtype={dtype.name}{settings})"
    text = description.encode()
    rows = np.zeros((comm.size, _DESCRIPTION_BYTES), dtype=np.uint8)
    mine = rows[comm.rank]
    mine[:4] = np.frombuffer(zlib.crc32(text).to_bytes(4, "little"), dtype=np.uint8)
    start = text[:_DESCRIPTION_BYTES - 4]
    mine[4:4 + len(start)] = np.frombuffer(start, dtype=np.uint8)
    comm.allreduce(rows, "sum", timeout=timeout)  # one non-zero row each: a gather
    differ = {r: bytes(row[4:]).rstrip(b"\0").decode(errors="replace")
              for r, row in enumerate(rows) if not np.array_equal(row, mine)}
    if differ:
        raise MismatchError(kind, 0, differ, description)


def check_step_buffer(kind: str, count: int, dtype: Any, buf: Any) -> tuple[np.ndarray, Any]:
    """``buf`` as a host array (and its owner) if it has the element count
    and dtype the collective was created with; InvalidArgumentError if not."""
    buffer = as_buffer(buf, "buf")
    check_step_shape(kind, count, dtype, buffer)
    return buffer.host_array(), buffer.owner


def check_step_shape(kind: str, count: int, dtype: Any, buffer: Any) -> None:
    """InvalidArgumentError unless ``buffer`` (buffers.Buffer) has the element
    count and dtype the collective was created with."""
    if buffer.count != count or buffer.dtype is not dtype:
        raise InvalidArgumentError(
            "buf", f"{kind} was created for {count} x {dtype.name}, "
            f"got {buffer.count} x {buffer.dtype.name}")


class _Call:
    """One application call (step, flush or close) waiting for its round."""

    __slots__ = ("iteration", "data", "owner", "handle", "started", "deadline",
                 "staleness", "kind")

    def __init__(self, kind: str, iteration: int, data: np.ndarray | None, owner: Any,
                 handle: Handle, deadline: float, staleness: int) -> None:
        self.kind, self.iteration, self.data, self.owner = kind, iteration, data, owner
        self.handle, self.deadline, self.staleness = handle, deadline, staleness
        self.started = time.monotonic()


class Result:
    """A completed round: its summed buffer (data then member flags) and who
    was in it. ``readers`` pins the buffer while an application thread uses it."""

    __slots__ = ("array", "round", "step", "group", "fresh", "activator",
                 "synchronized", "readers", "retired")

    def __init__(self, array: np.ndarray, round: int, step: int | None,
                 group: tuple[int, ...], fresh: tuple[int, ...], activator: int | None,
                 synchronized: bool) -> None:
        self.array, self.round, self.step, self.group = array, round, step, group
        self.fresh, self.activator, self.synchronized = fresh, activator, synchronized
        self.readers, self.retired = 0, False


class PartialCollective:
    """Base of the wait-avoiding group allreduce and the solo/majority
    allreduces. Subclasses define what a rank contributes and what a caller
    gets back (the ``_`` hooks at the end)."""

    kind = "partial_collective"

    def __init__(self, comm: Any, buf: Any, sync_every: int, timeout: float | None,
                 algorithm: str | None, first_round: int = 0) -> None:
        check_sync_every(sync_every)
        self.first_round = check_first_round(first_round)
        buffer = self._intake(buf)
        self._comm = comm
        self._engine = comm._engine
        self._transport = comm._transport
        self.rank, self.size = comm.rank, comm.size
        # One tuple for every round: the schedule caches answer the tuple
        # they compiled from at once, and check the members of a new one.
        self._everyone = tuple(range(self.size))
        self.sync_every = sync_every
        self.timeout = comm._call_timeout(timeout)
        self.count, self.dtype = buffer.count, buffer.dtype
        self._template = buffer  # shape/dtype every step must match; kept alive
        if algorithm is not None and (algorithm == "native" or algorithm
                                      not in algorithms.ALLREDUCE_ALGORITHMS):
            usable = [a for a in algorithms.ALLREDUCE_ALGORITHMS if a != "native"]
            raise InvalidArgumentError(
                "algorithm", f"expected one of {usable} (rounds must give bitwise-"
                f"identical results on every member), got {algorithm!r}")
        self._algorithm = algorithm
        self._one = self._one_bits()
        self._mem = self._memory()
        self._lock = threading.Lock()
        self._inbox: deque[tuple[str, Any]] = deque()
        self._free: list[np.ndarray] = []
        self.telemetry = Telemetry(self.size)
        # shared (under _lock)
        self._app_round = 0
        self._started = -1
        self._completed = -1
        # The last round started here by this rank's ready publish (start_ready)
        # that no arrival has activated yet: arriving at it must still send
        # the activation, or a late member would never be told.
        self._ready_started = -1
        self._ready_promised = -1  # app thread: the round a ready publish promised a step to
        self._pending: dict[int, _Call] = {}
        # When the last round completed here (progress thread): a step queued
        # behind rounds that were running waits for its activation from then.
        self._idle_since = time.monotonic()
        self._liveness_due = 0.0  # the next look at peers' liveness while steps wait
        self._error: WagmaError | None = None
        self._closed = False
        # progress thread only
        self._activated = -1
        self._running = False
        self._sync_arrived: set[int] = set()
        self._round_work: Work | None = None  # the round in flight
        self._arrival_checks = 0  # sync rounds' arrival checks still in flight
        self._final: _Call | None = None  # a flush or close waiting for its turn
        self._final_count = 0
        # What the engine's errors of the running flush or close name: the
        # caller's step count and the call, not its Work's number (a count
        # of flushes and closes), which the broken communicator repeated.
        self._final_naming: tuple[int, str] = (0, "")
        self._thresholds: dict[int, int] = {}
        self._roots: dict[int, int] = {}
        self._last_sync = -1
        self._token_in = np.zeros(_TOKEN_WORDS, dtype=np.int64)
        self._closing: _Call | None = None  # close() waiting for the peers' last tokens
        self._marked: set[int] = set()  # peers whose closed mark came
        self._sending: list[tuple[Any, np.ndarray]] = []
        self._id = comm._register_partial()
        prefix = f"p{self._id}."
        self._ch_data, self._ch_ctl = prefix + "data", prefix + "ctl"
        self._ch_fdata, self._ch_fctl = prefix + "fdata", prefix + "fctl"
        self._ch_act = prefix + "act"
        self._channels = (self._ch_data, self._ch_ctl, self._ch_fdata, self._ch_fctl,
                          self._ch_act)

    # -- set-up (collective) -------------------------------------------------------
    def _open(self) -> None:
        """Create the channels on every rank, then start listening for tokens."""
        self._comm._open_channels(self.kind, self._channels, self.timeout)
        self._engine.add_service(self)
        self._inbox.append(("listen", None))
        self._engine.wake()

    # -- application side ---------------------------------------------------------
    def step(self, buf: Any, *, async_op: bool = False) -> Any:
        """Contribute ``buf`` to this iteration's round and replace it in place by
        the round's result. Returns a RoundInfo (or a Handle whose ``wait()``
        returns it)."""
        data, owner = self._check_buf(buf)
        with self._lock:
            # Under the lock: a break after the check would fail no call
            # registered after it (fail() takes the lock).
            self._check_usable()
            t = self._app_round
            self._app_round += 1
            self._contribute(data, t)
            self._mem.settle()  # the caller may reuse ``buf`` once we return
            staleness = max(0, self._started - t + 1)
            call = self._new_call("step", t, data, owner, staleness)
            late = None
            if t > self._completed:
                self._pending[t] = call
            else:
                late = self._late_result(t)
            arrive = t > self._started or t == self._ready_started
        if late is not None:  # the round ran without us: answer at once
            try:
                self._deliver(call, late)
            finally:
                with self._lock:
                    self._release(late)
        elif arrive:
            self._inbox.append(("arrive", t))
            self._engine.wake()
        return call.handle if async_op else call.handle.wait()

    def flush(self, buf: Any = None) -> RoundInfo | None:
        """Collective: finish every round up to this rank's last step, then run
        one synchronous round over all ranks (see the subclass for what it
        carries). Every rank must have taken the same number of steps."""
        if buf is not None:
            data, owner = self._check_buf(buf)
        elif self._flush_needs_data():  # the result must land somewhere
            data, owner = self._template_data()
        else:
            data, owner = None, None
        with self._lock:
            self._check_usable("flush()")
        self._check_promise("flush")
        call = self._final_call("flush", data, owner)
        return call.handle.wait()

    def close(self) -> None:
        """Collective: wait for every rank to finish stepping, then release the
        channels. Idempotent; a broken collective is released locally."""
        if not self._closed and self._error is None:
            self._check_promise("close")
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._error is None and self._engine.alive():
                call = self._final_call("close", None, None)
                call.handle.wait()
        finally:
            if not any(what == "break" for what, _ in list(self._inbox)):
                self._engine.remove_service(self)  # else its break does (progress())
            leftover = self._leftover()
            if leftover:
                warnings.warn(f"{self.kind} closed with {leftover}; call flush() on "
                              "every rank before close() so it lands", RuntimeWarning,
                              stacklevel=2)

    def statistics(self) -> dict[str, Any]:
        """Participation, fresh vs stale contributions, staleness histogram,
        waiting time (see docs/partial.md)."""
        with self._lock:
            stats = self.telemetry.as_dict()
            stats.update(kind=self.kind, rank=self.rank, size=self.size,
                         sync_every=self.sync_every, first_round=self.first_round,
                         iteration=self._app_round,
                         started_round=self._started, completed_round=self._completed,
                         broken=None if self._error is None else str(self._error),
                         path="messages")
        stats.update(self._extra_statistics())
        return stats

    def __enter__(self) -> "PartialCollective":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            with self._lock:
                self._closed = True
            # Stop listening for tokens and fail the calls still outstanding,
            # on the progress thread (the listener's receive can be
            # cancelled only there).
            self._inbox.append(("break", CommunicatorClosedError(
                "closed when an exception left its with block")))
            self._engine.wake()

    # -- application-side helpers ----------------------------------------------------
    def _check_buf(self, buf: Any) -> tuple[np.ndarray, Any]:
        return check_step_buffer(self.kind, self.count, self.dtype, buf)

    def _check_promise(self, what: str) -> None:
        """A ready publish started a round that only this rank's step can be
        sure to finish (its peers may never arrive); a flush or close before
        that step would wait for it forever. Refused here, before anything
        is sent."""
        if self._ready_promised == self._app_round:
            raise InvalidArgumentError(
                "ready", f"publish(ready=True) for round {self._app_round} promised a "
                f"step(); call step() before {what}()")

    def _check_usable(self, call: str | None = None, closing: bool = False) -> None:
        """(under _lock) Raise, naming the round (or ``call``), unless this
        collective and its communicator are usable (:func:`unusable`). A
        broken communicator breaks the collective here, at once: no round
        runs and no token is sent. A flush that cannot run says what it
        could not deliver (solo/majority: the inputs not yet in any round).
        ``closing``: close(), which has marked the collective closed."""
        leftover = self._leftover() if call == "flush()" else ""
        error = unusable(self.kind, self._app_round, call, self._closed and not closing,
                         self._error, self._comm,
                         note=f"; not delivered: {leftover}" if leftover else "")
        if error is None:
            return
        self._error = error
        # Stop listening for tokens and fail the calls still outstanding,
        # on the progress thread (the listener's receive can be cancelled
        # only there).
        self._inbox.append(("break", error))
        self._engine.wake()
        raise error

    def _new_call(self, kind: str, t: int, data: np.ndarray | None, owner: Any,
                  staleness: int) -> _Call:
        deadline = time.monotonic() + self.timeout
        # test() turns the engine (and so this collective's service), as the
        # communicator's handles do: a polling loop otherwise starves the
        # progress thread of the GIL.
        handle = Handle(self.kind, t, deadline, self._engine.alive, nudge=self._engine.nudge)
        return _Call(kind, t, data, owner, handle, deadline, staleness)

    def _final_call(self, kind: str, data: np.ndarray | None, owner: Any) -> _Call:
        """Queue a flush or close for the progress thread. Checked and queued
        under the lock, as fail() takes the calls still queued under it: a
        break either comes first (raised here) or fails the call."""
        with self._lock:
            self._check_usable(f"{kind}()", closing=kind == "close")
            call = self._new_call(kind, self._app_round, data, owner, 0)
            self._inbox.append(("final", call))
        self._engine.wake()
        return call

    def _info(self, call: _Call, res: Result) -> RoundInfo:
        return RoundInfo(round=res.round, step=res.step, group=res.group,
                         activator=res.activator, fresh=res.fresh,
                         staleness=call.staleness, synchronized=res.synchronized,
                         iteration=call.iteration)

    def _deliver(self, call: _Call, res: Result) -> None:
        """Write the round's result into the caller's buffer, complete its handle."""
        try:
            if call.data is not None:
                self._finalize(call, res)
                self._mem.settle()  # the result is in memory before the handle completes
        except WagmaError as exc:
            call.handle._complete(None, exc)
            return
        if res.round == call.iteration and self.rank in res.fresh:
            call.staleness = 0  # its current contribution made the round: on time
        if call.kind == "step":  # a flush counts in ``flushes``, as on the board
            waited = time.monotonic() - call.started
            with self._lock:
                self.telemetry.record_call(call.staleness, waited, res.synchronized)
        call.handle._complete(self._info(call, res))

    # -- progress thread -------------------------------------------------------------
    def progress(self) -> bool:
        did = False
        while self._inbox:
            what, arg = self._inbox.popleft()
            did = True
            if what == "listen":
                self._listen()
            elif what == "arrive":
                self._arrive(arg)
            elif what == "ready":
                self._start_ready(arg)
            elif what == "final":
                self._final = arg
            elif what == "break":  # an application call found it broken, or __exit__
                self._break(arg)  # by an exception
                return True
        if self._closing is not None:
            return did | self._check_drain_deadline()
        if self._error is None:
            did |= self._start_due()
            did |= self._check_pending_deadlines()
        return did

    def busy(self) -> bool:
        return False  # a round in flight is an engine Work; between rounds it listens

    def fail(self, error: WagmaError) -> None:
        """The engine stopped this service (it broke, or the communicator is
        closing): fail the calls still waiting. Except, at a close, the call
        of the round in flight: the engine lets that round finish (or fail at
        its deadline), and its result went to the peers, so its step gets it
        too (``_round_done``) rather than CommunicatorClosedError."""
        self._engine.cancel_posted(self._on_token)
        work = self._round_work  # an engine Work on host memory (not device.py's)
        in_flight = (work.seq if isinstance(work, Work) and not work.handle.done
                     and isinstance(error, CommunicatorClosedError) else None)
        with self._lock:
            self._error = self._error or error
            keep = {t: c for t, c in self._pending.items() if t == in_flight}
            calls = [c for t, c in self._pending.items() if t != in_flight]
            self._pending = keep
            # A flush or close still queued: progress() will never take it.
            calls += [arg for what, arg in list(self._inbox) if what == "final"]
        if self._final is not None:
            calls.append(self._final)
            self._final = None
        if self._closing is not None:  # a close() waiting for the peers' last tokens
            calls.append(self._closing)
            self._closing = None
        for call in calls:
            if not call.handle.done:
                call.handle._complete(None, self._named(error, call))

    def _named(self, error: WagmaError, call: _Call) -> WagmaError:
        """The engine's bare CommunicatorClosedError ("communicator closed"),
        said of this collective and the call's round; other errors name
        what failed already."""
        if type(error) is not CommunicatorClosedError:
            return error
        what = f"{call.kind}()" if call.kind != "step" else f"round {call.iteration}"
        return CommunicatorClosedError(f"{self.kind} ({what}): {error}")

    def _break(self, error: WagmaError) -> None:
        """A round failed: this collective cannot go on (messages of the failed
        round may still be in flight)."""
        self._engine.remove_service(self)
        self.fail(error)

    def _synchronous(self, r: int) -> bool:
        """Whether this object's round ``r`` is a blocking round over all ranks."""
        return activation.is_sync_round(self.first_round + r, self.sync_every)

    def _arrive(self, t: int) -> None:
        if self._synchronous(t):
            self._sync_arrived.add(t)
        elif t <= self._completed:
            return  # it ran here, so every member took part: nobody to tell
        elif self._activates(t):
            self.telemetry.activated_here += not self._is_activated(t)
            work = self._round_work
            if work is not None and work.seq == t and work.patient:
                # A ready start: somebody waits for it now, and its timeout
                # counts from here, as for a round this arrival activates.
                work.patient = False
                work.deadline = time.monotonic() + self.timeout
            self._activate(t, None, self.rank)

    def _start_ready(self, t: int) -> None:
        """This rank published its final contribution to round ``t``
        (``publish(ready=True)``): start the round here without telling
        anyone. It completes once every member has started it, by its own
        ready publish or by an activation, so when all members publish in
        time the round runs during their compute and nobody waits; a member
        that arrives first still activates it (``step`` sends ``arrive``),
        so a late member is never waited for."""
        if (t <= self._activated or t <= self._last_sync
                or self._synchronous(t)):
            return  # activated already, or not a group round
        if any(not self._synchronous(q)
               for q in range(self._activated + 1, t)):
            self._activate(t, None, self.rank)  # skipped rounds need tokens
            return
        self.telemetry.ready_starts += 1
        self._activated = t
        self._roots[t] = self.rank
        with self._lock:
            self._ready_started = t

    def _start_due(self) -> bool:
        if self._running:
            return False
        r = self._started + 1
        final = self._final
        if final is not None and r >= final.iteration:
            if self._arrival_checks:
                return False  # close() frees their channel: let them finish
            self._final = None
            self._start_final(final)
            return True
        if self._synchronous(r):
            if r not in self._sync_arrived:
                return False
            self._sync_arrived.discard(r)
            self._start_round(r, self._everyone, None, None, synchronized=True)
            return True
        if self._is_activated(r):
            step = activation.group_step(self.first_round + r, self.sync_every)
            root = self._round_activator(r, self._roots.pop(r, self.rank))
            self._start_round(r, self._members(r), step, root, synchronized=False)
            return True
        return False

    def _check_pending_deadlines(self) -> bool:
        """A step whose round is not activated within the timeout fails,
        naming who it waits for. Only while no round runs here: a step queued
        behind a running round (async steps, a slow but timely peer at a sync
        round) waits for that round, whose own deadline names its missing
        ranks; its activation wait counts from when the rounds before it were
        done (``_idle_since``), not from its call."""
        if self._running:
            return False
        now = time.monotonic()
        since = self._idle_since + self.timeout
        with self._lock:
            unstarted = [c for t, c in self._pending.items() if t > self._started]
            late = [c for c in unstarted if now > max(c.deadline, since)]
        if unstarted and not late and now >= self._liveness_due:
            return self._check_activation_liveness(unstarted[0], now)
        for call in late:
            waiting = self._waiting_for(call.iteration)
            self._break(CollectiveTimeoutError(
                self.kind, call.iteration, waiting,
                f"round {call.iteration} was not activated within {self.timeout:g} s"))
            return True
        return False

    def _check_activation_liveness(self, call: _Call, now: float) -> bool:
        """A step waiting for its round's activation is no engine Work, so no
        liveness check looked at it: a majority step whose activator, or a
        peer whose step would activate it, had died waited out the whole
        timeout and then named the activator (rank 1 where rank 2 was
        killed). Every ``liveness.PERIOD_S`` while steps wait, a dead rank
        fails them (RankFailedError naming it)."""
        self._liveness_due = now + PERIOD_S
        dead = self._engine.watch.dead_ranks(self._everyone)
        if not dead:
            return False
        self._break(RankFailedError(
            self.kind, call.iteration, dead,
            f"gone while round {call.iteration} waited for its activation"))
        return True

    # -- rounds ------------------------------------------------------------------------
    def _take(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._new_buffer()

    def _release(self, res: Result) -> None:
        """(under _lock) Drop a reader; recycle a retired buffer nobody reads."""
        res.readers = max(0, res.readers - 1)
        if res.retired and res.readers == 0:
            self._free.append(res.array)

    def _retire(self, res: Result | None) -> None:
        """(under _lock) A result no one will ask for any more."""
        if res is not None:
            res.retired = True
            if res.readers == 0:
                self._free.append(res.array)

    def _start_round(self, r: int, members: tuple[int, ...], step: int | None,
                     root: int | None, synchronized: bool) -> None:
        buf = self._take()
        with self._lock:
            fresh = self._snapshot(buf[:self.count], r)
            self._started = r
            # Its step, and every call queued behind it, now waits for this
            # round, which fails no later than its own deadline: a queued
            # call's handle dated from the round before, which may have
            # completed up to a timeout before this one was activated
            # (majority), and gave up 5 s past that (a false "not finished
            # ... after its deadline") while this round legitimately ran.
            self._extend_deadlines(r, time.monotonic() + self.timeout)
        self._count_contribution(fresh)
        self._set_flags(buf, members, fresh)
        if synchronized:
            self._check_arrivals(r)
        with self._lock:
            patient = r == self._ready_started and r not in self._pending
        self._round_work = self._exchange(
            r, buf, members, self._ch_data, "round data exchange", [],
            lambda res, err: self._round_done(r, buf, members, step, root, synchronized, err),
            "round", patient)

    def _extend_deadlines(self, first: int, until: float) -> None:
        """(under _lock) The handles of the steps from round ``first`` on and
        of a queued flush or close wait at least ``until``: the engine may
        fail them that late, and a handle's wait gives up on its own shortly
        past its deadline (runtime/handle.py, ``_stalled``)."""
        queued = [c for t, c in self._pending.items() if t >= first]
        if self._final is not None:
            queued.append(self._final)
        for call in queued:
            call.handle._deadline = max(call.handle._deadline, until)

    def _check_arrivals(self, r: int) -> None:
        """A synchronous round's arrival check, beside its data exchange rather
        than before it (it used to be the round's first stage, and that cost
        a full exchange of latency: docs/partial.md). It exists to name a
        rank that stopped stepping, so it times out a little before the data
        (``_ARRIVAL_LEAD``, at least ``_ARRIVAL_LEAD_MIN_S``) and its error is the one the round fails with;
        when the data completes, every rank has arrived and it completes too."""
        stage = self._arrival_stage(self._ch_ctl, r, r, None)
        lead = min(max(_ARRIVAL_LEAD * self.timeout, _ARRIVAL_LEAD_MIN_S), 0.5 * self.timeout)
        deadline = time.monotonic() + self.timeout - lead

        def done(res: Any, err: BaseException | None) -> None:
            self._arrival_checks -= 1
            if err is not None and self._error is None:
                self._break(err if isinstance(err, WagmaError) else WagmaError(str(err)))
        self._arrival_checks += 1
        # ``timeout`` as configured: it is what the error message reports.
        self._engine.start(self._new_work(r, [stage], deadline, "arrival", done))

    def _start_final(self, call: _Call) -> None:
        """A flush or close: synchronous, outside the iteration count."""
        k = self._final_count
        self._final_count += 1
        self._final_naming = (call.iteration, f"{call.kind}()")
        everyone = self._everyone
        if call.kind == "close" or (call.data is None and not self._flush_needs_data()):
            what = CLOSE if call.kind == "close" else FLUSH
            stages = [self._arrival_stage(self._ch_fctl, k, call.iteration, what)]
            self._launch(k, stages, lambda res, err: self._final_done(call, None, err),
                         space="final")
            return
        buf = self._take()
        with self._lock:
            self._flush_snapshot(buf[:self.count], call)
        self._set_flags(buf, everyone, True)
        arrival = self._arrival_stage(self._ch_fctl, k, call.iteration, FLUSH_ROUND)

        def done(res: Any, err: BaseException | None) -> None:
            result = None if err else Result(buf, call.iteration, None, everyone, everyone,
                                             None, True)
            self._final_done(call, result, err)
        self._exchange(k, buf, everyone, self._ch_fdata, "flush data exchange", [arrival],
                       done, "final", False)

    def _launch(self, seq: int, stages: list[Stage],
                on_complete: Callable[[Any, BaseException | None], None],
                space: str = "round", patient: bool = False) -> Work:
        """Start the one round (or flush/close) this collective runs at a time."""
        work = self._new_work(seq, stages, time.monotonic() + self.timeout, space,
                              on_complete, patient)
        self._running = True
        self._engine.start(work)
        return work

    def _new_work(self, seq: int, stages: list[Stage], deadline: float, space: str,
                  on_complete: Callable[[Any, BaseException | None], None],
                  patient: bool = False) -> Work:
        """An engine Work of this collective (nobody waits on its handle: the
        outcome arrives through ``on_complete``)."""
        round, call = self._final_naming if space == "final" else (None, "")
        handle = Handle(self.kind, seq if round is None else round, deadline,
                        self._engine.alive)
        # rings: a member's progress thread may sleep while its application
        # computes; our round's messages wake it (runtime/engine.py).
        return Work(seq, self.kind, handle, stages, deadline, self.timeout,
                    space=(self, space), on_complete=on_complete, patient=patient,
                    rings=True, round=round, call=call)

    def _exchange(self, seq: int, buf: np.ndarray, members: tuple[int, ...], channel: str,
                  label: str, before: list[Stage],
                  on_complete: Callable[[Any, BaseException | None], None], space: str,
                  patient: bool) -> Any:
        """Run ``before`` (host stages), then the sum of ``buf`` (data and
        member flags) over ``members``; the one round in flight. Host memory:
        one engine Work (the GPU path overrides this: partial/device.py)."""
        return self._launch(seq, [*before, self._data_stage(channel, buf, members, label)],
                            on_complete, space=space, patient=patient)

    def _data_stage(self, channel: str, buf: np.ndarray, members: tuple[int, ...],
                    label: str) -> Stage:
        """The round's allreduce (sum) of data plus one flag per member. Never
        native: the schedules are proven bitwise-identical on every member, which
        the synchronous rounds promise."""
        n = self.count + len(members)
        name = self._algorithm or algorithms.choose_allreduce(
            n * self.dtype.itemsize, len(members))
        sched = algorithms.compile_allreduce(self.rank, members, n, "sum", name)
        return Stage(sched, channel, {DATA: buf[:n]}, self.dtype, label=label)

    def _arrival_stage(self, channel: str, seq: int, value: int, final: int | None) -> Stage:
        """All-to-all of two int64 per rank before a synchronous round (the
        round or step count, and for a flush or close which one: FLUSH,
        FLUSH_ROUND, CLOSE): who is missing is then exactly who this rank is
        still waiting for, and at a flush or close a rank that counted or
        called differently is named."""
        everyone = self._everyone
        sched = algorithms.compile_exchange(self.rank, everyone, 2)
        mine = np.array([value, final or 0], dtype=np.int64)
        peers = np.zeros(2 * self.size, dtype=np.int64)

        def compare() -> None:
            if final is None:
                return
            table = peers.reshape(self.size, 2)
            table[self.rank] = mine
            differ, own = final_call_differences(table, self.rank)
            if differ:
                raise MismatchError(self.kind, value, differ, own)
        return Stage(sched, channel, {DATA: mine, algorithms.EXCHANGE_SCRATCH: peers}, INT64,
                     on_done=compare,
                     label="arrival check (ranks that did not call step/flush/close)")

    def _round_done(self, r: int, buf: np.ndarray, members: tuple[int, ...],
                    step: int | None, root: int | None, synchronized: bool,
                    err: BaseException | None) -> None:
        self._running = False
        self._round_work = None
        if err is not None:
            self._break(err if isinstance(err, WagmaError) else WagmaError(str(err)))
            return
        n = len(members)
        flags = self._flags_of(buf, n)
        fresh = tuple(m for k, m in enumerate(members) if flags[k] != 0)
        res = Result(buf, r, step, members, fresh, root, synchronized)
        if synchronized:
            self._last_sync = r
            self._thresholds = {q: v for q, v in self._thresholds.items() if q > r}
        else:
            self._forget_routes(r)
        now = time.monotonic()
        self._idle_since = now
        with self._lock:
            self.telemetry.record_round(members, fresh, synchronized)
            self._completed = r
            call = self._pending.pop(r, None)
            # Calls queued behind this round wait for the next one from now
            # (see _check_pending_deadlines), not from when they were made.
            self._extend_deadlines(r + 1, now + self.timeout)
            self._store(res, wanted=call is not None)
            if call is not None:
                res.readers += 1
        if call is not None:
            try:
                self._deliver(call, res)
            finally:
                with self._lock:
                    self._release(res)

    def _final_done(self, call: _Call, res: Result | None, err: BaseException | None) -> None:
        self._running = False
        if err is not None:
            error = err if isinstance(err, WagmaError) else WagmaError(str(err))
            named = f"{call.kind}(): "
            if (isinstance(error, (CollectiveTimeoutError, RankFailedError))
                    and not (error.round == call.iteration and error.detail.startswith(named))):
                # Said of the call and the caller's step count, as a mismatch
                # of final calls and the board say it. The engine's timeouts
                # already are (Work.round, Work.call); before, they named its
                # Work's seq, this collective's count of flushes and closes:
                # "(round 0)", a round done long before.
                error = type(error)(self.kind, call.iteration, error.ranks,
                                    named + error.detail)
            if call.kind == "close":
                self._teardown()
            else:
                self._break(error)
            # The engine's bare "communicator closed while in flight"
            # (close(cancel=True)) said of this collective and the call.
            call.handle._complete(None, self._named(error, call))
            return
        if call.kind == "close":
            self._drain_tokens(call)
            return
        with self._lock:
            self.telemetry.flushes += 1
        if res is None:
            call.handle._complete(None)
            return
        with self._lock:
            self.telemetry.record_round(res.group, res.fresh, True)
        try:
            self._deliver(call, res)
        finally:
            with self._lock:
                res.retired = True
                self._release(res)

    def _drain_tokens(self, call: _Call) -> None:
        """close(), once every rank has stopped stepping: tokens travel on
        their own channel, unordered against close()'s exchange, so a peer's
        last tokens may still be in flight. Freeing the channel under them
        would leave them unmatched, to be received by whichever communicator
        MPI gives the freed context next (a truncated message, or data
        overwritten by a token). So every rank sends each peer a closed mark,
        after which it sends no tokens; tokens between two ranks arrive in
        order, so once every peer's mark has come nothing is in flight, and
        the channels are freed."""
        self._closing = call
        call.deadline = time.monotonic() + self.timeout
        call.handle._deadline = call.deadline
        if self.size > 1:
            mark = np.array([self._id, _CLOSED_MARK, -1, self.rank], dtype=np.int64)
            for peer in range(self.size):
                if peer != self.rank:
                    self._send_token(mark, peer)
        self._finish_drain()

    def _finish_drain(self) -> None:
        call = self._closing
        if call is not None and len(self._marked) >= self.size - 1:
            self._closing = None
            self._teardown(clean=True)
            call.handle._complete(None)

    def _check_drain_deadline(self) -> bool:
        call = self._closing
        if call is None or time.monotonic() <= call.deadline:
            return False
        self._closing = None
        self._teardown()
        missing = sorted(set(range(self.size)) - self._marked - {self.rank})
        call.handle._complete(None, CollectiveTimeoutError(
            self.kind, call.iteration, missing,
            f"close(): ranks {missing} never sent their last activation token "
            f"within {self.timeout:g} s"))
        return True

    def _teardown(self, clean: bool = False) -> None:
        """Progress thread: stop listening and release the channels. Only a
        clean close (every peer's last token received) frees them; otherwise
        messages may still arrive, and the transport keeps the channels
        allocated so that no later communicator can receive them."""
        self._engine.remove_service(self)
        self._engine.cancel_posted(self._on_token)
        self._transport.close_channels(self._channels, free=clean)

    # -- activation tokens ------------------------------------------------------------
    def _members(self, r: int) -> tuple[int, ...]:
        """Who takes part in (non-sync) round ``r`` with this rank."""
        return self._everyone

    def _token_scope(self, r: int) -> tuple[int, ...]:
        """Who the activation of round ``r`` is broadcast to."""
        return self._everyone

    def _listen(self) -> None:
        if self.size == 1:
            return
        request = self._transport.irecv_any(self._token_in, self._ch_act)
        self._engine.post(request, self._on_token)

    def _on_token(self) -> None:
        ident, r, root, sender = (int(v) for v in self._token_in)
        self._listen()
        if ident != self._id:
            return
        if r == _CLOSED_MARK:
            self._marked.add(sender)
            self._finish_drain()
            return
        self.telemetry.tokens_received += 1
        if self._closing is not None:
            return  # a peer's last tokens: every round has run
        if not self._is_activated(r):
            self.telemetry.activated_elsewhere += 1
        self._activate(r, sender, root)

    def _is_activated(self, r: int) -> bool:
        """Whether group round ``r`` may start here once the rounds before it ran."""
        return r <= self._activated

    def _activate(self, r: int, sender: int | None, root: int) -> None:
        """Record that round ``r`` is activated and pass the token on."""
        if (r <= self._last_sync or r <= self._completed - TOKEN_HORIZON
                or self._synchronous(r)):
            return
        self._mark_activated(r)
        if r > self._started:  # popped when the round starts
            root = self._roots.setdefault(r, root)
        self._route(r, sender, root)

    def _mark_activated(self, r: int) -> None:
        """Round ``r`` is activated, and the rounds before it too: rounds run in
        order here, and a member of an earlier round that never arrived would
        otherwise never run it (its group's tokens come from arrivals only).
        This rank activates those rounds itself, as their root."""
        if r > self._activated:
            for q in range(self._activated + 1, r):
                if not self._synchronous(q):
                    self._roots[q] = self.rank
                    self.telemetry.activated_here += 1  # as its activator (RoundInfo)
                    self._route(q, None, self.rank)
            self._activated = r

    def _forget_routes(self, r: int) -> None:
        """Round ``r`` completed: drop the routing state of rounds whose
        tokens :meth:`_activate` now ignores (amortised; sync rounds clear it
        all, but ``sync_every`` may be huge)."""
        if len(self._thresholds) > 2 * TOKEN_HORIZON:
            horizon = r - TOKEN_HORIZON
            self._thresholds = {q: v for q, v in self._thresholds.items() if q > horizon}

    def _route(self, r: int, sender: int | None, root: int) -> None:
        scope = self._token_scope(r)
        n = len(scope)
        if n <= 1:
            return
        me = scope.index(self.rank)
        if self._flat_tokens(n):  # one hop to everyone: a sender told them all
            if r in self._thresholds:
                return
            self._thresholds[r] = -1
            if sender is not None:
                return
            targets = activation.flat_targets(me, n)
        else:
            came = -1 if sender is None else activation.incoming_dimension(
                me, scope.index(sender), n)
            threshold = self._thresholds.get(r, activation.no_tokens_sent(n))
            targets, self._thresholds[r] = activation.forward(me, n, came, threshold)
        for k in targets:
            self._send_token(np.array([self._id, r, root, self.rank], dtype=np.int64),
                             scope[k])
            self.telemetry.tokens_sent += 1

    def _send_token(self, token: np.ndarray, peer: int) -> None:
        request = self._transport.isend(token, peer, self._ch_act, 0, 0)
        self._engine.ring(peer)  # its listener may sleep on its doorbell
        entry = (request, token)
        self._sending.append(entry)
        self._engine.post(request, lambda e=entry: self._sending.remove(e))

    # -- helpers ------------------------------------------------------------------
    def _set_flags(self, buf: np.ndarray, members: tuple[int, ...], fresh: bool) -> None:
        self._mem.set_flags(buf[self.count:self.count + len(members)],
                            members.index(self.rank) if fresh else None, self._one)

    def _one_bits(self) -> Any:
        if self.dtype.is_half:
            return host_kernels.from_float32(np.ones(1, np.float32), self.dtype)[0]
        return np.ones(1, dtype=self.dtype.storage)[0]

    def _count_contribution(self, fresh: bool) -> None:
        with self._lock:
            if fresh:
                self.telemetry.fresh_contributions += 1
            else:
                self.telemetry.stale_contributions += 1

    # -- where the data lives (host memory here; partial/device.py for GPUs) -----------
    def _intake(self, buf: Any) -> Any:
        """The creation buffer, checked (``buffers.Buffer``)."""
        return as_buffer(buf, "buf")

    def _memory(self) -> Any:
        """Where rounds keep their data, and how they copy, add and average it."""
        memory = HostMemory(self.dtype)
        memory.warm()  # compiled now, outside the lock and before any round
        return memory

    def _new_buffer(self) -> np.ndarray:
        """A round buffer: the data, then one flag per rank."""
        return self._mem.empty(self.count + self.size)

    def _flags_of(self, buf: np.ndarray, n: int) -> np.ndarray:
        """A completed round's ``n`` summed member flags, readable on the host."""
        return self._mem.to_host(buf[self.count:self.count + n])

    def _template_data(self) -> tuple[Any, Any]:
        """The creation buffer as step data (where a flush lands by default)."""
        return self._template.host_array(), self._template.owner

    # -- hooks ----------------------------------------------------------------------
    def _activates(self, t: int) -> bool:
        """Whether this rank's arrival at round ``t`` activates it."""
        return True

    def _flat_tokens(self, n: int) -> bool:
        """Whether a round's activation over ``n`` members is one flat
        broadcast rather than the reference's binomial tree."""
        return False

    def _waiting_for(self, t: int) -> list[int]:
        return []

    def _round_activator(self, r: int, first_root: int) -> int:
        """The activator a round reports: the root of the first activation that
        reached this rank (ranks arriving together may each name themselves)."""
        return first_root

    def _flush_needs_data(self) -> bool:
        return True

    def _contribute(self, data: np.ndarray, t: int) -> None:
        raise NotImplementedError

    def _snapshot(self, dst: np.ndarray, r: int) -> bool:
        raise NotImplementedError

    def _flush_snapshot(self, dst: np.ndarray, call: _Call) -> None:
        raise NotImplementedError

    def _late_result(self, t: int) -> Result:
        raise NotImplementedError

    def _store(self, res: Result, wanted: bool) -> None:
        raise NotImplementedError

    def _finalize(self, call: _Call, res: Result) -> None:
        raise NotImplementedError

    def _leftover(self) -> str:
        return ""

    def _extra_statistics(self) -> dict[str, Any]:
        return {}

