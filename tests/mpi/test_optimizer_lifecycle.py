"""DistributedOptimizer and the gossip methods under a real MPI job (any
number of ranks): the statistics of drained iterations and after close(),
the buckets it allocates and releases, what close() releases in D-PSGD and
SGP, and parameter groups added after wrapping (session 46 review)."""

from __future__ import annotations

import copy
import gc
from types import FunctionType, ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from mpi4py import MPI

from conftest import not_at_3_or_8_ranks

from wagma_comm import Communicator, CommunicatorClosedError, InvalidArgumentError
from wagma_comm.train import DistributedOptimizer
from wagma_comm.train.pytorch import TorchBucket

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()

torch.set_num_threads(1)


def _calls(comm: Communicator) -> dict[str, int]:
    return dict(comm.statistics()["calls"])


def _reachable(root: Any, comm: Communicator) -> list[Any]:
    """Every object reachable from ``root`` through references that do not
    pass through the communicator (its runtime may keep a finished call's
    buffer a while, which is not the optimizer's doing), classes, modules
    or a function's globals (the whole program)."""
    seen, todo, out = {id(comm)}, [root], []
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, ModuleType)):
            continue
        seen.add(id(obj))
        out.append(obj)
        refs = gc.get_referents(obj)
        if isinstance(obj, FunctionType):
            refs = [r for r in refs if r is not obj.__globals__]
        todo.extend(refs)
    return out


def _reaches(root: Any, targets: list[Any], comm: Communicator) -> list[Any]:
    """The ``targets`` reachable from ``root`` (see :func:`_reachable`)."""
    ids = {id(o) for o in _reachable(root, comm)}
    return [t for t in targets if id(t) in ids]


def _bucket_memory(bucket: TorchBucket) -> list[Any]:
    """What a bucket allocates: its flat tensors, host mirrors, NumPy views."""
    return [bucket, *bucket._flat.values(), *bucket._host.values(), *bucket._np.values()]


def _one(opt: DistributedOptimizer, model: torch.nn.Module) -> None:
    opt.zero_grad()
    model(torch.full((1, 2), float(RANK + 1))).sum().backward()
    opt.step()


# -- statistics: drained iterations, and after close -------------------------------------


@pytest.mark.parametrize("method,end", [("wagma", "finalize"), ("wagma", "close"),
                                        ("local_sgd", "finalize"),
                                        ("allreduce", "finalize"), ("allreduce", "close")])
@not_at_3_or_8_ranks
def test_a_drained_iteration_counts_in_the_statistics(comm: Communicator, method: str,
                                                      end: str) -> None:
    """An iteration started (zero_grad(); gradient methods: averaged by
    synchronize()) and ended by finalize() or close() counts in
    ``opt.iteration`` (docs/training.md), but statistics() left it out:
    ``iterations`` fell behind ``iteration``, and a drained sync round was
    missing from ``synchronized``, as the Averager's were before."""
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm, method,
                               model=model, sync_every=2)
    _one(opt, model)
    opt.zero_grad()  # iteration 1: a sync round of sync_every=2
    model(torch.ones(1, 2)).sum().backward()
    if method == "allreduce":
        opt.synchronize()  # averaged, never stepped
    getattr(opt, end)()
    stats = opt.statistics()
    assert opt.iteration == 2 and stats["iterations"] == 2, stats
    assert stats["synchronized"] == (2 if method == "allreduce" else 1), stats
    assert stats["communicating"] == (1 if method == "local_sgd" else 2), stats
    assert opt.last_info is not None and opt.last_info.iteration == 1
    if end == "finalize":
        opt.zero_grad()  # model methods start here, gradient methods at the last hook
        model(torch.ones(1, 2)).sum().backward()
        opt.close()
        assert opt.iteration == 3 and opt.statistics()["iterations"] == 3
    else:
        opt.close()


@pytest.mark.parametrize("method", ["wagma", "solo"])
def test_statistics_after_close_keep_the_collectives_telemetry(comm: Communicator,
                                                               method: str) -> None:
    """close() releases the method's collectives, and statistics() then
    reported ``collective: {}``: examples/torch_example.py and a training
    loop that prints the telemetry after close() lost it (the Averager kept
    it since this session)."""
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm, method,
                               model=model, sync_every=2)
    for _ in range(3):
        _one(opt, model)
    opt.finalize()
    before = opt.statistics()["collective"]
    assert before and before["iteration"] == 3
    opt.close()
    after = opt.statistics()
    assert after["collective"] == before
    assert after["iterations"] == 3


# -- memory -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["wagma", "local_sgd", "allreduce"])
def test_the_optimizer_holds_no_bucket_it_does_not_need(comm: Communicator,
                                                        method: str) -> None:
    """A model method allocated a gradient bucket it never uses (a whole copy
    of the model; staged CUDA parameters: another in pinned host memory
    too), and close() kept every bucket for as long as the wrapper lived."""
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm, method,
                               model=model, sync_every=2)
    buckets = [o for o in _reachable(opt, comm) if isinstance(o, TorchBucket)]
    assert len(buckets) == 1, f"{method} holds {len(buckets)} buckets"  # what it averages
    for _ in range(3):
        _one(opt, model)
    opt.finalize()
    memory = [m for b in buckets for m in _bucket_memory(b)]
    del buckets
    opt.close()
    held = _reaches(opt, memory, comm)
    assert not held, f"a closed optimizer holds {len(held)} of its buckets' buffers"
    with pytest.raises(CommunicatorClosedError, match="closed"):
        opt.finalize()
    assert opt.statistics()["buckets"] == "host"


@pytest.mark.parametrize("method", ["allreduce", "solo"])
@pytest.mark.parametrize("broadcast", [True, False])
def test_a_gradient_method_keeps_no_weights_bucket(comm: Communicator, method: str,
                                                   broadcast: bool) -> None:
    """A gradient method uses the weights' bucket only for the set-up
    broadcast, but kept it (a whole copy of the model; staged CUDA
    parameters: another in pinned host memory) for the wrapper's lifetime,
    and made it with ``broadcast=False`` too. Training still averages."""
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm, method,
                               model=model, sync_every=1, broadcast=broadcast)
    buckets = [o for o in _reachable(opt, comm) if isinstance(o, TorchBucket)]
    assert buckets == [opt._grads], f"{method} holds {len(buckets)} buckets"
    if broadcast:
        for _ in range(2):
            _one(opt, model)
        flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
        assert len(set(WORLD.allgather(flat.tobytes()))) == 1
    opt.close()


@pytest.mark.parametrize("method", ["dpsgd", "sgp"])
def test_a_closed_gossip_method_releases_what_it_received(comm: Communicator,
                                                          method: str) -> None:
    """D-PSGD and SGP keep a receive buffer per neighbour (a model copy
    each) and the bucket's buffers between iterations; close() kept them
    alive for as long as the method (and so the optimizer) lived."""
    if SIZE == 1:
        pytest.skip("one rank has no neighbour to receive from")
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm, method,
                               model=model)
    for _ in range(2):
        _one(opt, model)
    m = opt.method
    received = [x for r in m._received for x in r]  # type: ignore[attr-defined]
    buffers = list(m._buffers)  # type: ignore[attr-defined]
    assert received and buffers
    opt.close()
    held = _reaches(opt, received + buffers, comm)
    assert not held, f"a closed {method} holds {len(held)} of its exchange buffers"


def test_a_gossip_round_that_failed_keeps_its_send_buffers_at_close() -> None:
    """The release at close() stops short of the buffers a failed round sent
    from: the exchange abandoned those sends without completing them, and
    MPI may still read the buffers (freed, it would send whatever took
    their memory, or fault). The receive buffers go (their receives were
    cancelled)."""
    if SIZE == 1:
        pytest.skip("a missing neighbour needs two ranks")
    import wagma_comm
    from wagma_comm.errors import CollectiveTimeoutError
    from wagma_comm.train.methods import make_method, ring_neighbours

    c = wagma_comm.init(timeout=1.0)
    last = SIZE - 1
    buf = [np.ones(4, np.float32)]
    m = make_method("dpsgd")
    m.setup(c, buf)
    m.start(0, buf)
    m.finish()  # everyone
    if RANK in ring_neighbours(last, SIZE):
        m.start(1, buf)
        with pytest.raises(CollectiveTimeoutError):
            m.finish()  # the last rank does not come
        m.close()
        assert m._received == []  # type: ignore[attr-defined]
        assert [b is buf[0] for b in m._buffers] == [True]  # type: ignore[attr-defined]
    else:
        if RANK != last:
            m.start(1, buf)
            m.finish()  # not the last rank's neighbour: its own round completes
        m.close()
        assert m._received == [] and m._buffers == []  # type: ignore[attr-defined]
    WORLD.Barrier()
    c.close(cancel=True)


def test_a_failed_gossip_rounds_messages_never_reach_a_later_exchange(
        comm: Communicator) -> None:
    """A D-PSGD round rank 0 gave up on (rank 1 never came) leaves its sends
    in flight. close() freed the exchange's communicator anyway, MPI gave its
    context to the next one, and that exchange's round received them: rank
    1 averaged in 777-ish values (388.75 where 0.5 was due). It is kept now,
    as the transport keeps a broken communicator's."""
    if SIZE != 2:
        pytest.skip("two ranks (rank-count independent)")
    import wagma_comm
    from wagma_comm.errors import CollectiveTimeoutError
    from wagma_comm.train.methods import make_method

    c = wagma_comm.init(timeout=1.0)
    buf = [np.full(4, 100.0 + RANK, np.float32)]
    m = make_method("dpsgd")
    m.setup(c, buf)
    m.start(0, buf)
    m.finish()
    if RANK == 0:
        buf[0][:] = 777.0
        m.start(1, buf)
        with pytest.raises(CollectiveTimeoutError):
            m.finish()
    m.close()
    WORLD.Barrier()
    c.close(cancel=True)
    later = [np.full(4, float(RANK), np.float32)]
    m = make_method("dpsgd")
    m.setup(comm, later)
    try:
        for t in range(3):
            m.start(t, later)
            m.finish()
            np.testing.assert_array_equal(later[0], np.full(4, 0.5, np.float32))
    finally:
        m.close()


def test_zero_grad_after_close_hooks_nothing(comm: Communicator) -> None:
    """zero_grad() after close() still hooked a parameter unfrozen since:
    the parameter then held the closed optimizer (its buckets and method)
    alive through its hook, for as long as the model lived."""
    model = torch.nn.Linear(2, 1)
    model.bias.requires_grad_(False)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm,
                               "allreduce", model=model)
    _one(opt, model)
    opt.close()
    model.bias.requires_grad_(True)
    opt.zero_grad()  # the wrapped optimizer's zero_grad: local, still allowed
    assert not _reaches(model, [opt], comm), "a parameter holds the closed optimizer"
    model(torch.ones(1, 2)).sum().backward()  # plain torch from here
    assert model.bias.grad is not None and not opt.method.in_flight


# -- parameter groups added after wrapping --------------------------------------------------


@pytest.mark.parametrize("method", ["wagma", "allreduce"])
def test_a_parameter_group_added_after_wrapping_is_refused(comm: Communicator,
                                                           method: str) -> None:
    """``opt.optimizer.add_param_group()`` after wrapping (the wrapper's
    own add_param_group refuses) gave the optimizer parameters no bucket
    holds: they were stepped with each rank's own gradient and never
    averaged nor broadcast, so the replicas diverged silently. Now the
    next zero_grad(), backward or step() refuses it naming ``optimizer``,
    before that iteration communicates."""
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm, method,
                               model=model)
    _one(opt, model)
    extra = torch.nn.Parameter(torch.full((3,), float(RANK)))
    opt.optimizer.add_param_group({"params": [extra]})
    calls = _calls(comm)
    with pytest.raises(InvalidArgumentError, match="after wrapping") as err:
        opt.zero_grad()
        (model(torch.ones(1, 2)).sum() + extra.sum()).backward()
        opt.step()
    assert err.value.argument == "optimizer"
    assert _calls(comm) == calls  # nothing communicated
    assert opt.iteration == 1 and not opt.method.in_flight
    with pytest.raises(InvalidArgumentError, match="after wrapping"):
        opt.finalize()
    assert _calls(comm) == calls
    opt.optimizer.param_groups.pop()  # the layout it was wrapped with: usable again
    _one(opt, model)
    assert opt.iteration == 2
    opt.zero_grad()  # a group added while this iteration is averaged: step() refuses it
    model(torch.ones(1, 2)).sum().backward()
    opt.optimizer.add_param_group({"params": [extra]})
    before = extra.detach().clone()
    with pytest.raises(InvalidArgumentError, match="after wrapping"):
        opt.step()
    assert opt.iteration == 2 and torch.equal(extra.detach(), before)  # not stepped
    opt.optimizer.param_groups.pop()
    opt.step()  # the averaging started before finishes
    assert opt.iteration == 3
    opt.finalize()
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
    assert len(set(WORLD.allgather(flat.tobytes()))) == 1
    opt.close()
    assert np.all(extra.detach().numpy() == RANK)


# -- checkpoints --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["local_sgd", "allreduce"])
def test_a_checkpoint_after_a_skipped_step_resumes_the_uninterrupted_run(
        comm: Communicator, method: str) -> None:
    """AMP's GradScaler skipped rank 0's step of an averaged iteration
    (model method: only rank 0 overflowed; gradient method: the average
    overflows everywhere), then every rank took a checkpoint. The skipped
    iteration counts at the next zero_grad(), but state_dict() saved it as
    not yet done: rank 0's state was an iteration behind the others' (no
    rank could load the checkpoint), and a gradient method refused it as
    "gradients are being averaged". The state is now of the next iteration,
    and resuming from it continues the uninterrupted run exactly."""
    if not hasattr(torch.amp, "GradScaler"):
        pytest.skip("torch.amp.GradScaler('cpu') needs torch >= 2.3")

    def fresh() -> tuple[torch.nn.Module, DistributedOptimizer, Any]:
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   comm, method, model=model, sync_every=2)
        return model, opt, torch.amp.GradScaler("cpu", init_scale=4.0)

    def run(steps: range, model: torch.nn.Module, opt: DistributedOptimizer,
            scaler: Any) -> None:
        for t in steps:
            opt.zero_grad()
            x = torch.full((1, 2), float("inf") if t == 1 and RANK == 0 else RANK + t + 1.0)
            scaler.scale(model(x).sum()).backward()
            opt.synchronize()
            scaler.step(opt)
            scaler.update()

    model, opt, scaler = fresh()
    run(range(4), model, opt, scaler)
    whole = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    opt.close()
    model, opt, scaler = fresh()
    run(range(2), model, opt, scaler)
    state = copy.deepcopy((model.state_dict(), opt.state_dict(), scaler.state_dict()))
    assert state[1]["iteration"] == 2
    opt.close()
    model, opt, scaler = fresh()
    model.load_state_dict(state[0])
    opt.load_state_dict(state[1])
    scaler.load_state_dict(state[2])
    assert opt.iteration == 2
    run(range(2, 4), model, opt, scaler)
    resumed = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    assert torch.equal(resumed, whole), f"{method}: the resumed run differs"
    opt.close()


# -- step(closure) --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["allreduce", "solo"])
def test_step_with_a_closure_after_backward_is_refused_naming_closure(
        comm: Communicator, method: str) -> None:
    """A backward, then ``step(closure)`` (a gradient method, overlap): the
    hooks had started averaging the first backward's gradients, and the
    closure's backward failed from inside with an error naming ``overlap``
    and "gradient accumulation". Now step() refuses the closure before it
    runs, naming it, and a plain step() then finishes that iteration."""
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), comm, method,
                               model=model, sync_every=1)
    x = torch.full((1, 2), float(RANK + 1))
    ran = []

    def closure() -> torch.Tensor:
        ran.append(1)
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    opt.zero_grad()
    model(x).sum().backward()
    with pytest.raises(InvalidArgumentError, match="closure") as err:
        opt.step(closure)
    assert err.value.argument == "closure" and not ran
    opt.step()  # the iteration the backward started
    assert opt.iteration == 1
    assert torch.allclose(model.bias.grad, torch.ones(1))
    opt.step(closure)  # a closure with no backward before it: averaged as usual
    assert ran and opt.iteration == 2
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
    assert len(set(WORLD.allgather(flat.tobytes()))) == 1
    opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_step_with_a_closure_after_synchronize_averages_the_closures_gradients(
        comm: Communicator, overlap: bool) -> None:
    """synchronize() averaged this iteration, then ``step(closure)`` whose
    closure recomputes the gradients without ``opt.zero_grad()``: with
    overlap=False nothing saw the new gradients, and step() applied each
    rank's own closure gradient unaveraged (the replicas diverged silently).
    The closure's gradients are now averaged, in a round of their own."""
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), comm,
                               "allreduce", model=model, overlap=overlap)

    def closure() -> torch.Tensor:
        model.zero_grad()
        loss = model(torch.full((1, 2), float(RANK + 1))).sum()
        loss.backward()
        return loss

    opt.zero_grad()
    model(torch.full((1, 2), 10.0 * (RANK + 1))).sum().backward()
    opt.synchronize()
    opt.step(closure)
    mean = (SIZE + 1) / 2  # the mean of the closures' weight gradients, RANK + 1
    assert torch.allclose(model.weight.grad, torch.full((1, 2), mean))
    assert opt.iteration == 2 and opt.statistics()["iterations"] == 2
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
    assert len(set(WORLD.allgather(flat.tobytes()))) == 1
    opt.close()


# -- a parameter replaced after wrapping ------------------------------------------------------


@pytest.mark.parametrize("method", ["wagma", "allreduce"])
def test_a_parameter_replaced_in_the_optimizer_is_refused(comm: Communicator,
                                                          method: str) -> None:
    """A parameter replaced in ``opt.optimizer.param_groups`` by another
    tensor of the same shape: the group sizes still matched, so the buckets
    kept averaging the old tensor while the new one was stepped with each
    rank's own gradient (the replicas diverged silently). Now refused naming
    ``optimizer`` and the parameter, before that iteration communicates."""
    model = torch.nn.Linear(2, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, method,
                               model=model)
    _one(opt, model)
    new = torch.nn.Parameter(torch.full((1, 2), float(RANK)))
    params = opt.optimizer.param_groups[0]["params"]
    old, params[0] = params[0], new
    calls = _calls(comm)
    with pytest.raises(InvalidArgumentError, match="another tensor") as err:
        opt.zero_grad()
        (model(torch.ones(1, 2)).sum() + new.sum()).backward()
        opt.step()
    assert err.value.argument == "optimizer" and "'weight'" in str(err.value)
    assert _calls(comm) == calls  # nothing communicated
    assert opt.iteration == 1 and not opt.method.in_flight
    assert np.all(new.detach().numpy() == RANK)  # not stepped
    params[0] = old  # the tensor it was wrapped with: usable again
    opt.zero_grad()
    _one(opt, model)
    assert opt.iteration == 2
    opt.finalize()
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
    assert len(set(WORLD.allgather(flat.tobytes()))) == 1
    opt.close()


# -- a Method instance shared by two optimizers ------------------------------------------------


def test_a_method_instance_set_up_by_another_optimizer_is_refused(comm: Communicator) -> None:
    """One WagmaSGD instance passed to two optimizers (a GAN's generator and
    discriminator): the second set-up replaced the first's collectives
    under it (never closed: the interpreter warned at exit) and both ran
    their rounds on the second's. Now refused naming ``method``, before
    communicating; once the first is closed, the instance can be reused."""
    from wagma_comm.train.methods import WagmaSGD

    method = WagmaSGD(1, 2)
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    first = DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.01), comm, method,
                                 model=a)
    colls = list(method._colls)
    calls = _calls(comm)
    with pytest.raises(InvalidArgumentError, match="already set up") as err:
        DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.01), comm, method, model=b)
    assert err.value.argument == "method"
    assert _calls(comm) == calls and method._colls == colls  # nothing made, nothing sent
    _one(first, a)
    first.close()
    second = DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.01), comm, method,
                                  model=b)
    _one(second, b)
    assert second.iteration == 1
    second.close()
