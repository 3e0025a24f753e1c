"""The straight-line order of every compiled schedule (schedule/straight.py):
it keeps every dependency, cannot deadlock with its peers' orders, and the
checker catches an order that would."""

import pytest

from wagma_comm.errors import ScheduleError
from wagma_comm.schedule import algorithms
from wagma_comm.schedule.build import ScheduleBuilder
from wagma_comm.schedule.ir import DATA, Recv, Send, Slot
from wagma_comm.schedule.straight import (
    LOCAL,
    POST,
    WAIT,
    check_straight,
    straight_order,
    straight_safe,
)

SIZES = list(range(1, 18)) + [32]


def _group(collective, p, count=7, op="avg", root=0, algorithm=None, ranks=None):
    ranks = ranks or tuple(range(p))
    return dict(zip(ranks, algorithms.compile_group(collective, ranks, count, op, root,
                                                     algorithm)))


def _check_order_keeps_dependencies(schedule):
    """Every op runs once, after its dependencies: a local op or a post only
    once every message it depends on was waited for, every message posted
    before it is waited for, and everything posted is waited for by the end."""
    order = straight_order(schedule)
    posted, finished, ran = set(), set(), []
    for kind, what in order.steps:
        if kind == WAIT:
            assert set(what) <= posted and not set(what) & finished
            finished.update(what)
            continue
        deps = schedule.deps[what]
        assert all(d in finished for d in deps), (what, deps)
        ran.append(what)
        if kind == POST:
            posted.add(what)
        else:
            finished.add(what)
    assert sorted(ran) == list(range(len(schedule.ops)))
    assert finished == set(range(len(schedule.ops)))


@pytest.mark.parametrize("algorithm", algorithms.ALLREDUCE_ALGORITHMS)
@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("count", [1, 7, 1000])
def test_allreduce_orders_are_safe(algorithm, p, count):
    scheds = _group("allreduce", p, count, algorithm=algorithm)
    check_straight(scheds)
    for s in scheds.values():
        _check_order_keeps_dependencies(s)
        assert straight_safe(s)


@pytest.mark.parametrize("algorithm", algorithms.BROADCAST_ALGORITHMS)
@pytest.mark.parametrize("p", SIZES)
def test_broadcast_orders_are_safe(algorithm, p):
    for root in {0, p - 1, p // 2}:
        scheds = _group("broadcast", p, 999, op="", root=root, algorithm=algorithm)
        check_straight(scheds)
        for s in scheds.values():
            _check_order_keeps_dependencies(s)
            assert straight_safe(s)


@pytest.mark.parametrize("p", SIZES)
def test_barrier_orders_are_safe(p):
    scheds = _group("barrier", p, 0, op="", root=-1)
    check_straight(scheds)
    assert all(straight_safe(s) for s in scheds.values())


def test_group_subsets_use_global_ranks():
    scheds = _group("allreduce", 0, 10, op="sum", algorithm="recursive_doubling",
                    ranks=(1, 4, 6))
    check_straight(scheds)
    assert straight_safe(scheds[4])


def test_recursive_doubling_is_a_loop_of_exchanges():
    """Rank 0 of 8: per round, receive then send, wait for both, reduce."""
    s = algorithms.compile_allreduce(0, tuple(range(8)), 4, "sum", "recursive_doubling")
    order = straight_order(s)
    kinds = [(kind, type(s.ops[what]).__name__ if kind != WAIT else len(what))
             for kind, what in order.steps]
    assert kinds == [(POST, "Recv"), (POST, "Send"), (WAIT, 2), (LOCAL, "Reduce")] * 3
    # what a run stopped at the second wait hands over
    assert order.done[1] == frozenset({0, 1, 2})
    assert sorted(order.outstanding[1]) == [3, 4]


def _crossed(rank):
    """Each rank receives (and reduces) before the send its peer waits for;
    the send depends on nothing, so the dataflow order cannot deadlock, but
    the straight-line order waits for the receive before posting the send."""
    peer = 1 - rank
    b = ScheduleBuilder("allreduce", "hand", rank, (0, 1), 2, "sum")
    tmp = b.scratch("t", 1)
    b.recv(Slot(tmp, 0, 1), peer)
    b.reduce(Slot(DATA, 1, 1), Slot(tmp, 0, 1), "sum")
    b.send(Slot(DATA, 0, 1), peer)
    return b.build()


def test_checker_catches_a_deadlock():
    scheds = {0: _crossed(0), 1: _crossed(1)}
    assert [type(op) for op in scheds[0].ops].count(Send) == 1
    assert any(type(op) is Recv for op in scheds[0].ops)
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 waits for ops"):
        check_straight(scheds)


def test_a_schedule_the_compiler_does_not_make_is_not_trusted():
    assert not straight_safe(_crossed(0))
    s = algorithms.compile_exchange(0, (0, 1), 3)
    assert not straight_safe(s)
