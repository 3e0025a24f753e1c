"""Native collectives over groups: a call never precedes its group's MPI
communicator, and calls on one group keep their order (Work.requires)."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import pytest
from mpi4py import MPI

from conftest import not_at_3_or_8_ranks

import wagma_comm
from wagma_comm import Communicator

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


@pytest.mark.parametrize("step", [0, 1])
def test_back_to_back_async_native_calls_on_a_new_group(comm: Communicator, step: int) -> None:
    """The second call's group is still being created by the first call when
    it is submitted (it used to fail with KeyError, or mismatch its order)."""
    if SIZE < 3:
        pytest.skip("needs a group smaller than the world")
    group_size = 2
    members = comm.group_of(group_size, step + 5)  # a partition no other test used
    bufs = [np.full(7, (RANK + 1) * (k + 1), np.float32) for k in range(4)]
    handles = [comm.group_allreduce(b, group_size, step + 5, "sum", async_op=True,
                                    algorithm="native") for b in bufs]
    for k, h in enumerate(handles):
        h.wait()
        expected = sum((r + 1) * (k + 1) for r in members)
        np.testing.assert_array_equal(bufs[k], np.full(7, expected, np.float32))


def test_failed_setup_is_redone_by_the_next_call() -> None:
    """A collective that was to create a group's communicator fails before its
    set-up runs (a debug mismatch): the next native call on the group sets it
    up again instead of waiting for it forever."""
    if SIZE < 3:
        pytest.skip("needs a group smaller than the world")
    c = wagma_comm.init(timeout=20, debug=True)
    try:
        count = 4 if RANK == 0 else 8  # rank 0 disagrees: MismatchError everywhere
        with pytest.raises(wagma_comm.MismatchError):
            c.group_allreduce(np.ones(count, np.float32), 2, 0, algorithm="native")
        x = np.full(4, RANK + 1, np.float32)
        c.group_allreduce(x, 2, 0, "sum", algorithm="native")
        members = c.group_of(2, 0)
        np.testing.assert_array_equal(x, np.full(4, sum(r + 1 for r in members), np.float32))
    finally:
        MPI.COMM_WORLD.Barrier()
        c.close()


def _late_partner_case(run_early: Callable[[wagma_comm.Communicator, int, Callable[[], None]],
                                            None],
                       run_late: Callable[[wagma_comm.Communicator], None]) -> None:
    """Rank 0 runs ``run_early(c, partner, release)`` while its group partner
    at step 0 holds back (so the group's set-up cannot finish), whatever the
    timing: the partner runs ``run_late(c)`` only once rank 0 calls
    ``release()`` (or failed)."""
    if SIZE < 3:
        pytest.skip("needs a group smaller than the world (its set-up can be pending)")
    c = wagma_comm.init(timeout=20)
    partner = [r for r in c.group_of(2, 0, rank=0) if r != 0][0]
    released: list[bool] = []

    def release() -> None:
        if not released:
            released.append(True)
            MPI.COMM_WORLD.send(None, dest=partner, tag=77)
    try:
        if RANK == 0:
            try:
                run_early(c, partner, release)
            finally:
                release()
        elif RANK == partner:
            MPI.COMM_WORLD.recv(source=0, tag=77)
            run_late(c)
    finally:
        MPI.COMM_WORLD.Barrier()
        c.close(cancel=True)


def _expire_queued_early(c: wagma_comm.Communicator, partner: int,
                         release: Callable[[], None]) -> None:
    """Rank 0: the second of three native calls times out queued behind the
    group's set-up (the partner holds back); the set-up then finishes."""
    first = np.full(4, 1.0, np.float32)
    h1 = c.group_allreduce(first, 2, 0, "sum", algorithm="native", async_op=True)
    h2 = c.group_allreduce(np.full(4, 2.0, np.float32), 2, 0, "sum",
                           algorithm="native", async_op=True, timeout=1)
    h3 = c.group_allreduce(np.full(4, 100.0, np.float32), 2, 0, "sum",
                           algorithm="native", async_op=True)
    with pytest.raises(wagma_comm.CollectiveTimeoutError,
                       match="before it could start.*group set-up") as info:
        h2.wait()
    assert info.value.ranks == (partner,)
    assert c.statistics()["broken"] is not None
    with pytest.raises(wagma_comm.CommunicatorClosedError, match="round 1"):
        h3.wait()
    with pytest.raises(wagma_comm.CommunicatorClosedError, match="broken"):
        c.allreduce(np.ones(4, np.float32), async_op=True)
    release()  # now the set-up may finish
    h1.wait()
    np.testing.assert_array_equal(first, np.full(4, 2.0, np.float32))


def _expire_queued_late(c: wagma_comm.Communicator) -> None:
    """The partner: all three calls posted; the two rank 0 skipped time out
    (their messages stay with MPI, unmatched)."""
    mine = [np.full(4, v, np.float32) for v in (1.0, 10.0, 1000.0)]
    handles = [c.group_allreduce(x, 2, 0, "sum", algorithm="native", async_op=True,
                                 timeout=1 if k else 20) for k, x in enumerate(mine)]
    handles[0].wait()
    np.testing.assert_array_equal(mine[0], np.full(4, 2.0, np.float32))
    for h in handles[1:]:  # rank 0 never posts them: never a wrong sum
        with pytest.raises(wagma_comm.CollectiveTimeoutError):
            h.wait()


@not_at_3_or_8_ranks
def test_a_call_that_times_out_queued_breaks_the_communicator_and_names_the_ranks() -> None:
    """A native call that expires while queued behind its group's set-up was
    never posted: it breaks the communicator (as an in-flight timeout does)
    and names the partner the set-up waits for; the call queued behind it
    fails rather than being matched by MPI with the partner's skipped call.
    Before, nothing broke and the next call returned a wrong sum on both."""
    _late_partner_case(_expire_queued_early, _expire_queued_late)


def test_a_broken_communicators_contexts_are_never_reused() -> None:
    """After the case above the partner's two skipped calls' messages are
    still with MPI on rank 0. Had rank 0 freed its communicators, MPI would
    hand their contexts to the next ones, and a native call over another
    group of rank 0's would receive those messages: a wrong sum (25 of 25
    elements wrong in the 8-rank stress test). A broken communicator's
    contexts are kept instead."""
    _late_partner_case(_expire_queued_early, _expire_queued_late)
    c = wagma_comm.init(timeout=20)
    try:
        for step in range(1, 7):
            x = np.full(5, (RANK + 1) * step, np.float32)
            c.group_allreduce(x, 2, step, "sum", algorithm="native")
            want = sum((r + 1) * step for r in c.group_of(2, step))
            np.testing.assert_array_equal(x, np.full(5, want, np.float32))
    finally:
        MPI.COMM_WORLD.Barrier()
        c.close()


def test_a_queued_call_fails_at_its_own_deadline_behind_a_longer_one() -> None:
    """A call with a 1 s timeout queued behind a call with a longer one (both
    behind a group's set-up) fails at its own deadline with the timeout
    naming the partner, not 5 s later with a false "engine stopped"; the
    earlier queued call still runs, in order, once the partner comes."""
    bufs = [np.full(4, 1.0, np.float32), np.full(4, 2.0, np.float32)]

    def early(c: wagma_comm.Communicator, partner: int, release: Callable[[], None]) -> None:
        natives = [c.group_allreduce(b, 2, 0, "sum", algorithm="native", async_op=True)
                   for b in bufs]
        short = c.allreduce(np.ones(4, np.float32), algorithm="recursive_doubling",
                            async_op=True, timeout=1)
        with pytest.raises(wagma_comm.CollectiveTimeoutError,
                           match="before it could start") as info:
            short.wait()
        assert info.value.ranks == (partner,)
        assert not natives[1].done  # earlier in the queue: not failed with it
        release()
        for h in natives:
            h.wait()
        np.testing.assert_array_equal(bufs[1], np.full(4, 4.0, np.float32))

    def late(c: wagma_comm.Communicator) -> None:
        mine = [np.full(4, 1.0, np.float32), np.full(4, 2.0, np.float32)]
        for x in mine:
            c.group_allreduce(x, 2, 0, "sum", algorithm="native")
        np.testing.assert_array_equal(mine[0], np.full(4, 2.0, np.float32))
        np.testing.assert_array_equal(mine[1], np.full(4, 4.0, np.float32))

    _late_partner_case(early, late)


def test_group_set_ups_run_in_call_order() -> None:
    """A rank sets up one new group at a time, in call order. Each set-up
    ends in a blocking MPI_Comm_create_group; started out of order, ranks
    could each block in a different group's creation waiting for a peer
    blocked in a third (a cycle, forever). Here rank 0 comes late to its
    step-0 group, so its partner p may set up its step-1 group (with q) only
    after that: q's step-1 call ends after rank 0 came, not at once."""
    if SIZE < 4:
        pytest.skip("needs step-1 groups without rank 0 whose members wait for it")
    c = wagma_comm.init(timeout=20)
    late_s = 1.0
    partner = [r for r in c.group_of(2, 0, rank=0) if r != 0][0]
    q = [r for r in c.group_of(2, 1, rank=partner) if r != partner][0]
    try:
        MPI.COMM_WORLD.Barrier()
        if RANK == 0:
            time.sleep(late_s)
        start = time.monotonic()
        bufs = [np.full(3, RANK + 1.0, np.float32) for _ in range(2)]
        handles = [c.group_allreduce(b, 2, step, "sum", algorithm="native", async_op=True)
                   for step, b in enumerate(bufs)]
        handles[1].wait()
        ended = time.monotonic() - start
        handles[0].wait()
        for step, b in enumerate(bufs):
            want = sum(r + 1.0 for r in c.group_of(2, step))
            np.testing.assert_array_equal(b, np.full(3, want, np.float32))
        if RANK == q:
            assert ended >= 0.5 * late_s, (
                f"rank {q}'s step-1 group was set up by rank {partner} {ended:.3f} s in, "
                f"before rank {partner}'s earlier set-up with the late rank 0")
    finally:
        MPI.COMM_WORLD.Barrier()
        c.close()
