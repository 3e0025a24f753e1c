"""Broadcast through the shared-memory exchange (runtime/shared.py): the
default at any size where the communicator has the segment; every root, dtypes, buffers of many
pieces, non-blocking calls in flight, a root that does not wait for its
readers, a mismatch, a missing root and a missing reader."""

from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import wagma_comm
from wagma_comm.dtypes import FLOAT32
from wagma_comm.runtime.shared import SharedCall, splits
from wagma_comm.transport.shm import DEPTH

from conftest import not_at_3_or_8_ranks, own_communicator, posted

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
SHARED = "shared_memory"


def _fresh(root: int, count: int, dtype: type, salt: int) -> np.ndarray:
    """Random data of ``root`` (any rank can make it), new on every run."""
    rng = np.random.default_rng([root, count, salt])
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 200, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


@pytest.fixture
def salt() -> int:
    """A seed every rank shares, different on every run."""
    return int(WORLD.bcast(random.randrange(1 << 30) if RANK == 0 else None))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.uint8])
def test_broadcasts_take_it_by_default_from_every_root(
        shared: wagma_comm.Communicator, dtype: type, salt: int) -> None:
    limit = shared.shared_memory_bytes
    itemsize = np.dtype(dtype).itemsize
    for root in range(SIZE):
        for count in (1, 7, 1001, max(1, limit // itemsize)):
            before = posted(shared)
            arr = _fresh(RANK, count, dtype, salt)  # each rank its own data
            assert shared.broadcast(arr, root=root) is arr
            np.testing.assert_array_equal(arr, _fresh(root, count, dtype, salt))
            assert posted(shared) == before + 1
    before = posted(shared)
    large = _fresh(RANK, limit // itemsize + 1, dtype, salt)  # beyond reductions' limit
    shared.broadcast(large, root=SIZE - 1)
    np.testing.assert_array_equal(large, _fresh(SIZE - 1, large.size, dtype, salt))
    assert posted(shared) == before + 1
    before = posted(shared)
    small = _fresh(RANK, 8, dtype, salt)
    shared.broadcast(small, algorithm="binomial")  # asked for: messages
    np.testing.assert_array_equal(small, _fresh(0, 8, dtype, salt))
    assert posted(shared) == before


@pytest.mark.parametrize("tdt", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_tensors_are_broadcast(shared: wagma_comm.Communicator, tdt: torch.dtype,
                                     salt: int) -> None:
    root = SIZE - 1
    want = torch.from_numpy(_fresh(root, 3001, np.float32, salt)).to(tdt)
    t = torch.from_numpy(_fresh(RANK, 3001, np.float32, salt)).to(tdt)
    assert shared.broadcast(t, root=root, algorithm=SHARED) is t
    assert torch.equal(t, want)


def test_buffers_of_many_pieces_from_every_root(shared: wagma_comm.Communicator,
                                                salt: int) -> None:
    row = shared._shared.segment.slot_bytes  # type: ignore[union-attr]
    count = (2 * DEPTH * row + row // 2) // 8 + 3  # more pieces than row sets, a short last
    for root in range(SIZE):
        arr = _fresh(RANK, count, np.float64, salt)
        shared.broadcast(arr, root=root, algorithm=SHARED)
        np.testing.assert_array_equal(arr, _fresh(root, count, np.float64, salt))


def test_nonblocking_broadcasts_in_flight_finish_in_any_wait_order(
        shared: wagma_comm.Communicator, salt: int) -> None:
    row = shared._shared.segment.slot_bytes  # type: ignore[union-attr]
    counts = [1, 9, 1 << 14, 3 * row // 4 + 5, 1 << 10, 2 * row // 4 + 1] * 2
    calls = []
    for i, count in enumerate(counts):
        root = i % SIZE
        arr = _fresh(RANK, count, np.float32, salt + i)
        calls.append((arr, root, i, shared.broadcast(arr, root=root, async_op=True,
                                                     algorithm=SHARED)))
    random.Random(RANK).shuffle(calls)  # every rank waits in another order
    for arr, root, i, handle in calls:
        assert handle.wait() is arr
        np.testing.assert_array_equal(arr, _fresh(root, arr.size, np.float32, salt + i))


def test_the_root_finishes_without_waiting_for_its_readers() -> None:
    """The root publishes DEPTH broadcasts (reusing one buffer) before any
    other rank calls one: if it waited for them, it would time out."""
    with own_communicator(30, "a root without readers needs two ranks") as c:
        arr = np.zeros(100, np.float32)
        if RANK == 0:
            for i in range(DEPTH):
                arr[:] = i + 1
                c.broadcast(arr, timeout=5.0)
            WORLD.Barrier()
        else:
            WORLD.Barrier()
            for i in range(DEPTH):
                c.broadcast(arr, timeout=5.0)
                np.testing.assert_array_equal(arr, np.full(100, i + 1, np.float32))
        c.allreduce(arr)  # and the exchange goes on in step
        np.testing.assert_array_equal(arr, np.full(100, SIZE * DEPTH, np.float32))


def test_a_broadcast_that_differs_is_a_mismatch_on_its_readers(
        shared: wagma_comm.Communicator) -> None:
    count = 3 if RANK == 0 else 2  # the root broadcasts another size
    arr = np.ones(count, np.float32)
    if RANK == 0:
        shared.broadcast(arr, algorithm=SHARED)  # the root reads nobody's description
    else:
        with pytest.raises(wagma_comm.MismatchError) as info:
            shared.broadcast(arr, algorithm=SHARED)
        assert list(info.value.ranks) == [0]
        assert "count=3" in str(info.value) and "count=2" in str(info.value)
    x = np.full(2, RANK + 1.0)
    # Rank 0 reduces where the others broadcast: a mismatch on every rank.
    with pytest.raises(wagma_comm.MismatchError) as info:
        if RANK == 0:
            shared.allreduce(x, algorithm=SHARED)
        else:
            shared.broadcast(x, root=0, algorithm=SHARED)
    assert list(info.value.ranks) == (list(range(1, SIZE)) if RANK == 0 else [0])
    x = np.full(2, RANK + 1.0)
    shared.allreduce(x)  # the communicator is still usable
    np.testing.assert_array_equal(x, np.full(2, SIZE * (SIZE + 1) / 2))


@not_at_3_or_8_ranks
def test_a_root_that_never_comes_is_a_timeout_naming_it() -> None:
    with own_communicator(30, "a missing root needs two ranks") as c:
        root = SIZE - 1
        if RANK != root:
            with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
                c.broadcast(np.ones(4), root=root, timeout=1.0)
            assert list(info.value.ranks) == [root]
            assert info.value.collective == "broadcast" and info.value.round == 0
            assert "did not arrive (shared-memory exchange)" in str(info.value)


@not_at_3_or_8_ranks
def test_a_reader_that_never_comes_times_out_a_later_call_naming_it() -> None:
    """The root's calls finish without the missing reader until its row
    would be rewritten: DEPTH calls on, that call times out naming it (on
    the other readers too: their rows wait for the same)."""
    with own_communicator(30, "a missing reader needs two ranks") as c:
        late = SIZE - 1
        if RANK != late:
            arr = np.ones(4)
            for _ in range(DEPTH):
                c.broadcast(arr, timeout=1.0)
            with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
                c.broadcast(arr, timeout=1.0)
            assert list(info.value.ranks) == [late]
            print("ERR", repr(info.value), flush=True)
            assert info.value.round == DEPTH
            assert "had not yet read this rank's part of round 0" in str(info.value)


# -- Reductions through the exchange (tests/mpi/test_shared.py is the main file) --

@not_at_3_or_8_ranks
def test_a_call_failed_at_its_post_never_writes_its_buffer_later() -> None:
    """Rank 0's blocking call of more pieces than row sets fails inside its
    post (piece DEPTH waits for piece 0, whose peers are late); rank 0 then
    reuses its buffer. When the others come and rank 0 closes, the pieces
    it had published must not be reduced into that buffer (close() finished
    them, into the caller's memory)."""
    with own_communicator(30, "a late rank needs two ranks") as c:
        per_row = c._shared.segment.slot_bytes // 8  # type: ignore[union-attr]
        x = np.ones((DEPTH + 2) * per_row)
        if RANK == 0:
            with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
                c.allreduce(x, algorithm=SHARED, timeout=0.5)
            assert info.value.round == 0 and 1 in info.value.ranks
            x[:] = 7.0  # the caller reuses its buffer
        else:
            time.sleep(1.5)
            try:
                c.allreduce(x, algorithm=SHARED, timeout=2.0)
            except wagma_comm.WagmaError:
                pass  # rank 0 gave up: whatever the others get is not under test
        WORLD.Barrier()  # the others have published the pieces rank 0 published
        if RANK == 0:
            c.close()
            assert np.all(x == 7.0)


def test_a_call_failed_at_its_post_counts_as_failed() -> None:
    """The root's broadcast DEPTH calls on fails at its post (a reader never
    comes): statistics() counts it failed, as a call failing after its post
    is (it was counted neither completed nor failed)."""
    with own_communicator(30, "a missing reader needs two ranks") as c:
        if RANK == 0:
            before = c.statistics()
            for _ in range(DEPTH):
                c.broadcast(np.ones(4), timeout=1.0)
            with pytest.raises(wagma_comm.CollectiveTimeoutError):
                c.broadcast(np.ones(4), timeout=1.0)
            after = c.statistics()
            assert (after["completed"] - before["completed"],
                    after["failed"] - before["failed"]) == (DEPTH, 1)


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (state T in /proc)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] == b"T"


@not_at_3_or_8_ranks
def test_a_post_behind_a_piece_reduced_in_shares_names_the_rank_it_waits_for() -> None:
    """Rank 1 posts a call whose piece is reduced in shares and is stopped
    (SIGSTOP: alive, not scheduled) before the others post it, so it never
    reduces its share. The others' calls DEPTH pieces on, with a shorter
    timeout, fail at their post waiting for that piece: their error must
    name rank 1 (every part had arrived, so it named no rank at all)."""
    with own_communicator(30, "a stopped rank needs two ranks") as c:
        per_row = c._shared.segment.slot_bytes // 4  # type: ignore[union-attr]
        if not splits(SharedCall("allreduce", tuple(range(SIZE)), per_row, FLOAT32, "sum", ""),
                      per_row):
            pytest.skip("rows too small to be reduced in shares here")
        pids = WORLD.allgather(os.getpid())
        others = WORLD.Split(0 if RANK != 1 else MPI.UNDEFINED, RANK)  # all but rank 1
        x = np.ones(per_row, np.float32)
        if RANK == 1:
            handle = c.allreduce(x, async_op=True, algorithm=SHARED, timeout=20.0)
            while c._shared._queue:  # type: ignore[union-attr]
                time.sleep(1e-3)  # the progress thread publishes it
            WORLD.send(None, dest=0)  # rank 0 stops this process, then resumes it
            try:
                handle.wait()
            except wagma_comm.WagmaError:
                pass  # the others' communicators broke: not under test
            return
        if RANK == 0:
            WORLD.recv(source=1)
            os.kill(pids[1], signal.SIGSTOP)
            while not _stopped(pids[1]):
                time.sleep(1e-3)
        try:
            others.Barrier()  # rank 1 is stopped
            c.allreduce(x, async_op=True, algorithm=SHARED, timeout=20.0)
            for _ in range(DEPTH - 1):
                c.allreduce(np.ones(2), async_op=True, timeout=20.0)
            with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
                c.allreduce(np.ones(2), timeout=2.0)
        finally:
            others.Barrier()
            if RANK == 0:
                os.kill(pids[1], signal.SIGCONT)
            others.Free()
        assert info.value.round == DEPTH
        assert 1 in info.value.ranks, str(info.value)  # (a slow other may be named too)
        c.close(cancel=True)  # the calls rank 1 never joins (the first it may finish)
