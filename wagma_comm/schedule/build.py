"""Build one rank's :class:`~wagma_comm.schedule.ir.Schedule` op by op.

Algorithms are written as straight-line programs ("send this slot, receive into
that one, reduce"); the builder numbers the messages and infers every
dependency from buffer hazards, so an algorithm cannot forget one. The executor
starts an op as soon as its deps completed, hence deps must cover each
read-after-write, write-after-read and write-after-write pair on overlapping
slots. Only the last writer of a region and the readers since then are
recorded as deps (earlier accesses are ordered transitively through them).
Anything malformed raises :class:`ScheduleError` at the op that is wrong,
not later in the executor.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from functools import lru_cache
from typing import Iterable

from ..errors import ScheduleError
from .ir import DATA, Copy, Native, Op, Recv, Reduce, Scale, Schedule, Send, Slot, reads, writes

MAX_MSG = 1 << 15  # messages per peer per schedule (the transport's tag field)
REDUCE_OPS = ("sum", "max", "min", "prod")  # what Reduce computes ("avg" is lowered)
NATIVE_OPS = REDUCE_OPS + ("avg",)
NATIVE_KINDS = ("allreduce", "broadcast")


@lru_cache(maxsize=64)
def group_index(ranks: tuple[int, ...]) -> dict[int, int] | None:
    """Position of each member of ``ranks``, or None if a rank repeats. Cached:
    compiling every member's schedule of a 4,096-rank group would otherwise
    re-scan the group once per rank (quadratic)."""
    index = {r: i for i, r in enumerate(ranks)}
    return index if len(index) == len(ranks) else None


class HazardTracker:
    """Per-buffer interval maps of "last writer, readers since that write".

    Shared by the builder (the conflicts of a new op become its deps) and the
    verifier (the conflicts must be ancestors of the op). Segments are split at
    slot boundaries, so each segment has a single last writer.
    """

    def __init__(self, sizes: dict[str, int]) -> None:
        # buf -> (segment starts, last writer per segment (-1: none), readers)
        self._maps: dict[str, tuple[list[int], list[int], list[tuple[int, ...]]]] = {}
        self._sizes = sizes  # shared with the owner: buffers may grow later

    def _map(self, buf: str) -> tuple[list[int], list[int], list[tuple[int, ...]]]:
        m = self._maps.get(buf)
        if m is None:
            m = self._maps[buf] = ([0], [-1], [()])
        return m

    def _cut(self, buf: str, at: int) -> None:
        """Make ``at`` a segment boundary of ``buf``."""
        starts, writer, readers = self._map(buf)
        if at >= self._sizes[buf]:
            return
        i = bisect_right(starts, at) - 1
        if starts[i] != at:
            starts.insert(i + 1, at)
            writer.insert(i + 1, writer[i])
            readers.insert(i + 1, readers[i])

    def touch(self, op: Op, index: int) -> set[int]:
        """Record that op ``index`` accesses its slots; return the earlier ops
        it must wait for (RAW, WAR, WAW)."""
        acc = _accesses(op)
        for slot, _ in acc:
            self._cut(slot.buf, slot.offset)
            self._cut(slot.buf, slot.end)
        out: set[int] = set()
        for slot, is_write in acc:
            starts, writer, readers = self._maps[slot.buf]
            for k in range(bisect_left(starts, slot.offset), bisect_left(starts, slot.end)):
                if writer[k] >= 0:
                    out.add(writer[k])
                if is_write:
                    out.update(readers[k])
        for slot, is_write in acc:
            starts, writer, readers = self._maps[slot.buf]
            first, last = bisect_left(starts, slot.offset), bisect_left(starts, slot.end)
            if is_write:  # after the reads: a write resets the readers
                starts[first:last] = [slot.offset]
                writer[first:last] = [index]
                readers[first:last] = [()]
            else:
                for k in range(first, last):
                    readers[k] = readers[k] + (index,)
        out.discard(index)
        return out


def _accesses(op: Op) -> list[tuple[Slot, bool]]:
    """(slot, is_write) pairs of ``op``, reads first; zero-count slots touch
    nothing."""
    out = [(s, False) for s in reads(op) if s.count > 0]
    out.extend((s, True) for s in writes(op) if s.count > 0)
    return out


def check_slot(slot: object, sizes: dict[str, int], where: str) -> Slot:
    """Raise ScheduleError unless ``slot`` lies inside a known buffer."""
    if isinstance(slot, Slot) and type(slot.offset) is int and type(slot.count) is int \
            and 0 <= slot.offset and 0 <= slot.count and slot.end <= sizes.get(slot.buf, -1):
        return slot  # the common case, checked in one go
    if not isinstance(slot, Slot):
        raise ScheduleError(f"{where}: expected a Slot, got {slot!r}")
    if slot.buf not in sizes:
        raise ScheduleError(f"{where}: unknown buffer {slot.buf!r} (declare scratch first)")
    for name in ("offset", "count"):
        value = getattr(slot, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ScheduleError(f"{where}: slot {name} must be an int >= 0, got {value!r}")
    if slot.end > sizes[slot.buf]:
        raise ScheduleError(
            f"{where}: slot {slot.buf}[{slot.offset}:{slot.end}] exceeds the buffer's "
            f"{sizes[slot.buf]} elements")
    return slot


class ScheduleBuilder:
    """Accumulates one rank's ops; ``build()`` freezes them into a Schedule.

    Every op method returns the new op's index. ``after`` adds explicit deps for
    orderings no buffer expresses (a barrier's zero-byte messages).
    """

    def __init__(self, collective: str, algorithm: str, rank: int, ranks: Iterable[int],
                 count: int, op: str = "", root: int = -1) -> None:
        self.collective, self.algorithm, self.op, self.root = collective, algorithm, op, root
        self.rank, self.ranks = rank, tuple(ranks)
        self._index = group_index(self.ranks)
        if self._index is None:
            raise ScheduleError(f"ranks {self.ranks} contain duplicates")
        if rank not in self._index:
            raise ScheduleError(f"rank {rank} is not in ranks {self.ranks}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ScheduleError(f"count must be an int >= 0, got {count!r}")
        self.count = count
        self._sizes: dict[str, int] = {DATA: count}
        self._scratch: dict[str, int] = {}
        self._ops: list[Op] = []
        self._deps: list[tuple[int, ...]] = []
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._last_native: dict[tuple[int, ...], int] = {}  # rank set -> its latest Native
        self._tracker = HazardTracker(self._sizes)

    # -- buffers ---------------------------------------------------------------
    def scratch(self, name: str, count: int) -> str:
        """Declare scratch buffer ``name`` of ``count`` elements; declaring it
        again grows it to the larger size (algorithms reuse buffers per step)."""
        if not isinstance(name, str) or not name or name == DATA:
            raise ScheduleError(f"invalid scratch buffer name {name!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ScheduleError(f"scratch {name!r}: count must be an int >= 0, got {count!r}")
        size = max(count, self._scratch.get(name, 0))
        self._scratch[name] = self._sizes[name] = size
        return name

    # -- ops -------------------------------------------------------------------
    def send(self, slot: Slot, peer: int, *, after: Iterable[int] = ()) -> int:
        """Send ``slot`` to global rank ``peer`` (message number assigned)."""
        self._check_peer(peer)
        msg = self._next_msg(self._sent, peer, "sends to")
        return self._add(Send(slot, peer, msg), after)

    def recv(self, slot: Slot, peer: int, *, after: Iterable[int] = ()) -> int:
        """Receive from global rank ``peer`` into ``slot``."""
        self._check_peer(peer)
        msg = self._next_msg(self._received, peer, "receives from")
        return self._add(Recv(slot, peer, msg), after)

    def reduce(self, dst: Slot, src: Slot, op: str, *, after: Iterable[int] = ()) -> int:
        """``dst = op(dst, src)``; ``op`` in REDUCE_OPS."""
        if op not in REDUCE_OPS:
            raise ScheduleError(f"reduce: op must be one of {REDUCE_OPS}, got {op!r}")
        return self._add(Reduce(dst, src, op), after)

    def copy(self, dst: Slot, src: Slot, *, after: Iterable[int] = ()) -> int:
        """``dst = src``."""
        return self._add(Copy(dst, src), after)

    def scale(self, dst: Slot, divisor: int, *, after: Iterable[int] = ()) -> int:
        """``dst = dst / divisor`` (divisor >= 1)."""
        if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
            raise ScheduleError(f"scale: divisor must be an int >= 1, got {divisor!r}")
        return self._add(Scale(dst, divisor), after)

    def native(self, kind: str, buf: Slot, op: str, ranks: Iterable[int], root: int = -1,
               *, after: Iterable[int] = ()) -> int:
        """A whole collective run by the transport as one call over ``ranks``."""
        members = tuple(ranks)
        check_native(kind, op, members, root, self.rank, self.ranks)
        # MPI matches nonblocking collectives on one communicator by the order
        # they are called in, and the dataflow executor calls each once its
        # deps are done: an unordered pair could go out in different orders
        # on different members. Chain the natives over one rank set.
        prev = self._last_native.get(members)
        index = self._add(Native(kind, buf, op, members, root),
                          after if prev is None else (*after, prev))
        self._last_native[members] = index
        return index

    def build(self) -> Schedule:
        """The frozen schedule (the builder may keep growing afterwards)."""
        return Schedule(self.collective, self.algorithm, self.rank, self.ranks, self.count,
                        self.op, self.root, tuple(self._ops), tuple(self._deps),
                        tuple(self._scratch.items()))

    # -- internals -------------------------------------------------------------
    def _check_peer(self, peer: int) -> None:
        if peer == self.rank:
            raise ScheduleError(f"rank {self.rank} cannot message itself")
        if peer not in self._index:  # type: ignore[operator]
            raise ScheduleError(f"peer {peer} is not in ranks {self.ranks}")

    def _next_msg(self, counters: dict[int, int], peer: int, what: str) -> int:
        msg = counters.get(peer, 0)
        if msg >= MAX_MSG:
            raise ScheduleError(
                f"rank {self.rank}: more than {MAX_MSG} {what} rank {peer} in one schedule")
        counters[peer] = msg + 1
        return msg

    def _add(self, op: Op, after: Iterable[int]) -> int:
        index = len(self._ops)
        where = f"rank {self.rank} op {index} ({type(op).__name__})"
        check_op_slots(op, self._sizes, where)
        explicit = set(after)
        if any(not isinstance(j, int) or not 0 <= j < index for j in explicit):
            raise ScheduleError(f"{where}: after={sorted(explicit, key=str)} must name "
                                "earlier ops")
        deps = self._tracker.touch(op, index) | explicit
        implied = set().union(*(self._deps[j] for j in deps))
        deps -= implied  # a dep of a dep is ordered already (one-level pruning)
        self._ops.append(op)
        self._deps.append(tuple(sorted(deps)))
        return index


def check_op_slots(op: Op, sizes: dict[str, int], where: str) -> None:
    """Bounds of every slot of ``op``; an op may not read and write overlapping
    parts of different slots (Reduce/Copy whose src overlaps dst)."""
    for slot in (*reads(op), *writes(op)):
        check_slot(slot, sizes, where)
    if isinstance(op, (Reduce, Copy)) and op.src.overlaps(op.dst):
        raise ScheduleError(f"{where}: src and dst overlap")


def check_native(kind: str, op: str, members: tuple[int, ...], root: int, rank: int,
                  ranks: tuple[int, ...]) -> None:
    if kind not in NATIVE_KINDS:
        raise ScheduleError(f"native: kind must be one of {NATIVE_KINDS}, got {kind!r}")
    if rank not in members or len(set(members)) != len(members):
        raise ScheduleError(f"native: ranks {members} must be distinct and include {rank}")
    if not set(members) <= set(ranks):
        raise ScheduleError(f"native: ranks {members} are not all in {ranks}")
    if kind == "allreduce" and (op not in NATIVE_OPS or root != -1):
        raise ScheduleError(f"native allreduce: bad op {op!r} or root {root} (want -1)")
    if kind == "broadcast" and (op != "" or root not in members):
        raise ScheduleError(f"native broadcast: root {root} must be in {members}, op ''")
