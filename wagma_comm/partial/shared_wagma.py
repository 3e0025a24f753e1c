"""WAGMA's wait-avoiding group allreduce through shared memory (one host).

Why: through messages, a group round needs every member's progress thread,
even that of a member whose application is still computing. On a host whose
ranks outnumber its cores those threads' turns were most of what a WAGMA
iteration cost beyond local SGD (docs/training.md, "Why the second target is
missed"). On one host nobody needs to run anything for a peer: the first
member to arrive at a round computes it from the models its peers last
published on the board (transport/shm_board.py) and leaves the sum in every
member's result block; members that arrive later take it from there.

Semantics (docs/partial.md, "Through shared memory"), as on the message path
unless said:

* ``publish`` and ``step`` copy the model into this rank's published slot;
  a round counts a member fresh when its slot holds the model of that round.
* The first member to arrive at round ``t`` (under every member's lock, so
  exactly one does) sums the group's published models in member order and
  writes the sum, the freshness flags and its own rank (the activator) into
  every member's result block whose newest round is older than ``t``.
* A member whose result block already holds round ``t`` or later is late: it
  gets that newest round at once (staleness ``newest - t + 1``, or 0 when
  that round is ``t`` and its published model was fresh in it), as the
  message path's late caller gets the most recent completed round.
* Half precision: a round's sum stays in float32 in the result blocks, and
  ``_combine`` rounds once (no float16 overflow where the mean fits).
* Nobody waits for a peer in a group round (the locks are held for the copy
  and the sum only), except for the opt-in ``grace``: the first member to
  arrive may wait a bounded time for members one round behind
  (``_await_one_behind``). Sync rounds, ``flush`` and ``close`` are the
  communicator's blocking allreduces (shared memory or messages by size).
* No progress thread, no tokens: ``activation`` makes no difference, and a
  ready publish is an ordinary publish (a round uses whatever is published
  when its first member arrives, which is what a ready start achieves).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

import numpy as np

from .. import groups as groups_mod
from ..buffers import as_buffer
from ..errors import (
    CollectiveError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
    MismatchError,
    RankFailedError,
    UnsupportedError,
    WagmaError,
    WaitTimeoutError,
)
from ..kernels import host as host_kernels
from ..runtime.activation import group_step, is_sync_round
from ..runtime.handle import Handle, check_wait_timeout
from ..schedule import algorithms
from ..transport import shm_lock
from ..transport.shm_board import (ACTIVATOR, ARRIVED, DIED, HOLDER, PUBLISHED, RESULT,
                                    Board)
from .base import (CLOSE, FLUSH, FLUSH_ROUND, agree, check_first_round, check_step_buffer,
                   check_sync_every, final_call_differences, unusable)
from .info import RoundInfo, Telemetry
from .wagma import WaitAvoidingGroupAllreduce, check_options, check_ready

SHARED_MEMORY = "shared_memory"
LIVENESS_PERIOD_S = 0.25
"""How often a round with stale members asks whether they are alive."""
GRACE_POLL_S = 100e-6
"""How often a member in its grace period looks at its peers' published rounds."""
COMPUTE_WINDOW = 8
"""The grace scales with the median of this rank's last COMPUTE_WINDOW
compute times: one long pause (a checkpoint, an evaluation) is not a
typical compute time. Until session 48 it was a moving average (weight 1/8
for the newest), which one 3 s pause at 20 ms per step raised to 0.4 s,
a grace 20 times too long for the next rounds."""
GRACE_MAX_SHARE = 0.5
"""The grace never waits more than this share of the collective's timeout,
so that the step's lock waits keep the rest and the step ends within it."""
MODEL_MAX_BYTES = 16 << 20
"""Largest model (bytes per rank) on the board. The member that computes a
round holds its group's locks while it sums their models, so a peer that
publishes meanwhile waits that long; bigger models take the message path."""


class _Continued:
    """A Handle-like result of a step whose collective runs elsewhere (a sync
    round's allreduce): ``then`` turns its outcome into the step's RoundInfo,
    once, on the thread that first sees it finished (the caller's wait, or
    the collective's next call settling it: a lock keeps them from both
    running it). ``collective`` and ``round`` name the step (as a message
    path step's Handle does), not the communicator's allreduce under it."""

    def __init__(self, inner: Any, then: Callable[[BaseException | None], RoundInfo],
                 collective: str, round: int) -> None:
        self.collective, self.round = collective, round
        self._inner, self._then = inner, then
        self._outcome: tuple[RoundInfo | None, BaseException | None] | None = None
        self._settling = threading.Lock()

    @property
    def settled(self) -> bool:
        """Whether some caller has already been given its outcome."""
        return self._outcome is not None

    @property
    def done(self) -> bool:
        return self._inner.done

    @property
    def elapsed(self) -> float | None:
        return self._inner.elapsed

    def _settle(self, error: BaseException | None) -> RoundInfo:
        with self._settling:
            if self._outcome is None:
                try:
                    self._outcome = (self._then(error), None)
                except BaseException as exc:  # the step's own error, raised to every caller
                    self._outcome = (None, exc)
        info, exc = self._outcome
        if exc is not None:
            raise exc
        assert info is not None
        return info

    def test(self) -> bool:
        error = None
        try:
            if not self._inner.test():
                return False
        except WagmaError as exc:
            error = exc
        self._settle(error)
        return True

    def wait(self, timeout: float | None = None) -> RoundInfo:
        # A bad timeout is the caller's error, raised before waiting: taken
        # for the round's outcome it broke the collective while the round ran on.
        given = timeout
        if timeout is not None:
            timeout = check_wait_timeout(timeout)
        error = None
        try:
            self._inner.wait(timeout)
        except WaitTimeoutError:  # still running: wait() may be called again
            raise WaitTimeoutError(f"{self.collective} (round {self.round}) still running "
                                   f"after wait({given}); call wait() again") from None
        except WagmaError as exc:
            error = exc
        return self._settle(error)


class SharedWaitAvoidingGroupAllreduce:
    """Made by :meth:`Communicator.wait_avoiding_group_allreduce` when every
    rank is on one host (see :func:`create`); the same interface as
    :class:`~wagma_comm.partial.wagma.WaitAvoidingGroupAllreduce`."""

    kind = "wait_avoiding_group_allreduce"
    path = SHARED_MEMORY

    def __init__(self, comm: Any, buf: Any, board: Board, ident: int, group_size: int,
                 sync_every: int, *, activation: str, normalization: str,
                 timeout: float, first_round: int = 0, grace: float = 0.0) -> None:
        buffer = as_buffer(buf, "buf")
        self._comm, self._board, self._id = comm, board, ident
        self.rank, self.size = comm.rank, comm.size
        self.count, self.dtype = buffer.count, buffer.dtype
        self.group_size, self.sync_every = group_size, sync_every
        self.first_round = first_round  # round r has round first_round + r's group
        self.activation, self.normalization, self.timeout = activation, normalization, timeout
        self.grace = grace
        storage = self.dtype.storage
        self._published = [b[:buffer.nbytes].view(storage) for b in board.published]
        # A half-precision round's sum stays in float32 (the board's blocks are
        # twice the model then: result_bytes), so a float16 group sum over
        # 65504 does not overflow where the mean is representable, and the
        # result is rounded once, in _combine.
        self._results = [b.view(np.float32 if self.dtype.is_half else storage)
                         for b in board.result]
        self._reducers: dict[tuple[int, ...], Callable[[np.ndarray], None]] = {}
        self._combiners: dict[int, Callable[[np.ndarray], None]] = {}
        # The groups shift with the step, which repeats every num_steps.
        self._groups = tuple(groups_mod.group_of(self.rank, self.size, group_size, k)
                             for k in range(groups_mod.num_steps(self.size, group_size)))
        self._everyone = tuple(range(self.size))
        # Sync rounds must give every rank the same bits: the default
        # algorithm's choice (never native).
        self._sync_algorithm = comm._choose_reduce(self.count * self.dtype.itemsize,
                                                   self._everyone)
        self.telemetry = Telemetry(self.size)
        self._app_round = 0
        self._completed = -1
        self._pending: dict[int, Any] = {}  # none: read by the communicator's exit report
        self._unsettled: _Continued | None = None  # an async sync round not yet waited on
        self._error: WagmaError | None = None
        self._closed = False
        # Held while a thread uses the board, and by close() to unmap it: a
        # step on another thread then finishes first or sees it closed.
        self._use = threading.RLock()
        self._liveness_checked = 0.0
        self._arrivals = 0  # blocking rounds entered here (the board's ARRIVED word)
        self._left_step: float | None = None  # when the last step() returned
        # The last COMPUTE_WINDOW times between steps (this rank's compute).
        self._computes: collections.deque[float] = collections.deque(maxlen=COMPUTE_WINDOW)

    def _open(self) -> None:
        """(Communicator._create) The board was agreed on in :func:`create`."""

    # -- application side ---------------------------------------------------------
    def publish(self, buf: Any, *, ready: bool = False) -> None:
        """Make ``buf`` (copied now) this rank's contribution to its next
        round without arriving at it; ``ready`` changes nothing here (module
        docstring)."""
        check_ready(ready)
        data, _ = check_step_buffer(self.kind, self.count, self.dtype, buf)
        self._settle_sync_round()
        self._check_usable()
        self._publish(data, self._app_round)

    def step(self, buf: Any, *, async_op: bool = False) -> Any:
        """Contribute ``buf`` to this iteration's round and replace it in place
        by the round's result. Returns a RoundInfo (or a handle whose
        ``wait()`` returns it)."""
        data, _ = check_step_buffer(self.kind, self.count, self.dtype, buf)
        self._settle_sync_round()
        self._check_usable()
        t = self._app_round
        self._app_round += 1
        started = time.monotonic()
        self._measure_compute(started)
        if is_sync_round(self.first_round + t, self.sync_every):
            handle = self._sync_round(t, buf, data, started)
            if async_op:  # the caller computes while it runs: that is compute time
                self._unsettled = handle
            else:
                info = handle.wait()
            self._left_step = time.monotonic()
            return handle if async_op else info
        with self._use:
            self._check_mapped()
            info = self._group_round(t, data, started)
        self._left_step = time.monotonic()
        if not async_op:
            return info
        done = Handle(self.kind, t, started, lambda: True)
        done.started = started  # elapsed: the step's own time, as a queued step's is
        done._complete(info)
        return done

    def flush(self, buf: Any = None) -> RoundInfo | None:
        """Collective: every rank must have taken the same number of steps;
        with ``buf``, one extra global mean of it (as a sync round)."""
        data = None if buf is None else check_step_buffer(
            self.kind, self.count, self.dtype, buf)[0]
        self._settle_sync_round()
        self._check_usable("flush()")
        self._agree("flush", FLUSH if data is None else FLUSH_ROUND)
        self.telemetry.flushes += 1
        if data is None:
            return None
        started = time.monotonic()
        return self._sync_round(self._app_round, buf, data, started, counted=False).wait()

    def close(self) -> None:
        """Collective: every rank must have taken the same number of steps
        (so nobody reads this rank's slot any more); then unmaps. A broken
        collective is released locally. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            unseen = self._settle_sync_round()
            if unseen is not None:  # its handle's owner never asked: tell them here
                raise unseen
            if self._error is None and not self._comm.closed:
                self._check_usable("close()", closing=True)
                self._agree("close", CLOSE)
        finally:
            self._unmap()

    def statistics(self) -> dict[str, Any]:
        """As the message path's (docs/partial.md, "Telemetry"); ``path`` says
        which. Rounds are counted where their result is applied here."""
        stats = self.telemetry.as_dict()
        stats.update(kind=self.kind, rank=self.rank, size=self.size,
                     sync_every=self.sync_every, first_round=self.first_round,
                     iteration=self._app_round, started_round=self._completed,
                     completed_round=self._completed,
                     broken=None if self._error is None else str(self._error),
                     group_size=self.group_size, activation=self.activation,
                     normalization=self.normalization, path=self.path)
        return stats

    def __enter__(self) -> "SharedWaitAvoidingGroupAllreduce":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._closed = True
            self._unmap()

    # -- group rounds ---------------------------------------------------------------
    def _members(self, r: int) -> tuple[int, ...]:
        groups = self._groups
        return groups[group_step(self.first_round + r, self.sync_every) % len(groups)]

    def _group_round(self, t: int, data: np.ndarray, started: float) -> RoundInfo:
        members = self._members(t)
        me, words = self.rank, self._board.words
        deadline = started + self.timeout  # the grace and the lock waits, together
        waited = self._await_one_behind(t, members, data, started)
        held = self._hold_all(members, t, deadline)
        try:
            if waited is None:  # else published before the wait
                self._write_published(data, t)
            newest = int(words[me][RESULT])
            if newest < t:  # first to arrive: this rank runs the round for the group
                self._run_round(t, members)
                newest = t
            group = members if newest == t else self._members(newest)
            flags = self._board.flags[me]
            fresh = tuple(m for i, m in enumerate(group) if flags[i])
            # On time when its model of round t made round t (it ran the round,
            # or a peer did after this rank published); else rounds behind.
            staleness = 0 if newest == t and me in fresh else newest - t + 1
            activator = int(words[me][ACTIVATOR])
            if activator == me and newest == t and len(fresh) < len(group):
                self._check_stale_members(t, [m for m in group if m not in fresh])
            others, held = [m for m in held if m != me], [me]
            self._release(others)
            self._combine(data, len(group))  # under this rank's lock: its result block
        finally:
            self._release(held)
        self._completed = max(self._completed, newest)
        telemetry = self.telemetry
        telemetry.record_round(group, fresh, False)
        telemetry.record_call(staleness, time.monotonic() - started, False)
        if waited is not None:
            telemetry.grace_waits += 1
            telemetry.grace_wait_time_s += waited
        if activator == me:
            telemetry.activated_here += 1
        else:
            telemetry.activated_elsewhere += 1
        if me in fresh:
            telemetry.fresh_contributions += 1
        else:
            telemetry.stale_contributions += 1
        return RoundInfo(round=newest,
                         step=group_step(self.first_round + newest, self.sync_every),
                         group=group, activator=activator, fresh=fresh,
                         staleness=staleness, synchronized=False, iteration=t)

    def _measure_compute(self, now: float) -> None:
        """Keep the time since the last step() returned (this rank's own
        compute) among the last COMPUTE_WINDOW, whose median scales the grace."""
        if self._left_step is not None:
            self._computes.append(now - self._left_step)

    def _compute_s(self) -> float | None:
        """This rank's typical compute time: the lower median of the last
        COMPUTE_WINDOW (one pause among them, even among two, changes
        nothing); None before the second step."""
        computes = sorted(self._computes)
        return computes[(len(computes) - 1) // 2] if computes else None

    def _await_one_behind(self, t: int, members: tuple[int, ...],
                          data: np.ndarray, started: float) -> float | None:
        """The grace (opt-in): before running round ``t``, wait at most
        ``grace`` times this rank's typical compute time (never past
        GRACE_MAX_SHARE of the timeout after the step's call at
        ``started``) for the members whose
        published model is of round ``t - 1``, so that a peer a moment
        behind is counted fresh instead of averaged in with last round's
        model. On messages a round's own latency gives peers that moment; on
        the board a round takes microseconds. A member further behind is a
        straggler and nobody waits for it; a peer that runs the round
        meanwhile ends the wait. Holds no lock. Returns the seconds waited,
        None if it did not wait."""
        words, me = self._board.words, self.rank
        peers = [words[m] for m in members if m != me]

        def worth_waiting() -> bool:  # unlocked reads: hints only, the round re-reads
            return words[me][RESULT] < t and any(w[PUBLISHED] == t - 1 for w in peers)

        compute = self._compute_s() if self.grace else None
        if compute is None or not worth_waiting():
            return None
        # This rank's model first: a peer in its own grace then sees it
        # arrived, instead of both waiting for each other.
        self._publish(data, t)
        start = now = time.monotonic()
        deadline = min(start + self.grace * compute, started + GRACE_MAX_SHARE * self.timeout)
        while now < deadline and worth_waiting():
            time.sleep(min(GRACE_POLL_S, deadline - now))
            self._check_cancel(t)
            now = time.monotonic()
        return now - start

    def _run_round(self, t: int, members: tuple[int, ...]) -> None:
        """(every member's lock held) Sum the members' published models into
        this rank's result block, then hand it to every member still older."""
        me, words, board = self.rank, self._board.words, self._board
        reduce = self._reducers.get(members)
        if reduce is None:
            reduce = self._summer([self._published[m] for m in members])
            self._reducers[members] = reduce
        reduce(self._results[me])
        flags = board.flags[me]
        for i, m in enumerate(members):
            flags[i] = words[m][PUBLISHED] == t
        words[me][RESULT], words[me][ACTIVATOR] = t, me
        n = len(members)
        for m in members:
            if m != me and words[m][RESULT] < t:
                np.copyto(self._results[m], self._results[me])
                board.flags[m][:n] = flags[:n]
                words[m][RESULT], words[m][ACTIVATOR] = t, me

    def _check_stale_members(self, t: int, stale: list[int]) -> None:
        """A member whose model was stale may be dead rather than slow: a
        round never waits for it, so ask the liveness check (at most every
        LIVENESS_PERIOD_S) and raise RankFailedError naming it, as the
        message path's round does, instead of averaging with a dead model
        until the next sync round."""
        now = time.monotonic()
        if now - self._liveness_checked < LIVENESS_PERIOD_S:
            return
        self._liveness_checked = now
        failed = self._comm._engine.watch.dead_among(stale)
        if failed is not None:
            raise self._break(failed(self.kind, t))

    def _publish(self, data: np.ndarray, t: int | None) -> None:
        with self._use:
            self._check_mapped()
            self._hold(self.rank, self._app_round if t is None else t,
                       time.monotonic() + self.timeout)
            try:
                self._write_published(data, t)
            finally:
                self._release([self.rank])

    def _write_published(self, data: np.ndarray, t: int | None) -> None:
        """(this rank's lock held) ``data`` is this rank's model of round
        ``t`` (None: of the round its slot already names)."""
        np.copyto(self._published[self.rank], data)
        if t is not None:
            self._board.words[self.rank][PUBLISHED] = t

    def _summer(self, rows: list[np.ndarray]) -> Callable[[np.ndarray], None]:
        """``fn(dst)``: ``dst`` = the sum of ``rows`` in their order; float32
        for half precision (accumulated as the kernels do, never rounded to
        the half format)."""
        if not self.dtype.is_half:
            return host_kernels.rows_reducer("sum", self.dtype, rows)

        def widened_sum(dst: np.ndarray) -> None:
            dst[:] = host_kernels.to_float32(rows[0], self.dtype)
            for row in rows[1:]:
                dst += host_kernels.to_float32(row, self.dtype)
        return widened_sum

    def _combine(self, out: np.ndarray, n: int) -> None:
        """``out`` = the group's mean (``n`` members), or (normalization
        "wagma") ``(sum + out) / (n + 1)``, rounded once. Made once per
        group size: average_into's checks cost more than the kernel."""
        combine = self._combiners.get(n)
        if combine is None:
            with_out = self.normalization != "mean"
            total = self._results[self.rank]
            if self.dtype.is_half:  # the float32 sum (see __init__)
                def combine(dst: np.ndarray) -> None:
                    acc = total + host_kernels.to_float32(dst, self.dtype) if with_out else total
                    dst[:] = host_kernels.from_float32(acc / np.float32(n + with_out),
                                                       self.dtype)
            else:
                combine = host_kernels.rows_reducer("avg", self.dtype, [total],
                                                    n + with_out, with_dst=with_out)
            self._combiners[n] = combine
        combine(out)

    # -- locks ----------------------------------------------------------------------
    def _hold_all(self, members: tuple[int, ...], t: int, deadline: float) -> list[int]:
        """Every member's lock, in rank order (no two ranks deadlock), by
        the step's ``deadline``."""
        held: list[int] = []
        try:
            for m in sorted(members):
                self._hold(m, t, deadline)
                held.append(m)
        except BaseException:
            self._release(held)
            raise
        return held

    def _hold(self, m: int, t: int, deadline: float) -> None:
        """Rank ``m``'s lock. A rank that died holding it may have left its
        slot half written: the first to hold it after the death marks the
        slot (DIED), so that every later holder raises RankFailedError too
        instead of reading the torn model as data."""
        words, lock = self._board.words[m], self._board.locks[m]
        try:
            survived = shm_lock.acquire(lock, deadline, lambda: self._check_cancel(t))
        except shm_lock.LockTimeout:
            holder = int(words[HOLDER])  # -1: the holder has not written it yet
            who, ranks = ((f"rank {holder}", [holder]) if 0 <= holder < self.size
                          else ("a rank that had not yet written its rank", []))
            raise self._break(CollectiveTimeoutError(
                self.kind, t, ranks, f"{who} held rank {m}'s board slot for "
                f"more than {self.timeout:g} s")) from None
        if not survived or words[DIED] >= 0:
            try:  # the liveness check may fail too: never keep the lock then
                if words[DIED] < 0:
                    words[DIED] = self._died_holding(int(words[HOLDER]))
                dead = int(words[DIED])
            finally:
                shm_lock.release(lock)
            slot = "its own board slot" if dead == m else f"rank {m}'s board slot"
            who, ranks = (f"rank {dead}", [dead]) if dead < self.size else ("a rank", [])
            raise self._break(RankFailedError(self.kind, t, ranks, f"{who} died holding {slot}"))
        words[HOLDER] = self.rank

    def _check_cancel(self, t: int) -> None:
        """(between waits for a peer) Raise close(cancel=True)'s error: the
        communicator's shared exchange carries it from before close takes
        any lock, so a step waiting for a lock held by a peer that stopped,
        or in its grace, ends within a nap instead of at its deadline. Said
        of this collective and round ``t``, as on the message path."""
        shared = self._comm._shared
        error = None if shared is None else shared.cancelled()
        if error is not None:
            raise self._break(CommunicatorClosedError(f"{self.kind} (round {t}): {error}"))

    def _died_holding(self, holder: int) -> int:
        """Who died holding a lock (for the DIED word, never negative): the
        HOLDER word names it unless the holder died between taking the lock
        and writing the word, so ask the liveness check which rank is gone;
        ``self.size`` where nobody can be named."""
        others = [r for r in range(self.size) if r != self.rank]
        dead = self._comm._engine.watch.dead_ranks(others, settle=True)
        if holder in dead or (not dead and holder in others):
            return holder
        return dead[0] if dead else self.size

    def _release(self, held: list[int]) -> None:
        """Let go of ``held``'s locks, first clearing their HOLDER words: a
        peer timing out on one later names its holder, or nobody while the
        holder has not yet written its rank, never the last rank that held
        it (often the peer itself)."""
        words, locks = self._board.words, self._board.locks
        for m in held:
            words[m][HOLDER] = -1
            shm_lock.release(locks[m])

    # -- blocking rounds ------------------------------------------------------------
    def _sync_round(self, t: int, buf: Any, data: np.ndarray, started: float,
                    counted: bool = True) -> _Continued:
        """The global mean of every rank's ``buf`` (``data``: its host array),
        then published here. ``counted``: a step's sync round; else flush(buf)'s
        extra mean, which keeps the round number and is named for the flush."""
        what = "synchronous round" if counted else "flush(buf)'s global mean"
        arrived = self._arrive()
        try:
            inner = self._comm.allreduce(buf, "avg", async_op=True,
                                         algorithm=self._sync_algorithm, timeout=self.timeout)
        except WagmaError as exc:  # refused at once (a broken communicator): this round
            # failed, and later group rounds must not go on without it
            raise self._named(exc, t, what, call=None if counted else "flush()") from None

        def then(error: BaseException | None) -> RoundInfo:
            if error is not None:
                raise self._named(error, t, what, call=None if counted else "flush()",
                                  arrived=arrived)
            with self._use:
                if not self._board.closed:  # else nobody reads this rank's slot any more
                    # A flush's mean is this rank's model after its last step,
                    # not a model of the next round: its round number stays.
                    self._publish(data, t if counted else None)
            self.telemetry.record_round(self._everyone, self._everyone, True)
            if counted:
                # Until the round completed, not until someone settled it: an
                # async step's caller computes meanwhile (the message path
                # measures to the delivery too).
                finished = getattr(inner, "finished", None)
                end = time.monotonic() if finished is None else finished
                self.telemetry.record_call(0, end - started, True)
                self.telemetry.fresh_contributions += 1
                self._completed = max(self._completed, t)
            return RoundInfo(round=t, step=None, group=self._everyone, activator=None,
                             fresh=self._everyone, staleness=0, synchronized=True,
                             iteration=t)
        return _Continued(inner, then, self.kind, t)

    def _settle_sync_round(self) -> WagmaError | None:
        """Finish a sync round that ``step(async_op=True)`` left running: its
        result is published on the board when it completes, which must come
        before any later round's publish (the board keeps one model per rank,
        of one round) and before close() unmaps the board. Its error stays
        with its handle and breaks this collective (``_named``); it is
        returned if no caller has seen it yet."""
        handle = self._unsettled
        if handle is None:
            return None
        seen = handle.settled
        error = None
        try:
            handle.wait()
        except WagmaError as exc:  # the handle raises it to its own caller too
            error = None if seen else exc
        self._unsettled = None
        return error

    def _agree(self, what: str, call: int) -> None:
        """Collective: every rank's step count and final call (FLUSH,
        FLUSH_ROUND or CLOSE), compared; a rank that stepped a different
        number of times or called something else is named."""
        table = np.zeros((self.size, 2), dtype=np.int64)
        table[self.rank] = self._app_round, call
        try:
            self._comm.allreduce(table, "sum", timeout=self.timeout)
        except (CollectiveError, CommunicatorClosedError) as exc:
            raise self._named(exc, self._app_round, f"{what}()", call=f"{what}()") from None
        differ, mine = final_call_differences(table, self.rank)
        if differ:
            raise self._break(MismatchError(self.kind, self._app_round, differ, mine))

    def _named(self, error: BaseException, t: int, what: str, *, call: str | None = None,
               arrived: int | None = None) -> WagmaError:
        """The communicator's error, renamed for this collective's round
        (``call``: the flush or close it was, for a cancel's text, as on the
        message path). ``arrived``: the blocking round's number on the
        board (:meth:`_arrive`): a timeout then names the ranks that never
        entered it, not the peer a message schedule was waiting on (which
        may itself be waiting for them)."""
        if isinstance(error, CollectiveTimeoutError) and arrived is not None:
            missing = self._not_arrived(arrived)
            if missing:
                error = CollectiveTimeoutError(
                    self.kind, t, missing, f"{what}: rank(s) {missing} never arrived "
                    f"({error.where}: {error.detail})")
                return self._break(error)
        if isinstance(error, (CollectiveTimeoutError, RankFailedError)):
            error = type(error)(self.kind, t, error.ranks,
                                f"{what}: {error.where}: {error.detail}")
        elif type(error) is CommunicatorClosedError:  # close(cancel=True)'s bare text
            error = CommunicatorClosedError(f"{self.kind} ({call or f'round {t}'}): {error}")
        elif not isinstance(error, WagmaError):
            error = WagmaError(str(error))
        return self._break(error)

    def _arrive(self) -> int:
        """Before a blocking round's allreduce: say on the board that this
        rank entered it. Why: a message schedule's timeout names the peer it
        was waiting on, often one waiting like itself for the rank that
        never came (the message path's sync rounds run an arrival check
        for this); the board tells without a message. Returns its number."""
        self._arrivals += 1
        with self._use:
            if not self._board.closed:
                self._board.words[self.rank][ARRIVED] = self._arrivals
        return self._arrivals

    def _not_arrived(self, k: int) -> list[int]:
        """The ranks that have not entered this rank's ``k``-th blocking round
        (unlocked reads: a hint for naming only); [] once unmapped."""
        with self._use:
            if self._board.closed:
                return []
            return [r for r in range(self.size) if self._board.words[r][ARRIVED] < k]

    def _break(self, error: WagmaError) -> WagmaError:
        if self._error is None:
            self._error = error
        return error

    def _unmap(self) -> None:
        """Drop every view of the board, then unmap it: a view left (the
        models, the cached kernels' rows) kept the whole board mapped, and
        its memory in /dev/shm (P times twice the model) allocated, for as
        long as this object lived."""
        with self._use:
            self._published, self._results = [], []
            self._reducers.clear()
            self._combiners.clear()
            self._board.close()

    def _check_mapped(self) -> None:
        """(under _use) A thread that got past _check_usable while another
        closed this collective must not touch the unmapped board."""
        if self._board.closed:
            raise CommunicatorClosedError(f"{self.kind} is closed")

    def _check_usable(self, call: str | None = None, closing: bool = False) -> None:
        """Raise, naming the round (or ``call``), unless this collective and
        its communicator are usable; a broken communicator breaks the
        collective (base.unusable, as on the message path). ``closing``:
        close(), which has marked the collective closed."""
        error = unusable(self.kind, self._app_round, call, self._closed and not closing,
                         self._error, self._comm)
        if error is not None:
            raise self._break(error)


# -- choosing the path (collective) ---------------------------------------------------
def unavailable_reason(comm: Any, nbytes: int) -> str | None:
    """Why a board cannot serve this collective, of what every rank can
    tell alike once the creation agreement passed (the communicator's
    segment is agreed at init, ``nbytes`` by the agreement). What only this
    process can tell (its C library's locks) is :func:`open_board`'s
    ``refused``, told to the others there."""
    # The segment itself, not shared_memory_bytes: WAGMA_SHM_MAX_BYTES=0
    # (nothing reduced there by default) leaves the segment, and the board
    # has its own limit (before session 48 it said no segment there).
    if comm._shared is None:
        reason = comm._transport.shared_unavailable or "no shared-memory segment"
        return f"the communicator has no shared-memory segment ({reason})"
    if nbytes > MODEL_MAX_BYTES:
        return f"{nbytes} bytes is over the board's {MODEL_MAX_BYTES} bytes per rank"
    return None


def result_bytes(count: int, dtype: Any) -> int:
    """Bytes of a board block's model slots: a round's sum is float32 for
    half precision (SharedWaitAvoidingGroupAllreduce.__init__)."""
    return count * (4 if dtype.is_half else dtype.itemsize)


def _unable(comm: Any, able: bool, timeout: float) -> list[int]:
    """Collective: the ranks whose ``able`` is False (a flag each, gathered
    by a sum), the same list on every rank."""
    flags = np.zeros(comm.size, dtype=np.int64)
    flags[comm.rank] = not able
    comm.allreduce(flags, "sum", timeout=timeout)
    return [int(r) for r in np.flatnonzero(flags)]


def open_board(comm: Any, ident: int, initial: np.ndarray, nbytes: int, timeout: float,
               refused: str | None = None) -> tuple[Board | None, str | None]:
    """Collective: rank 0 creates the board (``nbytes`` per model slot), the
    others map it, every rank puts ``initial`` in its published slot; a
    board only if all could. ``refused``: why this rank alone cannot use
    one (shm_lock.UNAVAILABLE), said in the first exchange, so that every
    rank learns it at once and the others name this rank. Returns the
    board, or None and why: this rank's own reason, else the ranks that
    could not."""
    path = f"{comm._shared.segment.path}-p{ident}"
    board, reason = None, refused
    if comm.rank == 0 and refused is None:
        try:
            board = Board.create(path, comm.size, nbytes)
        except OSError as exc:
            reason = f"rank 0 could not create {path}: {exc}"
    try:
        unable = _unable(comm, reason is None, timeout)
        if not unable:  # the same on every rank
            if comm.rank != 0:
                try:
                    board = Board.attach(path, comm.size, nbytes)
                except OSError as exc:
                    reason = f"rank {comm.rank} could not map {path}: {exc}"
            if board is not None:
                board.published[comm.rank][:initial.nbytes] = \
                    initial.reshape(-1).view(np.uint8)
            unable = _unable(comm, board is not None, timeout)
    except BaseException:
        # An agreement that failed (a rank dead or missing) must not leave
        # the board's file in /dev/shm: nothing would ever unlink it.
        if board is not None:
            if comm.rank == 0:
                board.unlink()
            board.close()
        raise
    if board is not None and comm.rank == 0:
        board.unlink()
    if not unable:
        return board, None
    if board is not None:
        board.close()
    return None, reason or f"rank(s) {unable} could not create, map or use the board"


def create(comm: Any, buf: Any, group_size: int, sync_every: int, *,
           activation: str = "global", normalization: str = "wagma",
           timeout: float | None = None, algorithm: str | None = None,
           first_round: int = 0, grace: float = 0.0) -> Any:
    """Collective: the wait-avoiding group allreduce on the board where it
    can run (``algorithm`` None or ``"shared_memory"``), else on messages."""
    check_sync_every(sync_every)
    check_first_round(first_round)
    check_options(comm.size, group_size, activation, normalization, grace)
    buffer = as_buffer(buf, "buf")
    # Refused here, before any communication: what this rank alone can tell.
    if algorithm not in (SHARED_MEMORY, None) and (
            algorithm not in algorithms.ALLREDUCE_ALGORITHMS or algorithm == "native"):
        usable = [a for a in algorithms.ALLREDUCE_ALGORITHMS if a != "native"]
        raise InvalidArgumentError(
            "algorithm", f"expected {SHARED_MEMORY!r} or one of {usable}, got {algorithm!r}")
    agree(comm, WaitAvoidingGroupAllreduce.kind, buffer.count, buffer.dtype, timeout,
          group_size=group_size, sync_every=sync_every, first_round=first_round,
          activation=activation, normalization=normalization, algorithm=algorithm)
    if algorithm == SHARED_MEMORY or algorithm is None:
        # Only now, and alike on every rank: a refusal before the agreement
        # (a rank whose model alone is over the limit, or whose C library
        # alone lacks the locks) left the others to time out in it; with
        # algorithm=None such a rank took the message path alone.
        reason = unavailable_reason(comm, buffer.nbytes)
        if reason is None:
            data = buffer.host_array()
            deadline = comm._call_timeout(timeout)
            ident = comm._register_partial()
            board, reason = open_board(comm, ident, data,
                                       result_bytes(buffer.count, buffer.dtype), deadline,
                                       refused=shm_lock.UNAVAILABLE)
            if board is not None:
                return comm._create(SharedWaitAvoidingGroupAllreduce(
                    comm, buf, board, ident, group_size, sync_every, activation=activation,
                    normalization=normalization, timeout=deadline, first_round=first_round,
                    grace=float(grace)))
        if algorithm == SHARED_MEMORY:  # the board could not be made on every rank
            raise UnsupportedError("algorithm", f"shared_memory: {reason}")
        algorithm = None
    return comm._create(WaitAvoidingGroupAllreduce(
        comm, buf, group_size, sync_every, activation=activation,
        normalization=normalization, timeout=timeout, algorithm=algorithm,
        first_round=first_round, grace=grace))


__all__ = ["SharedWaitAvoidingGroupAllreduce", "create", "unavailable_reason",
           "MODEL_MAX_BYTES", "SHARED_MEMORY"]
