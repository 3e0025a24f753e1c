"""Bad input, mismatches and timeouts under a real MPI job."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

import wagma_comm
from wagma_comm import Communicator
from wagma_comm.comm import INLINE_MAX_BYTES

from conftest import message_path, up_to_4_ranks

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def _readonly() -> np.ndarray:
    a = np.ones(4, dtype=np.float32)
    a.flags.writeable = False
    return a


class _FakeCuda:
    """Says it lives on CUDA device 0 (DLPack device type 2) while no GPU
    transport exists: it must be refused before anyone asks for its memory."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("exported although it should have been refused")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)


class _BrokenExporter(_FakeCuda):
    """A DLPack exporter whose device query itself fails."""

    def __dlpack_device__(self) -> tuple[int, int]:
        raise RuntimeError("device query failed")


def _misaligned(dtype: Any = np.float32, n: int = 4) -> np.ndarray:
    """A writable, C-contiguous array one byte off its element alignment."""
    size = np.dtype(dtype).itemsize
    a = np.frombuffer(bytearray(n * size + 1), dtype=dtype, offset=1, count=n)
    assert not a.flags.aligned and a.flags.writeable and a.flags.c_contiguous
    return a


def _bf16(n: int) -> np.ndarray:
    import ml_dtypes

    return np.ones(n, dtype=ml_dtypes.bfloat16)


F32 = np.ones(4, dtype=np.float32)
BAD_INPUTS: list[tuple[str, Callable[[Communicator], Any], type, str]] = [
    ("no dlpack", lambda c: c.allreduce([1.0, 2.0]), wagma_comm.BufferError, "buf"),
    ("strided", lambda c: c.allreduce(np.ones(8, np.float32)[::2]), wagma_comm.BufferError, "buf"),
    ("read-only", lambda c: c.allreduce(_readonly()), wagma_comm.BufferError, "buf"),
    ("empty", lambda c: c.allreduce(np.ones(0, np.float32)), wagma_comm.BufferError, "buf"),
    ("dtype", lambda c: c.allreduce(np.ones(4, np.complex64)), wagma_comm.BufferError, "buf"),
    ("op", lambda c: c.allreduce(F32, "mean"), wagma_comm.InvalidArgumentError, "op"),
    ("op type", lambda c: c.allreduce(F32, 3), wagma_comm.InvalidArgumentError, "op"),
    ("algorithm", lambda c: c.allreduce(F32, algorithm="tree9"),
     wagma_comm.InvalidArgumentError, "algorithm"),
    ("timeout 0", lambda c: c.allreduce(F32, timeout=0), wagma_comm.InvalidArgumentError,
     "timeout"),
    ("timeout nan", lambda c: c.barrier(timeout=float("nan")),
     wagma_comm.InvalidArgumentError, "timeout"),
    ("group_size 0", lambda c: c.group_allreduce(F32, 0, 0), wagma_comm.InvalidArgumentError,
     "group_size"),
    ("group_size > P", lambda c: c.group_allreduce(F32, SIZE + 1, 0),
     wagma_comm.InvalidArgumentError, "group_size"),
    ("step < 0", lambda c: c.group_allreduce(F32, 1, -1), wagma_comm.InvalidArgumentError,
     "step"),
    ("root", lambda c: c.broadcast(F32, root=SIZE), wagma_comm.InvalidArgumentError, "root"),
    ("root type", lambda c: c.broadcast(F32, root="0"), wagma_comm.InvalidArgumentError, "root"),
    ("groups size", lambda c: c.groups(0, 0), wagma_comm.InvalidArgumentError, "group_size"),
    # huge count: 2**40 elements that do not exist (stride 0, read-only view)
    ("huge broadcast_to", lambda c: c.allreduce(np.broadcast_to(np.ones(1, np.float32),
                                                                (2 ** 40,))),
     wagma_comm.BufferError, "buf"),
    ("transposed 2-D", lambda c: c.allreduce(np.ones((3, 4), np.float32).T),
     wagma_comm.BufferError, "buf"),
    ("bool dtype", lambda c: c.allreduce(np.ones(4, np.bool_)), wagma_comm.BufferError, "buf"),
    ("cuda without GPU transport", lambda c: c.allreduce(_FakeCuda()),
     wagma_comm.UnsupportedError, "buf"),
    ("device query fails", lambda c: c.broadcast(_BrokenExporter()),
     wagma_comm.BufferError, "buf"),
    ("native bfloat16 max", lambda c: c.allreduce(_bf16(4), "max", algorithm="native"),
     wagma_comm.UnsupportedError, "algorithm"),
    ("broadcast algorithm", lambda c: c.broadcast(F32, algorithm="ring"),
     wagma_comm.InvalidArgumentError, "algorithm"),
    ("group op", lambda c: c.group_allreduce(F32, 1, 0, op="median"),
     wagma_comm.InvalidArgumentError, "op"),
    ("group_size < 0", lambda c: c.group_allreduce(F32, -2, 0),
     wagma_comm.InvalidArgumentError, "group_size"),
    ("group_size float", lambda c: c.group_allreduce(F32, 1.0, 0),
     wagma_comm.InvalidArgumentError, "group_size"),
    ("step float", lambda c: c.group_allreduce(F32, 1, 0.5), wagma_comm.InvalidArgumentError,
     "step"),
    ("step bool", lambda c: c.group_allreduce(F32, 1, True), wagma_comm.InvalidArgumentError,
     "step"),
    ("groups step", lambda c: c.groups(1, -3), wagma_comm.InvalidArgumentError, "step"),
    ("group_of rank", lambda c: c.group_of(1, 0, rank=SIZE), wagma_comm.InvalidArgumentError,
     "rank"),
    ("group_of rank < 0", lambda c: c.group_of(1, 0, rank=-1),
     wagma_comm.InvalidArgumentError, "rank"),
    ("timeout inf", lambda c: c.allreduce(F32, timeout=float("inf")),
     wagma_comm.InvalidArgumentError, "timeout"),
    ("timeout bool", lambda c: c.broadcast(F32, timeout=True),
     wagma_comm.InvalidArgumentError, "timeout"),
    ("timeout < 0", lambda c: c.group_allreduce(F32, 1, 0, timeout=-1.0),
     wagma_comm.InvalidArgumentError, "timeout"),
    ("timeout str", lambda c: c.barrier(timeout="5"), wagma_comm.InvalidArgumentError,
     "timeout"),
    ("init timeout", lambda c: wagma_comm.init(timeout=0.0), wagma_comm.InvalidArgumentError,
     "timeout"),
    ("root < 0", lambda c: c.broadcast(F32, root=-1), wagma_comm.InvalidArgumentError, "root"),
    # persistent collectives: refused before their collective set-up starts
    ("sync_every < 0", lambda c: c.solo_allreduce(np.zeros(2), -3),
     wagma_comm.InvalidArgumentError, "sync_every"),
    ("sync_every bool", lambda c: c.wait_avoiding_group_allreduce(np.zeros(2), 1, True),
     wagma_comm.InvalidArgumentError, "sync_every"),
    ("wagma group_size 0", lambda c: c.wait_avoiding_group_allreduce(np.zeros(2), 0, 2),
     wagma_comm.InvalidArgumentError, "group_size"),
    ("activation type", lambda c: c.wait_avoiding_group_allreduce(
        np.zeros(2), 1, 2, activation=None), wagma_comm.InvalidArgumentError, "activation"),
    ("normalization case", lambda c: c.wait_avoiding_group_allreduce(
        np.zeros(2), 1, 2, normalization="WAGMA"), wagma_comm.InvalidArgumentError,
     "normalization"),
    ("wagma cuda without GPU transport", lambda c: c.wait_avoiding_group_allreduce(
        _FakeCuda(), 1, 2), wagma_comm.UnsupportedError, "buf"),
    ("solo cuda without GPU transport", lambda c: c.solo_allreduce(_FakeCuda(), 2),
     wagma_comm.UnsupportedError, "buf"),
    ("majority cuda without GPU transport", lambda c: c.majority_allreduce(_FakeCuda(), 2),
     wagma_comm.UnsupportedError, "buf"),
    ("persistent read-only", lambda c: c.majority_allreduce(_readonly(), 2),
     wagma_comm.BufferError, "buf"),
    ("persistent timeout nan", lambda c: c.solo_allreduce(np.zeros(2), 2,
                                                           timeout=float("nan")),
     wagma_comm.InvalidArgumentError, "timeout"),
    # one byte off: MPI cannot send it (it broke the communicator on the message path)
    ("misaligned", lambda c: c.allreduce(_misaligned()), wagma_comm.BufferError, "buf"),
    ("misaligned float64 group", lambda c: c.group_allreduce(_misaligned(np.float64), 1, 0),
     wagma_comm.BufferError, "buf"),
    ("misaligned broadcast", lambda c: c.broadcast(_misaligned(np.int32)),
     wagma_comm.BufferError, "buf"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_refused_locally_and_engine_survives(comm: Communicator, case: Any) -> None:
    _, call, exc, argument = case
    before = comm.statistics()["completed"]
    with pytest.raises(exc) as info:
        call(comm)
    assert info.value.argument == argument
    assert comm.statistics()["completed"] == before  # nothing was communicated
    a = np.full(3, RANK + 1.0)
    comm.allreduce(a)  # the next valid collective still works
    assert a[0] == SIZE * (SIZE + 1) / 2


def test_a_misaligned_buffer_is_refused_on_the_message_path_and_on_the_fast_path() -> None:
    """A NumPy view one byte off its element alignment (np.frombuffer at an
    offset): on the message path MPI was handed it as a typed buffer that
    mpi4py cannot map, and the first collective raised TransportError and
    broke the communicator. Now every entry point refuses it before any
    message, also once an aligned call of the same dtype and shape has been
    remembered for the small-message path, and the communicator goes on."""
    with message_path():
        c = wagma_comm.init(timeout=30)
    try:
        calls: list[Callable[[np.ndarray], Any]] = [
            lambda b: c.allreduce(b, "sum"),
            lambda b: c.group_allreduce(b, SIZE, 0, "sum"),
            lambda b: c.broadcast(b, root=SIZE - 1),
        ]
        for call in calls:
            for _ in range(2):  # the second call is remembered for the fast path
                good = np.full(4, RANK + 1.0, np.float32)
                call(good)
            before = c.statistics()["completed"]
            bad = _misaligned()
            bad[:] = RANK + 1.0
            with pytest.raises(wagma_comm.BufferError, match="aligned") as info:
                call(bad)
            assert info.value.argument == "buf"
            assert c.statistics()["completed"] == before  # nothing was communicated
        a = np.full(3, RANK + 1.0)
        c.allreduce(a)  # not broken
        assert a.tolist() == [SIZE * (SIZE + 1) / 2] * 3 and c.statistics()["broken"] is None
    finally:
        c.close()


def test_closed_communicator() -> None:
    c = wagma_comm.init(timeout=30)
    with c:
        c.barrier()
    assert c.closed
    with pytest.raises(wagma_comm.CommunicatorClosedError):
        c.allreduce(np.ones(2))
    c.close()  # idempotent


USE_AFTER_CLOSE: list[tuple[str, Callable[[Communicator], Any]]] = [
    ("allreduce", lambda c: c.allreduce(np.ones(2))),
    ("async allreduce", lambda c: c.allreduce(np.ones(2), async_op=True)),
    ("group_allreduce", lambda c: c.group_allreduce(np.ones(2), 1, 0)),
    ("broadcast", lambda c: c.broadcast(np.ones(2))),
    ("barrier", lambda c: c.barrier()),
    ("wait_avoiding_group_allreduce", lambda c: c.wait_avoiding_group_allreduce(
        np.ones(2), 1, 2)),
    ("solo_allreduce", lambda c: c.solo_allreduce(np.ones(2), 2)),
    ("majority_allreduce", lambda c: c.majority_allreduce(np.ones(2), 2)),
]


def test_every_entry_point_refuses_a_closed_communicator() -> None:
    """After close() every collective and every persistent collective's
    creation raises CommunicatorClosedError at once (nothing hangs), and so
    does a persistent collective created before the close."""
    c = wagma_comm.init(timeout=30)
    w = c.wait_avoiding_group_allreduce(np.zeros(3), 1, sync_every=2)
    solo = c.solo_allreduce(np.zeros(3), sync_every=2, op="sum")
    for _ in range(2):  # up to and through a sync round: nothing left in flight
        w.step(np.ones(3))
        solo.step(np.ones(3))
    c.close()
    assert c.closed
    for name, call in USE_AFTER_CLOSE:
        with pytest.raises(wagma_comm.CommunicatorClosedError, match="closed"):
            call(c)
    for partial in (w, solo):
        with pytest.raises(wagma_comm.CommunicatorClosedError, match="closed"):
            partial.step(np.ones(3))
        with pytest.raises(wagma_comm.CommunicatorClosedError, match="closed"):
            partial.flush(np.ones(3))
        partial.close()  # released locally: the communicator is gone
        partial.close()


PERSISTENT: dict[str, Callable[[Communicator, np.ndarray], Any]] = {
    "wagma": lambda c, b: c.wait_avoiding_group_allreduce(b, 1, sync_every=3),
    "solo": lambda c, b: c.solo_allreduce(b, sync_every=3, op="sum"),
    "majority": lambda c, b: c.majority_allreduce(b, sync_every=3, seed=5, op="sum"),
}
STEP_BAD_INPUTS: list[tuple[str, Callable[[Any], Any], type, str]] = [
    ("step count", lambda p: p.step(np.zeros(5, np.float32)), wagma_comm.InvalidArgumentError,
     "buf"),
    ("step dtype", lambda p: p.step(np.zeros(4, np.float64)), wagma_comm.InvalidArgumentError,
     "buf"),
    ("step shape 4x2", lambda p: p.step(np.zeros((4, 2), np.float32)),
     wagma_comm.InvalidArgumentError, "buf"),
    ("step read-only", lambda p: p.step(_readonly()), wagma_comm.BufferError, "buf"),
    ("step strided", lambda p: p.step(np.zeros(8, np.float32)[::2]), wagma_comm.BufferError,
     "buf"),
    ("step list", lambda p: p.step([0.0] * 4), wagma_comm.BufferError, "buf"),
    ("async step dtype", lambda p: p.step(np.zeros(4, np.int32), async_op=True),
     wagma_comm.InvalidArgumentError, "buf"),
    ("flush dtype", lambda p: p.flush(np.zeros(4, np.int64)), wagma_comm.InvalidArgumentError,
     "buf"),
]


@pytest.mark.parametrize("kind", sorted(PERSISTENT))
def test_bad_step_input_is_refused_locally_and_the_collective_goes_on(
        comm: Communicator, kind: str) -> None:
    """A refused step consumes no round: the valid steps that follow line up
    with the other ranks' and give the exact results."""
    p = PERSISTENT[kind](comm, np.zeros(4, np.float32))
    for name, call, exc, argument in STEP_BAD_INPUTS:
        with pytest.raises(exc) as info:
            call(p)
        assert info.value.argument == argument, name
    assert p.statistics()["iteration"] == 0  # no round was consumed
    total = np.zeros(4, np.float32)
    for _ in range(3):  # rounds 0, 1 and the sync round 2
        g = np.full(4, 1.0, np.float32)
        info = p.step(g)
        total += g
    assert info.synchronized
    if kind == "wagma":  # every model is 1: group averages and the mean stay 1
        assert np.all(total == 3)
    else:  # sums: what reached a round plus the flush is every input, once
        final = np.zeros(4, np.float32)
        p.flush(final)
        assert np.all(total + final == 3 * SIZE)
    p.close()


NAN_MODES = ["inline", "engine", "async"]  # small blocking, large blocking, non-blocking


def _reduce_with_nan(comm: Communicator, dtype: str, op: str, mode: str,
                     algorithm: str | None = None) -> np.ndarray:
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    n = 40_000 if mode == "engine" else 6  # 40k elements: above the inline limit
    a = (np.arange(n) % 50 + RANK).astype(dtype)
    if RANK == SIZE - 1:
        a[2] = np.nan
    with pytest.raises(wagma_comm.InvalidArgumentError) as info:
        h = comm.allreduce(a, op, async_op=mode == "async", algorithm=algorithm)
        if mode == "async":
            h.wait()
    assert info.value.argument == "buf" and "NaN" in str(info.value)
    return a


@pytest.mark.parametrize("mode", NAN_MODES)
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_nan_with_max_min_raises_on_every_member_and_communicator_survives(
        comm: Communicator, dtype: str, op: str, mode: str) -> None:
    """One rank's NaN: the reduction completes on every rank with the same
    result bits (NaN where the NaN was, the true max/min elsewhere), then every
    rank raises; nothing is broken and the next collective is exact."""
    a = _reduce_with_nan(comm, dtype, op, mode)
    assert len(set(WORLD.allgather(a.tobytes()))) == 1  # bitwise the same everywhere
    values = a.astype(np.float64)
    assert np.isnan(values[2]) and not np.isnan(np.delete(values, 2)).any()
    base = np.arange(a.size) % 50
    expected = base + (SIZE - 1 if op == "max" else 0)
    assert np.array_equal(np.delete(values, 2), np.delete(expected, 2))
    assert comm.statistics()["broken"] is None
    b = np.full(3, RANK + 1.0)
    comm.allreduce(b)
    assert b[0] == SIZE * (SIZE + 1) / 2


@pytest.mark.parametrize("mode", NAN_MODES)
@pytest.mark.parametrize("algorithm", [None, "recursive_doubling"])
def test_a_result_refused_for_nan_counts_as_failed_on_every_path(
        comm: Communicator, mode: str, algorithm: str | None) -> None:
    """statistics(): a call whose result check raised is failed, not
    completed, whichever path ran it (inline, shared memory, engine,
    non-blocking); blocking inline and shared-memory calls counted it
    completed before."""
    before = comm.statistics()
    _reduce_with_nan(comm, "float32", "max", mode, algorithm)
    after = comm.statistics()
    assert (after["completed"] - before["completed"], after["failed"] - before["failed"]) \
        == (0, 1)


def test_nan_in_a_group_raises_on_that_group_only(comm: Communicator) -> None:
    group_size = min(2, SIZE)
    group = comm.group_of(group_size, 0)
    a = np.full(5, float(RANK), np.float32)
    if RANK == SIZE - 1:
        a[0] = np.nan
    if SIZE - 1 in group:
        with pytest.raises(wagma_comm.InvalidArgumentError, match="NaN") as info:
            comm.group_allreduce(a, group_size, 0, op="min")
        assert info.value.argument == "buf" and np.isnan(a[0])
    else:
        comm.group_allreduce(a, group_size, 0, op="min")
        assert not np.isnan(a).any()
    assert np.all(a[1:] == min(group))
    comm.barrier()


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_inf_with_max_min_is_ordered_and_accepted(comm: Communicator, dtype: str,
                                                  op: str) -> None:
    import ml_dtypes  # noqa: F401

    a = np.array([1.0, 2.0, -3.0, RANK], np.float64)
    if RANK == SIZE - 1:
        a[:2] = [np.inf, -np.inf]
    if RANK == 0:
        a[2] = -np.inf if op == "min" else np.inf
    a = a.astype(dtype)
    inputs = np.stack(WORLD.allgather(a.astype(np.float64)))
    comm.allreduce(a, op)
    expected = inputs.max(axis=0) if op == "max" else inputs.min(axis=0)
    assert np.array_equal(a.astype(np.float64), expected)
    assert np.isinf(a.astype(np.float64)).any()


def test_debug_reports_mismatched_calls_by_rank() -> None:
    if SIZE == 1:
        pytest.skip("a mismatch needs two ranks")
    with wagma_comm.init(timeout=30, debug=True) as c:
        count = 5 if RANK == 1 else 4
        with pytest.raises(wagma_comm.MismatchError) as info:
            c.allreduce(np.ones(count, np.float32))
        err = info.value
        assert err.collective == "allreduce" and err.round == 0
        if RANK == 1:
            assert err.ranks == tuple(r for r in range(SIZE) if r != 1)
        else:
            assert err.ranks == (1,)
            assert "count=5" in err.details[1]
        # a different collective at the same round is named too
        with pytest.raises(wagma_comm.MismatchError) as info:
            if RANK == 0:
                c.broadcast(np.ones(4, np.float32))
            else:
                c.allreduce(np.ones(4, np.float32))
        assert ("broadcast" in str(info.value)) and info.value.round == 1
        a = np.ones(4, np.float32)
        c.allreduce(a)  # the exchange completed, so the communicator is still good
        assert a[0] == SIZE


# What one rank (the last) passes differently, the call of the others, its,
# and what the fingerprint must name for it: every argument that changes
# the call (docs/usage.md, "Ranks that pass different counts": a dtype of
# the same size, a root, and the native algorithm escape the size check).
_DEBUG_MISMATCHES: dict[str, tuple[Callable[[Communicator], Any],
                                   Callable[[Communicator], Any], str]] = {
    "dtype": (lambda c: c.allreduce(np.ones(4, np.float32)),
              lambda c: c.allreduce(np.ones(4, np.int32)), "dtype=int32"),
    "op": (lambda c: c.allreduce(np.ones(4, np.float32), "sum"),
           lambda c: c.allreduce(np.ones(4, np.float32), "max"), "op=max"),
    "algorithm": (lambda c: c.allreduce(np.ones(4, np.float32), algorithm="ring"),
                  lambda c: c.allreduce(np.ones(4, np.float32), algorithm="native"),
                  "algorithm=native"),
    "root": (lambda c: c.broadcast(np.ones(4, np.float32), 0),
             lambda c: c.broadcast(np.ones(4, np.float32), SIZE - 1), f"root={SIZE - 1}"),
    "group_size": (lambda c: c.group_allreduce(np.ones(4, np.float32), SIZE, 0),
                   lambda c: c.group_allreduce(np.ones(4, np.float32), 1, 0),
                   "group_size=1"),
}


@pytest.mark.parametrize("what", list(_DEBUG_MISMATCHES))
def test_debug_names_a_rank_passing_another_dtype_op_algorithm_root_or_group(
        what: str) -> None:
    """Each way a call can differ is caught by the fingerprint exchange on
    every rank, before any data moves, and named: the other ranks name the
    last rank and what it called, the last rank names all others. The
    communicator stays usable."""
    if SIZE == 1:
        pytest.skip("a mismatch needs two ranks")
    theirs, mine, named = _DEBUG_MISMATCHES[what]
    with wagma_comm.init(timeout=30, debug=True) as c:
        sent = c.statistics()["messages_sent"]
        with pytest.raises(wagma_comm.MismatchError) as info:
            (mine if RANK == SIZE - 1 else theirs)(c)
        err = info.value
        if RANK == SIZE - 1:
            assert err.ranks == tuple(range(SIZE - 1)), err
        else:
            assert err.ranks == (SIZE - 1,), err
            assert named in err.details[SIZE - 1], err
        # only the fingerprints went out: one to every other rank
        assert c.statistics()["messages_sent"] - sent == SIZE - 1
        a = np.ones(4, np.float32)
        c.allreduce(a)
        assert a[0] == SIZE


CHUNKED = [("allreduce", "ring"), ("allreduce", "rabenseifner"),
           ("broadcast", "scatter_allgather")]


@pytest.mark.parametrize("straight", [True, False], ids=["straight-line", "dataflow"])
@pytest.mark.parametrize("collective, algorithm", CHUNKED, ids=[a for _, a in CHUNKED])
@up_to_4_ranks
def test_a_count_mismatch_with_empty_chunks_is_never_a_silent_result(
        monkeypatch: pytest.MonkeyPatch, collective: str, algorithm: str,
        straight: bool) -> None:
    """A count below the group size leaves chunks empty. Empty chunks used to
    send nothing, so a rank whose count differed from its peers' numbered its
    messages differently and could take a peer's *next* chunk of the same
    size: a 4-rank scatter_allgather broadcast of 4 elements, the last rank
    passing 3, returned [2. 3. 4.] there with no error. Empty chunks now
    travel as zero-byte messages, so every chunk's size is compared: the
    last rank (one element short: its last chunk is empty) never returns,
    and any rank that does holds the right values. These calls are small,
    so they run inline: each of the two inline executors is pinned."""
    if SIZE == 1:
        pytest.skip("a mismatch needs two ranks")
    from wagma_comm.runtime import engine as engine_mod

    monkeypatch.setattr(engine_mod, "STRAIGHT_LINES", straight)
    last = RANK == SIZE - 1
    count = SIZE - last
    if collective == "allreduce":
        buf = np.arange(1, count + 1, dtype=np.float32) * (RANK + 1)
        expected = np.arange(1, count + 1, dtype=np.float32) * (SIZE * (SIZE + 1) // 2)
    else:
        buf = np.arange(1, count + 1, dtype=np.float32) * (RANK == 0)
        expected = np.arange(1, count + 1, dtype=np.float32)
    with message_path():
        c = wagma_comm.init(timeout=3)
    try:
        try:
            if collective == "allreduce":
                c.allreduce(buf, algorithm=algorithm)
            else:
                c.broadcast(buf, root=0, algorithm=algorithm)
            outcome = ("done", bool(np.array_equal(buf, expected)), buf.tolist())
        except wagma_comm.WagmaError as err:
            outcome = (type(err).__name__, getattr(err, "ranks", None))
    finally:
        c.close()
    outcomes = WORLD.allgather(outcome)
    assert outcomes[SIZE - 1][0] != "done", outcomes
    assert all(o[1] for o in outcomes if o[0] == "done"), outcomes  # no wrong result
    assert any(o[0] == "MessageSizeError" for o in outcomes), outcomes


@pytest.mark.parametrize("path, mismatch", [
    ("straight-line", "count"), ("dataflow", "count"), ("executor", "count"),
    ("straight-line", "dtype"), ("dataflow", "dtype"), ("executor", "dtype")])
@up_to_4_ranks
def test_a_size_mismatch_on_the_message_path_is_never_a_silent_result(
        monkeypatch: pytest.MonkeyPatch, path: str, mismatch: str) -> None:
    """MPI accepts a message shorter than its receive without an error, so a
    rank whose buffer is larger than its peer's used to return a wrong
    result silently. Now every rank fails: a receiver of a message of the
    wrong size raises MessageSizeError naming the sender (shorter: the bytes
    it got; longer: MPI truncated it, received is None), and a rank waiting
    on a failed one times out. Each executor is checked: the straight line
    and the dataflow run of a small call (runtime/straight.py, inline.py),
    and the engine for a call too large to run inline."""
    if SIZE == 1:
        pytest.skip("a mismatch needs two ranks")
    from wagma_comm.runtime import engine as engine_mod

    monkeypatch.setattr(engine_mod, "STRAIGHT_LINES", path == "straight-line")
    count = INLINE_MAX_BYTES // 4 + 1 if path == "executor" else 5
    last = RANK == SIZE - 1
    if mismatch == "count":
        buf = np.ones(count + last, np.float32)
    else:  # the same count, elements of another size; an odd count: 20 bytes
        # received as float64 are no whole number of elements, which MPICH's
        # typed unpack aborts the job on (receives are posted as bytes)
        buf = np.ones(count, np.float64 if last else np.float32)
    expected_short = (count * 8, count * 4) if mismatch == "dtype" else ((count + 1) * 4, count * 4)
    with message_path():
        c = wagma_comm.init(timeout=3)
    try:
        outcome: tuple[Any, ...] = ("done",)
        try:
            c.allreduce(buf, algorithm="recursive_doubling")
        except wagma_comm.MessageSizeError as err:
            assert isinstance(err, wagma_comm.TransportError)  # what it was before
            assert err.collective == "allreduce" and err.round == 0
            outcome = ("size", err.ranks, err.expected, err.received)
        except wagma_comm.CollectiveTimeoutError as err:
            outcome = ("timeout", err.ranks)
        with pytest.raises(wagma_comm.CommunicatorClosedError):
            c.allreduce(np.ones(4, np.float32))  # broken: a peer may still wait for us
    finally:
        c.close()
    outcomes = WORLD.allgather(outcome)
    assert all(o[0] != "done" for o in outcomes), outcomes
    sized = {r: o for r, o in enumerate(outcomes) if o[0] == "size"}
    assert sized, outcomes
    if SIZE == 2:  # partners in every round: both see the other's message
        assert set(sized) == {0, 1}
    for r, (_, senders, expected, received) in sized.items():
        if r == SIZE - 1:  # a larger buffer than its peers': their message is short
            assert len(senders) == 1 and senders[0] != r
            assert (expected, received) == expected_short
        else:  # a smaller one: the last rank's message did not fit
            assert senders == (SIZE - 1,)
            assert (expected, received) == (expected_short[1], None)
    for o in outcomes:
        if o[0] == "timeout":
            assert o[1], "a timeout names the ranks it waited for"


@pytest.mark.parametrize("path", ["straight-line", "dataflow", "executor"])
def test_errors_name_the_call_made_not_its_schedule(monkeypatch: pytest.MonkeyPatch,
                                                    path: str) -> None:
    """A group_allreduce's size mismatch run inline was a MessageSizeError of
    "allreduce" (its schedule's name; the engine said group_allreduce), and a
    native broadcast that MPI failed was a TransportError naming no call at
    all ("MPI error: See the MPI_ERROR field in MPI_Status")."""
    from wagma_comm.runtime import engine as engine_mod

    if SIZE != 2:
        pytest.skip("rank-count independent: run at 2 ranks")
    monkeypatch.setattr(engine_mod, "STRAIGHT_LINES", path == "straight-line")
    count = INLINE_MAX_BYTES // 4 + 1 if path == "executor" else 5
    with message_path():
        c = wagma_comm.init(timeout=3)
    try:
        with pytest.raises((wagma_comm.MessageSizeError,
                            wagma_comm.CollectiveTimeoutError)) as info:
            c.group_allreduce(np.ones(count + RANK, np.float32), 2, 0,
                              algorithm="recursive_doubling")
        assert info.value.collective == "group_allreduce", info.value
    finally:
        c.close()
    with message_path():
        c = wagma_comm.init(timeout=3)
    try:
        outcome = "done"
        try:  # rank 1's receive is shorter than rank 0's message
            c.broadcast(np.ones(count * (2 - RANK), np.float32), 0, algorithm="native")
        except wagma_comm.TransportError as err:
            outcome = str(err)
    finally:
        c.close(cancel=True)
    if RANK == 1:
        assert outcome.startswith("broadcast (round 0): MPI error"), outcome


@pytest.mark.parametrize("root_is_last", [False, True], ids=["root-0", "root-last"])
@up_to_4_ranks
def test_a_broadcast_with_a_count_mismatch_never_returns_wrong_data(root_is_last: bool) -> None:
    """The last rank passes one element more. A broadcast has no reduction,
    so ranks whose messages all had their size get the root's data; the
    last rank, a reader, gets a short message and says so; as the root, its
    readers' receives are too small (truncated) and they say so."""
    if SIZE == 1:
        pytest.skip("a mismatch needs two ranks")
    root = SIZE - 1 if root_is_last else 0
    last = RANK == SIZE - 1
    buf = np.full(5 + last, RANK, np.float32)
    with message_path():
        c = wagma_comm.init(timeout=3)
    try:
        outcome: tuple[Any, ...]
        try:
            c.broadcast(buf, root=root)
            outcome = ("done", buf.tolist())
        except wagma_comm.MessageSizeError as err:
            outcome = ("size", err.ranks, err.expected, err.received)
        except wagma_comm.CollectiveTimeoutError as err:
            outcome = ("timeout", err.ranks)
    finally:
        c.close()
    outcomes = WORLD.allgather(outcome)
    for r, o in enumerate(outcomes):
        if o[0] == "done":
            assert o[1] == [float(root)] * (5 + (r == SIZE - 1)), (r, o)
        elif o[0] == "size":
            assert r != root and len(o[1]) == 1
            assert (o[2], o[3]) == ((24, 20) if r == SIZE - 1 else (20, None)), (r, o)
        else:
            assert o[1], "a timeout names the ranks it waited for"
    assert outcomes[root][0] == "done"  # the root only sends
    if not root_is_last:
        assert outcomes[SIZE - 1][0] == "size"  # its message was short
    else:  # every reader the root sends to directly
        assert any(o[0] == "size" for r, o in enumerate(outcomes) if r != root)


def test_the_mpi_transport_tells_short_and_long_messages_apart() -> None:
    """The pieces the size check stands on, on this rank alone (messages to
    itself over MPI_COMM_SELF): each test call reports a short message's
    length through its statuses (a test of some in completion order), and
    names the sender of a message longer than the receive."""
    from wagma_comm.transport.mpi import MPITransport

    transport = MPITransport(MPI.COMM_SELF, timeout=30)
    isend, irecv = transport.posters("data")
    three = np.arange(3, dtype=np.float32)
    try:
        for test in ("one", "some", "all"):
            got = np.zeros(4, np.float32)
            # received as bytes: 12 of them are no whole float64, and fine
            into = transport.receive_buffer(got.view(np.float64))
            requests = [isend(three, 0, 1), irecv(into, 0, 1)]
            statuses = transport.statuses(2)
            assert statuses is not None
            deadline = time.monotonic() + 10
            if test == "one":
                while not transport.test_one(requests[1], statuses[0]):
                    assert time.monotonic() < deadline
                assert transport.received_bytes(statuses[0]) == 12
                requests[0].Wait()
            elif test == "some":
                done: list[int] = []
                while len(done) < 2:
                    assert time.monotonic() < deadline
                    now = transport.test_some(requests, statuses)
                    if 1 in now:
                        assert transport.received_bytes(statuses[now.index(1)]) == 12
                    done += now
            else:
                while not transport.tester()(requests, statuses):
                    assert time.monotonic() < deadline
                assert transport.received_bytes(statuses[1]) == 12
            assert got.tolist() == [0, 1, 2, 0]
            # longer than the receive: MPI truncates, the error names the sender
            # (fresh statuses: the sender must come from the failed test)
            statuses = transport.statuses(2)
            assert statuses is not None
            small = np.zeros(2, np.float32)
            requests = [irecv(small, 0, 2), isend(three, 0, 2)]
            with pytest.raises(wagma_comm.TransportError) as info:
                while True:
                    assert time.monotonic() < deadline
                    if test == "one":
                        transport.test_one(requests[0], statuses[0])
                    elif test == "some":
                        transport.test_some(requests, statuses)
                    else:
                        try:  # the bare call: its caller translates
                            transport.tester()(requests, statuses)
                        except transport.raw_errors as exc:
                            raise transport.error_of(exc) from exc
            senders = transport.overlong(info.value, statuses)  # type: ignore[arg-type]
            assert [(sender, tag) for _, sender, tag in senders] == [(0, transport.tag(0, 2))]
            if test == "all":  # request order: the receive's own position
                assert senders[0][0] == 0
            requests[1].Wait()
        assert transport.overlong(wagma_comm.TransportError("not MPI's"), statuses) == []
    finally:
        transport.close()


def test_a_truncated_receive_is_named_by_its_tag_among_receives_from_one_sender() -> None:
    """Two receives from the same sender; the second gets a message longer
    than its buffer. The failed test's status carries the tag, which names
    that receive (the first completed receive from the sender used to be
    taken, so the size error could fail another collective's run)."""
    from wagma_comm.runtime.inline import overlong_receive
    from wagma_comm.transport.mpi import MPITransport

    transport = MPITransport(MPI.COMM_SELF, timeout=30)
    isend, irecv = transport.posters("data")
    three = np.arange(3, dtype=np.float32)
    try:
        sends = [isend(three, 0, transport.tag(7, 1)), isend(three, 0, transport.tag(8, 1))]
        fits, small = np.zeros(3, np.float32), np.zeros(2, np.float32)
        requests = [irecv(fits, 0, transport.tag(7, 1)), irecv(small, 0, transport.tag(8, 1))]
        statuses = transport.statuses(2)
        assert statuses is not None
        deadline = time.monotonic() + 10
        with pytest.raises(wagma_comm.TransportError) as info:
            while True:
                assert time.monotonic() < deadline
                transport.test_some(requests, statuses)
        receives = [(0, 0, transport.tag(7, 1)), (1, 0, transport.tag(8, 1))]
        assert overlong_receive(transport, info.value, statuses, receives) == 1
        assert fits.tolist() == [0, 1, 2]
        for req in sends:
            req.Wait()
    finally:
        transport.close()


@pytest.mark.parametrize("debug", [False, True])
def test_timeout_names_collective_round_and_missing_ranks(debug: bool) -> None:
    if SIZE == 1:
        pytest.skip("a missing rank needs two ranks")
    c = wagma_comm.init(timeout=30, debug=debug)
    c.barrier()  # round 0
    if RANK == 0:
        with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
            c.allreduce(np.ones(4, np.float32), timeout=0.5)
        err = info.value
        assert err.collective == "allreduce" and err.round == 1
        assert err.ranks and set(err.ranks) <= set(range(1, SIZE))
        if debug:  # the fingerprint exchange sees exactly who is missing
            assert err.ranks == tuple(range(1, SIZE))
        assert "allreduce (round 1)" in str(err)
        with pytest.raises(wagma_comm.CommunicatorClosedError, match="broken"):
            c.allreduce(np.ones(4, np.float32))
    WORLD.Barrier()
    c.close(cancel=True)


@pytest.mark.parametrize("what", ["init", "exchange"])
def test_a_duplication_some_rank_never_joins_times_out(what: str) -> None:
    """init() and the gossip baselines' set-up duplicate an MPI communicator,
    which waits for every rank: a rank that never joins makes the others raise
    CollectiveTimeoutError at the deadline instead of waiting forever. The
    abandoned duplication is kept and completes once the late rank joins."""
    if SIZE == 1:
        pytest.skip("a missing rank needs two ranks")
    import time

    from wagma_comm.train.neighbors import NeighborExchange
    from wagma_comm.transport import mpi as mpi_transport

    sub = WORLD.Dup()
    slow = SIZE - 1
    if RANK != slow:
        t0 = time.monotonic()
        with pytest.raises(wagma_comm.CollectiveTimeoutError, match="duplicating") as info:
            if what == "init":
                wagma_comm.init(timeout=0.3, mpi_comm=sub)
            else:
                NeighborExchange(sub, 0.3, "sgp exchange")  # no arrival check
        named = {"init": "init()", "exchange": "sgp exchange set-up"}[what]
        assert info.value.collective == named and time.monotonic() - t0 < 10.0
        dup, request = mpi_transport.ABANDONED.pop()
    WORLD.Barrier()
    if RANK == slow:  # joins late: the others' abandoned duplication completes
        dup, request = sub.Idup()
    request.Wait()
    dup.Free()
    sub.Free()


def _outcome_in_thread(call: Callable[[], Any], join_s: float,
                       what: str) -> tuple[BaseException | None, float]:
    """Run ``call`` on a daemon thread (a hang must not take the test run
    with it): what it raised (None if nothing) and how long it took."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 -- the test looks at it
            outcome.append(exc)
    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(join_s)
    assert not thread.is_alive(), f"{what} blocked past its timeout"
    return outcome[0], time.monotonic() - started


@up_to_4_ranks
def test_a_rank_whose_peers_gave_up_on_init_times_out_too() -> None:
    """The others' init() times out waiting for the late rank; it arrives
    after, while they still drive MPI, so its first duplication completes.
    Its next steps are collectives the others never call: it must raise
    CollectiveTimeoutError at its own deadline (it used to block in a
    blocking Dup for ever)."""
    if SIZE == 1:
        pytest.skip("a missing rank needs two ranks")

    from wagma_comm.transport import mpi as mpi_transport

    sub = WORLD.Dup()
    slow = SIZE - 1
    if RANK != slow:
        with pytest.raises(wagma_comm.CollectiveTimeoutError, match="duplicating"):
            wagma_comm.init(timeout=0.3, mpi_comm=sub)
        dup, request = mpi_transport.ABANDONED.pop()
    WORLD.Barrier()  # the others gave up before the late rank calls init()
    if RANK != slow:
        deadline = time.monotonic() + 20
        while not request.Test():  # driving MPI: the late rank's duplication completes
            assert time.monotonic() < deadline, "the late rank's duplication never came"
            time.sleep(1e-3)
    else:
        error, took = _outcome_in_thread(
            lambda: wagma_comm.init(timeout=2, mpi_comm=sub).close(), 20, "init()")
        assert took < 10
        assert isinstance(error, wagma_comm.CollectiveTimeoutError), error
        assert error.collective == "init()" and "gave up on init()" in str(error)
        # its abandoned second step: a duplication of what the first made
        dup, request = mpi_transport.ABANDONED.pop()
    WORLD.Barrier()
    if RANK != slow:  # the others join that step, so nothing stays pending
        dup, request = dup.Idup()
    request.Wait()
    dup.Free()
    sub.Free()


@up_to_4_ranks
def test_opening_channels_no_peer_joins_times_out() -> None:
    """A persistent collective's channels are duplicated on the progress
    thread once a barrier completed there; a peer whose barrier timed out
    just before never duplicates. The rank that got through must raise
    CollectiveTimeoutError within the communicator's timeout (it used to
    block in a blocking Dup for ever, its progress thread with it)."""
    if SIZE == 1:
        pytest.skip("a missing rank needs two ranks")
    from wagma_comm.transport import mpi as mpi_transport
    from wagma_comm.transport.mpi import MPITransport

    WORLD.Barrier()
    transport = MPITransport(WORLD, timeout=5)
    try:
        if RANK == 0:  # alone: the others stay away
            error, took = _outcome_in_thread(
                lambda: transport.open_channels(["p9.data"]), 30, "open_channels()")
            assert 4 < took < 20
            assert isinstance(error, wagma_comm.CollectiveTimeoutError), error
            assert "p9.data" in str(error) and "set-up of channels" in error.collective
            assert "p9.data" not in transport._comms
            dup, request = mpi_transport.ABANDONED.pop()
        WORLD.Barrier()
        if RANK != 0:  # join late, so that nothing stays pending
            dup, request = transport._comms["data"].Idup()
        request.Wait()
        dup.Free()
    finally:
        transport.close()


def test_close_frees_the_duplicate_init_made_first() -> None:
    from wagma_comm.transport import mpi as mpi_transport

    abandoned = len(mpi_transport.ABANDONED)
    with wagma_comm.init(timeout=30) as c:
        base = c._transport._base
        assert base != MPI.COMM_NULL and base.Get_size() == SIZE
    assert base == MPI.COMM_NULL  # mpi4py nulls a freed handle
    assert len(mpi_transport.ABANDONED) == abandoned


def test_exchange_bytes_shares_rank_0s_bytes_and_times_out_keeping_its_buffer() -> None:
    """The NCCL unique id's exchange (MPI only, so testable without a GPU):
    every rank gets rank 0's bytes; when rank 0 stays away the others raise a
    TimeoutError, their broadcast's request and buffer kept for MPI, and the
    bytes land there once rank 0 joins."""
    from wagma_comm.transport import mpi as mpi_transport

    with wagma_comm.init(timeout=30) as c:
        transport = c._transport
        payload = bytes(range(16)) if RANK == 0 else None
        assert transport.exchange_bytes(payload, 16, time.monotonic() + 30) == bytes(range(16))
        if SIZE == 1:
            return
        if RANK != 0:  # rank 0, the root, stays away
            with pytest.raises(TimeoutError, match="NCCL unique id"):
                transport.exchange_bytes(None, 16, time.monotonic() + 0.3)
            buf, request = mpi_transport.ABANDONED.pop()
            assert isinstance(buf, bytearray) and bytes(buf) == bytes(16)
        WORLD.Barrier()
        if RANK == 0:  # joins late: the others' abandoned broadcast completes
            assert transport.exchange_bytes(payload, 16, time.monotonic() + 30) == payload
        else:
            request.Wait()
            assert bytes(buf) == bytes(range(16))


def test_a_timeout_outside_any_round_names_no_round() -> None:
    """init(), channel set-up and the NCCL id exchange are no collective of
    a communicator (round -1): their timeouts name the call alone, where
    they used to say "(round -1)"."""
    from wagma_comm.transport.mpi import ABANDONED, wait_with_deadline

    comm = WORLD.Dup()
    request = comm.Irecv(bytearray(1), source=RANK, tag=7)  # nothing is ever sent
    try:
        with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
            wait_with_deadline(request, comm, time.monotonic() + 0.05, "init()", [RANK],
                               detail="duplicating the MPI communicator did not complete")
        assert ABANDONED.pop()[1] is request
        err = info.value
        assert err.collective == "init()" and err.round == -1 and err.ranks == (RANK,)
        assert str(err) == ("init(): duplicating the MPI communicator did not complete; "
                            f"ranks: [{RANK}]")
    finally:
        request.Cancel()
        request.Wait()
        comm.Free()
    named = wagma_comm.CollectiveTimeoutError("allreduce", 0, [1], "timed out")
    assert str(named) == "allreduce (round 0): timed out; ranks: [1]"




def test_debug_accepts_groups_of_different_sizes_choosing_their_own_algorithm() -> None:
    """At 3 ranks with group size 2 the groups are {0, 1} and {2}; for a
    buffer of 64 KiB or more the default algorithm is Rabenseifner in the
    first and recursive doubling in the second (by group size). That is a
    correct program: debug mode must not call it a mismatch (the
    fingerprint named each rank's own default and raised MismatchError on
    every rank)."""
    if SIZE < 3:
        pytest.skip("needs groups of different sizes: three ranks")
    sub = WORLD.Split(0 if RANK < 3 else MPI.UNDEFINED)
    if sub == MPI.COMM_NULL:
        return
    try:
        with wagma_comm.init(timeout=30, mpi_comm=sub, debug=True) as c:
            x = np.full(INLINE_MAX_BYTES // 4 * 2, RANK + 1.0, np.float32)
            c.group_allreduce(x, 2, 0, op="sum")
            members = c.group_of(2, 0)
            assert np.all(x == sum(r + 1.0 for r in members)), (members, x[:2])
    finally:
        sub.Free()


def test_use_local_gpu_times_out_when_a_rank_never_calls_it() -> None:
    """``use_local_gpu`` splits the world by node with MPI_Comm_split_type,
    a blocking collective: a rank that never called it (it failed before,
    or took another branch) left the others blocked in it for ever. A
    barrier under the timeout now comes first: CollectiveTimeoutError
    naming use_local_gpu, within the timeout. The absent rank then joins
    that barrier, so that the abandoned request completes."""
    if SIZE == 1:
        pytest.skip("a missing rank needs two ranks")
    from wagma_comm.torch_views import use_local_gpu
    from wagma_comm.transport.mpi import ABANDONED

    absent = SIZE - 1
    dup = WORLD.Dup()
    try:
        if RANK != absent:
            error, took = _outcome_in_thread(lambda: use_local_gpu(dup, timeout=1.0), 30.0,
                                             "use_local_gpu")
            assert isinstance(error, wagma_comm.CollectiveTimeoutError), repr(error)
            assert error.collective == "use_local_gpu" and "within 1 s" in str(error), error
            assert took < 15.0, took
        WORLD.Barrier()  # every present rank gave up
        if RANK == absent:
            dup.Ibarrier().Wait()  # matches the others' abandoned barrier
        else:
            _, request = ABANDONED.pop()  # (uses, request), kept by the timeout
            request.Wait()
    finally:
        dup.Free()


def test_a_timeout_of_any_real_number_type_is_taken_or_refused_by_name(
        comm: Communicator) -> None:
    """``timeout=np.float32(30)`` (a NumPy scalar, as a config or a
    computation gives) was refused with "expected seconds as a number",
    although it is one (``Handle.wait`` takes it). An int too large for a
    float escaped as a bare OverflowError, and a long double beyond float's
    range became inf: an endless deadline. All before any communication."""
    from fractions import Fraction

    for good in (np.float32(30), np.int64(30), np.float64(30.5), Fraction(61, 2)):
        a = np.full(3, RANK + 1.0)
        comm.allreduce(a, timeout=good)
        assert a[0] == SIZE * (SIZE + 1) / 2, good
        comm.barrier(timeout=good)
    before = comm.statistics()["completed"]
    bad_values = [10 ** 400, np.float32("nan"), np.int64(-1), np.float32(0), np.bool_(True),
                  np.float64("inf")]
    if np.finfo(np.longdouble).max > np.finfo(np.float64).max:  # 80-bit long double
        bad_values.append(np.longdouble("1e400"))
    for bad in bad_values:
        for call in (lambda: comm.allreduce(np.ones(3), timeout=bad),
                     lambda: comm.broadcast(np.ones(3), timeout=bad),
                     lambda: comm.barrier(timeout=bad),
                     lambda: wagma_comm.init(timeout=bad)):
            with pytest.raises(wagma_comm.InvalidArgumentError) as info:
                call()
            assert info.value.argument == "timeout", (bad, info.value)
    assert comm.statistics()["completed"] == before  # nothing was communicated
