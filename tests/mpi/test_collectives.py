"""Real multi-rank collectives under mpiexec; size-agnostic (1, 2, 3, 4, 8 ranks).

Every rank generates every rank's input from a shared seed, so each rank knows
the exact expected result without extra communication; bitwise agreement
across ranks is checked by gathering result bytes with plain mpi4py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

import wagma_comm
from wagma_comm import dtypes, groups
from wagma_comm.schedule import algorithms

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
FLOATS = ["float16", "bfloat16", "float32", "float64"]
INTS = ["int32", "int64", "uint8"]
REDUCE_ALGORITHMS = [a for a in algorithms.ALLREDUCE_ALGORITHMS if a != "native"]


def inputs(rank: int, count: int, name: str, op: str, seed: int) -> np.ndarray:
    """Rank ``rank``'s input: small values so integer sums/products stay exact
    and float results have a tight float64 reference."""
    rng = np.random.default_rng([seed, rank, count])
    dt = dtypes.BY_NAME[name]
    if name in INTS:
        hi = 3 if op == "prod" else 20
        return rng.integers(1, hi, count).astype(dt.numpy)
    vals = rng.uniform(0.5, 2.0 if op == "prod" else 8.0, count)
    return vals.astype(np.float32).astype(dt.numpy)


def reference(ranks: list[int], count: int, name: str, op: str, seed: int) -> np.ndarray:
    stack = np.stack([inputs(r, count, name, op, seed).astype(np.float64) for r in ranks])
    if op == "sum":
        return stack.sum(0)
    if op == "avg":
        s = stack.sum(0)
        return np.floor(s / len(ranks)) if name in INTS else s / len(ranks)
    return {"max": stack.max(0), "min": stack.min(0), "prod": stack.prod(0)}[op]


def tolerance(name: str, n: int) -> float:
    """Relative error bound: one rounding per reduction step plus the final one."""
    eps = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24,
           "float64": 2.0**-53}.get(name, 0.0)
    return 2 * (n + 1) * eps


def assert_bitwise_identical(arr: np.ndarray, members: list[int]) -> None:
    """All members of a group hold the same bytes."""
    blobs = WORLD.allgather(arr.tobytes())
    for r in members:
        assert blobs[r] == blobs[members[0]], f"rank {r} differs from rank {members[0]}"


def check(arr: np.ndarray, ranks: list[int], count: int, name: str, op: str, seed: int) -> None:
    expected = reference(ranks, count, name, op, seed)
    got = arr.astype(np.float64).reshape(-1)
    if name in INTS:
        np.testing.assert_array_equal(got, expected)
    else:
        np.testing.assert_allclose(got, expected, rtol=tolerance(name, len(ranks)))


@pytest.mark.parametrize("name", FLOATS + INTS)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod"])
@pytest.mark.parametrize("algorithm", [None, "recursive_doubling"])
def test_allreduce_every_dtype_and_op(comm: wagma_comm.Communicator, name: str, op: str,
                                      algorithm: str | None) -> None:
    """The default (the shared-memory exchange where every rank is on this
    host) and the message path."""
    count = 37
    arr = inputs(RANK, count, name, op, seed=1)
    out = comm.allreduce(arr, op, algorithm=algorithm)
    assert out is arr
    check(arr, list(range(SIZE)), count, name, op, seed=1)
    assert_bitwise_identical(arr, list(range(SIZE)))


@pytest.mark.parametrize("algorithm", REDUCE_ALGORITHMS)
@pytest.mark.parametrize("count", [1, 2, 7, 1000, 65537])
def test_allreduce_every_algorithm(comm: wagma_comm.Communicator, algorithm: str,
                                   count: int) -> None:
    for name in ("bfloat16", "float32", "int64"):
        arr = inputs(RANK, count, name, "sum", seed=2)
        comm.allreduce(arr, "sum", algorithm=algorithm)
        check(arr, list(range(SIZE)), count, name, "sum", seed=2)
        assert_bitwise_identical(arr, list(range(SIZE)))


@pytest.mark.parametrize("name", ["float32", "float64", "int32", "int64", "uint8"])
def test_native_algorithm(comm: wagma_comm.Communicator, name: str) -> None:
    arr = inputs(RANK, 100, name, "sum", seed=3)
    comm.allreduce(arr, "sum", algorithm="native")
    check(arr, list(range(SIZE)), 100, name, "sum", seed=3)
    if SIZE >= 2:
        arr = inputs(RANK, 100, name, "avg", seed=3)
        comm.group_allreduce(arr, 2, 0, "avg", algorithm="native")
        members = comm.group_of(2, 0)
        check(arr, members, 100, name, "avg", seed=3)


def test_native_refuses_half_precision_over_mpi(comm: wagma_comm.Communicator) -> None:
    with pytest.raises(wagma_comm.UnsupportedError) as info:
        comm.allreduce(np.ones(4, dtype=np.float16), algorithm="native")
    assert info.value.argument == "algorithm"


@pytest.mark.parametrize("tdt", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_tensors(comm: wagma_comm.Communicator, tdt: torch.dtype) -> None:
    name = str(tdt).split(".")[1]
    ref = inputs(RANK, 301, name, "avg", seed=4)
    t = torch.from_numpy(ref.astype(np.float32)).to(tdt)
    assert comm.allreduce(t, "avg") is t
    check(t.float().numpy(), list(range(SIZE)), 301, name, "avg", seed=4)
    assert_bitwise_identical(t.view(torch.uint8).numpy() if tdt != torch.float32
                             else t.numpy(), list(range(SIZE)))


@pytest.mark.parametrize("group_size", sorted({1, 2, 3, 4, SIZE}))
def test_group_allreduce_shifting_groups(comm: wagma_comm.Communicator, group_size: int) -> None:
    if group_size > SIZE:
        pytest.skip("group larger than the job")
    for step in range(groups.num_steps(SIZE, group_size) + 1):
        for name in ("float32", "bfloat16"):
            arr = inputs(RANK, 513, name, "avg", seed=5 + step)
            comm.group_allreduce(arr, group_size, step)  # default op: avg
            members = comm.group_of(group_size, step)
            assert RANK in members
            check(arr, members, 513, name, "avg", seed=5 + step)
            assert_bitwise_identical(arr, members)


def test_groups_agree_with_partition(comm: wagma_comm.Communicator) -> None:
    for s in range(1, SIZE + 1):
        parts = comm.groups(s, 1)
        assert sorted(r for g in parts for r in g) == list(range(SIZE))
        assert comm.group_of(s, 1) in parts


def test_group_mixing_reaches_the_global_mean(comm: wagma_comm.Communicator) -> None:
    """Averaging in the groups of steps 0..K-1 gives every rank the global mean."""
    for S in range(2, SIZE + 1):
        if not groups.is_exact(SIZE, S):
            continue
        x = inputs(RANK, 64, "float64", "avg", seed=6)
        for step in range(groups.num_steps(SIZE, S)):
            comm.group_allreduce(x, S, step, "avg")
        check(x, list(range(SIZE)), 64, "float64", "avg", seed=6)


@pytest.mark.parametrize("algorithm", algorithms.BROADCAST_ALGORITHMS)
def test_broadcast_every_root(comm: wagma_comm.Communicator, algorithm: str) -> None:
    for root in range(SIZE):
        for count in (1, 1000, 40001):
            arr = inputs(RANK, count, "float32", "sum", seed=7)
            assert comm.broadcast(arr, root=root, algorithm=algorithm) is arr
            np.testing.assert_array_equal(arr, inputs(root, count, "float32", "sum", seed=7))


def test_barrier(comm: wagma_comm.Communicator) -> None:
    assert comm.barrier() is None


def test_many_outstanding_handles_complete_in_any_order(comm: wagma_comm.Communicator) -> None:
    arrays, handles = [], []
    for i in range(40):
        name = ("float32", "bfloat16", "int32", "float64")[i % 4]
        count = 1 + (i * 977) % 5000
        a = inputs(RANK, count, name, "sum", seed=100 + i)
        arrays.append((a, name, count, i))
        if i % 5 == 4:
            members = comm.group_of(min(2, SIZE), i % 2)
            h = comm.group_allreduce(a, min(2, SIZE), i % 2, "sum", async_op=True)
        else:
            members = list(range(SIZE))
            h = comm.allreduce(a, "sum", async_op=True)
        handles.append((h, members))
    for (h, members), (a, name, count, i) in zip(reversed(handles), reversed(arrays)):
        assert h.wait() is a
        assert h.done and h.test()
        check(a, members, count, name, "sum", seed=100 + i)


def test_handle_wait_checks_its_timeout_and_names_the_one_given(
        comm: wagma_comm.Communicator) -> None:
    """wait("x") was a bare TypeError, wait(nan) waited out the collective's
    deadline on the shared-memory path and wait(1e300) overflowed the lock wait;
    the WaitTimeoutError named the time left, not the timeout passed."""
    a = np.full(10, float(RANK))
    if RANK == 0:
        h = comm.allreduce(a, async_op=True)
        for bad in ("x", True, float("nan"), -1.0):
            with pytest.raises(wagma_comm.InvalidArgumentError, match="timeout"):
                h.wait(timeout=bad)
        if SIZE > 1:
            with pytest.raises(wagma_comm.WaitTimeoutError, match=r"wait\(0\.05\)"):
                h.wait(timeout=0.05)  # the others have not started yet
        WORLD.Barrier()
    else:
        WORLD.Barrier()
        h = comm.allreduce(a, async_op=True)
    assert h.wait(timeout=1e300) is a  # beyond any lock wait: no limit of its own
    assert h.wait(timeout=np.float32(1)) is a
    assert a[0] == sum(range(SIZE))


def test_handle_wait_with_short_timeout_keeps_collective_alive(
        comm: wagma_comm.Communicator) -> None:
    a = np.full(10, float(RANK))
    if RANK == 0 and SIZE > 1:
        h = comm.allreduce(a, async_op=True)
        with pytest.raises(wagma_comm.WaitTimeoutError):
            h.wait(timeout=0.01)  # the others have not started yet
        WORLD.Barrier()
        h.wait()
    else:
        WORLD.Barrier()
        comm.allreduce(a)
    assert a[0] == sum(range(SIZE))
