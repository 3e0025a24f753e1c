"""The framework-agnostic Averager under a real MPI job (any number of ranks):
empty tensors, the statistics of drained iterations, the memory it keeps,
what finalize() checks before it communicates, the set-up broadcast into a
mix of writable and read-only tensors, and arguments of the wrong kind
(session 46 review)."""

from __future__ import annotations

import gc
import tracemalloc
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from mpi4py import MPI

from wagma_comm import Communicator, CommunicatorClosedError, InvalidArgumentError
from wagma_comm.train import Averager

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def _calls(comm: Communicator) -> dict[str, int]:
    return dict(comm.statistics()["calls"])


# -- empty tensors: left out of the buckets, as DistributedOptimizer does ------------------


@pytest.mark.parametrize("method,knobs", [("allreduce", {}), ("wagma", {"sync_every": 2}),
                                          ("dpsgd", {})], ids=["allreduce", "wagma", "dpsgd"])
@pytest.mark.parametrize("buckets", ["host", "device"])
def test_empty_tensors_are_left_out_of_the_buckets(comm: Communicator, method: str,
                                                   knobs: dict[str, Any], buckets: str) -> None:
    """An empty tensor (a zero-size bias, an empty pytree leaf) made the
    Averager raise BufferError("params[1]: buffer is empty; nothing to
    reduce"), while DistributedOptimizer leaves such parameters out of its
    buckets (docs/training.md). The Averager leaves them out too, a dtype
    whose tensors are all empty included, and averages the rest."""
    if buckets == "device" and method == "dpsgd":
        pytest.skip("dpsgd exchanges through host memory")
    w = np.full(4, RANK + 1.0, np.float32)
    params = [w, np.zeros((0, 3), np.float32), torch.zeros(0, dtype=torch.bfloat16),
              np.zeros((2, 0), np.float64)]
    grads = [w.copy(), np.zeros((0, 3), np.float32), torch.zeros(0, dtype=torch.bfloat16),
             np.zeros((2, 0), np.float64)]
    avg = Averager(comm, params, method, broadcast=False, buckets=buckets, **knobs)
    assert [s.count for s in avg.specs] == [4, 0, 0, 0]
    assert [s.dtype for s in avg.specs] == ["float32", "float32", "bfloat16", "float64"]
    for _ in range(3):
        avg.average(params, grads)
    out = avg.finalize(params, grads)
    if avg.averages == "model":  # finalize: one model everywhere
        assert len(set(WORLD.allgather(w.tobytes()))) == 1
    else:
        np.testing.assert_allclose(grads[0], np.full(4, (SIZE + 1) / 2.0), rtol=1e-6)
    assert [tuple(p.shape) for p in out.params[1:]] == [(0, 3), (0,), (2, 0)]
    copies = avg.average(params, grads, copy=True)
    changed = copies.params if avg.averages == "model" else copies.grads
    assert changed is not None and [tuple(c.shape) for c in changed] == [(4,), (0, 3), (0,),
                                                                         (2, 0)]
    assert [tuple(m.shape) for m in avg.model()] == [(4,), (0, 3), (0,), (2, 0)]
    avg.close()


def test_a_model_of_empty_tensors_only_is_refused_before_any_communication(
        comm: Communicator) -> None:
    """Nothing to average: refused naming params (DistributedOptimizer:
    "its parameters hold no elements"), before the set-up communicates."""
    calls = _calls(comm)
    with pytest.raises(InvalidArgumentError) as err:
        Averager(comm, [np.zeros(0, np.float32), np.zeros((3, 0), np.float64)], "wagma")
    assert err.value.argument == "params" and "no elements" in str(err.value)
    assert _calls(comm) == calls


def test_an_empty_tensor_still_has_its_shape_and_dtype_checked(comm: Communicator) -> None:
    """Left out of the buckets, an empty tensor is still part of the layout:
    one of another shape or dtype later is named, an unsupported dtype at
    set-up."""
    from wagma_comm.errors import BufferError

    x = [np.ones(3, np.float32), np.zeros((0, 2), np.float32)]
    with pytest.raises(BufferError, match=r"params\[1\].*unsupported dtype"):
        Averager(comm, [x[0], np.zeros(0, np.complex64)], "allreduce")
    avg = Averager(comm, x, "local_sgd", sync_every=1)
    with pytest.raises(InvalidArgumentError, match=r"params\[1\].*\(0, 2\) float32, got "
                       r"shape \(0, 3\) float32"):
        avg.average([x[0], np.zeros((0, 3), np.float32)])
    with pytest.raises(InvalidArgumentError, match=r"params\[1\].*float64"):
        avg.average([x[0], np.zeros((0, 2), np.float64)])
    avg.average(x)
    avg.close()


# -- statistics: drained iterations, and after close -------------------------------------


@pytest.mark.parametrize("method,knobs", [("local_sgd", {"sync_every": 1}),
                                          ("solo", {"sync_every": 2}),
                                          ("wagma", {"sync_every": 2})],
                         ids=["local_sgd", "solo", "wagma"])
# solo: the drained step's input has no round left to land in (partial.md)
@pytest.mark.filterwarnings("ignore:solo_allreduce closed with the inputs")
def test_a_drained_iteration_counts_in_the_statistics(comm: Communicator, method: str,
                                                      knobs: dict[str, Any]) -> None:
    """start() then finalize() or close(): the iteration is finished and
    counted in ``avg.iteration`` (docs/training.md: "counted"), but
    statistics() left it out, so ``iterations`` fell behind ``iteration``
    (and a drained sync round was missing from ``synchronized``)."""
    x = [np.full(3, RANK + 1.0, np.float32)]
    g = [x[0].copy()]
    avg = Averager(comm, x, method, broadcast=False, **knobs)
    avg.average(x, g)
    avg.start(x, g)  # iteration 1: a sync round of sync_every=2
    avg.finalize(x, g)
    stats = avg.statistics()
    assert avg.iteration == 2 and stats["iterations"] == 2
    assert stats["synchronized"] == 2 if method == "local_sgd" else 1
    avg.start(x, g)
    avg.close()
    stats = avg.statistics()
    assert avg.iteration == 3 and stats["iterations"] == 3


@pytest.mark.parametrize("method", ["wagma", "solo"])
def test_statistics_after_close_keep_the_collectives_telemetry(comm: Communicator,
                                                               method: str) -> None:
    """close() releases the method's collectives, and statistics() then
    reported ``collective: {}``: printing the telemetry after training
    (examples/numpy_example.py reads statistics() after close) lost it. It
    is what it was when the collectives were released."""
    x = [np.ones(3, np.float32)]
    avg = Averager(comm, x, method, sync_every=2)
    for _ in range(3):
        avg.average(x, [x[0].copy()])
    avg.finalize(x, [x[0].copy()])
    before = avg.statistics()["collective"]
    assert before and before["iteration"] == 3
    avg.close()
    after = avg.statistics()["collective"]
    assert after == before
    assert avg.statistics()["iterations"] == 3


# -- memory ---------------------------------------------------------------------------------


class _Traced:
    """Bytes allocated from the training layer's code (the innermost frame
    in wagma_comm/train/) and still held, while tracing: the communicator's
    own pools and first imports are not the Averager's."""

    def __enter__(self) -> "_Traced":
        tracemalloc.start()
        self._start = self._snapshot()
        return self

    def __exit__(self, *exc: Any) -> None:
        tracemalloc.stop()

    @staticmethod
    def _snapshot() -> tracemalloc.Snapshot:
        return tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, "*/wagma_comm/train/*")])

    def held(self) -> int:
        return sum(d.size_diff for d in self._snapshot().compare_to(self._start, "filename"))


def _reaches(root: Any, target: Any, comm: Communicator) -> bool:
    """Whether ``target`` is reachable from ``root`` through references
    that do not pass through the communicator (its runtime may keep a
    finished call's buffer a while, which is not the Averager's doing)."""
    seen, todo = {id(comm)}, [root]
    while todo:
        obj = todo.pop()
        if obj is target:
            return True
        if id(obj) in seen or isinstance(obj, (type, ModuleType)):
            continue
        seen.add(id(obj))
        todo.extend(gc.get_referents(obj))
    return False


def test_the_averager_holds_no_bucket_it_does_not_need(comm: Communicator) -> None:
    """A model method allocated a gradient bucket it never uses, and a
    gradient method kept its gradient bucket after close(): a whole copy of
    the model each (on the GPU, with device buckets) for as long as the
    Averager lived. model() still works after close(); finish() says it
    is closed, as start() does (it said "no iteration was started")."""
    n = 1 << 20  # 4 MiB of float32
    nbytes = 4 * n
    x = [np.ones(n, np.float32)]
    with _Traced() as traced:
        avg = Averager(comm, x, "local_sgd", sync_every=1)
        held = traced.held()
    assert held < 1.5 * nbytes, f"a model method's Averager holds {held} bytes"
    avg.average(x)
    avg.close()
    avg = Averager(comm, x, "allreduce")
    avg.average(x, [x[0].copy()])
    assert avg._grads is not None
    flat = avg._grads.flats["float32"]
    assert _reaches(avg, flat, comm)
    avg.close()
    assert not _reaches(avg, flat, comm), "a closed Averager holds its gradient bucket"
    with pytest.raises(CommunicatorClosedError, match="closed"):  # as start() and average()
        avg.finish(x, [x[0].copy()])
    assert [m.shape for m in avg.model()] == [(n,)]


# -- finalize checks its inputs before it communicates ----------------------------------------


@pytest.mark.parametrize("copy", [False, True])
def test_finalize_checks_the_model_before_it_drains_an_iteration(comm: Communicator,
                                                                 copy: bool) -> None:
    """A model method's finalize() with a None or a changed tensor drained
    the iteration in flight (a collective wait), then raised; with
    ``copy=True`` no check at all came before. Now the error is raised
    before any communication, with the iteration still in flight, and a
    correct finalize() follows."""
    x = [np.full(3, RANK + 1.0, np.float32), np.ones(2, np.float64)]
    avg = Averager(comm, x, "local_sgd", sync_every=1, broadcast=False)
    avg.start(x)
    calls = _calls(comm)
    for bad, arg in (([None, x[1]], r"params\[0\]"),
                     ([x[0], np.ones(3, np.float64)], r"params\[1\]"),
                     ([x[0]], "params")):
        with pytest.raises(InvalidArgumentError, match=arg):
            avg.finalize(bad, copy=copy)
        assert avg.method.in_flight and avg.iteration == 0
    assert _calls(comm) == calls  # nothing communicated
    out = avg.finalize(x, copy=copy)
    mean = np.full(3, (SIZE + 1) / 2.0, np.float32)
    np.testing.assert_allclose(out.params[0], mean, rtol=1e-6)
    assert avg.iteration == 1
    avg.close()


# -- the set-up broadcast ---------------------------------------------------------------


def test_the_set_up_broadcast_writes_every_writable_tensor_of_a_mixed_list(
        comm: Communicator) -> None:
    """One read-only tensor among writable ones (a frozen table) made the
    broadcast's unpack raise before writing any: every rank silently kept
    its own values of the writable tensors, and a gradient method never
    brought them together. The writable ones get rank 0's values; the
    read-only one is read back with model(), as documented."""
    if SIZE == 1:
        pytest.skip("rank 0's values differ from nobody's")
    w = np.full(3, RANK + 1.0, np.float32)
    ro = np.full(2, RANK + 1.0, np.float32)
    ro.flags.writeable = False
    h = np.full(2, RANK + 1.0, ml_dtypes.bfloat16)
    avg = Averager(comm, [w, ro, h], "allreduce")
    assert w.tolist() == [1.0] * 3 and h.astype(np.float32).tolist() == [1.0] * 2
    assert ro.tolist() == [RANK + 1.0] * 2  # never written
    assert avg.model()[1].tolist() == [1.0] * 2
    avg.close()


# -- arguments of the wrong kind ----------------------------------------------------------


def test_a_bad_comm_broadcast_or_copy_is_named(comm: Communicator) -> None:
    """``comm=None`` failed with a bare AttributeError, and a ``broadcast``
    or ``copy`` that is no bool (None, a string) was taken for its truth
    value silently, as DistributedOptimizer refuses ``broadcast``."""
    x = [np.ones(3, np.float32)]
    calls = _calls(comm)
    for bad in (None, "comm", WORLD):
        with pytest.raises(InvalidArgumentError) as err:
            Averager(bad, x, "allreduce")
        assert err.value.argument == "comm"
    for bad in (None, "no", 1):
        with pytest.raises(InvalidArgumentError) as err:
            Averager(comm, x, "allreduce", broadcast=bad)
        assert err.value.argument == "broadcast"
    assert _calls(comm) == calls
    avg = Averager(comm, x, "allreduce")
    g = [np.full(3, RANK + 1.0, np.float32)]
    calls = _calls(comm)
    for bad in (None, "yes"):
        with pytest.raises(InvalidArgumentError) as err:
            avg.average(x, g, copy=bad)
        assert err.value.argument == "copy"
        with pytest.raises(InvalidArgumentError) as err:
            avg.finalize(x, g, copy=bad)
        assert err.value.argument == "copy"
    assert _calls(comm) == calls and avg.iteration == 0
    avg.start(x, g)
    for bad in (None, "yes"):
        with pytest.raises(InvalidArgumentError) as err:
            avg.finish(x, g, copy=bad)
        assert err.value.argument == "copy" and avg.method.in_flight
    avg.finish(x, g)
    np.testing.assert_allclose(g[0], np.full(3, (SIZE + 1) / 2.0), rtol=1e-6)
    avg.close()
