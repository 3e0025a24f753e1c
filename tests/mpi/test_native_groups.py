"""Native collectives over groups: a call never precedes its group's MPI
communicator, and calls on one group keep their order (Work.requires)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import wagma_comm
from wagma_comm import Communicator

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


@pytest.mark.parametrize("step", [0, 1])
def test_back_to_back_async_native_calls_on_a_new_group(comm: Communicator, step: int) -> None:
    """The second call's group is still being created by the first call when
    it is submitted (it used to fail with KeyError, or mismatch its order)."""
    if SIZE < 3:
        pytest.skip("needs a group smaller than the world")
    group_size = 2
    members = comm.group_of(group_size, step + 5)  # a partition no other test used
    bufs = [np.full(7, (RANK + 1) * (k + 1), np.float32) for k in range(4)]
    handles = [comm.group_allreduce(b, group_size, step + 5, "sum", async_op=True,
                                    algorithm="native") for b in bufs]
    for k, h in enumerate(handles):
        h.wait()
        expected = sum((r + 1) * (k + 1) for r in members)
        np.testing.assert_array_equal(bufs[k], np.full(7, expected, np.float32))


def test_failed_setup_is_redone_by_the_next_call() -> None:
    """A collective that was to create a group's communicator fails before its
    set-up runs (a debug mismatch): the next native call on the group sets it
    up again instead of waiting for it forever."""
    if SIZE < 3:
        pytest.skip("needs a group smaller than the world")
    c = wagma_comm.init(timeout=20, debug=True)
    try:
        count = 4 if RANK == 0 else 8  # rank 0 disagrees: MismatchError everywhere
        with pytest.raises(wagma_comm.MismatchError):
            c.group_allreduce(np.ones(count, np.float32), 2, 0, algorithm="native")
        x = np.full(4, RANK + 1, np.float32)
        c.group_allreduce(x, 2, 0, "sum", algorithm="native")
        members = c.group_of(2, 0)
        np.testing.assert_array_equal(x, np.full(4, sum(r + 1 for r in members), np.float32))
    finally:
        MPI.COMM_WORLD.Barrier()
        c.close()
