"""The simulator (wagma_comm.sim): timed schedules, closed forms, activation
tokens and simulated training iterations.

Every number asserted here is derived independently of the simulator: by hand
from the cost model's rules, from an op-by-op reference evaluator written in
this file (a fixed-point pass over the compiler's own schedules, no DAG
levelling), from a replay of ``activation.forward``'s routing, or from a
zero-cost recurrence of the training loop.
"""

from __future__ import annotations

import heapq
import json
import math
from collections import deque
from dataclasses import asdict, replace

import numpy as np
import pytest

from wagma_comm import groups
from wagma_comm.errors import InvalidArgumentError
from wagma_comm.imbalance import make_injector
from wagma_comm.runtime import activation
from wagma_comm.schedule import algorithms as alg
from wagma_comm.schedule.build import ScheduleBuilder
from wagma_comm.schedule.ir import DATA, Copy, Native, Recv, Reduce, Scale, Send, Slot
from wagma_comm.sim import (
    GPU_CLUSTER,
    METHODS,
    PRESETS,
    Collectives,
    CostModel,
    TimedDag,
    Workload,
    native_cost,
    simulate,
    token_arrivals,
)
from wagma_comm.sim.collectives import AllToAllTiming
from wagma_comm.sim.cost import TOKEN_BYTES
from wagma_comm.sim.training import BLOCKING, PARTIAL
from wagma_comm.train.methods.gossip import ring_neighbours

ZERO = PRESETS["zero"]
TIGHT = 1e-12


def model(lat_intra: float = 2e-6, lat_inter: float = 7e-6, bw_intra: float = 4e9,
          bw_inter: float = 5e8, reduce: float = 3e-10, copy: float = 1e-10, o: float = 0.0,
          call: float = 0.0, rpn: int = 1) -> CostModel:
    """A cost model whose numbers are all distinct, so a wrong choice shows."""
    return CostModel(lat_intra, lat_inter, bw_intra, bw_inter, reduce, copy, o, call, rpn)


def allreduce(ranks: tuple[int, ...], count: int, algorithm: str, op: str = "sum"):
    return [alg.compile_allreduce(r, ranks, count, op, algorithm) for r in ranks]


def popcount(x: int) -> int:
    return bin(x).count("1")


# ----------------------------------------------------------- reference evaluator


def reference_ends(schedules, cost: CostModel, itemsize: int, starts) -> np.ndarray:
    """Member end times by the cost model's rules, op by op, in passes until
    every op is timed (independent of TimedDag's levelling)."""
    o = cost.op_overhead_s
    end = [[None] * len(s.ops) for s in schedules]
    send_end: dict[tuple[int, int, int], float] = {}
    hub_ready: dict[tuple, dict[int, float]] = {}
    left = sum(len(s.ops) for s in schedules)
    while left:
        progress = False
        for p, s in enumerate(schedules):
            native_seen: dict[tuple, int] = {}
            prev_send = None
            for i, op in enumerate(s.ops):
                if isinstance(op, Native):
                    k0 = (op.kind, op.ranks, op.root, op.op)
                    native_seen[k0] = native_seen.get(k0, 0) + 1
                    hub = k0 + (native_seen[k0],)
                before = prev_send
                if isinstance(op, Send):
                    prev_send = i
                if end[p][i] is not None:
                    continue
                deps = [end[p][d] for d in s.deps[i]]
                if any(d is None for d in deps):
                    continue
                ready = max(deps) if deps else float(starts[p])
                if isinstance(op, Send):
                    if before is not None:
                        if end[p][before] is None:
                            continue
                        ready = max(ready, end[p][before])
                    t = ready + o + op.src.count * itemsize / cost.bandwidth(s.rank, op.peer)
                    send_end[(s.rank, op.peer, op.msg)] = t
                elif isinstance(op, Recv):
                    key = (op.peer, s.rank, op.msg)
                    if key not in send_end:
                        continue
                    t = max(ready, send_end[key] + cost.latency(op.peer, s.rank)) + o
                elif isinstance(op, (Reduce, Scale)):
                    t = ready + o + op.dst.count * itemsize * cost.reduce_s_per_byte
                elif isinstance(op, Copy):
                    t = ready + o + op.dst.count * itemsize * cost.copy_s_per_byte
                else:
                    assert isinstance(op, Native)
                    hub_ready.setdefault(hub, {})[s.rank] = ready
                    if len(hub_ready[hub]) < len(op.ranks):
                        continue
                    t = max(hub_ready[hub].values()) + native_cost(
                        op.kind, op.buf.count * itemsize, op.ranks, cost)
                end[p][i] = t
                left -= 1
                progress = True
        assert progress, "reference evaluator: schedules deadlock"
    return np.array([max([float(starts[p])] + end[p]) for p in range(len(schedules))])


# ------------------------------------------------------------------ the cases

GROUPS = [(0,), (0, 1), (0, 1, 2), (0, 1, 2, 3, 4), tuple(range(8)), (3, 11, 19, 27),
          (5, 2, 9, 7, 1, 6)]
COUNTS = [0, 3, 1000]


def ring_of(ranks: tuple[int, ...], r: int) -> tuple[int, ...]:
    """Ring neighbours by group position (as D-PSGD's ring, on any group)."""
    i, n = ranks.index(r), len(ranks)
    return tuple(sorted({ranks[(i - 1) % n], ranks[(i + 1) % n]} - {r}))


def cases(ranks: tuple[int, ...], count: int):
    """(name, kind, root, schedules) of every collective the compiler offers."""
    out = []
    for name in alg.ALLREDUCE_ALGORITHMS:
        for op in ("sum", "avg"):
            out.append((f"allreduce-{name}-{op}", "allreduce", None,
                        allreduce(ranks, count, name, op)))
    for name in alg.BROADCAST_ALGORITHMS:
        for root in sorted({ranks[0], ranks[-1]}):
            out.append((f"broadcast-{name}-{root}", "broadcast", root,
                        [alg.compile_broadcast(r, ranks, count, root, name) for r in ranks]))
    out.append(("barrier", "barrier", None, [alg.compile_barrier(r, ranks) for r in ranks]))
    out.append(("exchange", "exchange", None,
                [alg.compile_exchange(r, ranks, count) for r in ranks]))
    out.append(("neighbor_average", "neighbors", None,
                [alg.compile_neighbor_average(r, ranks, count, ring_of(ranks, r))
                 for r in ranks]))
    return out


def all_cases():
    for ranks in GROUPS:
        for count in COUNTS:
            for name, kind, root, scheds in cases(ranks, count):
                yield ranks, count, name, kind, root, scheds


def test_cases_cover_every_algorithm() -> None:
    names = {name for _, _, name, _, _, _ in all_cases()}
    for a in alg.ALLREDUCE_ALGORITHMS:
        assert f"allreduce-{a}-sum" in names and f"allreduce-{a}-avg" in names
    for a in alg.BROADCAST_ALGORITHMS:
        assert any(n.startswith(f"broadcast-{a}-") for n in names)
    assert {"barrier", "exchange", "neighbor_average"} <= names
    assert alg.BARRIER_ALGORITHMS == ("dissemination",)


# ====================================================== 1. by hand: small cases


N_EL = 1000  # elements of 4 bytes
NB = 4 * N_EL


def test_two_rank_recursive_doubling_by_hand() -> None:
    c = model(o=0.0, call=0.0, rpn=1)
    dag = TimedDag(allreduce((0, 1), N_EL, "recursive_doubling"), c, 4)
    expected = c.latency_inter_s + NB / c.bandwidth_inter + NB * c.reduce_s_per_byte
    assert dag.evaluate(np.zeros(2)) == pytest.approx([expected, expected], rel=TIGHT)
    assert dag.cost_of() == pytest.approx(expected, rel=TIGHT)
    # the same with an element size of 8 bytes: twice the bytes
    dag8 = TimedDag(allreduce((0, 1), N_EL, "recursive_doubling"), c, 8)
    expected8 = c.latency_inter_s + 2 * NB / c.bandwidth_inter + 2 * NB * c.reduce_s_per_byte
    assert dag8.cost_of() == pytest.approx(expected8, rel=TIGHT)


@pytest.mark.parametrize("o", [1e-6, 3.5e-6])
def test_two_rank_recursive_doubling_op_overheads(o: float) -> None:
    """Send (o), Recv (o) and Reduce (o) lie on the path: 3 overheads."""
    c = model(o=o, rpn=1)
    dag = TimedDag(allreduce((0, 1), N_EL, "recursive_doubling"), c, 4)
    L, B, g = c.latency_inter_s, c.bandwidth_inter, c.reduce_s_per_byte
    assert dag.cost_of() == pytest.approx(L + NB / B + NB * g + 3 * o, rel=TIGHT)
    # avg adds one Scale of the whole buffer
    avg = TimedDag(allreduce((0, 1), N_EL, "recursive_doubling", "avg"), c, 4)
    assert avg.cost_of() == pytest.approx(L + NB / B + 2 * NB * g + 4 * o, rel=TIGHT)


@pytest.mark.parametrize("o", [0.0, 2e-6])
def test_two_rank_rabenseifner_by_hand(o: float) -> None:
    """Half out, half in and reduced, then the reduced half out and the other
    half in: 2 latencies, the whole buffer over the wire, half of it reduced,
    and five ops (send, recv, reduce, send, recv) on the path."""
    c = model(o=o, rpn=1)
    dag = TimedDag(allreduce((0, 1), N_EL, "rabenseifner"), c, 4)
    L, B, g = c.latency_inter_s, c.bandwidth_inter, c.reduce_s_per_byte
    expected = 2 * L + NB / B + NB / 2 * g + 5 * o
    assert dag.evaluate(np.zeros(2)) == pytest.approx([expected] * 2, rel=TIGHT)
    assert dag.traffic.messages.tolist() == [2, 2]
    assert dag.traffic.bytes.tolist() == [NB, NB]


@pytest.mark.parametrize("rpn", [1, 2, 4])
def test_four_rank_recursive_doubling_two_rounds(rpn: int) -> None:
    """Round 1 pairs 0-1 and 2-3 (same node when rpn >= 2), round 2 pairs
    0-2 and 1-3 (same node only when rpn >= 4)."""
    c = model(o=0.0, rpn=rpn)
    dag = TimedDag(allreduce((0, 1, 2, 3), N_EL, "recursive_doubling"), c, 4)
    g = c.reduce_s_per_byte

    def rnd(intra: bool) -> float:
        L = c.latency_intra_s if intra else c.latency_inter_s
        B = c.bandwidth_intra if intra else c.bandwidth_inter
        return L + NB / B + NB * g

    expected = rnd(rpn >= 2) + rnd(rpn >= 4)
    assert dag.evaluate(np.zeros(4)) == pytest.approx([expected] * 4, rel=TIGHT)
    assert dag.traffic.messages.tolist() == [2] * 4


def test_intra_and_inter_node_links() -> None:
    """Nodes are runs of ranks_per_node consecutive ranks, whatever the group."""
    one = allreduce((0, 1), N_EL, "recursive_doubling")
    g = 3e-10

    def rd(c: CostModel, intra: bool) -> float:
        L = c.latency_intra_s if intra else c.latency_inter_s
        B = c.bandwidth_intra if intra else c.bandwidth_inter
        return L + NB / B + NB * g

    c1, c2 = model(rpn=1), model(rpn=2)
    assert TimedDag(one, c1, 4).cost_of() == pytest.approx(rd(c1, False), rel=TIGHT)
    assert TimedDag(one, c2, 4).cost_of() == pytest.approx(rd(c2, True), rel=TIGHT)
    assert rd(c2, True) < rd(c1, False)
    c4 = model(rpn=4)
    across = allreduce((3, 4), N_EL, "recursive_doubling")  # nodes 0 and 1
    inside = allreduce((4, 7), N_EL, "recursive_doubling")  # both node 1
    assert TimedDag(across, c4, 4).cost_of() == pytest.approx(rd(c4, False), rel=TIGHT)
    assert TimedDag(inside, c4, 4).cost_of() == pytest.approx(rd(c4, True), rel=TIGHT)
    # the accessors, also vectorised
    assert c4.latency(3, 4) == c4.latency_inter_s and c4.latency(4, 7) == c4.latency_intra_s
    assert c4.bandwidth(3, 4) == c4.bandwidth_inter and c4.bandwidth(0, 3) == c4.bandwidth_intra
    assert c4.same_node(np.array([0, 3, 4, 8]), 2).tolist() == [True, True, False, False]


def test_port_serialisation_of_back_to_back_sends() -> None:
    """3-rank exchange: every rank sends two messages in a row, in position
    order. Rank 0 gets the first message of both others, rank 1 the first of
    0 and the second of 2, rank 2 the second of both."""
    o = 1.5e-6
    c = model(o=o, rpn=1)
    L, B = c.latency_inter_s, c.bandwidth_inter
    dag = TimedDag([alg.compile_exchange(r, (0, 1, 2), N_EL) for r in (0, 1, 2)], c, 4)
    port = o + NB / B
    assert 2 * port > port + L + o  # so rank 0 ends with its own second send
    late = 2 * port + L + o  # not port + L + o: the port is busy with the first
    expected = [2 * port, late, late]
    assert dag.evaluate(np.zeros(3)) == pytest.approx(expected, rel=TIGHT)
    # the same with ranks 1 and 2 starting late: they bind through their sends
    d = 1e-4
    ends = dag.evaluate(np.array([0.0, d, d]))
    assert ends == pytest.approx([d + port + L + o, d + late, d + late], rel=TIGHT)


def test_port_serialisation_in_binomial_broadcast() -> None:
    """Root 0 of 4 sends to 2 then to 1; 2 forwards to 3 (and ends when its
    own send has left the port)."""
    o = 1e-6
    c = model(o=o, rpn=1)
    L, B = c.latency_inter_s, c.bandwidth_inter
    port = o + NB / B
    dag = TimedDag([alg.compile_broadcast(r, (0, 1, 2, 3), N_EL, 0, "binomial")
                    for r in range(4)], c, 4)
    at2 = port + L + o
    expected = [2 * port, 2 * port + L + o, at2 + port, at2 + port + L + o]
    assert dag.evaluate(np.zeros(4)) == pytest.approx(expected, rel=TIGHT)
    assert dag.traffic.messages.tolist() == [2, 0, 1, 0]


def test_native_hub_waits_for_the_last_member() -> None:
    c = model(o=1e-6, rpn=1)
    L, B, g, o = c.latency_inter_s, c.bandwidth_inter, c.reduce_s_per_byte, c.op_overhead_s
    two = TimedDag(allreduce((0, 1), N_EL, "native"), c, 4)
    ring2 = 2 * (L + o) + NB / B + NB / 2 * g  # 2(n-1) steps, 2(n-1)/n, (n-1)/n
    assert native_cost("allreduce", NB, (0, 1), c) == pytest.approx(ring2, rel=TIGHT)
    d = 3e-4
    assert two.evaluate(np.array([0.0, d])) == pytest.approx([d + ring2] * 2, rel=TIGHT)
    assert two.evaluate(np.array([d, 0.0])) == pytest.approx([d + ring2] * 2, rel=TIGHT)
    # four ranks, starts all different; avg adds a Scale after the hub
    ring4 = 6 * (L + o) + 1.5 * NB / B + 0.75 * NB * g
    four = TimedDag(allreduce((0, 1, 2, 3), N_EL, "native", "avg"), c, 4)
    starts = np.array([2e-5, 7e-5, 1e-5, 4e-5])
    expected = 7e-5 + ring4 + o + NB * g
    assert four.evaluate(starts) == pytest.approx([expected] * 4, rel=TIGHT)
    assert four.traffic.messages.tolist() == [6] * 4
    assert four.traffic.bytes == pytest.approx([1.5 * NB] * 4, rel=TIGHT)
    # a node-local group uses the intra-node numbers
    c4 = model(o=1e-6, rpn=4)
    local = 6 * (c4.latency_intra_s + o) + 1.5 * NB / c4.bandwidth_intra + 0.75 * NB * g
    assert native_cost("allreduce", NB, (4, 5, 6, 7), c4) == pytest.approx(local, rel=TIGHT)
    assert native_cost("allreduce", NB, (2, 3, 4, 5), c4) == pytest.approx(ring4, rel=TIGHT)
    # broadcast: ceil(log2 n) steps plus one buffer; one rank costs nothing
    bc = TimedDag([alg.compile_broadcast(r, tuple(range(5)), N_EL, 2, "native")
                   for r in range(5)], c, 4)
    assert bc.cost_of() == pytest.approx(3 * (L + o) + NB / B, rel=TIGHT)
    assert bc.traffic.messages.tolist() == [1] * 5
    for n, steps in ((2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4)):
        assert native_cost("broadcast", NB, tuple(range(n)), c) == pytest.approx(
            steps * (L + o) + NB / B, rel=TIGHT)
    assert native_cost("allreduce", NB, (9,), c) == 0.0
    assert native_cost("broadcast", NB, (), c) == 0.0


def test_native_after_local_ops_and_native_twice() -> None:
    """Hand-built schedules (the compiler's never copy, and put a Native
    first): Copy, Native, Scale, Native on 3 ranks. Each hub waits for the
    slowest member's preceding op; the second Native is a second hub."""
    c = model(o=1e-6, rpn=2)
    o, g, k = c.op_overhead_s, c.reduce_s_per_byte, c.copy_s_per_byte
    ranks = (0, 1, 2)
    scheds = []
    for r in ranks:
        b = ScheduleBuilder("allreduce", "custom", r, ranks, N_EL, "sum")
        data = Slot(DATA, 0, N_EL)
        b.copy(Slot(b.scratch("keep", N_EL), 0, N_EL), data)
        b.native("allreduce", data, "sum", ranks)
        b.scale(data, 3)
        b.native("allreduce", data, "sum", ranks)
        scheds.append(b.build())
    assert [type(op) for op in scheds[0].ops] == [Copy, Native, Scale, Native]
    assert scheds[0].deps[1] == (0,)  # the Native overwrites what the Copy reads
    dag = TimedDag(scheds, c, 4)
    nc = native_cost("allreduce", NB, ranks, c)
    starts = np.array([3e-5, 1e-5, 0.0])
    hub1 = 3e-5 + o + NB * k + nc
    hub2 = hub1 + o + NB * g + nc
    assert dag.evaluate(starts) == pytest.approx([hub2] * 3, rel=TIGHT)
    np.testing.assert_allclose(dag.evaluate(starts), reference_ends(scheds, c, 4, starts),
                               rtol=TIGHT)
    assert dag.traffic.messages.tolist() == [8] * 3  # 2 x 2(n-1)


def test_later_start_is_binding() -> None:
    """2-rank RD, rank 1 starts d late (d > n/B + L): rank 0's data is already
    waiting at rank 1, so rank 1 ends d + n/B + n*gamma and rank 0 a latency later."""
    c = model(o=0.0, rpn=1)
    L, B, g = c.latency_inter_s, c.bandwidth_inter, c.reduce_s_per_byte
    dag = TimedDag(allreduce((0, 1), N_EL, "recursive_doubling"), c, 4)
    d = 1e-3
    assert d > NB / B + L
    ends = dag.evaluate(np.array([0.0, d]))
    assert ends == pytest.approx([d + NB / B + L + NB * g, d + NB / B + NB * g], rel=TIGHT)
    assert dag.cost_of(np.array([0.0, d])) == pytest.approx(d + NB / B + L + NB * g, rel=TIGHT)
    # shifting both starts shifts everything
    assert dag.evaluate(np.array([5.0, 5.0 + d])) == pytest.approx(ends + 5.0, rel=TIGHT)


def test_two_dimensional_starts_evaluate_scenarios_at_once() -> None:
    c = model(o=1e-6, rpn=2)
    dag = TimedDag(allreduce(tuple(range(6)), 77, "rabenseifner"), c, 4)
    rng = np.random.default_rng(11)
    starts = rng.uniform(0, 1e-4, (6, 5))
    together = dag.evaluate(starts)
    assert together.shape == (6, 5)
    for k in range(5):
        np.testing.assert_allclose(together[:, k], dag.evaluate(starts[:, k]), rtol=TIGHT)


# ============================================ 2. every algorithm, any group


@pytest.mark.parametrize("ranks", GROUPS, ids=str)
def test_every_schedule_matches_the_reference_evaluator(ranks) -> None:
    rng = np.random.default_rng(sum(ranks) * 7 + len(ranks))
    for count in COUNTS:
        for name, _, _, scheds in cases(ranks, count):
            c = CostModel(*rng.uniform(0, 1e-5, 2), *rng.uniform(1e7, 1e10, 2),
                          *rng.uniform(0, 1e-9, 2), float(rng.uniform(0, 2e-6)), 0.0,
                          int(rng.integers(1, 5)))
            itemsize = int(rng.choice([1, 2, 4, 8]))
            dag = TimedDag(scheds, c, itemsize)
            assert dag.members.tolist() == list(ranks)
            assert dag.ops == sum(len(s.ops) for s in scheds)
            for _ in range(2):
                starts = rng.uniform(0, 1e-4, len(ranks))
                ends = dag.evaluate(starts)
                ref = reference_ends(scheds, c, itemsize, starts)
                np.testing.assert_allclose(ends, ref, rtol=1e-12, atol=0,
                                           err_msg=f"{name} {ranks} count={count}")
                assert np.all(ends >= starts)


@pytest.mark.parametrize("ranks", GROUPS, ids=str)
def test_ends_are_monotone_and_one_lipschitz_in_starts(ranks) -> None:
    """Max-plus: raising one start by delta never lowers an end and raises
    none by more than delta; raising all by delta raises all by delta."""
    rng = np.random.default_rng(len(ranks) + 100)
    c = model(o=1e-6, rpn=2)
    n = len(ranks)
    for count in (3, 1000):
        for name, _, _, scheds in cases(ranks, count):
            dag = TimedDag(scheds, c, 4)
            base = rng.uniform(0, 1e-4, n)
            e0 = dag.evaluate(base)
            delta = 5e-5
            bumped = np.repeat(base[:, None], n, axis=1) + delta * np.eye(n)
            e1 = dag.evaluate(bumped)  # column q: start q raised
            assert np.all(e1 >= e0[:, None] - 1e-18), name
            assert np.all(e1 <= e0[:, None] + delta * (1 + 1e-9)), name
            # each member's own start binds its own end from below
            assert np.all(np.diag(e1) >= base + delta)
            np.testing.assert_allclose(dag.evaluate(base + 1.0), e0 + 1.0, rtol=1e-12)


def expected_dependencies(kind: str, ranks, count: int, root, p: int, scheds) -> set | None:
    """Whose start member ``p``'s end depends on, from the collective's meaning
    (None: only "itself and the root" is known)."""
    n, me = len(ranks), ranks[p]
    everyone = set(ranks)
    if n == 1:
        return {me}
    if kind == "allreduce":
        return everyone if count else {me}
    if kind in ("barrier", "exchange"):
        return everyone
    if kind == "neighbors":
        return ({me} | set(ring_of(ranks, me))) if count else {me}
    assert kind == "broadcast"
    if not count:
        return {me}
    if scheds[p].algorithm == "native":
        return everyone
    if scheds[p].algorithm == "binomial":
        # the path from the root: relative position v came from v - lowbit(v)
        r0 = ranks.index(root)
        v = (p - r0) % n
        path = {me}
        while v:
            v -= v & -v
            path.add(ranks[(r0 + v) % n])
        return path
    return None


@pytest.mark.parametrize("ranks", GROUPS, ids=str)
def test_zero_cost_end_is_max_start_of_dependencies(ranks) -> None:
    n = len(ranks)
    rng = np.random.default_rng(n + 7)
    for count in COUNTS:
        for name, kind, root, scheds in cases(ranks, count):
            dag = TimedDag(scheds, ZERO, 4)
            reach = dag.evaluate(np.eye(n)) > 0.5  # reach[p, q]: q's start reaches p
            for p in range(n):
                deps = {ranks[q] for q in range(n) if reach[p, q]}
                want = expected_dependencies(kind, ranks, count, root, p, scheds)
                if want is None:
                    assert {ranks[p], root} <= deps, name
                else:
                    assert deps == want, (name, count, ranks[p])
            starts = rng.uniform(0, 1, n)
            ends = dag.evaluate(starts)
            expected = [max(starts[q] for q in range(n) if reach[p, q]) for p in range(n)]
            assert ends.tolist() == expected, name
            if kind == "allreduce":
                want_all = starts.max() if count and n > 1 else starts
                np.testing.assert_array_equal(ends, np.broadcast_to(want_all, n))


@pytest.mark.parametrize("ranks", GROUPS, ids=str)
def test_traffic_counts_what_the_schedules_send(ranks) -> None:
    n = len(ranks)
    for count in COUNTS:
        for name, _, _, scheds in cases(ranks, count):
            dag = TimedDag(scheds, ZERO, 8)
            msgs, sent = [], []
            for s in scheds:
                natives = [op for op in s.ops if isinstance(op, Native)]
                if natives:
                    (nat,) = natives
                    nb = nat.buf.count * 8
                    if nat.kind == "broadcast":
                        msgs.append(1)
                        sent.append(nb)
                    else:
                        msgs.append(2 * (n - 1))
                        sent.append(2 * (n - 1) / n * nb)
                    continue
                sends = [op for op in s.ops if isinstance(op, Send)]
                msgs.append(len(sends))
                sent.append(sum(op.src.count * 8 for op in sends))
            assert dag.traffic.messages.tolist() == msgs, name
            np.testing.assert_allclose(dag.traffic.bytes, sent, rtol=TIGHT, err_msg=name)


def test_traffic_known_values() -> None:
    eight = tuple(range(8))
    rd = TimedDag(allreduce(eight, 1024, "recursive_doubling"), ZERO, 4)
    assert rd.traffic.messages.tolist() == [3] * 8  # log2 8 rounds
    assert rd.traffic.bytes.tolist() == [3 * 4096.0] * 8
    rab = TimedDag(allreduce(eight, 1024, "rabenseifner"), ZERO, 4)
    assert rab.traffic.messages.tolist() == [6] * 8
    assert rab.traffic.bytes.tolist() == [2 * 7 / 8 * 4096] * 8  # 2(n-1)/n of the buffer
    ring = TimedDag(allreduce((0, 1, 2, 3, 4), 1000, "ring"), ZERO, 4)
    assert ring.traffic.messages.tolist() == [8] * 5  # 2(n-1)
    assert ring.traffic.bytes.tolist() == [8 * 800.0] * 5
    ex = TimedDag([alg.compile_exchange(r, eight, 2) for r in eight], ZERO, 4)
    assert ex.traffic.messages.tolist() == [7] * 8
    bar = TimedDag([alg.compile_barrier(r, (0, 1, 2, 3, 4)) for r in range(5)], ZERO, 4)
    assert bar.traffic.messages.tolist() == [3] * 5  # ceil(log2 5) rounds
    assert bar.traffic.bytes.tolist() == [0.0] * 5
    # non-power of two RD: the folded rank sends once, its partner twice more
    five = TimedDag(allreduce((0, 1, 2, 3, 4), 10, "recursive_doubling"), ZERO, 4)
    assert five.traffic.messages.tolist() == [3, 2, 2, 2, 1]


def test_timed_dag_rejects_bad_input() -> None:
    two = allreduce((0, 1), 4, "recursive_doubling")
    with pytest.raises(InvalidArgumentError) as e:
        TimedDag(two, ZERO, 0)
    assert e.value.argument == "itemsize"
    with pytest.raises(InvalidArgumentError) as e:
        TimedDag([two[0], two[0]], ZERO, 4)
    assert e.value.argument == "schedules"
    with pytest.raises(InvalidArgumentError, match="receives message 0 from rank 1") as e:
        TimedDag([two[0]], ZERO, 4)
    assert e.value.argument == "schedules"
    dag = TimedDag(two, ZERO, 4)
    with pytest.raises(InvalidArgumentError) as e:
        dag.evaluate(np.zeros(3))
    assert e.value.argument == "starts"
    # each rank receives before it sends what the other waits for: a cycle
    loop = []
    for r, peer in ((0, 1), (1, 0)):
        b = ScheduleBuilder("allreduce", "custom", r, (0, 1), 4, "sum")
        b.recv(Slot(DATA, 0, 4), peer)
        b.send(Slot(DATA, 0, 4), peer)
        loop.append(b.build())
    assert loop[0].deps == ((), (0,))
    with pytest.raises(InvalidArgumentError, match="deadlock") as e:
        TimedDag(loop, ZERO, 4)
    assert e.value.argument == "schedules"


@pytest.mark.parametrize("name", alg.ALLREDUCE_ALGORITHMS)
def test_disjoint_groups_in_one_dag_do_not_interact(name: str) -> None:
    c = model(o=1e-6, rpn=2)
    a, b = (0, 1, 2, 3), (4, 5, 6, 7)
    both = TimedDag(allreduce(a, 500, name) + allreduce(b, 500, name), c, 4)
    only_a = TimedDag(allreduce(a, 500, name), c, 4)
    only_b = TimedDag(allreduce(b, 500, name), c, 4)
    starts = np.linspace(0, 3e-5, 8)
    ends = both.evaluate(starts)
    np.testing.assert_allclose(ends[:4], only_a.evaluate(starts[:4]), rtol=TIGHT)
    np.testing.assert_allclose(ends[4:], only_b.evaluate(starts[4:]), rtol=TIGHT)
    assert ends[:4].max() < ends[4:].max()  # b starts later and waits for nobody in a


# ============================================ 3. the all-to-all in closed form


@pytest.mark.parametrize("rpn", [1, 2, 3])
@pytest.mark.parametrize("P", range(1, 10))
def test_all_to_all_closed_form_equals_timed_dag(P: int, rpn: int) -> None:
    c = model(o=1.3e-6, rpn=rpn)
    rng = np.random.default_rng(P * 10 + rpn)
    for members in (tuple(range(P)), tuple(int(x) for x in np.sort(
            rng.choice(40, P, replace=False)))):
        for count, itemsize in ((1, 8), (300, 4)):
            closed = AllToAllTiming(members, count, c, itemsize)
            dag = TimedDag([alg.compile_exchange(r, members, count) for r in members], c,
                           itemsize)
            assert closed.ops == dag.ops
            np.testing.assert_array_equal(closed.traffic.messages, dag.traffic.messages)
            np.testing.assert_allclose(closed.traffic.bytes, dag.traffic.bytes, rtol=TIGHT)
            for _ in range(3):
                starts = rng.uniform(0, 2e-5, P)
                np.testing.assert_allclose(closed.evaluate(starts), dag.evaluate(starts),
                                           rtol=1e-12, atol=0)


def test_all_to_all_blocks_of_senders() -> None:
    """Beyond ~1,400 ranks the closed form works in blocks of senders; the
    result must equal the per-receiver formula computed in one piece."""
    P = 1500
    c = model(o=1e-7, rpn=8)
    rng = np.random.default_rng(5)
    starts = rng.uniform(0, 1e-4, P)
    ends = AllToAllTiming(tuple(range(P)), 1, c, 8).evaluate(starts)
    r = np.arange(P)
    same = c.same_node(r[:, None], r[None, :])
    port = np.where(same, c.op_overhead_s + 8 / c.bandwidth_intra,
                    c.op_overhead_s + 8 / c.bandwidth_inter)
    np.fill_diagonal(port, 0.0)
    done = starts[:, None] + np.cumsum(port, axis=1)  # [sender, receiver]
    arrive = done + np.where(same, c.latency_intra_s, c.latency_inter_s)
    np.fill_diagonal(arrive, -np.inf)
    expected = np.maximum(np.maximum(arrive.max(axis=0), starts) + c.op_overhead_s, done[:, -1])
    np.testing.assert_allclose(ends, expected, rtol=1e-12, atol=0)


def test_collectives_arrival_check_is_the_exchange_of_two_int64() -> None:
    """As partial/base.py's _arrival_stage: the count and which final call."""
    lib = Collectives(6, GPU_CLUSTER.with_(ranks_per_node=4))
    chk = lib.arrival_check()
    assert chk is lib.arrival_check()  # cached
    dag = TimedDag([alg.compile_exchange(r, tuple(range(6)), 2) for r in range(6)],
                   lib.cost, 8)
    starts = np.array([0, 1, 2, 3, 4, 5]) * 1e-6
    np.testing.assert_allclose(chk.evaluate(starts), dag.evaluate(starts), rtol=TIGHT)
    assert chk.traffic.bytes.tolist() == [80.0] * 6


# ======================================================= 4. activation tokens


def tree_pairs(n: int, root: int) -> set[tuple[int, int]]:
    """The binomial tree of the docstring: offset g sends to g + 2**d for the
    dimensions d above its highest set bit (positions, not ranks)."""
    out = set()
    for d in range(activation.dimensions(n)):
        for g in range(min(1 << d, n)):
            if g + (1 << d) < n:
                out.add(((root + g) % n, (root + g + (1 << d)) % n))
    return out


def replay_forward(n: int, root: int):
    """Route one activation with activation.forward, processing every token
    (wrapped ones too) in FIFO order. Returns (every token as (sender,
    receiver), the token that first reached each member)."""
    thresholds = [activation.no_tokens_sent(n)] * n
    queue = deque([(root, -1)])
    reached = {root}
    tokens, first = [], set()
    while queue:
        me, came = queue.popleft()
        targets, thresholds[me] = activation.forward(me, n, came, thresholds[me])
        for k in targets:
            tokens.append((me, k))
            if k not in reached:
                reached.add(k)
                first.add((me, k))
            queue.append((k, activation.incoming_dimension(k, me, n)))
    assert reached == set(range(n))
    return tokens, first


def timed_forward(members: np.ndarray, root: int, t0: float, cost: CostModel) -> np.ndarray:
    """First arrival of each member when the tokens of activation.forward (all of
    them) travel under ``cost``: the k-th token a member sends on one
    activation leaves k port times after that activation, and lands latency +
    o later. Event order by time."""
    n = len(members)
    thresholds = [activation.no_tokens_sent(n)] * n
    first = np.full(n, np.inf)
    events = [(t0, 0, root, -1)]
    seq = 1
    while events:
        t, _, me, came = heapq.heappop(events)
        first[me] = min(first[me], t)
        targets, thresholds[me] = activation.forward(me, n, came, thresholds[me])
        for k_th, k in enumerate(targets, start=1):
            a, b = int(members[me]), int(members[k])
            port = cost.op_overhead_s + TOKEN_BYTES / cost.bandwidth(a, b)
            land = t + k_th * port + cost.latency(a, b) + cost.op_overhead_s
            heapq.heappush(events, (land, seq, k, activation.incoming_dimension(k, me, n)))
            seq += 1
    return first


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64])
def test_tokens_power_of_two_zero_cost(n: int) -> None:
    for root in sorted({0, n // 3, n - 1}):
        members = np.arange(n) * 2 + 5
        arrival, sent = token_arrivals(members, root, 0.25, ZERO)
        assert int(sent.sum()) == n - 1
        assert np.all(arrival == 0.25)  # everyone reached, at once
        # the root sends log2 n tokens; a member at offset g sends one per
        # dimension above its highest set bit
        for g in range(n):
            hi = g.bit_length() - 1 if g else -1
            assert sent[(root + g) % n] == activation.dimensions(n) - 1 - hi


@pytest.mark.parametrize("n", list(range(1, 17)) + [32, 64])
def test_token_hops_are_the_popcount_of_the_offset(n: int) -> None:
    L = 3e-6
    c = CostModel(L, L, math.inf, math.inf, 0.0, 0.0, 0.0, 0.0, 2)
    for root in range(0, n, max(1, n // 4)):
        arrival, _ = token_arrivals(np.arange(n), root, 1.0, c)
        for g in range(n):
            assert arrival[(root + g) % n] == pytest.approx(1.0 + popcount(g) * L, rel=TIGHT)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 16])
def test_flat_tokens_leave_the_root_one_port_time_apart(n: int) -> None:
    """The per-group flat broadcast: one hop to everyone, the root sends all
    n - 1 tokens (activation.flat_targets' order), the k-th after k port times."""
    L, o = 3e-6, 1e-6
    c = CostModel(L, L, math.inf, math.inf, 0.0, 0.0, o, 0.0, 2)
    for root in range(n):
        members = np.arange(n) * 3 + 1
        arrival, sent = token_arrivals(members, root, 1.0, c, flat=True)
        assert sent.tolist() == [n - 1 if m == root else 0 for m in range(n)]
        assert arrival[root] == 1.0
        for k, m in enumerate(activation.flat_targets(root, n), start=1):
            assert arrival[m] == pytest.approx(1.0 + k * o + L + o, rel=TIGHT)


@pytest.mark.parametrize("n", range(2, 18))
def test_token_tree_is_activation_forward(n: int) -> None:
    """The tree token_arrivals times is forward's routing less the tokens that
    wrap around (non-power-of-two n). Up to 16 members the wrapped tokens
    are also never the first to reach a member in hop order; at 17 one is
    (see test_token_arrivals_includes_wrapped_tokens_that_arrive_first)."""
    for root in range(n):
        tokens, first = replay_forward(n, root)
        tree = tree_pairs(n, root)
        if n <= 16:
            assert first == tree
        else:
            assert (first - tree) == {((root + 8) % n, (root + 7) % n)}
        assert len(tree) == n - 1
        wrapped = [(a, b) for a, b in tokens if (b - root) % n < (a - root) % n]
        assert set(tokens) - set(wrapped) == tree
        assert len(tokens) == len(wrapped) + n - 1  # nothing else is sent
        if n & (n - 1) == 0:
            assert wrapped == []
        _, sent = token_arrivals(np.arange(n), root, 0.0, ZERO)
        per_sender = np.bincount([a for a, _ in tree], minlength=n)
        np.testing.assert_array_equal(sent, per_sender)


@pytest.mark.parametrize("n", range(2, 17))
def test_token_times_follow_forward_uniform_links(n: int) -> None:
    """With one latency and one bandwidth everywhere (n <= 16), the tree
    token of every member is its first token in forward's timed routing."""
    rng = np.random.default_rng(n)
    for _ in range(4):
        L, bw = rng.uniform(1e-7, 1e-5), rng.uniform(1e6, 1e10)
        c = CostModel(L, L, bw, bw, 0.0, 0.0, float(rng.uniform(0, 1e-6)), 0.0, 1)
        members = np.sort(rng.choice(100, n, replace=False))
        root = int(rng.integers(n))
        arrival, _ = token_arrivals(members, root, 2.0, c)
        np.testing.assert_allclose(arrival, timed_forward(members, root, 2.0, c),
                                   rtol=1e-13, atol=0)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_token_times_follow_forward_two_latencies(n: int) -> None:
    """Power-of-two scopes (no wrapped tokens) on nodes of 2-3 ranks, with
    distinct intra/inter latencies (equal bandwidths: equal port times)."""
    rng = np.random.default_rng(100 + n)
    for rpn in (2, 3):
        c = CostModel(1e-6, 6e-6, 2e9, 2e9, 0.0, 0.0, 4e-7, 0.0, rpn)
        members = np.sort(rng.choice(3 * n, n, replace=False))
        for root in (0, n - 1):
            arrival, _ = token_arrivals(members, root, 0.0, c)
            np.testing.assert_allclose(arrival, timed_forward(members, root, 0.0, c),
                                       rtol=1e-13, atol=0)


@pytest.mark.xfail(strict=True, reason=(
    "sim/collectives.py token_arrivals drops wrapped tokens, assuming they reach "
    "members already reached; for n=17 with latency 5us, o=0 and infinite "
    "bandwidth, forward() reaches offset 7 via 0->8->7 (the dimension-4 token of "
    "offset 8 wraps to 7) at 2 latencies = 10us, token_arrivals says popcount(7)=3 "
    "latencies = 15us; the GPU_CLUSTER preset (rpn=1, n=17) is 1us late too"))
def test_token_arrivals_includes_wrapped_tokens_that_arrive_first() -> None:
    L = 5e-6
    c = CostModel(L, L, math.inf, math.inf, 0.0, 0.0, 0.0, 0.0, 1)
    arrival, _ = token_arrivals(np.arange(17), 0, 0.0, c)
    real = timed_forward(np.arange(17), 0, 0.0, c)
    assert real[7] == pytest.approx(2 * L)
    np.testing.assert_allclose(arrival, real, rtol=1e-12)


@pytest.mark.xfail(strict=True, reason=(
    "sim/collectives.py token_arrivals: a sender's k-th token leaves k times the "
    "port time of *its own* link, not after the sum of the port times of the "
    "tokens before it as TimedDag serialises sends. Members (0,1,2,3), root 0, "
    "rpn=2, bw_intra=1e9, bw_inter=1e7, latency 1us, o=0: member 2 (second "
    "token, inter-node) should land at 32/1e9 + 32/1e7 + 1us = 4.232us; "
    "token_arrivals gives 2*32/1e7 + 1us = 7.4us"))
def test_token_port_time_is_the_sum_of_earlier_tokens() -> None:
    c = CostModel(1e-6, 1e-6, 1e9, 1e7, 0.0, 0.0, 0.0, 0.0, 2)
    arrival, _ = token_arrivals(np.arange(4), 0, 0.0, c)
    assert arrival[2] == pytest.approx(32 / 1e9 + 32 / 1e7 + 1e-6, rel=1e-9)


def test_token_arrivals_positive_costs_by_hand() -> None:
    """4 members, root 1, rpn=1 (all links inter): offset 1 is the root's first
    token, offset 2 its second, offset 3 offset 1's first."""
    o = 2e-7
    c = model(o=o, rpn=1)
    port = o + TOKEN_BYTES / c.bandwidth_inter
    hop = c.latency_inter_s + o
    members = np.array([10, 20, 30, 40])
    arrival, sent = token_arrivals(members, 1, 1.0, c)
    at = {0: 1.0, 1: 1.0 + port + hop, 2: 1.0 + 2 * port + hop}
    at[3] = at[1] + port + hop
    expected = [at[(p - 1) % 4] for p in range(4)]
    assert arrival == pytest.approx(expected, rel=TIGHT)
    assert sent.tolist() == [0, 2, 1, 0]


# ======================================================= 5. training iterations


SMALL = dict(size=8, elements=1000, compute_s=0.01, group_size=4)


def host_copies(cost: CostModel, w: Workload) -> tuple[float, float]:
    """What a partial round costs on the host besides its schedule (as
    partial/ does it): one copy of the model (step() publishing it; the
    progress thread copies it again into the round buffer) and one reduction
    (averaging the result into the caller's buffer)."""
    nbytes = w.elements * w.itemsize
    return (cost.op_overhead_s + nbytes * cost.copy_s_per_byte,
            cost.op_overhead_s + nbytes * cost.reduce_s_per_byte)


def test_one_iteration_of_each_method_by_hand() -> None:
    cost = GPU_CLUSTER.with_(ranks_per_node=4)
    c, comp = cost.call_overhead_s, 0.01
    w = Workload(**SMALL, steps=1, sync_every=1000)
    copy, finish = host_copies(cost, w)
    assert copy > 0 and finish > 0
    lib = Collectives(8, cost)
    group_round = lib.partition(4, 0, 1000, "sum", flags=True).cost_of()
    partial = comp + copy + c + copy  # publish, round start, then the round
    expected = {
        "allreduce": comp + c + lib.allreduce(1000).cost_of(),
        "group_allreduce": comp + c + lib.partition(4, 0, 1000).cost_of(),
        "local_sgd": comp,
        "dpsgd": comp + c + lib.neighbours(1000).cost_of(),
        "wagma": partial + group_round + finish,
        "wagma_group_scope": partial + group_round + finish,
        "solo": partial + lib.global_round(1000).cost_of() + finish,
    }
    # majority: only the agreed activator's arrival starts the round; the
    # others (already there) join when its token reaches them
    root = activation.majority_activator(0, 0, 8)
    tok, _ = token_arrivals(np.arange(8), root, comp + copy, cost)
    assert tok[root] == comp + copy and np.all(np.delete(tok, root) > comp + copy)
    expected["majority"] = float(
        lib.global_round(1000).evaluate(tok + c + copy).max()) + finish
    assert expected["majority"] > expected["solo"]
    assert set(expected) == set(METHODS)
    for m in METHODS:
        r = simulate(m, w, cost)
        assert r.makespan_s == pytest.approx(expected[m], rel=1e-12), m
        assert r.iterations_per_s == pytest.approx(1 / expected[m], rel=1e-12), m
        assert r.method == m
        if m in PARTIAL:
            assert r.fresh_share == 1.0
            assert r.staleness_histogram == {0: 8}
        else:
            assert r.fresh_share is None and r.staleness_histogram == {}


def test_blocking_iterations_chain() -> None:
    """Steps of a blocking method: each starts where the last ended plus compute."""
    cost = GPU_CLUSTER.with_(ranks_per_node=2)
    w = Workload(6, 30000, 0.002, steps=7, group_size=3, sync_every=3)
    lib = Collectives(6, cost)
    ar = lib.allreduce(30000)
    end = np.zeros(6)
    for _ in range(7):
        end = ar.evaluate(end + 0.002 + cost.call_overhead_s)
    r = simulate("allreduce", w, cost, lib)
    assert r.makespan_s == pytest.approx(end.max(), rel=1e-12)
    assert r.iterations_per_s == pytest.approx(7 / end.max(), rel=1e-12)
    # group_allreduce: group steps skip nothing at sync rounds, which are global
    end = np.zeros(6)
    for t in range(7):
        if activation.is_sync_round(t, 3):
            dag = ar
        else:
            dag = lib.partition(3, activation.group_step(t, 3), 30000)
        end = dag.evaluate(end + 0.002 + cost.call_overhead_s)
    r = simulate("group_allreduce", w, cost, lib)
    assert r.makespan_s == pytest.approx(end.max(), rel=1e-12)


def test_forced_algorithm_is_used() -> None:
    cost = GPU_CLUSTER.with_(ranks_per_node=2)
    w = Workload(5, 1000, 0.01, steps=1, algorithm="ring")
    ring = TimedDag(allreduce(tuple(range(5)), 1000, "ring", "avg"), cost, 4)
    r = simulate("allreduce", w, cost)
    assert r.makespan_s == pytest.approx(0.01 + cost.call_overhead_s + ring.cost_of(),
                                         rel=1e-12)
    assert r.messages_per_iteration == 8.0  # 2(n-1)


def test_messages_and_bytes_per_iteration() -> None:
    """16 ranks, groups of 4 at every group step, small buffers (recursive
    doubling), no sync round: 2 data messages per rank per round plus the 15
    tokens of the activation tree shared by 16 ranks. A sync round: 15
    arrival-check messages and 4 rounds of recursive doubling, no tokens."""
    assert groups.radices(16, 4) == (4, 4)
    w = Workload(16, 1000, 0.01, group_size=4, steps=3, sync_every=100)
    r = simulate("wagma", w, GPU_CLUSTER)
    assert r.messages_per_iteration == pytest.approx(2 + 15 / 16, rel=TIGHT)
    data = 2 * (1000 + 4) * 4
    assert r.bytes_per_iteration == pytest.approx(data + 15 / 16 * TOKEN_BYTES, rel=TIGHT)
    w = Workload(16, 1000, 0.01, group_size=4, steps=1, sync_every=1)
    r = simulate("wagma", w, GPU_CLUSTER)
    assert r.messages_per_iteration == 15 + 4
    assert r.bytes_per_iteration == 15 * 16 + 4 * (1000 + 16) * 4
    # 8 ranks in groups of 4: radices (4, 2), so group step 1 pairs ranks
    w = Workload(**SMALL, steps=3, sync_every=100)
    r = simulate("wagma", w, GPU_CLUSTER)
    assert r.messages_per_iteration == pytest.approx((2 + 1 + 2) / 3 + 7 / 8, rel=TIGHT)
    r = simulate("allreduce", Workload(**SMALL, steps=4), GPU_CLUSTER)
    assert r.messages_per_iteration == 3 and r.bytes_per_iteration == 3 * 4000
    r = simulate("local_sgd", Workload(**SMALL, steps=4, sync_every=2), GPU_CLUSTER)
    assert r.messages_per_iteration == 3 / 2
    r = simulate("dpsgd", Workload(**SMALL, steps=2), GPU_CLUSTER)
    assert r.messages_per_iteration == 2 and r.bytes_per_iteration == 8000


def zero_cost_reference(method: str, w: Workload):
    """The training loop under the zero cost model, from the module's rules:
    a collective ends everywhere at the latest start among the ranks it
    depends on, tokens are instant."""
    P, inj = w.size, make_injector(w.imbalance, w.size, w.seed)
    end, busy, waited = np.zeros(P), np.zeros(P), np.zeros(P)
    starts, ends, arrivals, fresh = [], [], [], 0

    def group_max(x: np.ndarray, parts) -> np.ndarray:
        out = np.empty(P)
        for g in parts:
            out[list(g)] = x[list(g)].max()
        return out

    for t in range(w.steps):
        a = end + w.compute_s + inj.delays(t)
        sync = (t + 1) % w.sync_every == 0
        parts = groups.partition(P, w.group, t - (t + 1) // w.sync_every)
        if method in BLOCKING:
            if method == "allreduce" or (sync and method != "dpsgd"):
                e = np.full(P, a.max())
            elif method == "local_sgd":
                e = a.copy()
            elif method == "group_allreduce":
                e = group_max(a, parts)
            else:
                e = np.array([max([a[i]] + [a[j] for j in ring_neighbours(i, P)])
                              for i in range(P)])
        else:
            if sync:
                s = np.maximum(a, busy)
                e = np.full(P, s.max())
            else:
                if method == "majority":
                    act = np.full(P, a[activation.majority_activator(w.seed, t, P)])
                elif method == "wagma_group_scope":
                    act = group_max(-a, parts) * -1  # the group's first arrival
                else:
                    act = np.full(P, a.min())
                s = np.maximum(act, busy)
                e = group_max(s, parts) if method.startswith("wagma") else np.full(P, s.max())
            starts.append(s)
            ends.append(e)
            fresh += int(np.sum(a <= s))
            busy = e
            e = np.maximum(a, e)
        arrivals.append(a)
        waited += e - a
        end = e
    hist: dict[int, int] = {}
    if method in PARTIAL:
        for i in range(P):
            for t in range(w.steps):
                k = sum(1 for u in range(t, w.steps) if starts[u][i] < arrivals[t][i])
                if k and method.startswith("wagma"):  # the newest round completed, or its own
                    k = max(1, sum(1 for u in range(t, w.steps) if ends[u][i] < arrivals[t][i]))
                hist[k] = hist.get(k, 0) + 1
    return end.max(), waited / w.steps, (fresh / (P * w.steps) if method in PARTIAL else None), \
        dict(sorted(hist.items()))


@pytest.mark.parametrize("spec,size,group", [
    ("reference:0.3:2", 8, 4), ("reference:0.05:3", 12, 4), ("skewed:0.02:1.0", 6, 3),
    ("slownode:0.04:2:1", 8, 2), ("none", 5, 5)])
def test_zero_cost_training_follows_the_recurrence(spec: str, size: int, group: int) -> None:
    w = Workload(size, 64, 0.01, imbalance=spec, steps=11, group_size=group, sync_every=4,
                 seed=3)
    for m in METHODS:
        r = simulate(m, w, ZERO)
        makespan, wait, fresh, hist = zero_cost_reference(m, w)
        assert r.makespan_s == pytest.approx(makespan, rel=1e-12), m
        np.testing.assert_allclose(r.wait_per_iteration_s, wait, rtol=1e-9, atol=1e-15,
                                   err_msg=m)
        assert r.mean_wait_s == pytest.approx(float(np.mean(wait)), rel=1e-9, abs=1e-15)
        assert r.fresh_share == fresh, m
        assert r.staleness_histogram == hist, m
        assert r.iterations_per_s == pytest.approx(11 / makespan, rel=1e-12)
        if spec == "none":
            assert r.fresh_share in (None, 1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_injector_zero_cost_by_hand(seed: int) -> None:
    P, steps, S, comp = 16, 24, 6, 0.05
    w = Workload(P, 256, comp, imbalance="reference:0.3:2", steps=steps, group_size=4,
                 sync_every=S, seed=seed)
    inj = make_injector("reference:0.3:2", P, seed)
    delays = np.array([inj.delays(t) for t in range(steps)])
    results = {m: simulate(m, w, ZERO) for m in METHODS}
    # a global allreduce every step: everyone waits for that step's slowest
    blocking = sum(comp + delays[t].max() for t in range(steps))
    assert blocking == pytest.approx(steps * (comp + 0.3))  # someone is slow every step
    assert results["allreduce"].makespan_s == pytest.approx(blocking, rel=1e-12)
    # local SGD: each rank runs on its own until the period's allreduce
    periods = delays.reshape(steps // S, S, P).sum(axis=1).max(axis=1)
    local = float(np.sum(S * comp + periods))
    assert results["local_sgd"].makespan_s == pytest.approx(local, rel=1e-12)
    for m in ("local_sgd", "wagma", "wagma_group_scope", "solo", "group_allreduce", "dpsgd"):
        assert results[m].iterations_per_s >= results["allreduce"].iterations_per_s * (
            1 - 1e-12), m
    assert results["local_sgd"].iterations_per_s > results["allreduce"].iterations_per_s
    for m in PARTIAL:
        r = results[m]
        hist = r.staleness_histogram
        assert sum(hist.values()) == P * steps
        stale = sum(v for k, v in hist.items() if k >= 1)
        assert stale == round((1 - r.fresh_share) * P * steps)
    assert results["wagma"].fresh_share < 1.0  # slow ranks contribute stale models


def test_fresh_without_imbalance_when_ranks_finish_together() -> None:
    w = Workload(**SMALL, steps=9, sync_every=10)
    for m in PARTIAL:
        for cost in (ZERO, GPU_CLUSTER):
            if m == "majority" and cost is GPU_CLUSTER:
                continue  # the activator may be ahead of ranks it tokens late
            r = simulate(m, w, cost)
            assert r.fresh_share == 1.0, (m, cost.name)
            assert r.staleness_histogram == {0: 72}
    w = Workload(**SMALL, steps=20, sync_every=5)
    for m in PARTIAL:
        r = simulate(m, w, ZERO)
        assert r.fresh_share == 1.0 and r.staleness_histogram == {0: 160}


def runtime_tokens_all_arrive_together(n: int) -> int:
    """Tokens partial/base.py sends for one round when all n members arrive
    before any token lands: each step() finds its round not started, so
    _arrive -> _activate(t, None, rank) -> _route with came=-1 sends along
    every dimension below its threshold; later tokens find nothing left."""
    thresholds = [activation.no_tokens_sent(n)] * n
    sent = 0
    for me in range(n):  # every own activation first
        targets, thresholds[me] = activation.forward(me, n, -1, thresholds[me])
        sent += len(targets)
    for me in range(n):  # then the incoming tokens: nothing left to forward
        for d in range(activation.dimensions(n)):
            targets, thresholds[me] = activation.forward(me, n, d, thresholds[me])
            assert targets == []
    return sent


def test_runtime_token_count_helper() -> None:
    assert runtime_tokens_all_arrive_together(8) == 24
    assert runtime_tokens_all_arrive_together(4) == 8
    assert runtime_tokens_all_arrive_together(1) == 0


@pytest.mark.xfail(strict=True, reason=(
    "sim/training.py _activation counts only the first arrival's tree (n-1 "
    "tokens, token_arrivals' `sent`), but in partial/base.py every rank whose "
    "step() finds its round not yet started activates it itself (step() line "
    "'elif t > self._started_snapshot()' -> _arrive -> _activate(t, None, rank) "
    "-> _route, came=-1) and sends along every dimension it has not covered: "
    "8 ranks of a balanced WAGMA round each send 3 tokens (24), the sim counts 7, "
    "so messages_per_iteration is 2 + 7/8 instead of 2 + 3 (groups of 4)"))
def test_token_messages_of_self_activating_ranks() -> None:
    w = Workload(**SMALL, steps=1, sync_every=100)
    r = simulate("wagma", w, GPU_CLUSTER)
    assert r.messages_per_iteration == pytest.approx(
        2 + runtime_tokens_all_arrive_together(8) / 8, rel=TIGHT)


def test_majority_waits_for_a_slow_activator() -> None:
    """Make the agreed activator of round 0 the slow rank: solo starts without
    it (its contribution is stale, it does not wait); majority waits for it
    and everyone else's contribution is fresh."""
    P, comp, D = 8, 0.01, 0.5
    root = activation.majority_activator(0, 0, P)
    w = Workload(P, 100, comp, imbalance=f"slownode:{D}:1:{root}", steps=1, sync_every=50)
    maj, solo = simulate("majority", w, ZERO), simulate("solo", w, ZERO)
    assert maj.makespan_s == pytest.approx(comp + D)
    assert maj.fresh_share == 1.0
    assert solo.makespan_s == pytest.approx(comp + D)  # the slow rank's own compute
    assert solo.fresh_share == pytest.approx((P - 1) / P)
    assert solo.staleness_histogram == {0: P - 1, 1: 1}
    wait_solo = np.array(solo.wait_per_iteration_s)
    assert wait_solo[root] == 0.0 and np.all(np.delete(wait_solo, root) == 0.0)
    wait_maj = np.array(maj.wait_per_iteration_s)
    assert wait_maj[root] == 0.0
    assert np.delete(wait_maj, root) == pytest.approx([D] * (P - 1))
    # with costs: the round starts when the activator's tokens arrive
    cost = GPU_CLUSTER
    copy, finish = host_copies(cost, w)
    lib = Collectives(P, cost)
    tok, sent = token_arrivals(np.arange(P), root, comp + D + copy, cost)
    tok[root] = comp + D + copy
    starts = tok + cost.call_overhead_s + copy
    expected = float(lib.global_round(100).evaluate(starts).max()) + finish
    r = simulate("majority", w, cost, lib)
    assert r.makespan_s == pytest.approx(expected, rel=1e-12)
    assert r.messages_per_iteration == pytest.approx(
        (sent.sum() + lib.global_round(100).traffic.messages.sum()) / P, rel=TIGHT)


def test_simulate_rejects_bad_input() -> None:
    w = Workload(**SMALL, steps=1)
    with pytest.raises(InvalidArgumentError) as e:
        simulate("bogus", w, ZERO)
    assert e.value.argument == "method"
    with pytest.raises(InvalidArgumentError) as e:
        simulate("wagma", w, ZERO, Collectives(8, GPU_CLUSTER))
    assert e.value.argument == "collectives"
    with pytest.raises(InvalidArgumentError) as e:
        simulate("wagma", w, ZERO, Collectives(9, ZERO))
    assert e.value.argument == "collectives"


@pytest.mark.parametrize("kwargs,argument", [
    (dict(size=0), "size"), (dict(size=True), "size"), (dict(size=2.0), "size"),
    (dict(elements=-1), "elements"), (dict(steps=0), "steps"),
    (dict(sync_every=0), "sync_every"), (dict(itemsize=0), "itemsize"),
    (dict(seed=-1), "seed"), (dict(group_size=-1), "group_size"),
    (dict(group_size=9), "group_size"), (dict(compute_s=-0.1), "compute_s"),
    (dict(compute_s="1"), "compute_s"), (dict(imbalance="bogus"), "imbalance"),
    (dict(imbalance="reference:-1"), "imbalance"), (dict(imbalance="slownode:1:8:1"),
                                                    "imbalance")])
def test_workload_rejects_bad_arguments(kwargs, argument: str) -> None:
    args = dict(size=8, elements=10, compute_s=0.1)
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError) as e:
        Workload(**args)
    assert e.value.argument == argument


def test_workload_defaults() -> None:
    w = Workload(10, 5, 0.1)
    assert (w.group, w.itemsize, w.imbalance, w.algorithm) == (5, 4, "none", None)
    assert Workload(1, 5, 0.1).group == 1
    assert Workload(10, 5, 0.1, group_size=3).group == 3


@pytest.mark.parametrize("compute_s", [float("nan"), float("inf"), True])
def test_workload_rejects_non_finite_compute(compute_s) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        Workload(8, 10, compute_s)
    assert e.value.argument == "compute_s"


def test_workload_rejects_unknown_algorithm() -> None:
    with pytest.raises(InvalidArgumentError) as e:
        Workload(8, 10, 0.1, algorithm="bogus")
    assert e.value.argument == "algorithm"


def test_partial_methods_refuse_native_rounds() -> None:
    w = Workload(8, 10, 0.1, steps=2, algorithm="native")
    with pytest.raises(InvalidArgumentError) as e:
        simulate("wagma", w, GPU_CLUSTER)
    assert e.value.argument == "algorithm"


def test_collectives_refuse_oversized_schedules() -> None:
    lib = Collectives(3000, GPU_CLUSTER, algorithm="ring")
    with pytest.raises(InvalidArgumentError) as e:
        lib.allreduce(10)
    assert e.value.argument == "algorithm"


def test_collectives_cache_and_step_modulo() -> None:
    lib = Collectives(16, GPU_CLUSTER)
    assert lib.allreduce(100) is lib.allreduce(100)
    k = groups.num_steps(16, 4)
    assert k == 2
    assert lib.partition(4, 1, 100) is lib.partition(4, 1 + 3 * k, 100)
    dag = lib.partition(4, 1, 100, "sum", flags=True)
    parts = groups.partition(16, 4, 1)
    assert sorted(dag.members.tolist()) == list(range(16))
    # the flags: one element per member after the data
    want = sum(len(s.ops) for g in parts
               for s in allreduce(g, 104, alg.choose_allreduce(104 * 4, 4)))
    assert dag.ops == want
    assert lib.global_round(100).ops == sum(
        len(s.ops) for s in allreduce(tuple(range(16)), 116, "recursive_doubling"))


# ===================================================== 6. thousands of ranks


def test_four_thousand_ranks() -> None:
    w = Workload(4096, elements=1 << 20, compute_s=0.1, imbalance="reference:0.3:2",
                 steps=12, group_size=8, sync_every=6)
    r = simulate("wagma", w, PRESETS["gpu-cluster"])
    assert math.isfinite(r.iterations_per_s) and 0 < r.iterations_per_s < 1 / 0.1
    assert r.iterations_per_s == pytest.approx(12 / r.makespan_s, rel=TIGHT)
    assert r.makespan_s > 12 * 0.1
    assert len(r.wait_per_iteration_s) == 4096
    assert sum(r.staleness_histogram.values()) == 4096 * 12
    assert 0 < r.fresh_share <= 1
    assert r.messages_per_iteration > 0 and r.bytes_per_iteration > 0


# ======================================================== the cost model


def test_cost_model_validation() -> None:
    good = dict(latency_intra_s=1e-6, latency_inter_s=2e-6, bandwidth_intra=1e9,
                bandwidth_inter=1e8, reduce_s_per_byte=0.0, copy_s_per_byte=0.0,
                op_overhead_s=0.0, call_overhead_s=0.0, ranks_per_node=4)
    CostModel(**good)
    for field, value, argument in (("latency_intra_s", -1e-6, "latency_intra_s"),
                                   ("op_overhead_s", True, "op_overhead_s"),
                                   ("copy_s_per_byte", "0", "copy_s_per_byte"),
                                   ("bandwidth_inter", 0.0, "bandwidth"),
                                   ("ranks_per_node", 0, "ranks_per_node"),
                                   ("ranks_per_node", 1.5, "ranks_per_node")):
        with pytest.raises(InvalidArgumentError) as e:
            CostModel(**{**good, field: value})
        assert e.value.argument == argument, field


def test_cost_model_rejects_nan() -> None:
    with pytest.raises(InvalidArgumentError):
        CostModel(float("nan"), 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1)


def test_cost_model_files(tmp_path) -> None:
    path = tmp_path / "cost.json"
    GPU_CLUSTER.save(str(path), extra={"measured": {"x": 1}})
    data = json.loads(path.read_text())
    assert data["measured"] == {"x": 1}
    assert CostModel.load(str(path)) == GPU_CLUSTER
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(ZERO.to_dict() | {"unknown": 3}))
    assert CostModel.load(str(bare)) == ZERO
    assert CostModel.load("gpu-cluster") is GPU_CLUSTER and CostModel.load("zero") is ZERO
    partial = tmp_path / "partial.json"
    d = GPU_CLUSTER.to_dict()
    del d["latency_inter_s"]
    partial.write_text(json.dumps(d))
    with pytest.raises(InvalidArgumentError, match="latency_inter_s") as e:
        CostModel.load(str(partial))
    assert e.value.argument == "cost"
    with pytest.raises(InvalidArgumentError) as e:
        CostModel.load(str(tmp_path / "missing.json"))
    assert e.value.argument == "cost"
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(InvalidArgumentError) as e:
        CostModel.load(str(tmp_path / "junk.json"))
    assert e.value.argument == "cost"
    assert GPU_CLUSTER.with_(ranks_per_node=2).ranks_per_node == 2
    assert GPU_CLUSTER.ranks_per_node == 8


def test_presets() -> None:
    assert {"gpu-cluster", "zero"} <= set(PRESETS)
    assert all(CostModel.load(name) is cm for name, cm in PRESETS.items())
    z = PRESETS["zero"]
    assert z.latency(0, 5) == 0.0 and z.bandwidth(0, 5) == math.inf
    g = GPU_CLUSTER
    assert g.same_node(0, 7) and not g.same_node(7, 8)
    assert g.bandwidth_intra > g.bandwidth_inter and g.latency_intra_s < g.latency_inter_s


# -- command lines: bad input is refused naming its option --------------------------------
def _cli(argv: list[str]) -> int:
    from wagma_comm.cli import main

    return main(argv)


@pytest.mark.parametrize("argv,argument", [
    (["--itemsize", "0"], "itemsize"),  # was ZeroDivisionError
    (["--model-mb", "nan"], "model_mb"),  # was ValueError from int(nan)
    (["--model-mb", "inf"], "model_mb"),  # was OverflowError
    (["--model-mb", "-5"], "model_mb"),  # was a silent 0-byte model
])
def test_sim_and_plan_refuse_bad_model_sizes(argv: list[str], argument: str, capsys) -> None:
    for command in (["sim", "--ranks", "4"], ["plan", "--ranks", "4"]):
        with pytest.raises(InvalidArgumentError) as e:
            _cli([*command, "--steps", "2", "--methods", "allreduce", *argv]
                 if command[0] == "sim" else [*command, "--steps", "2", *argv])
        assert e.value.argument == argument, command
    assert capsys.readouterr().out == ""  # refused before anything ran


@pytest.mark.parametrize("argv,option", [
    (["--ranks", "0"], "--ranks"), (["--ranks", "4", "--compute", "-1"], "--compute"),
    (["--ranks", "4", "--steps", "0"], "--steps"),
    (["--ranks", "4", "--imbalance", "bogus"], "--imbalance")])
def test_sim_and_plan_name_the_option_not_the_workload_field(argv: list[str], option: str,
                                                             capsys) -> None:
    """`--ranks 0` was blamed on `size`, `--compute -1` on `compute_s`: the
    simulator's field names, which no option of the command has."""
    for command in ("sim", "plan"):
        with pytest.raises(InvalidArgumentError) as e:
            _cli([command, *argv, "--methods", "allreduce"] if command == "sim"
                 else [command, *argv])
        assert e.value.argument == option, command
        assert not str(e.value).startswith(option.lstrip("-").replace("-", "_") + ":")
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("argv", [["sim", "--ranks", ","], ["sim", "--ranks", ""],
                                  ["plan", "--ranks", "4", "--group-sizes", ","],
                                  ["plan", "--ranks", "4", "--sync-periods", ","]])
def test_empty_int_lists_are_refused(argv: list[str], capsys) -> None:
    # `--ranks ,` ran nothing and exited 0; `--group-sizes ,` silently took the defaults.
    with pytest.raises(SystemExit) as e:
        _cli(argv)
    assert e.value.code == 2
    assert "expected at least one int" in capsys.readouterr().err


def test_calibrate_refuses_zero_repeats_before_any_communication() -> None:
    from wagma_comm.sim.calibrate import calibrate

    with pytest.raises(InvalidArgumentError) as e:  # was ZeroDivisionError on every rank
        calibrate(None, repeats=0)
    assert e.value.argument == "repeats"
    with pytest.raises(InvalidArgumentError) as e:
        _cli(["sim", "--calibrate", "--repeats", "0"])
    assert e.value.argument == "repeats"


def _measurement(delay: float) -> dict:
    return {"ranks": 2, "compute_s": 0.01, "injector": f"reference:{delay}:2",
            "sync_every": 5, "group_size": 1, "grace": 0.0, "elements": 64, "seed": 0,
            "steps": 10, "rates": {"allreduce": 50.0, "wagma": 60.0}}


def test_validate_takes_every_measurement_of_a_delays_sweep(tmp_path, capsys) -> None:
    """`wagma imbalance --delays ... --json` writes {"sweep": [...]}: --validate
    raised KeyError 'ranks' on it."""
    path, out = tmp_path / "sweep.json", tmp_path / "v.json"
    path.write_text(json.dumps({"sweep": [_measurement(0.0), _measurement(0.01)]}))
    assert _cli(["sim", "--validate", str(path), "--cost", "zero", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("# validation: 2 ranks") == 2
    assert "reference:0.0:2" in text and "reference:0.01:2" in text
    written = json.loads(out.read_text())["sweep"]
    assert [len(v["rows"]) for v in written] == [2, 2]
    assert written[1]["workload"]["imbalance"] == "reference:0.01:2"
    single = tmp_path / "one.json"
    single.write_text(json.dumps(_measurement(0.01)))
    assert _cli(["sim", "--validate", str(single), "--cost", "zero", "--json", str(out)]) == 0
    assert [r["method"] for r in json.loads(out.read_text())["rows"]] == ["allreduce", "wagma"]


def test_validate_notes_a_grace_it_does_not_model(tmp_path, capsys) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps(_measurement(0.01) | {"grace": 0.5}))
    _cli(["sim", "--validate", str(path), "--cost", "zero"])
    assert "measured with grace 0.5; the simulator does not model" in capsys.readouterr().out


@pytest.mark.parametrize("content", ['{"x": 1}', "[]", "{not json", '{"sweep": []}',
                                     '{"sweep": [{"ranks": 2}]}'])
def test_validate_refuses_what_is_not_a_measurement(tmp_path, content: str) -> None:
    path = tmp_path / "m.json"
    path.write_text(content)
    with pytest.raises(InvalidArgumentError) as e:
        _cli(["sim", "--validate", str(path), "--cost", "zero"])
    assert e.value.argument == "validate"
    with pytest.raises(InvalidArgumentError) as e:
        _cli(["sim", "--validate", str(tmp_path / "missing.json"), "--cost", "zero"])
    assert e.value.argument == "validate"


def test_sync_round_arrival_check_runs_beside_the_data() -> None:
    """partial/base.py (since session 22, docs/partial.md) starts a sync round's
    all-to-all arrival check and its data exchange together (_check_arrivals
    beside _exchange); the simulator ran the check first and the data after
    it, a full exchange of latency too much on every sync round. Both start
    at the round's start; the round ends when both have."""
    cost = GPU_CLUSTER.with_(ranks_per_node=4)
    comp = 0.01
    w = Workload(**SMALL, steps=1, sync_every=1)
    copy, finish = host_copies(cost, w)
    lib = Collectives(8, cost)
    begin = np.full(8, comp + copy + cost.call_overhead_s + copy)
    data = lib.global_round(1000).evaluate(begin)
    check = lib.arrival_check().evaluate(begin)
    expected = float(np.maximum(data, check).max()) + finish
    serial = float(lib.global_round(1000).evaluate(check).max()) + finish
    assert serial > expected  # the two models differ here
    for m in PARTIAL:
        r = simulate(m, w, cost, lib)
        assert r.makespan_s == pytest.approx(expected, rel=1e-12), m


@pytest.mark.parametrize("field", ["latency_intra_s", "latency_inter_s", "reduce_s_per_byte",
                                   "copy_s_per_byte", "op_overhead_s", "call_overhead_s",
                                   "ranks_per_node"])
def test_cost_model_rejects_infinite_costs(field: str) -> None:
    """An infinite latency, rate or overhead (JSON 'Infinity' in a cost file)
    was accepted and made every time infinite (`wagma sim` then died in a
    ZeroDivisionError printing the table); an infinite ranks_per_node raised
    OverflowError. Only bandwidths may be infinite (messages of no size)."""
    with pytest.raises(InvalidArgumentError) as e:
        GPU_CLUSTER.with_(**{field: math.inf})
    assert e.value.argument == field
    assert GPU_CLUSTER.with_(bandwidth_inter=math.inf).bandwidth_inter == math.inf


@pytest.mark.parametrize("option,bad", [("--json", "DIR"), ("--plot", "DIR"),
                                        ("--plot", "scale.txt")])
def test_sim_refuses_an_output_it_could_not_write_before_simulating(
        tmp_path, capsys, option: str, bad: str) -> None:
    """`wagma sim --json DIR` (or --plot with a name matplotlib cannot render)
    simulated every size first (minutes at thousands of ranks), printed the
    tables, then died in open() with IsADirectoryError, or in the plot."""
    path = str(tmp_path) if bad == "DIR" else str(tmp_path / bad)
    with pytest.raises(InvalidArgumentError) as e:
        _cli(["sim", "--ranks", "4", "--steps", "2", "--methods", "allreduce", option, path])
    assert e.value.argument == option
    assert capsys.readouterr().out == ""  # nothing simulated


def test_validate_refuses_an_output_it_could_not_write_before_simulating(
        tmp_path, capsys) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps(_measurement(0.01)))
    with pytest.raises(InvalidArgumentError) as e:
        _cli(["sim", "--validate", str(path), "--cost", "zero", "--json", str(tmp_path)])
    assert e.value.argument == "--json"
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("rates", [{"allreduce": 0.0}, {"allreduce": -3.0},
                                   {"allreduce": float("nan")}, {"allreduce": "50"},
                                   {"sgp": 50.0}, {}, [50.0]])
def test_validate_refuses_rates_that_are_not_measurements(tmp_path, capsys, rates) -> None:
    """A measured rate of 0 died in ZeroDivisionError after the header was
    printed; NaN or a negative rate printed a FAIL row as if measured; an
    unknown method was refused as `method`, naming neither file nor entry."""
    path = tmp_path / "m.json"
    path.write_text(json.dumps(_measurement(0.01) | {"rates": rates}))
    with pytest.raises(InvalidArgumentError, match="rates") as e:
        _cli(["sim", "--validate", str(path), "--cost", "zero"])
    assert e.value.argument == "validate"
    assert capsys.readouterr().out == ""


def test_plan_refuses_sync_periods_longer_than_the_simulated_steps() -> None:
    """`wagma plan --steps 20` simulated the sync period 40 without a single
    sync round, so it looked fastest and was recommended."""
    from wagma_comm.sim.plan import plan

    w = Workload(8, 1000, 0.01, "reference:0.01:2", steps=20)
    with pytest.raises(InvalidArgumentError, match="40") as e:
        plan(w, GPU_CLUSTER, [2, 4], [5, 40])
    assert e.value.argument == "sync_periods"
    candidates, chosen = plan(w, GPU_CLUSTER, [2, 4], [5, 20])
    assert len(candidates) == 4 and chosen.sync_every in (5, 20)


def test_native_algorithm_leaves_partial_methods_out_or_refuses_them(capsys) -> None:
    # Was: every allreduce method simulated, then InvalidArgumentError at wagma.
    assert _cli(["sim", "--ranks", "4", "--steps", "2", "--algorithm", "native"]) == 0
    out = capsys.readouterr().out
    assert "left out" in out and " allreduce " in out
    assert not any(line.split()[0] == "wagma" for line in out.splitlines()
                   if line and not line.startswith("#"))
    with pytest.raises(InvalidArgumentError) as e:
        _cli(["sim", "--ranks", "4", "--steps", "2", "--algorithm", "native",
              "--methods", "allreduce,solo"])
    assert e.value.argument == "methods" and "solo" in str(e.value)
    with pytest.raises(InvalidArgumentError) as e:
        _cli(["plan", "--ranks", "4", "--steps", "2", "--algorithm", "native"])
    assert e.value.argument == "algorithm"
    assert capsys.readouterr().out == ""  # both refused before simulating


def test_calibrated_intra_node_bandwidth_is_no_faster_than_the_copy_rate() -> None:
    """A ping-pong whose half round trips were all one scheduler quantum (3
    ranks on 2 cores) fitted a slope of ~0: a 3.9e13 B/s model in CI. A byte
    moved between two ranks of a node is copied at least once, so the copy
    rate bounds it, and the raw measurements say it was capped."""
    from wagma_comm.sim.calibrate import _within_copy_rate

    raw: dict = {}
    assert _within_copy_rate(3.9e13, 1 / 2e10, raw, "ping-pong") == pytest.approx(2e10)
    assert "3.9e+13" in raw["bandwidth_capped"][0]
    untouched: dict = {}
    assert _within_copy_rate(7e9, 1 / 2e10, untouched, "fitted") == 7e9
    assert untouched == {}


def test_late_wagma_step_counts_staleness_to_the_newest_completed_round() -> None:
    """partial/wagma.py (session 45): a late WAGMA step gets the newest round
    completed on its rank, staleness ``round - iteration + 1``, not the rounds
    merely started (a newer one may still be running). Solo and majority get
    their own round and keep counting started rounds.

    By hand: two ranks, one group, every round costs 0.1 s (the call overhead),
    rank 1 is 0.25 s slow. Rank 0 arrives at 0.01 + k * 0.11 and runs round k
    in [0.01 + 0.11k, 0.11 + 0.11k]. Rank 1 arrives for step 0 at 0.26, when
    rounds 0 and 1 have completed and round 2 runs: WAGMA staleness 2 (the
    simulator said 3 before session 47), solo 3. Its step 0 returns at once
    (round 0 is done); step 1 arrives at 0.52, rounds 1 and 2 done (2); step 2
    at 0.78, round 2 done (1)."""
    cost = CostModel(0.0, 0.0, float("inf"), float("inf"), 0.0, 0.0, 0.0, 0.1, 1)
    w = Workload(2, 16, 0.01, imbalance="slownode:0.25:1:1", steps=3, group_size=2,
                 sync_every=100)
    for m in ("wagma", "wagma_group_scope"):
        r = simulate(m, w, cost)
        assert r.staleness_histogram == {0: 3, 1: 1, 2: 2}, m
    assert simulate("solo", w, cost).staleness_histogram == {0: 3, 1: 1, 2: 1, 3: 1}


@pytest.mark.parametrize("content", ["[]", "5", '"gpu-cluster"', '{"cost_model": [1, 2]}',
                                     '{"cost_model": null}'])
def test_cost_file_that_is_not_an_object_is_refused_naming_cost(tmp_path, content: str,
                                                                 capsys) -> None:
    """Valid JSON that is not an object of fields was an AttributeError ('list'
    object has no attribute 'get') or a TypeError, a traceback from
    `wagma sim --cost FILE`/`wagma plan --cost FILE`."""
    path = tmp_path / "cost.json"
    path.write_text(content)
    with pytest.raises(InvalidArgumentError) as e:
        CostModel.load(str(path))
    assert e.value.argument == "cost"
    for command in (["sim", "--methods", "allreduce"], ["plan"]):
        with pytest.raises(InvalidArgumentError) as e:
            _cli([*command, "--ranks", "4", "--steps", "2", "--cost", str(path)])
        assert e.value.argument == "cost"
    assert capsys.readouterr().out == ""


def test_first_round_moves_the_partial_rounds_not_the_injector() -> None:
    """``Workload.first_round``: a partial collective's round t is round
    first_round + t (majority activator, sync rounds), as the runtime's
    ``first_round`` and a collective kept across `wagma imbalance`'s runs;
    the injector stays at step t. By hand, under the zero cost model."""
    P, comp, D = 8, 0.01, 0.5
    root = activation.majority_activator(0, 0, P)
    other = next(r for r in range(1, 50) if activation.majority_activator(0, r, P) != root)
    w = Workload(P, 100, comp, imbalance=f"slownode:{D}:1:{root}", steps=1, sync_every=50)
    waits = np.array(simulate("majority", w, ZERO).wait_per_iteration_s)
    assert np.delete(waits, root) == pytest.approx([D] * (P - 1))  # waits for its activator
    shifted = simulate("majority", replace(w, first_round=other), ZERO)
    assert shifted.wait_per_iteration_s == [0.0] * P  # another activator: nobody waits
    assert shifted.fresh_share == pytest.approx((P - 1) / P)
    # rounds 2 and 3 with sync_every 4: step 1 is a sync round, so the fast ranks
    # wait there for the slow one's two delays (none without the shift)
    w = Workload(P, 100, comp, imbalance=f"slownode:{D}:1:0", steps=2, sync_every=4)
    for m in ("solo", "wagma"):
        assert np.all(np.array(simulate(m, w, ZERO).wait_per_iteration_s) == 0.0), m
        r = simulate(m, replace(w, first_round=2), ZERO)
        assert np.array(r.wait_per_iteration_s)[1:] == pytest.approx([D] * (P - 1)), m
        assert r.makespan_s == pytest.approx(2 * (comp + D)), m
    with pytest.raises(InvalidArgumentError) as e:
        Workload(P, 100, comp, first_round=-1)
    assert e.value.argument == "first_round"


def test_validate_simulates_the_rounds_the_timed_runs_used(tmp_path, capsys) -> None:
    """`wagma imbalance` keeps each partial collective through its warm-up and
    its timed runs, so timed run k starts at round k * steps (other majority
    activators, group steps) while the injector replays steps 0..steps-1; its
    rate is steps over the median run. --validate simulated every method from
    round 0."""
    m = {"ranks": 8, "compute_s": 0.01, "injector": "reference:0.01:2", "sync_every": 5,
         "group_size": 1, "grace": 0.0, "elements": 64, "seed": 0, "steps": 10,
         "rounds": 3, "rates": {"majority": 50.0, "allreduce": 50.0}}
    path, out = tmp_path / "m.json", tmp_path / "v.json"
    path.write_text(json.dumps(m))
    assert _cli(["sim", "--validate", str(path), "--cost", "zero", "--json", str(out)]) == 0
    rows = {r["method"]: r["simulated"] for r in json.loads(out.read_text())["rows"]}
    w = Workload(8, 64, 0.01, "reference:0.01:2", steps=10, group_size=1, sync_every=5)
    spans = [simulate("majority", replace(w, first_round=10 * k), ZERO).makespan_s
             for k in (1, 2, 3)]
    assert rows["majority"] == pytest.approx(10 / sorted(spans)[1], rel=TIGHT)
    assert rows["majority"] != pytest.approx(simulate("majority", w, ZERO).iterations_per_s)
    assert rows["allreduce"] == simulate("allreduce", w, ZERO).iterations_per_s
    capsys.readouterr()


def test_plan_simulates_a_repeated_candidate_once(capsys) -> None:
    """`wagma plan --group-sizes 4,4 --sync-periods 10,10` simulated the same
    candidate four times and printed four rows marked recommended."""
    from wagma_comm.sim.plan import plan

    w = Workload(8, 1000, 0.01, "reference:0.01:2", steps=20)
    candidates, chosen = plan(w, GPU_CLUSTER, [4, 2, 4], [10, 5, 10])
    assert [(c.group_size, c.sync_every) for c in candidates] == [(4, 10), (4, 5), (2, 10),
                                                                   (2, 5)]
    assert _cli(["plan", "--ranks", "8", "--steps", "20", "--model-mb", "0.01",
                 "--group-sizes", "4,4", "--sync-periods", "10,10"]) == 0
    assert capsys.readouterr().out.count("<- recommended") == 1


def test_scale_plot_title_gives_each_jobs_group(tmp_path) -> None:
    """The title showed the first run's group for every job size: `--ranks
    4,64 --group-size 8` caps the group at 4 for 4 ranks only, and
    `--group-size 0` (half the ranks) was titled "group 0"."""
    pytest.importorskip("matplotlib")
    from wagma_comm.sim.plots import plot_scale

    def runs(ranks: list[int], group: int) -> list[dict]:
        out = []
        for size in ranks:
            w = Workload(size, 100, 0.01, steps=2, group_size=min(group, size))
            out.append({"ranks": size, "workload": asdict(w), "cost_model": ZERO.to_dict(),
                        "results": {"allreduce": simulate("allreduce", w, ZERO).to_dict()}})
        return out

    title = plot_scale(runs([4, 64], 8), str(tmp_path / "a.png")).axes[0].get_title()
    assert "group 4-8," in title
    title = plot_scale(runs([16], 0), str(tmp_path / "b.png")).axes[0].get_title()
    assert "group 8," in title
