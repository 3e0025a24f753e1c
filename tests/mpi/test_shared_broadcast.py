"""Broadcast through the shared-memory exchange (runtime/shared.py): the
default at any size where the communicator has the segment; every root, dtypes, buffers of many
pieces, non-blocking calls in flight, a root that does not wait for its
readers, a mismatch, a missing root and a missing reader."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from mpi4py import MPI

import wagma_comm
from wagma_comm.transport.shm import DEPTH

from conftest import own_communicator, posted

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


def test_a_root_that_never_comes_is_a_timeout_naming_it() -> None:
    with own_communicator(30, "a missing root needs two ranks") as c:
        root = SIZE - 1
        if RANK != root:
            with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
                c.broadcast(np.ones(4), root=root, timeout=1.0)
            assert list(info.value.ranks) == [root]
            assert info.value.collective == "broadcast" and info.value.round == 0
            assert "did not arrive (shared-memory exchange)" in str(info.value)


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
            assert info.value.round == DEPTH
            assert "had not yet read this rank's part of round 0" in str(info.value)
