"""The GPU side of the engine: a queue of collectives on GPU buffers that the
progress thread issues to NCCL, in submission order, and completes.

Why a queue of whole collectives instead of the host engine's op-by-op
polling: NCCL is stream-ordered, so a collective is enqueued at once (its
waves, schedule/waves.py) and completes with one CUDA event; polling each op on
the host would put a host round trip between every step of the schedule.

Ordering (why several NCCL communicators in flight cannot deadlock): only the
progress thread calls NCCL, and it takes collectives from this FIFO in the
order the communicator numbered them. Every rank calls its collectives in the
same order (the API's contract, checked with WAGMA_DEBUG=1), so every rank
makes the same NCCL calls in the same order, on every communicator.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence

from ..dtypes import DType
from ..errors import (
    CollectiveTimeoutError,
    CommunicatorClosedError,
    RankFailedError,
    TransportError,
    UnsupportedError,
    WagmaError,
)
from ..schedule.ir import Schedule
from ..schedule.waves import plan_waves
from .handle import Handle

_ERROR_CHECK_S = 0.25  # how often NCCL's asynchronous error state is read
_DEATH_GRACE_S = 0.5  # an NCCL error: how long to look for a dead member behind it
_log = logging.getLogger("wagma_comm.gpu")


@dataclass
class GpuWork:
    """One collective on a GPU buffer, compiled and planned, not yet issued."""

    seq: int
    collective: str
    handle: Handle
    schedule: Schedule
    waves: tuple[tuple[int, ...], ...]
    data: int  # device address of the user's buffer
    dtype: DType
    # groups of a native group collective (None: the world communicator)
    partition: tuple[tuple[int, ...], ...] | None
    deadline: float
    timeout: float
    result: Any
    keepalive: Any
    pending: Any = None


class GpuQueue:
    """Service of one communicator's engine for its GPU buffers (one device)."""

    def __init__(self, engine: Any, device_id: int,
                 make_transport: Callable[[int, Any, float, Any], Any],
                 dead_peers: Callable[[Sequence[int]], list[int]] | None = None,
                 world: Sequence[int] = ()) -> None:
        import cupy

        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            # Created here, on the application thread, because DLPack export
            # needs it (the consumer's stream) before NCCL exists.
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._engine = engine
        self._make_transport = make_transport
        self._dead_peers = dead_peers
        self._world = tuple(world)
        self._watched: GpuWork | None = None  # the collective being issued
        # The collective a failure of this turn is about (its handle gets the
        # error; the others are failed as casualties): _break.
        self._culprit: GpuWork | None = None
        self._lock = threading.Lock()
        self._queue: deque[GpuWork] = deque()
        self._in_flight: deque[GpuWork] = deque()
        self.transport: Any = None
        self.broken: WagmaError | None = None
        self._next_check = 0.0
        self.stats = {"gpu_completed": 0, "gpu_failed": 0}
        engine.add_service(self)

    # -- application side -----------------------------------------------------
    def submit(self, work: GpuWork) -> None:
        with self._lock:
            if self.broken is not None:
                raise CommunicatorClosedError(f"the GPU path is broken: {self.broken}")
            self._queue.append(work)
        self._engine.wake()

    def busy(self) -> bool:
        return bool(self._queue or self._in_flight)

    # -- progress thread ------------------------------------------------------
    def progress(self) -> bool:
        """Issue what is queued, complete what finished, enforce deadlines.
        NCCL is only ever called from the progress thread itself (a waiter
        driving the engine leaves GPU work to it)."""
        if not self._engine.on_progress_thread() or self.broken is not None:
            return False
        progressed = False
        self._culprit = None
        try:
            progressed |= self._issue()
            progressed |= self._complete()
            self._check_health()
        except WagmaError as exc:
            self._break(exc, self._culprit)
            return True
        except Exception as exc:  # noqa: BLE001 -- CUDA/NVRTC/NCCL binding errors
            # must fail the GPU collectives, not kill the progress thread
            self._break(TransportError(f"GPU path failed: {type(exc).__name__}: {exc}"),
                        self._culprit)
            return True
        return progressed

    def _issue(self) -> bool:
        issued = False
        while True:
            with self._lock:
                if not self._queue:
                    return issued
                work = self._queue.popleft()
                # In flight from here on, so whatever fails below fails it too.
                self._in_flight.append(work)
            # A failure from here to its issue is this collective's, not the
            # oldest in flight's (which may be an earlier, healthy one).
            self._culprit = work
            _log.debug("issue %s round %d", work.collective, work.seq)
            if self.transport is None:
                self.transport = self._setup(work)
                _log.debug("NCCL %s ready in %.3fs", self.transport.nccl_version,
                           self.transport.init_seconds)
            self._watched = work
            group = None
            try:
                if work.partition is not None:
                    group = self.transport.group_comm(work.schedule.ranks, work.partition,
                                                      work.deadline)
                work.pending = self.transport.enqueue(
                    work.schedule, work.waves, work.data, work.dtype, group, work.deadline)
            except TimeoutError as exc:
                raise self._timeout_error(work, str(exc)) from exc
            except TransportError as exc:
                raise self._attribute(work, exc) from exc
            self._culprit = None
            issued = True

    def _setup(self, work: GpuWork) -> Any:
        try:
            self._watched = work
            return self._make_transport(self.device_id, self.stream, work.deadline,
                                        None if self._dead_peers is None else self._watch)
        except TimeoutError as exc:
            raise self._timeout_error(work, f"NCCL initialisation: {exc}") from exc
        except ImportError as exc:
            raise UnsupportedError("buf", f"GPU transport unavailable: {exc}") from exc

    def _complete(self) -> bool:
        done = False
        while (self._in_flight and self._in_flight[0].pending is not None
               and self.transport.done(self._in_flight[0].pending)):
            work = self._in_flight.popleft()
            work.pending = None
            _log.debug("done %s round %d", work.collective, work.seq)
            self.stats["gpu_completed"] += 1
            work.handle._complete(work.result)
            done = True
        return done

    def _check_health(self) -> None:
        if not self._in_flight:
            return
        now = time.monotonic()
        late = overdue(self._in_flight, now)
        if late is not None:
            self._culprit = late
            raise self._timeout_error(late, f"did not complete within {late.timeout:g}s")
        oldest = self._culprit = self._in_flight[0]
        if now >= self._next_check:
            self._next_check = now + _ERROR_CHECK_S
            problem = self.transport.async_error()
            if problem is not None:
                raise self._attribute(oldest, TransportError(problem))
            if self._dead_peers is not None:
                dead = self._dead_peers(oldest.schedule.ranks)
                if dead:
                    raise RankFailedError(oldest.collective, oldest.seq, dead,
                                          "a member's process died; NCCL communicators "
                                          "aborted")

    def _watch(self) -> None:
        """What NCCL's settle loops call while the collective being issued
        (``_watched``) sets up or issues: a dead member is named at once
        (RankFailedError), not at the deadline."""
        work, dead_peers = self._watched, self._dead_peers
        if work is None or dead_peers is None:
            return
        members = work.schedule.ranks
        dead = dead_peers(members)
        if dead:
            raise RankFailedError(work.collective, work.seq, dead,
                                  "a member's process died while NCCL was setting up "
                                  "or issuing; NCCL communicators aborted"
                                  + dead_elsewhere(dead_peers, members, self._world))

    def _attribute(self, work: GpuWork, error: TransportError) -> WagmaError:
        """An NCCL error during ``work``: RankFailedError if a member's process
        is gone (NCCL may see its closed socket before the process is reaped,
        so it is asked again for up to _DEATH_GRACE_S), else the error with
        the collective and round named."""
        members = work.schedule.ranks
        if self._dead_peers is not None:
            dead = dead_within(self._dead_peers, members, _DEATH_GRACE_S)
            if dead:
                return RankFailedError(
                    work.collective, work.seq, dead,
                    f"a member's process died (NCCL: {error}); NCCL communicators "
                    "aborted" + dead_elsewhere(self._dead_peers, members, self._world))
        return TransportError(f"{work.collective} (round {work.seq}): {error}")

    def _timeout_error(self, work: GpuWork, what: str) -> CollectiveTimeoutError:
        blamed, why = timeout_blame(self._dead_peers, work.schedule.ranks, work.schedule.rank,
                                    self._world)
        return CollectiveTimeoutError(
            work.collective, work.seq, blamed,
            f"GPU collective {what}; NCCL communicators aborted, the GPU path of this "
            f"communicator is unusable now ({why})")

    def _break(self, error: WagmaError, culprit: GpuWork | None = None) -> None:
        """Abort NCCL (so no kernel stays blocked) and fail everything;
        ``culprit``: the collective ``error`` is about."""
        self.broken = error
        if self.transport is not None:
            self.transport.abort(str(error))
        self.fail(error, culprit)

    def fail(self, error: WagmaError, culprit: GpuWork | None = None) -> None:
        """Fail every queued and in-flight GPU collective (engine broke/closed,
        or the GPU path broke at ``culprit``)."""
        with self._lock:
            works = list(self._in_flight) + list(self._queue)
            self._in_flight.clear()
            self._queue.clear()
        for work, err in zip(works, failure_errors(works, error, culprit)):
            self.stats["gpu_failed"] += 1
            work.handle._complete(error=err)

    def close(self, deadline: float) -> None:
        """Called after the engine drained: release the NCCL communicators."""
        if self.transport is not None and self.broken is None:
            self.transport.close(deadline)


def overdue(works: Sequence[GpuWork], now: float) -> GpuWork | None:
    """The collective in ``works`` whose deadline passed first (None if
    none has): each call has its own timeout, so one queued on the stream
    behind a slower collective must still fail at its own deadline, not at
    the older one's."""
    late = [w for w in works if now > w.deadline]
    return min(late, key=lambda w: w.deadline) if late else None


def failure_errors(works: Sequence[GpuWork], error: WagmaError,
                   culprit: GpuWork | None) -> list[BaseException]:
    """What each of ``works`` (in flight, then queued) fails with when the
    GPU path breaks: ``error`` for the collective it is about (``culprit``,
    else the first), and for a timeout or a dead rank a
    CommunicatorClosedError for the others, whose NCCL work was aborted with
    it (they may be older than the culprit as well as newer)."""
    lead = culprit if any(w is culprit for w in works) else (works[0] if works else None)
    out: list[BaseException] = []
    for work in works:
        if work is lead or not isinstance(error, (CollectiveTimeoutError, RankFailedError)):
            out.append(error)
        else:
            out.append(CommunicatorClosedError(
                f"{work.collective} (round {work.seq}): not completed, the GPU path broke "
                f"at another collective and its NCCL work was aborted: {error}"))
    return out


def timeout_blame(dead_peers: Callable[[Sequence[int]], list[int]] | None,
                  members: Sequence[int], me: int,
                  world: Sequence[int]) -> tuple[list[int], str]:
    """Whom a GPU collective's timeout names, and why: its dead members if
    the liveness check found any, else (NCCL does not say who arrived) all
    other members; and any dead rank outside the group, which a member may
    have stopped for (a cascade: it failed first, then left)."""
    dead = dead_peers(members) if dead_peers is not None else []
    if dead:
        return dead, "these members' processes are gone" + dead_elsewhere(dead_peers, members,
                                                                           world)
    return [r for r in members if r != me], (
        "NCCL does not say which members arrived; these are the other members"
        + dead_elsewhere(dead_peers, members, world))


def dead_within(dead_peers: Callable[[Sequence[int]], list[int]], members: Sequence[int],
                grace: float = _DEATH_GRACE_S) -> list[int]:
    """The dead among ``members`` after an NCCL error, asked again for up to
    ``grace`` seconds: NCCL may see a killed peer's closed socket before the
    process is reaped."""
    limit = time.monotonic() + grace
    while True:
        dead = dead_peers(members)
        if dead or time.monotonic() > limit:
            return dead
        time.sleep(0.02)


def dead_elsewhere(dead_peers: Callable[[Sequence[int]], list[int]] | None,
                   members: Sequence[int], world: Sequence[int]) -> str:
    """A note naming the dead ranks outside ``members`` (empty if none): a
    member may have stopped because of them, and then left."""
    others = dead_peers([r for r in world if r not in members]) if dead_peers else []
    return (f"; ranks {others}, outside this group, are dead: a member may have stopped "
            "because of them" if others else "")


@lru_cache(maxsize=512)
def plan(kind: str, ranks: tuple[int, ...], count: int, op: str, algorithm: str,
         root: int) -> tuple[dict[int, Schedule], dict[int, tuple[tuple[int, ...], ...]]]:
    """Every member's schedule of one GPU collective and its stream-ordered
    waves. Each rank computes the same plan from the deterministic compiler,
    without talking; cached, since a trainer repeats the same shapes."""
    from ..schedule import algorithms

    if kind == "allreduce":
        scheds = {r: algorithms.compile_allreduce(r, ranks, count, op, algorithm)
                  for r in ranks}
    else:
        scheds = {r: algorithms.compile_broadcast(r, ranks, count, root, algorithm)
                  for r in ranks}
    return scheds, plan_waves(scheds)
