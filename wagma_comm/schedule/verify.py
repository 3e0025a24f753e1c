"""Prove that a group's schedules compute their collective, by symbolic execution.

All members' programs are run together on symbols instead of numbers:
element ``i`` of member ``m``'s initial data is the leaf ``(m, i)``, and each
Reduce/Scale/Native builds an interned (hash-consed) expression node, the two
operands of a commutative op in canonical order. Equal expressions therefore
get equal integer ids, which makes the final comparisons cheap and exact:

(a) messages: each Send has exactly one Recv (sender, receiver, msg) of the same
    count and vice versa; Native ops match across their members; the graph of
    deps plus messages, where a Send and its Recv (and a Native's members)
    complete together (the worst case: no buffering), runs to the end;
(b) races: two ops of one rank on overlapping slots, one of them writing, are
    ordered by the deps (transitively), and so are two Natives over the same
    ranks (called in the same order on every member);
(c) result: allreduce - every member ends with the same expression per element
    (so bitwise-identical values), which reduces every member's element exactly
    once with the schedule's op (avg: and divides by the group size once);
    broadcast - every member holds the root's data; barrier - every rank
    finishes only after every other rank has started.

Everything raises :class:`ScheduleError` naming the rank, op and slot.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from ..dtypes import OPS
from ..errors import ScheduleError
from .algorithms import compile_group
from .build import MAX_MSG, REDUCE_OPS, HazardTracker, check_native, check_op_slots
from .export import op_label
from .ir import DATA, moved, Copy, Native, Op, Recv, Reduce, Scale, Schedule, Send, Slot

COLLECTIVES = ("allreduce", "broadcast", "barrier")
# An interned node: ("reduce", op, a, b) with a <= b, ("native", op, sorted
# operands) or ("scale", a, divisor); operands are expression ids.
Key = tuple[Any, ...]
UNDEF = -1  # the value of scratch memory nothing has written yet


def verify(schedules: Sequence[Schedule]) -> None:
    """Raise ScheduleError unless ``schedules`` (one per member) are correct."""
    group = _Group(schedules)
    pairs = _match_messages(group)
    natives = _match_natives(group)
    for pos in range(group.n):
        _check_races(group, pos)
    order = _execution_order(group, pairs, natives)
    _check_result(group, order)


def verify_collective(collective: str, ranks: Sequence[int], count: int = 0, op: str = "",
                      root: int = -1, algorithm: str | None = None) -> None:
    """Compile every member's schedule and verify them together."""
    verify(compile_group(collective, tuple(ranks), count, op, root, algorithm))


# -- the group and its structure -----------------------------------------------
class _Group:
    """The schedules in group order plus a global numbering of their ops."""

    def __init__(self, schedules: Sequence[Schedule]) -> None:
        scheds = list(schedules)
        if not scheds:
            raise ScheduleError("no schedules to verify")
        for s in scheds:
            _check_types(s)
        first = scheds[0]
        self.ranks, self.count, self.op = first.ranks, first.count, first.op
        self.collective, self.root = first.collective, first.root
        self.n = len(self.ranks)
        _check_header(first)
        by_rank = _one_per_member(scheds, first)
        self.scheds = [by_rank[r] for r in self.ranks]
        self.pos = {r: i for i, r in enumerate(self.ranks)}
        self.base: list[int] = []
        total = 0
        for s in self.scheds:
            self.base.append(total)
            total += len(s.ops)
        self.total = total
        self.owner = [p for p, s in enumerate(self.scheds) for _ in s.ops]
        for s in self.scheds:
            _check_structure(s)

    def gid(self, pos: int, index: int) -> int:
        return self.base[pos] + index

    def op_at(self, gid: int) -> Op:
        pos = self.owner[gid]
        return self.scheds[pos].ops[gid - self.base[pos]]

    def where(self, gid: int) -> str:
        pos = self.owner[gid]
        index = gid - self.base[pos]
        return f"rank {self.ranks[pos]} op {index} ({op_label(self.scheds[pos].ops[index])})"


def _is_int(value: object, low: int = 0) -> bool:
    """An int >= ``low`` and not a bool. Fields are compared with ``==``, and
    ``1.0 == True == 1``: a schedule loaded from hand-edited JSON with peer
    1.0 would verify, then fail in the transport."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_types(s: object) -> None:
    """The header's field types, before anything compares or hashes them."""
    if not isinstance(s, Schedule):
        raise ScheduleError(f"expected a Schedule, got {type(s).__name__}")
    for name in ("collective", "algorithm", "op"):
        if not isinstance(getattr(s, name), str):
            raise ScheduleError(f"schedule {name} must be a str, got {getattr(s, name)!r}")
    if not isinstance(s.ranks, tuple) or not all(_is_int(r) for r in s.ranks):
        raise ScheduleError(f"schedule ranks must be a tuple of ints >= 0, got {s.ranks!r}")
    for name, low in (("rank", 0), ("count", 0), ("root", -1)):
        if not _is_int(getattr(s, name), low):
            raise ScheduleError(f"schedule {name} must be an int >= {low}, got "
                                f"{getattr(s, name)!r}")
    if not isinstance(s.scratch, tuple) or not all(
            isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str) and _is_int(e[1])
            for e in s.scratch):
        raise ScheduleError(f"rank {s.rank}: scratch must be (name, size >= 0) pairs, got "
                            f"{s.scratch!r}")
    if not isinstance(s.ops, tuple) or not isinstance(s.deps, tuple) \
            or not all(isinstance(d, tuple) for d in s.deps):
        raise ScheduleError(f"rank {s.rank}: ops and deps must be tuples (deps of tuples)")


def _check_header(s: Schedule) -> None:
    if s.collective not in COLLECTIVES:
        raise ScheduleError(f"unknown collective {s.collective!r}")
    if len(set(s.ranks)) != len(s.ranks) or not s.ranks:
        raise ScheduleError(f"ranks {s.ranks} must be non-empty and distinct")
    if s.collective == "allreduce" and s.op not in OPS:
        raise ScheduleError(f"allreduce with unknown op {s.op!r}")
    if s.collective == "broadcast" and s.root not in s.ranks:
        raise ScheduleError(f"broadcast root {s.root} is not in ranks {s.ranks}")
    if s.collective == "barrier" and s.count != 0:
        raise ScheduleError(f"barrier must have count 0, got {s.count}")


def _one_per_member(scheds: list[Schedule], first: Schedule) -> dict[int, Schedule]:
    header = _header(first)
    by_rank: dict[int, Schedule] = {}
    for s in scheds:
        if _header(s) != header:
            raise ScheduleError(
                f"rank {s.rank}'s schedule is for {_header(s)}, rank {first.rank}'s for {header}")
        if s.rank in by_rank:
            raise ScheduleError(f"two schedules for rank {s.rank}")
        by_rank[s.rank] = s
    missing = [r for r in first.ranks if r not in by_rank]
    extra = [r for r in by_rank if r not in first.ranks]
    if missing or extra:
        raise ScheduleError(f"schedules must cover ranks {first.ranks} exactly: "
                            f"missing {missing}, not members {extra}")
    return by_rank


def _header(s: Schedule) -> tuple[object, ...]:
    return (s.collective, s.algorithm, s.ranks, s.count, s.op, s.root)


def _check_structure(s: Schedule) -> None:
    """Deps point backwards, slots are in bounds, peers are other members."""
    if len(s.deps) != len(s.ops):
        raise ScheduleError(f"rank {s.rank}: {len(s.ops)} ops but {len(s.deps)} dep lists")
    names = [name for name, _ in s.scratch]
    if DATA in names or len(set(names)) != len(names):
        raise ScheduleError(f"rank {s.rank}: scratch buffers {names} must be distinct and "
                            f"not named {DATA!r}")
    sizes = {DATA: s.count, **s.scratch_sizes}
    for i, (op, deps) in enumerate(zip(s.ops, s.deps)):
        where = f"rank {s.rank} op {i} ({type(op).__name__})"
        if any(not isinstance(j, int) or not 0 <= j < i for j in deps):
            raise ScheduleError(f"{where}: deps {deps} must name earlier ops")
        check_op_slots(op, sizes, where)
        _check_fields(op, s, where)


def _check_fields(op: Op, s: Schedule, where: str) -> None:
    if isinstance(op, (Send, Recv)):
        if not _is_int(op.peer) or op.peer == s.rank or op.peer not in s.ranks:
            raise ScheduleError(f"{where}: peer {op.peer!r} is not another member of {s.ranks}")
        if not _is_int(op.msg) or op.msg >= MAX_MSG:
            raise ScheduleError(f"{where}: msg {op.msg!r} is no int in [0, {MAX_MSG})")
    elif isinstance(op, Reduce) and op.op not in REDUCE_OPS:  # "avg" is lowered
        raise ScheduleError(f"{where}: unknown reduction {op.op!r}; a Reduce computes one "
                            f"of {REDUCE_OPS}")
    elif isinstance(op, Scale) and not _is_int(op.divisor, 1):
        raise ScheduleError(f"{where}: divisor {op.divisor!r} is no int >= 1")
    elif isinstance(op, Native):
        if not isinstance(op.ranks, tuple) or not all(_is_int(r) for r in op.ranks) \
                or not _is_int(op.root, -1):
            raise ScheduleError(f"{where}: ranks {op.ranks!r} and root {op.root!r} must be "
                                "ints")
        try:
            check_native(op.kind, op.op, op.ranks, op.root, s.rank, s.ranks)
        except ScheduleError as exc:
            raise ScheduleError(f"{where}: {exc}") from None
    elif not isinstance(op, (Reduce, Copy, Scale)):
        raise ScheduleError(f"{where}: unknown op type {type(op).__name__}")


# -- (a) matching ----------------------------------------------------------------
def _match_messages(group: _Group) -> dict[int, int]:
    """Send gid -> Recv gid for every message, or ScheduleError."""
    sends: dict[tuple[int, int, int], int] = {}
    recvs: dict[tuple[int, int, int], int] = {}
    for pos, s in enumerate(group.scheds):
        for i, op in enumerate(s.ops):
            if isinstance(op, Send):
                _put(sends, (s.rank, op.peer, op.msg), group.gid(pos, i), group, "sends")
            elif isinstance(op, Recv):
                _put(recvs, (op.peer, s.rank, op.msg), group.gid(pos, i), group, "receives")
    pairs: dict[int, int] = {}
    for key, sg in sends.items():
        rg = recvs.get(key)
        if rg is None:
            raise ScheduleError(f"{group.where(sg)} has no matching Recv on rank {key[1]}")
        sc, rc = moved(group.op_at(sg)).count, moved(group.op_at(rg)).count
        if sc != rc:
            raise ScheduleError(f"{group.where(sg)} sends {sc} elements but "
                                f"{group.where(rg)} receives {rc}")
        pairs[sg] = rg
    for key, rg in recvs.items():
        if key not in sends:
            raise ScheduleError(f"{group.where(rg)} has no matching Send on rank {key[0]}")
    return pairs


def _put(table: dict[tuple[int, int, int], int], key: tuple[int, int, int], gid: int,
         group: _Group, what: str) -> None:
    if key in table:
        raise ScheduleError(f"{group.where(table[key])} and {group.where(gid)} both {what} "
                            f"message #{key[2]} between ranks {key[0]} and {key[1]}")
    table[key] = gid


def _match_natives(group: _Group) -> list[list[int]]:
    """Groups of Native gids run as one call: the k-th Native over a rank set on
    each of its members. Each member must issue it with identical arguments."""
    calls: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for pos, s in enumerate(group.scheds):
        seen: dict[tuple[int, ...], int] = {}
        for i, op in enumerate(s.ops):
            if isinstance(op, Native):
                k = seen.get(op.ranks, 0)
                seen[op.ranks] = k + 1
                calls.setdefault((op.ranks, k), []).append(group.gid(pos, i))
    out = []
    for (members, k), gids in calls.items():
        present = sorted(group.ranks[group.owner[g]] for g in gids)
        if present != sorted(members):
            raise ScheduleError(f"native call #{k} over {members} is issued only by "
                                f"ranks {present}: {group.where(gids[0])}")
        first = group.op_at(gids[0])
        for g in gids[1:]:
            if _native_sig(group.op_at(g)) != _native_sig(first):
                raise ScheduleError(f"{group.where(g)} does not match {group.where(gids[0])}")
        out.append(gids)
    return out


def _native_sig(op: Op) -> tuple[object, ...]:
    assert isinstance(op, Native)
    return (op.kind, op.op, op.root, op.buf.count)


# -- (b) races -------------------------------------------------------------------
def _check_races(group: _Group, pos: int) -> None:
    """Each op must come after the last writer of what it touches and, if it
    writes, after the readers since; by induction that orders all conflicts."""
    s = group.scheds[pos]
    tracker = HazardTracker({DATA: s.count, **s.scratch_sizes})
    ancestors: list[int] = []
    last_native: dict[tuple[int, ...], int] = {}
    for i, (op, deps) in enumerate(zip(s.ops, s.deps)):
        anc = 0
        for j in deps:
            anc |= ancestors[j] | (1 << j)
        ancestors.append(anc)
        if isinstance(op, Native):
            # Natives are matched k-th with k-th (_match_natives), as MPI
            # matches them by call order: the dataflow executor keeps that
            # order only where the deps impose it.
            j = last_native.get(op.ranks, -1)
            if j >= 0 and not (anc >> j) & 1:
                raise ScheduleError(
                    f"rank {s.rank}: op {i} ({op_label(op)}) and op {j} "
                    f"({op_label(s.ops[j])}) are native collectives over the same ranks "
                    "that no dependency orders: members could start them in different orders")
            last_native[op.ranks] = i
        for j in sorted(tracker.touch(op, i)):
            if not (anc >> j) & 1:
                raise ScheduleError(
                    f"race on rank {s.rank}: op {i} ({op_label(op)}) and op {j} "
                    f"({op_label(s.ops[j])}) touch overlapping memory, one writes, "
                    "and no dependency orders them")


# -- (a) deadlock freedom and an execution order ---------------------------------
def _execution_order(group: _Group, pairs: dict[int, int],
                     natives: list[list[int]]) -> list[list[int]]:
    """Events (lists of gids completing together) in an order the worst-case
    executor can follow; ScheduleError if some op could never complete."""
    rep = list(range(group.total))
    members: dict[int, list[int]] = {g: [g] for g in range(group.total)}
    for sg, rg in pairs.items():
        _merge(rep, members, sg, [rg])
    for gids in natives:
        _merge(rep, members, gids[0], gids[1:])
    preds, succs = _event_edges(group, rep, members)
    ready = [e for e in members if not preds[e]]
    order: list[list[int]] = []
    while ready:
        e = ready.pop()
        order.append(members[e])
        for f in succs[e]:
            preds[f].discard(e)
            if not preds[f]:
                ready.append(f)
    if len(order) < len(members):
        _report_deadlock(group, members, preds, len(members) - len(order))
    return order


def _merge(rep: list[int], members: dict[int, list[int]], head: int,
           others: Iterable[int]) -> None:
    for g in others:
        rep[g] = head
        members[head].append(g)
        del members[g]


def _event_edges(group: _Group, rep: list[int], members: dict[int, list[int]]
                 ) -> tuple[dict[int, set[int]], dict[int, list[int]]]:
    preds: dict[int, set[int]] = {}
    succs: dict[int, list[int]] = {e: [] for e in members}
    for e, gids in members.items():
        ps: set[int] = set()
        for g in gids:
            pos = group.owner[g]
            base = group.base[pos]
            for j in group.scheds[pos].deps[g - base]:
                ps.add(rep[base + j])
        ps.discard(e)
        preds[e] = ps
        for p in ps:
            succs[p].append(e)
    return preds, succs


def _report_deadlock(group: _Group, members: dict[int, list[int]],
                     preds: dict[int, set[int]], stuck: int) -> None:
    e = min((e for e in members if preds[e]), key=lambda e: members[e][0])
    waits = min(preds[e])
    raise ScheduleError(
        f"deadlock: {stuck} operation group(s) can never complete, e.g. "
        f"{' + '.join(group.where(g) for g in members[e])} waits for "
        f"{' + '.join(group.where(g) for g in members[waits])} (a cycle of deps and "
        "messages, assuming sends complete only when received)")


# -- (c) symbolic execution -------------------------------------------------------
class _Symbols:
    """Interned expressions: ids below ``leaves`` are the initial data
    (member pos * count + index); larger ids index ``nodes``."""

    def __init__(self, ranks: tuple[int, ...], count: int) -> None:
        self.ranks = ranks
        self.leaves = len(ranks) * count
        self.count = count
        self.table: dict[Key, int] = {}
        self.nodes: list[Key] = []

    def intern(self, key: Key) -> int:
        i = self.table.get(key)
        if i is None:
            i = self.table[key] = self.leaves + len(self.nodes)
            self.nodes.append(key)
        return i

    def node(self, e: int) -> Key | None:
        return None if e < self.leaves else self.nodes[e - self.leaves]

    def show(self, e: int, depth: int = 3) -> str:
        """Readable form of an expression, for error messages."""
        if e == UNDEF:
            return "<uninitialised>"
        key = self.node(e)
        if key is None:
            return f"x{self.ranks[e // self.count]}[{e % self.count}]"  # rank's input
        if depth == 0:
            return "..."
        if key[0] == "scale":
            return f"({self.show(key[1], depth - 1)})/{key[2]}"
        inner = ", ".join(self.show(p, depth - 1) for p in _operands(key))
        return f"{key[1]}({inner})"


def _operands(key: Key) -> tuple[int, ...]:
    """The operand ids of a reduce or native node."""
    return key[2:] if key[0] == "reduce" else key[2]  # type: ignore[no-any-return]


class _Machine:
    """Every member's buffers, holding expression ids."""

    def __init__(self, group: _Group) -> None:
        self.group = group
        self.sym = _Symbols(group.ranks, group.count)
        c = group.count
        self.mem: list[dict[str, list[int]]] = []
        for pos, s in enumerate(group.scheds):
            bufs = {name: [UNDEF] * size for name, size in s.scratch}
            bufs[DATA] = list(range(pos * c, (pos + 1) * c))
            self.mem.append(bufs)

    def read(self, gid: int, slot_owner: int, slot: Slot) -> list[int]:
        vals = self.mem[slot_owner][slot.buf][slot.offset:slot.end]
        if UNDEF in vals:
            raise ScheduleError(f"{self.group.where(gid)} reads uninitialised memory "
                                f"{slot.buf}[{slot.offset}:{slot.end}]")
        return vals

    def run(self, event: list[int]) -> None:
        op = self.group.op_at(event[0])
        if isinstance(op, Native):
            self._native(event, op)
        elif isinstance(op, Send):
            self._message(event)
        else:
            self._local(event[0], op)

    def _local(self, gid: int, op: Op) -> None:
        pos = self.group.owner[gid]
        if isinstance(op, Reduce):
            a, b = self.read(gid, pos, op.dst), self.read(gid, pos, op.src)
            intern, name = self.sym.intern, op.op
            out = [intern(("reduce", name, x, y) if x <= y else ("reduce", name, y, x))
                   for x, y in zip(a, b)]
        elif isinstance(op, Copy):
            out = self.read(gid, pos, op.src)
        else:
            assert isinstance(op, Scale)
            intern, d = self.sym.intern, op.divisor
            out = [intern(("scale", x, d)) for x in self.read(gid, pos, op.dst)]
        dst = op.dst
        self.mem[pos][dst.buf][dst.offset:dst.end] = out

    def _message(self, event: list[int]) -> None:
        send_gid, recv_gid = event
        send, recv = self.group.op_at(send_gid), self.group.op_at(recv_gid)
        assert isinstance(send, Send) and isinstance(recv, Recv)
        vals = self.read(send_gid, self.group.owner[send_gid], send.src)
        self.mem[self.group.owner[recv_gid]][recv.dst.buf][recv.dst.offset:recv.dst.end] = vals

    def _native(self, event: list[int], first: Native) -> None:
        owners = [self.group.owner[g] for g in event]
        slots = [moved(self.group.op_at(g)) for g in event]
        inputs = [self.read(g, p, sl) for g, p, sl in zip(event, owners, slots)]
        if first.kind == "broadcast":
            out = inputs[owners.index(self.group.pos[first.root])]
        else:
            out = self._native_reduce(first, inputs)
        for p, sl in zip(owners, slots):
            self.mem[p][sl.buf][sl.offset:sl.end] = out

    def _native_reduce(self, op: Native, inputs: list[list[int]]) -> list[int]:
        intern, name = self.sym.intern, "sum" if op.op == "avg" else op.op
        out = [intern(("native", name, tuple(sorted(col)))) for col in zip(*inputs)]
        if op.op == "avg":
            out = [intern(("scale", x, len(op.ranks))) for x in out]
        return out


def _check_result(group: _Group, order: list[list[int]]) -> None:
    if group.collective == "barrier":
        _check_barrier(group, order)
        return
    machine = _Machine(group)
    for event in order:
        machine.run(event)
    if group.collective == "broadcast":
        _check_broadcast(group, machine)
    else:
        _check_allreduce(group, machine)


def _check_broadcast(group: _Group, machine: _Machine) -> None:
    c, root = group.count, group.pos[group.root]
    want = list(range(root * c, (root + 1) * c))
    for pos, bufs in enumerate(machine.mem):
        for i, (got, exp) in enumerate(zip(bufs[DATA], want)):
            if got != exp:
                raise ScheduleError(
                    f"broadcast: rank {group.ranks[pos]} ends with {machine.sym.show(got)} at "
                    f"element {i}, not the root's (rank {group.root}) element")


def _check_allreduce(group: _Group, machine: _Machine) -> None:
    """Each member's result first (the precise error), then their identity."""
    checker = _ReductionChecker(group, machine.sym)
    for pos in range(group.n):
        for i, e in enumerate(machine.mem[pos][DATA]):
            checker.check(e, i, group.ranks[pos])
    ref = machine.mem[0][DATA]
    for pos in range(1, group.n):
        data = machine.mem[pos][DATA]
        if data != ref:
            i = next(k for k, (x, y) in enumerate(zip(data, ref)) if x != y)
            raise ScheduleError(
                f"allreduce: rank {group.ranks[pos]} and rank {group.ranks[0]} compute element "
                f"{i} differently ({machine.sym.show(data[i])} vs {machine.sym.show(ref[i])}): "
                "results would not be bitwise identical")


class _ReductionChecker:
    """Checks that an expression reduces every member's element i exactly once."""

    def __init__(self, group: _Group, sym: _Symbols) -> None:
        self.group, self.sym = group, sym
        self.op = "sum" if group.op == "avg" else group.op
        self.full = (1 << group.n) - 1
        self.memo: dict[int, tuple[int, int]] = {}
        self.rank = -1

    def check(self, e: int, i: int, rank: int) -> None:
        """Element ``i`` of ``rank``'s final data is the expression ``e``."""
        self.rank = rank
        key = self.sym.node(e)
        if self.group.op == "avg":
            if key is not None and key[0] == "scale":
                if key[2] != self.group.n:
                    self._fail(i, e, f"is divided by {key[2]}, not the group size {self.group.n}")
                e = key[1]
            elif self.group.n > 1:
                self._fail(i, e, f"is not divided by the group size {self.group.n}")
        index, mask = self._leaves(e, i)
        if index != i:
            self._fail(i, e, f"reduces element {index}, not {i}")
        if mask != self.full:
            missing = [r for p, r in enumerate(self.group.ranks) if not (mask >> p) & 1]
            self._fail(i, e, f"lacks the contributions of ranks {missing}")

    def _leaves(self, e: int, i: int) -> tuple[int, int]:
        """(element index, bitmask of member positions) of a pure reduction."""
        if e < self.sym.leaves:
            return e % self.sym.count, 1 << (e // self.sym.count)
        hit = self.memo.get(e)
        if hit is not None:
            return hit
        key = self.sym.nodes[e - self.sym.leaves]
        if key[0] == "scale":
            self._fail(i, e, "is divided inside the reduction")
        if key[1] != self.op:
            self._fail(i, e, f"uses reduction {key[1]!r}, not {self.op!r}")
        index, mask = -1, 0
        for k in _operands(key):
            ki, km = self._leaves(k, i)
            if index not in (-1, ki):
                self._fail(i, e, f"mixes elements {index} and {ki}")
            if mask & km:
                dup = [r for p, r in enumerate(self.group.ranks) if (mask & km) >> p & 1]
                self._fail(i, e, f"reduces the contribution of ranks {dup} more than once")
            index, mask = ki, mask | km
        self.memo[e] = (index, mask)
        return index, mask

    def _fail(self, i: int, e: int, what: str) -> None:
        raise ScheduleError(f"allreduce({self.group.op}): element {i} of rank {self.rank}, "
                            f"{self.sym.show(e)}, {what}")


def _check_barrier(group: _Group, order: list[list[int]]) -> None:
    """Happens-before as bitsets of member positions: an op knows a rank has
    entered if some op of that rank precedes it through deps and messages (a
    Send's completion says nothing about its receiver; a Native's does)."""
    seen = [0] * group.total
    for event in order:
        before = 0
        for g in event:
            pos = group.owner[g]
            mine = 1 << pos
            for j in group.scheds[pos].deps[g - group.base[pos]]:
                mine |= seen[group.base[pos] + j]
            seen[g] = mine
            before |= mine
        if isinstance(group.op_at(event[0]), Send):
            seen[event[1]] |= seen[event[0]]
        elif isinstance(group.op_at(event[0]), Native):
            for g in event:
                seen[g] = before
    full = (1 << group.n) - 1
    for pos, s in enumerate(group.scheds):
        done = 1 << pos
        for i in range(len(s.ops)):
            done |= seen[group.base[pos] + i]
        if done != full:
            late = [r for p, r in enumerate(group.ranks) if not (done >> p) & 1]
            raise ScheduleError(f"barrier: rank {s.rank} can leave before ranks {late} "
                                "have entered")
