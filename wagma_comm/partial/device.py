"""Persistent partial collectives on GPU buffers: control on the host, data over NCCL.

The rounds' machinery (activation tokens, arrival checks, member flags,
staleness, telemetry: partial/base.py) is the host path's, unchanged; it
travels over MPI in small host messages. What moves to the GPU is the data:

* the published model (WAGMA) or the gradient accumulator (solo, majority),
  the round buffers and the results live on the rank's GPU, and the rounds'
  copies, adds and the fused average are our CUDA kernels (``DeviceMemory``);
* a round's sum is one ``ncclAllReduce`` on a communicator of the round's
  group, made for this collective at creation (``DeviceRounds``).

Why own communicators and two streams (docs/gpu.md, "Partial collectives"):
a round starts when its activation arrives, at a different point of each
rank's sequence of collectives, so sharing NCCL communicators or a stream with
the communicator's ordinary GPU collectives could order two NCCL calls
differently on two ranks, a deadlock. One collective's rounds run in round
order on every member, which is all NCCL needs. Rounds go on the *round
stream*, where an allreduce may wait for a late member; copies and kernels go
on the *local stream*, which never waits for a peer, so ``step``, ``publish``
and the averaging never queue behind a round. Every communicator is connected
at creation (one allreduce of the round size), so issuing a round never
blocks the progress thread on a peer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .. import groups as groups_mod
from ..buffers import as_buffer, cuda_device
from ..dtypes import DType
from ..errors import (
    CollectiveTimeoutError,
    InvalidArgumentError,
    RankFailedError,
    TransportError,
    UnsupportedError,
    WagmaError,
)
from ..runtime.gpu import dead_elsewhere, dead_within, timeout_blame
from ..transport.nccl import NCCL_IN_PROGRESS, UNIQUE_ID_BYTES, call_settled, unavailable_reason
from .base import agree, check_first_round, check_step_shape, check_sync_every
from .eager import MajorityAllreduce, SoloAllreduce
from .wagma import WaitAvoidingGroupAllreduce, check_options

_NCCL_SUM = 0
_HEALTH_CHECK_S = 0.25  # how often NCCL's async errors and the members' liveness are read
_POLL_SLEEP_S = 20e-6


def wait_stream(stream: Any, deadline: float, what: str) -> None:
    """Block until ``stream`` has run everything queued on it, at most until
    ``deadline`` (TimeoutError)."""
    while not stream.done:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: GPU work still running at the deadline")
        time.sleep(_POLL_SLEEP_S)


class DeviceMemory:
    """partial/memory.HostMemory's operations on GPU arrays (CuPy arrays of the
    dtype's storage type), queued on the local stream; ``settle`` waits."""

    def __init__(self, dtype: DType, device_id: int, stream: Any, timeout: float) -> None:
        import cupy

        from ..kernels.device import kernels

        self._cp, self.dtype, self.stream = cupy, dtype, stream
        self._device = cupy.cuda.Device(device_id)
        self._timeout = timeout
        with self._device:
            self._kernels = kernels(device_id)

    def view(self, ptr: int, count: int, owner: Any) -> Any:
        """A CuPy array over ``count`` elements of someone else's memory."""
        cp = self._cp
        memory = cp.cuda.UnownedMemory(ptr, count * self.dtype.itemsize, owner,
                                       self._device.id)
        return cp.ndarray((count,), self.dtype.storage, cp.cuda.MemoryPointer(memory, 0))

    def empty(self, count: int) -> Any:
        with self._device, self.stream:
            return self._cp.empty(count, self.dtype.storage)

    def zeros(self, count: int) -> Any:
        out = self.empty(count)
        self.zero(out)
        self.settle()
        return out

    def clone(self, src: Any) -> Any:
        out = self.empty(src.size)
        self.copy(out, src)
        self.settle()
        return out

    def copy(self, dst: Any, src: Any) -> None:
        self._cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, dst.nbytes, 3,
                                          self.stream.ptr)  # 3: device to device

    def zero(self, dst: Any) -> None:
        self._cp.cuda.runtime.memsetAsync(dst.data.ptr, 0, dst.nbytes, self.stream.ptr)

    def add(self, dst: Any, src: Any) -> None:
        with self._device:
            self._kernels.reduce(dst.data.ptr, src.data.ptr, dst.size, "sum", self.dtype,
                                 self.stream)

    def average(self, out: Any, parts: Sequence[Any], divisor: int) -> None:
        """``out = sum(parts) / divisor``: the fused kernel for floats (float32
        accumulation for 16-bit floats); integers add (wrapping) then floor-divide."""
        with self._device:
            if self.dtype.is_float:
                self._kernels.average(out.data.ptr, [p.data.ptr for p in parts], out.size,
                                      divisor, self.dtype, self.stream)
                return
            rest = [p for p in parts if p is not out]
            if len(rest) == len(parts):
                self.copy(out, rest.pop(0))
            for part in rest:
                self.add(out, part)
            self._kernels.scale(out.data.ptr, out.size, divisor, self.dtype, self.stream)

    def set_flags(self, flags: Any, index: int | None, one: Any) -> None:
        self.zero(flags)
        if index is not None:
            with self._device, self.stream:
                flags[index:index + 1].fill(one)

    def to_host(self, arr: Any) -> np.ndarray:
        with self._device:
            return arr.get(stream=self.stream)

    def settle(self) -> None:
        """Wait for the local stream (it never waits for a peer: bounded by
        local work), at most the collective's timeout (then TransportError)."""
        try:
            wait_stream(self.stream, time.monotonic() + self._timeout,
                        "the partial collective's copies and kernels")
        except TimeoutError as exc:
            raise TransportError(str(exc)) from exc


def distinct_groups(partitions: Sequence[Sequence[tuple[int, ...]]]) -> list[tuple[int, ...]]:
    """Every group of more than one rank in ``partitions``, once, in a fixed
    order: each rank makes the communicators of its groups in this order, so
    every communicator's members make it together (the lowest one not yet
    made always has all its members at it)."""
    seen: dict[tuple[int, ...], None] = {}
    for partition in partitions:
        for group in partition:
            if len(group) > 1:
                seen.setdefault(tuple(group), None)
    return list(seen)


@dataclass
class DeviceRound:
    """One round (or flush) on the GPU: ``base._arrive`` reads ``seq`` and
    changes ``patient``/``deadline`` as it does for a host round's Work."""

    seq: int
    members: tuple[int, ...]
    buf: Any
    on_complete: Callable[[Any, BaseException | None], None]
    deadline: float
    patient: bool
    label: str
    event: Any = None


class DeviceRounds:
    """The NCCL side of one partial collective: its round stream, and one
    communicator per group this rank is in (made in :meth:`connect`)."""

    def __init__(self, device_id: int) -> None:
        import cupy
        from nccl.bindings import nccl as nb

        self._cp, self._nb = cupy, nb
        self.device_id = device_id
        self.dtype: DType | None = None  # the rounds' dtype, set by connect
        self._device = cupy.cuda.Device(device_id)
        with self._device:
            self.local = cupy.cuda.Stream(non_blocking=True)
            self.rounds = cupy.cuda.Stream(non_blocking=True)
        self._comms: dict[tuple[int, ...], Any] = {}
        self.connect_seconds = 0.0
        self.broken: str | None = None

    def connect(self, comm: Any, groups: list[tuple[int, ...]], count: int, dtype: DType,
                timeout: float) -> None:
        """Collective over every rank: make and connect the communicators of
        ``groups`` (distinct_groups), each with a unique id rank 0 makes.
        ``count``: the data elements of a round (each group adds its flags)."""
        import nccl.core as nc

        self.dtype = dtype
        started = time.monotonic()
        deadline = started + timeout
        ids = np.zeros((max(1, len(groups)), UNIQUE_ID_BYTES), dtype=np.uint8)
        if comm.rank == 0:
            for k in range(len(groups)):
                ids[k] = np.frombuffer(bytes(nc.get_unique_id()), dtype=np.uint8)
        comm.broadcast(ids, 0, timeout=timeout)
        config = nc.NCCLConfig(blocking=False)
        with self._device:
            for k, group in enumerate(groups):
                if comm.rank not in group:
                    continue
                uid = nc.UniqueId.from_bytes(ids[k].tobytes())
                self._comms[group] = self._settled(
                    lambda: nc.Communicator.init(len(group), group.index(comm.rank), uid,
                                                 config), None, deadline,
                    f"ncclCommInitRank of group {list(group)}")
            # Connect now (NCCL connects peers at a communicator's first
            # collective of a kind): an allreduce of the rounds' size on each.
            scratch = []
            for group, nccl_comm in self._comms.items():
                n = count + len(group)
                with self.rounds:
                    buf = self._cp.zeros(n, dtype.storage)
                scratch.append(buf)
                self._allreduce(buf.data.ptr, n, nccl_comm, deadline)
            wait_stream(self.rounds, deadline, "connecting the partial collective's "
                        "NCCL communicators")
        self.connect_seconds = time.monotonic() - started

    def _settled(self, call: Callable[[], Any], comm: Any, deadline: float,
                 what: str) -> Any:
        try:
            return call_settled(self._nb, call, comm, deadline, what)
        except TimeoutError as exc:
            raise TransportError(f"NCCL {what}: {exc}") from exc

    def _allreduce(self, ptr: int, count: int, nccl_comm: Any, deadline: float) -> None:
        assert self.dtype is not None, "connect() first"
        nccl_type = self.dtype.nccl
        self._settled(lambda: self._nb.all_reduce(ptr, ptr, count, nccl_type, _NCCL_SUM,
                                                  nccl_comm._comm, self.rounds.ptr),
                      nccl_comm, deadline, "ncclAllReduce (partial collective round)")

    def local_mark(self) -> Any:
        """An event after everything queued on the local stream so far."""
        with self._device:
            event = self._cp.cuda.Event(disable_timing=True)
            event.record(self.local)
        return event

    def start(self, rnd: DeviceRound, count: int, ready: Any) -> None:
        """Queue the round's sum on the round stream, after ``ready`` (the
        event that follows its snapshot and flags on the local stream)."""
        with self._device:
            self.rounds.wait_event(ready)
            if len(rnd.members) > 1:
                self._allreduce(rnd.buf.data.ptr, count, self._comms[rnd.members],
                                rnd.deadline)
            rnd.event = self._cp.cuda.Event(disable_timing=True)
            rnd.event.record(self.rounds)

    def async_error(self) -> str | None:
        for group, nccl_comm in self._comms.items():
            state = int(self._nb.comm_get_async_error(nccl_comm._comm))
            if state not in (0, NCCL_IN_PROGRESS):
                return f"NCCL reported error code {state} on the communicator of {list(group)}"
        return None

    def abort(self, reason: str) -> None:
        """Abort every communicator: a round kernel waiting for a dead or
        absent member returns, nothing stays blocked on the GPU."""
        if self.broken is None:
            self.broken = reason
        for nccl_comm in self._comms.values():
            try:
                nccl_comm.abort()
            except Exception:  # noqa: BLE001 -- best effort on the way down
                pass
        self._comms.clear()

    def close(self, deadline: float) -> None:
        """Let queued work finish (bounded, else abort), then free the communicators."""
        if self.broken is not None:
            return
        try:
            wait_stream(self.rounds, deadline, "closing")
            wait_stream(self.local, deadline, "closing")
        except TimeoutError as exc:
            self.abort(str(exc))
            return
        for nccl_comm in self._comms.values():
            try:
                nccl_comm.destroy()
            except Exception:  # noqa: BLE001
                pass
        self._comms.clear()
        self.broken = "closed"


class DevicePartial:
    """Mixin, first base of a PartialCollective subclass: its data on the GPU
    (see the module's docstring). ``_prepare`` runs before the base's
    ``__init__``; ``connect`` is collective, after the creation agreement."""

    _dev: DeviceRounds

    def _intake(self, buf: Any) -> Any:
        device = cuda_device(buf)
        if device is None:
            raise UnsupportedError("buf", "the device path takes CUDA buffers only")
        self._dev = DeviceRounds(device)
        self._in_flight: DeviceRound | None = None
        self._next_check = 0.0
        return as_buffer(buf, "buf", gpu_available=True, stream=self._dev.local.ptr)

    def _memory(self) -> DeviceMemory:
        return DeviceMemory(self.dtype, self._dev.device_id, self._dev.local, self.timeout)

    def connect(self, partitions: Sequence[Sequence[tuple[int, ...]]]) -> None:
        """Collective: the NCCL communicators of every group of ``partitions``."""
        self._dev.connect(self._comm, distinct_groups(partitions), self.count, self.dtype,
                          self.timeout)

    # -- data where it lives ------------------------------------------------------
    def _template_data(self) -> tuple[Any, Any]:
        return self._mem.view(self._template.ptr, self.count, self._template.owner), \
            self._template.owner

    def _check_buf(self, buf: Any) -> tuple[Any, Any]:
        buffer = as_buffer(buf, "buf", gpu_available=True, stream=self._dev.local.ptr)
        if buffer.device != "cuda" or buffer.device_id != self._dev.device_id:
            raise InvalidArgumentError(
                "buf", f"{self.kind} was created on cuda:{self._dev.device_id}, got a "
                f"buffer on {buffer.device}:{buffer.device_id}")
        check_step_shape(self.kind, self.count, self.dtype, buffer)
        return self._mem.view(buffer.ptr, self.count, buffer.owner), buffer.owner

    # -- rounds on the GPU ----------------------------------------------------------
    def _exchange(self, seq: int, buf: Any, members: tuple[int, ...], channel: str,
                  label: str, before: list[Any],
                  on_complete: Callable[[Any, BaseException | None], None], space: str,
                  patient: bool) -> DeviceRound:
        rnd = DeviceRound(seq, members, buf, on_complete, time.monotonic() + self.timeout,
                          patient, label)
        ready = self._dev.local_mark()  # after the snapshot and the flags
        if before:  # a flush's arrival check first, on the host engine
            def after(result: Any, err: BaseException | None) -> None:
                if err is not None:
                    on_complete(None, err)
                else:
                    self._issue(rnd, ready)
            self._launch(seq, before, after, space=space)
        else:
            self._running = True
            self._issue(rnd, ready)
        return rnd

    def _issue(self, rnd: DeviceRound, ready: Any) -> None:
        try:
            self._dev.start(rnd, self.count + len(rnd.members), ready)
        except TransportError as exc:
            self._abort_round(rnd, self._attribute(rnd, exc))
            return
        except WagmaError as exc:
            self._abort_round(rnd, exc)
            return
        except Exception as exc:  # noqa: BLE001 -- CUDA/binding errors fail the round
            self._abort_round(rnd, TransportError(f"{rnd.label}: {type(exc).__name__}: {exc}"))
            return
        self._in_flight = rnd

    def busy(self) -> bool:
        return self._in_flight is not None

    def progress(self) -> bool:
        did = super().progress()  # type: ignore[misc]
        rnd = self._in_flight
        if rnd is None:
            return did
        if rnd.event.done:
            self._in_flight = None
            rnd.on_complete(None, None)
            return True
        problem = self._health(rnd)
        if problem is not None:
            self._abort_round(rnd, problem)
            return True
        return did

    def _health(self, rnd: DeviceRound) -> WagmaError | None:
        now = time.monotonic()
        if not rnd.patient and now > rnd.deadline:
            live = self._comm._liveness
            blamed, why = timeout_blame(live.dead if live is not None else None, rnd.members,
                                        self.rank, range(self.size))
            return CollectiveTimeoutError(
                self.kind, rnd.seq, blamed, f"{rnd.label} on the GPU did not complete within "
                f"{self.timeout:g} s; NCCL communicators aborted ({why})")
        if now < self._next_check:
            return None
        self._next_check = now + _HEALTH_CHECK_S
        dead = self._dead(rnd.members)
        if dead:
            return RankFailedError(self.kind, rnd.seq, dead,
                                   f"{rnd.label}: a member's process died; NCCL "
                                   "communicators aborted" + self._dead_elsewhere(rnd))
        problem = self._dev.async_error()
        return None if problem is None else self._attribute(rnd, TransportError(problem))

    def _attribute(self, rnd: DeviceRound, error: TransportError) -> WagmaError:
        """An NCCL error in a round: RankFailedError if a member is gone
        (looked for a while, as the GPU queue does: runtime/gpu.py)."""
        live = self._comm._liveness
        dead = dead_within(live.dead, rnd.members) if live is not None else []
        if dead:
            return RankFailedError(self.kind, rnd.seq, dead, f"{rnd.label}: a member's process "
                                   f"died (NCCL: {error}); NCCL communicators aborted"
                                   + self._dead_elsewhere(rnd))
        return TransportError(f"{self.kind} (round {rnd.seq}), {rnd.label}: {error}")

    def _dead(self, members: Sequence[int]) -> list[int]:
        live = self._comm._liveness
        return live.dead(members) if live is not None else []

    def _dead_elsewhere(self, rnd: DeviceRound) -> str:
        """The dead ranks outside the round's group: a member that waited for
        one of them failed and left, which is why this round lost it (a
        cascade)."""
        live = self._comm._liveness
        return dead_elsewhere(live.dead if live is not None else None, rnd.members,
                              range(self.size))

    def _abort_round(self, rnd: DeviceRound, error: WagmaError) -> None:
        self._in_flight = None
        self._dev.abort(str(error))
        rnd.on_complete(None, error)

    def fail(self, error: WagmaError) -> None:
        rnd, self._in_flight = self._in_flight, None
        if rnd is not None:
            self._dev.abort(str(error))
        super().fail(error)  # type: ignore[misc]

    def _teardown(self, clean: bool = False) -> None:
        super()._teardown(clean)  # type: ignore[misc]
        if clean:
            self._dev.close(time.monotonic() + self.timeout)
        else:
            self._dev.abort("closed after a failure")

    def _extra_statistics(self) -> dict[str, Any]:
        stats = super()._extra_statistics()  # type: ignore[misc]
        stats.update(path="gpu", device=f"cuda:{self._dev.device_id}",
                     nccl_connect_seconds=self._dev.connect_seconds)
        return stats


    def creation_options(self) -> dict[str, Any]:
        """What every rank must have created this with (base.agree): a rank
        that passed a host buffer where the others passed GPU ones differs."""
        return {**super().creation_options(), "memory": "cuda"}  # type: ignore[misc]


class DeviceWaitAvoidingGroupAllreduce(DevicePartial, WaitAvoidingGroupAllreduce):
    """WAGMA's wait-avoiding group allreduce of a GPU model."""


class DeviceSoloAllreduce(DevicePartial, SoloAllreduce):
    """eager-SGD's solo allreduce of GPU gradients."""


class DeviceMajorityAllreduce(DevicePartial, MajorityAllreduce):
    """eager-SGD's majority allreduce of GPU gradients."""


def _check_usable(algorithm: Any) -> None:
    """Refused before any communication: no GPU path here, or an algorithm
    (rounds on GPU buffers are one ncclAllReduce each)."""
    reason = unavailable_reason()
    if reason is not None:
        raise UnsupportedError("buf", f"a CUDA buffer was given but {reason}")
    if algorithm is not None:
        raise UnsupportedError(
            "algorithm", f"rounds on GPU buffers are one ncclAllReduce on the round's group "
            f"communicator; pass algorithm=None, got {algorithm!r}")


def _everyone(size: int) -> tuple[tuple[int, ...], ...]:
    return (tuple(range(size)),)


def create_wait_avoiding(comm: Any, buf: Any, group_size: int, sync_every: int, *,
                         activation: str, normalization: str, timeout: float | None,
                         algorithm: str | None, first_round: int,
                         grace: float) -> DeviceWaitAvoidingGroupAllreduce:
    """Collective: WAGMA on a GPU model (Communicator.wait_avoiding_group_allreduce)."""
    check_sync_every(sync_every)
    check_first_round(first_round)
    check_options(comm.size, group_size, activation, normalization, grace)
    _check_usable(algorithm)
    buffer = as_buffer(buf, "buf", gpu_available=True)
    # Agreed before the object exists, as on the host path (shared_wagma.create):
    # making it registers a partial collective id, and a rank whose host-path
    # peers refused would otherwise count one more than they do, and its later
    # partial collectives' tokens would never match theirs.
    agree(comm, DeviceWaitAvoidingGroupAllreduce.kind, buffer.count, buffer.dtype, timeout,
          group_size=group_size, sync_every=sync_every, first_round=first_round,
          activation=activation, normalization=normalization, algorithm=algorithm,
          memory="cuda")
    partial = DeviceWaitAvoidingGroupAllreduce(
        comm, buf, group_size, sync_every, activation=activation,
        normalization=normalization, timeout=timeout, first_round=first_round, grace=grace)
    steps = groups_mod.num_steps(comm.size, group_size)
    partial.connect([_everyone(comm.size)] + [groups_mod.partition(comm.size, group_size, s)
                                              for s in range(steps)])
    return comm._create(partial)


def create_eager(comm: Any, majority: bool, buf: Any, sync_every: int, *, op: str,
                 timeout: float | None, algorithm: str | None, first_round: int,
                 seed: int = 0) -> SoloAllreduce:
    """Collective: solo or majority allreduce of GPU gradients."""
    _check_usable(algorithm)
    if majority:
        partial: SoloAllreduce = DeviceMajorityAllreduce(
            comm, buf, sync_every, seed=seed, op=op, timeout=timeout, first_round=first_round)
    else:
        partial = DeviceSoloAllreduce(comm, buf, sync_every, op=op, timeout=timeout,
                                      first_round=first_round)
    agree(comm, partial.kind, partial.count, partial.dtype, partial.timeout,
          **partial.creation_options())
    partial.connect([_everyone(comm.size)])  # type: ignore[attr-defined]
    return comm._create(partial)
