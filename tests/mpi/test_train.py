"""Training integration under a real MPI job (any number of ranks).

* the set-up check names a parameter that differs between ranks, and the ranks;
* the PyTorch wrapper's update equals a hand-computed WAGMA-SGD step;
* WAGMA's sync rounds leave every replica's averaged model bitwise identical;
* every method converges on a small regression problem;
* checkpoint/resume continues exactly the uninterrupted trajectory;
* the NumPy example and the demo run end to end (the JAX example is run by
  tests/unit/test_train_examples.py: importing JAX on every rank is slow).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import io
import os
import tempfile
import time
from types import ModuleType
from typing import Any, Iterator

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from conftest import not_at_3_or_8_ranks

from wagma_comm import Communicator, CommunicatorClosedError, InvalidArgumentError
from wagma_comm.runtime.activation import group_step
from wagma_comm.train import (
    METHODS,
    Averager,
    DistributedOptimizer,
    ParameterMismatchError,
    default_group_size,
    load_checkpoint,
    save_checkpoint,
)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
LAST = SIZE - 1
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

torch.set_num_threads(1)


def _digest(arrays: Any) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _flat(model: torch.nn.Module) -> np.ndarray:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()


def _gather_rows(comm: Communicator, row: np.ndarray) -> np.ndarray:
    """Every rank's ``row`` through the communicator under test (zeros elsewhere
    make the sum exact)."""
    table = np.zeros((SIZE, row.size), dtype=row.dtype)
    table[RANK] = row
    comm.allreduce(table, "sum")
    return table


@pytest.fixture
def rank_dir() -> Iterator[str]:
    """A private directory per rank (pytest's tmp_path base is shared by all
    ranks of the job, whose clean-ups then race)."""
    with tempfile.TemporaryDirectory(prefix=f"wagma-train-r{RANK}-") as d:
        yield d


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples",
                                                                     f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- set-up check -------------------------------------------------------------------


def _mlp(out_features: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(),
                               torch.nn.Linear(3, out_features))


def test_shape_mismatch_names_the_parameter_and_the_rank(comm: Communicator) -> None:
    if SIZE == 1:
        pytest.skip("needs two ranks")
    model = _mlp(3 if RANK == LAST else 2)  # parameter 2 ('2.weight') differs on LAST
    with pytest.raises(ParameterMismatchError) as err:
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, "allreduce",
                             model=model)
    e = err.value
    assert e.argument == "params" and e.index == 2
    assert "parameter 2 ('2.weight')" in str(e)
    assert "shape (3, 3) float32" in str(e) and "shape (2, 3) float32" in str(e)
    assert e.ranks == ((LAST,) if SIZE > 2 else e.ranks) and len(e.ranks) == 1
    comm.barrier()  # the communicator is still usable


def test_count_and_dtype_mismatches_are_named(comm: Communicator) -> None:
    if SIZE == 1:
        pytest.skip("needs two ranks")
    params = [np.zeros(3, np.float32), np.zeros((2, 2), np.float32)]
    if RANK == LAST:
        params.append(np.zeros(5, np.float32))
    with pytest.raises(ParameterMismatchError) as err:
        Averager(comm, params, "allreduce", names=["a", "b", "c"][:len(params)])
    assert err.value.index == 2 and "different numbers of parameters" in str(err.value)
    assert f"rank {LAST}: 3" in str(err.value)
    params = [np.zeros(3, np.float32),
              np.zeros((2, 2), ml_dtypes.bfloat16 if RANK == LAST else np.float32)]
    with pytest.raises(ParameterMismatchError) as err:
        Averager(comm, params, "wagma", names=["a", "b"])
    assert err.value.index == 1 and "parameter 1 ('b')" in str(err.value)
    assert "bfloat16" in str(err.value) and "float32" in str(err.value)


def test_initial_weights_come_from_rank_0(comm: Communicator) -> None:
    torch.manual_seed(100 + RANK)
    model = _mlp(2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, "local_sgd",
                               model=model)
    rows = _gather_rows(comm, _flat(model))
    torch.manual_seed(100)
    assert np.array_equal(rows[RANK], _flat(_mlp(2)))  # rank 0's initialisation
    assert all(np.array_equal(r, rows[0]) for r in rows)
    opt.close()


# -- the WAGMA step, by hand ------------------------------------------------------------


@pytest.mark.parametrize("round_start", ["gradient", "iteration", "publish"])
def test_wrapper_update_equals_hand_computed_wagma_step(comm: Communicator,
                                                        round_start: str) -> None:
    """Iteration t on rank i (ALGORITHMS.md s. 2): g = grad at the pre-averaging
    w_i; W = (sum of the group's published models + w_i) / (S + 1), or the global
    mean in a sync round; v = m v + g; w = W - lr v. A member's published model
    is its current one if it was fresh in the round, else the one it published
    the iteration before (a barrier per iteration guarantees that) -- or the
    synchronized mean right after a sync round, or the initial model at t=0."""
    lr, m, tau = 0.1, 0.9, 3
    S = default_group_size(SIZE)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=m), comm,
                               "wagma", model=model, group_size=S, sync_every=tau,
                               round_start=round_start)
    g = torch.Generator().manual_seed(RANK)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)
    published = np.tile(_flat(model).astype(np.float64), (SIZE, 1))  # the initial model
    v = None
    for t in range(2 * tau + 2):
        comm.barrier()
        pre = _gather_rows(comm, _flat(model)).astype(np.float64)
        opt.zero_grad()
        F.mse_loss(model(x + t), y).backward()
        grad = np.concatenate([p.grad.detach().numpy().ravel() for p in model.parameters()])
        opt.step()
        info = opt.last_info
        assert info is not None and info.iteration == t and len(info.rounds) == 1
        rnd = info.rounds[0]
        assert rnd.round == t
        if info.synchronized:
            assert (t + 1) % tau == 0
            avg = pre.mean(0)
        else:
            members = comm.group_of(S, group_step(t, tau))
            assert list(rnd.group) == members and RANK in members
            parts = [pre[j] if j in rnd.fresh else published[j] for j in members]
            avg = (np.sum(parts, axis=0) + pre[RANK]) / (len(members) + 1)
        published = np.tile(avg, (SIZE, 1)) if info.synchronized else pre
        v = grad if v is None else m * v + grad
        expected = avg - lr * v
        np.testing.assert_allclose(_flat(model), expected, rtol=1e-5, atol=1e-6)
    opt.close()


@pytest.mark.parametrize("round_start", ["gradient", "publish"])
def test_a_rank_still_computing_contributes_its_current_model(comm: Communicator,
                                                              round_start: str) -> None:
    """The last rank publishes its model at start() and computes (sleeps)
    long after the others finish theirs, so every round runs without its
    arrival (started by the first fast arrival, or by the ready publishes
    before anyone arrives) -- yet with its current model, counted fresh.
    Group of all ranks, plain mean: the fast ranks' result is exact."""
    if SIZE == 1:
        pytest.skip("needs a slow and a fast rank")
    params = [np.full(5, float(RANK))]
    avg = Averager(comm, params, "wagma", group_size=SIZE, sync_every=100,
                   normalization="mean", activation="group", round_start=round_start)
    for t in range(3):
        pre = _gather_rows(comm, params[0].copy())
        avg.start(params)
        WORLD.Barrier()  # everyone has published; nobody has arrived yet
        if RANK == LAST:
            time.sleep(0.3)  # long after every fast rank's round has run
        info = avg.finish(params).info
        assert info is not None
        rnd = info.rounds[0]
        assert rnd.round == t and rnd.fresh == tuple(range(SIZE)), rnd
        if RANK == LAST:  # its round ran without its arrival, on its current
            assert info.staleness == 0  # model: on time (docs/partial.md)
        else:
            np.testing.assert_array_equal(params[0], pre.mean(0))
        params[0] += 1.0  # the "optimizer step": a new model every iteration
    assert avg.method.statistics()["stale_contributions"] == 0
    avg.close()


def test_sync_rounds_leave_replicas_bitwise_identical(comm: Communicator) -> None:
    """Two dtype buckets (float32, bfloat16) that drift apart by rank-specific
    updates between sync rounds; after each sync round every rank holds
    exactly the same bytes, and no group round makes them so by accident
    (they differ again right after)."""
    rng = np.random.default_rng(RANK)
    params = [np.ones((4, 5), np.float32), np.ones(7, ml_dtypes.bfloat16),
              np.ones(3, np.float32)]
    tau = 4
    avg = Averager(comm, params, "wagma", names=["w", "h", "b"], sync_every=tau)
    synced, differed = 0, 0
    for t in range(3 * tau):
        for p in params:
            p += rng.normal(0, 0.1, p.shape).astype(p.dtype)  # this rank's "update"
        info = avg.average(params).info
        digests = WORLD.allgather(_digest(params))
        if info is not None and info.synchronized:
            synced += 1
            assert len(set(digests)) == 1, f"replicas differ after sync round {t}"
        else:
            differed += len(set(digests)) > 1
    assert synced == 3
    assert differed == (3 * tau - 3 if SIZE > 1 else 0)  # the check can tell them apart
    final = avg.finalize(params)
    assert final.params[0] is params[0]
    assert len(set(WORLD.allgather(_digest(params)))) == 1
    avg.close()


# -- convergence --------------------------------------------------------------------


def _regression(comm: Communicator, method: str, steps: int,
                **knobs: Any) -> tuple[float, float, torch.nn.Module]:
    g = torch.Generator().manual_seed(7)
    X = torch.randn(256, 4, generator=g)
    Y = X @ torch.randn(4, 1, generator=g) + 0.5
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        initial = F.mse_loss(model(X), Y).item()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5),
                               comm, method, model=model, **knobs)
    xs, ys = X[RANK::SIZE], Y[RANK::SIZE]
    for t in range(steps):
        i = (4 * t) % max(1, len(xs) - 4)
        opt.zero_grad()
        F.mse_loss(model(xs[i:i + 4]), ys[i:i + 4]).backward()
        opt.step()
    opt.finalize()
    opt.close()
    with torch.no_grad():
        return initial, F.mse_loss(model(X), Y).item(), model


@pytest.mark.parametrize("method", METHODS)
def test_every_method_converges_and_replicas_agree_at_the_end(comm: Communicator,
                                                               method: str) -> None:
    # AD-PSGD has no global sync: how fast it mixes depends on timing, and on
    # a loaded machine 80 steps were once not enough (CI, 3 ranks: loss 4.85 ->
    # 0.53); twice the steps keep the same bound robust.
    steps = 160 if method == "ad_psgd" else 80
    initial, final, model = _regression(comm, method, steps, sync_every=5)
    assert final < 0.01 * initial, f"{method}: loss {initial:.3f} -> {final:.5f}"
    assert len(set(WORLD.allgather(_digest([_flat(model)])))) == 1


# -- checkpoint / resume -----------------------------------------------------------------

RESUMABLE = [("allreduce", {}), ("local_sgd", {"sync_every": 3}), ("dpsgd", {}),
             ("sgp", {}), ("wagma", {"group_size": 1, "sync_every": 3, "activation": "group"})]


def _trajectory(comm: Communicator, method: str, knobs: dict[str, Any], steps: range,
                model: torch.nn.Module, opt: DistributedOptimizer) -> list[np.ndarray]:
    g = torch.Generator().manual_seed(RANK)
    data = [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g))
            for _ in range(20)]
    out = []
    for t in steps:
        x, y = data[t]
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        out.append(_flat(model))
    return out


def _fresh(comm: Communicator, method: str, knobs: dict[str, Any],
           seed: int) -> tuple[torch.nn.Module, DistributedOptimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               comm, method, model=model, **knobs)
    return model, opt


@pytest.mark.parametrize("method,knobs", RESUMABLE, ids=[m for m, _ in RESUMABLE])
def test_resume_continues_the_uninterrupted_trajectory(comm: Communicator, rank_dir: str,
                                                       method: str,
                                                       knobs: dict[str, Any]) -> None:
    model, opt = _fresh(comm, method, knobs, 0)
    whole = _trajectory(comm, method, knobs, range(10), model, opt)
    opt.close()
    model, opt = _fresh(comm, method, knobs, 0)
    first = _trajectory(comm, method, knobs, range(6), model, opt)
    path = os.path.join(rank_dir, "ckpt-{rank}.pt")
    save_checkpoint(path, model, opt, extra={"epoch": 1})
    opt.close()
    model, opt = _fresh(comm, method, knobs, 99)  # other weights: the checkpoint wins
    assert load_checkpoint(path, model, opt) == {"epoch": 1}
    assert opt.iteration == 6
    rest = _trajectory(comm, method, knobs, range(6, 10), model, opt)
    opt.close()
    for t, (a, b) in enumerate(zip(whole, first + rest)):
        assert np.array_equal(a, b), f"{method}: iteration {t} differs after resume"


# -- device buckets ----------------------------------------------------------------------
# buckets="device" hands the flat torch tensors to the collectives. On the CPU
# that is the code a GPU runs (methods on torch tensors, the partial
# collectives' intake through DLPack) without NCCL; tests/gpu/mpi/test_gpu_train.py
# runs it on CUDA tensors.


@pytest.mark.parametrize("method,knobs", RESUMABLE[:2] + RESUMABLE[-1:],
                         ids=["allreduce", "local_sgd", "wagma"])
def test_device_buckets_follow_the_host_buckets_trajectory(comm: Communicator, method: str,
                                                          knobs: dict[str, Any]) -> None:
    runs = []
    for buckets in ("host", "device"):
        model, opt = _fresh(comm, method, dict(knobs, buckets=buckets), 5)
        assert opt.buckets == buckets
        assert all(isinstance(b, torch.Tensor) == (buckets == "device")
                   for b in opt._work.buffers())
        runs.append(_trajectory(comm, method, knobs, range(8), model, opt))
        opt.finalize()
        runs[-1].append(_flat(model))
        opt.close()
    for t, (a, b) in enumerate(zip(*runs)):
        assert np.array_equal(a, b), f"{method}: iteration {t} differs with device buckets"


@pytest.mark.parametrize("method", ["solo", "majority", "wagma", "ad_psgd"])
def test_partial_methods_converge_on_device_buckets(comm: Communicator, method: str) -> None:
    steps = 160 if method == "ad_psgd" else 80  # as the host-bucket test
    initial, final, model = _regression(comm, method, steps, sync_every=5, buckets="device")
    assert final < 0.01 * initial, f"{method}: loss {initial:.3f} -> {final:.5f}"
    assert len(set(WORLD.allgather(_digest([_flat(model)])))) == 1


def test_bucket_choice_is_checked_and_agreed(comm: Communicator) -> None:
    def make(method: str, buckets: str) -> DistributedOptimizer:
        model = torch.nn.Linear(2, 1)
        return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                                    method, model=model, buckets=buckets)

    with pytest.raises(InvalidArgumentError, match="buckets"):
        make("allreduce", "gpu")
    with pytest.raises(InvalidArgumentError, match="dpsgd exchanges models through host"):
        make("dpsgd", "device")
    opt = make("wagma", "auto")  # CPU parameters: host buckets, the NumPy fast path
    assert opt.buckets == "host" and opt.statistics()["buckets"] == "host"
    opt.close()
    if SIZE > 1:  # rank 0 asks for host buckets, the others for device ones
        with pytest.raises(InvalidArgumentError, match="ranks passed different values"):
            make("allreduce", "host" if RANK == 0 else "device")
    opt = make("allreduce", "device")  # the communicator is still in step
    assert opt.buckets == "device"
    opt.close()


def _averager_steps(comm: Communicator, method: str, buckets: str, framework: str,
                    steps: int, **knobs: Any) -> tuple[list[np.ndarray], Averager]:
    """An Averager over a float32 and a float64 tensor of ``framework``
    (``numpy`` or ``torch``), each rank's gradients from its own seed: every
    iteration's weights, then the finalized ones."""
    rng = np.random.default_rng(RANK)
    to = (lambda a: a) if framework == "numpy" else torch.from_numpy
    w = to(np.full((3, 2), 0.5 + RANK, np.float32))
    b = to(np.linspace(-1, 1, 5) * (RANK + 1))
    gw, gb = to(np.zeros((3, 2), np.float32)), to(np.zeros(5))
    avg = Averager(comm, [w, b], method, buckets=buckets, **knobs)
    out = []
    for _ in range(steps):
        gw[...] = to((0.1 * np.asarray(w) + rng.normal(size=(3, 2))).astype(np.float32))
        gb[...] = to(0.1 * np.asarray(b) + rng.normal(size=5))
        avg.average([w, b], [gw, gb])
        w -= 0.1 * gw
        b -= 0.1 * gb
        out.append(np.concatenate([np.asarray(w, np.float64).ravel(), np.asarray(b)]))
    done = avg.finalize([w, b], [gw, gb])
    if done.apply:
        w -= 0.1 * gw
        b -= 0.1 * gb
    out.append(np.concatenate([np.asarray(w, np.float64).ravel(), np.asarray(b)]))
    avg.close()
    return out, avg


def _same_on_every_rank_bytes(arr: np.ndarray) -> bool:
    return len(set(WORLD.allgather(arr.tobytes()))) == 1


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("method,knobs", RESUMABLE[:2] + RESUMABLE[-1:],
                         ids=["allreduce", "local_sgd", "wagma"])
def test_averager_device_buckets_follow_the_host_buckets_trajectory(
        comm: Communicator, method: str, knobs: dict[str, Any], framework: str) -> None:
    """The Averager's device buckets (torch tensors the collectives take
    through DLPack; on the CPU here, on CUDA in tests/gpu) give the host
    buckets' trajectory bit for bit, for NumPy arrays and torch tensors."""
    runs = []
    for buckets in ("host", "device"):
        out, avg = _averager_steps(comm, method, buckets, framework, 8, **knobs)
        assert avg.buckets == buckets and avg.statistics()["buckets"] == buckets
        assert all(isinstance(b, torch.Tensor) == (buckets == "device")
                   for b in avg._model.buffers())
        runs.append(out)
    for t, (a, b) in enumerate(zip(*runs)):
        assert np.array_equal(a, b), f"{method}: iteration {t} differs with device buckets"
    assert _same_on_every_rank_bytes(runs[1][-1])  # finalize: one model everywhere


def test_averager_device_buckets_return_torch_copies_and_write_in_place(
        comm: Communicator) -> None:
    """``copy=True`` and ``model()`` give fresh torch tensors (JAX and CuPy
    import them through DLPack), never views of the bucket; in place, a
    NumPy bfloat16 array and a read-only array are served like on host
    buckets."""
    w = np.full(4, RANK + 1.0, np.float32)
    h = np.full(3, RANK + 1.0, ml_dtypes.bfloat16)
    ro = np.full(2, 7.0, np.float32)
    ro.flags.writeable = False
    avg = Averager(comm, [w, h, ro], "allreduce", buckets="device", broadcast=False)
    mean = (SIZE + 1) / 2
    grads = [w.copy(), h.copy(), np.zeros(2, np.float32)]
    out = avg.average([w, h, ro], grads, copy=True)
    assert all(isinstance(g, torch.Tensor) for g in out.grads)
    assert out.grads[0].tolist() == [mean] * 4 and out.grads[1].float().tolist() == [mean] * 3
    out.grads[0].fill_(-1)  # a copy: the bucket keeps its value
    assert avg._grads.flats["float32"][:4].tolist() == [mean] * 4
    assert grads[0].tolist() == [RANK + 1.0] * 4  # inputs untouched
    avg.average([w, h, ro], grads)  # in place, bfloat16 NumPy included
    assert grads[0].tolist() == [mean] * 4
    assert grads[1].astype(np.float32).tolist() == [mean] * 3
    model = avg.model()
    assert [m.dtype for m in model] == [torch.float32, torch.bfloat16, torch.float32]
    assert model[2].tolist() == [7.0, 7.0]
    avg.close()


def test_averager_bucket_choice_is_checked_and_agreed(comm: Communicator) -> None:
    x = np.ones(3, np.float32)
    with pytest.raises(InvalidArgumentError, match="buckets"):
        Averager(comm, [x], "allreduce", buckets="gpu")
    with pytest.raises(InvalidArgumentError, match="sgp exchanges models through host"):
        Averager(comm, [x], "sgp", buckets="device")
    avg = Averager(comm, [x], "wagma")  # host tensors: host buckets, the NumPy fast path
    assert avg.buckets == "host"
    avg.close()
    if SIZE > 1:  # rank 0 asks for host buckets, the others for device ones
        with pytest.raises(InvalidArgumentError, match="ranks passed different values"):
            Averager(comm, [x], "allreduce", buckets="host" if RANK == 0 else "device")
    avg = Averager(comm, [x], "allreduce", buckets="device")  # still in step
    assert avg.buckets == "device"
    avg.close()


def test_checkpoint_refuses_what_cannot_resume_exactly(comm: Communicator,
                                                       rank_dir: str) -> None:
    model, opt = _fresh(comm, "wagma", {"sync_every": 3}, 0)
    _trajectory(comm, "wagma", {}, range(2), model, opt)
    with pytest.raises(InvalidArgumentError, match="multiple of sync_every=3"):
        opt.state_dict()
    with pytest.raises(InvalidArgumentError, match="rank"):
        save_checkpoint(os.path.join(rank_dir, "shared.pt"), model, opt)  # replicas differ
    _trajectory(comm, "wagma", {}, range(2, 3), model, opt)
    state = opt.state_dict()
    assert state["iteration"] == 3 and state["method"] == "wagma"
    with pytest.raises(InvalidArgumentError, match="method"):
        state2 = dict(state, method="dpsgd")
        opt.load_state_dict(state2)
    opt.close()


def test_gradient_accumulation_with_overlap_is_refused(comm: Communicator) -> None:
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, "allreduce",
                               model=model)
    x = torch.ones(1, 2)
    model(x).sum().backward()  # completes every gradient: the averaging starts
    with pytest.raises(InvalidArgumentError, match="overlap=False"):
        model(x).sum().backward()
    opt.step()  # finishes the started averaging on every rank
    opt.close()
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, "allreduce",
                               model=model, overlap=False)
    model(x).sum().backward()
    model(x).sum().backward()
    opt.step()
    assert torch.allclose(model.bias.grad, torch.full((1,), 2.0))  # both passes averaged
    opt.close()


# -- torch semantics the wrapper keeps (found in session 41's review) ------------------


def test_frozen_parameters_keep_no_gradient_and_do_not_move(comm: Communicator) -> None:
    """A zero gradient would let weight decay and momentum move a frozen
    parameter; plain torch skips a parameter whose ``.grad`` is None."""
    model = torch.nn.Linear(3, 1)
    model.bias.requires_grad_(False)
    before = model.bias.detach().clone()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                               weight_decay=0.1), comm, "allreduce",
                               model=model)
    before = model.bias.detach().clone()  # rank 0's, after the broadcast
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    assert model.bias.grad is None
    assert torch.equal(model.bias.detach(), before)
    opt.close()


def test_changing_gradients_after_backward_needs_synchronize(comm: Communicator) -> None:
    """Averaging starts at the last gradient hook (overlap), so clipping after
    backward would be undone by step(): it raises, naming the way out, and
    ``synchronize()`` applies the average first so the clipping holds."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                               "allreduce", model=model)
    x = torch.full((2, 4), float(RANK + 1))

    def backward() -> None:
        opt.zero_grad()
        (100 * model(x)).sum().backward()

    backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(InvalidArgumentError, match="synchronize"):
        opt.step()
    assert opt.iteration == 1  # the round ran on every rank: counted
    backward()
    local = torch.cat([p.grad.flatten() for p in model.parameters()])
    info = opt.synchronize()
    assert opt.synchronize() is info  # idempotent until the step
    averaged = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert _same_on_every_rank_bytes(averaged.numpy())
    expected = _gather_rows(comm, local.numpy().astype(np.float64)).mean(0)
    np.testing.assert_allclose(averaged.numpy(), expected, rtol=1e-5)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    opt.step()
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert float((weights - after).norm()) == pytest.approx(0.1, rel=1e-4)  # lr * clipped norm
    assert opt.iteration == 2
    opt.close()


def test_a_parameter_unfrozen_after_wrapping_gets_its_averaged_gradient(
        comm: Communicator) -> None:
    model = _mlp(1)
    model[0].weight.requires_grad_(False)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), comm,
                               "allreduce", model=model)
    model[0].weight.requires_grad_(True)
    x = torch.full((2, 4), float(RANK + 1))
    for _ in range(2):  # the first step hooks it; both must average it
        opt.zero_grad()
        model(x).sum().backward()
        local = model[0].weight.grad.clone()
        opt.step()
        expected = _gather_rows(comm, local.flatten().numpy().astype(np.float64)).mean(0)
        assert float(local.abs().sum()) > 0
        np.testing.assert_allclose(model[0].weight.grad.flatten().numpy(), expected, rtol=1e-5)
    opt.close()


def test_finalize_mid_iteration_keeps_sync_rounds_on_their_iterations(
        comm: Communicator) -> None:
    """A drained iteration (zero_grad() then finalize(), as before an
    evaluation) used its round: it counts, so WAGMA's sync rounds stay on
    the iterations ALGORITHMS.md puts them (every sync_every-th)."""
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm, "wagma",
                               model=model, sync_every=3)
    synced = []

    def one() -> None:
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        info = opt.last_info
        assert info.rounds[0].iteration == info.iteration  # the collective agrees
        synced.append((info.iteration, info.synchronized))

    for _ in range(3):
        one()
    opt.zero_grad()  # starts iteration 3's model average
    opt.finalize()  # drains it
    assert opt.iteration == 4
    for _ in range(5):
        one()
    opt.close()
    assert [t for t, s in synced if s] == [2, 5, 8]


def test_a_dtype_change_after_wrapping_is_named(comm: Communicator) -> None:
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                               "local_sgd", model=model, sync_every=1)
    model.double()  # float64 weights would be cast into the float32 bucket
    with pytest.raises(InvalidArgumentError, match=r"params\[0\].*float64"):
        opt.zero_grad()  # a model method packs here, before communicating
        opt.step()
    opt.close()


def test_parameters_outside_the_optimizer_start_equal(comm: Communicator) -> None:
    torch.manual_seed(RANK)  # different weights on every rank
    model = _mlp(1)
    opt = DistributedOptimizer(torch.optim.SGD(model[2].parameters(), lr=0.1), comm,
                               "allreduce", model=model)  # the first layer is not optimized
    assert _same_on_every_rank_bytes(model[0].weight.detach().numpy())
    opt.close()


def test_ranks_running_different_methods_are_named(comm: Communicator) -> None:
    if SIZE == 1:
        pytest.skip("a disagreement needs two ranks")
    x = np.ones(3, np.float32)
    method, knobs = ("allreduce", {}) if RANK == 0 else ("local_sgd", {"sync_every": 1})
    with pytest.raises(InvalidArgumentError, match=r"different methods.*\[0\]"
                       if SIZE > 2 else "different methods"):
        Averager(comm, [x], method, **knobs)
    other = 2 if RANK == LAST else 4  # the same method, another knob
    with pytest.raises(InvalidArgumentError, match="local_sgd"):
        Averager(comm, [x], "local_sgd", sync_every=other)
    Averager(comm, [x], "allreduce").close()  # still in step


def test_averager_hands_out_the_average_of_a_missing_gradient(comm: Communicator) -> None:
    """A gradient that was never computed (None) contributes zeros; its
    average comes back as a fresh array instead of a late BufferError."""
    w = [np.ones(2, np.float32), np.ones(3, np.float32)]
    avg = Averager(comm, w, "allreduce")
    grads = [np.full(2, RANK + 1.0, np.float32), None if RANK == 0 else np.ones(3, np.float32)]
    out = avg.average(w, grads)
    assert out.grads[0] is grads[0] and grads[0].tolist() == [(SIZE + 1) / 2] * 2
    np.testing.assert_allclose(out.grads[1], [(SIZE - 1) / SIZE] * 3, rtol=1e-6)
    avg.close()
    avg = Averager(comm, w, "local_sgd")
    with pytest.raises(InvalidArgumentError, match=r"params\[1\]"):
        avg.average([w[0], None])  # before any communication
    avg.close()


# -- examples and the demo ------------------------------------------------------------


@pytest.mark.parametrize("method", ["wagma", "solo", "dpsgd"])
def test_numpy_example_trains(comm: Communicator, method: str) -> None:
    acc = _load("numpy_example").main(comm, method, steps=60, sync_every=5)
    assert acc > 0.8  # 4 separable-ish blobs; chance is 0.25
    assert len(set(WORLD.allgather(round(acc, 6)))) == 1  # finalize: one model


def test_demo_runs_end_to_end_at_a_tiny_size(comm: Communicator, rank_dir: str) -> None:
    pytest.importorskip("sklearn")
    from wagma_comm import demo

    parser = demo.argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    plot = os.path.join(rank_dir, "acc.png")
    opts = parser.parse_args(["demo", "--seeds", "1", "--epochs", "1", "--compute", "0",
                              "--imbalance", "reference:0.001:2", "--sync-every", "3",
                              "--target", "0.5", "--plot", plot, "--quiet"])
    out = io.StringIO()
    result = demo.run_demo(comm, opts, out=out)
    if RANK == 0:
        rows = {r["method"]: r for r in result["rows"]}
        assert list(rows) == list(demo.DEFAULT_METHODS)
        for r in rows.values():
            assert 0.3 < r["final_accuracy"] <= 1.0 and r["iterations_per_s"] > 0
        text = out.getvalue()
        assert "| wagma |" in text and "time to 50%" in text and "accuracy: wagma" in text
        assert os.path.getsize(plot) > 10_000


# -- set-up of the gossip baselines' exchange ---------------------------------------------
def test_a_rank_that_never_creates_the_exchange_is_named() -> None:
    """D-PSGD/SGP duplicate the MPI communicator at set-up, and a plain Dup
    waits forever for a rank that never comes: the timed arrival check first
    names it."""
    if SIZE == 1:
        pytest.skip("a missing rank needs two ranks")
    import wagma_comm
    from wagma_comm.errors import CollectiveTimeoutError
    from wagma_comm.train.neighbors import NeighborExchange

    c = wagma_comm.init(timeout=30)
    slow = SIZE - 1
    named: tuple[int, ...] = ()
    if RANK != slow:
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            NeighborExchange(WORLD, 0.5, "dpsgd exchange", arrive=lambda t: c.barrier(timeout=t))
        assert info.value.collective == "dpsgd exchange" and info.value.ranks
        assert time.monotonic() - t0 < 10.0
        named = info.value.ranks  # the peers this rank waited for
    everyone = set().union(*WORLD.allgather(named))
    assert slow in everyone  # the absent rank is named by whoever waited for it
    c.close(cancel=True)



# -- an Averager iteration left in flight ---------------------------------------------


@pytest.mark.parametrize("method,knobs", [
    ("local_sgd", {"sync_every": 1}), ("dpsgd", {}), ("solo", {"sync_every": 3}),
    ("wagma", {"sync_every": 3, "round_start": "iteration"})],
    ids=["local_sgd", "dpsgd", "solo", "wagma"])
def test_averager_finalize_or_close_mid_iteration_drains_it(comm: Communicator, method: str,
                                                             knobs: dict[str, Any]) -> None:
    """start() then finalize() (an evaluation mid-training) or close(): the
    started round is finished on every rank and counts, as with
    DistributedOptimizer. It was left in flight: its buffers repacked under
    it, the next start() refused, and D-PSGD's pending exchange crashed the
    process at exit."""
    x = [np.full(5, float(RANK), np.float32)]
    g = [np.full(5, float(RANK), np.float32)]
    avg = Averager(comm, x, method, broadcast=False, **knobs)
    avg.start(x, g)
    x[0][:] = 10.0 * (RANK + 1)  # the model finalize() averages
    avg.finalize(x, g)
    assert avg.iteration == 1 and not avg.method.in_flight
    if avg.averages == "model":
        np.testing.assert_allclose(x[0], 5.0 * (SIZE + 1), rtol=1e-6)
    synced = []
    for _ in range(4):  # training goes on; sync rounds stay on their iterations
        info = avg.average(x, g).info
        assert info is not None
        synced.append((info.iteration, info.synchronized))
    if method in ("solo", "wagma"):
        assert [t for t, s in synced if s] == [2] and info.rounds[0].round == 4
    avg.start(x, g)
    avg.close()  # drains too
    assert avg.iteration == 6 and not avg.method.in_flight


# -- the gossip baselines' exchange: what its errors name ----------------------------------


@not_at_3_or_8_ranks
def test_a_gossip_timeout_names_the_training_iteration_and_the_late_neighbour() -> None:
    """Resumed at iteration 5, D-PSGD's exchange counted its own rounds from
    0: a timeout at iteration 6 said "round 1". It names the iteration, as
    the partial collectives' rounds do, and the neighbour that did not come."""
    if SIZE == 1:
        pytest.skip("a missing neighbour needs two ranks")
    import wagma_comm
    from wagma_comm.errors import CollectiveTimeoutError, CommunicatorClosedError
    from wagma_comm.train.methods import ring_neighbours

    c = wagma_comm.init(timeout=1.0)
    x = [np.ones(4, np.float32)]
    avg = Averager(c, x, "dpsgd", first_iteration=5)
    avg.average(x)  # iteration 5, everyone
    if RANK in ring_neighbours(LAST, SIZE):
        with pytest.raises(CollectiveTimeoutError) as info:
            avg.average(x)  # iteration 6: LAST does not come
        assert info.value.collective == "dpsgd exchange"
        assert info.value.round == 6 and info.value.ranks == (LAST,)
        for _ in range(2):  # the broken exchange stays the answer, not "in flight"
            with pytest.raises(CommunicatorClosedError, match="round 6 timed out"):
                avg.average(x)
    elif RANK != LAST:
        avg.average(x)  # not LAST's neighbour: its own round completes
    avg.close()
    WORLD.Barrier()
    c.close(cancel=True)


def test_an_mpi_error_in_the_exchange_is_typed_and_names_the_peer() -> None:
    """A failed message (here: longer than its receive; in the wild, a peer
    that gave up on the round and left) surfaced as a bare mpi4py exception
    naming neither the exchange, nor the round, nor the peer."""
    if SIZE == 1:
        pytest.skip("an exchange needs two ranks")
    from wagma_comm.errors import CollectiveError
    from wagma_comm.train.neighbors import NeighborExchange

    ex = NeighborExchange(WORLD, 10.0, "sgp exchange")
    if RANK == 0:
        ex.start([(np.zeros(4, np.float32), [1])], [], label=7)
        ex.wait()
    elif RANK == 1:
        ex.start([], [([np.empty(2, np.float32)], [0])], label=7)
        with pytest.raises(CollectiveError) as info:
            ex.wait()
        assert info.value.collective == "sgp exchange"
        assert info.value.round == 7 and info.value.ranks == (0,)
    ex.close()


def test_closing_the_exchange_mid_round_gives_its_receive_buffers_back() -> None:
    """A round posted and never waited for (a method closed mid-iteration)
    left its receives active on the freed communicator: MPI still owned
    buffers the method reuses or frees. close() cancels them."""
    if SIZE == 1:
        pytest.skip("an exchange needs two ranks")
    from wagma_comm.train.neighbors import NeighborExchange

    ex = NeighborExchange(WORLD, 10.0, "dpsgd exchange")
    if RANK == 0:  # rank 1 never takes part in this round
        ex.start([], [([np.empty(1 << 12, np.float32)], [1])])
        receive = ex._requests[0]
        assert receive != MPI.REQUEST_NULL
    ex.close()
    if RANK == 0:
        assert receive == MPI.REQUEST_NULL  # cancelled and freed: the buffer is ours
    WORLD.Barrier()


def test_the_exchange_refuses_too_many_buffers_and_use_after_close() -> None:
    """More than 32 receive buffers (only sends were counted) took tags of the
    next round; a start() after close() was a bare AttributeError."""
    from wagma_comm.errors import CommunicatorClosedError, InvalidArgumentError
    from wagma_comm.train.neighbors import NeighborExchange

    if SIZE != 2:
        pytest.skip("rank-count independent: run at 2 ranks")
    ex = NeighborExchange(WORLD, 10.0, "dpsgd exchange")
    many = [([np.empty(1, np.float32)], [1 - RANK])] * 33
    with pytest.raises(InvalidArgumentError) as info:
        ex.start([], many)
    assert info.value.argument == "recvs" and not ex._requests
    ex.close()
    with pytest.raises(CommunicatorClosedError, match="dpsgd exchange.*closed"):
        ex.start([], [])
    ex.close()  # twice is harmless
    WORLD.Barrier()


def test_an_abandoned_send_keeps_its_buffer_alive() -> None:
    """A round given up on with its send still pending dropped the send's
    request, and with it the only reference to a buffer MPI may still read:
    the caller's array could be freed under MPI."""
    import gc
    import weakref

    from wagma_comm.errors import CollectiveTimeoutError
    from wagma_comm.train.neighbors import NeighborExchange

    if SIZE != 2:
        pytest.skip("rank-count independent: run at 2 ranks")
    ex = NeighborExchange(WORLD, 0.3, "dpsgd exchange")
    if RANK == 0:  # 4 MiB: rendezvous, so the send waits for rank 1's receive
        buf = np.ones(1 << 20, np.float32)
        alive = weakref.ref(buf)
        ex.start([(buf, [1])], [])
        with pytest.raises(CollectiveTimeoutError):
            ex.wait()
        del buf
        gc.collect()
        assert alive() is not None, "the pending send's buffer was let go"
    WORLD.Barrier()
    if RANK == 1:  # the late receive, so MPI finishes the send
        late = np.empty(1 << 20, np.float32)
        ex._comm.Recv([late.view(np.uint8), MPI.BYTE], 0, 0)
        assert late[0] == 1.0
    WORLD.Barrier()
    ex.close()


def test_checkpoint_paths_with_other_braces_keep_them(comm: Communicator,
                                                       rank_dir: str) -> None:
    """``{rank}`` was filled in with str.format, so any other brace in the
    path (a directory named ``run{3}``, a ``{step}`` left for later) was a
    bare KeyError or IndexError that named nothing."""
    model, opt = _fresh(comm, "local_sgd", {"sync_every": 2}, 0)
    _trajectory(comm, "local_sgd", {}, range(2), model, opt)
    for odd in ("run{3}", "run{step}", "run{}"):
        os.makedirs(os.path.join(rank_dir, odd))
        path = os.path.join(rank_dir, odd, "ckpt-{rank}.pt")
        file = save_checkpoint(path, model, opt, extra={"dir": odd})
        assert file == os.path.join(rank_dir, odd, f"ckpt-{RANK}.pt") and os.path.exists(file)
        assert load_checkpoint(path, model, opt) == {"dir": odd}
    opt.close()


@pytest.mark.parametrize("method", METHODS)
def test_an_averager_used_after_close_says_so(comm: Communicator, method: str) -> None:
    """Its collectives are released: the partial methods failed with a bare
    IndexError, D-PSGD and SGP with an AssertionError (leaving the iteration
    half started), and the blocking ones ran a collective as if open."""
    from wagma_comm.errors import CommunicatorClosedError

    x = [np.ones(3, np.float32)]
    avg = Averager(comm, x, method, sync_every=2)
    avg.average(x, [np.ones(3, np.float32)])
    avg.close()
    for call in (lambda: avg.average(x, [x[0].copy()]), lambda: avg.finalize(x, [x[0].copy()])):
        with pytest.raises(CommunicatorClosedError, match=f"Averager \\({method}"):
            call()
    assert not avg.method.in_flight
    avg.close()  # idempotent
    comm.barrier()  # nothing was started on any rank


# -- DistributedOptimizer after an error, a skipped step, odd models (session 44) ------


@not_at_3_or_8_ranks
def test_a_timed_out_step_is_retried_typed_and_the_optimizer_still_closes() -> None:
    """A step() whose round timed out left the wrapper "started" with nothing
    in flight: a retry raised InvalidArgumentError("finish: no iteration was
    started"), the next backward was refused as a second gradient, and
    close() raised that InvalidArgumentError too."""
    if SIZE == 1:
        pytest.skip("a missing rank needs two ranks")
    import wagma_comm
    from wagma_comm.errors import CollectiveTimeoutError, CommunicatorClosedError

    c = wagma_comm.init(timeout=3.0)
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), c, "allreduce",
                               model=model)
    if RANK != LAST:  # LAST never computes a gradient nor steps
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(CollectiveTimeoutError):
            opt.step()
        with pytest.raises(CommunicatorClosedError):  # the broken communicator says so
            opt.step()
        opt.zero_grad()
        with pytest.raises(CommunicatorClosedError):
            model(torch.ones(1, 2)).sum().backward()
    opt.close()  # nothing in flight: no error
    WORLD.Barrier()
    c.close(cancel=True)


class _FailsOnce(torch.optim.SGD):
    """SGD whose first step raises, as a user's optimizer may (a NaN check)."""

    failed = False

    def step(self, closure: Any = None) -> Any:
        if not self.failed:
            self.failed = True
            raise FloatingPointError("non-finite update")
        return super().step(closure)


def test_an_optimizer_step_that_raised_is_retried_without_a_new_round(
        comm: Communicator) -> None:
    """The wrapped optimizer's step raised after the average was applied: a
    retry raised InvalidArgumentError("finish: no iteration was started")
    for ever. It now only steps, with the average already in ``.grad``."""
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(_FailsOnce(model.parameters(), lr=0.5), comm, "allreduce",
                               model=model)
    before = model.bias.detach().clone()
    opt.zero_grad()
    model(torch.full((1, 2), float(RANK))).sum().backward()
    with pytest.raises(FloatingPointError):
        opt.step()
    assert opt.iteration == 0
    opt.step()
    assert opt.iteration == 1 and opt.statistics()["iterations"] == 1
    assert torch.allclose(model.bias.grad, torch.ones(1))  # averaged once, stepped once
    assert torch.allclose(model.bias.detach(), before - 0.5)
    assert _same_on_every_rank_bytes(_flat(model))
    opt.close()


@pytest.mark.parametrize("method,overlap", [("allreduce", True), ("allreduce", False),
                                            ("wagma", True)])
def test_an_iteration_whose_step_amp_skips_ends_at_the_next_zero_grad(
        comm: Communicator, method: str, overlap: bool) -> None:
    """AMP's GradScaler.step skips optimizer.step() when the gradients
    overflowed (here on rank 0; after synchronize(), as docs/training.md
    says for unscale_). The next iteration reused the skipped one's average:
    its own gradients were never averaged and the replicas diverged silently
    (overlap=False), its backward was refused as a second gradient
    (overlap=True), or a model method's rank 0 stayed one round behind and
    finalize() failed with a MismatchError."""
    if not hasattr(torch.amp, "GradScaler"):
        pytest.skip("torch.amp.GradScaler('cpu') needs torch >= 2.3")
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, method,
                               model=model, overlap=overlap, sync_every=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for it in range(4):
        opt.zero_grad()
        x = torch.full((1, 2), float("inf") if it == 1 and RANK == 0 else float(RANK + 1))
        scale = scaler.get_scale()
        scaler.scale(model(x).sum()).backward()
        opt.synchronize()
        if method == "allreduce" and it != 1:  # the scaled mean of the inputs
            expected = torch.full((1, 2), scale * (SIZE + 1) / 2)
            assert torch.allclose(model.weight.grad, expected)
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()
    assert opt.iteration == 4 and opt.statistics()["iterations"] == 4
    opt.finalize()
    assert _same_on_every_rank_bytes(_flat(model))
    opt.close()


def test_a_refused_start_leaves_the_next_backward_its_own_start(comm: Communicator) -> None:
    """A start refused in a gradient hook (here a dtype change) left that
    backward's gradients counted: the next backward started averaging at its
    first gradient and refused the second as a gradient after its averaging
    started."""
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, "allreduce",
                               model=model)
    model.double()
    opt.zero_grad()
    with pytest.raises(InvalidArgumentError, match=r"params\[\d\].*float64"):
        model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()  # before communicating
    model.float()
    opt.zero_grad()
    model(torch.full((1, 2), float(RANK + 1))).sum().backward()
    opt.step()
    assert torch.allclose(model.weight.grad, torch.full((1, 2), (SIZE + 1) / 2))
    assert opt.iteration == 1
    opt.close()


def test_group_size_beyond_the_ranks_is_refused_before_any_communication(
        comm: Communicator) -> None:
    """It was raised by the method's set-up, after the parameters were
    checked across ranks and rank 0's weights broadcast over everyone's."""
    torch.manual_seed(RANK)
    model = _mlp(1)
    before = _flat(model)
    with pytest.raises(InvalidArgumentError, match="group_size"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, "wagma",
                             model=model, group_size=SIZE + 1)
    assert np.array_equal(_flat(model), before)  # nothing was broadcast
    DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, "ad_psgd",
                         model=model).close()  # its fixed pairs fit any size
    comm.barrier()


def test_averager_refuses_a_group_beyond_the_ranks_before_communicating(
        comm: Communicator) -> None:
    """Rank 0 alone constructs it: the error comes before the set-up's
    consistency check and broadcast (before, rank 0 broadcast its weights,
    or alone timed out in the check, and only then heard of group_size)."""
    if RANK == 0:
        w = np.arange(4, dtype=np.float32)
        started = time.monotonic()
        with pytest.raises(InvalidArgumentError, match="group_size"):
            Averager(comm, [w], "wagma", group_size=SIZE + 1)
        assert time.monotonic() - started < comm.timeout / 2
    comm.barrier()


def test_averager_takes_generators_of_tensors(comm: Communicator) -> None:
    """The constructor, average() and finalize() read their lists more than
    once: a generator gave "params: expected at least one tensor, got none"
    at construction, and average() found it used up at finish."""
    w = [np.full(3, RANK + 1.0, np.float32), np.full(2, 2.0 * (RANK + 1), np.float64)]
    avg = Averager(comm, (t for t in w), "allreduce", broadcast=False)
    try:
        grads = [x.copy() for x in w]
        out = avg.average((p for p in w), (g for g in grads))
        mean = sum(r + 1.0 for r in range(SIZE)) / SIZE
        np.testing.assert_allclose(out.grads[0], np.full(3, mean, np.float32))
        np.testing.assert_allclose(grads[1], np.full(2, 2.0 * mean))  # in place
        avg.finalize((p for p in w), (g for g in grads))
    finally:
        avg.close()


def test_lbfgs_is_refused_before_communicating(comm: Communicator) -> None:
    """Its step evaluates the closure several times; step() called it
    without one and failed with a bare TypeError after set-up."""
    model = torch.nn.Linear(2, 1)
    if RANK == 0:  # alone: refused before any communication
        with pytest.raises(InvalidArgumentError, match="LBFGS"):
            DistributedOptimizer(torch.optim.LBFGS(model.parameters()), comm, "allreduce")
    comm.barrier()


def test_load_state_dict_after_close_is_refused(comm: Communicator) -> None:
    """It made the method's collectives again on a closed optimizer, which
    nothing would ever close (close() is idempotent)."""
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, "solo",
                               model=model, sync_every=1)
    state = opt.state_dict()
    opt.close()
    with pytest.raises(CommunicatorClosedError, match="closed"):
        opt.load_state_dict(state)
    with pytest.raises(CommunicatorClosedError, match="closed"):  # as a closed Averager
        opt.step()
    assert opt.method.statistics() == {}  # no collective was made
    comm.barrier()


def test_model_buffers_of_any_dtype_and_empty_parameters_start_equal(
        comm: Communicator) -> None:
    """A bool mask or int8 buffer made construction fail (after the weights'
    broadcast), and a dtype whose only parameter is empty failed with
    "buf: buffer is empty"."""
    torch.manual_seed(RANK)
    model = _mlp(1)
    model.register_buffer("mask", torch.rand(7) > 0.5)
    model.register_buffer("codes", torch.randint(-100, 100, (2, 3), dtype=torch.int8))
    model.register_buffer("flag", torch.tensor(RANK % 2 == 0))
    model.empty = torch.nn.Parameter(torch.zeros(0, dtype=torch.float64))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, "allreduce",
                               model=model)
    assert model.mask.dtype == torch.bool and model.codes.shape == (2, 3)
    for t in (model.mask, model.codes, model.flag):
        assert _same_on_every_rank_bytes(t.numpy())
    assert bool(model.flag)  # rank 0's
    opt.zero_grad()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert _same_on_every_rank_bytes(_flat(model))
    opt.close()


def test_bad_arguments_are_refused_before_any_communication() -> None:
    """One rank constructs alone: every argument error must come before a
    collective, which would wait for the others until the deadline. A bad
    ``buckets`` or a ``group_size`` beyond the ranks came after the set-up
    check's allreduces; ``overlap="no"`` was taken as True and ``comm=None``
    was a bare AttributeError."""
    if SIZE == 1:
        pytest.skip("a lone rank needs two ranks")
    import wagma_comm

    c = wagma_comm.init(timeout=2.0)
    if RANK == LAST:
        model = torch.nn.Linear(2, 1)
        cases: list[tuple[str, Any, dict[str, Any]]] = [
            ("buckets", c, {"buckets": "gpu"}),
            ("buckets", c, {"method": "dpsgd", "buckets": "device"}),
            ("group_size", c, {"group_size": SIZE + 1}),
            ("overlap", c, {"overlap": "no"}),
            ("broadcast", c, {"broadcast": None}),
            ("comm", None, {}),
        ]
        for argument, cm, kw in cases:
            kw = {"method": "wagma", **kw}
            with pytest.raises(InvalidArgumentError) as err:
                DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), cm,
                                     kw.pop("method"), model=model, **kw)
            assert err.value.argument == argument
    WORLD.Barrier()
    c.barrier()  # nothing was started: the communicator is still in step
    c.close()


def test_leaving_a_with_block_by_an_exception_unhooks_the_model(comm: Communicator) -> None:
    """__exit__ leaves a collective close() to the caller after an exception,
    but left the gradient hooks on too: a later backward of the same model
    (under a new wrapper, say) started this wrapper's averaging."""
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ZeroDivisionError):
        with DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                                  "allreduce", model=model) as opt:
            1 / 0
    model(torch.ones(1, 2)).sum().backward()
    assert not opt.method.in_flight
    opt.close()


# -- methods' telemetry and knobs, checkpoints (session 44, train review) ---------------


@pytest.mark.parametrize("method", ["solo", "majority", "wagma"])
def test_statistics_name_a_broken_second_bucket(method: str) -> None:
    """statistics()["collective"] was the first bucket's collective's only:
    with the float64 bucket's collective broken (its sync round timed out
    waiting for LAST), it said broken=None."""
    if SIZE != 2:  # 2 s a case, the same at any rank count: kept off `make test`'s budget
        pytest.skip("runs at 2 ranks (a missing rank)")
    import wagma_comm
    from wagma_comm.errors import CollectiveTimeoutError
    from wagma_comm.train import make_method

    c = wagma_comm.init(timeout=2.0)
    m = make_method(method, sync_every=1)
    bufs = [np.zeros(3, np.float32), np.zeros(2, np.float64)]
    m.setup(c, bufs)
    if RANK != LAST:  # LAST never steps the second bucket's collective
        with pytest.raises(CollectiveTimeoutError):
            m._colls[1].step(bufs[1])  # type: ignore[attr-defined]
    stats = m.statistics()
    if RANK != LAST:
        assert stats["broken"] and "(round 0)" in stats["broken"]
    else:
        assert stats["broken"] is None
    per = stats["per_bucket"]
    assert len(per) == 2 and per[0]["broken"] is None and per[1]["broken"] == stats["broken"]
    assert stats["path"] == per[0]["path"] and stats["steps"] == per[0]["steps"]
    WORLD.Barrier()
    c.close(cancel=True)


@pytest.mark.parametrize("method,knobs", [("majority", {"seed": RANK}),
                                          ("wagma", {"normalization": "mean" if RANK else
                                                     "wagma"}),
                                          ("wagma", {"grace": 0.25 if RANK else 0.5})])
def test_ranks_with_different_seeds_normalizations_or_graces_are_refused(
        comm: Communicator, method: str, knobs: dict[str, Any]) -> None:
    """describe() left these knobs out, so the set-up's check that every rank
    runs the same method passed: a different seed or normalization surfaced
    only after the weights' broadcast, as the partial collective's
    MismatchError (not the InvalidArgumentError naming ``method`` that
    docs/training.md promises), and a different grace not at all."""
    if SIZE == 1:
        pytest.skip("a disagreement needs two ranks")
    x = np.ones(3, np.float32)
    with pytest.raises(InvalidArgumentError, match="different methods or knobs") as err:
        Averager(comm, [x], method, **knobs)
    assert err.value.argument == "method"
    Averager(comm, [x], "allreduce").close()  # still in step


def test_a_checkpoint_one_rank_cannot_write_is_refused_on_every_rank(
        comm: Communicator, rank_dir: str) -> None:
    """Rank 0's save failed (its target is a directory) with a bare OSError,
    leaving its ``.tmp`` file behind, while the others waited in the barrier
    until the communicator's timeout broke it."""
    model, opt = _fresh(comm, "local_sgd", {"sync_every": 2}, 0)
    _trajectory(comm, "local_sgd", {}, range(2), model, opt)
    path = os.path.join(rank_dir, "ckpt-{rank}.pt")
    if RANK == 0:
        os.makedirs(path.replace("{rank}", "0"))  # no file can take its place
    t0 = time.monotonic()
    with pytest.raises(InvalidArgumentError) as err:
        save_checkpoint(path, model, opt)
    assert err.value.argument == "path" and time.monotonic() - t0 < 30
    assert ("could not write" if RANK == 0 else "rank [0]") in str(err.value)
    if RANK == 0:
        assert os.listdir(rank_dir) == ["ckpt-0.pt"]  # the directory; no .tmp left
        os.rmdir(path.replace("{rank}", "0"))
    save_checkpoint(path, model, opt)  # the communicator is still in step
    assert load_checkpoint(path, model, opt) == {}
    opt.close()


def test_an_extra_the_loader_cannot_read_is_refused_before_any_file_is_replaced(
        comm: Communicator, rank_dir: str) -> None:
    """``extra`` holding a NumPy value (a loss as ``np.float64``) on one rank:
    torch.save wrote it, replacing that rank's last good checkpoint, and
    load_checkpoint (``weights_only=True``) then refused the file on every
    rank as "not a readable checkpoint": the run could not resume at all.
    Now every rank raises InvalidArgumentError naming ``extra``, and the
    checkpoint saved before is kept and loads."""
    model, opt = _fresh(comm, "local_sgd", {"sync_every": 2}, 0)
    _trajectory(comm, "local_sgd", {}, range(2), model, opt)
    path = os.path.join(rank_dir, "ckpt-{rank}.pt")
    save_checkpoint(path, model, opt, extra={"loss": 1.0})
    saved = _flat(model)
    _trajectory(comm, "local_sgd", {}, range(2, 4), model, opt)
    loss = np.float64(2.0) if RANK == LAST else 2.0
    with pytest.raises(InvalidArgumentError) as err:
        save_checkpoint(path, model, opt, extra={"loss": loss})
    assert err.value.argument == "extra"
    assert ("numpy" if RANK == LAST else f"rank [{LAST}]") in str(err.value)
    assert load_checkpoint(path, model, opt) == {"loss": 1.0}  # the last good one
    assert np.array_equal(_flat(model), saved) and opt.iteration == 2
    with pytest.raises(InvalidArgumentError, match="expected a dict") as err:
        save_checkpoint(path, model, opt, extra=[("loss", 1.0)])  # type: ignore[arg-type]
    assert err.value.argument == "extra"
    opt.close()


def test_a_checkpoint_missing_or_unreadable_on_one_rank_loads_nowhere(
        comm: Communicator, rank_dir: str) -> None:
    """A rank whose file was missing (or no checkpoint) raised alone, before
    the optimizer's collective restart, while the others loaded theirs (the
    replicas then resumed from different states) or waited for it."""
    model, opt = _fresh(comm, "local_sgd", {"sync_every": 2}, 0)
    _trajectory(comm, "local_sgd", {}, range(2), model, opt)
    path = os.path.join(rank_dir, "ckpt-{rank}.pt")
    save_checkpoint(path, model, opt)
    saved = _flat(model)
    _trajectory(comm, "local_sgd", {}, range(2, 4), model, opt)
    now = _flat(model)
    mine = path.replace("{rank}", str(RANK))
    for damage in ("missing", "garbage"):
        if RANK == 0:
            os.replace(mine, mine + ".bak")
            if damage == "garbage":
                with open(mine, "wb") as f:
                    f.write(b"not a checkpoint")
        with pytest.raises(InvalidArgumentError) as err:
            load_checkpoint(path, model, opt)
        assert err.value.argument == "path"
        if RANK != 0:
            assert "rank [0]" in str(err.value) or "ranks [0]" in str(err.value)
        assert np.array_equal(_flat(model), now) and opt.iteration == 4  # nothing loaded
        if RANK == 0:
            os.replace(mine + ".bak", mine)
    load_checkpoint(path, model, opt)
    assert np.array_equal(_flat(model), saved) and opt.iteration == 2
    opt.close()


def test_checkpoints_of_different_iterations_are_refused_on_every_rank(
        comm: Communicator, rank_dir: str) -> None:
    """Each rank loaded what its path held: LAST at iteration 4, the others
    at 2, and local SGD went on with its ranks' iteration counters apart."""
    if SIZE == 1:
        pytest.skip("a disagreement needs two ranks")
    model, opt = _fresh(comm, "local_sgd", {"sync_every": 2}, 0)
    _trajectory(comm, "local_sgd", {}, range(2), model, opt)
    save_checkpoint(os.path.join(rank_dir, "a-{rank}.pt"), model, opt)
    _trajectory(comm, "local_sgd", {}, range(2, 4), model, opt)
    save_checkpoint(os.path.join(rank_dir, "b-{rank}.pt"), model, opt)
    now = _flat(model)
    which = "b" if RANK == LAST else "a"
    with pytest.raises(InvalidArgumentError, match="different iterations") as err:
        load_checkpoint(os.path.join(rank_dir, which + "-{rank}.pt"), model, opt)
    assert err.value.argument == "path" and f"rank {LAST}: 4" in str(err.value)
    assert SIZE == 2 or f"majority: [{LAST}]" in str(err.value)
    assert np.array_equal(_flat(model), now) and opt.iteration == 4
    opt.close()


def test_a_model_that_refuses_its_checkpoint_on_one_rank_is_named_on_every_rank(
        comm: Communicator, rank_dir: str) -> None:
    """LAST's model refused its state (a bare RuntimeError there) while the
    other ranks went on to load the optimizer state and restart the method:
    the replicas resumed at different iterations."""
    model, opt = _fresh(comm, "local_sgd", {"sync_every": 2}, 0)
    _trajectory(comm, "local_sgd", {}, range(2), model, opt)
    path = os.path.join(rank_dir, "ckpt-{rank}.pt")
    save_checkpoint(path, model, opt)
    _trajectory(comm, "local_sgd", {}, range(2, 4), model, opt)
    if RANK == LAST:  # a checkpoint of another architecture
        mine = path.replace("{rank}", str(RANK))
        state = torch.load(mine, weights_only=True)
        state["model"]["weight"] = torch.zeros(2, 3)
        torch.save(state, mine)
    with pytest.raises(InvalidArgumentError) as err:
        load_checkpoint(path, model, opt)
    assert err.value.argument == "model"
    assert ("size mismatch" if RANK == LAST else f"[{LAST}]") in str(err.value)
    assert opt.iteration == 4  # the optimizer was not touched on any rank
    opt.close()


# -- load_state_dict agreement, methods' set-up and close on failure (session 45) --------


def _momentum(opt: DistributedOptimizer) -> list[torch.Tensor]:
    return [opt.optimizer.state[p]["momentum_buffer"].clone() for p in opt.params]


@pytest.mark.parametrize("method,damage", [("local_sgd", "optimizer"), ("wagma", "optimizer"),
                                           ("local_sgd", "iteration")])
def test_a_state_one_rank_cannot_load_is_refused_on_every_rank(
        comm: Communicator, method: str, damage: str) -> None:
    """LAST's optimizer state did not fit (a bare ValueError there), or it
    loaded a state of another iteration: with local SGD the other ranks
    loaded theirs and went on at other iterations than LAST, silently; with
    WAGMA they waited in the method's restart until the timeout broke the
    communicator. Now every rank raises, nothing loaded anywhere."""
    if SIZE == 1:
        pytest.skip("a disagreement needs two ranks")
    model, opt = _fresh(comm, method, {"sync_every": 2}, 0)
    _trajectory(comm, method, {}, range(2), model, opt)
    state = copy.deepcopy(opt.state_dict())  # its momentum tensors are the live ones
    _trajectory(comm, method, {}, range(2, 4), model, opt)
    newer = opt.state_dict()
    now, momentum = _flat(model), _momentum(opt)
    bad = state
    if RANK == LAST:
        bad = (newer if damage == "iteration" else
               dict(state, optimizer=dict(state["optimizer"],
                                          param_groups=state["optimizer"]["param_groups"] * 2)))
    t0 = time.monotonic()
    with pytest.raises(InvalidArgumentError) as err:
        opt.load_state_dict(bad)
    assert err.value.argument == "state_dict" and time.monotonic() - t0 < 30
    if damage == "iteration":
        assert "different iterations" in str(err.value) and f"rank {LAST}: 4" in str(err.value)
    else:
        assert ("parameter groups" if RANK == LAST else f"rank [{LAST}]") in str(err.value)
    assert opt.iteration == 4 and np.array_equal(_flat(model), now)
    assert all(torch.equal(a, b) for a, b in zip(_momentum(opt), momentum))  # not loaded
    opt.load_state_dict(state)  # the communicator and the method are still in step
    assert opt.iteration == 2
    assert not all(torch.equal(a, b) for a, b in zip(_momentum(opt), momentum))
    _trajectory(comm, method, {}, range(2, 4), model, opt)
    opt.finalize()
    assert _same_on_every_rank_bytes(_flat(model))
    opt.close()


@pytest.mark.parametrize("method", ["solo", "majority", "wagma"])
def test_a_failed_set_up_releases_the_collectives_it_made(method: str) -> None:
    """A set-up whose second bucket's collective could not be made (here an
    unsupported dtype) left the first bucket's open for the communicator's
    lifetime: its progress-thread work and channels, never closed. A method
    closed (or whose set-up failed) then failed start() with a bare
    IndexError and finalize() returned without averaging."""
    import wagma_comm
    from conftest import TEST_TIMEOUT_S, message_path
    from wagma_comm.errors import BufferError
    from wagma_comm.train import make_method

    with message_path():  # wagma's collectives too are then registered ones
        c = wagma_comm.init(timeout=TEST_TIMEOUT_S)
    m = make_method(method, sync_every=1)
    m.check_size(SIZE)
    with pytest.raises(BufferError, match="complex64"):
        m.setup(c, [np.zeros(3, np.float32), np.zeros(2, np.complex64)])
    assert [p.kind for p in list(c._persistent) if not p._closed] == []
    assert m.statistics() == {}
    bufs = [np.ones(3, np.float32)]
    with pytest.raises(CommunicatorClosedError, match="setup"):
        m.start(0, bufs)
    assert not m.in_flight
    m.setup(c, bufs)  # set up again: works
    m.start(0, bufs)
    assert m.finish().iteration == 0 and np.array_equal(bufs[0], np.ones(3, np.float32))
    m.close()
    m.close()  # idempotent
    with pytest.raises(CommunicatorClosedError, match="setup"):
        m.start(1, bufs)
    with pytest.raises(CommunicatorClosedError, match="setup"):
        m.finalize(bufs)
    assert [p.kind for p in list(c._persistent) if not p._closed] == []
    c.close()


@pytest.mark.parametrize("method", ["solo", "wagma"])
def test_a_close_that_times_out_still_releases_every_bucket(method: str) -> None:
    """The first bucket's close() timed out (LAST never closes) and the
    second bucket's collective was left open, with ``_colls`` kept: it was
    never released."""
    if SIZE != 2:  # 2 s a case, the same at any rank count: kept off `make test`'s budget
        pytest.skip("runs at 2 ranks (a missing rank)")
    import wagma_comm
    from conftest import message_path
    from wagma_comm.errors import CollectiveTimeoutError
    from wagma_comm.train import make_method

    with message_path():
        c = wagma_comm.init(timeout=2.0)
    m = make_method(method, sync_every=1)
    m.check_size(SIZE)
    m.setup(c, [np.zeros(3, np.float32), np.zeros(2, np.float64)])
    if RANK != LAST:
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeoutError):
            m.close()
        assert time.monotonic() - t0 < 3 * 2.0  # one timeout, not one per bucket
        assert [p.kind for p in list(c._persistent) if not p._closed] == []
        assert m.statistics() == {}
        m.close()  # idempotent: nothing left
    WORLD.Barrier()
    c.close(cancel=True)


# -- session 45 review: the Averager's own checks, and where the buckets live ----------


@pytest.mark.parametrize("method,knobs", [("local_sgd", {"sync_every": 1}), ("dpsgd", {})],
                         ids=["local_sgd", "dpsgd"])
def test_a_refused_second_start_leaves_the_round_in_flight_alone(
        comm: Communicator, method: str, knobs: dict[str, Any]) -> None:
    """start() while an iteration is in flight packed the new tensors into
    the buckets the round was still reading or had written its result into,
    then refused: finish() delivered this rank's new tensors (or D-PSGD a
    mean with them) as the average."""
    x = [np.full(4, RANK + 1.0, np.float32)]
    avg = Averager(comm, x, method, broadcast=False, **knobs)
    avg.start(x)
    with pytest.raises(InvalidArgumentError, match="iteration 0 was started and not finished"):
        avg.start([np.full(4, 100.0, np.float32)])
    avg.finish(x)
    if method == "local_sgd":
        expect = (SIZE + 1) / 2.0
    else:
        from wagma_comm.train.methods import ring_neighbours
        peers = [RANK] + ring_neighbours(RANK, SIZE)
        expect = sum(r + 1.0 for r in peers) / len(peers)
    np.testing.assert_allclose(x[0], np.full(4, expect, np.float32), rtol=1e-6)
    avg.close()


def test_finish_checks_where_the_result_goes_before_waiting(comm: Communicator) -> None:
    """A gradient method's finish() without grads waited, then failed with a
    bare AssertionError, its average lost; now InvalidArgumentError naming
    grads, the iteration still in flight for a finish() with them."""
    w = [np.ones(3, np.float32)]
    g = [np.full(3, RANK + 1.0, np.float32)]
    avg = Averager(comm, w, "allreduce")
    avg.start(w, g)
    with pytest.raises(InvalidArgumentError) as err:
        avg.finish(w)
    assert err.value.argument == "grads"
    assert avg.method.in_flight and avg.iteration == 0
    avg.finish(w, g)
    np.testing.assert_allclose(g[0], np.full(3, (SIZE + 1) / 2.0, np.float32), rtol=1e-6)
    assert avg.iteration == 1
    avg.close()


def test_a_read_only_model_is_refused_before_the_round(comm: Communicator) -> None:
    """average() and finalize() of read-only tensors (JAX arrays) without
    copy=True ran the round, then raised BufferError writing the result: the
    round was used up (the iteration counted) and its result lost. They are
    refused before any communication now; copy=True then runs the same
    iteration."""
    from wagma_comm.errors import BufferError

    ro = np.full(3, RANK + 1.0, np.float32)
    ro.flags.writeable = False
    avg = Averager(comm, [ro], "local_sgd", sync_every=1, broadcast=False)
    calls = dict(comm.statistics()["calls"])
    with pytest.raises(BufferError, match=r"params\[0\]"):
        avg.average([ro])
    assert avg.iteration == 0 and not avg.method.in_flight
    assert avg.statistics()["iterations"] == 0
    with pytest.raises(BufferError, match=r"params\[0\]"):
        avg.finalize([ro])
    assert comm.statistics()["calls"] == calls  # nothing communicated
    out = avg.average([ro], copy=True)
    assert out.info is not None and out.info.iteration == 0
    np.testing.assert_allclose(out.params[0], np.full(3, (SIZE + 1) / 2.0), rtol=1e-6)
    avg.close()


def test_averager_takes_a_generator_of_names(comm: Communicator) -> None:
    """The names were read once per bucket: a generator was used up by the
    first and the second said "expected 1 names (one per tensor), got 0"."""
    w = [np.ones(3, np.float32), np.ones(2, np.float64)]
    avg = Averager(comm, w, "allreduce", names=(n for n in ["w", "b"]))
    assert [s.name for s in avg.specs] == ["w", "b"]
    avg.close()


def test_device_buckets_over_different_device_kinds_are_refused_on_every_rank(
        comm: Communicator) -> None:
    """buckets="device" with CUDA tensors on one rank and CPU tensors on the
    others gave device buckets everywhere: a GPU collective on one rank and
    host ones on the others, which only end at the deadline."""
    if SIZE == 1:
        pytest.skip("needs two ranks")
    from wagma_comm.train import make_method
    from wagma_comm.train.placement import agree_at_setup

    method = make_method("allreduce")
    kind = "cuda" if RANK == LAST else "cpu"
    with pytest.raises(InvalidArgumentError) as err:
        agree_at_setup(comm, "device", kind, method)
    assert err.value.argument == "buckets" and f"are on {kind}" in str(err.value)
    if SIZE > 2:
        assert f"majority: [{LAST}]" in str(err.value)
    assert agree_at_setup(comm, "host", kind, method) is False  # host buckets: fine
    assert agree_at_setup(comm, "device", "cpu", method) is True
    comm.barrier()
