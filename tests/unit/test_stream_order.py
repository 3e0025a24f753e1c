"""The stream-ordered (NCCL) lowering of every compiled schedule: waves cannot
deadlock and NCCL's order matching pairs the messages the tags would."""

import pytest

from wagma_comm.errors import ScheduleError
from wagma_comm.schedule import algorithms
from wagma_comm.schedule.ir import Recv, Schedule, Send, Slot
from wagma_comm.schedule.waves import check_stream_order, plan_waves

SIZES = list(range(1, 10)) + [12, 16]


@pytest.mark.parametrize("algorithm", algorithms.ALLREDUCE_ALGORITHMS)
@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("count", [1, 7, 1000])
def test_allreduce_waves_are_deadlock_free(algorithm, p, count):
    ranks = tuple(range(p))
    scheds = {r: algorithms.compile_allreduce(r, ranks, count, "avg", algorithm) for r in ranks}
    check_stream_order(scheds)


@pytest.mark.parametrize("algorithm", algorithms.BROADCAST_ALGORITHMS)
@pytest.mark.parametrize("p", SIZES)
def test_broadcast_waves_are_deadlock_free(algorithm, p):
    ranks = tuple(range(p))
    for root in {0, p - 1, p // 2}:
        scheds = {r: algorithms.compile_broadcast(r, ranks, 999, root, algorithm)
                  for r in ranks}
        check_stream_order(scheds)


def test_group_subsets_use_global_ranks():
    ranks = (1, 4, 6)
    scheds = {r: algorithms.compile_allreduce(r, ranks, 10, "sum", "recursive_doubling")
              for r in ranks}
    check_stream_order(scheds)


def _hand(rank, ops, deps):
    return Schedule("allreduce", "hand", rank, (0, 1), 4, "sum", -1, tuple(ops), tuple(deps))


def test_checker_catches_a_deadlock():
    # Recursive doubling's receives placed by their own inputs only (wave 0):
    # the second round's receive blocks the stream until the peer's second
    # send, which waits behind the peer's own early receive.
    ranks = (0, 1, 2, 3)
    scheds = {r: algorithms.compile_allreduce(r, ranks, 4, "sum", "recursive_doubling")
              for r in ranks}
    naive = {}
    for r, s in scheds.items():
        depth = []
        for deps in s.deps:
            depth.append(1 + max((depth[d] for d in deps), default=-1))
        naive[r] = tuple(tuple(i for i in range(len(s.ops)) if depth[i] == k)
                         for k in range(max(depth) + 1))
    with pytest.raises(ScheduleError, match="deadlocks"):
        check_stream_order(scheds, naive)
    check_stream_order(scheds)  # the planned waves do not


def test_planner_refuses_a_cycle():
    # Each rank receives before it sends (the send waits on the receive).
    d = Slot("data", 0, 4)
    s0 = _hand(0, [Recv(d, 1, 0), Send(d, 1, 0)], [(), (0,)])
    s1 = _hand(1, [Recv(d, 0, 0), Send(d, 0, 0)], [(), (0,)])
    with pytest.raises(ScheduleError, match="cycle"):
        plan_waves({0: s0, 1: s1})


def test_checker_catches_an_order_mismatch():
    # Rank 0 sends message 1 before message 0; order matching would swap them.
    a, b = Slot("data", 0, 2), Slot("data", 2, 2)
    s0 = _hand(0, [Send(a, 1, 1), Send(b, 1, 0)], [(), (0,)])
    s1 = _hand(1, [Recv(b, 0, 0), Recv(a, 0, 1)], [(), (0,)])
    order = {0: ((0,), (1,)), 1: ((0,), (1,))}
    with pytest.raises(ScheduleError, match="message number"):
        check_stream_order({0: s0, 1: s1}, order)


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_waves_respect_dependencies(p):
    ranks = tuple(range(p))
    scheds = {r: algorithms.compile_allreduce(r, ranks, 100, "avg", "rabenseifner")
              for r in ranks}
    for r, order in plan_waves(scheds).items():
        sched = scheds[r]
        flat = [i for w in order for i in w]
        assert sorted(flat) == list(range(len(sched.ops)))
        pos = {i: k for k, w in enumerate(order) for i in w}
        for i, deps in enumerate(sched.deps):
            assert all(pos[d] < pos[i] for d in deps)
