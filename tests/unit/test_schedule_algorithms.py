"""The schedule builder and the collective algorithms, proved by the verifier
and cross-checked by running them on numbers (no MPI)."""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wagma_comm.errors import InvalidArgumentError, ScheduleError
from wagma_comm.groups import group_of, partition
from wagma_comm.schedule import algorithms as alg
from wagma_comm.schedule.build import MAX_MSG, ScheduleBuilder
from wagma_comm.schedule.ir import (
    DATA, Copy, Native, Op, Recv, Reduce, Scale, Schedule, Send, Slot,
)
from wagma_comm.schedule.verify import verify, verify_collective

SMALL_SIZES = list(range(1, 18))
OPS_TESTED = ("sum", "avg")


def small_counts(n: int) -> list[int]:
    return sorted({0, 1, max(n - 1, 0), n, 2 * n + 3, 37})


# -- builder -----------------------------------------------------------------------
def builder(count: int = 8, ranks: tuple[int, ...] = (0, 1, 2)) -> ScheduleBuilder:
    return ScheduleBuilder("allreduce", "test", ranks[0], ranks, count, "sum")


def test_builder_infers_raw_war_waw() -> None:
    b = builder()
    t = b.scratch("t", 4)
    r0 = b.recv(Slot(t, 0, 4), 1)                          # writes t
    s0 = b.send(Slot(DATA, 0, 4), 2)                       # reads d[0:4]
    red = b.reduce(Slot(DATA, 0, 4), Slot(t, 0, 4), "sum")  # RAW on t, WAR on d
    r1 = b.recv(Slot(t, 0, 4), 1)                          # WAR on t (reduce read it)
    w = b.copy(Slot(DATA, 2, 2), Slot(DATA, 4, 2))           # WAW/RAW on d[2:4]
    sched = b.build()
    assert sched.deps[red] == (r0, s0)
    assert sched.deps[r1] == (red,)  # r0 (WAW) is implied through red
    assert sched.deps[w] == (red,)
    assert sched.deps[s0] == () and sched.deps[r0] == ()


def test_builder_disjoint_and_zero_count_slots_have_no_hazard() -> None:
    b = builder()
    b.recv(Slot(DATA, 0, 4), 1)
    i = b.recv(Slot(DATA, 4, 4), 2)
    j = b.send(Slot(DATA, 0, 0), 1)
    sched = b.build()
    assert sched.deps[i] == () and sched.deps[j] == ()


def test_builder_readers_since_last_write_only() -> None:
    b = builder()
    w0 = b.recv(Slot(DATA, 0, 8), 1)
    r1 = b.send(Slot(DATA, 0, 8), 2)
    w2 = b.scale(Slot(DATA, 0, 8), 2)
    r3 = b.send(Slot(DATA, 0, 4), 1)
    sched = b.build()
    assert sched.deps[r1] == (w0,)
    assert sched.deps[w2] == (r1,)  # w0 is implied through r1
    assert sched.deps[r3] == (w2,)  # not w0: ordered through w2


def test_builder_numbers_messages_per_peer_and_direction() -> None:
    b = builder()
    ops = [b.send(Slot(DATA, 0, 1), 1), b.send(Slot(DATA, 0, 1), 2),
           b.send(Slot(DATA, 0, 1), 1), b.recv(Slot(DATA, 1, 1), 1),
           b.recv(Slot(DATA, 2, 1), 1)]
    built = b.build().ops
    msgs = [op.msg for op in (built[i] for i in ops) if isinstance(op, (Send, Recv))]
    assert msgs == [0, 0, 1, 0, 1]


def test_builder_explicit_after() -> None:
    b = builder(count=0)
    r = b.recv(Slot(DATA, 0, 0), 1)
    s = b.send(Slot(DATA, 0, 0), 2, after=[r])
    assert b.build().deps[s] == (r,)
    with pytest.raises(ScheduleError):
        b.send(Slot(DATA, 0, 0), 2, after=[5])


@pytest.mark.parametrize("call", [
    lambda b: b.send(Slot(DATA, 4, 5), 1),            # past the end of data
    lambda b: b.send(Slot("nope", 0, 1), 1),          # undeclared scratch
    lambda b: b.send(Slot(DATA, -1, 1), 1),           # negative offset
    lambda b: b.send(Slot(DATA, 0, 1), 7),            # peer not in ranks
    lambda b: b.send(Slot(DATA, 0, 1), 0),            # peer == self
    lambda b: b.recv(Slot(DATA, 0, 1), 0),
    lambda b: b.reduce(Slot(DATA, 0, 2), Slot(DATA, 1, 2), "sum"),  # src overlaps dst
    lambda b: b.reduce(Slot(DATA, 0, 2), Slot(DATA, 2, 2), "avg"),  # avg is lowered
    lambda b: b.scale(Slot(DATA, 0, 2), 0),
    lambda b: b.native("allreduce", Slot(DATA, 0, 8), "sum", (1, 2)),  # not a member
    lambda b: b.native("broadcast", Slot(DATA, 0, 8), "", (0, 1), root=2),
    lambda b: b.native("gather", Slot(DATA, 0, 8), "", (0, 1)),
    lambda b: b.scratch(DATA, 3),
])
def test_builder_rejects_malformed_ops(call: Callable[[ScheduleBuilder], int]) -> None:
    with pytest.raises(ScheduleError):
        call(builder())


def test_builder_rejects_bad_group() -> None:
    with pytest.raises(ScheduleError):
        ScheduleBuilder("allreduce", "x", 5, (0, 1), 4)
    with pytest.raises(ScheduleError):
        ScheduleBuilder("allreduce", "x", 0, (0, 1, 1), 4)


def test_builder_message_limit() -> None:
    b = builder(count=0, ranks=(0, 1))
    for _ in range(MAX_MSG):
        b.send(Slot(DATA, 0, 0), 1)
    with pytest.raises(ScheduleError, match="more than"):
        b.send(Slot(DATA, 0, 0), 1)
    b.recv(Slot(DATA, 0, 0), 1)  # the other direction has its own counter


def test_scratch_grows_to_largest_declaration() -> None:
    b = builder()
    b.scratch("t", 2)
    b.scratch("t", 5)
    b.scratch("t", 3)
    assert b.build().scratch_sizes == {"t": 5}


# -- allreduce ---------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", alg.ALLREDUCE_ALGORITHMS)
@pytest.mark.parametrize("n", SMALL_SIZES)
def test_allreduce_small_groups(algorithm: str, n: int) -> None:
    for count in small_counts(n):
        for op in OPS_TESTED:
            verify_collective("allreduce", tuple(range(n)), count, op, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", alg.ALLREDUCE_ALGORITHMS)
@pytest.mark.parametrize("n", [32, 64])
def test_allreduce_large_groups(algorithm: str, n: int) -> None:
    for count in (1, n + 5, 3 * n):
        for op in OPS_TESTED:
            verify_collective("allreduce", tuple(range(n)), count, op, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", alg.ALLREDUCE_ALGORITHMS)
@pytest.mark.parametrize("op", ["max", "min", "prod"])
def test_allreduce_other_ops(algorithm: str, op: str) -> None:
    for n in (2, 3, 6, 8):
        verify_collective("allreduce", tuple(range(n)), 11, op, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", alg.ALLREDUCE_ALGORITHMS)
def test_allreduce_shifting_groups(algorithm: str) -> None:
    """Non-contiguous global ranks, as shifting groups produce them."""
    verify_collective("allreduce", (3, 11, 19, 27), 10, "avg", algorithm=algorithm)
    for size, gsize, step in [(32, 4, 1), (32, 4, 2), (12, 5, 1), (7, 4, 1), (40, 6, 1)]:
        for group in partition(size, gsize, step)[:3]:
            verify_collective("allreduce", group, 2 * len(group) + 1, "avg",
                              algorithm=algorithm)


@pytest.mark.parametrize("algorithm", alg.ALLREDUCE_ALGORITHMS)
def test_allreduce_group_order_need_not_be_sorted(algorithm: str) -> None:
    verify_collective("allreduce", (9, 2, 5), 7, "sum", algorithm=algorithm)


def test_group_of_one_is_empty() -> None:
    for name in alg.ALLREDUCE_ALGORITHMS:
        assert alg.compile_allreduce(4, (4,), 10, "avg", name).ops == ()
    for name in alg.BROADCAST_ALGORITHMS:
        assert alg.compile_broadcast(4, (4,), 10, 4, name).ops == ()
    assert alg.compile_barrier(4, (4,)).ops == ()


def _messages(s: Schedule) -> list[Send | Recv]:
    return [op for op in s.ops if isinstance(op, (Send, Recv))]


def _message_pattern(s: Schedule) -> list[tuple[str, int, int]]:
    return [(type(op).__name__, op.peer, op.msg) for op in _messages(s)]


CHUNKED = [("allreduce", "rabenseifner"), ("allreduce", "ring"),
           ("broadcast", "scatter_allgather")]


@pytest.mark.parametrize("collective,algorithm", CHUNKED, ids=[a for _, a in CHUNKED])
def test_empty_chunks_travel_so_message_numbers_never_depend_on_the_count(
        collective: str, algorithm: str) -> None:
    """Which messages a rank exchanges, with which numbers, is the same for any
    count > 0: a rank whose count differs from its peers' (a user error)
    cannot match a peer's *next* chunk; its chunk sizes differ instead, and
    the receive's size check names it (tests/mpi/test_errors.py)."""
    extra = {"root": 1} if collective == "broadcast" else {"op": "sum"}

    def schedules(n: int, count: int) -> tuple[Schedule, ...]:
        return alg.compile_group(collective, tuple(range(n)), count, algorithm=algorithm,
                                 **extra)

    for n in (3, 4, 5, 8):
        reference = [_message_pattern(s) for s in schedules(n, 4 * n + 3)]
        for count in (1, 2, n - 1, n, n + 1):
            assert [_message_pattern(s) for s in schedules(n, count)] == reference, (n, count)
        # count 1 over n >= 3 ranks: some chunks are empty, and they travel
        assert any((op.src if isinstance(op, Send) else op.dst).count == 0
                   for s in schedules(n, 1) for op in _messages(s))


def test_message_numbers_are_contiguous_per_peer() -> None:
    for name in alg.ALLREDUCE_ALGORITHMS:
        for s in alg.compile_group("allreduce", tuple(range(7)), 30, "avg", algorithm=name):
            seen: dict[tuple[str, int], list[int]] = {}
            for op in _messages(s):
                seen.setdefault((type(op).__name__, op.peer), []).append(op.msg)
            assert all(v == list(range(len(v))) for v in seen.values())


def test_native_allreduce_is_one_call_plus_scale() -> None:
    s = alg.compile_allreduce(11, (3, 11, 19), 6, "avg", "native")
    assert s.ops == (Native("allreduce", Slot(DATA, 0, 6), "sum", (3, 11, 19)),
                     Scale(Slot(DATA, 0, 6), 3))
    assert s.deps == ((), (0,))


def test_ring_scales_only_the_owned_chunk() -> None:
    s = alg.compile_allreduce(0, (0, 1, 2, 3), 8, "avg", "ring")
    scales = [op for op in s.ops if isinstance(op, Scale)]
    assert scales == [Scale(Slot(DATA, 2, 2), 4)]


def test_recursive_doubling_receives_can_be_posted_early() -> None:
    """Alternating receive buffers: receive k+1 waits for the reduce of k-1 only."""
    s = alg.compile_allreduce(0, tuple(range(8)), 4, "sum", "recursive_doubling")
    recvs = [i for i, op in enumerate(s.ops) if isinstance(op, Recv)]
    reduces = [i for i, op in enumerate(s.ops) if isinstance(op, Reduce)]
    assert s.deps[recvs[1]] == ()
    assert s.deps[recvs[2]] == (reduces[0],)


# -- broadcast and barrier ---------------------------------------------------------
@pytest.mark.parametrize("algorithm", alg.BROADCAST_ALGORITHMS)
@pytest.mark.parametrize("n", list(range(1, 11)))
def test_broadcast_every_root(algorithm: str, n: int) -> None:
    ranks = tuple(range(100, 100 + 3 * n, 3))
    for root in ranks:
        for count in sorted({0, 1, n, 2 * n + 3}):
            verify_collective("broadcast", ranks, count, root=root, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", alg.BROADCAST_ALGORITHMS)
def test_broadcast_larger_groups(algorithm: str) -> None:
    for n in (13, 17, 32, 64):
        for root in (0, n // 2, n - 1):
            verify_collective("broadcast", tuple(range(n)), 2 * n + 1, root=root,
                              algorithm=algorithm)


def test_scatter_allgather_root_receives_nothing() -> None:
    for s in alg.compile_group("broadcast", tuple(range(6)), 20, root=2,
                               algorithm="scatter_allgather"):
        if s.rank == 2:
            assert not any(isinstance(op, Recv) for op in s.ops)


@pytest.mark.parametrize("n", list(range(1, 18)) + [32, 33, 64])
def test_barrier(n: int) -> None:
    verify_collective("barrier", tuple(range(n)))
    rounds = (n - 1).bit_length()
    assert all(len(s.ops) == 2 * rounds for s in alg.compile_group("barrier", tuple(range(n))))


# -- arguments and choices ---------------------------------------------------------
def test_unknown_algorithm() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        alg.compile_allreduce(0, (0, 1), 4, "sum", "bogus")
    assert info.value.argument == "algorithm"
    with pytest.raises(InvalidArgumentError):
        alg.compile_broadcast(0, (0, 1), 4, 0, "ring")
    with pytest.raises(InvalidArgumentError):
        alg.compile_group("barrier", (0, 1), algorithm="ring")


@pytest.mark.parametrize("call,argument", [
    (lambda: alg.compile_broadcast(0, (0, 1), 4, 5, "binomial"), "root"),
    (lambda: alg.compile_allreduce(3, (0, 1), 4, "sum", "ring"), "rank"),
    (lambda: alg.compile_allreduce(0, (0, 1), 4, "mean", "ring"), "op"),
    (lambda: alg.compile_allreduce(0, (0, 1), -1, "sum", "ring"), "count"),
    (lambda: alg.compile_allreduce(0, (0, 0), 4, "sum", "ring"), "ranks"),
    (lambda: alg.compile_group("gather", (0, 1), 4), "collective"),
])
def test_bad_arguments(call: Callable[[], object], argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        call()
    assert info.value.argument == argument


def test_compiled_schedules_are_cached() -> None:
    a = alg.compile_allreduce(1, (0, 1, 2), 9, "avg", "ring")
    assert alg.compile_allreduce(1, (0, 1, 2), 9, "avg", "ring") is a


def test_choices_follow_the_crossovers() -> None:
    x = alg.ALLREDUCE_CROSSOVER_BYTES
    assert alg.choose_allreduce(x - 1, 8) == "recursive_doubling"
    assert alg.choose_allreduce(x, 8) == "rabenseifner"
    assert alg.choose_allreduce(10 * x, 1) == "recursive_doubling"
    y = alg.BROADCAST_CROSSOVER_BYTES
    assert alg.choose_broadcast(y - 1, 8) == "binomial"
    assert alg.choose_broadcast(y, 8) == "scatter_allgather"
    assert alg.choose_broadcast(10 * y, 2) == "binomial"
    for name in (alg.choose_allreduce(1, 4), alg.choose_allreduce(10 * x, 4)):
        assert name in alg.ALLREDUCE_ALGORITHMS


def test_chunk_offsets_are_even() -> None:
    assert alg.chunk_offsets(10, 4) == (0, 3, 6, 8, 10)
    assert alg.chunk_offsets(2, 4) == (0, 1, 2, 2, 2)
    assert alg.chunk_offsets(0, 3) == (0, 0, 0, 0)


# -- running the schedules on numbers ----------------------------------------------
_NUMPY_OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


class Simulator:
    """Runs every rank's ops in program order (one valid order, since deps point
    backwards) with buffered sends, on NumPy arrays; independent of the verifier."""

    def __init__(self, schedules: tuple[Schedule, ...], inputs: dict[int, np.ndarray]) -> None:
        self.scheds = {s.rank: s for s in schedules}
        self.mem = {s.rank: {DATA: inputs[s.rank].copy(),
                             **{n: _garbage(inputs[s.rank].dtype, c) for n, c in s.scratch}}
                    for s in schedules}
        self.pc = {s.rank: 0 for s in schedules}
        self.mailbox: dict[tuple[int, int, int], np.ndarray] = {}

    def run(self) -> dict[int, np.ndarray]:
        while any([self._step(rank) for rank in self.scheds]):
            pass
        assert all(self.pc[r] == len(s.ops) for r, s in self.scheds.items()), "deadlocked"
        assert not self.mailbox
        return {r: m[DATA] for r, m in self.mem.items()}

    def _current(self, rank: int) -> Op | None:
        ops = self.scheds[rank].ops
        return ops[self.pc[rank]] if self.pc[rank] < len(ops) else None

    def _view(self, rank: int, slot: Slot) -> np.ndarray:
        return self.mem[rank][slot.buf][slot.offset:slot.end]

    def _step(self, rank: int) -> bool:
        """Run ``rank``'s next op if it can run now."""
        op = self._current(rank)
        if op is None:
            return False
        if isinstance(op, Native):
            return self._native(op)
        if isinstance(op, Recv):
            key = (op.peer, rank, op.msg)
            if key not in self.mailbox:
                return False
            self._view(rank, op.dst)[:] = self.mailbox.pop(key)
        elif isinstance(op, Send):
            self.mailbox[(rank, op.peer, op.msg)] = self._view(rank, op.src).copy()
        else:
            _run_local(op, self._view(rank, op.dst),
                       self._view(rank, op.src) if isinstance(op, (Reduce, Copy)) else None)
        self.pc[rank] += 1
        return True

    def _native(self, op: Native) -> bool:
        """Run once every member has reached its Native op."""
        calls = [(r, self._current(r)) for r in op.ranks]
        views = {r: self._view(r, c.buf) for r, c in calls if isinstance(c, Native)}
        if len(views) < len(calls):
            return False
        if op.kind == "broadcast":
            out = views[op.root].copy()
        else:
            out = functools.reduce(_NUMPY_OPS["sum" if op.op == "avg" else op.op],
                                   [views[r] for r in op.ranks])
            if op.op == "avg":
                out = out / out.dtype.type(len(op.ranks))
        for r, v in views.items():
            v[:] = out
            self.pc[r] += 1
        return True


def _garbage(dtype: np.dtype, count: int) -> np.ndarray:
    """Scratch starts as garbage, so reading it unwritten shows in the result."""
    fill = np.nan if dtype.kind == "f" else np.iinfo(dtype).min
    return np.full(count, fill, dtype)


def _run_local(op: Op, dst: np.ndarray, src: np.ndarray | None) -> None:
    if isinstance(op, Reduce):
        dst[:] = _NUMPY_OPS[op.op](dst, src)
    elif isinstance(op, Scale):
        dst[:] = dst / dst.dtype.type(op.divisor) if dst.dtype.kind == "f" else dst // op.divisor
    else:
        dst[:] = src


def simulate(schedules: tuple[Schedule, ...],
             inputs: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    return Simulator(schedules, inputs).run()


@pytest.mark.parametrize("algorithm", alg.ALLREDUCE_ALGORITHMS)
def test_allreduce_numbers_are_bitwise_identical(algorithm: str) -> None:
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 5, 6, 8, 11):
        ranks = tuple(range(2, 2 + 2 * n, 2))
        for count in (1, n - 1 or 1, 3 * n + 1):
            inputs = {r: rng.standard_normal(count).astype(np.float32) * 1e3 for r in ranks}
            out = simulate(alg.compile_group("allreduce", ranks, count, "avg",
                                             algorithm=algorithm), inputs)
            first = out[ranks[0]]
            assert all(o.tobytes() == first.tobytes() for o in out.values())
            want = np.mean(np.stack([inputs[r].astype(np.float64) for r in ranks]), axis=0)
            np.testing.assert_allclose(first, want, rtol=1e-4, atol=1e-2)
            ints = {r: rng.integers(-1000, 1000, count) for r in ranks}
            got = simulate(alg.compile_group("allreduce", ranks, count, "sum",
                                             algorithm=algorithm), ints)
            assert all((g == sum(ints.values())).all() for g in got.values())


@pytest.mark.parametrize("algorithm", alg.BROADCAST_ALGORITHMS)
def test_broadcast_numbers(algorithm: str) -> None:
    rng = np.random.default_rng(8)
    for n in (1, 2, 3, 5, 7, 8):
        ranks = tuple(range(n))
        for root in ranks:
            inputs = {r: rng.integers(0, 1 << 30, 2 * n + 1) for r in ranks}
            out = simulate(alg.compile_group("broadcast", ranks, 2 * n + 1, root=root,
                                             algorithm=algorithm), inputs)
            assert all((o == inputs[root]).all() for o in out.values())


# -- property ----------------------------------------------------------------------
@st.composite
def collectives(draw: st.DrawFn) -> tuple[str, tuple[int, ...], int, str, int, str]:
    size = draw(st.integers(1, 40))
    gsize = draw(st.integers(1, size))
    step = draw(st.integers(0, 5))
    group = group_of(draw(st.integers(0, size - 1)), size, gsize, step)
    count = draw(st.integers(0, 3 * len(group) + 5))
    kind = draw(st.sampled_from(["allreduce", "allreduce", "broadcast", "barrier"]))
    if kind == "allreduce":
        return (kind, group, count, draw(st.sampled_from(["sum", "avg", "max", "prod"])),
                -1, draw(st.sampled_from(alg.ALLREDUCE_ALGORITHMS)))
    if kind == "broadcast":
        return (kind, group, count, "", draw(st.sampled_from(group)),
                draw(st.sampled_from(alg.BROADCAST_ALGORITHMS)))
    return kind, group, 0, "", -1, "dissemination"


@settings(max_examples=60, deadline=None)
@given(collectives())
def test_property_every_compiled_group_verifies(
        case: tuple[str, tuple[int, ...], int, str, int, str]) -> None:
    kind, group, count, op, root, name = case
    verify(alg.compile_group(kind, group, count, op, root, name))


@pytest.mark.parametrize("call,argument", [
    (lambda: alg.compile_allreduce(0, (0, 1), 4.0, "sum", "ring"), "count"),
    (lambda: alg.compile_allreduce(0, (0, 1), True, "sum", "ring"), "count"),
    (lambda: alg.compile_allreduce(1.0, (0, 1), 4, "sum", "ring"), "rank"),
    (lambda: alg.compile_broadcast(0, (0, 1), 4, 1.0, "binomial"), "root"),
    (lambda: alg.compile_broadcast(0, (0, 1), 4, True, "binomial"), "root"),
    (lambda: alg.compile_barrier(True, (0, 1)), "rank"),
])
def test_mistyped_arguments_are_rejected_even_after_a_cached_compile(
        call: Callable[[], object], argument: str) -> None:
    """``4.0 == 4`` and ``True == 1`` hash alike: an untyped compile cache handed
    back the well-typed call's schedule without validating, so whether a bad
    argument raised depended on what had been compiled before."""
    alg.compile_allreduce(0, (0, 1), 4, "sum", "ring")  # the well-typed twins, cached
    alg.compile_allreduce(0, (0, 1), 1, "sum", "ring")
    alg.compile_allreduce(1, (0, 1), 4, "sum", "ring")
    alg.compile_broadcast(0, (0, 1), 4, 1, "binomial")
    alg.compile_barrier(1, (0, 1))
    with pytest.raises(InvalidArgumentError) as info:
        call()
    assert info.value.argument == argument


@pytest.mark.parametrize("ranks", [(0.0, 1.0), (False, True), [0, 1]],
                         ids=["float", "bool", "list"])
def test_a_group_of_non_int_ranks_is_refused_whatever_was_compiled_before(
        ranks: object) -> None:
    """``(0.0, 1.0) == (False, True) == (0, 1)``, hashing alike, and a typed
    cache types the arguments, not a tuple's members: once ``(0, 1)`` was
    compiled such a group got its schedule back unchecked, and the member
    check (cached per group the same way) let a miss build sends to
    ``peer=0.0``, cached for the next well-typed call. A list raised a bare
    ``TypeError: unhashable type``."""
    count = 7919  # compiled by no other test
    for name in ("recursive_doubling", "ring"):
        alg.compile_allreduce(0, (0, 1), count, "sum", name)  # the int twin, cached
        for rank in (0, 1):
            with pytest.raises(InvalidArgumentError) as info:
                alg.compile_allreduce(rank, ranks, count, "sum", name)  # type: ignore[arg-type]
            assert info.value.argument == "ranks"
        good = alg.compile_allreduce(1, (0, 1), count, "sum", name)
        assert all(type(op.peer) is int for op in good.ops if isinstance(op, (Send, Recv)))
    alg.compile_broadcast(0, (0, 1), count, 0, "binomial")
    alg.compile_barrier(0, (0, 1))
    alg.compile_exchange(0, (0, 1), count)
    for call in (lambda: alg.compile_broadcast(0, ranks, count, 0, "binomial"),
                 lambda: alg.compile_barrier(0, ranks),
                 lambda: alg.compile_exchange(0, ranks, count)):
        with pytest.raises(InvalidArgumentError) as info:
            call()  # type: ignore[arg-type]
        assert info.value.argument == "ranks"


@pytest.mark.parametrize("neighbours", [(1.0,), (True,), [1]], ids=["float", "bool", "list"])
def test_non_int_neighbours_are_refused_whatever_was_compiled_before(
        neighbours: object) -> None:
    """As for ``ranks``: ``(1.0,)`` got ``(1,)``'s cached schedule, or on a
    miss a schedule sending to ``peer=1.0``."""
    alg.compile_neighbor_average(0, (0, 1, 2), 5, (1,))
    with pytest.raises(InvalidArgumentError) as info:
        alg.compile_neighbor_average(0, (0, 1, 2), 5, neighbours)  # type: ignore[arg-type]
    assert info.value.argument == "neighbours"
    with pytest.raises(InvalidArgumentError) as info:
        alg.compile_neighbor_average(0, (0, 1, 2), 6, neighbours)  # type: ignore[arg-type]
    assert info.value.argument == "neighbours"


@pytest.mark.parametrize("call,argument", [
    (lambda: alg.compile_group("allreduce", (0, 1), "8", "sum"), "count"),
    (lambda: alg.compile_group("broadcast", (0, 1), None, "", 0), "count"),
    (lambda: alg.compile_group("allreduce", 4, 8, "sum"), "ranks"),
    (lambda: alg.compile_allreduce(0, (0, 1), 8, "sum", ["ring"]), "algorithm"),
])
def test_compile_group_bad_arguments_are_typed_errors(call: Callable[[], object],
                                                      argument: str) -> None:
    """The default algorithm was chosen from ``4 * count`` before the count
    was checked (``"8" * 4 < 65536``: a bare TypeError), a non-iterable group
    failed in ``tuple()``, and an unhashable algorithm in the compile cache."""
    with pytest.raises(InvalidArgumentError) as info:
        call()
    assert info.value.argument == argument
