"""Small non-blocking collectives (at most INLINE_MAX_BYTES): queued without
waking the progress thread (Engine.submit(wake=LAZY)), run straight through
by whoever starts them first (the waiter, Handle.test(), or the progress
thread after its nap), and handed to the engine's executor when a peer is
late. Results, progress without any call into the library, test() as a
progress call, hand-over, timeouts and submission order."""

from __future__ import annotations

import random
import time
from typing import Any, Iterator

import numpy as np
import pytest
from mpi4py import MPI

import wagma_comm
from wagma_comm.runtime import engine as engine_mod

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


@pytest.fixture(scope="module", autouse=True)
def comm(message_comm: wagma_comm.Communicator) -> wagma_comm.Communicator:
    """The message path's runs are under test (shared memory: test_shared.py)."""
    return message_comm


def _total(dtype: type = np.float64) -> np.ndarray:
    return np.asarray(sum(r + 1 for r in range(SIZE)), dtype)


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sequence numbers of the collectives as they start, on any thread:
    straight and inline runs (Engine._run_here) and executor runs (their
    first stage)."""
    started: list[int] = []
    run_here, enter_stage = engine_mod.Engine._run_here, engine_mod.Engine._enter_stage

    def recording_run_here(self: Any, program: Any, data: Any, seq: int, *rest: Any) -> Any:
        started.append(seq)
        return run_here(self, program, data, seq, *rest)

    def recording_enter_stage(self: Any, run: Any, index: int) -> None:
        if index == 0:
            started.append(run.work.seq)
        enter_stage(self, run, index)

    monkeypatch.setattr(engine_mod.Engine, "_run_here", recording_run_here)
    monkeypatch.setattr(engine_mod.Engine, "_enter_stage", recording_enter_stage)
    return started


@pytest.fixture
def napping(comm: wagma_comm.Communicator, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For tests that change the progress thread's naps: afterwards the
    constants are restored and the thread is woken from a nap still running
    with the changed length."""
    yield
    monkeypatch.undo()
    comm._engine.wake()


def _enter_lazy_window(comm: wagma_comm.Communicator) -> None:
    """One small non-blocking call waited on at once: from now on the idle
    progress thread naps for at most _LAZY_NAP_S."""
    comm.allreduce(np.ones(2), async_op=True).wait()


def test_many_outstanding_complete_in_any_wait_order(comm: wagma_comm.Communicator) -> None:
    """Sixteen calls of mixed dtypes, ops and collectives in flight at once,
    waited on in reverse order: every result is right."""
    calls = []
    group_size = min(2, SIZE)
    for i in range(16):
        dtype = (np.float32, np.float64, np.int32, np.int64)[i % 4]
        buf = np.full(1 + i, RANK + 1, dtype)
        if i % 3 == 2:
            calls.append((buf, comm.group_allreduce(buf, group_size, i, op="sum",
                                                    async_op=True),
                          sum(r + 1 for r in comm.group_of(group_size, i))))
        elif i % 3 == 1:
            calls.append((buf, comm.allreduce(buf, "max", async_op=True), SIZE))
        else:
            calls.append((buf, comm.allreduce(buf, async_op=True), _total()))
    for buf, handle, expected in reversed(calls):
        assert handle.wait() is buf
        np.testing.assert_array_equal(buf, np.full(buf.size, expected, buf.dtype))


@pytest.mark.parametrize("idle", ["in the lazy window", "after a long idle"])
def test_progresses_without_any_call_into_the_library(
        comm: wagma_comm.Communicator, monkeypatch: pytest.MonkeyPatch, napping: None,
        idle: str) -> None:
    """No rank waits or tests for half a second, and the call still completes:
    the progress thread starts it after its short nap, or is woken for it
    from a long idle wait (which here would last 30 s)."""
    if idle == "in the lazy window":
        _enter_lazy_window(comm)
        monkeypatch.setattr(engine_mod, "_LAZY_NAP_S", 0.05)
    else:
        monkeypatch.setattr(engine_mod, "_LAZY_WINDOW_S", 0.0)
        monkeypatch.setattr(engine_mod, "_IDLE_WAIT_S", 30.0)
        time.sleep(1.2)  # the thread's current 1 s wait ends; it now waits 30 s
    buf = np.full(3, RANK + 1.0)
    handle = comm.allreduce(buf, async_op=True)
    time.sleep(0.5)
    assert handle.done, f"not started without a wait ({idle})"
    handle.wait()
    np.testing.assert_array_equal(buf, np.full(3, _total()))


def test_test_starts_the_call(comm: wagma_comm.Communicator,
                              monkeypatch: pytest.MonkeyPatch, napping: None) -> None:
    """Handle.test() progresses a queued call, as MPI_Test does: with the
    progress thread napping for 30 s, polling test() alone completes it."""
    _enter_lazy_window(comm)
    monkeypatch.setattr(engine_mod, "_LAZY_NAP_S", 30.0)
    time.sleep(0.05)  # the thread's current nap (at most 5 ms) ends: it naps 30 s
    buf = np.full(2, RANK + 1.0)
    handle = comm.allreduce(buf, async_op=True)
    give_up = time.monotonic() + 10.0
    while not handle.test():
        assert time.monotonic() < give_up, "test() never started the call"
        time.sleep(0.001)
    np.testing.assert_array_equal(buf, np.full(2, _total()))


def test_late_peer_hands_the_call_to_the_engine(comm: wagma_comm.Communicator) -> None:
    if SIZE == 1:
        pytest.skip("a late peer needs two ranks")
    before = comm.statistics()["inline_handed_over"]
    if RANK == SIZE - 1:
        time.sleep(0.3)  # far beyond the straight run's patience (1 ms)
    buf = np.full(5, RANK + 1, np.float32)
    comm.allreduce(buf, async_op=True).wait()
    np.testing.assert_array_equal(buf, np.full(5, _total(np.float32)))
    if RANK == 0:
        assert comm.statistics()["inline_handed_over"] > before


def test_blocking_call_behind_a_small_async_one(comm: wagma_comm.Communicator,
                                                starts: list[int]) -> None:
    """Submission order is kept: the blocking call waits behind the queued
    non-blocking one (never inline ahead of it), and both are right."""
    first = np.full(4, RANK + 1.0)
    handle = comm.allreduce(first, async_op=True)
    second = np.full(3, RANK + 1, np.int64)
    comm.allreduce(second, "max")
    np.testing.assert_array_equal(second, np.full(3, SIZE, np.int64))
    handle.wait()
    np.testing.assert_array_equal(first, np.full(4, _total()))
    assert len(starts) == 2 and starts[0] < starts[1], starts


def test_start_order_is_submission_order(comm: wagma_comm.Communicator,
                                         starts: list[int]) -> None:
    """A random mix (the same on every rank) of blocking and non-blocking,
    small and large calls, waited, polled or left alone a while, in
    batches waited in a shuffled order: the calls start in the order they
    were submitted, whichever thread starts them, and every result is
    right. (Matching tags would make results right in any order; the order
    is what keeps straight-line runs on different ranks from deadlocking.)"""
    rng = random.Random(2026)
    pending: list[tuple[np.ndarray, Any]] = []
    calls = 0
    for _ in range(150):
        buf = np.full(rng.choice([1, 3, 8, 9000]), RANK + 1.0)  # 9000 doubles: not small
        calls += 1
        if rng.random() < 0.35:
            comm.allreduce(buf)
            np.testing.assert_array_equal(buf, np.full(buf.size, _total()))
        else:
            handle = comm.allreduce(buf, async_op=True)
            pending.append((buf, handle))
            how = rng.random()
            if how < 0.3:
                while not handle.test():
                    pass
            elif how < 0.5:
                time.sleep(rng.random() * 0.002)
        if len(pending) > 6 or rng.random() < 0.2:
            rng.shuffle(pending)
            for buf, handle in pending:
                handle.wait()
                np.testing.assert_array_equal(buf, np.full(buf.size, _total()))
            pending.clear()
    for buf, handle in pending:
        handle.wait()
        np.testing.assert_array_equal(buf, np.full(buf.size, _total()))
    assert len(starts) == calls
    assert starts == sorted(starts), [s for i, s in enumerate(starts[1:]) if s < starts[i]]


@pytest.mark.parametrize("timeout", [0.0005, 0.5], ids=["expires-running", "after-hand-over"])
def test_timeout_names_the_missing_ranks(timeout: float) -> None:
    """Rank 0 calls alone. A deadline shorter than the straight run's
    patience expires in the run itself; a longer one after the engine took
    over. Either way the error names the collective, its round and the
    ranks that never took part."""
    if SIZE == 1:
        pytest.skip("a missing rank needs two ranks")
    c = wagma_comm.init(timeout=30)
    c.barrier()  # round 0
    if RANK == 0:
        handed_over = c.statistics()["inline_handed_over"]
        handle = c.allreduce(np.ones(2, np.float32), async_op=True, timeout=timeout)
        with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
            handle.wait()
        # The short deadline expired in the straight run itself; the long one
        # after the run was handed to the executor.
        assert c.statistics()["inline_handed_over"] - handed_over == (timeout > 0.01)
        err = info.value
        assert err.collective == "allreduce" and err.round == 1
        assert err.ranks and set(err.ranks) <= set(range(1, SIZE))
        with pytest.raises(wagma_comm.CommunicatorClosedError, match="broken"):
            c.allreduce(np.ones(2, np.float32), async_op=True)
    WORLD.Barrier()
    c.close(cancel=True)


@pytest.mark.parametrize("kind", ["small", "large", "wagma"])
def test_a_test_polling_loop_completes_without_the_progress_thread(
        comm: wagma_comm.Communicator, kind: str) -> None:
    """A thread polling test() in a tight loop holds the GIL; with a switch
    interval of 30 s the progress thread cannot take it back, so the call
    completes only because test() itself turns the engine (MPI_Test
    semantics): a small call, a large one (the engine's executor) and a
    persistent collective's round (a service of the engine)."""
    import sys

    from wagma_comm.comm import INLINE_MAX_BYTES

    count = 3 if kind != "large" else INLINE_MAX_BYTES // 8 + 1
    buf = np.full(count, RANK + 1.0)
    wagma = (comm.wait_avoiding_group_allreduce(np.zeros(count), 1, sync_every=1)
             if kind == "wagma" else None)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        handle = (wagma.step(buf, async_op=True) if wagma is not None
                  else comm.allreduce(buf, async_op=True))
        give_up = time.monotonic() + 10.0
        while not handle.test():
            if time.monotonic() > give_up:
                break
    finally:
        sys.setswitchinterval(switch)
    assert handle.done, f"a test() loop did not complete the {kind} call in 10 s"
    handle.wait()
    expected = _total() / SIZE if kind == "wagma" else _total()  # sync_every=1: the mean
    np.testing.assert_array_equal(buf, np.full(count, expected))
    if wagma is not None:
        wagma.close()
