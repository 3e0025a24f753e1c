"""Engine.close() with a progress thread that does not stop: it gives up
after the latest deadline plus the grace, fails what is left, and says which
collectives (comm.close() raises with that list). A real MPI transport over
MPI_COMM_SELF (one process, no mpiexec), and a service whose turn blocks
until the test lets it go."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from wagma_comm.dtypes import UINT8
from wagma_comm.errors import CommunicatorClosedError, WagmaError
from wagma_comm.runtime import engine as engine_mod
from wagma_comm.runtime.engine import Engine, Stage, Work
from wagma_comm.runtime.handle import Handle
from wagma_comm.schedule import algorithms
from wagma_comm.schedule.ir import DATA
from wagma_comm.transport.base import CHANNEL_DATA
from wagma_comm.transport.mpi import MPITransport


class _StuckService:
    """Holds the progress thread in its turn until ``release`` is set."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.failed: WagmaError | None = None

    def progress(self) -> bool:
        self.entered.set()
        self.release.wait(30)
        return False

    def fail(self, error: WagmaError) -> None:
        self.failed = error

    def busy(self) -> bool:
        return False


def _work(seq: int, timeout: float) -> Work:
    """A one-rank barrier (no messages) due in ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    stage = Stage(algorithms.compile_barrier(0, (0,)), CHANNEL_DATA,
                  {DATA: np.zeros(0, np.uint8)}, UINT8)
    handle = Handle("barrier", seq, deadline, lambda: True)
    return Work(seq, "barrier", handle, [stage], deadline, timeout)


def test_close_fails_and_names_what_a_stuck_thread_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, close() joined for a fixed time and returned silently with the
    work in flight and the thread alive."""
    monkeypatch.setattr(engine_mod, "CLOSE_GRACE_S", 0.2, raising=False)
    from mpi4py import MPI

    transport = MPITransport(MPI.COMM_SELF, timeout=10)
    engine = Engine(transport)
    service = _StuckService()
    engine.add_service(service)
    assert service.entered.wait(10)
    work = _work(0, 0.3)
    engine.submit(work)
    try:
        left = engine.close()
        assert left == ["barrier (round 0)"]
        # Its deadline plus the grace (measured from the deadline itself: time
        # passed between making the work and calling close() on a loaded host).
        assert time.monotonic() >= work.deadline + 0.2
        with pytest.raises(CommunicatorClosedError, match=r"barrier \(round 0\).*gave up"):
            work.handle.wait(timeout=0)
    finally:
        service.release.set()
    engine._thread.join(10)  # resumed, it cancels the rest and stops
    assert not engine.alive() and isinstance(service.failed, CommunicatorClosedError)
    transport.close()
