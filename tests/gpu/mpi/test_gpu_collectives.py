"""Collectives on GPU buffers against a float64 host reference, at any number
of ranks: every dtype, odd lengths, torch and CuPy inputs, both lowerings of
the group allreduce, and the stream contract (no user synchronisation)."""

from __future__ import annotations

import numpy as np
import pytest

from wagma_comm import dtypes
from wagma_comm.schedule import algorithms

torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
         "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
         "uint8": torch.uint8}
TOL = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12}


def _inputs(comm, n, dtype, seed):
    """Every rank's input (so each rank knows the reference), fresh per test."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(comm.size):
        if dtype.is_float:
            out.append((rng.standard_normal(n) * 4).astype(dtype.numpy))
        else:
            out.append(rng.integers(0, 50, n).astype(dtype.numpy))
    return out


def _check(got, inputs, members, op, dtype):
    stack = np.stack([inputs[r].astype(np.float64) for r in members])
    ref = {"sum": stack.sum(0), "avg": stack.sum(0) / len(members), "max": stack.max(0),
           "min": stack.min(0), "prod": stack.prod(0)}[op]
    got = got.astype(np.float64)
    if dtype.is_float:
        err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
        assert err < TOL[dtype.name] * max(1, len(members) / 2), err
    else:
        if op == "avg":
            ref = np.floor(stack.sum(0) / len(members))
        if op in ("sum", "prod"):
            bits = dtype.itemsize * 8
            mod = 2 ** bits
            ref = np.mod(ref, mod)
            got = np.mod(got, mod)
        np.testing.assert_array_equal(got, ref)


def _torch_buffer(host, dtype):
    t = torch.from_numpy(host.view(dtype.storage).copy()).cuda()
    return t.view(TORCH[dtype.name]) if dtype.is_half else t


def _torch_host(t, dtype):
    return t.view(torch.int16).cpu().numpy().view(dtype.numpy) if dtype.is_half \
        else t.cpu().numpy()


@pytest.mark.parametrize("dtype", dtypes.ALL, ids=lambda d: d.name)
@pytest.mark.parametrize("algorithm", algorithms.ALLREDUCE_ALGORITHMS)
def test_allreduce_torch_every_dtype(comm, dtype, algorithm):
    ops = ["sum", "avg", "max", "min"] if dtype.is_float else ["sum", "max", "min", "avg"]
    for i, n in enumerate([1, 7, 1001, 70001]):
        for op in ops:
            inputs = _inputs(comm, n, dtype, seed=1000 * i + len(op))
            buf = _torch_buffer(inputs[comm.rank], dtype)
            comm.allreduce(buf, op, algorithm=algorithm)
            _check(_torch_host(buf, dtype), inputs, range(comm.size), op, dtype)


@pytest.mark.parametrize("algorithm", ["native", "recursive_doubling", "ring"])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_group_allreduce_both_lowerings(comm, algorithm, group_size):
    if group_size > comm.size:
        pytest.skip("group larger than the job")
    for step in range(3):
        inputs = _inputs(comm, 5003, dtypes.FLOAT32, seed=step)
        buf = cp.asarray(inputs[comm.rank])
        comm.group_allreduce(buf, group_size, step, algorithm=algorithm)
        members = comm.group_of(group_size, step)
        _check(cp.asnumpy(buf), inputs, members, "avg", dtypes.FLOAT32)


def test_broadcast_cupy_and_torch(comm):
    for root in {0, comm.size - 1}:
        for algorithm in algorithms.BROADCAST_ALGORITHMS:
            data = np.arange(10007, dtype=np.float32) * (root + 1)
            mine = data if comm.rank == root else np.zeros_like(data)
            buf = cp.asarray(mine)
            comm.broadcast(buf, root=root, algorithm=algorithm)
            np.testing.assert_array_equal(cp.asnumpy(buf), data)
            t = torch.from_numpy(mine.copy()).cuda()
            comm.broadcast(t, root=root, algorithm=algorithm)
            np.testing.assert_array_equal(t.cpu().numpy(), data)


def test_cuda_managed_memory_takes_the_gpu_path(comm):
    """CuPy exports managed memory as DLPack's CUDA-managed device (13); it
    used to fall to the host path, which refused it as a GPU buffer."""
    from wagma_comm.buffers import cuda_device

    n = 4099
    mem = cp.cuda.malloc_managed(n * 4)
    buf = cp.ndarray((n,), dtype=cp.float32, memptr=mem)
    buf[...] = comm.rank + 1.0
    assert cuda_device(buf) == cp.cuda.Device().id
    comm.allreduce(buf, "sum")
    assert bool((buf == sum(r + 1.0 for r in range(comm.size))).all())


def test_stream_contract_without_user_synchronisation(comm):
    """The input is produced by kernels still queued on torch's stream, and
    the result is consumed on it right after the call: the runtime orders both
    (DLPack stream handshake in, host-complete handle out)."""
    n = 1 << 22
    for _ in range(3):
        x = torch.empty(n, device="cuda")
        torch.cuda._sleep(20_000_000)  # keep torch's stream busy a while
        x.fill_(comm.rank + 1.0)
        comm.allreduce(x, "sum")
        y = x * 2  # consumed on torch's stream, no synchronize
        expected = 2 * sum(r + 1.0 for r in range(comm.size))
        assert torch.all(y == expected).item()


def test_many_async_handles_complete(comm):
    bufs = [torch.full((1000 + k,), float(comm.rank + k), device="cuda") for k in range(20)]
    handles = [comm.allreduce(b, "sum", async_op=True) for b in bufs]
    for k, (b, h) in enumerate(zip(bufs, handles)):
        assert h.wait() is b
        want = sum(r + k for r in range(comm.size))
        assert torch.all(b == want).item()


def test_mixed_host_and_gpu_collectives(comm):
    host = np.full(100, comm.rank, dtype=np.float64)
    dev = torch.full((100,), float(comm.rank), device="cuda")
    h1 = comm.allreduce(dev, "sum", async_op=True)
    comm.allreduce(host, "sum")
    h1.wait()
    total = sum(range(comm.size))
    assert (host == total).all() and torch.all(dev == total).item()


def test_bad_gpu_input_is_refused_locally(comm):
    from wagma_comm.errors import BufferError, InvalidArgumentError

    t = torch.zeros(10, 10, device="cuda")
    with pytest.raises(BufferError, match="buf"):
        comm.allreduce(t[:, 1])  # strided
    with pytest.raises(InvalidArgumentError, match="op"):
        comm.allreduce(t, "median")
    misaligned = cp.ndarray((4,), dtype=cp.float32, memptr=cp.cuda.alloc(64) + 2)
    with pytest.raises(BufferError, match="not aligned"):
        comm.allreduce(misaligned)  # its kernels' loads would fault the context
    comm.allreduce(t)  # still exact afterwards
    assert torch.all(t == 0).item()


def test_a_shorter_deadline_behind_a_slower_collective_fails_at_its_own(comm):
    """Rank 0 issues a collective with a long deadline that the others never
    join, then one with a 2 s timeout: the second must fail at its own
    deadline, naming its round and the members (only the oldest's deadline
    used to be checked, so it failed 5 s late from the handle's backstop,
    naming nobody), and the first, aborted with it, with
    CommunicatorClosedError. On a communicator of its own: this one breaks."""
    import time

    import wagma_comm
    from wagma_comm.errors import CollectiveTimeoutError, CommunicatorClosedError

    if comm.size < 2:
        pytest.skip("needs a peer that does not join")
    mine = wagma_comm.init(timeout=60)  # its own MPI and NCCL communicators
    try:
        warm = torch.ones(1000, device="cuda")
        mine.allreduce(warm)  # NCCL up on every rank
        if mine.rank == 0:
            slow, quick = torch.ones(1000, device="cuda"), torch.ones(1000, device="cuda")
            h_slow = mine.allreduce(slow, async_op=True)
            started = time.monotonic()
            h_quick = mine.allreduce(quick, async_op=True, timeout=2.0)
            with pytest.raises(CollectiveTimeoutError) as info:
                h_quick.wait()
            assert time.monotonic() - started < 4.5
            assert info.value.round == h_quick.round
            assert set(info.value.ranks) == set(range(1, mine.size))
            with pytest.raises(CommunicatorClosedError, match=f"round {h_slow.round}"):
                h_slow.wait()
    finally:
        comm.barrier()
        mine.close(cancel=True)
