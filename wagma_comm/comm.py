"""Communicator: the user-facing API over the engine, compiler and transport.

Every collective here is *collective over the communicator*: all ranks call the
same collectives in the same order (a group collective too: each rank then runs
it within its own group). That shared order is what gives each collective the
same sequence number (``round``) on every rank, and the sequence number is part
of every message's identity.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

from . import groups as groups_mod
from .buffers import Buffer, as_buffer
from .dtypes import UINT8, check_op
from .errors import (
    CommunicatorClosedError,
    InvalidArgumentError,
    UnsupportedError,
)
from .runtime import debug
from .runtime.engine import Engine, Stage, Work
from .runtime.handle import Handle
from .schedule import algorithms
from .schedule.ir import DATA, Native, Schedule
from .transport.base import CHANNEL_DATA, CHANNEL_SETUP, Transport

INLINE_MAX_BYTES = 64 << 10
"""Blocking collectives up to this size run on the calling thread when nothing
else is in flight (runtime/inline.py): small messages cost their Python."""

DEFAULT_TIMEOUT_S = 300.0
"""Default deadline of every collective: finite, so a hang becomes an error.
Override per communicator (``init(timeout=...)``), per call (``timeout=``) or
with the ``WAGMA_TIMEOUT`` environment variable (seconds)."""


def _check_timeout(timeout: Any, argument: str = "timeout") -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidArgumentError(argument, f"expected seconds as a number, got {timeout!r}")
    if not timeout > 0 or timeout != timeout or timeout == float("inf"):
        raise InvalidArgumentError(argument, f"must be a finite number > 0, got {timeout!r}")
    return float(timeout)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


class Communicator:
    """A group of ranks that run collectives together (see :func:`init`)."""

    def __init__(self, transport: Transport, timeout: float | None = None,
                 debug_mode: bool | None = None) -> None:
        env_timeout = os.environ.get("WAGMA_TIMEOUT")
        if timeout is None:
            timeout = float(env_timeout) if env_timeout else DEFAULT_TIMEOUT_S
        self._timeout = _check_timeout(timeout)
        self._transport = transport
        self._debug = _env_flag("WAGMA_DEBUG") if debug_mode is None else debug_mode
        self._engine = Engine(transport)
        self._lock = threading.Lock()  # sequence numbers and submission order
        self._seq = 0
        self._native_groups: set[tuple[int, ...]] = set()
        self._closed = False
        self._calls: dict[str, int] = {}
        self._partials = 0

    # -- properties -----------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._transport.rank

    @property
    def size(self) -> int:
        return self._transport.size

    @property
    def timeout(self) -> float:
        """Default deadline (seconds) of this communicator's collectives."""
        return self._timeout

    @property
    def debug(self) -> bool:
        return self._debug

    @property
    def closed(self) -> bool:
        return self._closed

    # -- groups ---------------------------------------------------------------
    def groups(self, group_size: int, step: int) -> list[list[int]]:
        """The partition of all ranks into groups at ``step`` (see groups.py)."""
        groups_mod.check_group_size(self.size, group_size)
        groups_mod.check_step(step)
        return [list(g) for g in groups_mod.partition(self.size, group_size, step)]

    def group_of(self, group_size: int, step: int, rank: int | None = None) -> list[int]:
        """The group of ``rank`` (default: this rank) at ``step``."""
        groups_mod.check_group_size(self.size, group_size)
        groups_mod.check_step(step)
        r = self.rank if rank is None else rank
        return list(groups_mod.group_of(r, self.size, group_size, step))

    # -- collectives ----------------------------------------------------------
    def allreduce(self, buf: Any, op: str = "sum", *, async_op: bool = False,
                  algorithm: str | None = None, timeout: float | None = None) -> Any:
        """Reduce ``buf`` over all ranks, in place. Returns ``buf`` (or a Handle)."""
        return self._reduce("allreduce", buf, tuple(range(self.size)), op, algorithm,
                            timeout, async_op, extra="")

    def group_allreduce(self, buf: Any, group_size: int, step: int, op: str = "avg", *,
                        async_op: bool = False, algorithm: str | None = None,
                        timeout: float | None = None) -> Any:
        """Reduce ``buf`` within this rank's group at ``step`` (shifting groups of
        at most ``group_size`` ranks), in place."""
        groups_mod.check_group_size(self.size, group_size)
        groups_mod.check_step(step)
        ranks = groups_mod.group_of(self.rank, self.size, group_size, step)
        return self._reduce("group_allreduce", buf, ranks, op, algorithm, timeout,
                            async_op, extra=f",group_size={group_size},step={step}")

    def broadcast(self, buf: Any, root: int = 0, *, async_op: bool = False,
                  algorithm: str | None = None, timeout: float | None = None) -> Any:
        """Copy ``root``'s ``buf`` to every rank, in place."""
        self._check_open()
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.size:
            raise InvalidArgumentError("root", f"must be an int in [0, {self.size}), got {root!r}")
        buffer = as_buffer(buf, "buf")
        deadline_s = self._call_timeout(timeout)
        ranks = tuple(range(self.size))
        name = self._check_algorithm(
            algorithm, algorithms.BROADCAST_ALGORITHMS,
            lambda: algorithms.choose_broadcast(buffer.nbytes, len(ranks)))
        sched = algorithms.compile_broadcast(self.rank, ranks, buffer.count, root, name)
        text = (f"broadcast(count={buffer.count},dtype={buffer.dtype.name},root={root},"
                f"algorithm={name})")
        return self._submit("broadcast", text, sched, buffer, deadline_s, async_op)

    def barrier(self, timeout: float | None = None) -> None:
        """Block until every rank has entered the barrier."""
        self._check_open()
        deadline_s = self._call_timeout(timeout)
        sched = algorithms.compile_barrier(self.rank, tuple(range(self.size)))
        token = np.zeros(1, dtype=np.uint8)
        self._submit("barrier", "barrier()", sched, token, deadline_s, False,
                     dtype=UINT8, result=None)

    # -- persistent partial collectives ----------------------------------------
    def wait_avoiding_group_allreduce(self, buf: Any, group_size: int, sync_every: int, *,
                                      activation: str = "global",
                                      normalization: str = "wagma",
                                      timeout: float | None = None,
                                      algorithm: str | None = None) -> Any:
        """WAGMA model averaging over shifting groups of at most ``group_size``
        ranks; every ``sync_every``-th step is a blocking global mean. Collective:
        every rank creates it, in the same order as other collectives. ``buf``
        is the initial model (shape/dtype of every later step). See
        docs/partial.md."""
        from .partial.wagma import WaitAvoidingGroupAllreduce

        return self._create(WaitAvoidingGroupAllreduce(
            self, buf, group_size, sync_every, activation=activation,
            normalization=normalization, timeout=timeout, algorithm=algorithm))

    def solo_allreduce(self, buf: Any, sync_every: int, *, op: str = "avg",
                       timeout: float | None = None, algorithm: str | None = None) -> Any:
        """eager-SGD's solo allreduce of gradients: the first rank to arrive
        activates each round. Collective; see docs/partial.md."""
        from .partial.eager import SoloAllreduce

        return self._create(SoloAllreduce(self, buf, sync_every, op=op, timeout=timeout,
                                          algorithm=algorithm))

    def majority_allreduce(self, buf: Any, sync_every: int, *, seed: int = 0,
                           op: str = "avg", timeout: float | None = None,
                           algorithm: str | None = None) -> Any:
        """eager-SGD's majority allreduce: round ``t`` is activated by a rank
        drawn from (seed, t), the same on every rank. Collective."""
        from .partial.eager import MajorityAllreduce

        return self._create(MajorityAllreduce(self, buf, sync_every, seed=seed, op=op,
                                              timeout=timeout, algorithm=algorithm))

    def _create(self, partial: Any) -> Any:
        partial._open()
        with self._lock:
            self._calls[partial.kind] = self._calls.get(partial.kind, 0) + 1
        return partial

    def _register_partial(self) -> int:
        self._check_open()
        with self._lock:
            self._partials += 1
            return self._partials

    def _open_channels(self, collective: str, names: tuple[str, ...], timeout: float) -> None:
        """Collective: a barrier proves every rank present, then the progress
        thread creates the channels (blocking MPI calls that cannot hang now)."""
        self._check_open()
        deadline_s = self._call_timeout(timeout)
        sched = algorithms.compile_barrier(self.rank, tuple(range(self.size)))
        token = np.zeros(1, dtype=np.uint8)
        with self._lock:
            self._check_open()
            seq = self._seq
            self._seq += 1
            stage = Stage(sched, CHANNEL_SETUP, {DATA: token}, UINT8,
                          on_done=lambda: self._transport.open_channels(names),
                          label=f"set-up of {collective}")
            now = time.monotonic()
            handle = Handle(collective, seq, now + deadline_s, self._engine.alive)
            self._engine.submit(Work(seq, collective, handle, [stage], now + deadline_s,
                                     deadline_s, keepalive=token))
        handle.wait()

    # -- lifecycle ------------------------------------------------------------
    def close(self, cancel: bool = False) -> None:
        """Finish in-flight collectives (or fail them with ``cancel``), stop the
        progress thread and free the MPI communicators. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._engine.close(cancel=cancel, timeout=self._timeout + 10.0)
        if not self._engine.alive():
            self._transport.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(cancel=exc[0] is not None)

    def statistics(self) -> dict[str, Any]:
        """Counters of the engine (messages, bytes, completed/failed collectives)
        and calls per collective."""
        stats: dict[str, Any] = self._engine.statistics()
        stats["calls"] = dict(self._calls)
        stats["broken"] = None if self._engine.broken is None else str(self._engine.broken)
        return stats

    def __repr__(self) -> str:
        return (f"<Communicator rank={self.rank} size={self.size} "
                f"transport={self._transport.name}{' closed' if self._closed else ''}>")

    # -- internals ------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CommunicatorClosedError("communicator is closed")
        if self._engine.broken is not None:
            raise CommunicatorClosedError(f"communicator is broken: {self._engine.broken}")

    def _call_timeout(self, timeout: Any) -> float:
        return self._timeout if timeout is None else _check_timeout(timeout)

    @staticmethod
    def _check_algorithm(algorithm: Any, known: tuple[str, ...], default: Any) -> str:
        if algorithm is None:
            return default()
        if not isinstance(algorithm, str) or algorithm not in known:
            raise InvalidArgumentError(
                "algorithm", f"unknown algorithm {algorithm!r}; expected one of {list(known)}")
        return algorithm

    def _reduce(self, collective: str, buf: Any, ranks: tuple[int, ...], op: str,
                algorithm: str | None, timeout: Any, async_op: bool, extra: str) -> Any:
        self._check_open()
        check_op(op)
        buffer = as_buffer(buf, "buf")
        deadline_s = self._call_timeout(timeout)
        name = self._check_algorithm(
            algorithm, algorithms.ALLREDUCE_ALGORITHMS,
            lambda: algorithms.choose_allreduce(buffer.nbytes, len(ranks)))
        if name == "native" and not self._transport.supports_native(
                "sum" if op == "avg" else op, buffer.dtype):
            raise UnsupportedError(
                "algorithm", f"the {self._transport.name} transport has no native "
                f"{op} for {buffer.dtype.name}; use another algorithm")
        sched = algorithms.compile_allreduce(self.rank, ranks, buffer.count, op, name)
        text = (f"{collective}(count={buffer.count},dtype={buffer.dtype.name},op={op}"
                f"{extra},algorithm={name})")
        return self._submit(collective, text, sched, buffer, deadline_s, async_op)

    def _submit(self, collective: str, text: str, sched: Schedule, buffer: Buffer | np.ndarray,
                timeout: float, async_op: bool, *, dtype: Any = None,
                result: Any = ...) -> Any:
        if isinstance(buffer, Buffer):
            data, dt, owner = buffer.host_array(), buffer.dtype, buffer.owner
        else:
            data, dt, owner = buffer, dtype, buffer
        with self._lock:
            self._check_open()
            seq = self._seq
            self._seq += 1
            self._calls[collective] = self._calls.get(collective, 0) + 1
            stages: list[Stage] = []
            if self._debug and self.size > 1:
                stages.append(debug.fingerprint_stage(self.rank, self.size, seq,
                                                      collective, text))
            stages.extend(self._setup_stages(sched))
            stages.append(Stage(sched, CHANNEL_DATA, {DATA: data}, dt))
            now = time.monotonic()
            value = owner if result is ... else result

            def make_work() -> Work:
                handle = Handle(collective, seq, now + timeout, self._engine.alive,
                                self._engine.drive_until)
                return Work(seq, collective, handle, stages, now + timeout, timeout,
                            result=value, keepalive=buffer)

            # A small blocking call with nothing else in flight runs right here
            # (Engine.run_inline); the claim is taken under the submission lock.
            inline = (not async_op and len(stages) == 1 and data.nbytes <= INLINE_MAX_BYTES
                      and self._engine.try_inline())
            if not inline:
                work = make_work()
                # A blocking call drives its own work: no need to wake the thread.
                self._engine.submit(work, wake=async_op)
        if inline:
            late = self._engine.run_inline(stages[0], seq, now + timeout, make_work)
            return value if late is None else late.wait()
        return work.handle if async_op else work.handle.wait()

    def _setup_stages(self, sched: Schedule) -> list[Stage]:
        """Native collectives over a group need the group's own MPI communicator,
        created once, after a barrier over the group proves every member present
        (so the blocking creation call cannot hang on a missing rank)."""
        out: list[Stage] = []
        for op in sched.ops:
            if not isinstance(op, Native) or op.ranks in self._native_groups:
                continue
            self._native_groups.add(op.ranks)
            if self._transport.has_group(op.ranks):
                continue
            ranks = op.ranks
            barrier = algorithms.compile_barrier(self.rank, ranks)
            out.append(Stage(barrier, CHANNEL_SETUP, {DATA: np.zeros(0, np.uint8)}, UINT8,
                             on_done=lambda r=ranks: self._transport.create_group(r)))
        return out


def init(timeout: float | None = None, *, mpi_comm: Any = None,
         debug: bool | None = None) -> Communicator:
    """Create a communicator over ``mpi_comm`` (default MPI_COMM_WORLD).

    Works under ``mpiexec``/``srun`` and as a single process. MPI is initialised
    with MPI_THREAD_MULTIPLE (our progress thread calls MPI while your threads
    may too). ``timeout`` is the default deadline of every collective (seconds).
    """
    if timeout is not None:
        _check_timeout(timeout)
    from mpi4py import MPI

    from .transport.mpi import MPITransport

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise UnsupportedError(
            "mpi4py", "MPI was initialised without MPI_THREAD_MULTIPLE; wagma_comm's "
            "progress thread needs it (leave mpi4py.rc.thread_level at 'multiple')")
    comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    return Communicator(MPITransport(comm), timeout=timeout, debug_mode=debug)
