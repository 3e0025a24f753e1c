"""The progress engine: one thread per communicator owns every transport call.

Application threads only *submit* work (a :class:`Work`: one or more stages,
each a compiled schedule over arrays); the progress thread starts it in
submission order, issues each op once its dependencies are done, polls the
transport for all outstanding requests with one call, retires completed ops and
completes handles. Many collectives can be in flight and finish in any order.

Why one thread: MPI progress and (later) NCCL's ordering rule both want a single
issuer, and it keeps the transports single-threaded code. Why stages: debug
fingerprints and communicator set-up are just small schedules run before the
collective's own, on their own channels.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from ..dtypes import DType
from ..errors import (
    CollectiveError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
    MessageSizeError,
    RankFailedError,
    TransportError,
    WagmaError,
)
from ..schedule.ir import DATA, Recv, Schedule, Send
from ..schedule.straight import straight_order, straight_safe
from ..transport.base import CHANNEL_DATA, Transport
from .handle import Handle
from .inline import (DONE, EXPIRED, Plan, Program, ProgramRun, overlong_receive, plan, post,
                     run_local)
from .liveness import Liveness
from .pool import ScratchPool
from .straight import StraightLine
from .watch import Watch, stage_phase, timeout_error, waiting_ranks

# Polling-policy variables that could not be read: import must not fail on
# them, so init() raises for them (check_environment), naming the variable.
_BAD_ENVIRONMENT: dict[str, str] = {}


def _microseconds(name: str, default: str) -> float:
    """Seconds from the environment variable ``name`` (microseconds >= 0)."""
    raw = os.environ.get(name, default).strip() or default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # NaN too
        _BAD_ENVIRONMENT[name] = raw
        value = float(default)
    return value * 1e-6


def check_environment() -> None:
    """Raise InvalidArgumentError naming a polling variable that was not
    microseconds >= 0 (``WAGMA_SPIN_US=abc`` failed ``import wagma_comm``
    with a bare ValueError; a negative one was taken silently)."""
    for name, raw in _BAD_ENVIRONMENT.items():
        raise InvalidArgumentError(name, f"expected microseconds >= 0, got {raw!r}")


# Polling policy: spin (yielding the CPU) while requests are outstanding, and
# only after this long without any completion fall back to short sleeps, so a
# rank waiting on a straggler does not burn a core the others need.
_SPIN_S = _microseconds("WAGMA_SPIN_US", "20000")
_MAX_SLEEP_S = 1e-3
# With no collective in flight, only listeners (a partial collective waiting
# for a round's token), the thread spins this long: a long spin there holds
# the GIL against the application thread of its own process (a 1 ms hand-off
# per step measured on 2 cores, docs/partial.md) to catch a token that comes
# once per iteration anyway.
_LISTEN_SPIN_S = _microseconds("WAGMA_LISTEN_SPIN_US", "200")
_SPIN_POLLS = 32  # tests per spin between full turns of the engine
# With a doorbell (transport/doorbell.py) a thread with nothing in flight but
# listeners sleeps this long between turns instead of _MAX_SLEEP_S: a token
# rings it awake, so the limit only bounds how late a deadline is noticed.
_CALM_SLEEP_S = 0.05
_IDLE_WAIT_S = 1.0
# A small non-blocking call does not wake a napping progress thread
# (``submit(wake=LAZY)``): its caller usually waits soon and then runs it
# itself, and on an oversubscribed host the wake-up costs more than the call
# (docs/benchmarks.md). For this long after such a call the idle thread naps
# for at most _LAZY_NAP_S instead of _IDLE_WAIT_S, so it still starts the
# call within that nap when the caller does not wait.
_LAZY_NAP_S = 5e-3
_LAZY_WINDOW_S = 0.1
LAZY = "lazy"  # submit(wake=LAZY)
# How long a small non-blocking call run straight through (Engine._start_here)
# waits on a late peer before the executor takes it over: the thread running
# it (the progress thread, or a waiter driving) serves nothing else meanwhile.
_STRAIGHT_PATIENCE_S = 1e-3
# How long a blocking call waits for the progress thread to finish its turn
# before it queues instead of running inline.
_DRIVER_WAIT_S = 1e-3

# close() waits this long past the latest deadline in flight for the progress
# thread to stop (it fails each collective at its own deadline) before it
# concludes the thread is stuck and fails what is left itself.
CLOSE_GRACE_S = 10.0

NOT_INLINE = object()  # what run_inline returns when the engine was not idle

# Inline runs use a schedule's straight-line form where it is proven safe
# (runtime/straight.py); False keeps every run on the dataflow executor (A/B
# measurements, tests of that executor).
STRAIGHT_LINES = True

_PLAN_CACHE_LIMIT = 4096
_PROGRAM_CACHE_LIMIT = 64  # small schedules (inline runs) with their scratch


@dataclass(slots=True)
class Stage:
    """One schedule to run on ``arrays`` (``"data"`` plus any scratch the caller
    provides; missing scratch is taken from the engine's pool). ``on_done`` runs
    on the progress thread after the last op and may raise to fail the work."""

    schedule: Schedule
    channel: str
    arrays: dict[str, np.ndarray]
    dtype: DType
    on_done: Callable[[], None] | None = None
    label: str | None = None  # what a timeout message calls this stage


@dataclass(slots=True)
class Work:
    """A submitted collective: its stages run one after the other."""

    seq: int
    collective: str
    handle: Handle
    stages: list[Stage]
    deadline: float
    timeout: float
    result: Any = None
    keepalive: Any = None  # the user's buffer, alive until completion
    # Message-identity space of ``seq``: the communicator's own sequence or a
    # persistent collective's rounds (which advance independently).
    space: Any = None
    # Called on the progress thread with (result, error) just before the
    # handle completes: how services learn that a round they started finished.
    on_complete: Callable[[Any, BaseException | None], None] | None = None
    # Groups whose native communicator an earlier Work is still creating: this
    # one may start only once they exist (Communicator._setup_stages).
    requires: tuple[tuple[int, ...], ...] = ()
    creates: tuple[tuple[int, ...], ...] = ()  # groups whose set-up this Work runs
    # A small one-stage Work's inline form (Engine.program): the engine may
    # start it by running it straight through (Engine._start_here).
    program: Program | None = None
    # Its sends ring the peer's doorbell, so the peer's progress thread may
    # sleep while it waits for them (a partial collective's rounds, which a
    # peer may be listening for while its application computes).
    rings: bool = False
    # Nobody waits for it yet (a round started early, partial/base.py): the
    # thread polls it as it polls for tokens, without the long spin, and it
    # has no deadline and no watchdog (dead peers still fail it) until its
    # service sets this False and gives it a fresh deadline.
    patient: bool = False
    # Where ``seq`` is only a message identity (a partial collective's flush
    # or close, numbered by its count of them): the round its errors name
    # (the caller's step count) and the call they say it was ("close()").
    round: int | None = None
    call: str = ""

    def shown(self) -> tuple[int, str]:
        """The round this Work's errors name, and the start of their detail."""
        return (self.seq if self.round is None else self.round,
                f"{self.call}: " if self.call else "")


class Service(Protocol):
    """Something the progress thread drives besides submitted work: the
    persistent partial collectives, which must react to activations that
    arrive while their application thread is busy."""

    def progress(self) -> bool:
        """Do what is due; return True if anything happened. Progress thread."""

    def fail(self, error: WagmaError) -> None:
        """The engine broke or closed: fail everything pending."""

    def busy(self) -> bool:
        """Whether it has operations in flight (the thread then spins as for
        submitted work) rather than only listening."""


class _Run:
    """Execution state of the current stage of one Work."""

    __slots__ = ("work", "stage_index", "stage", "ops", "succ", "remaining", "ready",
                 "completed", "posted", "arrays", "borrowed", "warned")

    def __init__(self, work: Work) -> None:
        self.work = work
        self.warned = False  # the watchdog logged this run already
        self.stage_index = -1
        self.borrowed: list[np.ndarray] = []
        self.ready: deque[int] = deque()
        self.posted: dict[int, Any] = {}

    def enter(self, index: int, plan: Plan,
              arrays: dict[str, np.ndarray]) -> None:
        self.stage_index = index
        self.stage = self.work.stages[index]
        self.ops = self.stage.schedule.ops
        self.succ, indegree, first = plan
        self.remaining = list(indegree)
        self.ready = deque(first)
        self.completed = 0
        self.posted: dict[int, Any] = {}
        self.arrays = arrays


def _naming(where: str, error: TransportError) -> TransportError:
    """``error`` as it reads prefixed by ``where`` (the collective and round it
    broke), its MPI code kept; the message already carries that code."""
    named = TransportError(f"{where}: {error}")
    named.code = error.code
    return named


def _add_program_counts(stats: dict[str, int], program: Program, runs: int) -> None:
    """What ``runs`` inline runs of ``program`` finished add to the counters
    (counted per program, not per call: the per-call path stays lean)."""
    stats["completed"] += runs
    stats["inline"] += runs
    stats["messages_sent"] += runs * program.sends
    stats["bytes_sent"] += runs * program.bytes_sent
    stats["messages_received"] += runs * program.recvs
    stats["bytes_received"] += runs * program.bytes_received
    stats["local_ops"] += runs * program.local_ops


class Engine:
    """Owns the progress thread of one communicator."""

    def __init__(self, transport: Transport, name: str = "wagma-progress",
                 liveness: Liveness | None = None) -> None:
        self._transport = transport
        self._watch = Watch(liveness)
        # ``with self._mutex`` where nothing waits or notifies: the same lock
        # as ``with self._cv`` without the Condition's Python-level methods
        # (four such sections per small non-blocking call).
        self._mutex = threading.RLock()
        self._cv = threading.Condition(self._mutex)
        self._incoming: deque[Work] = deque()
        self._waiting: deque[Work] = deque()  # held back by the sequence window
        # No queued Work is due before this (a lower bound: _expire_waiting
        # scans the queue only once it passed, not on every turn).
        self._waiting_due = float("inf")
        self._active: list[_Run] = []
        self._requests: list[Any] = []
        self._owners: list[tuple[_Run, int]] = []
        self._plans: dict[int, tuple[Schedule, Any]] = {}
        self._programs: dict[tuple[int, str], tuple[Schedule, Program]] = {}
        self._counts_lock = threading.Lock()  # statistics() against the programs' fold
        self._checks_failed = 0  # under _counts_lock: see result_check_failed
        self.generation = 0  # bumped when the programs above are forgotten
        self._pool = ScratchPool()
        # What the test of all outstanding requests fills (None: the transport
        # cannot tell sizes, so receives go unchecked).
        self._statuses: list[Any] | None = transport.statuses(0)
        self._abandoned: list[Any] = []  # buffers of timed-out sends, kept alive
        self._services: list[Service] = []
        self._woken = False
        self._lazy_at = -_LAZY_WINDOW_S  # when the last LAZY submission came
        self._napping_long = False  # the thread sleeps up to _IDLE_WAIT_S
        self._bell = transport.doorbell
        self._bell_sleep = 0.0  # how long the thread sleeps on the bell now (0: not)
        # One thread at a time drives the engine: the progress thread, or an
        # application thread waiting on a handle (drive_until). ``_drivers``
        # counts the latter; the progress thread parks while any are driving.
        self._driver = threading.Lock()
        self._drivers = 0
        self._inline_runs = 0  # inline runs under way (counted as in flight)
        self._stopped = False  # the progress thread has finished: nobody drives
        self._closing = False
        self._cancel_pending = False
        self.broken: WagmaError | None = None
        self._stats = {"completed": 0, "failed": 0, "messages_sent": 0,
                       "messages_received": 0, "bytes_sent": 0, "bytes_received": 0,
                       "local_ops": 0, "polls": 0, "idle_wakeups": 0,
                       "inline": 0, "inline_handed_over": 0, "bell_sleeps": 0,
                       "bell_wakeups": 0}
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    @property
    def watch(self) -> Watch:
        """Deadlines, the watchdog and dead peers: also what the shared-memory
        exchange (runtime/shared.py) checks its own waits with."""
        return self._watch

    # -- application side -----------------------------------------------------
    def alive(self) -> bool:
        return self._thread.is_alive()

    def on_progress_thread(self) -> bool:
        """Whether the caller is the progress thread itself (not a waiter
        driving the engine): the GPU queue calls NCCL only from there."""
        return threading.current_thread() is self._thread

    def submit(self, work: Work, wake: bool | str = True) -> None:
        """Queue work (thread-safe). Order of submission is order of start.
        ``wake=False``: the caller will drive it (drive_until), so the parked
        progress thread is left asleep. ``wake=LAZY``: woken only from a long
        idle wait; otherwise it finds the work after its current nap of at
        most ``_LAZY_NAP_S``, or the caller's wait runs it first."""
        with self._mutex:
            if self._closing:
                raise CommunicatorClosedError("communicator is closed")
            if self.broken is not None:
                raise CommunicatorClosedError(f"communicator is broken: {self.broken}")
            self._incoming.append(work)
            if wake is LAZY:
                self._lazy_at = time.monotonic()
                if self._napping_long:
                    self._cv.notify()
                self._ring_if_asleep(_LAZY_NAP_S)
            elif wake:
                self._notify()

    def wake(self) -> None:
        """Make the progress thread look at its services now (thread-safe)."""
        with self._mutex:
            self._woken = True
            self._notify()

    def wake_if_calm(self) -> None:
        """Wake the progress thread only if it sleeps longer than its usual
        nap (on the doorbell, nothing in flight): something queued without a
        wake-up (a ready publish) is then still seen within ``_MAX_SLEEP_S``."""
        with self._mutex:
            self._ring_if_asleep(_MAX_SLEEP_S)

    def _notify(self) -> None:
        """(under ``_mutex``) Wake the progress thread from whichever sleep:
        its condition wait, or its doorbell."""
        self._cv.notify()
        self._ring_if_asleep(0.0)

    def _ring_if_asleep(self, longer_than: float) -> None:
        """(under ``_mutex``) Ring our own bell if the thread sleeps on it for
        longer than ``longer_than`` seconds."""
        if self._bell_sleep > longer_than:
            self._bell_sleep = 0.0  # one ring is enough
            assert self._bell is not None
            self._bell.ring_self()

    def ring(self, peer: int) -> None:
        """Wake ``peer``'s progress thread (a service sent it a message it may
        be sleeping for); nothing without doorbells."""
        if self._bell is not None:
            self._bell.ring(peer)

    def add_service(self, service: Service) -> None:
        """Have the progress thread call ``service.progress()`` every turn."""
        with self._mutex:
            if self._closing or self.broken is not None:
                raise CommunicatorClosedError("communicator is closed or broken")
            self._services = self._services + [service]
            self._notify()

    def remove_service(self, service: Service) -> None:
        with self._mutex:
            self._services = [s for s in self._services if s is not service]

    # -- progress-thread side, for services -----------------------------------
    def start(self, work: Work) -> None:
        """Queue work from the progress thread itself (a service's round)."""
        self._waiting.append(work)
        self._waiting_due = min(self._waiting_due, work.deadline)

    def post(self, request: Any, callback: Callable[[], None]) -> None:
        """Poll ``request`` with everything else; call ``callback`` (progress
        thread) once it completes. For a service's own messages."""
        self._requests.append(request)
        self._owners.append((None, callback))

    def cancel_posted(self, callback: Callable[[], None]) -> None:
        """Cancel the receive posted with ``callback`` (a listener)."""
        for k, owner in enumerate(self._owners):
            if owner[0] is None and owner[1] == callback:
                self._transport.cancel_recv(self._requests[k])
                del self._requests[k]
                del self._owners[k]
                return

    def close(self, cancel: bool = False, timeout: float | None = None) -> list[str]:
        """Stop the thread: drain in-flight work (each has a finite deadline), or
        fail it with CommunicatorClosedError when ``cancel``.

        ``timeout``: wait at most that long (the exit drain, whose caller
        cancels what is left). None: wait until the latest deadline in flight
        (a per-call timeout may exceed the communicator's) plus
        CLOSE_GRACE_S; a thread still running then is stuck, so what is left
        fails here (:meth:`_give_up`). Returns the collectives failed that
        way, e.g. ``["allreduce (round 3)"]``; [] normally."""
        with self._mutex:
            self._closing = True
            self._cancel_pending = cancel
            self._notify()
        if timeout is not None:
            self._thread.join(timeout)
            return []
        give_up = time.monotonic() + CLOSE_GRACE_S
        while self._thread.is_alive():
            give_up = max(give_up, self._latest_deadline() + CLOSE_GRACE_S)
            left = give_up - time.monotonic()
            if left <= 0:
                return self._give_up()
            self._thread.join(min(left, 0.5))
        return []

    def _works(self) -> list[Work]:
        """Every Work queued or in flight (any thread: copies made in C, under
        ``_mutex`` so none is between the submission queue and the next)."""
        with self._mutex:
            return ([run.work for run in list(self._active)] + list(self._waiting)
                    + list(self._incoming))

    def _latest_deadline(self) -> float:
        return max((work.deadline for work in self._works()), default=0.0)

    def _give_up(self) -> list[str]:
        """close(): the thread is still running past every deadline plus the
        grace (stuck in a call). Fail what is left from this thread, so no
        waiter hangs, and have the thread cancel it too should it resume."""
        with self._mutex:
            self._cancel_pending = True
            self._notify()
        failed: list[str] = []
        for work in self._works():
            if not work.handle.done:
                name = f"{work.collective} (round {work.seq})"
                work.handle._complete(None, CommunicatorClosedError(
                    f"{name}: still in flight {CLOSE_GRACE_S:g} s after its deadline, when "
                    "close() gave up on it (the progress thread did not stop)"))
                failed.append(name)
        return failed

    def abandoned(self) -> list[Any]:
        """The buffers of calls given up on with requests outstanding (MPI may
        still read or write them); for close(), once the thread stopped."""
        return list(self._abandoned)

    def in_flight(self) -> int:
        """Collectives submitted and not finished (thread-safe enough: lengths)."""
        return (len(self._active) + len(self._incoming) + len(self._waiting)
                + self._inline_runs)

    def statistics(self) -> dict[str, int]:
        with self._counts_lock:  # not between a fold and the clear that follows it
            stats = dict(self._stats)
            for _, program in list(self._programs.values()):
                _add_program_counts(stats, program, program.runs)
            stats["completed"] -= self._checks_failed
            stats["failed"] += self._checks_failed
        stats["in_flight"] = self.in_flight()
        stats["doorbell"] = self._bell is not None
        stats["bell_rings"] = self._bell.rings if self._bell is not None else 0
        return stats

    def result_check_failed(self) -> None:
        """A blocking call counted completed where it ran (inline, or the
        shared-memory exchange) failed its result check on the caller's
        thread (NaN in max/min): count it failed, as the engine counts such
        a Work. Thread-safe; off the fast path (which has no check)."""
        with self._counts_lock:
            self._checks_failed += 1

    def _fold_program_counts(self) -> None:
        """Move the programs' run counts into the engine's own (before the
        programs are forgotten)."""
        for _, program in self._programs.values():
            _add_program_counts(self._stats, program, program.runs)
            program.runs = 0

    # -- progress thread ------------------------------------------------------
    def _main(self) -> None:
        """The progress thread. Anything escaping the loop (a bug) breaks the
        engine, so every waiter fails at once instead of at its deadline."""
        try:
            self._loop()
        except BaseException as exc:
            if self._driver.acquire(timeout=5.0):
                try:
                    self._break(TransportError(f"progress thread failed: {exc!r}"))
                finally:
                    self._driver.release()
            self._stopped = True
            raise

    def _loop(self) -> None:
        idle_since = time.monotonic()
        sleep_s = 0.0
        while True:
            # Take the lock only when there is something to take or nothing to
            # do; a spin iteration with work in flight and none arriving skips it.
            busy = self._active or self._waiting or self._services
            if self._incoming or self._closing or not busy or self._drivers:
                waited = False
                with self._mutex:
                    while ((self._drivers or not (self._incoming or self._active
                                                  or self._waiting or self._services))
                           and not self._closing):
                        lazy = time.monotonic() - self._lazy_at < _LAZY_WINDOW_S
                        self._napping_long = not lazy
                        self._cv.wait(_LAZY_NAP_S if lazy else _IDLE_WAIT_S)
                        self._napping_long = False
                        self._stats["idle_wakeups"] += 1
                        waited = True
                    closing, cancel = self._closing, self._cancel_pending
                if closing:
                    with self._driver:
                        self._take_incoming()
                        if cancel:
                            self._fail_all(CommunicatorClosedError(
                                "communicator closed while in flight"))
                        if self._services:
                            self._stop_services(CommunicatorClosedError("communicator closed"))
                        self._fail_patient()
                        if not self._active and not self._waiting:
                            self._stopped = True  # no driver may touch the transport now
                            return
                if waited:  # back from a nap: spin again before backing off
                    idle_since = time.monotonic()
            with self._driver:
                progressed = self._turn()
            if progressed:
                idle_since, sleep_s = time.monotonic(), 0.0
            elif self._keep_spinning(time.monotonic() - idle_since):
                os.sched_yield()  # releases the GIL and lets a peer rank run
            else:
                sleep_s = min(_MAX_SLEEP_S, max(2 * sleep_s, 20e-6))
                self._nap(sleep_s)

    def _nap(self, sleep_s: float) -> None:
        """Sleep between turns: ``sleep_s``, cut short by a submission or
        wake(); on the doorbell, also by a peer's ring, and longer while only
        listeners wait (_CALM_SLEEP_S)."""
        if self._bell is None:
            with self._mutex:
                if not self._incoming and not self._woken:
                    self._cv.wait(sleep_s)
                self._woken = False
            return
        if self._calm() and time.monotonic() - self._lazy_at >= _LAZY_WINDOW_S:
            sleep_s = _CALM_SLEEP_S
        with self._mutex:
            asleep = not self._incoming and not self._woken
            self._woken = False
            self._bell_sleep = sleep_s if asleep else 0.0
        if asleep:
            self._stats["bell_sleeps"] += 1
            self._stats["bell_wakeups"] += self._bell.sleep(sleep_s)
            with self._mutex:
                self._bell_sleep = 0.0

    def _calm(self) -> bool:
        """Nothing in flight but the services' listening (their posted token
        receives and small token sends, which need no progress from us to
        finish): every message that could matter rings."""
        return not (self._active or self._waiting or self._incoming
                    or any(service.busy() for service in self._services))

    def _fail_patient(self) -> None:
        """Closing: a round nobody waited for (``Work.patient``) has no
        deadline, and its service is gone, so nobody ever will: fail it
        rather than drain it forever."""
        for run in [r for r in self._active if r.work.patient]:
            self._finish(run, error=CommunicatorClosedError(
                "communicator closed before every member started this round"))

    def _keep_spinning(self, idle_s: float) -> bool:
        """Whether the thread, ``idle_s`` seconds without progress, spins on:
        for ``_LISTEN_SPIN_S`` in any case, up to ``_SPIN_S`` while work
        somebody waits for (not ``patient``) and no doorbell announces
        (:meth:`_spin_for`), or a service's is in flight (not just listeners
        waiting for a token). The services are asked only after the short
        window."""
        if idle_s < _LISTEN_SPIN_S:
            return True
        return idle_s < _SPIN_S and bool(
            self._waiting or any(self._spin_for(run.work) for run in self._active)
            or any(service.busy() for service in self._services))

    def _spin_for(self, work: Work) -> bool:
        """Whether waiting for ``work``'s messages is worth a spin: someone
        waits for it, and no ring will wake us when they come."""
        return not work.patient and not (work.rings and self._bell is not None)

    def _take_incoming(self) -> None:
        if self._incoming:
            with self._mutex:
                self._waiting.extend(self._incoming)
                self._waiting_due = min(self._waiting_due,
                                        min(work.deadline for work in self._incoming))
                self._incoming.clear()

    def _turn(self) -> bool:
        """One pass over everything the engine drives; the caller holds
        ``_driver``. Returns True if anything happened."""
        progressed = False
        try:
            self._take_incoming()
            for service in self._services:
                progressed |= self._drive(service)
            progressed |= self._start_waiting()
            for run in list(self._active):
                progressed |= self._advance(run)
            progressed |= self._poll()
        except TransportError as exc:
            self._transport_failed(exc)
            return True
        self._check_deadlines()
        return progressed

    def drive_until(self, handle: Handle, until: float) -> None:
        """Run the engine on the calling (waiting) thread until ``handle``
        completes, ``until`` (monotonic) passes, or nothing progressed for a
        spin period; then the progress thread takes over again.

        Why: a blocking collective handed to the progress thread pays two
        thread wake-ups and GIL hand-offs, which dominate small messages on a
        loaded machine. Lending the waiting thread keeps a single issuer (the
        ``_driver`` lock) and the same submission order, as MPI libraries do
        when the waiter drives progress.
        """
        if handle.done or threading.get_ident() == self._thread.ident:
            return
        self._start_if_first(handle)  # its own small call, queued alone
        if handle.done:
            return
        registered = False
        try:
            with self._mutex:
                if self._closing or self._stopped:
                    return
                self._drivers += 1
                registered = True
            idle_since = time.monotonic()
            while not handle.done:
                progressed = self._drive_once(self._turn)
                now = time.monotonic()
                if progressed:
                    idle_since = now
                elif now - idle_since > _SPIN_S or now > until:
                    return
                elif self._drive_once(self._spin_poll):
                    idle_since = now
        finally:
            if registered:
                with self._mutex:
                    self._drivers -= 1
                    if self._active or self._waiting or self._incoming or self._services:
                        self._notify()  # work remains in flight: the thread resumes

    # -- inline runs: small blocking collectives -------------------------------
    def run_inline(self, program: Program, data: np.ndarray, seq: int,
                   deadline: float, work_of: Callable[..., Work],
                   work_args: tuple[Any, ...]) -> Handle | None | object:
        """Run a collective (``program``, from :meth:`program`, over ``data``
        on the data channel) on the calling thread if the engine is idle:
        nothing queued or in flight (services may listen). Returns NOT_INLINE (having
        done nothing) if it is not; None when the run finished here; or the
        Handle of the Work (``work_of(*work_args)``: one stage, that
        schedule; made only then) it handed to the engine because a peer was
        late. Raises the collective's error (a timeout breaks the engine, as
        in the engine itself). Call it under the communicator's submission
        lock, so no later collective can start first; it holds the driver
        lock while it runs and releases it whatever happens."""
        # With nothing queued or in flight (a partial collective may listen),
        # the progress thread holds the driver only for a turn (tens of us):
        # worth waiting for. Otherwise the call queues behind that work.
        if not self._driver.acquire(blocking=False) and (
                self._incoming or self._waiting or self._active
                or not self._driver.acquire(timeout=_DRIVER_WAIT_S)):
            return NOT_INLINE
        # Read without _cv: submissions append under the communicator's lock
        # (held by our caller) and the progress thread's under _driver (ours
        # now); a service added meanwhile just waits for the release.
        if (self._incoming or self._waiting or self._active or self._closing
                or self._stopped or self.broken is not None):
            self._driver.release()
            return NOT_INLINE
        # A service (a partial collective listening for tokens) is not polled
        # while this runs: hand over after _STRAIGHT_PATIENCE_S, as a small
        # non-blocking call does, rather than after the full spin. With no
        # work in flight its posted listeners are the only requests.
        patience = _STRAIGHT_PATIENCE_S if self._services or self._requests else _SPIN_S
        try:
            late = self._run_here(program, data, seq, deadline, patience, work_of, work_args)
            if late is None:
                program.runs += 1  # counted by statistics(): the per-call path stays lean
            return late
        finally:
            self._driver.release()

    def _run_here(self, program: Program, data: np.ndarray, seq: int, deadline: float,
                  patience: float, work_of: Callable[..., Work],
                  work_args: tuple[Any, ...]) -> Handle | None:
        """The body of :meth:`run_inline`, with ``_driver`` held: run
        ``program`` here, handing it to the engine once a wait took longer
        than ``patience``. None when done (the caller counts the run), else
        the engine's Handle. Counted in flight meanwhile (``_inline_runs``)."""
        state: ProgramRun | None = None
        run: _Run | None = None
        line: StraightLine | None = None
        schedule = program.schedule
        self._inline_runs += 1
        try:
            line = program.line
            if line is not None:
                if program.scratch is None:
                    program.prepare()
                stopped = line.run(data, seq, deadline, patience)
                if stopped is None:
                    return None
                outcome, point = stopped
                state, line = line.state(data, point), None
            else:
                state = program.start(data)
                outcome = state.execute(self._transport, CHANNEL_DATA, seq, deadline, patience)
                if outcome == DONE:
                    state = None
                    return None
            work = work_of(*work_args)
            if outcome == EXPIRED:
                self._retire_tested(state)
                error = timeout_error(work, work.stages[0], schedule.ops,
                                      state.posted(self._transport))
                self.broken = self.broken or error
                raise error
            # The engine goes on with the program's scratch: the next inline
            # run of this program gets fresh arrays.
            arrays = program.arrays(state.data)
            program.drop_scratch()
            run = _Run(work)
            run.enter(0, program.plan, arrays)
            run.remaining, run.completed = state.remaining, state.completed
            run.ready = deque(state.ready[state.pos:])
            run.posted = state.posted(self._transport)
            self._active.append(run)
            for i, req in run.posted.items():
                self._requests.append(req)
                self._owners.append((run, i))
            self._stats["inline_handed_over"] += 1
            handle, run = work.handle, None  # handed over: the engine owns it now
            with self._mutex:
                self._notify()  # the progress thread goes on if no one drives
            return handle
        except BaseException as exc:
            if line is not None and state is None:  # the straight line raised
                state = line.state(data, None)
            failure = self._inline_failed(exc, schedule, state, run, work_of, work_args)
            if failure is exc:
                raise
            raise failure from exc
        finally:
            self._inline_runs -= 1
            if state is not None:
                sent, bytes_sent, received, bytes_received, local = state.counts()
                stats = self._stats
                stats["messages_sent"] += sent
                stats["bytes_sent"] += bytes_sent
                stats["messages_received"] += received
                stats["bytes_received"] += bytes_received
                stats["local_ops"] += local

    def _retire_tested(self, state: ProgramRun) -> None:
        """An inline run expired: drop from ``state`` the requests that
        completed but were not tested yet (a straight line's test of a whole
        wait completes none until all did), so the timeout names only the
        ranks still missing and nothing completed is cancelled. A failing
        test leaves ``state`` as it is: the error is the timeout's."""
        try:
            done = self._transport.test_some(list(state.requests))
        except TransportError:
            return
        if done:
            state.retire(done)

    def nudge(self, handle: Handle) -> None:
        """Handle.test() of an unfinished ``handle``: one turn of the engine
        on the testing thread, if no one else is driving (as MPI_Test
        progresses), after starting ``handle``'s own small call if it is
        queued alone. Why: a thread polling test() in a loop holds the GIL,
        and the progress thread got it only every switch interval (5 ms):
        a polled 8-byte allreduce took 10 ms at 2 ranks and 67 ms at 8
        (bench/results/async-small-8.txt)."""
        if threading.get_ident() == self._thread.ident:
            return
        self._start_if_first(handle)
        if not handle.done and not self._drive_once(self._turn):
            # Nothing moved: give the core to a peer, as a waiter's polls do.
            # Without it, a polling loop at 8 ranks on 2 cores made a 64 KiB
            # allreduce take 19.5 ms instead of 0.9.
            os.sched_yield()

    def _start_if_first(self, handle: Handle) -> None:
        """Start ``handle``'s work here (:meth:`_start_first`) if it is first
        in the submission queue (read without the lock: a driver may empty
        the queue meanwhile)."""
        try:
            first = self._incoming[0].handle is handle
        except IndexError:
            return
        if first:
            self._drive_once(self._start_first)

    def _start_first(self) -> bool:
        """drive_until's shortcut for the waiter of the only work queued (a
        small non-blocking call, waited on before anything else came): start
        it here, as a turn would, without the turn's other checks."""
        if (self._active or self._waiting or self._services or self._requests
                or self._closing or self.broken is not None):
            return False
        with self._mutex:
            if len(self._incoming) != 1 or self._incoming[0].program is None:
                return False
            work = self._incoming.popleft()
        self._start_here(work)
        return True

    def _start_here(self, work: Work) -> None:
        """Start ``work`` (one small stage with a straight line, taken off
        ``_waiting``) by running it here, with ``_driver`` held: a small
        non-blocking collective then costs what a blocking one does instead
        of the dataflow executor's turns. A wait longer than
        ``_STRAIGHT_PATIENCE_S`` hands it to the executor, so other work waits
        at most that long. Unless handed over, its handle is completed
        whatever happens (a Ctrl-C on a driving waiter is raised after)."""
        stage = work.stages[0]
        result: Any = None
        error: BaseException | None = None
        handed_over = ran = False
        try:
            handed_over = self._run_here(
                work.program, stage.arrays[DATA], work.seq, work.deadline,
                _STRAIGHT_PATIENCE_S, lambda: work, ()) is not None
            if handed_over:
                return  # the executor goes on with it (and runs on_done)
            # Counted now, not in program.runs: the engine may have forgotten
            # the program since the work was queued (its runs would be lost).
            _add_program_counts(self._stats, work.program, 1)
            ran = True
            if stage.on_done is not None:
                stage.on_done()
            result = work.result
        except BaseException as exc:  # the collective's error, for its waiter
            error = exc if isinstance(exc, WagmaError) else TransportError(
                f"{work.collective} (round {work.seq}): {type(exc).__name__}: {exc}")
            if ran:  # failed by its check, as the executor counts it
                self._stats["completed"] -= 1
                self._stats["failed"] += 1
            if not isinstance(exc, Exception):
                raise  # Ctrl-C on a driving waiter stays Ctrl-C (after the finally)
        finally:
            if not handed_over:
                self._complete_work(work, result, error)

    def program(self, schedule: Schedule, dtype: DType) -> Program:
        """The inline form of ``schedule`` over ``dtype`` (made once and
        cached). A caller may keep it while :attr:`generation` is unchanged;
        afterwards the engine no longer counts its runs."""
        key = (id(schedule), dtype.name)
        cached = self._programs.get(key)
        if cached is None or cached[0] is not schedule:
            if len(self._programs) >= _PROGRAM_CACHE_LIMIT:  # each holds its scratch
                with self._counts_lock:
                    self._fold_program_counts()
                    self._programs.clear()
                self.generation += 1
            program = Program(schedule, dtype, self._transport, self._plan_of(schedule))
            if STRAIGHT_LINES and straight_safe(schedule):
                program.line = StraightLine(program, straight_order(schedule),
                                            self._transport, CHANNEL_DATA)
            cached = (schedule, program)
            self._programs[key] = cached
        return cached[1]

    def _inline_failed(self, exc: BaseException, schedule: Schedule, state: ProgramRun | None,
                       run: _Run | None, work_of: Callable[..., Work],
                       work_args: tuple[Any, ...]) -> BaseException:
        """The error an inline run raises, with the engine left consistent:
        outstanding requests dropped (cancelled unless a peer died), the
        buffers MPI may still touch kept alive, and the engine broken when
        messages of the abandoned round may still arrive (they would match a
        round one sequence window later)."""
        if run is not None:  # interrupted half-way through the hand-over
            if run in self._active:
                self._active.remove(run)
            self._forget_requests(run)
        failure: BaseException = exc
        broken: WagmaError | None = None
        communicated = state is not None and state.issued_any_message()
        work = work_of(*work_args)
        if isinstance(exc, TransportError):
            # Named as the call the user made: the executors know only the
            # schedule (a group_allreduce's is "allreduce"), and MPI's own
            # errors (a failed native call) named no collective at all.
            if isinstance(exc, MessageSizeError):
                if exc.collective != work.collective:
                    failure = MessageSizeError(work.collective, exc.round, exc.ranks[0],
                                               exc.expected, exc.received)
            elif not isinstance(exc, CollectiveError):
                failure = _naming(f"{work.collective} (round {work.seq})", exc)
            broken = failure  # type: ignore[assignment]
            dead = self._watch.dead_among(schedule.ranks, settle=True)
            if dead is not None:  # MPI's error is how the death showed
                failure = broken = dead(work.collective, work.seq)
        elif isinstance(exc, RankFailedError):
            broken = exc
        elif not isinstance(exc, WagmaError) and communicated:
            broken = TransportError(f"{work.collective} (round {work.seq}): an inline "
                                    f"collective was interrupted: {exc!r}")
            if isinstance(exc, Exception):  # a bug: report it as the transport's
                failure = broken
        if state is not None:
            if communicated:  # MPI may still touch them
                self._abandoned.append(state.program.arrays(state.data))
                state.program.drop_scratch()
            self._drop(state.posted(self._transport), failure)
            state.data = None  # the program keeps its run state: not the caller's buffer
        self._stats["failed"] += 1
        if broken is not None:
            self._break(broken)
        return failure  # Ctrl-C stays Ctrl-C for the caller

    def _drive_once(self, step: Callable[[], bool]) -> bool:
        """Run ``step`` (a turn or a spin-poll) if no one else is driving.

        An exception that escapes it on an application thread (Ctrl-C, a
        callback's bug) may leave a half-retired request behind, so it breaks
        the engine: every in-flight handle fails at once instead of hanging."""
        if not self._driver.acquire(blocking=False):
            os.sched_yield()
            return False
        try:
            if self._stopped:
                return False
            return step()
        except BaseException as exc:
            if not isinstance(exc, TransportError):
                self._break(TransportError(
                    f"engine interrupted while driven by a waiting thread: {exc!r}"))
            raise
        finally:
            self._driver.release()

    def _drive(self, service: Service) -> bool:
        """One turn of a service; a bug in it fails that service, loudly, and
        never kills the progress thread the other collectives depend on."""
        try:
            return service.progress()
        except TransportError:
            raise  # the transport itself failed: the main loop breaks everything
        except Exception as exc:  # noqa: BLE001 -- reported to the service's callers
            self.remove_service(service)
            service.fail(WagmaError(f"internal error in {type(service).__name__}: "
                                    f"{type(exc).__name__}: {exc}"))
            return True

    def _start_waiting(self) -> bool:
        started = False
        window = self._transport.seq_window
        while self._waiting:
            work = self._waiting[0]
            if self._active and work.seq - min(
                    (r.work.seq for r in self._active if r.work.space == work.space),
                    default=work.seq) >= window:
                break  # would reuse a live message identity: wait
            if work.creates and self._creating():
                break  # set-ups run in call order (see _creating)
            if work.requires and not all(map(self._transport.has_group, work.requires)):
                if self._setup_pending(work.requires):
                    break  # its group's communicator is still being created: wait
                self._waiting.popleft()  # the set-up failed in an earlier collective
                self._fail_queued(work, CollectiveError(
                    work.collective, work.seq, (),
                    "its group's communicator was never created: the earlier collective "
                    "that set it up failed"))
                continue
            self._waiting.popleft()
            started = True
            if work.program is not None and not self._active and self.broken is None:
                self._start_here(work)
                continue
            run = _Run(work)
            self._active.append(run)
            self._enter_stage(run, 0)
        return started

    def _creating(self) -> list[_Run]:
        """The started collectives still setting up a group. A set-up ends in
        a blocking MPI_Comm_create_group over the group: started out of call
        order, two ranks could each block in a different group's creation,
        waiting for a peer blocked in a third (a cycle no deadline ends). One
        at a time, in the call order every rank shares, no cycle can form."""
        has_group = self._transport.has_group
        return [run for run in self._active
                if run.work.creates and not all(map(has_group, run.work.creates))]

    def _setup_pending(self, groups: tuple[tuple[int, ...], ...]) -> bool:
        """True if a started Work still runs the set-up of every missing group."""
        creating = {g for run in self._active for g in run.work.creates}
        return all(self._transport.has_group(g) or g in creating for g in groups)

    def _enter_stage(self, run: _Run, index: int) -> None:
        stage = run.work.stages[index]
        arrays, borrowed = self._arrays_for(stage)
        run.borrowed.extend(borrowed)
        run.enter(index, self._plan_of(stage.schedule), arrays)
        if not stage.schedule.ops:
            self._stage_done(run)

    def _plan_of(self, sched: Schedule) -> Plan:
        cached = self._plans.get(id(sched))
        if cached is None or cached[0] is not sched:
            if len(self._plans) >= _PLAN_CACHE_LIMIT:  # bounded: many sizes over a job
                self._plans.clear()
            cached = (sched, plan(sched))
            self._plans[id(sched)] = cached
        return cached[1]

    def _arrays_for(self, stage: Stage) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
        """The stage's arrays plus pooled scratch for what it did not provide."""
        arrays = dict(stage.arrays)
        borrowed: list[np.ndarray] = []
        for name, count in stage.schedule.scratch:
            if name not in arrays:
                arr = self._pool.take(stage.dtype.storage, count)
                borrowed.append(arr)
                arrays[name] = arr
        return arrays, borrowed

    def _advance(self, run: _Run) -> bool:
        """Issue every ready op of ``run``; local ops run here and now."""
        if not run.ready or run.work.handle.done:
            return False
        transport, stats = self._transport, self._stats
        seq, channel, dtype = run.work.seq, run.stage.channel, run.stage.dtype
        while run.ready and run.stage_index >= 0:
            i = run.ready.popleft()
            op = run.ops[i]
            try:
                request = post(op, run.arrays, dtype, transport, channel, seq)
                if request is None:
                    run_local(op, run.arrays, dtype)
                    stats["local_ops"] += 1
                    self._op_done(run, i)
                    continue
                self._post(run, i, request)
                if isinstance(op, Send):
                    if run.work.rings:
                        self.ring(op.peer)
                    stats["messages_sent"] += 1
                    stats["bytes_sent"] += op.src.count * dtype.itemsize
            except TransportError:
                raise
            except WagmaError as exc:
                self._finish(run, error=exc)
                return True
            except Exception as exc:  # a kernel or MPI binding failure: fail this work
                self._finish(run, error=TransportError(
                    f"{run.work.collective} (round {seq}): {type(exc).__name__}: {exc}"))
                return True
        return True

    def _post(self, run: _Run, index: int, request: Any) -> None:
        run.posted[index] = request
        self._requests.append(request)
        self._owners.append((run, index))

    def _poll(self) -> bool:
        if not self._requests:
            return False
        self._stats["polls"] += 1
        done = self._test_some(self._requests)
        if not done:
            return False
        self._retire(done)
        return True

    def _spin_poll(self) -> bool:
        """Between full turns: only test the outstanding requests, yielding the
        CPU between tests. A full turn costs tens of microseconds of Python; a
        test costs one MPI call, and on an oversubscribed machine the CPU a
        waiting rank does not burn is what its peers need to reach us."""
        requests = self._requests
        if not requests:
            return False
        try:
            for _ in range(_SPIN_POLLS):
                os.sched_yield()
                done = self._test_some(requests)
                if done:
                    self._stats["polls"] += 1
                    self._retire(done)
                    return True
                if self._incoming:
                    return False
        except TransportError as exc:  # as a turn handles it
            self._transport_failed(exc)
            return True
        return False

    def _test_some(self, requests: list[Any]) -> list[int]:
        """The transport's test of ``requests`` (filling ``_statuses``), a
        truncated receive reported as the MessageSizeError of its run."""
        try:
            return self._transport.test_some(requests, self._statuses)
        except TransportError as exc:
            tag = self._transport.tag
            receives = [(k, run.ops[i].peer, tag(run.work.seq, run.ops[i].msg))
                        for k, (run, i) in enumerate(self._owners)
                        if run is not None and type(run.ops[i]) is Recv]
            found = overlong_receive(self._transport, exc, self._statuses or [], receives)
            if found is None:
                if isinstance(exc, CollectiveError):
                    raise
                # MPI does not say whose request failed (a native call's):
                # name what was in flight, since every one of them fails now.
                runs = list(dict.fromkeys(run for run, _ in self._owners if run is not None))
                names = ", ".join(f"{run.work.collective} (round {run.work.seq})"
                                  for run in runs)
                if not runs:
                    raise
                raise _naming(names if len(runs) == 1 else f"one of {names}", exc) from exc
            run, i = self._owners[found]
            raise self._size_error(run, i, None) from exc

    def _size_error(self, run: _Run, index: int, received: int | None) -> MessageSizeError:
        op = run.ops[index]
        return MessageSizeError(run.work.collective, run.work.seq, op.peer,
                                op.dst.count * run.stage.dtype.itemsize, received)

    def _retire(self, done: list[int]) -> None:
        # Sizes first (MPI accepts a short message silently), then compact:
        # retiring an op can finish or fail a run, which edits the request
        # lists itself.
        statuses = self._statuses
        if statuses is not None:
            size = self._transport.received_bytes
            for j, idx in enumerate(done):  # statuses come in this order
                run, i = self._owners[idx]
                if run is not None and type(run.ops[i]) is Recv:
                    received = size(statuses[j])
                    if received != run.ops[i].dst.count * run.stage.dtype.itemsize:
                        raise self._size_error(run, i, received)
        finished = set(done)
        completions = [self._owners[idx] for idx in done]
        keep = [k for k in range(len(self._owners)) if k not in finished]
        self._requests = [self._requests[k] for k in keep]
        self._owners = [self._owners[k] for k in keep]
        for run, i in completions:
            if run is None:
                try:
                    i()  # a service's request
                except Exception as exc:  # noqa: BLE001 -- a service bug: fail, loudly
                    self._break(TransportError(
                        f"handler of a service message failed: {type(exc).__name__}: {exc}"))
                    return True
                continue
            if run.posted.pop(i, None) is None:
                continue  # its run already failed
            op = run.ops[i]
            if isinstance(op, Recv):
                self._stats["messages_received"] += 1
                self._stats["bytes_received"] += op.dst.count * run.stage.dtype.itemsize
            self._op_done(run, i)

    def _op_done(self, run: _Run, index: int) -> None:
        run.completed += 1
        remaining, ready = run.remaining, run.ready
        for s in run.succ[index]:
            remaining[s] -= 1
            if remaining[s] == 0:
                ready.append(s)
        if run.completed == len(run.ops):
            self._stage_done(run)

    def _stage_done(self, run: _Run) -> None:
        stage = run.stage
        if stage.on_done is not None:
            try:
                stage.on_done()
            except WagmaError as exc:
                self._finish(run, error=exc)
                return
            except Exception as exc:  # noqa: BLE001 -- e.g. MPI failing to create a group
                self._finish(run, error=TransportError(
                    f"{run.work.collective} (round {run.work.seq}): "
                    f"{type(exc).__name__}: {exc}"))
                return
        if run.stage_index + 1 < len(run.work.stages):
            self._enter_stage(run, run.stage_index + 1)
        else:
            self._finish(run, result=run.work.result)

    def _finish(self, run: _Run, result: Any = None, error: BaseException | None = None) -> None:
        if run in self._active:
            self._active.remove(run)
        if run.posted:  # failed with requests outstanding: drop them
            self._drop(run.posted, error)
            self._abandoned.append(run.work.keepalive)
            self._abandoned.extend(run.borrowed)
            # And every array of the stage: one an inline run handed over
            # receives into its program's scratch, which is not borrowed.
            self._abandoned.extend(run.arrays.values())
            self._forget_requests(run)
        else:
            for arr in run.borrowed:
                self._pool.give(arr)
        run.stage_index = -1
        run.ready.clear()
        self._stats["completed" if error is None else "failed"] += 1
        self._complete_work(run.work, result, error)

    def _complete_work(self, work: Work, result: Any, error: BaseException | None) -> None:
        """Tell ``work``'s service (on_complete), then its handle. A callback
        that raises (a bug) still completes the handle, with that failure:
        the engine breaks on it, and the Work is no longer in flight, so no
        waiter would ever be woken."""
        try:
            if work.on_complete is not None:
                work.on_complete(result, error)
        except BaseException as exc:
            if error is None:
                result, error = None, TransportError(
                    f"{work.collective} (round {work.seq}): its completion callback "
                    f"failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            work.handle._complete(result, error)

    def _drop(self, posted: dict[int, Any], error: BaseException | None) -> None:
        """Give up the outstanding requests of a failed run. They are cancelled,
        except when a peer died: MPICH crashes cancelling requests to a dead
        process (seen: SIGSEGV in MPI_Cancel), and nothing will use this
        communicator again anyway."""
        if not isinstance(error, RankFailedError):
            for req in posted.values():
                self._transport.abandon(req)
        posted.clear()

    def _forget_requests(self, run: _Run) -> None:
        keep = [k for k, owner in enumerate(self._owners) if owner[0] is not run]
        self._requests = [self._requests[k] for k in keep]
        self._owners = [self._owners[k] for k in keep]

    def _fail_queued(self, work: Work, error: WagmaError) -> None:
        """Fail a Work that never started (it is no longer queued); its
        service learns it as from a Work that failed in flight."""
        self._stats["failed"] += 1
        self._complete_work(work, None, error)

    def _check_deadlines(self) -> None:
        """Timeouts, the watchdog and dead peers (runtime/watch.py). Both
        break the communicator: late messages of an abandoned round could
        match a later one, and a dead rank never comes back."""
        if self._waiting:
            self._expire_waiting()
        if not self._active:
            return
        dead = None
        for run, error in self._watch.scan(list(self._active)):
            self._finish(run, error=error)
            self.broken = self.broken or error
            if isinstance(error, RankFailedError):
                dead = error
        if dead is not None:
            self._break(dead)

    def _expire_waiting(self) -> None:
        """Queued work past its own deadline (every one's: work behind the
        head may have a shorter timeout) fails, and breaks the communicator
        as an in-flight timeout does: it was never posted, so a peer's
        matching native call would be matched by this rank's next one. Work
        queued after it fails too, for the same reason; work before it may
        still start, in order."""
        now = time.monotonic()
        if now <= self._waiting_due:
            return
        expired, due = None, float("inf")
        for k, work in enumerate(self._waiting):
            if now > work.deadline and not work.patient:
                expired = k
                break
            due = min(due, work.deadline)  # a patient Work's only grows
        self._waiting_due = due  # of the Works before ``expired``: all that stay
        if expired is None:
            return
        work = self._waiting[expired]
        error = self._queued_timeout(work)
        self.broken = self.broken or error
        later = [self._waiting.pop() for _ in range(expired, len(self._waiting))]
        later.reverse()  # submission order: ``work`` first
        self._fail_queued(work, error)
        for behind in later[1:]:
            self._fail_queued(behind, CommunicatorClosedError(
                f"{behind.collective} (round {behind.seq}): not started: the communicator "
                f"broke before it could start, queued behind {work.collective} "
                f"(round {work.seq}), which timed out unposted"))

    def _queued_timeout(self, work: Work) -> CollectiveTimeoutError:
        """The timeout of ``work``, which never left the queue: it names the
        ranks that the collectives holding up the queue's head still wait
        for (only the head is held by a started collective; the rest wait
        behind it)."""
        blockers = self._blockers(self._waiting[0])
        ranks = sorted({r for run in blockers
                        for r in waiting_ranks(run.stage.schedule.rank, run.ops, run.posted)})
        behind = ", ".join(f"{run.work.collective} (round {run.work.seq}) in its "
                           f"{stage_phase(run.stage)}" for run in blockers)
        why = (f"it was queued behind {behind}" if behind else
               "it was queued behind an earlier collective or its group's set-up")
        waiting = (f", still waiting for messages from rank(s) {ranks}" if ranks else
                   (", which waits for no message this rank can name" if behind else ""))
        return CollectiveTimeoutError(
            work.collective, work.seq, ranks,
            f"timed out after {work.timeout:g} s before it could start: {why}{waiting}")

    def _blockers(self, head: Work) -> list[_Run]:
        """The started collectives that keep ``head`` (first in the queue)
        from starting: those creating a group it needs, or (one with a group
        to set up) any set-up in progress, else the oldest in its sequence
        space (the sequence window)."""
        if head.requires:
            missing = {g for g in head.requires if not self._transport.has_group(g)}
            creating = [run for run in self._active if missing.intersection(run.work.creates)]
            if creating:
                return creating
        if head.creates:
            creating = self._creating()
            if creating:
                return creating
        same = [run for run in self._active if run.work.space == head.space]
        return [min(same, key=lambda run: run.work.seq)] if same else []

    def _transport_failed(self, exc: TransportError) -> None:
        """MPI reported an error: if a peer is gone, that is what it means, and
        every run says so (RankFailedError); else the transport itself broke."""
        failed = self._watch.dead_peers(list(self._active), settle=True)
        if not failed:
            self._break(exc)
            return
        for run, error in failed:
            self._finish(run, error=error)
        self._break(failed[0][1])

    def _break(self, error: WagmaError) -> None:
        self.broken = self.broken or error
        self._fail_all(error)
        self._stop_services(error)

    def _stop_services(self, error: WagmaError) -> None:
        with self._mutex:
            services, self._services = self._services, []
        for service in services:
            service.fail(error)

    def _fail_all(self, error: WagmaError) -> None:
        """Fail everything in flight or queued, the submissions not taken yet
        included (the progress thread dying left them to their deadline,
        and a polled handle of theirs to nobody)."""
        self._take_incoming()
        for run in list(self._active):
            self._finish(run, error=error)
        while self._waiting:
            self._fail_queued(self._waiting.popleft(), error)


__all__ = ["Engine", "Stage", "Work", "DATA"]
