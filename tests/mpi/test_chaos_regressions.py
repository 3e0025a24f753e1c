"""Regressions found by the randomised chaos driver (session 46): random but
rank-agreed sequences of collectives, persistent partial collectives, short
timeouts and cancelled closes. Each test is the minimised case of one
finding; size-agnostic like the other MPI tests.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import wagma_comm

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
# Rank-count independent, and about 20 s at 8 ranks on two cores: make test
# must stay under 20 minutes.
pytestmark = pytest.mark.skipif(SIZE != 2, reason="rank-count independent: run at 2 ranks")


@pytest.mark.parametrize("kind", ["solo", "majority", "wait_avoiding"])
@pytest.mark.parametrize("final", ["close", "flush", "flush_buf"])
def test_a_final_call_a_peer_never_makes_names_the_call_and_the_step_count(
        kind: str, final: str) -> None:
    """Rank 0 steps three times, then calls close(), flush() or flush(buf);
    the others never do. Its timeout must name what it was (the call) and
    where (its step count, 3, as a mismatch of final calls and the
    shared-memory path do) and the ranks that never came. On the message
    path it said "solo_allreduce (round 0): timed out ... in its arrival
    check": round 0 was the collective's count of flushes and closes (the
    engine Work's number), a round done long before, and no word of close()."""
    if SIZE == 1:
        pytest.skip("needs a peer that never makes the call")
    c = wagma_comm.init(timeout=30)
    try:
        x = np.zeros(4)
        if kind == "solo":
            p = c.solo_allreduce(x, 100, op="sum", timeout=1.0)
        elif kind == "majority":
            p = c.majority_allreduce(x, 100, op="sum", timeout=1.0)
        else:  # a named schedule: the message path, not the shared-memory board
            p = c.wait_avoiding_group_allreduce(x, SIZE, 100, timeout=1.0,
                                                algorithm="recursive_doubling")
        for _ in range(3):
            p.step(np.ones(4))
        WORLD.Barrier()
        if RANK == 0:
            with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
                if final == "close":
                    p.close()
                elif final == "flush":
                    p.flush()
                else:
                    p.flush(np.ones(4))
            err = info.value
            call = "close()" if final == "close" else "flush()"
            assert err.collective == p.kind, str(err)
            assert err.round == 3, str(err)
            assert call in str(err), str(err)
            assert err.ranks == tuple(range(1, SIZE)), str(err)
            assert str(err).count("ranks:") == 1, str(err)
            # The timeout broke the communicator, and what it refuses next
            # with names the same timeout (session 48's chaos run: "communicator
            # is broken: solo_allreduce (round 0): timed out ... arrival check",
            # the engine Work's number and no word of the call).
            with pytest.raises(wagma_comm.CommunicatorClosedError) as later:
                c.allreduce(np.ones(2))
            assert f"{p.kind} (round 3): {call}" in str(later.value), str(later.value)
        WORLD.Barrier()
    finally:
        c.close(cancel=True)
    WORLD.Barrier()


def test_a_cancelled_close_never_lets_a_peers_message_reach_the_next_communicator() -> None:
    """Rank 0 completes a small broadcast (its eager sends need no receiver);
    the others close with cancel=True without making that call (a call on
    another thread that lost the race with close, or an exception leaving
    ``with init() as comm``). Nothing was in flight on either side, so
    close() freed the MPI communicators everywhere and MPI gave their
    context ids to the next communicator: its first broadcast then received
    rank 0's old message (seen: 111.0 where the root sent 222.0, silently;
    a MessageSizeError where the sizes differ). A cancelled close cannot know
    what peers sent it, so it keeps its communicators, as a broken one does."""
    from conftest import message_path

    if SIZE == 1:
        pytest.skip("needs a receiver")
    with message_path():
        a = wagma_comm.init(timeout=30)
    if RANK == 0:
        a.broadcast(np.full(4, 111.0), root=0, algorithm="binomial")
    WORLD.Barrier()
    a.close(cancel=True)
    WORLD.Barrier()
    with message_path():
        b = wagma_comm.init(timeout=30)
    try:
        x = np.full(4, 222.0) if RANK == 0 else np.zeros(4)
        b.broadcast(x, root=0, algorithm="binomial")
        assert np.all(x == 222.0), f"rank {RANK} received {x} from a closed communicator"
        y = np.full(3, float(RANK + 1))
        b.allreduce(y, algorithm="recursive_doubling")
        assert np.all(y == SIZE * (SIZE + 1) / 2), y
    finally:
        b.close()
    WORLD.Barrier()


def test_an_exchange_limit_of_0_leaves_the_wagma_board_available() -> None:
    """WAGMA_SHM_MAX_BYTES only limits what algorithm=None reduces through
    the segment; the board takes models up to its own limit (a 1 KiB
    exchange limit keeps it). At 0 the segment is still there (a forced
    shared_memory allreduce runs), but the board judged the communicator by
    ``shared_memory_bytes == 0``: algorithm=None took the message path and
    algorithm="shared_memory" raised UnsupportedError("... the communicator
    has no shared-memory segment (this transport has no shared-memory
    segment)"), which was untrue (session 48's chaos run)."""
    from conftest import env_set

    if SIZE == 1:
        pytest.skip("one rank has no segment")
    with env_set("WAGMA_SHM_MAX_BYTES", "0"):
        c = wagma_comm.init(timeout=30)
    try:
        if c._shared is None:
            pytest.skip("no shared-memory segment on this machine")
        assert c.shared_memory_bytes == 0
        y = np.full(3, float(RANK + 1))
        c.allreduce(y, algorithm="shared_memory")
        assert np.all(y == SIZE * (SIZE + 1) / 2), y
        for algorithm in (None, "shared_memory"):
            w = c.wait_avoiding_group_allreduce(np.zeros(4), SIZE, 2, algorithm=algorithm)
            assert w.statistics()["path"] == "shared_memory", algorithm
            w.step(np.full(4, float(RANK)))
            model = np.full(4, float(RANK))
            w.step(model)  # the sync round: the global mean
            assert np.all(model == (SIZE - 1) / 2), model
            w.close()
    finally:
        c.close()
    WORLD.Barrier()
