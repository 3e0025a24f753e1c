"""GPU memory over NCCL (nccl4py), stream-ordered.

Why nccl4py and not ``cupy.cuda.nccl`` (docs/gpu.md has the details): it
exposes non-blocking communicators (so no call can block our progress thread
past a deadline), ncclCommSplit (communicators per group from the world
communicator, sharing its resources), ncclCommAbort, ncclCommGetAsyncError and
PreMulSum; CuPy's wrapper has no split and no non-blocking mode.

Every method runs on the communicator's progress thread (runtime/gpu.py), which
issues every NCCL call of the process in collective-submission order: every
rank submits its collectives in the same order, so every rank makes its NCCL
calls in the same order, on every communicator, and several communicators in
flight cannot deadlock.

A collective is enqueued whole: its waves (schedule/waves.py) become one
ncclGroupStart/End of sends and receives each, followed by our reduction
kernels, all on one stream; a CUDA event recorded after the last op tells the
engine when it is done. A native op becomes one ncclAllReduce/ncclBroadcast on
the group's communicator.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..dtypes import DType
from ..errors import TransportError, UnsupportedError
from ..schedule.ir import DATA, Copy, Native, Recv, Reduce, Scale, Schedule, Send, Slot

NCCL_IN_PROGRESS = 7  # ncclInProgress
_NCCL_UINT8 = 1
_NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
_SETTLE_SLEEP_S = 50e-6
UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
_log = logging.getLogger("wagma_comm.gpu")


def unavailable_reason() -> str | None:
    """Why GPU buffers cannot be used here (None when they can)."""
    try:
        import cupy

        importlib.import_module("nccl.core")  # nccl4py
    except Exception as exc:  # noqa: BLE001 -- any import failure means "no"
        return f"the GPU path needs cupy and nccl4py (the cuda12/cuda13 extra): {exc}"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device is visible"
    except Exception as exc:  # noqa: BLE001
        return f"CUDA is not usable: {exc}"
    return None


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    if status is None and exc.args and isinstance(exc.args[0], int):
        status = exc.args[0]
    return None if status is None else int(status)


Watch = Callable[[], None]
"""Called every _WATCH_S while a call settles; raises (RankFailedError) when
a member has died, so a dead peer is named at once, not at the deadline."""
_WATCH_S = 0.25


def settle(nb: Any, comm: Any, deadline: float, what: str, watch: Watch | None = None) -> None:
    """Wait until a non-blocking communicator has finished its last call
    (ncclInProgress -> ncclSuccess), at most until ``deadline`` (then
    TimeoutError). ``nb``: nccl4py's raw bindings."""
    next_watch = time.monotonic() + _WATCH_S
    while True:
        try:
            state = int(nb.comm_get_async_error(comm._comm))
        except Exception as exc:  # noqa: BLE001 -- say which call it was
            raise TransportError(f"NCCL {what}: polling its state failed: {exc}",
                                 _status(exc)) from exc
        if state == 0:
            return
        if state != NCCL_IN_PROGRESS:
            raise TransportError(f"NCCL {what} failed: {nb.get_error_string(state)}"
                                 if hasattr(nb, "get_error_string")
                                 else f"NCCL {what} failed with code {state}", state)
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"NCCL {what} still in progress at the deadline")
        if watch is not None and now >= next_watch:
            next_watch = now + _WATCH_S
            watch()
        time.sleep(_SETTLE_SLEEP_S)


def call_settled(nb: Any, call: Any, comm: Any, deadline: float, what: str,
                 watch: Watch | None = None) -> Any:
    """Run one NCCL call; on a non-blocking communicator it may answer
    ncclInProgress, and the communicator must settle before the next call.
    ``comm`` None: the call makes the communicator (it returns it)."""
    try:
        result = call()
    except Exception as exc:  # nccl4py raises NCCLError for any non-success
        if _status(exc) != NCCL_IN_PROGRESS:
            raise TransportError(f"NCCL {what} failed: {exc}", _status(exc)) from exc
        result = None
    target = comm if comm is not None else result
    if target is not None:
        settle(nb, target, deadline, what, watch)
    return result


@dataclass
class Pending:
    """A collective enqueued on the stream: done when ``event`` has fired."""

    event: Any
    keepalive: list[Any] = field(default_factory=list)  # scratch buffers


class NCCLTransport:
    """The world communicator, the group communicators, our stream and kernels."""

    name = "nccl"

    def __init__(self, rank: int, size: int, device_id: int, stream: Any,
                 exchange_bytes: Callable[[bytes | None, int, float], bytes],
                 deadline: float, watch: Watch | None = None) -> None:
        """Join the world communicator (collective over all ranks). ``stream``
        is the communicator's stream on ``device_id``; ``exchange_bytes``
        broadcasts rank 0's NCCL unique id over MPI."""
        import cupy
        import nccl.core as nc
        from nccl.bindings import nccl as nb

        from ..kernels.device import kernels

        self._cp, self._nc, self._nb = cupy, nc, nb
        # Set by the GPU queue for each collective it issues (runtime/gpu.py).
        self.watch = watch
        self.rank, self.size = rank, size
        self.device_id = device_id
        self._device = cupy.cuda.Device(device_id)
        self.stream = stream
        with self._device:
            self.kernels = kernels(device_id)
        _log.debug("kernels loaded")
        self._exchange = exchange_bytes
        self.group_method = "split"
        mine = bytes(nc.get_unique_id()) if rank == 0 else None
        uid = exchange_bytes(mine, UNIQUE_ID_BYTES, deadline)
        _log.debug("unique id exchanged")
        self._config = nc.NCCLConfig(blocking=False)
        # Group communicators: blocking, sharing the world's resources. Split
        # is only ever called where every rank calls it (a group collective
        # that all ranks reach at the same point of their sequence).
        self._split_config = nc.NCCLConfig(blocking=True, split_share=True)
        started = time.monotonic()
        with self._device:
            self.world = self._call_settled(
                lambda: nc.Communicator.init(self.size, self.rank, nc.UniqueId.from_bytes(uid),
                                             self._config), None, deadline,
                "ncclCommInitRank")
        self.init_seconds = time.monotonic() - started
        _log.debug("world communicator ready")
        self._groups: dict[tuple[tuple[int, ...], ...], Any] = {}  # partition -> comm
        self.broken: str | None = None

    @property
    def nccl_version(self) -> str:
        v = self._nb.get_version()
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"

    # -- issuing ------------------------------------------------------------
    def _call_settled(self, call: Any, comm: Any, deadline: float, what: str) -> Any:
        return call_settled(self._nb, call, comm, deadline, what, self.watch)

    def group_comm(self, ranks: tuple[int, ...], partition: tuple[tuple[int, ...], ...],
                   deadline: float) -> Any:
        """The communicator of ``ranks``, one of the groups of ``partition``.

        Made once per partition (group size, step), collectively over every
        rank (all ranks reach the same group collective at the same point of
        their collective sequence), then a dict lookup. First choice:
        ncclCommSplit of the world communicator, sharing its resources. Where
        NCCL refuses the split (seen with several ranks per GPU, NCCL 2.30.7:
        the child's state query answers InvalidArgument), every group gets its
        own ncclCommInitRank instead, with unique ids rank 0 makes and
        broadcasts over MPI; ``group_method`` says which is in use."""
        if len(ranks) == self.size:
            return self.world
        key = partition
        comm = self._groups.get(key)
        if comm is None:
            if self.group_method == "split":
                try:
                    comm = self._split(key, deadline)
                except TransportError as exc:
                    _log.warning("ncclCommSplit refused (%s); group communicators are "
                                 "initialised one by one from now on", exc)
                    self.group_method = "init"
            if comm is None:
                comm = self._init_group(key, deadline)
            self._groups[key] = comm
        return comm

    def _split(self, key: tuple[tuple[int, ...], ...], deadline: float) -> Any:
        color = next(i for i, g in enumerate(key) if self.rank in g)
        with self._device:
            return self._call_settled(
                lambda: self.world.split(color, self.rank, self._split_config), None,
                deadline, "ncclCommSplit")

    def _init_group(self, key: tuple[tuple[int, ...], ...], deadline: float) -> Any:
        nc = self._nc
        mine = (b"".join(bytes(nc.get_unique_id()) for _ in key) if self.rank == 0
                else None)
        ids = self._exchange(mine, UNIQUE_ID_BYTES * len(key), deadline)
        index = next(i for i, g in enumerate(key) if self.rank in g)
        group = key[index]
        uid = nc.UniqueId.from_bytes(ids[index * UNIQUE_ID_BYTES:(index + 1) * UNIQUE_ID_BYTES])
        with self._device:
            return self._call_settled(
                lambda: nc.Communicator.init(len(group), group.index(self.rank), uid,
                                             self._config), None, deadline,
                "ncclCommInitRank (group)")

    def enqueue(self, sched: Schedule, waves: Sequence[Sequence[int]], data: int,
                dtype: DType, group: Any, deadline: float) -> Pending:
        """Enqueue ``sched`` (this rank's schedule, grouped into ``waves``) on
        the stream over the buffer at device address ``data``."""
        with self._device, self.stream:
            return self._enqueue(sched, waves, data, dtype, group, deadline)

    def _enqueue(self, sched: Schedule, waves: Sequence[Sequence[int]], data: int,
                 dtype: DType, group: Any, deadline: float) -> Pending:
        cp, nb = self._cp, self._nb
        size = dtype.itemsize
        keep: list[Any] = []
        base = {DATA: data}
        for name, count in sched.scratch:
            # cupy's pool is stream-ordered: allocated on our stream, reused
            # only after the work on it that used the memory before.
            arr = cp.empty(max(count, 1) * size, dtype=cp.uint8)
            keep.append(arr)
            base[name] = int(arr.data.ptr)

        def addr(slot: Slot) -> int:
            return base[slot.buf] + slot.offset * size

        stream = self.stream.ptr
        world = self.world._comm
        for wave in waves:
            ops = [sched.ops[i] for i in wave]
            # Empty chunks' zero-byte messages (schedule/algorithms.py) serve
            # the host path's size check; NCCL matches by order and checks no
            # size, so both ends skip them alike.
            p2p = [op for op in ops if (isinstance(op, Send) and op.src.count)
                   or (isinstance(op, Recv) and op.dst.count)]
            if p2p:
                def issue_p2p() -> None:
                    nb.group_start()
                    try:
                        for op in p2p:
                            if isinstance(op, Send):
                                nb.send(addr(op.src), op.src.count * size, _NCCL_UINT8,
                                        op.peer, world, stream)
                            else:
                                nb.recv(addr(op.dst), op.dst.count * size, _NCCL_UINT8,
                                        op.peer, world, stream)
                    finally:
                        nb.group_end()
                self._call_settled(issue_p2p, self.world, deadline, "send/recv group")
            for op in ops:
                if isinstance(op, Native):
                    self._native(op, addr(op.buf), dtype, group, deadline)
                elif isinstance(op, Reduce):
                    self.kernels.reduce(addr(op.dst), addr(op.src), op.dst.count, op.op,
                                        dtype, self.stream)
                elif isinstance(op, Scale):
                    self.kernels.scale(addr(op.dst), op.dst.count, op.divisor, dtype,
                                       self.stream)
                elif isinstance(op, Copy):
                    cp.cuda.runtime.memcpyAsync(addr(op.dst), addr(op.src),
                                                op.dst.count * size, 3, stream)
        event = cp.cuda.Event(disable_timing=True)
        event.record(self.stream)
        return Pending(event, keep)

    def _native(self, op: Native, ptr: int, dtype: DType, group: Any, deadline: float) -> None:
        nb, comm = self._nb, group if group is not None else self.world
        count = op.buf.count
        if op.kind == "allreduce":
            code = _NCCL_OPS.get(op.op)
            if code is None:
                raise UnsupportedError("op", f"NCCL has no {op.op!r} reduction")
            self._call_settled(
                lambda: nb.all_reduce(ptr, ptr, count, dtype.nccl, code, comm._comm,
                                      self.stream.ptr), comm, deadline, "ncclAllReduce")
        else:
            root = list(op.ranks).index(op.root)
            self._call_settled(
                lambda: nb.broadcast(ptr, ptr, count * dtype.itemsize, _NCCL_UINT8, root,
                                     comm._comm, self.stream.ptr), comm, deadline,
                "ncclBroadcast")

    # -- progress -----------------------------------------------------------
    @staticmethod
    def done(pending: Pending) -> bool:
        return bool(pending.event.done)

    def async_error(self) -> str | None:
        """NCCL's asynchronous error on any communicator (a peer's failure
        surfaces here), or None."""
        for comm in [self.world, *self._groups.values()]:
            state = int(self._nb.comm_get_async_error(comm._comm))
            if state not in (0, NCCL_IN_PROGRESS):
                return f"NCCL reported error code {state} ({comm.get_last_error()})"
        return None

    def abort(self, reason: str) -> None:
        """Abort every communicator: in-flight NCCL kernels return, nothing
        hangs. The transport is unusable afterwards."""
        self.broken = reason
        for comm in [*self._groups.values(), self.world]:
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 -- best effort on the way down
                pass
        self._groups.clear()

    def close(self, deadline: float) -> None:
        """Let enqueued work finish (bounded), then release the communicators."""
        if self.broken is not None:
            return
        while not self.stream.done and time.monotonic() < deadline:
            time.sleep(1e-3)
        if not self.stream.done:
            self.abort("close() found GPU work still running at its deadline")
            return
        for comm in [*self._groups.values(), self.world]:
            try:
                comm.destroy()
            except Exception:  # noqa: BLE001
                pass
        self._groups.clear()
        self.broken = "closed"

