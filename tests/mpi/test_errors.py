"""Bad input, mismatches and timeouts under a real MPI job."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

import wagma_comm
from wagma_comm import Communicator

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def _readonly() -> np.ndarray:
    a = np.ones(4, dtype=np.float32)
    a.flags.writeable = False
    return a


F32 = np.ones(4, dtype=np.float32)
BAD_INPUTS: list[tuple[str, Callable[[Communicator], Any], type, str]] = [
    ("no dlpack", lambda c: c.allreduce([1.0, 2.0]), wagma_comm.BufferError, "buf"),
    ("strided", lambda c: c.allreduce(np.ones(8, np.float32)[::2]), wagma_comm.BufferError, "buf"),
    ("read-only", lambda c: c.allreduce(_readonly()), wagma_comm.BufferError, "buf"),
    ("empty", lambda c: c.allreduce(np.ones(0, np.float32)), wagma_comm.BufferError, "buf"),
    ("dtype", lambda c: c.allreduce(np.ones(4, np.complex64)), wagma_comm.BufferError, "buf"),
    ("op", lambda c: c.allreduce(F32, "mean"), wagma_comm.InvalidArgumentError, "op"),
    ("op type", lambda c: c.allreduce(F32, 3), wagma_comm.InvalidArgumentError, "op"),
    ("algorithm", lambda c: c.allreduce(F32, algorithm="tree9"),
     wagma_comm.InvalidArgumentError, "algorithm"),
    ("timeout 0", lambda c: c.allreduce(F32, timeout=0), wagma_comm.InvalidArgumentError,
     "timeout"),
    ("timeout nan", lambda c: c.barrier(timeout=float("nan")),
     wagma_comm.InvalidArgumentError, "timeout"),
    ("group_size 0", lambda c: c.group_allreduce(F32, 0, 0), wagma_comm.InvalidArgumentError,
     "group_size"),
    ("group_size > P", lambda c: c.group_allreduce(F32, SIZE + 1, 0),
     wagma_comm.InvalidArgumentError, "group_size"),
    ("step < 0", lambda c: c.group_allreduce(F32, 1, -1), wagma_comm.InvalidArgumentError,
     "step"),
    ("root", lambda c: c.broadcast(F32, root=SIZE), wagma_comm.InvalidArgumentError, "root"),
    ("root type", lambda c: c.broadcast(F32, root="0"), wagma_comm.InvalidArgumentError, "root"),
    ("groups size", lambda c: c.groups(0, 0), wagma_comm.InvalidArgumentError, "group_size"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_refused_locally_and_engine_survives(comm: Communicator, case: Any) -> None:
    _, call, exc, argument = case
    before = comm.statistics()["completed"]
    with pytest.raises(exc) as info:
        call(comm)
    assert info.value.argument == argument
    assert comm.statistics()["completed"] == before  # nothing was communicated
    a = np.full(3, RANK + 1.0)
    comm.allreduce(a)  # the next valid collective still works
    assert a[0] == SIZE * (SIZE + 1) / 2


def test_closed_communicator() -> None:
    c = wagma_comm.init(timeout=30)
    with c:
        c.barrier()
    assert c.closed
    with pytest.raises(wagma_comm.CommunicatorClosedError):
        c.allreduce(np.ones(2))
    c.close()  # idempotent


def test_debug_reports_mismatched_calls_by_rank() -> None:
    if SIZE == 1:
        pytest.skip("a mismatch needs two ranks")
    with wagma_comm.init(timeout=30, debug=True) as c:
        count = 5 if RANK == 1 else 4
        with pytest.raises(wagma_comm.MismatchError) as info:
            c.allreduce(np.ones(count, np.float32))
        err = info.value
        assert err.collective == "allreduce" and err.round == 0
        if RANK == 1:
            assert err.ranks == tuple(r for r in range(SIZE) if r != 1)
        else:
            assert err.ranks == (1,)
            assert "count=5" in err.details[1]
        # a different collective at the same round is named too
        with pytest.raises(wagma_comm.MismatchError) as info:
            if RANK == 0:
                c.broadcast(np.ones(4, np.float32))
            else:
                c.allreduce(np.ones(4, np.float32))
        assert ("broadcast" in str(info.value)) and info.value.round == 1
        a = np.ones(4, np.float32)
        c.allreduce(a)  # the exchange completed, so the communicator is still good
        assert a[0] == SIZE


@pytest.mark.parametrize("debug", [False, True])
def test_timeout_names_collective_round_and_missing_ranks(debug: bool) -> None:
    if SIZE == 1:
        pytest.skip("a missing rank needs two ranks")
    c = wagma_comm.init(timeout=30, debug=debug)
    c.barrier()  # round 0
    if RANK == 0:
        with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
            c.allreduce(np.ones(4, np.float32), timeout=0.5)
        err = info.value
        assert err.collective == "allreduce" and err.round == 1
        assert err.ranks and set(err.ranks) <= set(range(1, SIZE))
        if debug:  # the fingerprint exchange sees exactly who is missing
            assert err.ranks == tuple(range(1, SIZE))
        assert "allreduce (round 1)" in str(err)
        with pytest.raises(wagma_comm.CommunicatorClosedError, match="broken"):
            c.allreduce(np.ones(4, np.float32))
    WORLD.Barrier()
    c.close(cancel=True)
