"""WAGMA's wait-avoiding group allreduce through shared memory
(partial/shared_wagma.py): the default where every rank is on this host.

As in test_partial.py, lateness is ordered with MPI barriers on another
communicator, not timed: if a round waited for a member that has not
arrived, the test would hang and fail at its timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import threading
import time
from typing import Any, Iterator

import numpy as np
import pytest
from mpi4py import MPI

import wagma_comm
from wagma_comm import Communicator, RoundInfo
from wagma_comm.partial.shared_wagma import MODEL_MAX_BYTES

from conftest import (message_path, mismatched_creations_are_refused,
                      mismatched_final_calls_are_named, not_at_3_or_8_ranks,
                      step_into_a_missing_sync_round, up_to_4_ranks, wagma_rounds_follow)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
SLOW = SIZE - 1
SHARED = "shared_memory"

needs_peers = pytest.mark.skipif(SIZE == 1, reason="one rank has no shared-memory segment")


def _wagma(comm: Communicator, initial: Any, group_size: int, sync_every: int,
           **kw: Any) -> Any:
    w = comm.wait_avoiding_group_allreduce(initial, group_size, sync_every, **kw)
    assert w.statistics()["path"] == SHARED
    return w


def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


@needs_peers
def test_fast_ranks_never_wait_and_a_late_rank_gets_the_newest_round(
        comm: Communicator) -> None:
    """Integer-valued models. Fast rank f publishes f+1 before a barrier of
    the fast ranks, then steps; the slow rank publishes nothing and steps only
    after every fast step, so its contribution is the initial model (100) and
    every result is exact."""
    steps, group_size = 6, 2
    w = _wagma(comm, np.full(4, 100.0), group_size, sync_every=steps + 1)
    value = {r: float(r + 1) for r in range(SIZE)}
    value[SLOW] = 100.0
    fast = WORLD.Split(int(RANK == SLOW), RANK)
    if RANK != SLOW:
        for t in range(steps):
            model = np.full(4, value[RANK])
            w.publish(model)
            fast.Barrier()
            info = w.step(model)
            group = tuple(comm.group_of(group_size, info.step))
            assert (info.round, info.iteration, info.group) == (t, t, group)
            assert not info.synchronized and info.activator in group
            assert info.fresh == tuple(r for r in group if r != SLOW)
            expected = (sum(value[j] for j in group) + value[RANK]) / (len(group) + 1)
            assert np.all(model == expected), (t, group, model, expected)
            fast.Barrier()  # nobody publishes round t+1 before everyone stepped t
    WORLD.Barrier()  # the slow rank starts only now
    if RANK == SLOW:
        for t in range(steps):
            model = np.full(4, 100.0)
            info = w.step(model)
            assert info.round >= t and info.staleness == info.round - t + 1
            group = tuple(comm.group_of(group_size, info.step))
            assert info.group == group and SLOW not in info.fresh
            expected = (sum(value[j] for j in group) + 100.0) / (len(group) + 1)
            assert np.all(model == expected), (t, info, model, expected)
        stats = w.statistics()
        assert stats["late_steps"] >= 1 and stats["activated_here"] + \
            stats["activated_elsewhere"] == steps
    model = np.full(4, value[RANK])
    info = w.step(model)  # round `steps`: synchronous, everyone
    assert info.synchronized and info.fresh == tuple(range(SIZE))
    assert np.all(model == sum(value.values()) / SIZE)
    w.close()
    fast.Free()


@needs_peers
@pytest.mark.parametrize("normalization", ["wagma", "mean"])
def test_both_paths_give_the_same_rounds_when_everyone_published(
        comm: Communicator, normalization: str) -> None:
    """Every rank publishes, then all step: every contribution is fresh on
    both paths, and the results (integer-valued, so exact in any order)
    and the rounds' groups agree with the message path's."""
    rng = np.random.default_rng(7 + RANK)
    for group_size in sorted({1, 2, min(3, SIZE), SIZE}):
        init = np.zeros(33, np.float32)
        on_board = _wagma(comm, init, group_size, 4, normalization=normalization)
        on_messages = comm.wait_avoiding_group_allreduce(
            init, group_size, 4, normalization=normalization, algorithm="recursive_doubling")
        assert on_messages.statistics()["path"] == "messages"
        for t in range(9):
            x = rng.integers(-50, 50, 33).astype(np.float32)
            a, b = x.copy(), x.copy()
            for w, buf in ((on_board, a), (on_messages, b)):
                w.publish(buf)
            WORLD.Barrier()
            ia, ib = on_board.step(a), on_messages.step(b)
            np.testing.assert_array_equal(a, b)
            assert (ia.round, ia.group, ia.synchronized) == (ib.round, ib.group, ib.synchronized)
            assert ia.fresh == ia.group
        on_board.close()
        on_messages.close()


@needs_peers
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_run_replicas_agree_bitwise_after_every_sync_round(
        comm: Communicator, dtype: str) -> None:
    """300 steps with random 0-3 ms delays on every rank: many stale and late
    contributions, yet after every sync round all replicas hold the same bits,
    the exact mean of the ranks' integer-valued inputs."""
    import torch

    tdtype = getattr(torch, dtype)
    sync_every, n = 10, 65
    rng = random.Random(RANK)
    w = _wagma(comm, torch.zeros(n, dtype=tdtype), min(4, SIZE), sync_every)
    syncs = 0
    for t in range(300):
        time.sleep(rng.random() * 0.003)
        value = float((t * 7 + RANK * 3) % 11)
        model = torch.full((n,), value, dtype=tdtype)
        info = w.step(model)
        if info.synchronized:
            syncs += 1
            values = [float((t * 7 + r * 3) % 11) for r in range(SIZE)]
            expected = torch.full((n,), sum(values) / SIZE, dtype=torch.float32).to(tdtype)
            digest = _digest(model.view(torch.int16 if dtype == "bfloat16" else torch.int32)
                             .numpy())
            assert len(set(WORLD.allgather(digest))) == 1, t
            assert torch.equal(model, expected), (t, model[:3], expected[:3])
        else:
            assert info.round >= t and info.staleness == (info.round - t + 1 if
                                                          info.staleness else 0)
    assert syncs == 300 // sync_every
    stats = w.statistics()
    assert stats["steps"] == 300 and stats["sync_rounds"] == syncs
    assert stats["fresh_contributions"] + stats["stale_contributions"] == 300
    w.close()


@needs_peers
def test_async_steps_return_handles_and_a_sync_round_overlaps(comm: Communicator) -> None:
    w = _wagma(comm, np.zeros(8), min(2, SIZE), sync_every=2)
    h = w.step(np.full(8, float(RANK)), async_op=True)
    assert h.done and isinstance(h.wait(), RoundInfo)
    model = np.full(8, float(RANK))
    h = w.step(model, async_op=True)  # round 1: synchronous
    while not h.test():
        pass
    info = h.wait()
    assert info.synchronized and info.round == 1
    assert np.all(model == sum(range(SIZE)) / SIZE)
    w.close()


@needs_peers
def test_an_unwaited_sync_round_is_published_before_the_next_step(
        comm: Communicator) -> None:
    """Round 0 is synchronous (first_round=9, sync_every=10) and nobody waits
    on its handle before stepping round 1. Round 1 must still come after it
    on the board: each rank's slot then holds its round-1 model, which round
    2's first arrival sums. Before session 36 the sync result was published
    only at wait(), over the round-1 model, with round 0's number."""
    group_size = 2
    w = _wagma(comm, np.zeros(4), group_size, sync_every=10, first_round=9)
    synced = np.full(4, float(RANK))
    h = w.step(synced, async_op=True)
    w.step(np.full(4, 100.0 + RANK))
    WORLD.Barrier()  # every rank's round-1 model is on the board
    assert h.wait().synchronized
    assert np.all(synced == sum(range(SIZE)) / SIZE)
    WORLD.Barrier()
    model = np.full(4, 200.0 + RANK)
    info = w.step(model)  # nobody published round 2: the activator's own model is new
    a = info.activator
    total = sum(200.0 + m if m == a else 100.0 + m for m in info.group)
    assert info.round == 2 and np.all(model == (total + 200.0 + RANK) / (len(info.group) + 1)), \
        (info, model)
    w.close()


@needs_peers
def test_close_before_waiting_on_a_sync_round_finishes_it(comm: Communicator) -> None:
    """close() right after an async sync step: the round completes (close
    settles it before unmapping the board) and its handle still returns it;
    before session 36 wait() raised IndexError from the unmapped board."""
    w = _wagma(comm, np.zeros(4), 2, sync_every=10, first_round=9)
    model = np.full(4, float(RANK))
    h = w.step(model, async_op=True)
    w.close()
    info = h.wait()
    assert info.synchronized and info.round == 0
    assert np.all(model == sum(range(SIZE)) / SIZE)
    assert w.statistics()["completed_round"] == 0


@needs_peers
def test_an_async_sync_rounds_handle_names_the_step_not_the_allreduce(
        comm: Communicator) -> None:
    """The handle of an async sync step is the step's: its ``collective`` and
    ``round`` (and a WaitTimeoutError's text) name this collective and round
    0, as a message path step's Handle does. Before session 44 they were
    the communicator's allreduce under it (``allreduce``, its own call
    count). The slow rank steps only after the others looked."""
    w = _wagma(comm, np.zeros(4), 2, sync_every=10, first_round=9)
    model = np.full(4, float(RANK))
    if RANK != SLOW:
        h = w.step(model, async_op=True)
        assert (h.collective, h.round) == (w.kind, 0), (h.collective, h.round)
        with pytest.raises(wagma_comm.WaitTimeoutError, match=rf"^{w.kind} \(round 0\)"):
            h.wait(timeout=0)
    WORLD.Barrier()
    if RANK == SLOW:
        h = w.step(model, async_op=True)
        assert (h.collective, h.round) == (w.kind, 0), (h.collective, h.round)
    assert h.wait().round == 0 and np.all(model == sum(range(SIZE)) / SIZE)
    w.close()


@needs_peers
def test_a_bad_wait_timeout_on_an_async_sync_round_breaks_nothing(
        comm: Communicator) -> None:
    """``wait(timeout=-1)`` on an async sync step is the caller's error:
    InvalidArgumentError, and the round runs on, lands and is published,
    and the collective stays usable (before session 44 the bad timeout was
    taken for the round's outcome: the collective was broken, every later
    wait raised it, and close() skipped its agreement, so the peers' close
    timed out)."""
    w = _wagma(comm, np.zeros(4), 2, sync_every=10, first_round=9)
    model = np.full(4, float(RANK))
    h = w.step(model, async_op=True)
    for bad in (-1, float("nan"), "1"):
        with pytest.raises(wagma_comm.InvalidArgumentError) as info:
            h.wait(timeout=bad)
        assert info.value.argument == "timeout"
    assert w.statistics()["broken"] is None
    info = h.wait()
    assert info.synchronized and info.round == 0
    assert np.all(model == sum(range(SIZE)) / SIZE)
    after = np.full(4, 1.0)
    assert not w.step(after).synchronized  # round 1: a group round, still usable
    assert w.statistics()["completed_round"] == 1
    w.close()


@needs_peers
def test_an_async_sync_steps_wait_time_is_the_rounds_not_the_callers_compute(
        comm: Communicator) -> None:
    """``wait_time_s``/``sync_wait_time_s`` are "seconds from call to
    result": for an async sync step the round's own time, as on the message
    path, not the compute the caller overlaps with it before wait(). Before
    session 44 the board counted until the handle was settled (here 1 s of
    sleep for a round of milliseconds)."""
    compute = 1.0
    w = _wagma(comm, np.zeros(4), 2, sync_every=10, first_round=9)
    WORLD.Barrier()
    h = w.step(np.full(4, float(RANK)), async_op=True)
    time.sleep(compute)  # the caller's compute, overlapping the round
    assert h.wait().synchronized
    stats = w.statistics()
    assert stats["sync_wait_time_s"] == stats["wait_time_s"]
    assert stats["sync_wait_time_s"] <= h.elapsed + 0.25, (stats["sync_wait_time_s"], h.elapsed)
    w.close()


@needs_peers
def test_a_sync_round_waited_on_by_another_thread_is_settled_once(
        comm: Communicator) -> None:
    """A thread waits on each async sync round while the main thread steps
    the next round, which settles it too: the round must be published and
    counted once (a lock in the handle), and every rank end with the same
    models at the sync rounds."""
    w = _wagma(comm, np.zeros(4), 2, sync_every=2)
    digests = []

    def check(waiter: threading.Thread, h: Any, synced: np.ndarray, r: int) -> None:
        waiter.join()
        assert h.wait().round == r and np.all(synced == r - 1 + sum(range(SIZE)) / SIZE)
        digests.append(_digest(synced))

    pending = None
    for t in range(0, 20, 2):
        w.step(np.full(4, float(t + RANK)))  # group round t: settles round t - 1
        if pending is not None:
            check(*pending)
        synced = np.full(4, float(t + RANK))
        h = w.step(synced, async_op=True)  # sync round t + 1
        waiter = threading.Thread(target=h.wait)
        waiter.start()
        pending = (waiter, h, synced, t + 1)
    check(*pending)
    stats = w.statistics()
    assert stats["sync_rounds"] == 10 and stats["rounds"] == 20, stats
    assert all(d == digests for d in WORLD.allgather(digests))  # the same bits everywhere
    w.close()


@needs_peers
@up_to_4_ranks
def test_close_raises_the_error_of_a_sync_round_nobody_waited_on() -> None:
    """The slow rank never steps, so the others' async sync round times out;
    nobody waits on its handle, so close() (which settles it) must raise
    that error rather than return as if the round had run. The handle
    raises it too."""
    c = wagma_comm.init(timeout=30)
    w = _wagma(c, np.zeros(2), 2, sync_every=1, timeout=1.0)  # every round synchronous
    if RANK != SLOW:
        h = w.step(np.zeros(2), async_op=True)
        with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
            w.close()
        assert info.value.round == 0 and SLOW in info.value.ranks, info.value
        with pytest.raises(wagma_comm.CollectiveTimeoutError):
            h.wait()
        w.close()  # idempotent
    WORLD.Barrier()
    if RANK == SLOW:  # as in the test below: its close meets the others' sync round
        with pytest.raises((wagma_comm.CollectiveTimeoutError, wagma_comm.MismatchError)):
            w.close()
    c.close(cancel=True)


@needs_peers
@up_to_4_ranks
def test_a_rank_that_stops_stepping_is_named_at_the_sync_round() -> None:
    c = wagma_comm.init(timeout=30)
    w = _wagma(c, np.zeros(2), 2, sync_every=3, timeout=1.0)
    if RANK != SLOW:
        step_into_a_missing_sync_round(w, SLOW)
    WORLD.Barrier()
    if RANK == SLOW:  # close() is collective; the others are gone, and their
        # sync round's call is what its agreement meets on the segment
        with pytest.raises((wagma_comm.CollectiveTimeoutError, wagma_comm.MismatchError)):
            w.close()
    c.close(cancel=True)


@needs_peers
def test_close_after_different_step_counts_names_the_ranks(comm: Communicator) -> None:
    w = _wagma(comm, np.zeros(3), 2, sync_every=5)
    for _ in range(2 if RANK == SLOW else 3):
        w.step(np.zeros(3))
    with pytest.raises(wagma_comm.MismatchError) as info:
        w.close()
    expected = tuple(r for r in range(SIZE) if r != RANK) if RANK == SLOW else (SLOW,)
    assert info.value.ranks == expected and "close() after" in str(info.value)


@needs_peers
@pytest.mark.parametrize("rank0,others,steps", [
    ("close", "flush(buf)", (1, 1)), ("flush", "flush(buf)", (1, 1)),
    ("flush", "close", (1, 1)), ("flush(buf)", "flush(buf)", (2, 1))])
def test_ranks_that_end_differently_are_named(comm: Communicator, rank0: str,
                                              others: str, steps: tuple[int, int]) -> None:
    """As on the message path (test_partial.py): before session 36 only
    step counts were compared, so a flush(buf) against a close() or flush()
    elsewhere waited for an allreduce only it ran."""
    mismatched_final_calls_are_named(
        comm, lambda: _wagma(comm, np.zeros(4), 2, sync_every=100), rank0, others, steps)


@needs_peers
def test_flush_is_a_global_mean_and_publishes_it(comm: Communicator) -> None:
    w = _wagma(comm, np.zeros(5), 2, sync_every=100)
    w.step(np.full(5, float(RANK)))
    model = np.full(5, float(RANK * 2))
    info = w.flush(model)
    assert info.synchronized and np.all(model == 2 * sum(range(SIZE)) / SIZE)
    assert w.flush() is None
    w.close()


@pytest.mark.parametrize("algorithm", [None, "recursive_doubling"], ids=["board", "messages"])
def test_flush_is_not_counted_as_a_step(comm: Communicator, algorithm: str | None) -> None:
    """flush(buf) counts in ``flushes`` and ``sync_rounds`` only, on both
    paths (before session 37 the message path also counted it in
    ``steps`` and the staleness histogram, the board did not)."""
    if algorithm is None and SIZE == 1:
        pytest.skip("one rank has no shared-memory segment")
    w = comm.wait_avoiding_group_allreduce(np.zeros(4), 2 if SIZE > 1 else 1, sync_every=10,
                                           algorithm=algorithm)
    for _ in range(3):
        w.step(np.ones(4))
    w.flush(np.full(4, 2.0))
    stats = w.statistics()
    assert stats["steps"] == 3 and stats["flushes"] == 1 and stats["sync_rounds"] == 1, stats
    assert sum(stats["staleness_histogram"].values()) == 3, stats
    w.close()


@needs_peers
@pytest.mark.parametrize("algorithm", [None, "recursive_doubling"], ids=["board", "messages"])
def test_a_published_member_whose_round_a_peer_ran_is_on_time(
        comm: Communicator, algorithm: str | None) -> None:
    """Every rank publishes its model of round 0, then the fast ranks step
    (whichever runs the round, every contribution is fresh); the slow rank's
    step then gets round 0 at once with staleness 0 and is not a late step:
    its contribution was current. Before session 37 both paths reported
    staleness 1 there (and the board also for a fast rank whose peer ran
    the round)."""
    w = comm.wait_avoiding_group_allreduce(np.zeros(3), SIZE, sync_every=10,
                                           normalization="mean", algorithm=algorithm)
    model = np.full(3, float(RANK))
    w.publish(model)
    WORLD.Barrier()  # published before any fast rank steps
    if RANK != SLOW:
        info = w.step(model)
        assert info.round == 0 and info.staleness == 0 and SLOW in info.fresh, info
    WORLD.Barrier()
    if RANK == SLOW:
        info = w.step(model)  # (messages: round 0 may still be finishing here)
        assert info.round == 0 and info.staleness == 0 and SLOW in info.fresh, info
        assert w.statistics()["late_steps"] == 0
    np.testing.assert_array_equal(model, sum(range(SIZE)) / SIZE)
    w.flush()
    w.close()


@needs_peers
@pytest.mark.parametrize("normalization", ["wagma", "mean"])
def test_float16_group_rounds_do_not_overflow_where_the_mean_fits(
        comm: Communicator, normalization: str) -> None:
    """float16 models of 40000 on every rank: a group's sum (up to 40000 P)
    is beyond float16's 65504, its mean is not. The board keeps the sum in
    float32 and rounds once (before session 37 it stored the sum in float16:
    inf). The message path's sum overflows, as documented."""
    w = _wagma(comm, np.full(4, 40000, np.float16), SIZE, sync_every=100,
               normalization=normalization)
    for _ in range(3):
        model = np.full(4, 40000, np.float16)
        info = w.step(model)
        assert not info.synchronized
        np.testing.assert_array_equal(model, np.float16(40000))
    w.flush()
    w.close()


@needs_peers
@pytest.mark.parametrize("algorithm", [None, "recursive_doubling"], ids=["board", "messages"])
def test_a_flushed_model_is_not_fresh_for_the_next_round(comm: Communicator,
                                                           algorithm: str | None) -> None:
    """After flush(model) a rank's slot holds the global mean, its model
    after its last step; the next round's peers must count it stale until
    it steps (or publishes) that round, as the message path does. Before
    session 36 the board published the mean with the next round's number,
    so the rank counted fresh in a round it never reached."""
    w = comm.wait_avoiding_group_allreduce(np.zeros(4), SIZE, sync_every=100,
                                           algorithm=algorithm)
    w.step(np.full(4, float(RANK)))
    mean = np.full(4, float(RANK))
    w.flush(mean)
    fast = WORLD.Split(int(RANK == SLOW), RANK)
    if RANK != SLOW:
        model = np.full(4, 10.0)
        w.publish(model)
        fast.Barrier()
        info = w.step(model)
        assert info.round == 1 and SLOW not in info.fresh, info
        assert info.fresh == tuple(r for r in range(SIZE) if r != SLOW), info
        fast.Barrier()
    WORLD.Barrier()
    if RANK == SLOW:
        info = w.step(np.full(4, 10.0))
        assert info.round == 1 and SLOW not in info.fresh, info
    w.close()
    fast.Free()


COMPUTE_S, LATE_S = 0.5, 0.2


def _step_after_compute(w: Any, fast: Any, t: int, late: bool) -> tuple[RoundInfo, np.ndarray]:
    """Round ``t`` after COMPUTE_S of "compute" (from the last step's return,
    what the grace is measured in): the fast ranks publish and meet at a
    barrier before stepping, so only the late rank can be behind; it
    publishes LATE_S after them (``late``) or not at all."""
    time.sleep(COMPUTE_S)
    model = np.full(4, float(10 * t + RANK + 1))
    if RANK != SLOW:
        w.publish(model)
        fast.Barrier()
        return w.step(model), model
    if late:
        time.sleep(LATE_S)
        w.publish(model)
    return w.step(model), model


@needs_peers
@pytest.mark.parametrize("grace", [0.0, 1.0])
def test_grace_counts_a_member_a_moment_behind_fresh(comm: Communicator, grace: float) -> None:
    """Round 1: the slow rank publishes LATE_S after its peers arrive. With a
    grace of its peers' whole compute time (COMPUTE_S) they wait for it and
    it is fresh; with none it is averaged in with round 0's model."""
    group_size = min(4, SIZE)
    w = _wagma(comm, np.zeros(4), group_size, sync_every=100, grace=grace)
    fast = WORLD.Split(int(RANK == SLOW), RANK)
    w.step(np.full(4, float(RANK + 1)))  # round 0, everyone: starts the compute clock
    WORLD.Barrier()
    info, model = _step_after_compute(w, fast, 1, late=True)
    group = tuple(comm.group_of(group_size, info.step))
    if RANK != SLOW:
        assert info.round == 1 and info.group == group
        waits_for_slow = grace > 0 and SLOW in group
        assert info.fresh == (group if grace > 0 else tuple(r for r in group if r != SLOW))
        slow_value = 10 + SLOW + 1 if grace > 0 else SLOW + 1  # round 1's or round 0's
        total = sum(10 + r + 1 for r in group if r != SLOW) + (slow_value if SLOW in group
                                                              else 0)
        assert np.all(model == (total + 10 + RANK + 1) / (len(group) + 1)), (group, model)
        stats = w.statistics()
        assert stats["grace_waits"] <= int(waits_for_slow)  # only SLOW's group waits
        assert stats["grace_wait_time_s"] < COMPUTE_S * grace + 1.0
    else:
        assert SLOW in info.fresh if grace > 0 else SLOW not in info.fresh
    waited = WORLD.allreduce(w.statistics()["grace_wait_time_s"], MPI.MAX)
    assert (waited > 0.5 * LATE_S) == (grace > 0)  # someone in SLOW's group waited
    w.close()
    fast.Free()


@needs_peers
def test_members_that_step_together_without_publishing_do_not_wait_out_the_grace(
        comm: Communicator) -> None:
    """Every rank steps at once (a barrier), none publishes first. Each must
    publish its model before its grace wait, so the others see it arrived:
    every round is fresh for every member and nobody waits long (until
    session 35 all waited out the grace for each other, and whoever woke
    first counted the others stale)."""
    compute, grace = 0.2, 1.0  # a grace of 0.2 s against waits of microseconds
    w = _wagma(comm, np.zeros(4), min(4, SIZE), sync_every=100, grace=grace)
    w.step(np.zeros(4))  # round 0: starts the compute clock
    stale = 0
    for t in range(1, 6):
        time.sleep(compute)
        WORLD.Barrier()
        info = w.step(np.full(4, float(RANK)))
        stale += len(info.group) - len(info.fresh)
    stats = w.statistics()
    assert stale == 0, stats
    assert stats["grace_wait_time_s"] < 5 * grace * compute / 2, stats
    w.close()


@needs_peers
def test_grace_is_bounded_and_skips_a_member_two_rounds_behind(comm: Communicator) -> None:
    """The slow rank publishes nothing after round 0. Round 1: it is one
    round behind, so its group's first member waits out the grace (a
    quarter of COMPUTE_S) and averages without it. Round 2: two behind, a
    straggler: nobody waits at all."""
    group_size, grace = min(4, SIZE), 0.25
    w = _wagma(comm, np.zeros(4), group_size, sync_every=100, grace=grace)
    fast = WORLD.Split(int(RANK == SLOW), RANK)
    w.step(np.full(4, float(RANK + 1)))
    WORLD.Barrier()
    if RANK != SLOW:
        info, _ = _step_after_compute(w, fast, 1, late=False)
        assert SLOW not in info.fresh
        after_one = w.statistics()
        info, _ = _step_after_compute(w, fast, 2, late=False)
        assert SLOW not in info.fresh
        after_two = w.statistics()
        assert after_two["grace_waits"] == after_one["grace_waits"]
        assert after_two["grace_wait_time_s"] == after_one["grace_wait_time_s"]
        assert after_one["grace_wait_time_s"] < COMPUTE_S * grace + 1.0
    waited = WORLD.allreduce(w.statistics()["grace_wait_time_s"], MPI.MAX)
    assert 0.8 * COMPUTE_S * grace <= waited < COMPUTE_S * grace + 1.0
    WORLD.Barrier()
    if RANK == SLOW:
        for t in (1, 2):
            assert w.step(np.zeros(4)).staleness >= 1  # late: both rounds ran without it
    w.close()
    fast.Free()


def _wait_for(request: Any) -> Any:
    """An MPI request's outcome, napping (a spinning wait takes a core)."""
    while True:
        done, value = request.test()
        if done:
            return value
        time.sleep(0.001)


def _grace_waits(w: Any, computes: list[float]) -> list[float]:
    """Rounds 1, 2, ... after ``computes[t - 1]`` s of compute on the fast
    ranks, with the slow rank one round behind at each: it steps round
    ``t - 1`` only once the fast ranks finished it, then waits for their
    round ``t``. Every rank steps round 0 first. Returns the seconds each
    round's grace waited here (fast ranks; [] on the slow one)."""
    fast = WORLD.Split(int(RANK == SLOW), RANK)
    w.step(np.zeros(4))  # round 0, everyone: starts the compute clock
    waits = []
    for t, compute in enumerate(computes, 1):
        if RANK != SLOW:
            time.sleep(compute)
            before = w.statistics()["grace_wait_time_s"]
            w.step(np.full(4, float(t)))
            waits.append(w.statistics()["grace_wait_time_s"] - before)
            if RANK == 0:  # the slow rank steps round t now, late
                WORLD.send(t, dest=SLOW)
                _wait_for(WORLD.irecv(source=SLOW))
            _wait_for(fast.Ibarrier())
        else:
            _wait_for(WORLD.irecv(source=0))
            assert w.step(np.zeros(4)).staleness == 1
            WORLD.send(t, dest=0)
    _wait_for(WORLD.Ibarrier())
    fast.Free()
    return waits


@needs_peers
@not_at_3_or_8_ranks
def test_one_long_pause_does_not_lengthen_later_rounds_grace(comm: Communicator) -> None:
    """The fast ranks compute 30 ms per step, pause 1.6 s once (a
    checkpoint) and go on at 30 ms. The grace scales with the median of
    the last compute times, so the rounds after the pause still wait about
    30 ms for the slow rank. Until session 48 it scaled with a moving
    average that the pause raised to about 0.23 s, then 0.2 s: seven times
    this rank's compute, for rounds after it."""
    w = _wagma(comm, np.zeros(4), SIZE, sync_every=1000, grace=1.0)
    waits = _grace_waits(w, [0.03, 0.03, 0.03, 1.6, 0.03, 0.03])
    if RANK != SLOW:
        assert all(wait < 0.12 for wait in waits[3:]), waits
    w.close()


@needs_peers
@not_at_3_or_8_ranks
def test_the_grace_never_waits_past_half_the_timeout(comm: Communicator) -> None:
    """A compute time (1.2 s) over half the collective's timeout (2 s): the
    grace waits 1 s, so the step's lock waits keep the rest and the step
    ends within its timeout. Until session 48 it waited the whole 1.2 s
    (a longer compute, any time past the timeout)."""
    timeout = 2.0
    w = _wagma(comm, np.zeros(4), SIZE, sync_every=1000, grace=1.0, timeout=timeout)
    waits = _grace_waits(w, [1.2])
    if RANK != SLOW:
        assert waits[0] <= timeout / 2 + 0.05, waits
    waited = WORLD.allreduce(max(waits, default=0.0), MPI.MAX)
    assert waited >= 0.8 * timeout / 2, waited  # the grace did run, to its cap
    w.close()


@needs_peers
@pytest.mark.parametrize("first_round", [0, 3, 8])
def test_round_r_is_round_first_round_plus_r(comm: Communicator, first_round: int) -> None:
    """3 is no multiple of sync_every: the sync rounds move with it."""
    group_size = max(1, SIZE // 2)
    w = _wagma(comm, np.zeros(4, np.float32), group_size, 4, first_round=first_round)
    assert w.statistics()["first_round"] == first_round
    wagma_rounds_follow(first_round, w, 9, group_size)
    w.close()


@needs_peers
@pytest.mark.parametrize("what", ["first_round", "count"])
def test_ranks_that_create_it_differently_get_a_mismatch(comm: Communicator,
                                                         what: str) -> None:
    """Agreed on before the path is chosen: a count over the segment's limit
    on one rank must not send it down the other path."""
    def make(differs: bool) -> Any:
        if what == "first_round":
            return comm.wait_avoiding_group_allreduce(np.zeros(4, np.float32), 1, 4,
                                                      first_round=4 if differs else 0)
        count = MODEL_MAX_BYTES // 4 + 1 if differs else 4
        return comm.wait_avoiding_group_allreduce(np.zeros(count, np.float32), 1, 4)

    mismatched_creations_are_refused(
        comm, make, "first_round=4" if what == "first_round" else
        f"count={MODEL_MAX_BYTES // 4 + 1}")


@needs_peers
@pytest.mark.parametrize("how", ["close", "exception"])
def test_close_unmaps_the_board_while_the_object_lives(comm: Communicator, how: str) -> None:
    """After close() (or a ``with`` block left by an exception) the board is
    no longer mapped here, though the collective object is still
    referenced (for its statistics, say): its /dev/shm memory, P times
    twice the model, is freed once every rank closed. Before session 44 the
    object's own views of the board (the models, the cached kernels' rows)
    kept the mapping, so board.close() could not unmap it."""
    def mapped(path: str) -> bool:
        with open("/proc/self/maps") as maps:
            return any(path in line for line in maps)

    w = _wagma(comm, np.zeros(1 << 12, np.float32), 2, sync_every=10)
    path = w._board.path
    assert mapped(path)
    if how == "close":
        w.step(np.ones(1 << 12, np.float32))
        w.close()
    else:
        with pytest.raises(KeyError):
            with w:
                w.step(np.ones(1 << 12, np.float32))
                raise KeyError("the application failed")
    assert not mapped(path), path
    assert w.statistics()["iteration"] == 1
    with pytest.raises(wagma_comm.CommunicatorClosedError):
        w.step(np.ones(1 << 12, np.float32))
    WORLD.Barrier()


@needs_peers
def test_close_on_another_thread_waits_for_a_step_that_uses_the_board(
        comm: Communicator) -> None:
    """Rank 0 steps on one thread while it holds its own board lock (so the
    step waits inside the board) and closes on another: the unmap must wait
    for the step, which completes. Before session 44 nothing ordered them:
    once close() cleared the board the step failed with IndexError and left
    rank 0's lock held, so every later locker timed out."""
    from wagma_comm.transport import shm_lock

    w = _wagma(comm, np.zeros(4), SIZE, sync_every=10)
    if RANK != 0:
        w.step(np.full(4, float(RANK)))  # round 0 runs here: rank 0 gets it late
    WORLD.Barrier()
    if RANK != 0:
        w.close()
        return
    lock = w._board.locks[0]
    assert shm_lock.acquire(lock, time.monotonic() + 5.0)
    outcome: dict[str, Any] = {}

    def run(what: str, fn: Any) -> None:
        try:
            outcome[what] = fn()
        except BaseException as exc:  # reported by the asserts below
            outcome[what] = exc

    model = np.zeros(4)
    stepping = threading.Thread(target=run, args=("step", lambda: w.step(model)))
    stepping.start()
    time.sleep(0.3)  # the step waits for rank 0's lock, inside the board
    closing = threading.Thread(target=run, args=("close", w.close))
    closing.start()
    time.sleep(0.5)  # close()'s agreement is done: it would unmap now
    shm_lock.release(lock)
    stepping.join(30)
    closing.join(30)
    assert isinstance(outcome["step"], RoundInfo), outcome
    assert outcome["step"].round == 0 and outcome["close"] is None, outcome


@needs_peers
def test_a_board_whose_agreement_fails_leaves_no_file_in_dev_shm() -> None:
    """Rank 0 opens a board alone (its peers never come), so the agreement
    on it times out: the file rank 0 created must be gone, as the
    communicator's own segment is after a failed init(). Before session 44
    it stayed in /dev/shm (up to twice the model per rank) until a reboot."""
    import os

    from wagma_comm.partial import shared_wagma

    c = wagma_comm.init(timeout=30)
    ident = c._register_partial()
    path = f"{c._shared.segment.path}-p{ident}"
    try:
        if RANK == 0:
            with pytest.raises(wagma_comm.CollectiveTimeoutError):
                shared_wagma.open_board(c, ident, np.zeros(4), 32, 1.0)
            assert not os.path.exists(path), path
    finally:
        if RANK == 0 and os.path.exists(path):
            os.unlink(path)
        WORLD.Barrier()
        c.close(cancel=True)


def test_grace_is_checked_before_any_communication(comm: Communicator) -> None:
    for grace in (-0.5, 2.0, float("inf"), "0.1"):
        with pytest.raises(wagma_comm.InvalidArgumentError) as info:
            comm.wait_avoiding_group_allreduce(np.zeros(4), 1, 2, grace=grace)
        assert info.value.argument == "grace"
    w = comm.wait_avoiding_group_allreduce(np.zeros(4), 1, 2, grace=0.5,
                                           algorithm="recursive_doubling")
    assert w.grace == 0.5 and w.statistics()["grace_waits"] == 0  # messages: no effect
    w.close()


def test_explicit_shared_memory_is_refused_where_it_cannot_run() -> None:
    with message_path():
        c = wagma_comm.init(timeout=30)
    with pytest.raises(wagma_comm.UnsupportedError, match="shared_memory"):
        c.wait_avoiding_group_allreduce(np.zeros(4), 1, 2, algorithm=SHARED)
    with pytest.raises(wagma_comm.InvalidArgumentError) as info:
        c.wait_avoiding_group_allreduce(np.zeros(4), 1, 2, algorithm="native")
    assert info.value.argument == "algorithm"
    c.close()
    if SIZE > 1:
        c = wagma_comm.init(timeout=30)
        big = np.zeros(MODEL_MAX_BYTES // 4 + 1, np.float32)
        with pytest.raises(wagma_comm.UnsupportedError, match="board"):
            c.wait_avoiding_group_allreduce(big, 1, 2, algorithm=SHARED)
        w = c.wait_avoiding_group_allreduce(big, 1, 2)  # the message path, by default
        assert w.statistics()["path"] == "messages"
        w.close()
        c.close()


@needs_peers
def test_a_refusal_on_one_rank_is_told_to_every_rank(comm: Communicator,
                                                     monkeypatch: Any) -> None:
    """Rank 0 alone cannot run the board: its model is over the limit, or
    its C library has no robust mutexes. Every rank must hear of it at
    creation: a MismatchError naming rank 0 for the model (the others'
    count differs), an UnsupportedError for the locks (the others naming
    rank 0), and with ``algorithm=None`` every rank takes the message path.
    Until session 48 rank 0 raised UnsupportedError before the creation
    agreement and the others timed out in it (5 s here), and with
    ``algorithm=None`` rank 0 took the message path alone and every rank
    timed out."""
    from wagma_comm.transport import shm_lock

    timeout = 5.0
    big = np.zeros(MODEL_MAX_BYTES // 8 + 1) if RANK == 0 else np.zeros(4)
    started = time.monotonic()
    with pytest.raises(wagma_comm.MismatchError) as mismatch:
        comm.wait_avoiding_group_allreduce(big, SIZE, 4, timeout=timeout, algorithm=SHARED)
    assert sorted(mismatch.value.ranks) == ([0] if RANK else list(range(1, SIZE)))
    assert f"count={big.size}" in str(mismatch.value)
    if RANK == 0:
        monkeypatch.setattr(shm_lock, "UNAVAILABLE", "no robust mutexes in this C library")
    with pytest.raises(wagma_comm.UnsupportedError) as refused:
        comm.wait_avoiding_group_allreduce(np.zeros(4), SIZE, 4, timeout=timeout,
                                           algorithm=SHARED)
    assert time.monotonic() - started < timeout / 2
    assert str(refused.value) == ("algorithm: shared_memory: " + (
        "no robust mutexes in this C library" if RANK == 0
        else "rank(s) [0] could not create, map or use the board")), refused.value
    w = comm.wait_avoiding_group_allreduce(np.zeros(4), SIZE, 4, timeout=timeout)
    assert w.statistics()["path"] == "messages"
    info = w.step(np.full(4, float(RANK)))
    assert info.round == 0 and info.group == tuple(range(SIZE)), info
    w.close()


def _step_then_cancel(c: Any, w: Any, model: np.ndarray) -> tuple[Any, float]:
    """Step ``w`` on a thread (it waits inside the board), then
    ``c.close(cancel=True)`` here: the step's outcome, and how long after
    the cancel it ended."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["step"] = w.step(model)
        except BaseException as exc:  # reported by the caller's asserts
            outcome["step"] = exc
        outcome["ended"] = time.monotonic()

    stepping = threading.Thread(target=run)
    stepping.start()
    time.sleep(0.3)  # the step waits inside the board now
    cancelled = time.monotonic()
    c.close(cancel=True)
    stepping.join(30)
    assert not stepping.is_alive()
    return outcome["step"], outcome["ended"] - cancelled


@needs_peers
def test_close_cancel_ends_a_step_waiting_for_a_stopped_peers_board_lock() -> None:
    """The slow rank holds its board lock and never lets go (as a rank
    stopped while holding it would); rank 0's step waits for it. Rank 0's
    close(cancel=True) on another thread must end that wait within a nap,
    as the shared exchange's waits do. Before session 44 the lock was
    waited for in one call until the collective's timeout (20 s here),
    which then raised CollectiveTimeoutError, the cancel unseen."""
    from wagma_comm.transport import shm_lock

    c = wagma_comm.init(timeout=30)
    w = _wagma(c, np.zeros(4), SIZE, sync_every=1000, timeout=20.0)
    if RANK == SLOW:
        assert shm_lock.acquire(w._board.locks[SLOW], time.monotonic() + 5.0)
    WORLD.Barrier()
    if RANK == 0:
        outcome, took = _step_then_cancel(c, w, np.ones(4))
        assert isinstance(outcome, wagma_comm.CommunicatorClosedError), outcome
        assert "cancel" in str(outcome) and took < 2.0, (outcome, took)
        assert w.statistics()["iteration"] == 1
    WORLD.Barrier()
    if RANK == SLOW:
        shm_lock.release(w._board.locks[SLOW])
    c.close(cancel=True)
    w.close()  # its communicator is closed: released locally


@needs_peers
@up_to_4_ranks
def test_close_cancel_ends_a_step_in_its_grace() -> None:
    """Rank 0's round 1 waits out its grace (its whole compute time, 3 s)
    for peers that published round 0 and never come. close(cancel=True)
    must end that wait within a nap; before session 44 the grace ran to
    its end and the round then completed as if nothing had been cancelled."""
    c = wagma_comm.init(timeout=30)
    w = _wagma(c, np.zeros(4), SIZE, sync_every=1000, grace=1.0)
    w.step(np.full(4, float(RANK)))  # round 0, everyone: starts the compute clock
    WORLD.Barrier()
    if RANK == 0:
        time.sleep(3.0)  # rank 0's compute: its grace
        outcome, took = _step_then_cancel(c, w, np.ones(4))
        assert isinstance(outcome, wagma_comm.CommunicatorClosedError), outcome
        assert took < 1.5, took
        assert w.statistics()["rounds"] == 1  # round 1 did not run
    WORLD.Barrier()
    c.close(cancel=True)
    w.close()


@needs_peers
@pytest.mark.parametrize("said", [True, False], ids=["holder_said", "holder_unsaid"])
@up_to_4_ranks
def test_a_board_lock_timeout_names_the_holder_and_never_a_rank_that_let_go(
        said: bool) -> None:
    """Round 0 runs on rank 0, which takes every member's lock and lets go.
    The slow rank then takes its own lock and keeps it (as a rank stopped
    there would), having written its rank (``said``) or not yet. Rank 0's
    next step times out: it names the slow rank, or, when that had not said
    so, nobody; before session 44 it named rank 0 itself, the last rank
    that had held the lock."""
    from wagma_comm.transport import shm_lock

    c = wagma_comm.init(timeout=30)
    w = _wagma(c, np.zeros(4), SIZE, sync_every=1000, timeout=1.0)
    if RANK == 0:
        w.step(np.ones(4))
    WORLD.Barrier()
    if RANK == SLOW:
        if said:
            w._hold(SLOW, 0, time.monotonic() + 5.0)
        else:
            assert shm_lock.acquire(w._board.locks[SLOW], time.monotonic() + 5.0)
    WORLD.Barrier()
    if RANK == 0:
        with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
            w.step(np.ones(4))
        assert info.value.ranks == ((SLOW,) if said else ()), info.value
        assert f"rank {SLOW}'s board slot" in str(info.value), info.value
    WORLD.Barrier()
    if RANK == SLOW:
        shm_lock.release(w._board.locks[SLOW])
    c.close(cancel=True)
    w.close()


@needs_peers
def test_ready_must_be_a_bool_on_the_board_too(comm: Communicator) -> None:
    w = _wagma(comm, np.zeros(3), 1, sync_every=2)
    with pytest.raises(wagma_comm.InvalidArgumentError) as info:
        w.publish(np.zeros(3), ready=1)
    assert info.value.argument == "ready"
    w.close()


@contextlib.contextmanager
def _small_shared_exchange(max_bytes: int) -> Iterator[None]:
    """Communicators made inside send reductions over ``max_bytes`` (bytes
    per rank) through message schedules, though the WAGMA board still takes
    models up to MODEL_MAX_BYTES: a sync round is then a message allreduce
    (as for a model over 1 MiB where ranks do not outnumber cores)."""
    from conftest import env_set

    with env_set("WAGMA_SHM_MAX_BYTES", str(max_bytes)):
        yield


@needs_peers
@up_to_4_ranks
def test_a_sync_round_on_a_message_schedule_names_the_rank_that_never_arrived() -> None:
    """The slow rank never steps; the others' sync round (round 2) is a
    message allreduce (a model over the segment's exchange limit). Its
    timeout must name the slow rank on every rank, from the board's ARRIVED
    words. Before session 47 a rank named the peer its schedule was waiting
    on, which was itself waiting for the slow rank (at 4 ranks rank 0 named
    rank 2), while the message path's arrival check names it exactly."""
    with _small_shared_exchange(1024):
        c = wagma_comm.init(timeout=30)
    n = 4096  # 32 KiB of float64: over the exchange's 1 KiB, on the board
    w = _wagma(c, np.zeros(n), 2, sync_every=3, timeout=2.0)
    assert w._sync_algorithm != SHARED, w._sync_algorithm
    if RANK != SLOW:
        model = np.zeros(n)
        w.step(model)
        w.step(model)
        with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
            w.step(model)
        err = info.value
        assert err.collective == w.kind and err.round == 2, err
        assert err.ranks == (SLOW,), err
        assert str(err).count("ranks:") == 1, str(err)
        w.close()  # broken: released here
    WORLD.Barrier()
    if RANK == SLOW:  # close() is collective and the others are gone
        with pytest.raises((wagma_comm.CollectiveTimeoutError, wagma_comm.MismatchError)):
            w.close()
    c.close(cancel=True)


@needs_peers
@pytest.mark.parametrize("where", ["board_lock", "sync_round", "flush"])
def test_a_step_or_flush_cancelled_on_the_board_names_the_collective(where: str) -> None:
    """Rank 0 waits on the board (for the slow rank's lock), in a sync
    round or in flush() that its peers never join, when its communicator
    is closed with cancel=True on another thread. The error names the
    collective and the round or call, as on the message path
    (``wait_avoiding_group_allreduce (flush()): communicator closed while
    in flight``); before session 47 the board said only "communicator
    closed while in flight (cancel=True)"."""
    from wagma_comm.transport import shm_lock

    c = wagma_comm.init(timeout=30)
    w = _wagma(c, np.zeros(4), SIZE, sync_every=1 if where == "sync_round" else 1000,
               timeout=20.0)
    if where == "board_lock" and RANK == SLOW:
        assert shm_lock.acquire(w._board.locks[SLOW], time.monotonic() + 5.0)
    WORLD.Barrier()
    if RANK == 0:
        if where == "flush":
            outcome: dict[str, Any] = {}

            def run() -> None:
                try:
                    outcome["error"] = w.flush()
                except BaseException as exc:  # reported by the asserts below
                    outcome["error"] = exc

            flusher = threading.Thread(target=run)
            flusher.start()
            time.sleep(0.3)  # its agreement waits for the peers
            c.close(cancel=True)
            flusher.join(30)
            assert not flusher.is_alive()
            error, expected = outcome["error"], f"{w.kind} (flush()): "
        else:
            error, _ = _step_then_cancel(c, w, np.ones(4))
            expected = f"{w.kind} (round 0): "
        assert isinstance(error, wagma_comm.CommunicatorClosedError), error
        assert str(error).startswith(expected) and "cancel" in str(error), error
    WORLD.Barrier()
    if where == "board_lock" and RANK == SLOW:
        shm_lock.release(w._board.locks[SLOW])
    c.close(cancel=True)
    w.close()  # its communicator is closed: released locally


@needs_peers
def test_an_async_group_steps_handle_times_the_step() -> None:
    """``Handle.elapsed`` is seconds from submission to completion. Rank 0's
    async group step waits inside the board for the slow rank's lock, held
    for 0.5 s: its handle must say so. Before session 47 the handle was
    made after the round, so elapsed was about 0 however long the step took."""
    from wagma_comm.transport import shm_lock

    c = wagma_comm.init(timeout=30)
    w = _wagma(c, np.zeros(4), SIZE, sync_every=1000, timeout=20.0)
    if RANK == SLOW:
        assert shm_lock.acquire(w._board.locks[SLOW], time.monotonic() + 5.0)
    WORLD.Barrier()
    if RANK == SLOW:
        time.sleep(0.5)
        shm_lock.release(w._board.locks[SLOW])
    elif RANK == 0:
        h = w.step(np.ones(4), async_op=True)
        assert h.wait().round == 0
        assert h.elapsed is not None and h.elapsed >= 0.4, h.elapsed
    WORLD.Barrier()
    c.close(cancel=True)
    w.close()


@needs_peers
def test_a_sync_round_on_a_broken_communicator_breaks_the_collective() -> None:
    """Rank 0's communicator is broken (an allreduce its peers never join
    timed out), so its sync round's allreduce is refused at once. That must
    fail the step naming this collective and round and break the
    collective. Before session 47 the bare "communicator is broken" error
    came out of step(), the collective stayed usable, and the next step ran
    a group round on the board as if the sync round had happened."""
    c = wagma_comm.init(timeout=30)
    w = _wagma(c, np.zeros(4), 2, sync_every=2, timeout=5.0)
    w.step(np.zeros(4))  # round 0: a group round
    WORLD.Barrier()
    if RANK == 0:
        with pytest.raises(wagma_comm.CollectiveTimeoutError):
            c.allreduce(np.ones(2), timeout=0.5)  # nobody else calls it
        with pytest.raises(wagma_comm.CommunicatorClosedError) as info:
            w.step(np.zeros(4))  # round 1: synchronous
        assert str(info.value).startswith(f"{w.kind} (round 1): "), info.value
        assert w.statistics()["broken"] is not None
        with pytest.raises(wagma_comm.CommunicatorClosedError, match="broken"):
            w.step(np.zeros(4))  # round 2 would be a group round on the board
        assert w.statistics()["rounds"] == 1
    WORLD.Barrier()
    c.close(cancel=True)
    w.close()  # broken, or its communicator closed: released locally


@needs_peers
@not_at_3_or_8_ranks
def test_a_group_round_on_a_broken_communicator_raises_at_once() -> None:
    """Rank 0's communicator is broken (an allreduce its peers never join
    timed out). Its next steps are group rounds, which need nothing from
    the communicator, but they must fail at once naming the collective and
    the round, and break the collective, as a sync round does. Until
    session 48 they went on averaging on the board until the next sync
    round (round 999 here)."""
    c = wagma_comm.init(timeout=30)
    w = _wagma(c, np.zeros(4), SIZE, sync_every=1000, timeout=5.0)
    w.step(np.zeros(4))  # round 0: a group round
    WORLD.Barrier()
    if RANK == 0:
        with pytest.raises(wagma_comm.CollectiveTimeoutError) as broke:
            c.allreduce(np.ones(2), timeout=0.5)  # nobody else calls it
        started = time.monotonic()
        with pytest.raises(wagma_comm.CommunicatorClosedError) as info:
            w.step(np.full(4, 7.0))  # round 1: a group round
        assert time.monotonic() - started < 1.0
        assert str(info.value).startswith(
            f"{w.kind} (round 1): communicator is broken: {broke.value}"), info.value
        stats = w.statistics()
        assert stats["broken"] == str(info.value) and stats["rounds"] == 1, stats
        for call in (w.step, w.publish):
            with pytest.raises(wagma_comm.CommunicatorClosedError,
                               match=r"\(round 1\) is broken: .*communicator is broken"):
                call(np.full(4, 7.0))
        with pytest.raises(wagma_comm.CommunicatorClosedError, match=r"\(flush\(\)\) is broken"):
            w.flush()
        assert w.statistics()["rounds"] == 1
    WORLD.Barrier()
    c.close(cancel=True)
    w.close()  # broken, or its communicator closed: released locally
