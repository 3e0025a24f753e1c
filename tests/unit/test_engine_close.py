"""Engine.close() with a progress thread that does not stop: it gives up
after the latest deadline plus the grace, fails what is left, and says which
collectives (comm.close() raises with that list). A real MPI transport over
MPI_COMM_SELF (one process, no mpiexec), and a service whose turn blocks
until the test lets it go."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np
import pytest

from wagma_comm.dtypes import UINT8
from wagma_comm.errors import (CollectiveTimeoutError, CommunicatorClosedError, TransportError,
                               WagmaError)
from wagma_comm.runtime import engine as engine_mod
from wagma_comm.runtime import handle as handle_mod
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


def _engine() -> tuple[Engine, MPITransport]:
    from mpi4py import MPI

    transport = MPITransport(MPI.COMM_SELF, timeout=10)
    return Engine(transport), transport


def _driven(engine: Engine, seq: int, timeout: float,
            on_complete: Callable[[Any, BaseException | None], None] | None = None) -> Work:
    """:func:`_work` with a handle that drives ``engine``, as the
    communicator makes them (wait() and test() run turns of it)."""
    work = _work(seq, timeout)
    work.handle = Handle("barrier", seq, work.deadline, engine.alive, engine.drive_until,
                         engine.nudge)
    work.on_complete = on_complete
    return work


def test_a_handle_nobody_will_finish_raises_from_test_and_a_timed_wait() -> None:
    """Its engine stopped: test() returned False for ever (a polling loop
    hung), and wait(timeout=) waited the whole timeout to say "still
    running; call wait() again", again and again."""
    engine, transport = _engine()
    engine.close()
    assert not engine.alive()
    handle = Handle("allreduce", 7, time.monotonic() + 60, engine.alive, engine.drive_until,
                    engine.nudge)
    with pytest.raises(CommunicatorClosedError, match=r"allreduce \(round 7\).*stopped"):
        handle.test()
    start = time.monotonic()
    with pytest.raises(CommunicatorClosedError, match=r"allreduce \(round 7\).*stopped"):
        handle.wait(timeout=20)
    assert time.monotonic() - start < 10
    transport.close()


def test_a_handle_past_its_deadline_on_a_stuck_engine_raises_from_test_and_a_timed_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The progress thread is stuck (in a call, here a service's turn):
    wait() raised the timeout past the deadline plus the grace, but test()
    returned False for ever and wait(timeout=) waited its whole timeout."""
    monkeypatch.setattr(handle_mod, "_GRACE_S", 1.0)
    engine, transport = _engine()
    service = _StuckService()
    engine.add_service(service)
    assert service.entered.wait(10)
    work = _driven(engine, 3, 0.3)
    engine.submit(work)
    try:
        while time.monotonic() < work.deadline + 0.1:  # well before the grace ends
            assert work.handle.test() is False
            time.sleep(0.01)
        time.sleep(max(0.0, work.deadline + 1.05 - time.monotonic()))
        with pytest.raises(CollectiveTimeoutError, match=r"barrier \(round 3\).*did not fail"):
            work.handle.test()
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match=r"barrier \(round 3\)"):
            work.handle.wait(timeout=20)
        assert time.monotonic() - start < 10
    finally:
        service.release.set()
    engine.close()
    transport.close()


class _Hold:
    """An on_complete that waits until released, then raises (a bug)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, result: object, error: BaseException | None) -> None:
        self.entered.set()
        self.release.wait(30)
        raise ZeroDivisionError("bug in a completion callback")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_when_the_progress_thread_dies_every_waiter_gets_its_error() -> None:
    """A callback's bug kills the progress thread. Before, neither the
    collective whose callback failed (no longer in flight) nor one
    submitted meanwhile (never taken from the submission queue) was failed:
    test() said False for ever, wait(timeout=) "still running"."""
    engine, transport = _engine()
    hold = _Hold()
    first = _driven(engine, 0, 30, on_complete=hold)
    engine.submit(first)
    assert hold.entered.wait(10)  # the progress thread is in the callback
    second = _driven(engine, 1, 30)
    engine.submit(second)
    hold.release.set()
    engine._thread.join(10)
    assert not engine.alive()
    with pytest.raises(TransportError, match=r"barrier \(round 0\).*callback failed: "
                                             r"ZeroDivisionError"):
        first.handle.wait(timeout=5)
    with pytest.raises(TransportError, match="progress thread failed.*ZeroDivisionError"):
        second.handle.test()
    with pytest.raises(CommunicatorClosedError, match="broken"):
        engine.submit(_driven(engine, 2, 30))
    transport.close()


def test_a_callback_that_fails_on_a_waiting_thread_fails_its_handle() -> None:
    """The waiter drives the engine (wait() lends its thread): the bug is
    raised to it and breaks the engine, but the handle was left unfinished
    with the progress thread alive, so test() said False until the deadline
    (plus the grace) and another waiter saw a false "timeout"."""
    engine, transport = _engine()

    def bug(result: object, error: BaseException | None) -> None:
        raise ZeroDivisionError("bug in a completion callback")

    work = _driven(engine, 0, 60, on_complete=bug)
    engine.submit(work, wake=False)  # the waiter runs it
    with pytest.raises((ZeroDivisionError, TransportError)):
        work.handle.wait(timeout=10)
    assert work.handle.done
    with pytest.raises(TransportError, match="callback failed: ZeroDivisionError"):
        work.handle.test()
    assert engine.broken is not None
    engine.close()
    transport.close()
