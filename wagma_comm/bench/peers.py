"""Peer implementations for ``wagma bench --vs``: the same collective done by
another library, in the same process, in place on the same buffer as wagma's.

A ratio is only worth reporting when both sides ran on the same machine state,
so peers do not time anything: each hands back a zero-argument callable that
:func:`wagma_comm.bench.measure.side_by_side` alternates with wagma's.

Peers (``--vs`` names)::

    mpi     MPI_Allreduce / MPI_Bcast on a Dup of the world communicator (mpi4py)
    mpi-nb  MPI_Iallreduce / MPI_Ibcast, completed by an MPI_Test loop under a deadline
    gloo    torch.distributed, backend gloo, on CPU tensors sharing the NumPy memory
    nccl    torch.distributed, backend nccl, on CUDA tensors (only where a GPU is)

What each supports; anything else makes the factory return None (and
:meth:`Peer.why_not` say why) instead of converting the buffer behind your back::

    peer         dtypes                                   ops
    mpi, mpi-nb  float32 float64 int32 int64 uint8        sum prod max min, avg
    gloo         those + float16 bfloat16                 sum prod max min avg
    nccl         those + float16 bfloat16 (CUDA tensors)  sum prod max min avg
    broadcast: every dtype on every peer (it moves bytes).

``avg`` is what a user of that library writes: MPI has no average, so it is
MPI_SUM then a division of the buffer by the group size (NumPy, in place);
torch uses ReduceOp.AVG on floats. Integer ``avg`` is SUM then floor division on
every peer, like wagma's integer avg as long as the sum fits the dtype (the
peers' sum wraps before the division, wagma sums in int64). gloo reduces
float16/bfloat16 in the dtype itself (a rounding per step), wagma in float32
(one rounding): compare half-precision results with a tolerance, not bitwise.

Buffers: a C-contiguous writable NumPy array of the real dtype (bfloat16 as
``ml_dtypes.bfloat16``; pass the typed view, not a uint16 storage view), or a
torch tensor (CPU for the host peers, CUDA for nccl). torch is imported only
when a torch peer is asked for, so ``--vs mpi`` costs no torch import.

The torch peers need no environment from the user: rank 0 opens a TCPStore on
a port the OS picks (127.0.0.1 when every rank is on one host, else rank 0's
hostname), sends address and port to the others over MPI, and every rank calls
``init_process_group(store=..., rank=, world_size=, timeout=)``. Binding the port
inside the store (rather than probing a free port and passing ``tcp://addr:port``)
leaves no window in which another process can take the port. The process
group is shared by the torch peers and destroyed when the last one closes
(unless the caller had initialised torch.distributed already: then it is used
and left alone).

Timeouts (a finite number of seconds): gloo and nccl collectives run under the
process group's timeout; mpi-nb waits with a deadline and raises
CollectiveTimeoutError, after which the peer is broken (its abandoned request
is still posted, and it and its buffer are kept referenced): later calls raise
CommunicatorClosedError. MPI_Allreduce
and MPI_Bcast (peer ``mpi``) cannot be given one: they are the reference being
measured, so they stay the plain blocking calls.

A torch peer that cannot run on some rank (no torch, no GPU there) is
unavailable on every rank, its ``reason`` naming that rank.

``make_peers`` and ``group_allreduce`` are collective (call them on every rank,
in the same order, like the collective), and each starts with a small exchange
under the timeout: ranks that ask for different peers, or pass different
partitions, or a bad argument on one rank, raise InvalidArgumentError on every
rank, naming the argument, and a rank that never calls becomes a
CollectiveTimeoutError naming it, instead of the others blocking for ever in
MPI_Comm_dup/MPI_Comm_split or torch's process group set-up. ``allreduce`` and
``broadcast`` factories are local. torch timeouts above TORCH_TIMEOUT_MAX_S
(1e9 s) are clamped to it: torch's deadlines overflow from about 9e9 s.
"""

from __future__ import annotations

import datetime
import hashlib
import numbers
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .. import dtypes
from ..comm import check_timeout
from ..errors import (
    BufferError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
    UnsupportedError,
)
from ..torch_views import numpy_of, torch_of, use_local_gpu

if TYPE_CHECKING:
    from mpi4py import MPI

Call = Callable[[], object]
Partition = Sequence[Sequence[int]]

PEER_NAMES: tuple[str, ...] = ("mpi", "mpi-nb", "gloo", "nccl")
HOST_PEERS: tuple[str, ...] = ("mpi", "mpi-nb", "gloo")
DEFAULT_TIMEOUT_S = 300.0
# torch turns a timeout into a steady-clock deadline in int64 nanoseconds
# (about 9.2e9 s): from about 9e9 s a deadline wrapped, so a collective hung
# for ever or failed at once, and from 8.64e13 s timedelta() overflowed. Longer
# timeouts are clamped to this (31 years, "never" for a benchmark).
TORCH_TIMEOUT_MAX_S = 1e9

_MPI_DTYPES = ("float32", "float64", "int32", "int64", "uint8")
_MPI_OPS = {"sum": "SUM", "prod": "PROD", "max": "MAX", "min": "MIN"}


def parse_vs(text: str | Sequence[str]) -> list[str]:
    """``"mpi,gloo"`` -> ``["mpi", "gloo"]``; ``"none"`` or ``""`` -> ``[]``.

    Unknown names raise InvalidArgumentError("--vs", ...) before anything is
    started, so a typo fails on every rank alike instead of hanging one.
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    names: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise InvalidArgumentError("--vs", f"expected peer names, got {item!r}")
        name = item.strip().lower()
        if name in ("", "none"):
            continue
        if name not in PEER_NAMES:
            raise InvalidArgumentError(
                "--vs", f"unknown peer {item.strip()!r}; expected a comma-separated "
                f"subset of {list(PEER_NAMES)} or 'none'")
        if name not in names:
            names.append(name)
    return names


# -- buffers ------------------------------------------------------------------

def _is_torch_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "is_cuda")


def _check_writable(buf: Any, argument: str = "buf") -> None:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous or not buf.flags.writeable or buf.size == 0:
            raise BufferError(argument, "peers need a non-empty, C-contiguous, writable array")
    elif _is_torch_tensor(buf):
        if not buf.is_contiguous() or buf.numel() == 0:
            raise BufferError(argument, "peers need a non-empty, contiguous tensor")
    else:
        raise BufferError(argument, f"expected a NumPy array or a torch tensor, got "
                                    f"{type(buf).__name__}")


def _dtype_of(buf: Any) -> dtypes.DType | None:
    if isinstance(buf, np.ndarray):
        return dtypes.from_numpy(buf.dtype)
    return dtypes.BY_NAME.get(str(buf.dtype).removeprefix("torch."))


def _host_array(buf: Any) -> np.ndarray | None:
    """A NumPy view of a host buffer (same memory), or None for device memory."""
    if isinstance(buf, np.ndarray):
        return buf
    if buf.is_cuda:
        return None
    return numpy_of(buf)


def _torch_view(buf: Any) -> Any:
    """A torch tensor over the same memory (bfloat16 through a uint16 view)."""
    if _is_torch_tensor(buf):
        return buf
    return torch_of(buf)


def _divide(arr: np.ndarray, n: int, row: dtypes.DType) -> None:
    """avg = sum / n in place, in the buffer's dtype (floor for integers)."""
    if row.is_float:
        np.divide(arr, n, out=arr)
    else:
        np.floor_divide(arr, n, out=arr)


def _check_root(root: Any, size: int) -> int:
    """An int rank in [0, size): mpi4py truncates a float root (0.5 broadcast
    from rank 0) and torch fails on one only when the timed call runs."""
    if isinstance(root, bool) or not isinstance(root, numbers.Integral) \
            or not 0 <= root < size:
        raise InvalidArgumentError("root", f"must be an int in [0, {size}), got {root!r}")
    return int(root)


def _ints(values: Any, argument: str, what: str) -> tuple[int, ...]:
    """``values`` as sorted int ranks; a float (1.5 was truncated to 1), a
    bool or a non-iterable raises InvalidArgumentError naming ``argument``."""
    try:
        items = list(values)
    except TypeError:
        items = None
    if items is None or any(isinstance(r, bool) or not isinstance(r, numbers.Integral)
                            for r in items):
        raise InvalidArgumentError(argument, f"{what} must be int ranks, got {values!r}")
    return tuple(sorted(int(r) for r in items))


def _partition_key(partition: Partition, size: int) -> tuple[tuple[int, ...], ...]:
    """Validate a partition of range(size); returns it sorted. Every rank
    sorts alike, so collective creation orders match."""
    try:
        listed = list(partition)
    except TypeError:
        listed = None
    if listed is None or isinstance(partition, (str, bytes)):
        raise InvalidArgumentError("partition", f"expected groups of ranks, got {partition!r}")
    groups = tuple(sorted(_ints(g, "partition", "each group") for g in listed))
    flat = [r for g in groups for r in g]
    if sorted(flat) != list(range(size)) or any(len(g) == 0 for g in groups):
        raise InvalidArgumentError(
            "partition", f"must split ranks 0..{size - 1} into disjoint non-empty groups, "
            f"got {[list(g) for g in groups]}")
    return groups


def _color(groups: tuple[tuple[int, ...], ...], rank: int, ranks: Sequence[int]) -> int:
    """The index of this rank's group, which ``ranks`` must be."""
    mine = _ints(ranks, "ranks", "ranks")
    if mine not in groups or rank not in mine:
        raise InvalidArgumentError(
            "ranks", f"must be this rank's ({rank}) group in the partition, got {list(ranks)}")
    return groups.index(mine)


class _Exchange:
    """Small exchanges of picklable values among every rank of ``comm``, each
    under a deadline: a rank that never takes part becomes a
    CollectiveTimeoutError naming it, not a hang. Point to point (so the
    missing ranks are known), on a communicator whose collectives it never
    matches. A timeout breaks it: its abandoned receives stay posted (kept
    referenced), so a later round could match the late ranks' messages."""

    def __init__(self, comm: MPI.Comm, timeout: float) -> None:
        self.comm = comm
        self.timeout = timeout
        self.round = 0
        self.broken: str | None = None

    def allgather(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value``, in rank order (collective). ``value`` must
        pickle to less than 32 KiB, the buffer mpi4py's irecv() receives into."""
        from ..transport.mpi import ABANDONED

        if self.broken is not None:
            raise CommunicatorClosedError(self.broken)
        self.round += 1
        comm, rank = self.comm, self.comm.Get_rank()
        others = [r for r in range(comm.Get_size()) if r != rank]
        tag = self.round & 0x7FFF  # MPI guarantees tags up to 32767
        sends = [comm.isend(value, dest=r, tag=tag) for r in others]
        receives = {r: comm.irecv(source=r, tag=tag) for r in others}
        got = {rank: value}
        end, nap = time.monotonic() + self.timeout, 0.0
        while True:
            for r, req in list(receives.items()):
                done, msg = req.test()
                if done:
                    got[r] = msg
                    del receives[r]
            sends = [req for req in sends if not req.test()[0]]
            if not receives and not sends:
                return [got[r] for r in range(comm.Get_size())]
            if time.monotonic() > end:
                ABANDONED.extend((None, req) for req in [*sends, *receives.values()])
                self.broken = (f"broken by {what} (round {self.round}) timing out after "
                               f"{self.timeout:g} s")
                raise CollectiveTimeoutError(
                    what, self.round, receives.keys(),
                    f"not every rank took part within {self.timeout:g} s")
            nap = min(1e-3, nap * 2 or 2e-5)  # ranks may outnumber cores
            time.sleep(nap)

    def free(self) -> None:
        """Free the communicator, unless a timeout left requests on it."""
        if self.broken is None:
            self.comm.Free()


def _agree_on_groups(exchange: _Exchange, buf: Any, op: str, partition: Partition,
                     ranks: Sequence[int], rank: int, size: int,
                     what: str) -> tuple[tuple[tuple[int, ...], ...], int]:
    """Validate a group_allreduce call; returns the sorted partition and the
    index of this rank's group.

    Collective: the caller may go on to create the partition's groups,
    collectively over all ranks, so every rank first exchanges its verdict
    (under the deadline). A bad argument on one rank then raises on every
    rank, naming the argument, instead of leaving the others blocked in the
    creation; ranks that passed another partition are refused alike (their
    groups would silently differ, or one rank would create and one reuse).
    Every call, not only the creating one: whether a partition is cached
    differs between ranks exactly when they passed different ones."""
    key: tuple[tuple[int, ...], ...] | None = None
    color = -1
    error: BufferError | InvalidArgumentError | None = None
    try:
        _check_writable(buf)
        dtypes.check_op(op)
        key = _partition_key(partition, size)
        color = _color(key, rank, ranks)
    except (BufferError, InvalidArgumentError) as exc:
        error = exc
    verdict = None if error is None else (type(error).__name__, error.argument,
                                          str(error)[:2000])
    digest = None if key is None else hashlib.blake2b(repr(key).encode(), digest_size=16).digest()
    try:
        table = exchange.allgather((verdict, digest), what)
    except CollectiveTimeoutError as exc:
        if error is not None:
            raise error from exc
        raise
    if error is not None:
        raise error
    bad = [r for r, (v, _) in enumerate(table) if v is not None]
    if bad:
        kind, argument, text = table[bad[0]][0]
        cls = BufferError if kind == "BufferError" else InvalidArgumentError
        raise cls(argument, f"refused on rank{'s' if len(bad) > 1 else ''} "
                            f"{', '.join(map(str, bad))} (rank {bad[0]}: {text}); "
                            "no groups were created")
    differ = [r for r, (_, d) in enumerate(table) if d != digest]
    if differ:
        raise InvalidArgumentError(
            "partition", f"every rank must pass the same partition: rank"
            f"{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} passed "
            f"another than this rank's {[list(g) for g in key or ()]}")
    assert key is not None
    return key, color


# -- the interface --------------------------------------------------------------

class Peer:
    """One peer library. Factories return a zero-argument callable that runs
    the collective in place on ``buf`` each time it is called, or None when
    this peer cannot do it (``why_not`` says why).

    ``reason`` is None for a usable peer, else why it is unavailable here (e.g.
    nccl with no GPU); an unavailable peer's factories all return None.
    """

    name: str = "?"

    def __init__(self, reason: str | None = None) -> None:
        self.reason = reason

    def why_not(self, buf: Any, op: str | None = None) -> str | None:
        """Why ``allreduce(buf, op)`` (``op=None``: ``broadcast(buf)``) would
        return None; None when it is supported."""
        raise NotImplementedError

    def allreduce(self, buf: Any, op: str) -> Call | None:
        """Reduce ``buf`` over every rank of the world, in place."""
        raise NotImplementedError

    def group_allreduce(self, buf: Any, op: str, ranks: Sequence[int],
                        partition: Partition) -> Call | None:
        """Reduce ``buf`` within ``ranks`` (this rank's group), in place.

        ``partition`` lists every group (a partition of the world); the first
        call for a partition creates one communicator per group, collectively
        over all ranks, and caches them. Every call is collective: the ranks
        first agree (under the timeout) that they passed the same valid
        partition, so bad arguments on any rank raise on every rank.
        """
        raise NotImplementedError

    def broadcast(self, buf: Any, root: int) -> Call | None:
        """Copy ``root``'s ``buf`` to every rank, in place."""
        raise NotImplementedError

    def version(self) -> str:
        """Library and version, for the benchmark's metadata."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what the peer created (collective; idempotent)."""

    def __repr__(self) -> str:
        state = "ok" if self.reason is None else f"unavailable: {self.reason}"
        return f"<{type(self).__name__} {self.name} ({state})>"


class MPIPeer(Peer):
    """mpi4py on a Dup of ``world``: a communicator of its own, so its messages
    never match wagma's (which runs on the same world)."""

    def __init__(self, world: MPI.Comm, nonblocking: bool, timeout: float) -> None:
        from ..transport.mpi import dup_with_deadline

        super().__init__()
        self.name = "mpi-nb" if nonblocking else "mpi"
        self._nb = nonblocking
        self._timeout = check_timeout(timeout)
        self._comm: MPI.Comm | None = dup_with_deadline(world, self._timeout, "make_peers")
        # group_allreduce's agreement, point to point on the Dup (never
        # matched against its collectives).
        self._setup = _Exchange(self._comm, self._timeout)
        self._groups: dict[tuple[tuple[int, ...], ...], MPI.Comm] = {}
        self._round = 0  # nonblocking calls started, timed out or not
        self._broken: str | None = None  # why, after a timeout

    def why_not(self, buf: Any, op: str | None = None) -> str | None:
        _check_writable(buf)
        if self._comm is None:
            return "closed"
        if self._broken is not None or self._setup.broken is not None:
            return self._broken or self._setup.broken
        if _host_array(buf) is None:
            return f"{self.name} works on host memory; this buffer is on a GPU"
        row = _dtype_of(buf)
        if row is None:
            return f"unsupported dtype {buf.dtype}"
        if op is None:
            return None
        dtypes.check_op(op)
        if row.name not in _MPI_DTYPES:
            return f"MPI cannot reduce {row.name} (no standard MPI datatype)"
        return None

    def _wait(self, start: Callable[[], MPI.Request], what: str, uses: Any) -> None:
        """Start a nonblocking collective and MPI_Test it until done or the
        timeout passes. A timeout breaks the peer: the abandoned request stays
        posted, so a later call would be matched against it by the late ranks;
        it and the buffer it ``uses`` stay referenced, since MPI writes into
        that buffer when the late ranks come (freed, into whatever reused it)."""
        from ..transport.mpi import wait_with_deadline

        if self._broken is not None:
            raise CommunicatorClosedError(f"{self.name}: {self._broken}")
        self._round += 1
        req = start()
        if req.Test():
            return
        try:  # spinning, as MPI_Allreduce does: the peer is measured
            wait_with_deadline(req, uses, time.monotonic() + self._timeout, what, nap_limit=0,
                               round=self._round,
                               detail=f"{self.name}: not complete after {self._timeout} s")
        except CollectiveTimeoutError:
            self._broken = (f"broken by {what} (round {self._round}) timing out "
                            f"after {self._timeout} s")
            raise

    def _reduce(self, comm: MPI.Comm, buf: Any, op: str, what: str) -> Call | None:
        from mpi4py import MPI

        if self.why_not(buf, op) is not None:
            return None
        arr = _host_array(buf)
        assert arr is not None
        row = _dtype_of(buf)
        assert row is not None
        target = [arr, getattr(MPI, row.mpi_name or "")]
        mop = getattr(MPI, _MPI_OPS.get(op, "SUM"))
        n = comm.Get_size()
        avg = op == "avg"
        if self._nb:
            def call() -> None:
                self._wait(lambda: comm.Iallreduce(MPI.IN_PLACE, target, mop), what, target)
                if avg:
                    _divide(arr, n, row)
        elif avg:
            def call() -> None:
                comm.Allreduce(MPI.IN_PLACE, target, mop)
                _divide(arr, n, row)
        else:
            def call() -> None:
                comm.Allreduce(MPI.IN_PLACE, target, mop)
        return call

    def allreduce(self, buf: Any, op: str) -> Call | None:
        if self._comm is None:
            return None
        return self._reduce(self._comm, buf, op, "MPI_Iallreduce")

    def group_allreduce(self, buf: Any, op: str, ranks: Sequence[int],
                        partition: Partition) -> Call | None:
        if self._comm is None or self._broken is not None or self._setup.broken is not None:
            return None  # why_not says why
        rank = self._comm.Get_rank()
        key, color = _agree_on_groups(self._setup, buf, op, partition, ranks,
                                      rank, self._comm.Get_size(),
                                      f"{self.name} group_allreduce")
        if key not in self._groups:  # collective over all ranks of the Dup
            self._groups[key] = self._comm.Split(color, rank)
        return self._reduce(self._groups[key], buf, op, "MPI_Iallreduce(group)")

    def broadcast(self, buf: Any, root: int) -> Call | None:
        from mpi4py import MPI

        if self.why_not(buf) is not None or self._comm is None:
            return None
        comm = self._comm
        root = _check_root(root, comm.Get_size())
        arr = _host_array(buf)
        assert arr is not None
        target = [arr.reshape(-1).view(np.uint8), MPI.BYTE]
        if self._nb:
            return lambda: self._wait(lambda: comm.Ibcast(target, root), "MPI_Ibcast", target)
        return lambda: comm.Bcast(target, root)

    def version(self) -> str:
        import mpi4py
        from mpi4py import MPI

        lib = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
        return f"{lib}; mpi4py {mpi4py.__version__}"

    def close(self) -> None:
        for c in self._groups.values():
            c.Free()
        self._groups.clear()
        if self._comm is not None:
            self._comm.Free()
            self._comm = None


def _timedelta(timeout: float) -> datetime.timedelta:
    """torch's form of ``timeout`` seconds, clamped to TORCH_TIMEOUT_MAX_S."""
    return datetime.timedelta(seconds=min(timeout, TORCH_TIMEOUT_MAX_S))


class _TorchSession:
    """The default torch.distributed process group, bootstrapped over MPI and
    shared (reference-counted) by the torch peers of this process."""

    users = 0
    owned = False
    store: Any = None

    @classmethod
    def acquire(cls, setup: _Exchange, backend: str, timeout: float, users: int) -> None:
        """Collective: every rank calls it with the same backend, for ``users``
        peers (make_peers agreed on both and on torch.distributed's state)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            rank, size = setup.comm.Get_rank(), setup.comm.Get_size()
            store = _bootstrap_store(setup, timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                    timeout=_timedelta(timeout))
            cls.store, cls.owned = store, True
        cls.users += users

    @classmethod
    def release(cls) -> None:
        import torch.distributed as dist

        cls.users -= 1
        if cls.users == 0 and cls.owned:
            dist.destroy_process_group()
            cls.owned = False
            cls.store = None


def _torch_state() -> tuple[bool, str, int, int] | None:
    """(initialised, backend, rank, size) of torch.distributed here; None
    without it."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available():
        return None
    if not dist.is_initialized():
        return (False, "", -1, -1)
    return (True, str(dist.get_backend()), dist.get_rank(), dist.get_world_size())


def _check_torch_states(states: Sequence[tuple[bool, str, int, int] | None],
                        usable: Sequence[str]) -> None:
    """Raise UnsupportedError (on every rank: ``states`` are every rank's) when
    the process group the torch peers would share cannot serve them: made on
    some ranks only (the others would wait in the bootstrap), as other ranks,
    or without a backend a peer needs (an earlier gloo session asked for nccl:
    every call would fail)."""
    size = len(states)
    made = [r for r, st in enumerate(states) if st is not None and st[0]]
    if not made:
        return
    if len(made) != size:
        rest = [r for r in range(size) if r not in made]
        raise UnsupportedError(
            "--vs", f"torch.distributed is initialised on ranks {made} but not on {rest}: "
            "initialise it on every rank or on none")
    for r, st in enumerate(states):
        assert st is not None
        if (st[2], st[3]) != (r, size):
            raise UnsupportedError(
                "--vs", f"torch.distributed is already initialised with rank {st[2]} of "
                f"{st[3]} on MPI's rank {r} of {size}")
        for name in usable:
            if name not in st[1]:
                raise UnsupportedError(
                    "--vs", f"torch.distributed is already initialised with backend "
                    f"{st[1]!r} (rank {r}), which has no {name}: close the peers or "
                    f"process group using it first")


def _bootstrap_store(setup: _Exchange, timeout: float) -> Any:
    """A TCPStore on rank 0, reached by every rank; address and port go over
    MPI, under the deadline.

    Rank 0 sends either (address, port) or its error, so a failure to open
    the store raises on every rank instead of leaving the others waiting.
    """
    import torch.distributed as dist

    td = _timedelta(timeout)
    world = setup.comm
    hosts = setup.allgather(socket.gethostname(), "make_peers (torch store)")
    single_host = len(set(hosts)) == 1
    store = None
    msg: tuple[str, int] | str | None = None
    if world.Get_rank() == 0:
        addr = "127.0.0.1" if single_host else socket.getfqdn()
        try:
            store = dist.TCPStore(addr, 0, world.Get_size(), True, timeout=td,
                                  wait_for_workers=False)
            msg = (addr, int(store.port))
        except Exception as exc:  # noqa: BLE001 (reported on every rank below)
            msg = f"rank 0 could not open a TCPStore on {addr}: {exc}"
    msg = setup.allgather(msg, "make_peers (torch store)")[0]
    if isinstance(msg, str):
        raise UnsupportedError("--vs", msg)
    assert msg is not None
    if store is None:
        store = dist.TCPStore(msg[0], msg[1], world.Get_size(), False, timeout=td)
    return store


class TorchPeer(Peer):
    """torch.distributed with one backend: gloo on CPU tensors, nccl on CUDA
    tensors; the tensors share the caller's memory."""

    def __init__(self, backend: str, world: MPI.Comm, timeout: float,
                 reason: str | None) -> None:
        from ..transport.mpi import dup_with_deadline

        super().__init__(reason)
        self.name = backend
        self._timeout = timeout
        self._groups: dict[tuple[tuple[int, ...], ...], Any] = {}
        self._rank, self._size = world.Get_rank(), world.Get_size()
        self._open = reason is None
        # group_allreduce's agreement (over MPI: torch's new_group has no way
        # to hear of a rank that raised instead of joining).
        self._setup = (None if reason is not None
                       else _Exchange(dup_with_deadline(world, timeout, "make_peers"), timeout))

    def why_not(self, buf: Any, op: str | None = None) -> str | None:
        _check_writable(buf)
        if self.reason is not None:
            return self.reason
        if not self._open:
            return "closed"
        if self._setup is not None and self._setup.broken is not None:
            return self._setup.broken
        on_gpu = _is_torch_tensor(buf) and buf.is_cuda
        if self.name == "gloo" and on_gpu:
            return "gloo peer works on host memory; this tensor is on a GPU"
        if self.name == "nccl" and not on_gpu:
            return "nccl works on CUDA tensors; this buffer is in host memory"
        if _dtype_of(buf) is None:
            return f"unsupported dtype {buf.dtype}"
        if op is not None:
            dtypes.check_op(op)
        return None

    def _reduce(self, buf: Any, op: str, group: Any, n: int) -> Call | None:
        import torch.distributed as dist

        if self.why_not(buf, op) is not None:
            return None
        row = _dtype_of(buf)
        assert row is not None
        t = _torch_view(buf)
        if op == "avg" and not row.is_float:
            def call() -> None:
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
                t.div_(n, rounding_mode="floor")
            return call
        rop = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "avg": dist.ReduceOp.AVG}[op]
        return lambda: dist.all_reduce(t, op=rop, group=group)

    def allreduce(self, buf: Any, op: str) -> Call | None:
        return self._reduce(buf, op, None, self._size)

    def group_allreduce(self, buf: Any, op: str, ranks: Sequence[int],
                        partition: Partition) -> Call | None:
        import torch.distributed as dist

        if self.reason is not None or not self._open or self._setup is None \
                or self._setup.broken is not None:
            return None  # why_not says why
        key, color = _agree_on_groups(self._setup, buf, op, partition, ranks,
                                      self._rank, self._size,
                                      f"{self.name} group_allreduce")
        if key not in self._groups:  # new_group is collective over all ranks
            td = _timedelta(self._timeout)
            made = [dist.new_group(list(g), timeout=td, backend=self.name) for g in key]
            self._groups[key] = made[color]
        return self._reduce(buf, op, self._groups[key], len(key[color]))

    def broadcast(self, buf: Any, root: int) -> Call | None:
        import torch.distributed as dist

        if self.why_not(buf) is not None:
            return None
        root = _check_root(root, self._size)
        t = _torch_view(buf)
        return lambda: dist.broadcast(t, src=root)

    def version(self) -> str:
        try:
            import torch
        except ImportError:
            return "torch not installed"
        text = f"torch {torch.__version__} {self.name}"
        if self.name == "nccl" and self.reason is None:
            text += " " + ".".join(str(v) for v in torch.cuda.nccl.version())
        return text

    def close(self) -> None:
        if not self._open:
            return
        import torch.distributed as dist

        for g in self._groups.values():
            if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)
        self._groups.clear()
        self._open = False
        if self._setup is not None:
            self._setup.free()
        _TorchSession.release()


def _torch_reason(name: str, device: str) -> str | None:
    """Why torch peer ``name`` cannot run here, or None."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed (pip install 'wagma_comm[torch]')"
    if not dist.is_available():
        return f"torch {torch.__version__} was built without torch.distributed"
    if name == "gloo":
        if not dist.is_gloo_available():
            return f"torch {torch.__version__} was built without gloo"
        if device != "cpu":
            return f"gloo peer compares host buffers; device is {device!r}"
        return None
    if not torch.cuda.is_available():
        return (f"no CUDA device (torch.cuda.is_available() is False, torch "
                f"{torch.__version__}): NCCL needs a GPU")
    if not dist.is_nccl_available():
        return f"torch {torch.__version__} was built without NCCL"
    if device != "cuda":
        return f"nccl runs on CUDA tensors; device is {device!r}, pass device='cuda'"
    return None


def _agreed_reasons(everyone: Sequence[dict[str, str | None]],
                    mine: dict[str, str | None]) -> dict[str, str | None]:
    """A torch peer that cannot run on some rank is unavailable on every rank
    (``everyone``: every rank's reasons): otherwise the ranks that could start
    it would wait for the others in the store bootstrap."""
    agreed = dict(mine)
    for name, reason in mine.items():
        if reason is not None:
            continue
        for r, theirs in enumerate(everyone):
            if theirs.get(name) is not None:
                agreed[name] = f"unavailable on rank {r}: {theirs[name]}"
                break
    return agreed


def make_peers(names: str | Sequence[str], world: MPI.Comm | None = None,
               device: str = "cpu", timeout: float = DEFAULT_TIMEOUT_S) -> list[Peer]:
    """The peers named (``"mpi,gloo"`` or a list), in that order. Collective:
    every rank of ``world`` (default COMM_WORLD) calls it with the same names.

    ``device`` is where the benchmark's buffers live (``"cpu"`` or ``"cuda"``).
    A peer that cannot run here is still returned, with ``reason`` set and
    factories returning None, so the caller can print why it is missing.
    ``timeout`` (seconds) bounds torch's collectives (at most
    TORCH_TIMEOUT_MAX_S), mpi-nb's waits and the set-up's exchanges: ranks
    that ask for other peers, or one that never calls, raise an error on
    every rank instead of a hang.
    Close them with :func:`close_peers` (or each ``close()``).
    """
    wanted = parse_vs(names)
    if device not in ("cpu", "cuda"):
        raise InvalidArgumentError("device", f"expected 'cpu' or 'cuda', got {device!r}")
    timeout = check_timeout(timeout)
    from mpi4py import MPI

    from ..transport.mpi import dup_with_deadline

    world = MPI.COMM_WORLD if world is None else world
    setup = _Exchange(dup_with_deadline(world, timeout, "make_peers"), timeout)
    try:
        return _make_peers(setup, world, wanted, device, timeout)
    finally:
        setup.free()


def _make_peers(setup: _Exchange, world: MPI.Comm, wanted: list[str], device: str,
                timeout: float) -> list[Peer]:
    """make_peers once its arguments are checked, ``setup`` a private Dup of
    ``world``: every rank first says what it asked for and what it can run,
    so every rank takes the same decisions (and the same collective steps)."""
    torch_names = [n for n in wanted if n in ("gloo", "nccl")]
    mine = {n: _torch_reason(n, device) for n in torch_names}
    table = setup.allgather((wanted, mine, _torch_state() if torch_names else None),
                            "make_peers")
    differ = [r for r, row in enumerate(table) if row[0] != wanted]
    if differ:
        raise InvalidArgumentError(
            "--vs", f"every rank must ask for the same peers: this rank asked for {wanted}, "
            f"rank {differ[0]} for {table[differ[0]][0]} (ranks differing: {differ})")
    reasons = _agreed_reasons([row[1] for row in table], mine)
    usable = [n for n, r in reasons.items() if r is None]
    if usable:
        _check_torch_states([row[2] for row in table], usable)
        if "nccl" in usable:
            use_local_gpu(world, timeout)
        backend = "cpu:gloo,cuda:nccl" if len(usable) == 2 else usable[0]
        _TorchSession.acquire(setup, backend, timeout, len(usable))  # one release per peer
    peers: list[Peer] = []
    pending = len(usable)  # session users no peer releases yet
    try:
        for n in wanted:
            if n in ("mpi", "mpi-nb"):
                peers.append(MPIPeer(world, n == "mpi-nb", timeout))
            else:
                peers.append(TorchPeer(n, world, timeout, reasons[n]))
                pending -= reasons[n] is None
    except BaseException:
        close_peers(peers)
        for _ in range(pending):
            _TorchSession.release()
        raise
    return peers


def close_peers(peers: Sequence[Peer]) -> None:
    """Close every peer (collective), in reverse order of creation."""
    for p in reversed(peers):
        p.close()


__all__ = ["Peer", "MPIPeer", "TorchPeer", "PEER_NAMES", "HOST_PEERS", "parse_vs",
           "make_peers", "close_peers"]
