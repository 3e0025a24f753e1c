"""Communicator: the user-facing API over the engine, compiler and transport.

Every collective here is *collective over the communicator*: all ranks call the
same collectives in the same order (a group collective too: each rank then runs
it within its own group). That shared order is what gives each collective the
same sequence number (``round``) on every rank, and the sequence number is part
of every message's identity.
"""

from __future__ import annotations

import atexit
import math
import numbers
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

from . import groups as groups_mod
from .buffers import Buffer, as_buffer, cuda_device
from .dtypes import UINT8, DType, check_op
from .errors import (
    BufferError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
    UnsupportedError,
)
from .runtime import debug
from .runtime.engine import (CLOSE_GRACE_S, LAZY, NOT_INLINE, Engine, Stage, Work,
                             check_environment)
from .runtime.handle import Handle
from .runtime.inline import Program
from .runtime.liveness import Liveness, Monitor
from .runtime.shared import ALGORITHM as SHARED_MEMORY
from .runtime.shared import SharedCall, SharedExchange, describe, max_bytes_override
from .kernels.host import host_threads
from .runtime.watch import watchdog_seconds
from .schedule import algorithms
from .schedule.ir import DATA, Native, Schedule
from .transport.base import CHANNEL_DATA, CHANNEL_SETUP, Transport

INLINE_MAX_BYTES = 64 << 10
"""Blocking collectives up to this size run on the calling thread when nothing
else is in flight (runtime/inline.py): small messages cost their Python."""

REDUCE_ALGORITHMS = algorithms.ALLREDUCE_ALGORITHMS + (SHARED_MEMORY,)
"""What ``algorithm=`` of allreduce and group_allreduce on host memory takes."""

BROADCAST_ALGORITHMS = algorithms.BROADCAST_ALGORITHMS + (SHARED_MEMORY,)
"""What ``algorithm=`` of broadcast on host memory takes."""

_PREPARED_LIMIT = 1024  # distinct reduction calls remembered per communicator

DEFAULT_TIMEOUT_S = 300.0
"""Default deadline of every collective: finite, so a hang becomes an error.
Override per communicator (``init(timeout=...)``), per call (``timeout=``) or
with the ``WAGMA_TIMEOUT`` environment variable (seconds)."""


def check_timeout(timeout: Any, argument: str = "timeout") -> float:
    """A deadline in seconds: a finite real number > 0 (inf or NaN would make
    a wait endless), NumPy scalars included, as ``Handle.wait`` takes them;
    a bool or a string is refused, naming ``argument``. Judged as the float
    it becomes: an int too large for one (OverflowError) or a long double
    past its range (inf) is refused too."""
    if type(timeout) is float and 0.0 < timeout < math.inf:
        return timeout  # the common case, per call: no ABC check
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidArgumentError(argument, f"expected seconds as a number, got {timeout!r}")
    try:
        value = float(timeout)
    except (OverflowError, ValueError):
        value = math.inf
    if not (value > 0 and math.isfinite(value)):
        raise InvalidArgumentError(argument, f"must be a finite number > 0, got {timeout!r}")
    return value


EXIT_DRAIN_S = 10.0
"""At interpreter exit, a communicator that was never closed gets this long (at
most its own timeout; ``WAGMA_EXIT_DRAIN`` overrides, in seconds) to finish
what is in flight; whatever is left is then cancelled (see ``_close_all_at_exit``)."""


def _exit_drain_s() -> float:
    """:data:`EXIT_DRAIN_S`, or ``WAGMA_EXIT_DRAIN`` seconds (>= 0). A bad
    value is reported on stderr and the default used: raised in the atexit
    hook, it left the communicator marked closed but never closed."""
    env = os.environ.get("WAGMA_EXIT_DRAIN", "").strip()
    if not env:
        return EXIT_DRAIN_S
    try:
        value = float(env)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also NaN
        sys.stderr.write(f"wagma_comm: WAGMA_EXIT_DRAIN={env!r} is not a number of seconds "
                         f">= 0; draining for {EXIT_DRAIN_S:g} s\n")
        return EXIT_DRAIN_S
    return value


_LIVE: list["Communicator"] = []  # open communicators, oldest first
_LIVE_LOCK = threading.Lock()
_EXIT_HOOK = False


def _close_all_at_exit() -> None:
    """atexit hook: close every communicator still open, newest first.

    Why: the progress thread is a daemon thread, so without this an exit with
    collectives in flight would drop them silently (or let MPI_Finalize race a
    thread still inside MPI). Registered after mpi4py's import, so it runs
    before mpi4py finalizes MPI. Each communicator drains for a bounded time,
    then cancels, and says on stderr what it did: no rank blocks at exit."""
    with _LIVE_LOCK:
        live = list(reversed(_LIVE))
    for comm in live:
        try:
            comm._close_at_exit()
        except Exception as exc:  # noqa: BLE001 -- exit must go on for the others
            sys.stderr.write(f"wagma_comm: closing a communicator at exit failed: {exc!r}\n")


def _has_nan(data: np.ndarray, dtype: DType) -> bool:
    """Whether a float buffer (kernel storage: 16-bit floats as bit patterns)
    holds a NaN."""
    if dtype.is_half:
        exponent = 0x7C00 if dtype.name == "float16" else 0x7F80
        return bool(np.any((data & 0x7FFF) > exponent))
    return bool(np.isnan(data).any())


def _nan_check(collective: str, op: str, buffer: Buffer) -> Callable[[], None]:
    """The check a float max/min runs on its *result*: every member sees the
    same NaN there and raises, after a completed collective (no sequence skew,
    unlike a check of one rank's input)."""
    data, dtype = buffer.host_array(), buffer.dtype

    def check() -> None:
        if _has_nan(data, dtype):
            raise InvalidArgumentError(
                "buf", f"{collective} with op={op!r}: a member's input contained NaN, so "
                "the result is NaN; the buffer holds that reduced result (every member "
                "raises this; the communicator stays usable)")
    return check


def _host_buffer(buf: Any) -> Buffer:
    """``as_buffer`` for the host paths, refusing a buffer not aligned to its
    element size (a NumPy view at an odd byte offset): the message path hands
    it to MPI as a typed buffer, which mpi4py cannot map (NumPy exports it as
    '=f'), so it broke the communicator mid-collective instead of being
    refused before any message, and it ran on one host only."""
    buffer = as_buffer(buf, "buf")
    owner = buffer.owner
    if isinstance(owner, np.ndarray):
        aligned = owner.flags.aligned
    else:
        aligned = buffer.ptr % buffer.dtype.itemsize == 0
    if not aligned:
        raise BufferError(
            "buf", f"buffer is not aligned to its element size ({buffer.dtype.itemsize} "
            f"bytes for {buffer.dtype.name}), which MPI cannot send; pass an aligned copy "
            "(np.require(x, requirements='A'), x.copy())")
    return buffer


def _cancelled() -> CommunicatorClosedError:
    return CommunicatorClosedError("communicator closed while in flight (cancel=True)")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


class _FastCall:
    """What a blocking allreduce or group allreduce on NumPy arrays of one
    dtype and shape, with one op and algorithm (and group), compiles to
    (``Communicator._remember_fast``). ``counter`` is the one-element list
    its calls are counted in, shared by every such call of the collective and
    outliving the entry (a thread may still use an entry being forgotten)."""

    __slots__ = ("collective", "sched", "text", "dtype", "flat", "program", "generation",
                 "counter")

    def __init__(self, collective: str, sched: Schedule, text: str, dtype: DType,
                 flat: bool, engine: Engine, counter: list[int]) -> None:
        self.collective = collective
        self.sched, self.text, self.dtype = sched, text, dtype
        self.flat = flat  # the array itself is the flat view of its storage dtype
        self.counter = counter
        self.refresh(engine)

    def refresh(self, engine: Engine) -> Program:
        """The engine's program for this call (again, after it forgot them)."""
        self.generation = engine.generation
        self.program = engine.program(self.sched, self.dtype)
        return self.program


class Communicator:
    """A group of ranks that run collectives together (see :func:`init`)."""

    def __init__(self, transport: Transport, timeout: float | None = None,
                 debug_mode: bool | None = None) -> None:
        self._timeout = check_timeout(default_timeout(timeout))
        self._transport = transport
        self._debug = _env_flag("WAGMA_DEBUG") if debug_mode is None else debug_mode
        liveness = (Liveness(transport.rank, transport.identities)
                    if transport.identities else None)
        self._liveness = liveness
        try:
            self._engine = Engine(transport, liveness=liveness)
        except BaseException:
            transport.close()  # nobody else would free its MPI communicators
            raise
        try:
            segment = transport.shared_segment
            # Reductions through shared memory (runtime/shared.py): only
            # where the transport mapped a segment on every rank.
            self._shared = (SharedExchange(segment, transport.rank, self._break, self._engine)
                            if segment is not None else None)
            self._monitor = (Monitor(liveness, self._engine.in_flight)
                             if liveness is not None and liveness.checkable else None)
        except BaseException:
            # Nothing else would stop the progress thread or free the MPI
            # communicators (a failed init() left a 'wagma-progress' thread).
            self._engine.close(cancel=True)
            transport.close()
            raise
        self._lock = threading.Lock()  # sequence numbers and submission order
        self._seq = 0
        self._native_groups: set[tuple[int, ...]] = set()
        self._prepared: dict[tuple[Any, ...], tuple[Schedule | SharedCall, str]] = {}
        self._natives: dict[int, tuple[Schedule, tuple[tuple[int, ...], ...]]] = {}
        self._fast: dict[tuple[Any, ...], _FastCall] = {}
        self._all_ranks = tuple(range(self.size))
        self._gpu: Any = None  # runtime.gpu.GpuQueue, made at the first GPU buffer
        self._gpu_lock = threading.Lock()
        self._closed = False
        self._calls: dict[str, int] = {}
        self._small_counts: dict[str, list[int]] = {}  # calls on the small-call path
        self._partials = 0
        self._persistent: weakref.WeakSet[Any] = weakref.WeakSet()  # for the exit report
        global _EXIT_HOOK
        with _LIVE_LOCK:
            _LIVE.append(self)
            if not _EXIT_HOOK:
                atexit.register(_close_all_at_exit)
                _EXIT_HOOK = True

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
    def shared_memory_bytes(self) -> int:
        """The largest buffer (bytes per rank) that ``algorithm=None`` reduces
        through the shared-memory segment on this communicator; 0 where it
        has none (ranks on several hosts, not x86-64, ``WAGMA_SHM=0``, one
        rank). ``algorithm="shared_memory"`` takes any size."""
        return 0 if self._shared is None else self._shared.max_bytes

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
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.size:
            raise InvalidArgumentError("rank", f"must be an int in [0, {self.size}), got {r!r}")
        return list(groups_mod.group_of(r, self.size, group_size, step))

    # -- collectives ----------------------------------------------------------
    def allreduce(self, buf: Any, op: str = "sum", *, async_op: bool = False,
                  algorithm: str | None = None, timeout: float | None = None) -> Any:
        """Reduce ``buf`` over all ranks, in place. Returns ``buf`` (or a Handle).

        ``op="max"``/``"min"`` on a float dtype: a NaN in any member's input
        makes the result NaN on every member (bitwise the same), and then every
        member raises ``InvalidArgumentError("buf", ...)`` after the collective
        completed (from ``wait()`` when async); ``buf`` holds that result and
        the communicator stays usable. ±Inf is ordered and accepted."""
        fast_key = None
        if type(buf) is np.ndarray and timeout is None:
            # The small-message path: a call seen before (same dtype, shape, op
            # and algorithm) checks only what can differ between such calls.
            # (_try_small, written out: a Python call is 4% of this path.)
            fast_key = (buf.dtype, buf.shape, op, algorithm)
            try:
                fast = self._fast.get(fast_key)
            except TypeError:  # an unhashable algorithm: the full path names it
                fast = None
            if fast is not None:
                flags = buf.flags
                if flags.c_contiguous and flags.writeable and flags.aligned:
                    return self._submit_small(
                        fast, buf if fast.flat else buf.reshape(-1).view(fast.dtype.storage),
                        buf, async_op)
        device = cuda_device(buf)
        if device is not None:
            return self._gpu_collective("allreduce", buf, device, "allreduce",
                                        tuple(range(self.size)), op, algorithm, -1, None,
                                        timeout, async_op)
        return self._reduce("allreduce", buf, self._all_ranks, op, algorithm,
                            timeout, async_op, extra="", fast_key=fast_key)

    def group_allreduce(self, buf: Any, group_size: int, step: int, op: str = "avg", *,
                        async_op: bool = False, algorithm: str | None = None,
                        timeout: float | None = None) -> Any:
        """Reduce ``buf`` within this rank's group at ``step`` (shifting groups of
        at most ``group_size`` ranks), in place. NaN with max/min: as
        :meth:`allreduce` (raised on every member of the group)."""
        groups_mod.check_group_size(self.size, group_size)
        groups_mod.check_step(step)
        period = groups_mod.num_steps(self.size, group_size)
        step %= period  # one schedule (and description) per group
        fast_key = None
        if type(buf) is np.ndarray and timeout is None:
            # The small-message path, as allreduce's: the group, and so the
            # call, repeats every ``period`` steps.
            fast_key = (buf.dtype, buf.shape, op, algorithm, group_size, step)
            result = self._try_small(fast_key, buf, async_op)
            if result is not NOT_INLINE:
                return result
        ranks = groups_mod.group_of(self.rank, self.size, group_size, step)
        device = cuda_device(buf)
        if device is not None:
            # Group communicators only where some group has 2+ members; every
            # rank then takes part in making them, also a singleton's.
            partition = (tuple(tuple(g) for g in self.groups(group_size, step))
                         if group_size > 1 else None)
            return self._gpu_collective("group_allreduce", buf, device, "allreduce", ranks, op,
                                        algorithm, -1, partition, timeout, async_op)
        return self._reduce("group_allreduce", buf, ranks, op, algorithm, timeout,
                            async_op,
                            extra=f",group_size={group_size},step={step} (mod {period})",
                            fast_key=fast_key)

    def broadcast(self, buf: Any, root: int = 0, *, async_op: bool = False,
                  algorithm: str | None = None, timeout: float | None = None) -> Any:
        """Copy ``root``'s ``buf`` to every rank, in place. Through the
        shared-memory segment (the default where there is one, any size),
        the root's call finishes once its data is published, without waiting
        for the others (as an eager send); they copy it from there."""
        self._check_open()
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.size:
            raise InvalidArgumentError("root", f"must be an int in [0, {self.size}), got {root!r}")
        device = cuda_device(buf)
        if device is not None:
            return self._gpu_collective("broadcast", buf, device, "broadcast",
                                        tuple(range(self.size)), "", algorithm, root, None,
                                        timeout, async_op)
        fast_key = None
        if type(buf) is np.ndarray and timeout is None:
            # The small-message path, as allreduce's (the shared-memory exchange's calls).
            fast_key = ("broadcast", buf.dtype, buf.shape, root, algorithm)
            result = self._try_small(fast_key, buf, async_op)
            if result is not NOT_INLINE:
                return result
        buffer = _host_buffer(buf)
        deadline_s = self._call_timeout(timeout)
        sched, text = self._prepared_call(
            ("broadcast", root, algorithm, buffer.count, buffer.dtype.name),
            lambda: self._prepare_broadcast(buffer, root, algorithm))
        if isinstance(sched, SharedCall):
            if fast_key is not None:
                self._remember_shared(fast_key, buf, sched, buffer)
            return self._submit_shared(sched, buffer.host_array(), buffer.owner, deadline_s,
                                       async_op, None)
        return self._submit("broadcast", text, sched, buffer, deadline_s, async_op)

    def barrier(self, timeout: float | None = None) -> None:
        """Block until every rank has entered the barrier."""
        self._check_open()
        deadline_s = self._call_timeout(timeout)
        sched = algorithms.compile_barrier(self.rank, tuple(range(self.size)))
        token = np.zeros(0, dtype=np.uint8)  # as many elements as schedule.count: 0
        self._submit("barrier", "barrier()", sched, token, deadline_s, False,
                     dtype=UINT8, result=None)

    # -- persistent partial collectives ----------------------------------------
    def wait_avoiding_group_allreduce(self, buf: Any, group_size: int, sync_every: int, *,
                                      activation: str = "global",
                                      normalization: str = "wagma",
                                      timeout: float | None = None,
                                      algorithm: str | None = None,
                                      grace: float = 0.0, first_round: int = 0) -> Any:
        """WAGMA model averaging over shifting groups of at most ``group_size``
        ranks; every ``sync_every``-th step is a blocking global mean. Collective:
        every rank creates it, in the same order as other collectives. ``buf``
        is the initial model (shape/dtype of every later step). ``grace``
        (shared-memory path only): the first member of a round may wait up to
        that fraction of its own compute time for members one round behind.
        ``first_round`` (any int >= 0): round r is round first_round + r (its
        group, and whether it is a sync round), as when resuming there.
        See docs/partial.md."""
        if cuda_device(buf) is not None:  # data over NCCL (partial/device.py)
            from .partial import device

            return device.create_wait_avoiding(
                self, buf, group_size, sync_every, activation=activation,
                normalization=normalization, timeout=timeout, algorithm=algorithm,
                first_round=first_round, grace=grace)
        from .partial import shared_wagma

        return shared_wagma.create(self, buf, group_size, sync_every, activation=activation,
                                   normalization=normalization, timeout=timeout,
                                   algorithm=algorithm, grace=grace, first_round=first_round)

    def solo_allreduce(self, buf: Any, sync_every: int, *, op: str = "avg",
                       timeout: float | None = None, algorithm: str | None = None,
                       first_round: int = 0) -> Any:
        """eager-SGD's solo allreduce of gradients: the first rank to arrive
        activates each round. Collective; see docs/partial.md.
        ``first_round`` as in :meth:`wait_avoiding_group_allreduce`."""
        if cuda_device(buf) is not None:  # data over NCCL (partial/device.py)
            from .partial import device

            return device.create_eager(self, False, buf, sync_every, op=op, timeout=timeout,
                                       algorithm=algorithm, first_round=first_round)
        from .partial.eager import SoloAllreduce

        return self._create_eager(SoloAllreduce(self, buf, sync_every, op=op, timeout=timeout,
                                                algorithm=algorithm, first_round=first_round))

    def majority_allreduce(self, buf: Any, sync_every: int, *, seed: int = 0,
                           op: str = "avg", timeout: float | None = None,
                           algorithm: str | None = None, first_round: int = 0) -> Any:
        """eager-SGD's majority allreduce: round ``t`` is activated by a rank
        drawn from (seed, first_round + t), the same on every rank.
        Collective; ``first_round`` as in :meth:`wait_avoiding_group_allreduce`."""
        if cuda_device(buf) is not None:  # data over NCCL (partial/device.py)
            from .partial import device

            return device.create_eager(self, True, buf, sync_every, op=op, timeout=timeout,
                                       algorithm=algorithm, first_round=first_round,
                                       seed=seed)
        from .partial.eager import MajorityAllreduce

        return self._create_eager(MajorityAllreduce(self, buf, sync_every, seed=seed, op=op,
                                                    timeout=timeout, algorithm=algorithm,
                                                    first_round=first_round))

    def _create_eager(self, partial: Any) -> Any:
        """Open a solo or majority allreduce once every rank is known to have
        created it alike (partial/base.py, ``agree``)."""
        from .partial.base import agree

        agree(self, partial.kind, partial.count, partial.dtype, partial.timeout,
              **partial.creation_options())
        return self._create(partial)

    def _create(self, partial: Any) -> Any:
        partial._open()
        with self._lock:
            self._calls[partial.kind] = self._calls.get(partial.kind, 0) + 1
            self._persistent.add(partial)
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
        token = np.zeros(0, dtype=np.uint8)  # as many elements as schedule.count: 0
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
        if cancel and self._shared is not None:
            # Before the submission lock: a post waiting for a late peer holds
            # it (and a blocking call its piece's lock) until the deadline.
            self._shared.cancel(_cancelled())
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._shared is not None:
            # Every exchange in flight finishes (or fails): no peer waits for
            # this rank to read its row.
            self._shared.drain(_cancelled() if cancel else None)
        self._forget()
        self._drain_gpu(cancel)
        # Waits for the latest deadline in flight (a call's timeout= may be
        # longer than the communicator's), not a fixed time.
        stuck = self._engine.close(cancel=cancel)
        self._release(cancelled=cancel)
        if stuck:
            raise CommunicatorClosedError(
                f"close(): the progress thread did not stop by the latest deadline in flight "
                f"plus {CLOSE_GRACE_S:g} s; failed here: {', '.join(stuck)}"
                + ("; the MPI communicators were not freed" if self._engine.alive() else ""))

    def _drain_gpu(self, cancel: bool) -> None:
        """GPU collectives finish (each within its deadline, which the queue
        enforces) before the engine stops; then the NCCL communicators go."""
        gpu = self._gpu
        if gpu is None:
            return
        if cancel:
            gpu.fail(CommunicatorClosedError("communicator closed while in flight"))
        limit = time.monotonic() + self._timeout + 10.0
        while gpu.busy() and self._engine.alive() and time.monotonic() < limit:
            time.sleep(1e-3)
        gpu.close(time.monotonic() + 10.0)

    def _release(self, cancelled: bool = False) -> None:
        """After the engine closed: free the MPI communicators (only once no
        thread can touch them) and stop the liveness monitor."""
        if not self._engine.alive():
            # A call given up on with requests outstanding (a timeout, a
            # cancel), or a broken communicator: peers' messages may still come.
            # So after close(cancel=True) even with nothing in flight here: a
            # peer may have finished a call this rank never made (one racing
            # the close on another thread), its eager sends unreceived, and
            # a freed context id would hand them to the next communicator.
            abandoned = self._engine.abandoned()
            late_messages = (bool(abandoned) or self._engine.broken is not None
                             or cancelled)
            # Views of the shared-memory segment go first, so that closing the
            # transport unmaps it: a closed communicator still referenced kept
            # 8-16 MiB of /dev/shm mapped through its cached calls.
            self._prepared.clear()
            self._fast.clear()
            if self._shared is not None:
                self._shared.release()
            self._transport.close(keep=abandoned if late_messages else None)
        if self._monitor is not None:
            self._monitor.stop()

    def _forget(self) -> None:
        with _LIVE_LOCK:
            if self in _LIVE:
                _LIVE.remove(self)

    def _close_at_exit(self) -> None:
        """close() for the atexit hook: drain for a bounded time, then cancel
        (CommunicatorClosedError), reporting on stderr when anything was in
        flight. Never blocks longer than the drain plus a few seconds."""
        if self._closed:
            return  # (checked again under the lock)
        drain = min(self._timeout, _exit_drain_s())
        drained = time.monotonic() + drain  # the shared-memory calls' drain ends
        # A post waiting for a late peer (shared memory) holds the submission
        # lock until its deadline: past the drain's time it is cancelled.
        if not self._lock.acquire(timeout=min(drain, threading.TIMEOUT_MAX)):
            if self._shared is not None:
                self._shared.cancel(_cancelled())
            self._lock.acquire()
        try:
            if self._closed:
                return
            self._closed = True
        finally:
            self._lock.release()
        self._forget()
        before = self.statistics()
        pending = before["in_flight"]
        shared_cancelled = (self._shared.drain(_cancelled(), until=drained)
                            if self._shared is not None else 0)
        where = f"wagma_comm: rank {self.rank}/{self.size}:"
        unclosed = sorted(p.kind for p in list(self._persistent) if not p._closed)
        if unclosed:
            steps = sum(len(p._pending) for p in list(self._persistent) if not p._closed)
            sys.stderr.write(f"{where} interpreter exit with {len(unclosed)} persistent "
                             f"collective(s) not closed ({', '.join(unclosed)}); their "
                             f"{steps} outstanding step(s) finish if their round is "
                             "running, else fail with CommunicatorClosedError\n")
        if pending:
            sys.stderr.write(f"{where} interpreter exit with {pending} collective(s) in "
                             f"flight and the communicator not closed; finishing them "
                             f"(at most {drain:g} s), then cancelling the rest\n")
        self._engine.close(cancel=False, timeout=drain)
        cancelled = False
        if self._engine.alive():
            # Only what the drain left is cancelled: a thread not yet stopped
            # with nothing in flight (a drain of 0 s) cancels nothing.
            cancelled = self._engine.in_flight() > 0
            self._engine.close(cancel=True, timeout=5.0)
        cancelled = cancelled or shared_cancelled > 0
        failed = self.statistics()["failed"] - before["failed"]
        if failed or cancelled:
            how = ("cancelled with CommunicatorClosedError after the drain" if cancelled
                   else "failed or timed out")
            sys.stderr.write(f"{where} {failed} collective(s) did not complete before exit "
                             f"({how}); call close() on every rank before exiting\n")
        elif pending:
            sys.stderr.write(f"{where} the {pending} collective(s) in flight completed\n")
        sys.stderr.flush()
        self._release()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(cancel=exc[0] is not None)

    def statistics(self) -> dict[str, Any]:
        """Counters of the engine (messages, bytes, completed/failed collectives)
        and calls per collective."""
        stats: dict[str, Any] = self._engine.statistics()
        calls = dict(self._calls)
        for collective, (count,) in list(self._small_counts.items()):
            if count:
                calls[collective] = calls.get(collective, 0) + count
        stats["calls"] = calls
        shared = self._shared
        if shared is not None:  # its calls count as the engine's do
            stats["completed"] += shared.completed
            stats["failed"] += shared.failed
            # Calls, not pieces: one non-blocking call of 6 pieces counted 6.
            stats["in_flight"] += len({id(p.whole) for p in shared.in_flight()})
        stats["shared_memory_calls"] = 0 if shared is None else shared.posted
        stats["broken"] = None if self._engine.broken is None else str(self._engine.broken)
        if self._gpu is not None:
            stats.update(self._gpu.stats)
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
        return self._timeout if timeout is None else check_timeout(timeout)

    @staticmethod
    def _check_algorithm(algorithm: Any, known: tuple[str, ...], default: Any) -> str:
        if algorithm is None:
            return default()
        if not isinstance(algorithm, str) or algorithm not in known:
            raise InvalidArgumentError(
                "algorithm", f"unknown algorithm {algorithm!r}; expected one of {list(known)}")
        return algorithm

    def _reduce(self, collective: str, buf: Any, ranks: tuple[int, ...], op: str,
                algorithm: str | None, timeout: Any, async_op: bool, extra: str,
                fast_key: tuple[Any, ...] | None = None) -> Any:
        self._check_open()
        check_op(op)
        buffer = _host_buffer(buf)
        deadline_s = self._timeout if timeout is None else check_timeout(timeout)
        # What the arguments compile to depends on nothing else: a training
        # loop or a benchmark repeats the same call, so it is worked out once
        # (the small-message path costs its Python, docs/benchmarks.md).
        sched, text = self._prepared_call(
            (collective, ranks, op, algorithm, buffer.count, buffer.dtype.name, extra),
            lambda: self._prepare_reduce(collective, buffer, ranks, op, algorithm, extra))
        check = (_nan_check(collective, op, buffer)
                 if op in ("max", "min") and buffer.dtype.is_float else None)
        if isinstance(sched, SharedCall):
            if fast_key is not None and check is None:
                self._remember_shared(fast_key, buf, sched, buffer)
            return self._submit_shared(sched, buffer.host_array(), buffer.owner, deadline_s,
                                       async_op, check)
        if fast_key is not None and check is None:
            self._remember_fast(fast_key, collective, buf, sched, text, buffer)
        return self._submit(collective, text, sched, buffer, deadline_s, async_op,
                            on_done=check)

    def _try_small(self, fast_key: tuple[Any, ...], buf: np.ndarray, async_op: bool) -> Any:
        """Run (or post, ``async_op``) a call on the small-message path if one
        like it was remembered (only what differs between such calls is
        checked: the buffer's layout); NOT_INLINE if not."""
        try:
            fast = self._fast.get(fast_key)
        except TypeError:  # an unhashable algorithm: the full path names it
            return NOT_INLINE
        if fast is None:
            return NOT_INLINE
        flags = buf.flags
        if not (flags.c_contiguous and flags.writeable and flags.aligned):
            return NOT_INLINE  # the full path names the problem
        return self._submit_small(
            fast, buf if fast.flat else buf.reshape(-1).view(fast.dtype.storage), buf, async_op)

    def _remember_shared(self, fast_key: tuple[Any, ...], buf: np.ndarray, call: SharedCall,
                         buffer: Buffer) -> None:
        """As :meth:`_remember_fast`, for a shared-memory exchange: its own
        SharedCall per key (``flat`` depends on the array's shape)."""
        flat = buf.ndim == 1 and buf.dtype == buffer.dtype.storage
        mine = SharedCall(call.collective, call.members, call.count, call.dtype, call.op,
                          call.text, flat, call.root)
        with self._lock:
            if len(self._fast) >= _PREPARED_LIMIT:
                self._fast.clear()
            self._fast.setdefault(fast_key, mine)

    def _remember_fast(self, fast_key: tuple[Any, ...], collective: str, buf: np.ndarray,
                       sched: Schedule, text: str, buffer: Buffer) -> None:
        """Let later calls on NumPy arrays like ``buf`` with the same
        ``fast_key`` take the small-message path: only calls that run inline
        when the engine is idle (debug fingerprints and group set-up need the
        full path)."""
        if not self._may_run_inline(buffer.nbytes, self._native_ranks(sched)):
            return
        flat = buf.ndim == 1 and buf.dtype == buffer.dtype.storage
        # Under the submission lock, like every use of the engine's programs
        # (another thread may be submitting meanwhile).
        with self._lock:
            if fast_key in self._fast:
                return  # another thread remembered it first
            if len(self._fast) >= _PREPARED_LIMIT:
                self._fast.clear()
            counter = self._small_counts.setdefault(collective, [0])
            self._fast[fast_key] = _FastCall(collective, sched, text, buffer.dtype, flat,
                                             self._engine, counter)

    def _prepared_call(self, key: tuple[Any, ...], prepare: Callable[
            [], tuple[Schedule | SharedCall, str]]) -> tuple[Schedule | SharedCall, str]:
        """What a call's arguments compile to (``prepare()``), worked out once
        per ``key``: a training loop or a benchmark repeats the same call, and
        a SharedCall's plans or a schedule's program are reused with it."""
        try:
            prepared = self._prepared.get(key)
        except TypeError:  # an unhashable algorithm: prepare() names it
            return prepare()
        if prepared is None:
            prepared = prepare()
            if len(self._prepared) >= _PREPARED_LIMIT:
                self._prepared.clear()
            self._prepared[key] = prepared
        return prepared

    def _prepare_reduce(self, collective: str, buffer: Buffer, ranks: tuple[int, ...],
                        op: str, algorithm: Any, extra: str) -> tuple[Schedule | SharedCall, str]:
        """The schedule (or, for the shared-memory exchange, the SharedCall)
        and the description (debug fingerprint, timeouts) of a reduction, its
        algorithm checked or chosen by size."""
        name = self._check_algorithm(
            algorithm, REDUCE_ALGORITHMS, lambda: self._choose_reduce(buffer.nbytes, ranks))
        if name == SHARED_MEMORY:
            if self.size > 1:
                self._check_shared()
                call = SharedCall(collective, ranks, buffer.count, buffer.dtype, op,
                                  describe(collective, ranks, buffer.count, buffer.dtype, op,
                                           extra))
                return call, call.text
            name = "recursive_doubling"  # one rank: nothing to exchange either way
        if name == "native" and not self._transport.supports_native(
                "sum" if op == "avg" else op, buffer.dtype):
            raise UnsupportedError(
                "algorithm", f"the {self._transport.name} transport has no native "
                f"{op} for {buffer.dtype.name}; use another algorithm")
        sched = algorithms.compile_allreduce(self.rank, ranks, buffer.count, op, name)
        # The fingerprint (debug mode) must be alike on every rank of the
        # communicator: a group's default algorithm depends on its size, and
        # groups differ in size where P is no power of S.
        shown = name if algorithm is not None or collective != "group_allreduce" else "default"
        text = (f"{collective}(count={buffer.count},dtype={buffer.dtype.name},op={op}"
                f"{extra},algorithm={shown})")
        return sched, text

    def _choose_reduce(self, nbytes: int, ranks: tuple[int, ...]) -> str:
        """The default algorithm: the shared-memory exchange for a buffer up
        to its limit (``shared_memory_bytes``; every rank on one host; not in
        debug mode, whose fingerprints are message stages), else by size
        (schedule/algorithms.py).
        Decided from what is the same on every rank of the communicator, not
        only of the group: the exchange numbers its calls communicator-wide,
        so a rank alone in its group takes part too (its exchange is a copy)."""
        shared = self._shared
        if (shared is not None and not self._debug
                and nbytes <= shared.max_bytes):
            return SHARED_MEMORY
        return algorithms.choose_allreduce(nbytes, len(ranks))

    def _choose_broadcast(self, nbytes: int, ranks: tuple[int, ...]) -> str:
        """The default broadcast algorithm: the shared-memory exchange where
        the communicator has it (not in debug mode), at any size: unlike a
        reduction it has no rank's work to share out, and it beat the message
        path at every size measured but below 16 KiB on an oversubscribed
        host (docs/benchmarks.md, "Broadcast through shared memory"); else
        by size."""
        if self._shared is not None and not self._debug:
            return SHARED_MEMORY
        return algorithms.choose_broadcast(nbytes, len(ranks))

    def _prepare_broadcast(self, buffer: Buffer, root: int,
                           algorithm: Any) -> tuple[Schedule | SharedCall, str]:
        """As :meth:`_prepare_reduce`, for a broadcast from ``root``."""
        ranks = self._all_ranks
        name = self._check_algorithm(algorithm, BROADCAST_ALGORITHMS,
                                     lambda: self._choose_broadcast(buffer.nbytes, ranks))
        if name == SHARED_MEMORY:
            if self.size > 1:
                self._check_shared()
                call = SharedCall("broadcast", ranks, buffer.count, buffer.dtype, "",
                                  describe("broadcast", ranks, buffer.count, buffer.dtype, "",
                                           f",root={root}"), root=root)
                return call, call.text
            name = "binomial"  # one rank: nothing to exchange either way
        sched = algorithms.compile_broadcast(self.rank, ranks, buffer.count, root, name)
        return sched, (f"broadcast(count={buffer.count},dtype={buffer.dtype.name},root={root},"
                       f"algorithm={name})")

    def _check_shared(self) -> None:
        """Why ``algorithm="shared_memory"`` cannot run here, as a typed error."""
        shared = self._shared
        if shared is None:
            raise UnsupportedError(
                "algorithm", f"{SHARED_MEMORY!r} is unavailable on this communicator: "
                f"{self._transport.shared_unavailable}")

    def _submit_shared(self, call: SharedCall, data: np.ndarray, value: Any, timeout: float,
                       async_op: bool, on_done: Callable[[], None] | None) -> Any:
        """Post one shared-memory exchange (in order, under the submission
        lock) and, blocking, finish it on this thread; non-blocking, its
        handle finishes it (runtime/shared.py)."""
        shared = self._shared
        with self._lock:
            if self._closed or self._engine.broken is not None:
                self._check_open()
            seq = self._seq
            self._seq = seq + 1
            collective = call.collective
            self._calls[collective] = self._calls.get(collective, 0) + 1
            deadline = time.monotonic() + timeout
            pending = shared.post(  # type: ignore[union-attr]
                seq, call, data, deadline, timeout, lazy=async_op)
            if async_op:
                handle = Handle(collective, seq, deadline, self._engine.alive, pending.drive,
                                pending.nudge)
                pending.handle, pending.value, pending.on_done = handle, value, on_done
                shared.track(pending)  # type: ignore[union-attr]
                return handle
        if not pending.complete(deadline):  # another thread still finishing it: closing
            raise CollectiveTimeoutError(collective, seq, [], "another thread was still "
                                         "finishing it at its deadline (shared-memory exchange)")
        if on_done is not None:
            self._check_result(on_done)
        return value

    def _check_result(self, check: Callable[[], None]) -> None:
        """Run a blocking call's result check (NaN in max/min) here, after
        its run was counted completed: a failure counts it failed instead,
        as when the engine runs the check."""
        try:
            check()
        except Exception:
            self._engine.result_check_failed()
            raise

    def _break(self, error: Any) -> None:
        """A shared-memory exchange timed out or lost a member: as for the
        engine's own collectives, the communicator is broken."""
        engine = self._engine
        engine.broken = engine.broken or error

    def _submit(self, collective: str, text: str, sched: Schedule, buffer: Buffer | np.ndarray,
                timeout: float, async_op: bool, *, dtype: Any = None,
                result: Any = ..., on_done: Callable[[], None] | None = None) -> Any:
        """Queue one collective (or run it inline). ``on_done`` checks the
        completed data stage and may raise a WagmaError: the engine then fails
        the Work without breaking the communicator; inline, it is called here."""
        if isinstance(buffer, Buffer):
            data, dt, owner = buffer.host_array(), buffer.dtype, buffer.owner
        else:
            data, dt, owner = buffer, dtype, buffer
        with self._lock:
            self._check_open()
            seq = self._seq
            self._seq += 1
            self._calls[collective] = self._calls.get(collective, 0) + 1
            now = time.monotonic()
            value = owner if result is ... else result
            natives = self._native_ranks(sched)
            # A small blocking call with nothing else in flight runs right here
            # (Engine.run_inline), when it needs no stage before its own (a
            # debug fingerprint, a group's set-up). It runs under the
            # submission lock: other threads' submissions wait for at most
            # the inline run's patience (20 ms) before it hands over to the
            # engine.
            late = (self._engine.run_inline(
                self._engine.program(sched, dt), data, seq, now + timeout, self._inline_work,
                (collective, sched, dt, data, on_done, seq, now, timeout, value, buffer))
                if not async_op and self._may_run_inline(data.nbytes, natives)
                else NOT_INLINE)
            if late is NOT_INLINE:
                work = self._enqueue(collective, text, sched, data, dt, seq, now, timeout,
                                     async_op, value, buffer, on_done, natives)
        if late is not NOT_INLINE:
            if late is not None:  # handed to the engine, which runs on_done
                return late.wait()  # type: ignore[union-attr]
            if on_done is not None:
                self._check_result(on_done)
            return value
        return work.handle if async_op else work.handle.wait()

    def _may_run_inline(self, nbytes: int, natives: tuple[tuple[int, ...], ...]) -> bool:
        """Whether a blocking collective of ``nbytes`` whose native ops use
        the groups ``natives`` may run inline: small, and no stage before its
        own (a debug fingerprint, a group's set-up)."""
        return (nbytes <= INLINE_MAX_BYTES and not (self._debug and self.size > 1)
                and all(self._transport.has_group(r) for r in natives))

    def _submit_small(self, fast: _FastCall | SharedCall, data: np.ndarray, value: Any,
                      async_op: bool = False) -> Any:
        """:meth:`_submit` of a call ``fast`` says may run inline, with the
        communicator's default timeout: the same steps, minus what ``fast``
        settled when it was made (dtype, size, debug, native groups).
        Non-blocking, it is queued as a Work the engine runs straight through
        (Engine._start_here), without waking the progress thread."""
        if type(fast) is SharedCall:
            return self._submit_shared(fast, data, value, self._timeout, async_op, None)
        engine = self._engine
        with self._lock:
            if self._closed or engine.broken is not None:
                self._check_open()
            seq = self._seq
            self._seq = seq + 1
            fast.counter[0] += 1
            now = time.monotonic()
            timeout = self._timeout
            program = (fast.program if fast.generation == engine.generation
                       else fast.refresh(engine))
            if async_op:
                work = self._inline_work(fast.collective, fast.sched, fast.dtype, data, None,
                                         seq, now, timeout, value, data)
                work.program = program
                engine.submit(work, wake=LAZY)
                return work.handle
            late = engine.run_inline(
                program, data, seq, now + timeout, self._inline_work,
                (fast.collective, fast.sched, fast.dtype, data, None, seq, now, timeout,
                 value, data))
            if late is NOT_INLINE:
                work = self._enqueue(fast.collective, fast.text, fast.sched, data, fast.dtype,
                                     seq, now, timeout, False, value, data, None,
                                     self._native_ranks(fast.sched))
        if late is None:
            return value
        if late is not NOT_INLINE:
            return late.wait()  # type: ignore[union-attr]
        return work.handle.wait()

    def _enqueue(self, collective: str, text: str, sched: Schedule, data: np.ndarray,
                 dt: DType, seq: int, now: float, timeout: float, async_op: bool, value: Any,
                 keepalive: Any, on_done: Callable[[], None] | None,
                 natives: tuple[tuple[int, ...], ...]) -> Work:
        """Queue collective ``seq`` for the engine, behind a debug fingerprint
        and its native groups' set-up where needed; under the submission lock."""
        stages: list[Stage] = []
        if self._debug and self.size > 1:
            stages.append(debug.fingerprint_stage(self.rank, self.size, seq, collective, text))
        requires: tuple[tuple[int, ...], ...] = ()
        creates: tuple[tuple[int, ...], ...] = ()
        if natives:
            setup, requires, creates = self._setup_stages(sched)
            stages.extend(setup)
        stages.append(Stage(sched, CHANNEL_DATA, {DATA: data}, dt, on_done=on_done))
        engine = self._engine
        # Small and non-blocking: run straight through by whoever starts it
        # (its waiter, usually), and not worth waking the progress thread for.
        lazy = (async_op and len(stages) == 1 and not requires
                and data.nbytes <= INLINE_MAX_BYTES)
        handle = Handle(collective, seq, now + timeout, engine.alive, engine.drive_until,
                        engine.nudge)
        work = Work(seq, collective, handle, stages, now + timeout, timeout,
                    result=value, keepalive=keepalive, requires=requires, creates=creates,
                    on_complete=self._setup_failed(creates) if creates else None,
                    program=engine.program(sched, dt) if lazy else None)
        # A blocking call drives its own work: no need to wake the thread.
        engine.submit(work, wake=LAZY if lazy else async_op)
        return work

    def _inline_work(self, collective: str, sched: Schedule, dt: DType, data: np.ndarray,
                     on_done: Callable[[], None] | None, seq: int, now: float, timeout: float,
                     value: Any, buffer: Any) -> Work:
        """The one-stage Work of a small call: an inline run a late peer made
        the engine take over, or a queued non-blocking one (a method, not a
        closure: a closure's cells would be made on every call of _submit)."""
        stage = Stage(sched, CHANNEL_DATA, {DATA: data}, dt, on_done=on_done)
        handle = Handle(collective, seq, now + timeout, self._engine.alive,
                        self._engine.drive_until, self._engine.nudge)
        return Work(seq, collective, handle, [stage], now + timeout, timeout,
                    result=value, keepalive=buffer)

    # -- GPU buffers ------------------------------------------------------------
    def _gpu_queue(self, device_id: int) -> Any:
        """The GPU queue of this communicator, created at the first GPU buffer
        (NCCL itself starts on the progress thread, at the first collective)."""
        with self._gpu_lock:
            if self._gpu is None:
                from .runtime.gpu import GpuQueue
                from .transport.nccl import NCCLTransport, unavailable_reason

                reason = unavailable_reason()
                if reason is not None:
                    raise UnsupportedError("buf", f"cuda:{device_id} buffer given but {reason}")
                mpi = self._transport

                def make(dev: int, stream: Any, deadline: float, watch: Any) -> Any:
                    return NCCLTransport(mpi.rank, mpi.size, dev, stream,
                                         mpi.exchange_bytes, deadline, watch)

                live = self._liveness
                self._gpu = GpuQueue(self._engine, device_id, make,
                                     live.dead if live is not None else None,
                                     range(self.size))
            elif self._gpu.device_id != device_id:
                raise UnsupportedError(
                    "buf", f"buffer is on cuda:{device_id} but this communicator's GPU "
                    f"collectives run on cuda:{self._gpu.device_id} (one device per rank)")
            return self._gpu

    def _gpu_collective(self, collective: str, buf: Any, device: int, kind: str,
                        ranks: tuple[int, ...], op: str, algorithm: str | None, root: int,
                        partition: tuple[tuple[int, ...], ...] | None, timeout: Any,
                        async_op: bool) -> Any:
        """A collective on a GPU buffer: compiled and planned here, issued to
        NCCL by the progress thread (runtime/gpu.py). Default algorithm:
        "native" (NCCL's own collective on the group's communicator)."""
        from .runtime.gpu import GpuWork, plan

        self._check_open()
        if kind == "allreduce":
            check_op(op)
        queue = self._gpu_queue(device)
        buffer = as_buffer(buf, "buf", gpu_available=True, stream=queue.stream.ptr)
        deadline_s = self._call_timeout(timeout)
        known = (algorithms.ALLREDUCE_ALGORITHMS if kind == "allreduce"
                 else algorithms.BROADCAST_ALGORITHMS)
        if algorithm == SHARED_MEMORY:
            raise UnsupportedError("algorithm", f"{SHARED_MEMORY!r} is for host memory; "
                                   f"buf is on cuda:{device}")
        name = self._check_algorithm(algorithm, known, lambda: "native")
        if name != "native" or len(ranks) == self.size:
            partition = None  # point-to-point over the world communicator
        scheds, waves = plan(kind, ranks, buffer.count, op, name, root)
        with self._lock:
            self._check_open()
            seq = self._seq
            self._seq += 1
            self._calls[collective] = self._calls.get(collective, 0) + 1
            now = time.monotonic()
            handle = Handle(collective, seq, now + deadline_s, self._engine.alive)
            queue.submit(GpuWork(seq, collective, handle, scheds[self.rank], waves[self.rank],
                                 buffer.ptr, buffer.dtype, partition, now + deadline_s,
                                 deadline_s, buffer.owner, buffer))
        return handle if async_op else handle.wait()

    def _setup_failed(self, creates: tuple[tuple[int, ...], ...]) -> Callable[[Any, Any], None]:
        """on_complete of a collective that sets up the groups ``creates``: if it
        failed before creating one, the next call on that group sets it up again."""
        def forget(result: Any, error: BaseException | None) -> None:
            if error is not None:
                for ranks in creates:
                    if not self._transport.has_group(ranks):
                        self._native_groups.discard(ranks)
        return forget

    def _native_ranks(self, sched: Schedule) -> tuple[tuple[int, ...], ...]:
        """The groups of ``sched``'s native ops (none for a DAG schedule),
        remembered per schedule: every call asks."""
        cached = self._natives.get(id(sched))
        if cached is None or cached[0] is not sched:
            if len(self._natives) >= _PREPARED_LIMIT:
                self._natives.clear()
            cached = (sched, tuple(op.ranks for op in sched.ops if isinstance(op, Native)))
            self._natives[id(sched)] = cached
        return cached[1]

    def _setup_stages(self, sched: Schedule) -> tuple[
            list[Stage], tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        """Native collectives over a group need the group's own MPI communicator,
        created once, after a barrier over the group proves every member present
        (so the blocking creation call cannot hang on a missing rank).

        Returns the set-up stages this collective runs, the groups whose
        set-up an earlier collective runs and has not finished (the engine
        starts this one only after they exist: Work.requires, so a native call
        never precedes its communicator and calls on it keep their order), and
        the groups this one sets up (Work.creates)."""
        out: list[Stage] = []
        requires: list[tuple[int, ...]] = []
        creates: list[tuple[int, ...]] = []
        for ranks in self._native_ranks(sched):
            if self._transport.has_group(ranks):
                continue
            if ranks in self._native_groups:
                requires.append(ranks)
                continue
            self._native_groups.add(ranks)
            creates.append(ranks)
            barrier = algorithms.compile_barrier(self.rank, ranks)
            out.append(Stage(barrier, CHANNEL_SETUP, {DATA: np.zeros(0, np.uint8)}, UINT8,
                             on_done=lambda r=ranks: self._transport.create_group(r)))
        return out, tuple(requires), tuple(creates)


def default_timeout(timeout: float | None) -> float:
    """``timeout``, else ``WAGMA_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`.
    A bad ``WAGMA_TIMEOUT`` is an InvalidArgumentError naming the variable
    (not a bare ValueError, nor one blaming a ``timeout`` nobody passed)."""
    if timeout is not None:
        return timeout
    env_timeout = os.environ.get("WAGMA_TIMEOUT", "").strip()
    if not env_timeout:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(env_timeout)
    except ValueError:
        raise InvalidArgumentError(
            "WAGMA_TIMEOUT", f"expected seconds as a number, got {env_timeout!r}") from None
    return check_timeout(value, "WAGMA_TIMEOUT")


def init(timeout: float | None = None, *, mpi_comm: Any = None,
         debug: bool | None = None) -> Communicator:
    """Create a communicator over ``mpi_comm`` (default MPI_COMM_WORLD).

    Works under ``mpiexec``/``srun`` and as a single process. MPI is initialised
    with MPI_THREAD_MULTIPLE (our progress thread calls MPI while your threads
    may too). ``timeout`` is the default deadline of every collective (seconds),
    and of ``init`` itself: a rank that never calls it makes the others raise
    CollectiveTimeoutError instead of waiting forever.
    """
    deadline_s = check_timeout(default_timeout(timeout))  # before any MPI call
    # Likewise the environment the engine and the kernels read later (a bad
    # value failed after the transport's set-up, or mid-collective).
    watchdog_seconds()
    check_environment()
    host_threads()
    max_bytes_override()  # (it was checked after MPI's set-up, only where a segment was made)
    if debug is not None and not isinstance(debug, bool):
        raise InvalidArgumentError("debug", f"expected None, True or False, got {debug!r}")
    from mpi4py import MPI

    from .transport.mpi import MPITransport

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise UnsupportedError(
            "mpi4py", "MPI was initialised without MPI_THREAD_MULTIPLE; wagma_comm's "
            "progress thread needs it (leave mpi4py.rc.thread_level at 'multiple')")
    comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    # Checked here: MPITransport would fail inside its first MPI call with an
    # AttributeError or a raw MPI.Exception that names no argument.
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise InvalidArgumentError(
            "mpi_comm", f"expected an mpi4py intracommunicator (e.g. MPI.COMM_WORLD or one "
            f"made by Split/Dup), got {'MPI.COMM_NULL' if comm == MPI.COMM_NULL else repr(comm)}")
    return Communicator(MPITransport(comm, timeout=deadline_s), timeout=deadline_s,
                        debug_mode=debug)
