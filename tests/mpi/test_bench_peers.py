"""The ``--vs`` peers of ``wagma bench`` (wagma_comm.bench.peers) compute the
collective they stand for, in place on the caller's NumPy buffer.

Size-agnostic (1, 2, 3, 4, 8 ranks). Every rank builds every rank's input from
a shared seed, so each knows the exact expected result. Inputs are small
integers of both signs (exact in every dtype, bfloat16 included), so sums and
maxima are exact, only avg rounds, and integer avg must floor (not truncate).
"""

from __future__ import annotations

import gc
import time
from typing import Any, Iterator

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from conftest import not_at_3_or_8_ranks

from wagma_comm import groups
from wagma_comm.bench.peers import HOST_PEERS, Peer, close_peers, make_peers, parse_vs
from wagma_comm.errors import (
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
TIMEOUT_S = 60.0  # a hung peer collective fails the test within a minute
NUMPY = {"float32": np.float32, "float64": np.float64, "int32": np.int32,
         "bfloat16": ml_dtypes.bfloat16}
COUNT = 1031  # odd: no algorithm gets an evenly divisible buffer by accident


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, Peer]]:
    made = make_peers(",".join(HOST_PEERS), WORLD, timeout=TIMEOUT_S)
    yield {p.name: p for p in made}
    close_peers(made)


def inputs(rank: int, name: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    return rng.integers(-12, 20, COUNT).astype(NUMPY[name])


def reference(ranks: list[int], name: str, op: str, seed: int) -> np.ndarray:
    stack = np.stack([inputs(r, name, seed).astype(np.float64) for r in ranks])
    if op == "sum":
        return stack.sum(0)
    if op == "max":
        return stack.max(0)
    avg = stack.sum(0) / len(ranks)
    return np.floor(avg) if name == "int32" else avg


def check(arr: np.ndarray, ranks: list[int], name: str, op: str, seed: int) -> None:
    expected = reference(ranks, name, op, seed)
    got = arr.astype(np.float64)
    if name == "int32" or op != "avg":
        np.testing.assert_array_equal(got, expected)
    else:  # gloo averages bfloat16 in bfloat16: sum exact here, one rounding in the divide
        rtol = {"bfloat16": 2.0**-7, "float32": 2.0**-22, "float64": 2.0**-50}[name]
        np.testing.assert_allclose(got, expected, rtol=rtol)


def supported(peer: str, name: str) -> bool:
    return not (peer.startswith("mpi") and name == "bfloat16")


@pytest.mark.parametrize("peer", HOST_PEERS)
@pytest.mark.parametrize("name", list(NUMPY))
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_allreduce_in_place(peers: dict[str, Peer], peer: str, name: str, op: str) -> None:
    arr = inputs(RANK, name, seed=3)
    call = peers[peer].allreduce(arr, op)
    if not supported(peer, name):
        assert call is None
        assert "bfloat16" in (peers[peer].why_not(arr, op) or "")
        return
    assert call is not None and peers[peer].why_not(arr, op) is None
    call()
    check(arr, list(range(SIZE)), name, op, seed=3)
    # The callable is timed many times: it must redo the work on fresh data.
    arr[:] = inputs(RANK, name, seed=4)
    call()
    check(arr, list(range(SIZE)), name, op, seed=4)


@pytest.mark.parametrize("peer", HOST_PEERS)
@pytest.mark.parametrize("name", list(NUMPY))
def test_broadcast_in_place(peers: dict[str, Peer], peer: str, name: str) -> None:
    root = SIZE - 1
    arr = inputs(RANK, name, seed=5)
    call = peers[peer].broadcast(arr, root)
    assert call is not None
    call()
    np.testing.assert_array_equal(arr, inputs(root, name, seed=5))


@pytest.mark.skipif(SIZE < 2, reason="groups of 2 need 2 ranks")
@pytest.mark.parametrize("peer", HOST_PEERS)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_group_allreduce_pairs(peers: dict[str, Peer], peer: str, op: str) -> None:
    # Two different partitions (at 3 ranks: {0,2},{1} then {0,1},{2}): a cache
    # that ignored the partition would reduce over the wrong group.
    for step in range(groups.num_steps(SIZE, 2)):
        partition = groups.partition(SIZE, 2, step)
        mine = list(groups.group_of(RANK, SIZE, 2, step))
        arr = inputs(RANK, "float32", seed=6 + step)
        call = peers[peer].group_allreduce(arr, op, mine, partition)
        assert call is not None
        call()
        check(arr, mine, "float32", op, seed=6 + step)


def test_group_allreduce_rejects_a_wrong_group(peers: dict[str, Peer]) -> None:
    partition = [list(range(SIZE))]
    arr = inputs(RANK, "float32", seed=7)
    with pytest.raises(InvalidArgumentError) as err:
        peers["mpi"].group_allreduce(arr, "sum", [RANK, SIZE], partition)
    assert err.value.argument == "ranks"


def test_unsupported_dtype_is_none_not_converted(peers: dict[str, Peer]) -> None:
    arr = np.ones(8, np.float16)
    assert peers["mpi"].allreduce(arr, "sum") is None
    assert "float16" in (peers["mpi"].why_not(arr, "sum") or "")
    assert peers["gloo"].allreduce(arr, "sum") is not None


def test_parse_vs() -> None:
    assert parse_vs("mpi, gloo,mpi") == ["mpi", "gloo"]
    assert parse_vs("none") == []
    assert parse_vs(["nccl"]) == ["nccl"]


@pytest.mark.parametrize("text", ["mpi,glo", "openmpi", "mpi,,horovod"])
def test_unknown_names_rejected(text: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        make_peers(text, WORLD)
    assert err.value.argument == "--vs"
    assert "unknown peer" in str(err.value)


def test_nccl_without_gpu_says_why() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the nccl peer would start")
    (nccl,) = make_peers("nccl", WORLD)
    arr = np.ones(4, np.float32)
    assert nccl.reason is not None and "CUDA" in nccl.reason
    assert nccl.allreduce(arr, "sum") is None
    assert nccl.broadcast(arr, 0) is None
    nccl.close()


def test_versions(peers: dict[str, Peer]) -> None:
    assert "MPI" in peers["mpi"].version() or "MPICH" in peers["mpi"].version()
    assert peers["gloo"].version().startswith("torch ")


# -- regressions (review session 44) ----------------------------------------------

def _wait_all(reqs: list[MPI.Request], seconds: float = 30.0) -> None:
    """MPI_Waitall under a deadline (drives MPI progress for requests left behind)."""
    end = time.monotonic() + seconds
    while not MPI.Request.Testall(reqs):
        assert time.monotonic() < end, "peers did not complete within the deadline"
        time.sleep(0.001)


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 0, -1.0, "10", True])
def test_timeout_must_be_finite_seconds(timeout: object) -> None:
    # inf made mpi-nb wait forever (and torch's timedelta overflow); a string
    # or a bool slipped through as a TypeError or a 1 s timeout.
    with pytest.raises(InvalidArgumentError) as err:
        make_peers("mpi-nb", WORLD, timeout=timeout)  # type: ignore[arg-type]
    assert err.value.argument == "timeout"


@pytest.mark.skipif(SIZE < 2, reason="needs a rank where gloo can run and one where not")
def test_peer_unavailable_on_one_rank_is_unavailable_on_all(comm: Any) -> None:
    # Rank 0 could start gloo, the others not (here: their buffers are said to
    # be on a GPU; on a cluster: no torch, no GPU on some node). Rank 0 went on
    # alone into the TCPStore bootstrap's MPI allgather and hung there forever.
    pytest.importorskip("torch")
    (gloo,) = make_peers("gloo", WORLD, device="cpu" if RANK == 0 else "cuda")
    try:
        assert gloo.reason is not None
        if RANK == 0:
            assert "rank 1" in gloo.reason and "device is 'cuda'" in gloo.reason
        assert gloo.allreduce(np.ones(4, np.float32), "sum") is None
        comm.barrier(timeout=20.0)  # every rank got here: none is stuck in the bootstrap
    finally:
        gloo.close()


@pytest.mark.skipif(SIZE < 2, reason="needs a late rank")
def test_mpi_nb_after_a_timeout_is_broken() -> None:
    # After a timeout the abandoned MPI_Iallreduce is still posted on the peer's
    # communicator: a later call would be matched against it by the late ranks
    # (silently wrong sums). It must refuse, as a wagma communicator does.
    (peer,) = make_peers("mpi-nb", WORLD, timeout=0.5 if RANK == 0 else 30.0)
    try:
        arr = np.ones(COUNT, np.float32)
        call = peer.allreduce(arr, "sum")
        assert call is not None
        call()  # round 1, every rank on time
        np.testing.assert_array_equal(arr, SIZE)
        if RANK == 0:
            with pytest.raises(CollectiveTimeoutError) as err:
                call()  # round 2: the other ranks wait for the message below
            assert err.value.collective == "MPI_Iallreduce" and err.value.round == 2
            go = [WORLD.isend(None, dest=r, tag=44) for r in range(1, SIZE)]
            with pytest.raises(CommunicatorClosedError):
                call()
            assert "broken" in (peer.why_not(arr, "sum") or "")
            assert peer.allreduce(arr, "sum") is None
            _wait_all(go)
        else:
            _wait_all([WORLD.irecv(source=0, tag=44)])
            call()  # matches rank 0's abandoned round 2
        _wait_all([WORLD.Ibarrier()])
    finally:
        peer.close()


@pytest.mark.parametrize("peer", HOST_PEERS)
@pytest.mark.parametrize("root", [0.5, 1.0, True, -1, SIZE])
def test_broadcast_root_must_be_an_int_rank(peers: dict[str, Peer], peer: str,
                                            root: object) -> None:
    # mpi4py truncated root=0.5 to 0 (a broadcast from another root than asked);
    # torch raised an untyped TypeError only when the timed call ran.
    arr = inputs(RANK, "float32", seed=8)
    with pytest.raises(InvalidArgumentError) as err:
        peers[peer].broadcast(arr, root)  # type: ignore[arg-type]
    assert err.value.argument == "root"


# -- regressions (review session 45) ----------------------------------------------
# A blocking MPI or torch call that one rank never joins used to hang: these
# tests run under a thread timeout, so the old hang fails the job.

@pytest.mark.timeout(120, method="thread")
@pytest.mark.skipif(SIZE < 2, reason="needs a rank with bad arguments and one without")
@pytest.mark.parametrize("peer", HOST_PEERS)
def test_group_allreduce_bad_ranks_on_one_rank_fail_on_all(peers: dict[str, Peer],
                                                           peer: str) -> None:
    # Rank 0 raised InvalidArgumentError locally while the others blocked for
    # ever in MPI_Comm_split (mpi) or torch's new_group (gloo: until its
    # timeout, then an untyped torch error).
    partition = [list(range(SIZE))]
    arr = inputs(RANK, "float32", seed=9)
    started = time.monotonic()
    with pytest.raises(InvalidArgumentError) as err:
        peers[peer].group_allreduce(arr, "sum", [SIZE] if RANK == 0 else list(range(SIZE)),
                                    partition)
    assert err.value.argument == "ranks"
    assert time.monotonic() - started < TIMEOUT_S / 2  # refused, not timed out
    if RANK != 0:
        assert "rank 0" in str(err.value)
    # Nothing was created and the peer still works on the same partition.
    call = peers[peer].group_allreduce(arr, "sum", list(range(SIZE)), partition)
    assert call is not None
    call()
    check(arr, list(range(SIZE)), "float32", "sum", seed=9)


@pytest.mark.timeout(120, method="thread")
@pytest.mark.skipif(SIZE < 2, reason="needs two partitions")
@pytest.mark.parametrize("peer", HOST_PEERS)
def test_group_allreduce_refuses_partitions_that_differ(peers: dict[str, Peer],
                                                        peer: str) -> None:
    # Rank 0 passed singletons, the others the whole world. MPI_Comm_split put
    # rank 0 (color 0 either way) in a group with rank 1: rank 0's "alone"
    # reduction summed over two ranks, silently. gloo's new_group counts differed.
    mine = [[r] for r in range(SIZE)] if RANK == 0 else [list(range(SIZE))]
    ranks = [RANK] if RANK == 0 else list(range(SIZE))
    arr = inputs(RANK, "float32", seed=10)
    with pytest.raises(InvalidArgumentError) as err:
        peers[peer].group_allreduce(arr, "sum", ranks, mine)
    assert err.value.argument == "partition"
    assert "same partition" in str(err.value)


@pytest.mark.parametrize("bad", [[[0.5 + r] for r in range(SIZE)], [["0"] + list(range(1, SIZE))],
                                 [[False] + list(range(1, SIZE))], 7],
                         ids=["float", "str", "bool", "int"])
def test_group_allreduce_partition_must_be_int_ranks(peers: dict[str, Peer], bad: Any) -> None:
    # int() made [[0.5], [1.5]] the singletons, ["0", 1] and [False, 1] the
    # whole world (a partition nobody passed was used); an int partition
    # raised an untyped TypeError. ``ranks`` is this rank's group in what
    # int() made of it, so only the partition is wrong.
    ranks = [RANK] if isinstance(bad, list) and len(bad) == SIZE else list(range(SIZE))
    arr = inputs(RANK, "float32", seed=11)
    with pytest.raises(InvalidArgumentError) as err:
        peers["mpi"].group_allreduce(arr, "sum", ranks, bad)
    assert err.value.argument == "partition"


@pytest.mark.timeout(120, method="thread")
@pytest.mark.skipif(SIZE < 2, reason="needs ranks that ask for different peers")
@pytest.mark.parametrize("theirs", [("mpi", "none"), ("gloo", "nccl"), ("gloo", "gloo,mpi")],
                         ids=["mpi/none", "gloo/nccl", "gloo/gloo+mpi"])
def test_make_peers_refuses_names_that_differ(theirs: tuple[str, str]) -> None:
    # Rank 0 went alone into a collective the others never called: MPI's Dup
    # (mpi), the TCPStore bootstrap (gloo against an unavailable nccl), or the
    # process group of another backend (gloo against nccl, with a GPU).
    if "gloo" in theirs[0]:
        pytest.importorskip("torch")
    started = time.monotonic()
    with pytest.raises(InvalidArgumentError) as err:
        make_peers(theirs[0] if RANK == 0 else theirs[1], WORLD, timeout=TIMEOUT_S)
    assert err.value.argument == "--vs"
    assert "same peers" in str(err.value) and ("rank 0" if RANK else "rank 1") in str(err.value)
    assert time.monotonic() - started < TIMEOUT_S / 2
    made = make_peers("mpi", WORLD, timeout=TIMEOUT_S)  # nothing half made is in the way
    close_peers(made)


@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("timeout", [1e10, 1e15])
def test_huge_torch_timeout_is_clamped(timeout: float) -> None:
    # torch keeps deadlines in int64 nanoseconds: 1e10 s made the TCPStore time
    # out at once (UnsupportedError), 9e9 s hung, 1e15 s overflowed timedelta.
    pytest.importorskip("torch")
    (gloo,) = make_peers("gloo", WORLD, timeout=timeout)
    try:
        assert gloo.reason is None
        arr = inputs(RANK, "float32", seed=12)
        call = gloo.group_allreduce(arr, "sum", list(range(SIZE)), [list(range(SIZE))])
        assert call is not None
        call()
        check(arr, list(range(SIZE)), "float32", "sum", seed=12)
    finally:
        gloo.close()


@pytest.mark.skipif(SIZE < 2, reason="needs a late rank")
def test_mpi_nb_timeout_keeps_the_abandoned_buffer() -> None:
    # The abandoned MPI_Iallreduce still writes into its buffer when the late
    # ranks come; the peer kept no reference, so once the caller dropped the
    # buffer MPI wrote into whatever reused that memory (here: a new array).
    count = 1 << 17  # 512 KiB: its own mapping, reused by the next of that size
    (peer,) = make_peers("mpi-nb", WORLD, timeout=0.5 if RANK == 0 else 30.0)
    try:
        arr = np.ones(count, np.float32)
        call = peer.allreduce(arr, "sum")
        assert call is not None
        if RANK == 0:
            with pytest.raises(CollectiveTimeoutError):
                call()
            del arr, call
            gc.collect()
            victim = np.zeros(count, np.float32)
            go = [WORLD.isend(None, dest=r, tag=45) for r in range(1, SIZE)]
            _wait_all(go)
        else:
            _wait_all([WORLD.irecv(source=0, tag=45)])
            call()  # completes rank 0's abandoned call
            np.testing.assert_array_equal(arr, SIZE)
        _wait_all([WORLD.Ibarrier()])  # drives rank 0's MPI progress
        if RANK == 0:
            assert not np.any(victim), "MPI wrote into memory the peer had let go"
    finally:
        peer.close()


@pytest.mark.timeout(120, method="thread")
@pytest.mark.skipif(SIZE < 2, reason="needs a missing rank")
@not_at_3_or_8_ranks
def test_group_allreduce_names_a_rank_that_never_calls() -> None:
    # Rank 0 never creates the groups: the others blocked for ever in
    # MPI_Comm_split. Now a timeout naming the call, its round and rank 0,
    # after which the peer refuses (its receives for rank 0 are still posted).
    (peer,) = make_peers("mpi", WORLD, timeout=3.0)
    try:
        if RANK != 0:
            arr = inputs(RANK, "float32", seed=13)
            with pytest.raises(CollectiveTimeoutError) as err:
                peer.group_allreduce(arr, "sum", list(range(SIZE)), [list(range(SIZE))])
            assert err.value.collective == "mpi group_allreduce"
            assert err.value.round == 1 and err.value.ranks == (0,)
            assert "broken" in (peer.why_not(arr, "sum") or "")
            assert peer.group_allreduce(arr, "sum", list(range(SIZE)),
                                        [list(range(SIZE))]) is None
        _wait_all([WORLD.Ibarrier()])
    finally:
        peer.close()
