"""Small blocking collectives run on the calling thread (runtime/inline.py):
they are taken inline only when the engine is idle, hand over to the engine
when a peer is late, and time out naming the missing ranks."""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import wagma_comm
from wagma_comm.comm import INLINE_MAX_BYTES
from wagma_comm.runtime import inline as inline_mod

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


@pytest.fixture(scope="module", autouse=True)
def comm(message_comm: wagma_comm.Communicator) -> wagma_comm.Communicator:
    """The message path's runs are under test (shared memory: test_shared.py)."""
    return message_comm


def _expected(count: int, dtype: type) -> np.ndarray:
    return np.full(count, sum(r + 1 for r in range(SIZE)), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_small_blocking_calls_run_inline(comm: wagma_comm.Communicator, dtype: type) -> None:
    def started_inline() -> int:  # finished here, or handed over when a peer was late
        stats = comm.statistics()
        return stats["inline"] + stats["inline_handed_over"]

    before = started_inline()
    for _ in range(5):
        buf = np.full(3, RANK + 1, dtype)
        comm.allreduce(buf)
        np.testing.assert_array_equal(buf, _expected(3, dtype))
    assert started_inline() - before == 5


def test_small_blocking_calls_run_inline_while_a_partial_collective_listens(
        comm: wagma_comm.Communicator) -> None:
    """A persistent collective's listener is no work in flight: small blocking
    calls still run on the caller's thread (with a 1 ms patience, so the
    listener is not starved), where they used to queue behind the progress
    thread. Some may still queue when the progress thread holds the engine
    for longer than 1 ms (descheduled mid-turn), so only some are required."""
    w = comm.wait_avoiding_group_allreduce(np.zeros(4), 1, sync_every=100)
    stats = comm.statistics()
    before = stats["inline"] + stats["inline_handed_over"]
    for _ in range(20):
        buf = np.full(3, RANK + 1, np.float32)
        comm.allreduce(buf)
        np.testing.assert_array_equal(buf, _expected(3, np.float32))
    stats = comm.statistics()
    assert stats["inline"] + stats["inline_handed_over"] > before
    w.close()


def test_large_calls_use_the_engine_and_small_async_ones_run_straight(
        comm: wagma_comm.Communicator) -> None:
    """A large blocking call goes through the engine's executor; a small
    non-blocking one is run straight through by its waiter (counted with the
    inline runs; tests/mpi/test_small_async.py)."""
    stats = comm.statistics()
    before = stats["inline"] + stats["inline_handed_over"]
    big = np.full(INLINE_MAX_BYTES // 4 + 1, RANK + 1, np.float32)
    comm.allreduce(big)
    np.testing.assert_array_equal(big, _expected(big.size, np.float32))
    stats = comm.statistics()
    assert stats["inline"] + stats["inline_handed_over"] == before
    small = np.full(2, RANK + 1, np.float32)
    comm.allreduce(small, async_op=True).wait()
    np.testing.assert_array_equal(small, _expected(2, np.float32))
    stats = comm.statistics()
    assert stats["inline"] + stats["inline_handed_over"] == before + 1


def test_not_inline_while_other_work_is_in_flight(comm: wagma_comm.Communicator) -> None:
    """Submission order is kept: a blocking call behind async work goes through
    the engine's queue, and both results are right. The last rank submits
    the async call 0.2 s late, so on every other rank it is surely still in
    flight when the blocking call comes (on the last rank it may already
    have finished, and then running inline is right)."""
    stats = comm.statistics()
    before = stats["inline"] + stats["inline_handed_over"]
    first = np.full(1 << 16, RANK + 1, np.float32)
    if RANK == SIZE - 1:
        time.sleep(0.2)
    handle = comm.allreduce(first, async_op=True)
    second = np.full(4, RANK + 1, np.float64)
    comm.allreduce(second)
    handle.wait()
    np.testing.assert_array_equal(first, _expected(first.size, np.float32))
    np.testing.assert_array_equal(second, _expected(4, np.float64))
    if RANK != SIZE - 1:  # (one rank alone completes everything at submission)
        stats = comm.statistics()
        assert stats["inline"] + stats["inline_handed_over"] == before


def test_late_peer_hands_the_run_to_the_engine(comm: wagma_comm.Communicator) -> None:
    if SIZE == 1:
        pytest.skip("a late peer needs two ranks")
    before = comm.statistics()["inline_handed_over"]
    if RANK == SIZE - 1:
        time.sleep(0.3)  # far beyond the inline run's patience (20 ms)
    buf = np.full(5, RANK + 1, np.float32)
    comm.allreduce(buf)
    np.testing.assert_array_equal(buf, _expected(5, np.float32))
    grp = np.full(5, RANK + 1, np.float32)
    comm.group_allreduce(grp, 2, 0, op="sum")  # the engine is idle again: inline
    members = comm.group_of(2, 0)
    np.testing.assert_array_equal(grp, np.full(5, sum(r + 1 for r in members), np.float32))
    if RANK == 0:
        assert comm.statistics()["inline_handed_over"] > before


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "rabenseifner", "ring", "native"])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_every_algorithm_runs_inline_on_fresh_buffers(comm: wagma_comm.Communicator,
                                                      algorithm: str, op: str) -> None:
    """A Program is reused across calls: new buffers every call (odd lengths,
    so Rabenseifner and ring cut the buffer into uneven slices) must each get
    their own result, never a stale binding of an earlier call."""
    rng = np.random.default_rng(1234)
    for count in (1, 7, 7, 33, 7):
        data = rng.integers(-50, 50, size=(SIZE, count)).astype(np.float64)
        buf = data[RANK].copy()
        comm.allreduce(buf, op=op, algorithm=algorithm)
        expected = {"sum": data.sum(0), "avg": data.sum(0) / SIZE, "max": data.max(0)}[op]
        np.testing.assert_array_equal(buf, expected)


@pytest.mark.parametrize("straight", [True, False], ids=["straight-line", "dataflow"])
def test_both_inline_executors_give_every_algorithm_its_result(
        monkeypatch: pytest.MonkeyPatch, straight: bool) -> None:
    """Compiled schedules run as straight lines (runtime/straight.py); the
    dataflow executor stays for the others and must keep working: both, on
    every algorithm, fresh buffers of odd lengths, and a barrier between."""
    from wagma_comm.runtime import engine as engine_mod

    monkeypatch.setattr(engine_mod, "STRAIGHT_LINES", straight)
    c = wagma_comm.init(timeout=30)
    try:
        rng = np.random.default_rng(99)
        for algorithm in ("recursive_doubling", "rabenseifner", "ring", "native"):
            for op in ("sum", "avg", "min"):
                data = rng.integers(-50, 50, size=(SIZE, 5)).astype(np.float32)
                buf = data[RANK].copy()
                c.allreduce(buf, op=op, algorithm=algorithm)
                expected = {"sum": data.sum(0), "avg": data.sum(0) / SIZE,
                            "min": data.min(0)}[op]
                np.testing.assert_allclose(buf, expected, rtol=1e-6)
                c.barrier()
        stats = c.statistics()
        assert stats["inline"] + stats["inline_handed_over"] >= 24
        programs = [program for _, program in c._engine._programs.values()]
        assert programs and all((program.line is not None) == straight
                                for program in programs)
    finally:
        c.close()


def test_inline_counters_match_the_messages(comm: wagma_comm.Communicator) -> None:
    """Inline runs are counted per program (the per-call path stays lean);
    statistics() must still show every run and its messages, also after the
    program cache was emptied."""
    from wagma_comm.runtime import engine as engine_mod
    from wagma_comm.schedule import algorithms
    from wagma_comm.schedule.ir import Send

    def counters() -> tuple[int, int, int]:
        stats = comm.statistics()
        return stats["inline"] + stats["inline_handed_over"], stats["messages_sent"], \
            stats["bytes_sent"]

    calls, expected_sent, expected_bytes = 0, 0, 0
    before = counters()
    for count in range(1, engine_mod._PROGRAM_CACHE_LIMIT + 6):  # forces one eviction
        buf = np.ones(count, np.float32)
        comm.allreduce(buf)
        sched = algorithms.compile_allreduce(RANK, tuple(range(SIZE)), count, "sum",
                                             "recursive_doubling")
        sends = [op for op in sched.ops if isinstance(op, Send)]
        calls += 1
        expected_sent += len(sends)
        expected_bytes += sum(op.src.count for op in sends) * 4
    after = counters()
    assert after[0] - before[0] == calls
    assert after[1] - before[1] == expected_sent
    assert after[2] - before[2] == expected_bytes


def test_no_reference_to_the_buffer_is_kept(comm: wagma_comm.Communicator) -> None:
    """Programs keep views of their own scratch only: the caller's array can
    be resized in place (NumPy refuses while anything else refers to it)."""
    buf = np.full(6, RANK + 1, np.float32)
    comm.allreduce(buf)
    np.testing.assert_array_equal(buf, _expected(6, np.float32))
    buf.resize(9, refcheck=True)  # raises ValueError if referenced
    buf[:] = RANK + 1
    comm.allreduce(buf)
    np.testing.assert_array_equal(buf, _expected(9, np.float32))


def test_inline_timeout_names_the_missing_ranks() -> None:
    """A deadline shorter than the hand-over patience expires inline."""
    if SIZE == 1:
        pytest.skip("a missing rank needs two ranks")
    c = wagma_comm.init(timeout=30)
    c.barrier()  # round 0
    if RANK == 0:
        started = time.monotonic()
        with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
            c.allreduce(np.ones(2, np.float32), timeout=0.005)
        assert time.monotonic() - started < 1.0
        err = info.value
        assert err.collective == "allreduce" and err.round == 1
        assert err.ranks and set(err.ranks) <= set(range(1, SIZE))
        assert c.statistics()["failed"] == 1
        with pytest.raises(wagma_comm.CommunicatorClosedError, match="broken"):
            c.allreduce(np.ones(2, np.float32))
    WORLD.Barrier()
    c.close(cancel=True)


@pytest.mark.parametrize("straight", [True, False], ids=["straight-line", "dataflow"])
def test_interrupt_during_an_inline_run_breaks_the_communicator(
        monkeypatch: pytest.MonkeyPatch, straight: bool) -> None:
    """Ctrl-C inside an inline run after messages went out: late messages of
    that round could match a round one sequence window later, so the
    communicator must refuse further work (no silent wrong result). Both
    executors: the straight line tests with the transport's tester, the
    dataflow run with test_one/test_some."""
    if SIZE == 1:
        pytest.skip("a one-rank collective posts nothing")
    from wagma_comm.runtime import engine as engine_mod

    monkeypatch.setattr(engine_mod, "STRAIGHT_LINES", straight)
    c = wagma_comm.init(timeout=20)
    transport = c._transport
    real, real_one, real_tester = transport.test_some, transport.test_one, transport.tester

    def interrupted(*args: object) -> object:  # every rank: nobody waits for anybody
        transport.test_some, transport.test_one = real, real_one
        raise KeyboardInterrupt

    try:
        c.barrier()
        transport.test_some = transport.test_one = interrupted
        transport.tester = lambda: interrupted  # bound by the program made next
        with pytest.raises(KeyboardInterrupt):
            c.allreduce(np.ones(2, np.float32))
        assert c.statistics()["broken"] is not None
        with pytest.raises(wagma_comm.CommunicatorClosedError, match="broken"):
            c.allreduce(np.ones(2, np.float32))
    finally:
        transport.test_some, transport.test_one, transport.tester = real, real_one, real_tester
        WORLD.Barrier()
        c.close(cancel=True)


def _interrupt_next_prepare(real: Any) -> None:
    """The next Program.prepare raises KeyboardInterrupt (Ctrl-C) once, then
    ``real`` is back."""
    def interrupted(self: inline_mod.Program) -> None:
        inline_mod.Program.prepare = real  # type: ignore[method-assign]
        raise KeyboardInterrupt

    inline_mod.Program.prepare = interrupted  # type: ignore[method-assign]


def test_interrupt_before_anything_is_posted_releases_the_engine() -> None:
    """Ctrl-C while the inline run is still being set up: the engine's driver
    lock is released and, nothing having been sent, the next call works."""
    c = wagma_comm.init(timeout=20)
    engine = c._engine
    real = inline_mod.Program.prepare

    try:
        c.barrier()
        _interrupt_next_prepare(real)
        with pytest.raises(KeyboardInterrupt):
            c.allreduce(np.ones(3, np.float32))  # a new program: prepared in the run
        assert not engine._driver.locked()
        assert c.statistics()["broken"] is None
        buf = np.full(3, RANK + 1, np.float32)
        c.allreduce(buf)
        np.testing.assert_array_equal(buf, _expected(3, np.float32))
    finally:
        inline_mod.Program.prepare = real  # type: ignore[method-assign]
        WORLD.Barrier()
        c.close()


def test_repeated_calls_still_check_each_buffer(comm: wagma_comm.Communicator) -> None:
    """A call like an earlier one takes the small-message path (the work
    settled by dtype, shape, op and algorithm is reused), but every buffer is
    still checked: a strided or read-only array of the same shape and dtype
    is refused before anything is sent, and other shapes keep their results."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    buf = np.full(4, RANK + 1, np.float32)
    comm.allreduce(buf)
    assert comm._fast, "an allreduce on a NumPy array is remembered"
    sent = comm.statistics()["messages_sent"]
    strided = np.full(8, RANK + 1, np.float32)[::2]
    with pytest.raises(wagma_comm.BufferError, match="buf.*C-contiguous"):
        comm.allreduce(strided)
    frozen = np.full(4, RANK + 1, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(wagma_comm.BufferError, match="buf.*read-only"):
        comm.allreduce(frozen)
    assert comm.statistics()["messages_sent"] == sent
    for _ in range(2):  # the first call remembers, the second takes the path
        grid = np.full((2, 3), RANK + 1, ml_dtypes.bfloat16)
        comm.allreduce(grid)
        np.testing.assert_array_equal(grid.astype(np.float32),
                                      np.full((2, 3), SIZE * (SIZE + 1) / 2, np.float32))
        buf = np.full(4, RANK + 1, np.float32)
        assert comm.allreduce(buf) is buf
        np.testing.assert_array_equal(buf, _expected(4, np.float32))


def test_repeated_group_allreduce_takes_the_small_call_path(
        comm: wagma_comm.Communicator) -> None:
    """The groups repeat every ``num_steps`` steps, and so does a blocking
    group allreduce on a NumPy array: from the second period on every call
    runs from the remembered call (counted on it) and still sums its own
    group at its step. Bad arguments are still refused on that path."""
    from wagma_comm import groups

    group_size = max(1, SIZE // 2)
    period = groups.num_steps(SIZE, group_size)
    steps = 3 * period + 1
    before = comm.statistics()["calls"].get("group_allreduce", 0)
    small_before = comm._small_counts.get("group_allreduce", [0])[0]
    for step in range(steps):
        x = np.full(3, RANK + 1.0)
        assert comm.group_allreduce(x, group_size, step, op="sum") is x
        expected = sum(r + 1.0 for r in comm.group_of(group_size, step))
        np.testing.assert_array_equal(x, np.full(3, expected))
    remembered = [f for key, f in comm._fast.items() if f.collective == "group_allreduce"
                  and key[:5] == (np.dtype(np.float64), (3,), "sum", None, group_size)]
    assert len(remembered) == period
    assert comm._small_counts["group_allreduce"][0] - small_before == steps - period
    assert comm.statistics()["calls"]["group_allreduce"] - before == steps
    x = np.ones(3)
    with pytest.raises(wagma_comm.InvalidArgumentError, match="step"):
        comm.group_allreduce(x, group_size, -1, op="sum")
    with pytest.raises(wagma_comm.InvalidArgumentError, match="group_size"):
        comm.group_allreduce(x, True, 0, op="sum")


def test_call_counts_stay_exact_with_threads_and_cache_overflow(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three threads call on one rank (MPI_COMM_SELF: their order may differ
    from other ranks') with more shapes than the small-call cache holds, so
    it is forgotten again and again, every third call non-blocking (its
    waiter, another thread's turn or the progress thread starts it): no call
    fails and every call is counted exactly once."""
    import sys
    import threading

    from wagma_comm import comm as comm_mod
    from wagma_comm.transport.mpi import MPITransport

    monkeypatch.setattr(comm_mod, "_PREPARED_LIMIT", 8)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches inside the cache's upkeep
    errors: list[BaseException] = []
    calls = 400

    def caller(k: int) -> None:
        try:
            for i in range(calls):
                buf = np.ones(1 + (7 * i + k) % 25)
                if i % 3 == k:
                    c.allreduce(buf, async_op=True).wait()
                else:
                    c.allreduce(buf)
                assert np.all(buf == 1.0)
        except BaseException as exc:  # reported below, on the main thread
            errors.append(exc)

    c = wagma_comm.Communicator(MPITransport(MPI.COMM_SELF), timeout=60)
    try:
        threads = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
        c.close()
    assert not errors, errors[:3]
    assert c.statistics()["calls"]["allreduce"] == 3 * calls


@pytest.mark.parametrize("straight", [True, False], ids=["straight-line", "dataflow"])
def test_interrupt_setting_up_a_program_that_ran_before_keeps_the_communicator(
        monkeypatch: pytest.MonkeyPatch, straight: bool) -> None:
    """Ctrl-C while a program that ran before is set up again (its scratch
    dropped, as after a run the engine took over): the requests of its
    earlier runs are not this call's, so nothing counts as sent, the
    communicator stays usable and the next call gets its result. The
    straight line once took its last run's requests for this call's and
    broke the communicator."""
    from wagma_comm.runtime import engine as engine_mod

    monkeypatch.setattr(engine_mod, "STRAIGHT_LINES", straight)
    c = wagma_comm.init(timeout=20)
    real = inline_mod.Program.prepare

    try:
        c.barrier()
        buf = np.full(3, RANK + 1, np.float32)
        c.allreduce(buf)
        np.testing.assert_array_equal(buf, _expected(3, np.float32))
        [program] = [p for _, p in c._engine._programs.values()
                     if p.schedule.collective == "allreduce"]
        assert (program.line is not None) == straight
        program.drop_scratch()  # what a hand-over to the engine leaves
        _interrupt_next_prepare(real)
        sent = c.statistics()["messages_sent"]
        with pytest.raises(KeyboardInterrupt):
            c.allreduce(np.ones(3, np.float32))
        assert not c._engine._driver.locked()
        stats = c.statistics()
        assert stats["broken"] is None and stats["messages_sent"] == sent
        buf = np.full(3, RANK + 1, np.float32)
        c.allreduce(buf)
        np.testing.assert_array_equal(buf, _expected(3, np.float32))
    finally:
        inline_mod.Program.prepare = real  # type: ignore[method-assign]
        WORLD.Barrier()
        c.close()


@pytest.mark.parametrize("straight", [True, False], ids=["straight-line", "dataflow"])
def test_a_transport_error_posting_a_message_is_the_transports_error(
        monkeypatch: pytest.MonkeyPatch, straight: bool) -> None:
    """MPI failing a message as it is posted (as a send to a dead peer may)
    raises the transport's TransportError, with MPI's error code, from both
    executors: the engine's failure path reads a dead peer into it only from
    a TransportError. The dataflow run used to let mpi4py's own exception
    out, which was then reported as an interruption, without the code."""
    if SIZE == 1:
        pytest.skip("a one-rank collective posts nothing")
    from wagma_comm.runtime import engine as engine_mod

    monkeypatch.setattr(engine_mod, "STRAIGHT_LINES", straight)
    c = wagma_comm.init(timeout=20)
    transport = c._transport
    real = transport.posters

    def failing_posters(channel: str) -> tuple[object, object]:
        def failing(*args: object) -> object:  # every rank's first post: nobody waits
            raise MPI.Exception(MPI.ERR_OTHER)
        return failing, failing

    try:
        c.barrier()
        transport.posters = failing_posters  # bound by the program made next
        with pytest.raises(wagma_comm.TransportError) as info:
            c.allreduce(np.ones(2, np.float32))
        assert info.value.code == MPI.ERR_OTHER, info.value
        assert "MPI error" in str(info.value)
        with pytest.raises(wagma_comm.CommunicatorClosedError, match="broken"):
            c.allreduce(np.ones(2, np.float32))
    finally:
        transport.posters = real
        WORLD.Barrier()
        c.close(cancel=True)


@pytest.mark.parametrize("straight", [True, False], ids=["straight-line", "dataflow"])
def test_interrupt_half_way_through_setting_up_is_redone_next_call(
        monkeypatch: pytest.MonkeyPatch, straight: bool) -> None:
    """Ctrl-C inside Program.prepare, after the scratch arrays were made but
    before the run state referring to them was: the next call must set the
    program up again, not run it half set up. It used to find the scratch
    there, skip the rest, and fail every later call of that shape (an
    IndexError: no views of the scratch)."""
    if SIZE == 1:
        pytest.skip("a one-rank sum has no op to set up")
    from wagma_comm.runtime import engine as engine_mod

    monkeypatch.setattr(engine_mod, "STRAIGHT_LINES", straight)
    c = wagma_comm.init(timeout=20)
    real = inline_mod._spec

    def interrupted(*args: object) -> object:
        inline_mod._spec = real
        raise KeyboardInterrupt

    try:
        c.barrier()
        monkeypatch.setattr(inline_mod, "_spec", interrupted)
        with pytest.raises(KeyboardInterrupt):
            c.allreduce(np.ones(3, np.float32))  # a new program: prepared in the run
        assert c.statistics()["broken"] is None
        for _ in range(2):
            buf = np.full(3, RANK + 1, np.float32)
            c.allreduce(buf)
            np.testing.assert_array_equal(buf, _expected(3, np.float32))
    finally:
        inline_mod._spec = real
        WORLD.Barrier()
        c.close()


def test_a_handed_over_run_that_fails_keeps_its_scratch_for_mpi() -> None:
    """A late peer hands the inline run, with its program's scratch, to the
    engine; when it then fails (here: its deadline) with a receive into that
    scratch outstanding, the scratch must be kept alive with the other
    buffers MPI may still write (Engine.abandoned). It used to be dropped
    with the run: only the user's buffer and pooled scratch were kept."""
    if SIZE == 1:
        pytest.skip("a late peer needs two ranks")
    c = wagma_comm.init(timeout=30)
    try:
        buf = np.ones(5, np.float32)
        engine = c._engine
        for _ in range(20):  # until no rank handed its run over (which drops the scratch)
            c.allreduce(buf)  # makes the program and its scratch
            program = next(p for s, p in engine._programs.values()
                           if s.collective == "allreduce" and s.count == 5)
            if not WORLD.allreduce(program.scratch is None, op=MPI.LOR):
                break
        # (Not every rank's schedule has scratch: at 3 ranks the rank beyond
        # the power of two only sends and receives its data.)
        scratch = list(program.scratch.values())
        assert WORLD.allreduce(int(bool(scratch) and RANK != SIZE - 1)) > 0
        if RANK != SIZE - 1:  # the last rank stays away
            before = c.statistics()["inline_handed_over"]
            with pytest.raises(wagma_comm.CollectiveTimeoutError):
                c.allreduce(buf, timeout=0.5)  # hands over after 20 ms, fails at 0.5 s
            assert c.statistics()["inline_handed_over"] == before + 1
            kept = engine.abandoned()
            assert all(any(arr is k for k in kept) for arr in scratch)
    finally:
        WORLD.Barrier()
        c.close(cancel=True)


def test_an_inline_timeout_does_not_name_a_rank_whose_message_came() -> None:
    """A deadline shorter than the hand-over patience expires inline at a
    straight line's wait, whose test of all its requests completes none
    until all did: rank 2 of a 3-rank scatter_allgather broadcast waits for
    rank 0 (root) and rank 1 together. Rank 0's message is there, rank 1
    never comes: the timeout must name rank 1 only (it named both)."""
    if SIZE < 3:
        pytest.skip("needs three ranks: one that sent and one that never comes")
    sub = WORLD.Split(0 if RANK < 3 else MPI.UNDEFINED)
    if sub == MPI.COMM_NULL:
        return
    c = wagma_comm.init(timeout=30, mpi_comm=sub)
    try:
        buf = np.arange(7, dtype=np.float32)
        if RANK == 0:  # the root only sends (eagerly): done without rank 1
            c.broadcast(buf, 0, algorithm="scatter_allgather", timeout=5)
            sub.send(None, dest=2)
        elif RANK == 2:
            sub.recv(source=0)
            data = c._transport._comms["data"]
            deadline = time.monotonic() + 10
            while not data.Iprobe(source=0):  # rank 0's piece has arrived
                assert time.monotonic() < deadline, "rank 0's message never came"
                time.sleep(1e-3)
            with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
                c.broadcast(buf, 0, algorithm="scatter_allgather", timeout=0.005)
            assert c.statistics()["inline_handed_over"] == 0  # it expired inline
            assert info.value.ranks == (1,), info.value
    finally:
        sub.Barrier()
        c.close(cancel=True)
        sub.Free()


@pytest.mark.parametrize("straight", [True, False], ids=["straight-line", "dataflow"])
def test_a_call_interrupted_before_it_posted_keeps_no_reference_to_its_buffer(
        monkeypatch: pytest.MonkeyPatch, straight: bool) -> None:
    """Ctrl-C while an inline run is set up (nothing posted, the
    communicator stays usable): the caller's array must not stay referenced
    once the call is over, here after a later call of the same shape, so
    ndarray.resize still works. The straight line's failure state was the
    program's reusable run state, which kept the array for good."""
    from wagma_comm.runtime import engine as engine_mod

    monkeypatch.setattr(engine_mod, "STRAIGHT_LINES", straight)
    c = wagma_comm.init(timeout=20)
    real = inline_mod.Program.prepare

    try:
        c.barrier()
        _interrupt_next_prepare(real)
        mine = np.ones(3, np.float32)
        try:
            c.allreduce(mine)  # a new program: prepared in the run
        except KeyboardInterrupt:
            pass
        else:
            pytest.fail("the interruption did not reach the caller")
        assert c.statistics()["broken"] is None
        buf = np.full(3, RANK + 1, np.float32)
        c.allreduce(buf)
        np.testing.assert_array_equal(buf, _expected(3, np.float32))
        gc.collect()  # the failure's traceback frames refer to it until collected
        mine.resize(9, refcheck=True)  # raises ValueError if still referenced
    finally:
        inline_mod.Program.prepare = real  # type: ignore[method-assign]
        WORLD.Barrier()
        c.close()


def test_ranks_on_different_paths_still_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks need not take the same path for a call: each decides alone
    (its own engine idle or not, its own executor), and the messages are
    the same on every path. Even ranks run straight lines, odd ranks the
    dataflow executor, and the last rank has a large call in flight, so its
    blocking calls queue through the engine; every result must be right."""
    if SIZE == 1:
        pytest.skip("one rank has nobody to disagree with")
    from wagma_comm.runtime import engine as engine_mod

    monkeypatch.setattr(engine_mod, "STRAIGHT_LINES", RANK % 2 == 0)
    c = wagma_comm.init(timeout=30)
    try:
        c.barrier()
        rng = np.random.default_rng(7)
        before = c.statistics()
        for algorithm in ("recursive_doubling", "rabenseifner", "ring", "native"):
            big = np.full(INLINE_MAX_BYTES // 4 + 1, RANK + 1, np.float32)
            handle = c.allreduce(big, async_op=True)
            if RANK != SIZE - 1:
                handle.wait()  # idle again: the small calls below run inline here
            for count in (1, 5, 33):
                data = rng.integers(-50, 50, size=(SIZE, count)).astype(np.float64)
                buf = data[RANK].copy()
                c.allreduce(buf, op="sum", algorithm=algorithm)
                np.testing.assert_array_equal(buf, data.sum(0))
            handle.wait()
            np.testing.assert_array_equal(big, _expected(big.size, np.float32))
        after = c.statistics()
        inline = after["inline"] + after["inline_handed_over"] - (
            before["inline"] + before["inline_handed_over"])
        if RANK == 0:  # (a call may still queue if the progress thread held the engine)
            assert inline > 0, "rank 0 ran none of its small calls inline"
    finally:
        WORLD.Barrier()
        c.close()
