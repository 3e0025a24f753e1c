"""Property-based tests of the schedule compiler and its symbolic verifier.

1. Completeness: every schedule set the compiler builds for a shifting group
   (P ranks, groups of at most S, any step), any count, op, algorithm and root
   is accepted by the verifier.
2. Soundness: one corruption of one rank's schedule is rejected with
   ScheduleError. Corruptions are only asserted where they provably break the
   collective: either a rule the verifier documents is broken outright
   (message matching, native matching, unordered conflicting accesses), or the
   changed op is shown to matter by an independent dataflow trace of the intact
   schedules (``Trace``: which values reach a final result, and which element
   index each value derives from). Each mutation's comment says why it must fail.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from wagma_comm.errors import ScheduleError
from wagma_comm.groups import partition
from wagma_comm.schedule import algorithms as alg
from wagma_comm.schedule.build import MAX_MSG, REDUCE_OPS
from wagma_comm.schedule.ir import (
    DATA, Copy, Native, Op, Recv, Reduce, Scale, Schedule, Send, Slot, moved, reads, writes,
)
from wagma_comm.schedule.verify import verify

Group = tuple[Schedule, ...]
OPS = ("sum", "avg", "max", "min", "prod")

# Deterministic in CI (derandomize), no example database written into the tree.
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# -- property 1: the compiler's output always verifies ------------------------------
@settings(FUZZ, max_examples=30)
@given(data=st.data(), size=st.sampled_from(range(1, 25)),
       count=st.integers(1, 300) | st.sampled_from(range(1, 301)), op=st.sampled_from(OPS))
def test_every_compiled_schedule_set_verifies(data: st.DataObject, size: int, count: int,
                                              op: str) -> None:
    """Every group of the step's partition, in group order or shuffled, with every
    allreduce and broadcast algorithm (random root) and the barrier."""
    group_size = data.draw(st.sampled_from(range(1, size + 1)), label="group_size")
    step = data.draw(st.integers(0, 6), label="step")
    for group in partition(size, group_size, step):
        if data.draw(st.booleans(), label="shuffle"):
            group = tuple(data.draw(st.permutations(group), label="order"))
        for name in alg.ALLREDUCE_ALGORITHMS:
            verify(alg.compile_group("allreduce", group, count, op, -1, name))
        root = data.draw(st.sampled_from(group), label="root")
        for name in alg.BROADCAST_ALGORITHMS:
            verify(alg.compile_group("broadcast", group, count, "", root, name))
        verify(alg.compile_group("barrier", group))


# -- editing schedules (the IR is frozen: every edit builds a copy) -----------------
def replace_op(s: Schedule, i: int, op: Op) -> Schedule:
    return dataclasses.replace(s, ops=s.ops[:i] + (op,) + s.ops[i + 1:])


def drop_op(s: Schedule, i: int) -> Schedule:
    """Remove op ``i``; ops that waited for it wait for its deps instead, so the
    only thing missing is the op itself (no ordering is lost)."""
    def remap(deps: tuple[int, ...]) -> tuple[int, ...]:
        out: set[int] = set()
        for j in deps:
            out.update(s.deps[i] if j == i else (j,))
        return tuple(sorted(j - (j > i) for j in out))

    return dataclasses.replace(
        s, ops=s.ops[:i] + s.ops[i + 1:],
        deps=tuple(remap(d) for k, d in enumerate(s.deps) if k != i))


def insert_after(s: Schedule, i: int, op: Op) -> Schedule:
    """Insert ``op`` as op ``i + 1``, after op ``i``; whatever waited for op ``i``
    also waits for the new op (no ordering is lost)."""
    def remap(deps: tuple[int, ...]) -> tuple[int, ...]:
        out = {j + (j > i) for j in deps}
        return tuple(sorted(out | ({i + 1} if i in deps else set())))

    return dataclasses.replace(
        s, ops=s.ops[:i + 1] + (op,) + s.ops[i + 1:],
        deps=s.deps[:i + 1] + ((i,),) + tuple(remap(d) for d in s.deps[i + 1:]))


def set_deps(s: Schedule, i: int, deps: tuple[int, ...]) -> Schedule:
    return dataclasses.replace(s, deps=s.deps[:i] + (deps,) + s.deps[i + 1:])


def conflict(a: Op, b: Op) -> bool:
    """Overlapping accesses, at least one a write: the pair the verifier's race
    rule requires to be ordered."""
    acc_a = [(x, False) for x in reads(a)] + [(x, True) for x in writes(a)]
    acc_b = [(x, False) for x in reads(b)] + [(x, True) for x in writes(b)]
    return any(x.overlaps(y) and (wx or wy) for x, wx in acc_a for y, wy in acc_b)


def ancestors(deps: tuple[tuple[int, ...], ...]) -> list[int]:
    """Bitset of the transitive predecessors of each op."""
    out: list[int] = []
    for ds in deps:
        anc = 0
        for j in ds:
            anc |= out[j] | (1 << j)
        out.append(anc)
    return out


# -- an independent dataflow trace of an intact schedule set ------------------------
UNDEF, MIXED = -1, -2  # element tags: never written / derived from several indices


class Trace:
    """Runs the group in one legal order (program order per rank, buffered sends,
    natives when every member reached them) on *tags* instead of values: each
    element carries the index of the data element its value derives from. Then
    a backward pass finds, per op and element, whether the value the op produces
    (or moves) reaches some member's final data (``live``).

    If an op's output reaches a final element E, E's expression contains that
    output as a subterm; the mutations below use this to argue that E changes
    in a way the verifier must reject.
    """

    def __init__(self, group: Group) -> None:
        self.group = group
        self.pos = {s.rank: p for p, s in enumerate(group)}
        self.tags: list[dict[str, np.ndarray]] = [
            {**{n: np.full(c, UNDEF) for n, c in s.scratch}, DATA: np.arange(s.count)}
            for s in group]
        # (pos, i) -> tags of the whole buffer an op reads from, just before it ran
        self.before: dict[tuple[int, int], np.ndarray] = {}
        self.live: dict[tuple[int, int], np.ndarray] = {}
        self.src_live_after: dict[tuple[int, int], np.ndarray] = {}
        self._events: list[tuple[str, list[tuple[int, int]]]] = []
        self._forward()
        self._backward()

    # forward: tags
    def _forward(self) -> None:
        pc = [0] * len(self.group)
        mailbox: dict[tuple[int, int, int], tuple[np.ndarray, tuple[int, int]]] = {}
        progress = True
        while progress:
            progress = False
            for p, s in enumerate(self.group):
                while pc[p] < len(s.ops):
                    if not self._step(p, pc, mailbox):
                        break
                    progress = True
        assert all(pc[p] == len(s.ops) for p, s in enumerate(self.group)), "stuck"
        assert not mailbox

    def _step(self, p: int, pc: list[int],
              mailbox: dict[tuple[int, int, int], tuple[np.ndarray, tuple[int, int]]]) -> bool:
        s, i = self.group[p], pc[p]
        op, mem = s.ops[i], self.tags[p]
        if isinstance(op, Send):
            self.before[(p, i)] = mem[op.src.buf].copy()
            mailbox[(s.rank, op.peer, op.msg)] = (mem[op.src.buf][op.src.offset:op.src.end].copy(),
                                                  (p, i))
            self._events.append(("send", [(p, i)]))
        elif isinstance(op, Recv):
            key = (op.peer, s.rank, op.msg)
            if key not in mailbox:
                return False
            vals, sender = mailbox.pop(key)
            mem[op.dst.buf][op.dst.offset:op.dst.end] = vals
            self._events.append(("recv", [(p, i), sender]))
        elif isinstance(op, Native):
            members = [self.pos[r] for r in op.ranks]
            if not all(pc[m] < len(self.group[m].ops)
                       and isinstance(self.group[m].ops[pc[m]], Native) for m in members):
                return False
            ins = [self.tags[m][op.buf.buf][op.buf.offset:op.buf.end] for m in members]
            if op.kind == "broadcast":
                out = ins[members.index(self.pos[op.root])].copy()
            else:
                out = ins[0].copy()
                for other in ins[1:]:
                    out = _combine(out, other)
            self._events.append(("native", [(m, pc[m]) for m in members]))
            for m in members:
                self.tags[m][op.buf.buf][op.buf.offset:op.buf.end] = out
                if m != p:
                    pc[m] += 1  # this rank's own pc advances below
        else:
            if isinstance(op, Reduce):
                self.before[(p, i)] = mem[op.src.buf].copy()
                d, r = op.dst, op.src
                mem[d.buf][d.offset:d.end] = _combine(mem[d.buf][d.offset:d.end],
                                                      mem[r.buf][r.offset:r.end])
            elif isinstance(op, Copy):
                mem[op.dst.buf][op.dst.offset:op.dst.end] = \
                    mem[op.src.buf][op.src.offset:op.src.end]
            self._events.append(("local", [(p, i)]))
        pc[p] += 1
        return True

    # backward: liveness
    def _backward(self) -> None:
        need = [{n: np.zeros(len(t), bool) for n, t in mem.items()} for mem in self.tags]
        for p in range(len(self.group)):
            need[p][DATA][:] = True  # every member's final data is the result
        carried: dict[tuple[int, int], np.ndarray] = {}  # send -> need of its message
        for _, where in reversed(self._events):
            p, i = where[0]
            op = self.group[p].ops[i]
            if isinstance(op, Recv):
                d = op.dst
                w = need[p][d.buf][d.offset:d.end].copy()
                need[p][d.buf][d.offset:d.end] = False  # overwritten here
                self.live[(p, i)] = carried[where[1]] = w
            elif isinstance(op, Send):
                w = carried.pop((p, i))
                self.live[(p, i)] = w
                need[p][op.src.buf][op.src.offset:op.src.end] |= w
            elif isinstance(op, Native):  # every member's copy is one call
                b = op.buf
                w = np.zeros(b.count, bool)
                for m, _ in where:
                    w |= need[m][b.buf][b.offset:b.end]
                for m, j in where:
                    self.live[(m, j)] = w
                    feeds = op.kind == "allreduce" or self.group[m].rank == op.root
                    need[m][b.buf][b.offset:b.end] = w if feeds else False
            else:
                d = writes(op)[0]
                w = need[p][d.buf][d.offset:d.end].copy()
                self.live[(p, i)] = w
                if isinstance(op, Copy):
                    need[p][d.buf][d.offset:d.end] = False
                if isinstance(op, (Reduce, Copy)):
                    r = op.src
                    self.src_live_after[(p, i)] = need[p][r.buf][r.offset:r.end].copy()
                    need[p][r.buf][r.offset:r.end] |= w
                # Reduce and Scale also read dst: its need is unchanged

    def is_live(self, p: int, i: int) -> bool:
        return bool(self.live[(p, i)].any())


def _combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.where(a == b, a, MIXED)
    return np.where((a == UNDEF) | (b == UNDEF), UNDEF, out)


# -- mutations --------------------------------------------------------------------
# A mutation gets the intact group, the position of the rank to corrupt, the
# trace and hypothesis' data; it returns the corrupted group, or None when it
# does not apply to this schedule (no eligible op).
Mutation = Callable[[Group, int, Trace, st.DataObject], "Group | None"]


def _indices(s: Schedule, kinds: type | tuple[type, ...]) -> list[int]:
    return [i for i, op in enumerate(s.ops) if isinstance(op, kinds)]


def _pick(data: st.DataObject, choices: list[int]) -> int | None:
    return data.draw(st.sampled_from(choices), label="op") if choices else None


def _swap(group: Group, p: int, s: Schedule) -> Group:
    return group[:p] + (s,) + group[p + 1:]


def drop_message(group: Group, p: int, tr: Trace, data: st.DataObject) -> Group | None:
    """Must fail: the partner's matching Recv/Send of (sender, receiver, msg)
    loses its counterpart (message keys are unique in the intact group)."""
    s = group[p]
    i = _pick(data, _indices(s, (Send, Recv)))
    return None if i is None else _swap(group, p, drop_op(s, i))


def retarget(group: Group, p: int, tr: Trace, data: st.DataObject) -> Group | None:
    """Must fail: the old partner's Recv/Send keyed (sender, receiver, msg) has
    no counterpart any more (the new peer may be another member, a
    non-member, or the rank itself)."""
    s = group[p]
    i = _pick(data, _indices(s, (Send, Recv)))
    if i is None:
        return None
    op = s.ops[i]
    assert isinstance(op, (Send, Recv))
    peer = data.draw(st.sampled_from(list(s.ranks) + [max(s.ranks) + 1, -1])
                     .filter(lambda q: q != op.peer), label="peer")
    return _swap(group, p, replace_op(s, i, dataclasses.replace(op, peer=peer)))


def renumber(group: Group, p: int, tr: Trace, data: st.DataObject) -> Group | None:
    """Must fail: the partner's op keyed with the old number is left unmatched
    (or the new number collides with another message: a duplicate key)."""
    s = group[p]
    i = _pick(data, _indices(s, (Send, Recv)))
    if i is None:
        return None
    op = s.ops[i]
    assert isinstance(op, (Send, Recv))
    msg = data.draw(st.one_of(st.integers(-2, op.msg + 3), st.just(MAX_MSG))
                    .filter(lambda m: m != op.msg), label="msg")
    return _swap(group, p, replace_op(s, i, dataclasses.replace(op, msg=msg)))


def resize_message(group: Group, p: int, tr: Trace, data: st.DataObject) -> Group | None:
    """Must fail: a Send and its Recv must move the same number of elements
    (a count past the buffer's end is malformed on its own)."""
    s = group[p]
    i = _pick(data, _indices(s, (Send, Recv)))
    if i is None:
        return None
    op = s.ops[i]
    assert isinstance(op, (Send, Recv))
    slot = moved(op)
    size = s.count if slot.buf == DATA else s.scratch_sizes[slot.buf]
    count = data.draw(st.integers(0, size - slot.offset + 1)
                      .filter(lambda c: c != slot.count), label="count")
    new = dataclasses.replace(slot, count=count)
    changed = dataclasses.replace(op, src=new) if isinstance(op, Send) \
        else dataclasses.replace(op, dst=new)
    return _swap(group, p, replace_op(s, i, changed))


def duplicate_send(group: Group, p: int, tr: Trace, data: st.DataObject) -> Group | None:
    """Must fail: a second Send with the same key is a duplicate message; with a
    fresh number it is a Send no Recv matches."""
    s = group[p]
    i = _pick(data, _indices(s, Send))
    if i is None:
        return None
    op = s.ops[i]
    assert isinstance(op, Send)
    if data.draw(st.booleans(), label="fresh number"):
        used = [o.msg for o in s.ops if isinstance(o, Send) and o.peer == op.peer]
        op = dataclasses.replace(op, msg=max(used) + 1)
    return _swap(group, p, insert_after(s, i, op))


def corrupt_native(group: Group, p: int, tr: Trace, data: st.DataObject) -> Group | None:
    """Must fail: a native call is one call of all its members with identical
    arguments; this rank now leaves it out, or issues it with another op,
    root, count or member list (n >= 2 here, so the others disagree)."""
    s = group[p]
    i = _pick(data, _indices(s, Native))
    if i is None:
        return None
    op = s.ops[i]
    assert isinstance(op, Native)
    how = data.draw(st.sampled_from(["drop", "op", "root", "count", "ranks"]), label="how")
    if how == "drop":
        return _swap(group, p, drop_op(s, i))
    if how == "op":
        new = dataclasses.replace(op, op=data.draw(
            st.sampled_from(["", "sum", "avg", "max", "min", "prod"]).filter(
                lambda o: o != op.op)))
    elif how == "root":
        new = dataclasses.replace(op, root=data.draw(
            st.sampled_from(list(op.ranks) + [-1]).filter(lambda r: r != op.root)))
    elif how == "count":
        new = dataclasses.replace(op, buf=Slot(DATA, 0, data.draw(
            st.integers(0, s.count - 1))))
    else:  # drop another member, or reorder them
        others = [r for r in op.ranks if r != s.rank]
        gone = data.draw(st.sampled_from(others))
        members = tuple(r for r in op.ranks if r != gone)
        if len(op.ranks) > 2 and data.draw(st.booleans()):
            members = op.ranks[::-1]  # same set, another call key
        new = dataclasses.replace(op, ranks=members)
    return _swap(group, p, replace_op(s, i, new))


def drop_dependency(group: Group, p: int, tr: Trace, data: st.DataObject) -> Group | None:
    """Must fail: op i and its dep j touch overlapping memory, one of them
    writing, and without this dep j is no longer an ancestor of i (not even
    transitively): the race rule (b) requires them to be ordered."""
    s = group[p]
    anc = ancestors(s.deps)
    choices = []
    for i, ds in enumerate(s.deps):
        for j in ds:
            if not conflict(s.ops[i], s.ops[j]):
                continue
            rest = 0
            for k in ds:
                if k != j:
                    rest |= anc[k] | (1 << k)
            if not (rest >> j) & 1:
                choices.append((i, j))
    if not choices:
        return None
    i, j = data.draw(st.sampled_from(choices), label="dep")
    return _swap(group, p, set_deps(s, i, tuple(k for k in s.deps[i] if k != j)))


def _live(tr: Trace, p: int, s: Schedule, kinds: type | tuple[type, ...]) -> list[int]:
    return [i for i in _indices(s, kinds) if tr.is_live(p, i)]


def drop_reduce(group: Group, p: int, tr: Trace, data: st.DataObject) -> Group | None:
    """Must fail: the Reduce's output is live, so some final expression E holds
    it as a subterm, and (E reduces each contribution once) the contributions
    of its src appear in E only there. Without the Reduce, E lacks them."""
    s = group[p]
    i = _pick(data, _live(tr, p, s, Reduce))
    return None if i is None else _swap(group, p, drop_op(s, i))


def duplicate_reduce(group: Group, p: int, tr: Trace, data: st.DataObject) -> Group | None:
    """Must fail: running a live Reduce twice folds its src into dst twice, so a
    final expression reduces those contributions twice."""
    s = group[p]
    i = _pick(data, _live(tr, p, s, Reduce))
    return None if i is None else _swap(group, p, insert_after(s, i, s.ops[i]))


def change_reduce_op(group: Group, p: int, tr: Trace, data: st.DataObject) -> Group | None:
    """Must fail: a final expression now contains a node of another reduction
    than the collective's."""
    s = group[p]
    i = _pick(data, _live(tr, p, s, Reduce))
    if i is None:
        return None
    op = s.ops[i]
    assert isinstance(op, Reduce)
    new = data.draw(st.sampled_from(REDUCE_OPS).filter(lambda o: o != op.op), label="reduction")
    return _swap(group, p, replace_op(s, i, dataclasses.replace(op, op=new)))


def swap_reduce(group: Group, p: int, tr: Trace, data: st.DataObject) -> Group | None:
    """Must fail: with src and dst swapped the reduced value lands in src, whose
    value after the op is dead (checked), while dst keeps its old value, which
    lacks src's contributions, at an element whose value is live."""
    s = group[p]
    i = _pick(data, [i for i in _live(tr, p, s, Reduce)
                     if not tr.src_live_after[(p, i)].any()])
    if i is None:
        return None
    op = s.ops[i]
    assert isinstance(op, Reduce)
    return _swap(group, p, replace_op(s, i, Reduce(op.src, op.dst, op.op)))


def drop_scale(group: Group, p: int, tr: Trace, data: st.DataObject) -> Group | None:
    """Must fail: a live Scale (avg) is the division of some final expression;
    without it that element is not divided by the group size (n >= 2)."""
    s = group[p]
    i = _pick(data, _live(tr, p, s, Scale))
    return None if i is None else _swap(group, p, drop_op(s, i))


def rescale(group: Group, p: int, tr: Trace, data: st.DataObject) -> Group | None:
    """Must fail: a final expression is divided by another number than the group
    size (0 is malformed on its own)."""
    s = group[p]
    i = _pick(data, _live(tr, p, s, Scale))
    if i is None:
        return None
    op = s.ops[i]
    assert isinstance(op, Scale)
    divisor = data.draw(st.integers(0, 2 * len(s.ranks) + 1).filter(
        lambda d: d != op.divisor), label="divisor")
    return _swap(group, p, replace_op(s, i, dataclasses.replace(op, divisor=divisor)))


def shift_read(group: Group, p: int, tr: Trace, data: st.DataObject) -> Group | None:
    """Must fail: a Send's or Reduce's src is moved to another offset of its
    buffer where, at some element whose value is live, the trace shows a value
    derived from another data index (or never written). A final expression for
    index k then contains a contribution of another index (or the op reads
    uninitialised memory). Shifts that read an equally-tagged value are not
    asserted: they might be harmless. Optionally the moved read is also ordered
    after every earlier and before every later conflicting op of its rank, so
    it is race-free and reads exactly the traced value (program order): the
    rejection must then come from the result check (or a deadlock)."""
    s = group[p]
    room = [i for i in _live(tr, p, s, (Send, Reduce))  # src smaller than its buffer
            if len(tr.before[(p, i)]) > s.ops[i].src.count]  # type: ignore[union-attr]
    i = _pick(data, room)
    if i is None:
        return None
    op = s.ops[i]
    assert isinstance(op, (Send, Reduce))
    buf = tr.before[(p, i)]  # tags of src's buffer when the op ran
    windows = np.lib.stride_tricks.sliding_window_view(buf, op.src.count)
    old = buf[op.src.offset:op.src.end]
    differs = ((windows != old) & tr.live[(p, i)]).any(axis=1)
    offsets = [int(o) for o in np.flatnonzero(differs)]
    if not offsets:
        return None
    off = data.draw(st.sampled_from(offsets), label="offset")
    op = s.ops[i]
    assert isinstance(op, (Send, Reduce))
    new = dataclasses.replace(op, src=dataclasses.replace(op.src, offset=off))
    s = replace_op(s, i, new)
    if data.draw(st.booleans(), label="order the moved read"):
        deps = [set(d) for d in s.deps]
        deps[i] |= {j for j in range(i) if conflict(new, s.ops[j])}
        for k in range(i + 1, len(s.ops)):
            if conflict(new, s.ops[k]):
                deps[k].add(i)
        s = dataclasses.replace(s, deps=tuple(tuple(sorted(d)) for d in deps))
    return _swap(group, p, s)


# Which compiled collectives each mutation is tried on: the ones that have the
# ops it edits (avg: a Scale; non-native: messages and Reduces).
ALLREDUCE_P2P = ("recursive_doubling", "rabenseifner", "ring")
BROADCAST_P2P = ("binomial", "scatter_allgather")
P2P = {"allreduce": ALLREDUCE_P2P, "broadcast": BROADCAST_P2P}
REDUCING = {"allreduce": ALLREDUCE_P2P}
NATIVE = {"allreduce": ("native",), "broadcast": ("native",)}
# Only these move parts of a buffer (the others move whole buffers: no room).
CHUNKED = {"allreduce": ("rabenseifner", "ring"), "broadcast": ("scatter_allgather",)}
MUTATIONS: dict[str, tuple[Mutation, dict[str, tuple[str, ...]], tuple[str, ...]]] = {
    # name: (mutation, algorithms per collective, allreduce ops)
    "drop_message": (drop_message, P2P, OPS),
    "retarget": (retarget, P2P, OPS),
    "renumber": (renumber, P2P, OPS),
    "resize_message": (resize_message, P2P, OPS),
    "duplicate_send": (duplicate_send, P2P, OPS),
    "corrupt_native": (corrupt_native, NATIVE, OPS),
    "drop_dependency": (drop_dependency, P2P, OPS),
    "drop_reduce": (drop_reduce, REDUCING, OPS),
    "duplicate_reduce": (duplicate_reduce, REDUCING, OPS),
    "change_reduce_op": (change_reduce_op, REDUCING, OPS),
    "swap_reduce": (swap_reduce, REDUCING, OPS),
    "drop_scale": (drop_scale, {"allreduce": alg.ALLREDUCE_ALGORITHMS}, ("avg",)),
    "rescale": (rescale, {"allreduce": alg.ALLREDUCE_ALGORITHMS}, ("avg",)),
    "shift_read": (shift_read, CHUNKED, OPS),
}

_COUNTS = st.integers(1, 300) | st.sampled_from(range(1, 301))


@st.composite
def intact_groups(draw: st.DrawFn, algorithms: dict[str, tuple[str, ...]],
                  ops: tuple[str, ...]) -> Group:
    """A schedule set of a shifting group with at least two members."""
    # sampled_from draws about uniformly (integers() favours small values), so
    # large groups are common too.
    size = draw(st.sampled_from(range(2, 25)), label="size")
    group_size = draw(st.sampled_from(range(2, size + 1)), label="group_size")
    step = draw(st.integers(0, 6), label="step")
    group = max(partition(size, group_size, step), key=len)
    assume(len(group) >= 2)
    if draw(st.booleans(), label="shuffle"):
        group = tuple(draw(st.permutations(group), label="order"))
    count = draw(_COUNTS, label="count")
    collective = draw(st.sampled_from(sorted(algorithms)), label="collective")
    name = draw(st.sampled_from(algorithms[collective]), label="algorithm")
    if collective == "allreduce":
        return alg.compile_group(collective, group, count,
                                 draw(st.sampled_from(ops), label="op"), -1, name)
    return alg.compile_group(collective, group, count, "",
                             draw(st.sampled_from(group), label="root"), name)


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@settings(FUZZ, max_examples=30)  # per mutation
@given(data=st.data())
def test_corrupted_schedules_are_rejected(mutation: str, data: st.DataObject) -> None:
    """One provably harmful corruption of one rank's schedule: ScheduleError."""
    mutate, algorithms, ops = MUTATIONS[mutation]
    group = data.draw(intact_groups(algorithms, ops), label="group")
    verify(group)  # the intact set passes, so the rejection is the corruption's
    trace = Trace(group)
    first = data.draw(st.integers(0, len(group) - 1), label="rank position")
    for k in range(len(group)):  # the first rank from there the mutation applies to
        bad = mutate(group, (first + k) % len(group), trace, data)
        if bad is not None:
            break
    assume(bad is not None)
    event(f"{group[0].collective}/{group[0].algorithm}")
    event(f"{len(group) // 4 * 4}..{len(group) // 4 * 4 + 3} members")
    with pytest.raises(ScheduleError):
        verify(bad)


# -- verifier bugs found while writing these tests (they fail until fixed) -----------
def test_scratch_named_data_cannot_widen_the_user_buffer() -> None:
    """KNOWN BUG: the verifier takes buffer sizes from ``{DATA: count,
    **scratch}``, so a scratch entry named "data" (the builder refuses that
    name, a schedule loaded with ``export.from_json`` need not) overrides the
    user buffer's size. An op may then run past the end of the user's buffer:
    here the Scale divides 1000 elements of a 4-element buffer, and verify()
    accepts it because its symbolic memory silently clips the slice."""
    good = alg.compile_group("allreduce", (0, 1), 4, "avg", -1, "native")
    verify(good)
    s = good[0]
    assert isinstance(s.ops[1], Scale)
    bad = dataclasses.replace(s, scratch=(("data", 1000),),
                              ops=(s.ops[0], Scale(Slot(DATA, 0, 1000), 2)))
    with pytest.raises(ScheduleError):
        verify((bad, good[1]))


@pytest.mark.parametrize("root", [7, -1])
def test_native_broadcast_root_outside_the_group_is_a_schedule_error(root: int) -> None:
    """KNOWN BUG: _check_fields does not check a Native broadcast's root (the
    builder's _check_native does); when every member names the same non-member
    root the natives match, and symbolic execution fails with a raw KeyError
    (``group.pos[first.root]``) instead of ScheduleError."""
    good = alg.compile_group("broadcast", (0, 1, 2), 4, "", 0, "native")
    verify(good)
    bad = tuple(replace_op(s, 0, dataclasses.replace(s.ops[0], root=root)) for s in good)
    with pytest.raises(ScheduleError):
        verify(bad)
