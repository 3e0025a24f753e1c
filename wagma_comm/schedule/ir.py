"""The schedule IR: immutable operations and the per-rank Schedule DAG.

A collective is compiled into one :class:`Schedule` per participating rank. A
schedule is a tuple of operations plus, for each operation, the indices of the
operations it must wait for. Operations address memory symbolically as
:class:`Slot` ranges (a named buffer, an element offset and an element count):
``"data"`` is the user's buffer (in place) and any other name is a scratch buffer
the executor allocates with the size given in ``Schedule.scratch``.

Nothing here knows about MPI or NCCL; a transport maps Send/Recv/Native onto its
own calls and the engine runs Reduce/Copy/Scale with the host or device kernels.
Everything is frozen: passes build new schedules, they never edit ops in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

DATA = "data"  # the user's buffer


@dataclass(frozen=True, order=True)
class Slot:
    """``count`` elements of buffer ``buf`` starting at element ``offset``."""

    buf: str
    offset: int
    count: int

    @property
    def end(self) -> int:
        return self.offset + self.count

    def overlaps(self, other: "Slot") -> bool:
        return (
            self.buf == other.buf
            and self.count > 0
            and other.count > 0
            and self.offset < other.end
            and other.offset < self.end
        )


@dataclass(frozen=True)
class Send:
    """Send ``src`` to global rank ``peer``. ``msg`` numbers the messages from this
    rank to ``peer`` within one schedule (0, 1, 2, ...): the matching Recv on the
    peer carries the same number, and the executor combines it with the
    collective's sequence number to form the message's identity."""

    src: Slot
    peer: int
    msg: int


@dataclass(frozen=True)
class Recv:
    """Receive into ``dst`` from global rank ``peer``; ``msg`` as in Send."""

    dst: Slot
    peer: int
    msg: int


@dataclass(frozen=True)
class Reduce:
    """``dst = op(dst, src)`` elementwise (``op`` in sum/max/min/prod; "avg" is
    lowered to sum followed by Scale)."""

    dst: Slot
    src: Slot
    op: str


@dataclass(frozen=True)
class Copy:
    """``dst = src``."""

    dst: Slot
    src: Slot


@dataclass(frozen=True)
class Scale:
    """``dst = dst / divisor`` (floating types: true division rounded to the
    element type; integer types: floor division)."""

    dst: Slot
    divisor: int


@dataclass(frozen=True)
class Native:
    """A whole collective the transport may run as one call (ncclAllReduce,
    MPI_Iallreduce, ...) over the global ranks ``ranks`` on ``buf`` in place.
    ``kind`` is "allreduce" or "broadcast"; ``root`` is a global rank for
    broadcast, -1 otherwise."""

    kind: str
    buf: Slot
    op: str
    ranks: tuple[int, ...]
    root: int = -1


Op = Union[Send, Recv, Reduce, Copy, Scale, Native]


def reads(op: Op) -> tuple[Slot, ...]:
    """The slots an operation reads."""
    if isinstance(op, Send):
        return (op.src,)
    if isinstance(op, Reduce):
        return (op.dst, op.src)
    if isinstance(op, Copy):
        return (op.src,)
    if isinstance(op, (Scale,)):
        return (op.dst,)
    if isinstance(op, Native):
        return (op.buf,)
    return ()


def moved(op: Op) -> Slot:
    """The one slot a communication op (Send, Recv or Native) moves."""
    if isinstance(op, Send):
        return op.src
    if isinstance(op, Recv):
        return op.dst
    if isinstance(op, Native):
        return op.buf
    raise TypeError(f"{type(op).__name__} moves nothing")


def writes(op: Op) -> tuple[Slot, ...]:
    """The slots an operation writes."""
    if isinstance(op, (Recv,)):
        return (op.dst,)
    if isinstance(op, (Reduce, Copy, Scale)):
        return (op.dst,)
    if isinstance(op, Native):
        return (op.buf,)
    return ()


@dataclass(frozen=True)
class Schedule:
    """One rank's program for one collective.

    ``ops[i]`` may start once every op in ``deps[i]`` has completed; ``deps`` only
    points backwards (``j < i``), so ``ops`` is a topological order. ``ranks`` are
    the global ranks taking part (group order), ``rank`` is the owner's global
    rank, ``count`` the element count of ``data``. ``scratch`` maps each scratch
    buffer name to its element count.
    """

    collective: str  # "allreduce", "broadcast", "barrier"
    algorithm: str
    rank: int
    ranks: tuple[int, ...]
    count: int
    op: str  # reduction ("sum", "avg", ...); "" for broadcast/barrier
    root: int  # global root rank for broadcast, -1 otherwise
    ops: tuple[Op, ...]
    deps: tuple[tuple[int, ...], ...]
    scratch: tuple[tuple[str, int], ...] = field(default=())

    @property
    def scratch_sizes(self) -> dict[str, int]:
        return dict(self.scratch)

    @property
    def peers(self) -> frozenset[int]:
        """Global ranks this schedule exchanges messages with."""
        return frozenset(
            op.peer for op in self.ops if isinstance(op, (Send, Recv))
        ) | frozenset(
            r for op in self.ops if isinstance(op, Native) for r in op.ranks if r != self.rank
        )
