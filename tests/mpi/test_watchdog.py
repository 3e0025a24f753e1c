"""The watchdog: a collective in flight longer than its threshold (half its
timeout, or WAGMA_WATCHDOG_S) logs one line naming the ranks not yet seen,
before the timeout (runtime/watch.py)."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from mpi4py import MPI

import wagma_comm

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


@pytest.mark.parametrize("algorithm", [None, "recursive_doubling"])
def test_watchdog_names_the_late_ranks_then_the_collective_completes(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        algorithm: str | None) -> None:
    """Default (the shared-memory exchange where every rank is on this host)
    and the message path, which the engine watches."""
    if SIZE == 1:
        pytest.skip("a late rank needs two ranks")
    monkeypatch.setenv("WAGMA_WATCHDOG_S", "1.0")  # read when the engine starts
    c = wagma_comm.init(timeout=30)
    try:
        c.barrier()
        buf = np.full(3, RANK + 1, np.float32)
        with caplog.at_level(logging.WARNING, logger="wagma_comm"):
            if RANK != 0:
                time.sleep(2.5)  # rank 0 waits; its watchdog fires after 1 s
            c.allreduce(buf, algorithm=algorithm)
        np.testing.assert_array_equal(buf, np.full(3, SIZE * (SIZE + 1) / 2, np.float32))
        if RANK == 0:
            lines = [r.getMessage() for r in caplog.records if r.name == "wagma_comm"]
            assert len(lines) == 1, lines
            assert "allreduce (round 1) in flight for" in lines[0]
            assert "ranks not yet seen: [" in lines[0]
            seen = lines[0].rsplit("[", 1)[1].rstrip("]")
            assert {int(x) for x in seen.split(",")} <= set(range(1, SIZE))
    finally:
        WORLD.Barrier()
        c.close()


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "nan"])
def test_a_bad_watchdog_variable_is_an_error_naming_it(
        monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """Checked locally, no communication. Before, ``abc`` was a bare
    ValueError ("could not convert string to float") and 0, -1 and NaN
    silently meant the default threshold."""
    from wagma_comm.runtime.watch import Watch

    monkeypatch.setenv("WAGMA_WATCHDOG_S", raw)
    with pytest.raises(wagma_comm.InvalidArgumentError, match="WAGMA_WATCHDOG_S") as info:
        Watch(None)
    assert info.value.argument == "WAGMA_WATCHDOG_S"
    with pytest.raises(wagma_comm.InvalidArgumentError, match="WAGMA_WATCHDOG_S"):
        wagma_comm.init()  # refused before its transport duplicates a communicator
    monkeypatch.setenv("WAGMA_WATCHDOG_S", "inf")  # a threshold never reached
    assert not Watch(None).overdue(deadline=1e9, timeout=1e9, now=1e9 - 1)
