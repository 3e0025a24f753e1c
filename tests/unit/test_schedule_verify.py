"""The verifier must reject broken schedules, one corruption at a time, with a
message that says what is wrong (each test also checks the intact schedules
pass, so a rejection is caused by the corruption alone)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest

from wagma_comm.errors import ScheduleError
from wagma_comm.schedule import algorithms as alg
from wagma_comm.schedule.build import ScheduleBuilder
from wagma_comm.schedule.ir import (
    DATA, Native, Op, Recv, Reduce, Scale, Schedule, Send, Slot,
)
from wagma_comm.schedule.verify import verify, verify_collective

Group = tuple[Schedule, ...]


# -- editing helpers (tests only: the library never edits schedules) --------------
def drop_op(s: Schedule, i: int) -> Schedule:
    """Remove op ``i``; its dependents inherit its deps (so nothing but the op
    itself goes missing)."""
    def remap(deps: tuple[int, ...]) -> tuple[int, ...]:
        out: set[int] = set()
        for j in deps:
            out.update(s.deps[i] if j == i else (j,))
        return tuple(sorted(j - (j > i) for j in out))

    ops = s.ops[:i] + s.ops[i + 1:]
    deps = tuple(remap(d) for k, d in enumerate(s.deps) if k != i)
    return dataclasses.replace(s, ops=ops, deps=deps)


def insert_after(s: Schedule, i: int, op: Op) -> Schedule:
    """Insert ``op`` right after op ``i``, depending on it; every later op that
    waited for ``i`` also waits for the new op (so no race is introduced)."""
    def shift(deps: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted({j + (j > i) for j in deps} | ({i + 1} if i in deps else set())))

    ops = s.ops[:i + 1] + (op,) + s.ops[i + 1:]
    deps = s.deps[:i + 1] + ((i,),) + tuple(shift(d) for d in s.deps[i + 1:])
    return dataclasses.replace(s, ops=ops, deps=deps)


def replace_op(s: Schedule, i: int, op: Op) -> Schedule:
    return dataclasses.replace(s, ops=s.ops[:i] + (op,) + s.ops[i + 1:])


def first(s: Schedule, kind: type) -> int:
    return next(i for i, op in enumerate(s.ops) if isinstance(op, kind))


def edit(group: Group, rank: int, change: Callable[[Schedule], Schedule]) -> Group:
    return tuple(change(s) if s.rank == rank else s for s in group)


def compiled(collective: str, n: int, count: int, algorithm: str, op: str = "",
             root: int = -1, ranks: tuple[int, ...] | None = None) -> Group:
    group = alg.compile_group(collective, ranks or tuple(range(n)), count, op, root, algorithm)
    verify(group)  # the intact version is correct
    return group


# -- one test per corruption ------------------------------------------------------
def test_dropped_send_is_rejected() -> None:
    g = compiled("allreduce", 4, 8, "recursive_doubling", "sum")
    bad = edit(g, 1, lambda s: drop_op(s, first(s, Send)))
    with pytest.raises(ScheduleError, match="rank 0 op .*recv.* has no matching Send"):
        verify(bad)


def test_dropped_recv_is_rejected() -> None:
    g = compiled("allreduce", 5, 9, "ring", "avg")
    bad = edit(g, 2, lambda s: drop_op(s, first(s, Recv)))
    with pytest.raises(ScheduleError, match="no matching Recv on rank 2"):
        verify(bad)


def test_changed_peer_is_rejected() -> None:
    g = compiled("allreduce", 4, 8, "ring", "sum")

    def redirect(s: Schedule) -> Schedule:
        i = first(s, Send)
        op = s.ops[i]
        assert isinstance(op, Send) and op.peer == 1
        return replace_op(s, i, dataclasses.replace(op, peer=2))

    with pytest.raises(ScheduleError, match="no matching"):
        verify(edit(g, 0, redirect))


def test_changed_count_is_rejected() -> None:
    g = compiled("allreduce", 4, 37, "rabenseifner", "sum")

    def shrink(s: Schedule) -> Schedule:
        i = first(s, Send)
        op = s.ops[i]
        assert isinstance(op, Send)
        return replace_op(s, i, dataclasses.replace(op, src=dataclasses.replace(
            op.src, count=op.src.count - 1)))

    with pytest.raises(ScheduleError, match=r"sends \d+ elements but .* receives \d+"):
        verify(edit(g, 0, shrink))


def test_dropped_dependency_is_a_race() -> None:
    g = compiled("allreduce", 4, 8, "ring", "sum")

    def forget(s: Schedule) -> Schedule:
        i = first(s, Reduce)
        recv = i - 1
        assert isinstance(s.ops[recv], Recv) and recv in s.deps[i]
        deps = tuple(d for d in s.deps[i] if d != recv)
        return dataclasses.replace(s, deps=s.deps[:i] + (deps,) + s.deps[i + 1:])

    with pytest.raises(ScheduleError, match="race on rank 3: op 2 .* and op 1"):
        verify(edit(g, 3, forget))


def test_dropped_war_dependency_is_a_race() -> None:
    """The second receive into a buffer must wait until the reduce read it."""
    g = compiled("allreduce", 8, 8, "recursive_doubling", "sum")

    def forget(s: Schedule) -> Schedule:
        recvs = [i for i, op in enumerate(s.ops) if isinstance(op, Recv)]
        third = recvs[2]  # reuses tmp0 after the first reduce
        assert s.deps[third]
        return dataclasses.replace(s, deps=s.deps[:third] + ((),) + s.deps[third + 1:])

    with pytest.raises(ScheduleError, match="race"):
        verify(edit(g, 5, forget))


def test_duplicated_reduce_is_rejected() -> None:
    g = compiled("allreduce", 2, 3, "recursive_doubling", "sum")

    def twice(s: Schedule) -> Schedule:
        i = first(s, Reduce)
        return insert_after(s, i, s.ops[i])

    with pytest.raises(ScheduleError, match="rank 0.*more than once"):
        verify(edit(g, 0, twice))


def test_dropped_scale_of_avg_is_rejected() -> None:
    for algorithm in ("recursive_doubling", "ring", "native"):
        g = compiled("allreduce", 4, 9, algorithm, "avg")
        bad = edit(g, 0, lambda s: drop_op(s, first(s, Scale)))
        with pytest.raises(ScheduleError, match="not divided by the group size 4"):
            verify(bad)


def test_scale_by_wrong_divisor_is_rejected() -> None:
    g = compiled("allreduce", 3, 9, "ring", "avg")

    def wrong(s: Schedule) -> Schedule:
        i = first(s, Scale)
        return replace_op(s, i, dataclasses.replace(s.ops[i], divisor=4))

    with pytest.raises(ScheduleError, match="divided by 4"):
        verify(edit(g, 1, wrong))


def test_swapped_root_is_rejected() -> None:
    g = compiled("broadcast", 5, 7, "binomial", root=0)
    bad = tuple(dataclasses.replace(s, root=2) for s in g)
    with pytest.raises(ScheduleError, match=r"not the root's \(rank 2\)"):
        verify(bad)


def test_wrong_op_is_rejected() -> None:
    g = compiled("allreduce", 3, 4, "recursive_doubling", "sum")
    bad = tuple(dataclasses.replace(s, op="max") for s in g)
    with pytest.raises(ScheduleError, match="uses reduction 'sum', not 'max'"):
        verify(bad)


def test_different_reduction_trees_are_rejected() -> None:
    """Every rank reducing the ring's chunks itself in its own order gives
    correct sums that are not bitwise identical: the verifier must say so."""
    n, ranks = 3, (0, 1, 2)
    scheds = []
    for me in ranks:
        b = ScheduleBuilder("allreduce", "naive", me, ranks, 1, "sum")
        tmp = [Slot(b.scratch(f"t{r}", 1), 0, 1) for r in ranks]
        for r in ranks:
            if r != me:
                b.send(Slot(DATA, 0, 1), r)
                b.recv(tmp[r], r)
        for k in range(1, n):  # data + from (me+1) + from (me+2): order depends on me
            b.reduce(Slot(DATA, 0, 1), tmp[(me + k) % n], "sum")
        scheds.append(b.build())
    with pytest.raises(ScheduleError, match="not be bitwise identical"):
        verify(scheds)


def test_deadlock_is_rejected() -> None:
    """Both partners receive before they send: fine with buffering, a deadlock
    when sends complete only on receipt."""
    scheds = []
    for me, peer in ((0, 1), (1, 0)):
        b = ScheduleBuilder("allreduce", "bad", me, (0, 1), 2, "sum")
        t = Slot(b.scratch("t", 2), 0, 2)
        r = b.recv(t, peer)
        b.send(Slot(DATA, 0, 2), peer, after=[r])
        b.reduce(Slot(DATA, 0, 2), t, "sum")
        scheds.append(b.build())
    with pytest.raises(ScheduleError, match="deadlock"):
        verify(scheds)


def test_uninitialised_scratch_is_rejected() -> None:
    scheds = []
    for me, peer in ((0, 1), (1, 0)):
        b = ScheduleBuilder("allreduce", "bad", me, (0, 1), 2, "sum")
        t = Slot(b.scratch("t", 4), 0, 2)
        b.send(Slot(DATA, 0, 2), peer)
        b.recv(t, peer)
        b.reduce(Slot(DATA, 0, 2), Slot("t", 2, 2), "sum")  # the wrong half
        scheds.append(b.build())
    with pytest.raises(ScheduleError, match="uninitialised"):
        verify(scheds)


def test_barrier_without_ordering_is_rejected() -> None:
    g = compiled("barrier", 8, 0, "dissemination")
    bad = tuple(dataclasses.replace(s, deps=tuple(() for _ in s.deps)) for s in g)
    with pytest.raises(ScheduleError, match="barrier: rank .* can leave before"):
        verify(bad)


def test_mismatched_native_is_rejected() -> None:
    g = compiled("allreduce", 3, 6, "native", "sum")

    def other(s: Schedule) -> Schedule:
        op = s.ops[0]
        assert isinstance(op, Native)
        return replace_op(s, 0, dataclasses.replace(op, op="max"))

    with pytest.raises(ScheduleError, match="does not match"):
        verify(edit(g, 2, other))
    with pytest.raises(ScheduleError, match="issued only by ranks"):
        verify(edit(g, 1, lambda s: drop_op(s, 0)))


def _two_natives(rank: int, gate_first: bool) -> Schedule:
    """Natives A (d[0:1]) then B (d[1:2]) over ranks (0, 1); a zero-byte message
    from rank 0 to rank 1 gates A (``gate_first``) or B."""
    b = ScheduleBuilder("allreduce", "custom", rank, (0, 1), 2, "sum")
    empty, a, z = Slot(DATA, 0, 0), Slot(DATA, 0, 1), Slot(DATA, 1, 1)
    gate = b.send(empty, 1) if rank == 0 else b.recv(empty, 0)
    b.native("allreduce", a, "sum", (0, 1), after=[gate] if gate_first else [])
    b.native("allreduce", z, "sum", (0, 1), after=[] if gate_first else [gate])
    return b.build()


def test_natives_over_the_same_ranks_are_chained_by_the_builder() -> None:
    """MPI matches nonblocking collectives on one communicator by call order;
    the dataflow executor calls a native once its deps are done."""
    g = (_two_natives(0, gate_first=False), _two_natives(1, gate_first=True))
    assert 1 in g[1].deps[2]  # B waits for A although their slots are disjoint
    verify(g)


def test_unordered_natives_over_the_same_ranks_are_rejected() -> None:
    """Rank 0 could call B first and rank 1 A first (A waits for the message
    there): MPI would pair A with B. The verifier matched them k-th with k-th
    and passed this until the ordering was required."""
    g = (_two_natives(0, gate_first=False), _two_natives(1, gate_first=True))
    unchained = edit(g, 1, lambda s: dataclasses.replace(s, deps=s.deps[:2] + ((),)))
    with pytest.raises(ScheduleError, match="native collectives over the same ranks"):
        verify(unchained)


def test_missing_and_duplicate_members_are_rejected() -> None:
    g = compiled("allreduce", 3, 6, "ring", "sum")
    with pytest.raises(ScheduleError, match="missing"):
        verify(g[:2])
    with pytest.raises(ScheduleError, match="two schedules"):
        verify(g + g[:1])
    with pytest.raises(ScheduleError, match="no schedules"):
        verify(())


def test_inconsistent_headers_are_rejected() -> None:
    g = compiled("allreduce", 3, 6, "ring", "sum")
    with pytest.raises(ScheduleError, match="schedule is for"):
        verify((dataclasses.replace(g[0], count=5),) + g[1:])


def test_duplicate_message_number_is_rejected() -> None:
    g = compiled("allreduce", 3, 6, "ring", "sum")

    def renumber(s: Schedule) -> Schedule:
        sends = [i for i, op in enumerate(s.ops) if isinstance(op, Send)]
        return replace_op(s, sends[1], dataclasses.replace(s.ops[sends[1]], msg=0))

    with pytest.raises(ScheduleError, match="both sends message #0"):
        verify(edit(g, 0, renumber))


@pytest.mark.parametrize("change,match", [
    (lambda s: dataclasses.replace(s, deps=s.deps[:-1]), "dep lists"),
    (lambda s: dataclasses.replace(s, deps=s.deps[:-1] + ((len(s.ops),),)), "earlier ops"),
    (lambda s: replace_op(s, 0, dataclasses.replace(s.ops[0], src=Slot(DATA, 4, 9))),
     "exceeds"),
    (lambda s: replace_op(s, 0, dataclasses.replace(s.ops[0], src=Slot("x", 0, 1))),
     "unknown buffer"),
    (lambda s: replace_op(s, 0, dataclasses.replace(s.ops[0], peer=s.rank)),
     "not another member"),
])
def test_malformed_schedules_are_rejected(change: Callable[[Schedule], Schedule],
                                          match: str) -> None:
    g = compiled("allreduce", 2, 6, "recursive_doubling", "sum")
    with pytest.raises(ScheduleError, match=match):
        verify(edit(g, 0, change))


# -- acceptance edge cases -----------------------------------------------------------
def test_avg_of_one_member_may_omit_the_scale() -> None:
    verify_collective("allreduce", (5,), 4, "avg", algorithm="ring")
    b = ScheduleBuilder("allreduce", "x", 5, (5,), 4, "avg")
    b.scale(Slot(DATA, 0, 4), 1)
    verify([b.build()])


def _on_every_send_and_recv(field: str, change: Callable[[int], object]
                            ) -> Callable[[Schedule], Schedule]:
    def apply(s: Schedule) -> Schedule:
        ops = tuple(dataclasses.replace(op, **{field: change(getattr(op, field))})
                    if isinstance(op, (Send, Recv)) else op for op in s.ops)
        return dataclasses.replace(s, ops=ops)
    return apply


@pytest.mark.parametrize("algorithm,change,match", [
    # every member renamed consistently, so the messages still pair up
    ("recursive_doubling", _on_every_send_and_recv("peer", float), "not another member"),
    ("recursive_doubling", _on_every_send_and_recv("msg", float), "msg"),
    ("recursive_doubling", _on_every_send_and_recv("msg", bool), "msg"),
    ("recursive_doubling", lambda s: replace_op(s, first(s, Scale), Scale(
        s.ops[first(s, Scale)].dst, float(s.ops[first(s, Scale)].divisor))), "divisor"),
    ("native", lambda s: replace_op(s, first(s, Native), dataclasses.replace(
        s.ops[first(s, Native)], ranks=tuple(float(r) for r in s.ops[first(s, Native)].ranks))),
     "ranks"),
    ("recursive_doubling", lambda s: dataclasses.replace(s, count=float(s.count)), "count"),
    ("recursive_doubling", lambda s: dataclasses.replace(s, ranks=None), "ranks"),
    ("recursive_doubling", lambda s: dataclasses.replace(s, scratch=None), "scratch"),
    ("recursive_doubling", _on_every_send_and_recv("msg", lambda m: None), "msg"),
    ("recursive_doubling", lambda s: replace_op(s, first(s, Scale), Scale(
        s.ops[first(s, Scale)].dst, None)), "divisor"),  # type: ignore[arg-type]
])
def test_mistyped_fields_are_rejected_with_schedule_error(
        algorithm: str, change: Callable[[Schedule], Schedule], match: str) -> None:
    """Fields compare with ``==`` and ``1.0 == True == 1``: a schedule read from
    hand-edited JSON with ``"peer": 1.0`` verified, then failed in the
    transport; a None raised a bare TypeError instead of ScheduleError."""
    g = compiled("allreduce", 2, 6, algorithm, "avg")
    with pytest.raises(ScheduleError, match=match):
        verify(tuple(change(s) for s in g))


def test_a_reduce_the_kernels_cannot_run_is_rejected_even_when_dead() -> None:
    """A Reduce's op is one of sum/max/min/prod ("avg" is lowered to sum +
    Scale; the host kernels know nothing else): a dead ``Reduce(op="avg")``
    verified, and the run then failed inside the collective."""
    g = compiled("allreduce", 2, 6, "recursive_doubling", "sum")

    def add_dead_avg(s: Schedule) -> Schedule:
        tmp = Slot("tmp0", 0, 6)  # written by the receive, read by the reduce
        last = len(s.ops) - 1
        return dataclasses.replace(s, ops=s.ops + (Reduce(tmp, Slot(DATA, 0, 6), "avg"),),
                                   deps=s.deps + ((last,),))

    with pytest.raises(ScheduleError, match="reduction 'avg'"):
        verify(edit(g, 0, add_dead_avg))
