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
is still posted): later calls raise CommunicatorClosedError. MPI_Allreduce
and MPI_Bcast (peer ``mpi``) cannot be given one: they are the reference being
measured, so they stay the plain blocking calls.

A torch peer that cannot run on some rank (no torch, no GPU there) is
unavailable on every rank, its ``reason`` naming that rank.

Every factory (``allreduce``, ``group_allreduce``, ``broadcast``) is collective
when it creates communicators or process groups (the first group_allreduce for
a partition): call it on every rank, in the same order, like the collective.
"""

from __future__ import annotations

import datetime
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


def _canonical(partition: Partition, size: int, rank: int,
               ranks: Sequence[int]) -> tuple[tuple[tuple[int, ...], ...], int]:
    """Validate a partition of range(size); returns it sorted and the index of
    this rank's group. Every rank sorts alike, so collective creation orders match."""
    groups = tuple(sorted(tuple(sorted(int(r) for r in g)) for g in partition))
    flat = [r for g in groups for r in g]
    if sorted(flat) != list(range(size)) or any(len(g) == 0 for g in groups):
        raise InvalidArgumentError(
            "partition", f"must split ranks 0..{size - 1} into disjoint non-empty groups, "
            f"got {[list(g) for g in partition]}")
    mine = tuple(sorted(int(r) for r in ranks))
    if mine not in groups or rank not in mine:
        raise InvalidArgumentError(
            "ranks", f"must be this rank's ({rank}) group in the partition, got {list(ranks)}")
    return groups, groups.index(mine)


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
        over all ranks, and caches them.
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
        super().__init__()
        self.name = "mpi-nb" if nonblocking else "mpi"
        self._nb = nonblocking
        self._timeout = check_timeout(timeout)
        self._comm: MPI.Comm | None = world.Dup()
        self._groups: dict[tuple[tuple[int, ...], ...], MPI.Comm] = {}
        self._round = 0  # nonblocking calls started, timed out or not
        self._broken: str | None = None  # why, after a timeout

    def why_not(self, buf: Any, op: str | None = None) -> str | None:
        _check_writable(buf)
        if self._comm is None:
            return "closed"
        if self._broken is not None:
            return self._broken
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

    def _wait(self, start: Callable[[], MPI.Request], what: str) -> None:
        """Start a nonblocking collective and MPI_Test it until done or the
        timeout passes. A timeout breaks the peer: the abandoned request stays
        posted, so a later call would be matched against it by the late ranks."""
        if self._broken is not None:
            raise CommunicatorClosedError(f"{self.name}: {self._broken}")
        self._round += 1
        req = start()
        if req.Test():
            return
        end = time.monotonic() + self._timeout
        while not req.Test():
            if time.monotonic() > end:
                self._broken = (f"broken by {what} (round {self._round}) timing out "
                                f"after {self._timeout} s")
                raise CollectiveTimeoutError(
                    what, self._round, [], f"{self.name}: not complete after {self._timeout} s")

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
                self._wait(lambda: comm.Iallreduce(MPI.IN_PLACE, target, mop), what)
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
        if self._comm is None:
            return None
        key, color = _canonical(partition, self._comm.Get_size(), self._comm.Get_rank(), ranks)
        if key not in self._groups:  # collective over all ranks of the Dup
            self._groups[key] = self._comm.Split(color, self._comm.Get_rank())
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
            return lambda: self._wait(lambda: comm.Ibcast(target, root), "MPI_Ibcast")
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


class _TorchSession:
    """The default torch.distributed process group, bootstrapped over MPI and
    shared (reference-counted) by the torch peers of this process."""

    users = 0
    owned = False
    store: Any = None

    @classmethod
    def acquire(cls, world: MPI.Comm, backend: str, timeout: float) -> None:
        """Collective: every rank calls it with the same backend."""
        import torch.distributed as dist

        if cls.users == 0 and not dist.is_initialized():
            cls.store = _bootstrap_store(world, timeout)
            dist.init_process_group(
                backend, store=cls.store, rank=world.Get_rank(), world_size=world.Get_size(),
                timeout=datetime.timedelta(seconds=timeout))
            cls.owned = True
        elif dist.get_world_size() != world.Get_size() or dist.get_rank() != world.Get_rank():
            raise UnsupportedError(
                "--vs", f"torch.distributed is already initialised with rank "
                f"{dist.get_rank()} of {dist.get_world_size()}, not as MPI's rank "
                f"{world.Get_rank()} of {world.Get_size()}")
        cls.users += 1

    @classmethod
    def release(cls) -> None:
        import torch.distributed as dist

        cls.users -= 1
        if cls.users == 0 and cls.owned:
            dist.destroy_process_group()
            cls.owned = False
            cls.store = None


def _bootstrap_store(world: MPI.Comm, timeout: float) -> Any:
    """A TCPStore on rank 0, reached by every rank; address and port go over MPI.

    Rank 0 broadcasts either (address, port) or its error, so a failure to open
    the store raises on every rank instead of leaving the others in the bcast.
    """
    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout)
    hosts = world.allgather(socket.gethostname())
    single_host = len(set(hosts)) == 1
    store = None
    msg: tuple[str, int] | str
    if world.Get_rank() == 0:
        addr = "127.0.0.1" if single_host else socket.getfqdn()
        try:
            store = dist.TCPStore(addr, 0, world.Get_size(), True, timeout=td,
                                  wait_for_workers=False)
            msg = (addr, int(store.port))
        except Exception as exc:  # noqa: BLE001 (reported on every rank below)
            msg = f"rank 0 could not open a TCPStore on {addr}: {exc}"
    else:
        msg = ""
    msg = world.bcast(msg, root=0)
    if isinstance(msg, str):
        raise UnsupportedError("--vs", msg)
    if store is None:
        store = dist.TCPStore(msg[0], msg[1], world.Get_size(), False, timeout=td)
    return store


class TorchPeer(Peer):
    """torch.distributed with one backend: gloo on CPU tensors, nccl on CUDA
    tensors; the tensors share the caller's memory."""

    def __init__(self, backend: str, world: MPI.Comm, timeout: float,
                 reason: str | None) -> None:
        super().__init__(reason)
        self.name = backend
        self._timeout = timeout
        self._groups: dict[tuple[tuple[int, ...], ...], Any] = {}
        self._rank, self._size = world.Get_rank(), world.Get_size()
        self._open = reason is None

    def why_not(self, buf: Any, op: str | None = None) -> str | None:
        _check_writable(buf)
        if self.reason is not None:
            return self.reason
        if not self._open:
            return "closed"
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

        if self.why_not(buf, op) is not None:
            return None
        key, color = _canonical(partition, self._size, self._rank, ranks)
        if key not in self._groups:  # new_group is collective over all ranks
            td = datetime.timedelta(seconds=self._timeout)
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


def _agreed_reasons(world: MPI.Comm, mine: dict[str, str | None]
                    ) -> dict[str, str | None]:
    """A torch peer that cannot run on some rank is unavailable on every rank
    (collective): otherwise the ranks that could start it would wait for the
    others forever in the store bootstrap's MPI calls."""
    everyone = world.allgather(mine)
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
    ``timeout`` (seconds) bounds torch's collectives and mpi-nb's waits.
    Close them with :func:`close_peers` (or each ``close()``).
    """
    wanted = parse_vs(names)
    if device not in ("cpu", "cuda"):
        raise InvalidArgumentError("device", f"expected 'cpu' or 'cuda', got {device!r}")
    timeout = check_timeout(timeout)
    from mpi4py import MPI

    world = MPI.COMM_WORLD if world is None else world
    reasons = _agreed_reasons(
        world, {n: _torch_reason(n, device) for n in wanted if n in ("gloo", "nccl")})
    usable = [n for n, r in reasons.items() if r is None]
    if usable:
        if "nccl" in usable:
            use_local_gpu(world)
        backend = "cpu:gloo,cuda:nccl" if len(usable) == 2 else usable[0]
        _TorchSession.acquire(world, backend, timeout)
        for _ in usable[1:]:
            _TorchSession.users += 1  # one release per peer
    peers: list[Peer] = []
    for n in wanted:
        if n in ("mpi", "mpi-nb"):
            peers.append(MPIPeer(world, n == "mpi-nb", timeout))
        else:
            peers.append(TorchPeer(n, world, timeout, reasons[n]))
    return peers


def close_peers(peers: Sequence[Peer]) -> None:
    """Close every peer (collective), in reverse order of creation."""
    for p in reversed(peers):
        p.close()


__all__ = ["Peer", "MPIPeer", "TorchPeer", "PEER_NAMES", "HOST_PEERS", "parse_vs",
           "make_peers", "close_peers"]
