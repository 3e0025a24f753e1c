"""The PyTorch training path on CUDA tensors: DistributedOptimizer keeps its
buckets on the GPU (``buckets="auto"``), so the collectives and the partial
collectives run on the flat CUDA buckets through NCCL and our kernels with no
host copy. Checked against host-staged buckets on the same data, for every
method that takes device buffers, and through the demo (``--device cuda``)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
F = torch.nn.functional

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _flat(model) -> np.ndarray:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu().numpy()


def _same_on_every_rank(arr: np.ndarray) -> bool:
    return len(set(WORLD.allgather(arr.tobytes()))) == 1


def _steps(comm, method, buckets, steps, **knobs):
    """Train a seeded Linear(3, 1) on this rank's data; every iteration's
    parameters, then the finalized ones, and the optimizer's bucket memory."""
    from wagma_comm.train import DistributedOptimizer

    torch.manual_seed(3)
    model = torch.nn.Linear(3, 1).to(_device())
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               comm, method, model=model, buckets=buckets, **knobs)
    where = opt.buckets
    if where == "device":
        assert all(b.is_cuda for b in opt._work.buffers()) and not opt._work._host
    g = torch.Generator().manual_seed(RANK)
    out = []
    for _ in range(steps):
        x = torch.randn(4, 3, generator=g).to(_device())
        y = x.sum(1, keepdim=True)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        out.append(_flat(model))
    opt.finalize()
    out.append(_flat(model))
    opt.close()
    return out, where


DETERMINISTIC = [("allreduce", {}), ("local_sgd", {"sync_every": 3}),
                 ("wagma", {"group_size": 1, "sync_every": 3, "activation": "group"})]


@pytest.mark.parametrize("method,knobs", DETERMINISTIC, ids=[m for m, _ in DETERMINISTIC])
def test_cuda_parameters_get_device_buckets_that_follow_the_host_ones(comm, method, knobs):
    device, where = _steps(comm, method, "auto", 9, **knobs)
    assert where == "device"  # auto on CUDA: no pinned host mirror
    host, where = _steps(comm, method, "host", 9, **knobs)
    assert where == "host"
    for t, (a, b) in enumerate(zip(device, host)):
        # NCCL sums in its own order, the host path in rank order: rounding only.
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{method}: iteration {t}")
    if method == "allreduce":  # every rank applies the same averaged gradient bits
        assert all(_same_on_every_rank(a) for a in device)
    assert _same_on_every_rank(device[-1])  # finalize: one model


@pytest.mark.parametrize("method", ["solo", "majority", "wagma", "ad_psgd"])
def test_partial_methods_train_on_device_buckets(comm, method):
    """The wait-avoiding and eager collectives on the GPU buckets, gradients
    hooked during backward (overlap): the regression converges and finalize
    leaves every replica with the same bits."""
    from wagma_comm.train import DistributedOptimizer

    g = torch.Generator().manual_seed(7)
    X = torch.randn(256, 4, generator=g)
    Y = X @ torch.randn(4, 1, generator=g) + 0.5
    X, Y = X.to(_device()), Y.to(_device())
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 1).to(_device())
    with torch.no_grad():
        initial = F.mse_loss(model(X), Y).item()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5),
                               comm, method, model=model, sync_every=5, buckets="device")
    xs, ys = X[RANK::comm.size], Y[RANK::comm.size]
    for t in range(160 if method == "ad_psgd" else 80):
        i = (4 * t) % max(1, len(xs) - 4)
        opt.zero_grad()
        F.mse_loss(model(xs[i:i + 4]), ys[i:i + 4]).backward()
        opt.step()
    assert opt.statistics()["collective"]["path"] == "gpu"
    opt.finalize()
    opt.close()
    with torch.no_grad():
        final = F.mse_loss(model(X), Y).item()
    assert final < 0.01 * initial, f"{method}: loss {initial:.3f} -> {final:.5f}"
    assert _same_on_every_rank(_flat(model))


def test_two_dtype_buckets_on_the_gpu_agree_after_sync_rounds(comm):
    """A float32 and a bfloat16 bucket under WAGMA: rank-specific updates make
    the replicas differ between sync rounds; each sync round and finalize
    make them bitwise equal."""
    from wagma_comm.train import DistributedOptimizer

    dev = _device()
    torch.manual_seed(0)
    w32 = torch.nn.Parameter(torch.randn(5, 3, device=dev))
    w16 = torch.nn.Parameter(torch.randn(7, device=dev).to(torch.bfloat16))
    opt = DistributedOptimizer(torch.optim.SGD([w32, w16], lr=0.05), comm, "wagma",
                               sync_every=3)
    assert opt.buckets == "device"
    assert [b.dtype for b in opt._weights.buffers()] == [torch.float32, torch.bfloat16]
    target = float(RANK + 1)
    synced = 0
    for t in range(9):
        opt.zero_grad()
        ((w32.sum() - target) ** 2 + (w16.float().sum() - target) ** 2).backward()
        opt.step()
        if opt.last_info.synchronized:  # the bucket still holds the round's result
            synced += 1
            averaged = np.concatenate([b.float().cpu().numpy() for b in opt._weights.buffers()])
            assert _same_on_every_rank(averaged), f"sync round at iteration {t}"
    assert synced == 3
    opt.finalize()
    both = np.concatenate([w32.detach().cpu().numpy().ravel(),
                           w16.detach().float().cpu().numpy()])
    assert _same_on_every_rank(both)
    opt.close()


def test_gossip_methods_stay_on_host_buckets_with_cuda_parameters(comm):
    out, where = _steps(comm, "dpsgd", "auto", 6)
    assert where == "host"
    assert _same_on_every_rank(out[-1])


def test_demo_trains_on_the_gpu(comm):
    pytest.importorskip("sklearn")
    from wagma_comm import demo

    parser = demo.argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    opts = parser.parse_args(["demo", "--methods", "allreduce,wagma,solo,dpsgd",
                              "--seeds", "1", "--epochs", "1", "--compute", "0",
                              "--imbalance", "reference:0.001:2", "--sync-every", "3",
                              "--target", "0.5", "--plot", "", "--quiet", "--device", "cuda"])
    result = demo.run_demo(comm, opts, out=io.StringIO())
    if RANK == 0:
        buckets = {r["method"]: r["buckets"] for r in result["runs"]}
        assert buckets == {"allreduce": "device", "wagma": "device", "solo": "device",
                           "dpsgd": "host"}
        for r in result["rows"]:
            assert 0.3 < r["final_accuracy"] <= 1.0, r


def _averager_steps(comm, method, buckets, library, steps, **knobs):
    """The framework-agnostic Averager over a float32 and a float64 CUDA
    tensor of ``library`` (torch or cupy), updated in place: every
    iteration's weights on the host, then the finalized ones."""
    from wagma_comm.train import Averager

    if library == "cupy":
        cp = pytest.importorskip("cupy")
        to, host = cp.asarray, cp.asnumpy
    else:
        to, host = (lambda a: torch.from_numpy(a).to(_device())), (lambda a: a.cpu().numpy())
    rng = np.random.default_rng(RANK)
    w, b = to(np.full((3, 2), 0.5 + RANK, np.float32)), to(np.linspace(-1, 1, 5) * (RANK + 1))
    gw, gb = to(np.zeros((3, 2), np.float32)), to(np.zeros(5))
    avg = Averager(comm, [w, b], method, buckets=buckets, **knobs)
    out = []
    for _ in range(steps):
        gw[...] = to((0.1 * host(w) + rng.normal(size=(3, 2))).astype(np.float32))
        gb[...] = to(0.1 * host(b) + rng.normal(size=5))
        avg.average([w, b], [gw, gb])
        w -= 0.1 * gw  # on the library's own stream: no synchronize in between
        b -= 0.1 * gb
        out.append(np.concatenate([host(w).astype(np.float64).ravel(), host(b)]))
    avg.finalize([w, b], [gw, gb])
    out.append(np.concatenate([host(w).astype(np.float64).ravel(), host(b)]))
    avg.close()
    return out, avg.buckets


@pytest.mark.parametrize("library", ["torch", "cupy"])
@pytest.mark.parametrize("method,knobs", DETERMINISTIC, ids=[m for m, _ in DETERMINISTIC])
def test_averager_keeps_cuda_buckets_that_follow_the_host_ones(comm, method, knobs, library):
    """Averager on CUDA tensors of torch and of CuPy: ``auto`` puts the
    buckets on the GPU (NCCL, no host copy) and follows the host-staged
    trajectory up to NCCL's summation order."""
    device, where = _averager_steps(comm, method, "auto", library, 9, **knobs)
    assert where == "device"
    host, where = _averager_steps(comm, method, "host", library, 9, **knobs)
    assert where == "host"
    for t, (a, b) in enumerate(zip(device, host)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{method} ({library}): iteration {t}")
    assert _same_on_every_rank(device[-1])  # finalize: one model


def test_averager_device_buckets_need_one_device(comm):
    from wagma_comm import InvalidArgumentError
    from wagma_comm.train import Averager

    mixed = [torch.zeros(3, device=_device()), torch.zeros(2)]
    with pytest.raises(InvalidArgumentError, match="one device"):
        Averager(comm, mixed, "allreduce", buckets="device")
    avg = Averager(comm, mixed, "allreduce")  # auto: staged through the host
    assert avg.buckets == "host"
    avg.close()
