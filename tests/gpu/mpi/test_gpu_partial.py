"""The persistent partial collectives (WAGMA's wait-avoiding group allreduce,
eager-SGD's solo and majority) on GPU buffers: data over NCCL, control on the
host (wagma_comm/partial/device.py). Checked against host references on fresh
random data, with torch and CuPy buffers, at any number of ranks."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

import wagma_comm
from wagma_comm import dtypes

torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")

WORLD = MPI.COMM_WORLD
TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
         "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}
TOL = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 1e-6, "float64": 1e-14}
FLOATS = [dtypes.BFLOAT16, dtypes.FLOAT16, dtypes.FLOAT32, dtypes.FLOAT64]


def _models(size, n, dtype, seed):
    """Every rank's model of one step (each rank knows them all: the reference)."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * 3).astype(dtype.numpy) for _ in range(size)]


def _to_torch(host, dtype):
    t = torch.from_numpy(host.view(dtype.storage).copy()).cuda()
    return t.view(TORCH[dtype.name]) if dtype.is_half else t


def _from_torch(t, dtype):
    return (t.view(torch.int16).cpu().numpy().view(dtype.numpy) if dtype.is_half
            else t.cpu().numpy())


def _rel_err(got, ref):
    got = got.astype(np.float64)
    return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("normalization", ["wagma", "mean"])
def test_partial_wagma_rounds_average_the_published_models(comm, dtype, normalization):
    """Everyone publishes, a barrier, then steps: every round is fresh, so each
    result is exactly WAGMA's average over the round's group (checked against
    float64), the groups shift, and the synchronous rounds leave every rank
    with the same bits."""
    n, sync_every = 10007, 3  # odd length: the kernels' unaligned tails
    init = _models(comm.size, n, dtype, seed=7)[0]
    model = _to_torch(init, dtype)
    group_size = min(2, comm.size)
    wagma = comm.wait_avoiding_group_allreduce(model, group_size, sync_every,
                                               normalization=normalization)
    assert wagma.statistics()["path"] == "gpu"
    groups_seen = set()
    for t in range(2 * sync_every + 1):
        models = _models(comm.size, n, dtype, seed=100 + t)
        model.copy_(_to_torch(models[comm.rank], dtype))
        wagma.publish(model)
        comm.barrier()
        info = wagma.step(model)
        got = _from_torch(model, dtype)
        assert info.round == t and info.fresh == info.group
        stack = np.stack([models[r].astype(np.float64) for r in info.group])
        if info.synchronized:
            ref = stack.mean(0)
            everyone = WORLD.allgather(got.tobytes())
            assert all(b == everyone[0] for b in everyone), "sync round results differ"
        elif normalization == "wagma":
            ref = (stack.sum(0) + models[comm.rank]) / (len(info.group) + 1)
        else:
            ref = stack.mean(0)
        assert _rel_err(got, ref) < TOL[dtype.name], (t, _rel_err(got, ref))
        assert info.synchronized == ((t + 1) % sync_every == 0)
        groups_seen.add(info.group)
    if comm.size > 2:
        assert len(groups_seen) > 2  # the groups shifted
    wagma.close()


@pytest.mark.parametrize("kind", ["solo", "majority"])
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_partial_eager_loses_and_duplicates_nothing(comm, kind, library):
    """Integer gradients on the GPU, ranks arriving after random delays: rounds
    run with stale contributions carried forward, yet the results (rounds plus
    the final flush) sum exactly to every rank's inputs, and every rank got the
    same result bits for every round."""
    n, steps, sync_every = 1001, 40, 7
    rng = np.random.default_rng(300 + comm.rank)
    delays = np.random.default_rng(400 + comm.rank)
    zeros = np.zeros(n, dtype=np.int64)
    buf = torch.zeros(n, dtype=torch.int64, device="cuda") if library == "torch" \
        else cp.zeros(n, dtype=cp.int64)
    make = comm.solo_allreduce if kind == "solo" else comm.majority_allreduce
    c = make(buf, sync_every, op="sum")
    inputs, received, digests = zeros.copy(), zeros.copy(), []
    for t in range(steps):
        time.sleep(delays.uniform(0, 0.003))
        g = rng.integers(-1000, 1000, n)
        inputs += g
        buf[:] = torch.from_numpy(g).cuda() if library == "torch" else cp.asarray(g)
        info = c.step(buf)
        got = buf.cpu().numpy() if library == "torch" else cp.asnumpy(buf)
        received += got
        digests.append(got.tobytes())
        assert info.round == t and info.staleness < sync_every
    buf[:] = 0
    assert c.flush(buf).synchronized
    received += buf.cpu().numpy() if library == "torch" else cp.asnumpy(buf)
    total = np.zeros(n, dtype=np.int64)
    WORLD.Allreduce(inputs, total)
    np.testing.assert_array_equal(received, total)
    everyone = WORLD.allgather(digests)
    assert all(d == everyone[0] for d in everyone)
    stats = c.statistics()
    assert stats["path"] == "gpu" and stats["pending_steps"] == []
    c.close()


@pytest.mark.parametrize("dtype", [dtypes.BFLOAT16, dtypes.FLOAT32], ids=lambda d: d.name)
def test_partial_solo_average_when_nobody_is_late(comm, dtype):
    """op="avg" on float gradients: with everyone stepping between barriers...
    the first arrival still starts the round, so only the sync rounds are sure
    to be fresh; those must equal the mean of the inputs."""
    n = 4099
    grads = torch.zeros(n, dtype=TORCH[dtype.name], device="cuda")
    solo = comm.solo_allreduce(grads, 1)  # every round synchronous: all fresh
    for t in range(3):
        inputs = _models(comm.size, n, dtype, seed=500 + t)
        grads.copy_(_to_torch(inputs[comm.rank], dtype))
        info = solo.step(grads)
        assert info.synchronized and info.fresh == tuple(range(comm.size))
        ref = np.stack([x.astype(np.float64) for x in inputs]).mean(0)
        assert _rel_err(_from_torch(grads, dtype), ref) < TOL[dtype.name]
    solo.close()


def test_partial_stream_contract_without_user_synchronisation(comm):
    """The model is written by a kernel queued behind a long sleep on torch's
    stream, then handed to publish/step at once, and the result is read on
    torch's stream at once: no synchronize anywhere in user code."""
    n = 1 << 20
    model = torch.zeros(n, device="cuda")
    wagma = comm.wait_avoiding_group_allreduce(model, comm.size, 1)  # global rounds
    for t in range(3):
        torch.cuda._sleep(20_000_000)
        model.fill_(float(comm.rank + t))
        wagma.step(model)
        expected = sum(r + t for r in range(comm.size)) / comm.size
        assert float(model.min()) == float(model.max()) == expected
    wagma.close()


def test_partial_host_and_gpu_buffers_on_different_ranks_are_a_mismatch(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    buf = np.zeros(8, np.float32) if comm.rank == 0 else torch.zeros(8, device="cuda")
    with pytest.raises(wagma_comm.MismatchError):
        comm.wait_avoiding_group_allreduce(buf, 1, 2)
    comm.barrier()
    # Both paths still count partial collectives alike: the next one works.
    model = torch.ones(8, device="cuda")
    wagma = comm.wait_avoiding_group_allreduce(model, comm.size, 1)
    wagma.step(model)
    assert float(model.min()) == float(model.max()) == 1.0
    wagma.close()


def test_partial_bad_input_on_gpu_buffers(comm):
    model = torch.zeros(16, device="cuda")
    with pytest.raises(wagma_comm.UnsupportedError) as err:
        comm.wait_avoiding_group_allreduce(model, 1, 2, algorithm="ring")
    assert err.value.argument == "algorithm"
    wagma = comm.wait_avoiding_group_allreduce(model, 1, 2)
    with pytest.raises(wagma_comm.InvalidArgumentError) as err:
        wagma.step(torch.zeros(15, device="cuda"))
    assert err.value.argument == "buf"
    with pytest.raises(wagma_comm.InvalidArgumentError):
        wagma.step(torch.zeros(16, device="cuda", dtype=torch.float64))
    with pytest.raises(wagma_comm.InvalidArgumentError):
        wagma.step(np.zeros(16, np.float32))  # a host buffer for a GPU collective
    wagma.step(model)  # still usable
    wagma.close()
