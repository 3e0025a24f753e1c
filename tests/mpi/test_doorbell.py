"""Doorbells under a real MPI job (any number of ranks): a progress thread
that only listens sleeps on its bell, and both a peer's token and its own
application wake it at once.

The bell nap is stretched to 30 s here, so a wake-up that did not come from a
ring would show as a step taking 30 s; the tests allow 10.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from wagma_comm import Communicator
from wagma_comm.runtime import engine as engine_mod

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
SLOW = SIZE - 1


@pytest.fixture
def long_bell_naps(comm: Communicator, monkeypatch: pytest.MonkeyPatch) -> None:
    if comm._transport.doorbell is None:
        pytest.skip("no doorbells here (not Linux, or WAGMA_DOORBELL=0)")
    monkeypatch.setattr(engine_mod, "_BELL_NAP_S", 30.0)
    monkeypatch.setattr(engine_mod, "_BELL_AFTER_S", 0.0)


@pytest.mark.usefixtures("long_bell_naps")
def test_tokens_and_steps_wake_threads_asleep_on_their_bells(comm: Communicator) -> None:
    """Every thread falls asleep on its bell; the fast ranks step, so their
    own wake rings them and their tokens ring the slow rank's thread, which
    joins each round with the initial model while its application sits in an
    MPI barrier."""
    w = comm.wait_avoiding_group_allreduce(np.full(2, 100.0), SIZE, sync_every=100,
                                           activation="group", normalization="mean")
    naps = comm._engine.statistics()["bell_naps"]
    time.sleep(0.3)
    assert comm._engine.statistics()["bell_naps"] > naps  # asleep on the bell
    WORLD.Barrier()
    if RANK != SLOW or SIZE == 1:
        for t in range(3):
            model = np.full(2, float(RANK))
            t0 = time.monotonic()
            info = w.step(model)
            assert time.monotonic() - t0 < 10.0, "a thread slept through its bell"
            if SIZE > 1:
                assert SLOW not in info.fresh
                np.testing.assert_array_equal(model, (sum(range(SIZE - 1)) + 100.0) / SIZE)
            time.sleep(0.1)  # asleep on the bell again before the next step
    WORLD.Barrier()
    if RANK == SLOW and SIZE > 1:
        for t in range(3):
            assert w.step(np.full(2, 100.0)).round == 2
    w.close()
