"""The MPI transport itself (wagma_comm/transport/mpi.py) under a real MPI job:
what its set-up steps raise when MPI fails them."""

from __future__ import annotations

import glob
from typing import Iterator

import numpy as np
import pytest
from mpi4py import MPI

import wagma_comm
from wagma_comm.transport import mpi as mpi_transport

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
# Using up the context ids takes 5 s at 2 ranks and 40 s at 4 on two cores,
# and what is tested does not depend on the rank count.
pytestmark = pytest.mark.skipif(SIZE != 2, reason="rank-count independent: run at 2 ranks")


def _use_up(dups: list[MPI.Comm]) -> None:
    """Duplicate MPI_COMM_WORLD into ``dups`` until MPI has no context id
    left (MPICH: 2048 per process). Every rank fails at the same
    duplication: a context id is agreed by all of them."""
    try:
        for _ in range(100_000):
            dups.append(WORLD.Dup())
    except MPI.Exception:
        return
    pytest.skip("this MPI never ran out of communicator context ids")


def _leave_free(dups: list[MPI.Comm], n: int) -> None:
    """Free ``n`` of ``dups``: that many context ids are left."""
    for _ in range(n):
        dups.pop().Free()


@pytest.fixture(scope="module")
def no_context_ids() -> Iterator[list[MPI.Comm]]:
    """Every context id of this process in use (once per module: using them
    up takes seconds at 4 ranks); a test frees what it needs and uses them
    up again before it ends."""
    dups: list[MPI.Comm] = []
    try:
        _use_up(dups)
        yield dups
    finally:
        _leave_free(dups, len(dups))
        WORLD.Barrier()


# Context ids left free before init(): 0 fails its first duplication, 2 the
# channel duplications, 4 the last one (after the segment and doorbells).
@pytest.mark.parametrize("free", [0, 2, 4])
def test_init_reports_an_mpi_failure_as_a_transport_error(
        no_context_ids: list[MPI.Comm], free: int) -> None:
    """A duplication MPI fails (here: no context id left, as after many
    communicators, or many broken ones whose contexts are kept) made init()
    raise a bare mpi4py ``MPI.Exception``, which is no WagmaError, named
    neither init() nor the step. It must raise TransportError naming both,
    leave nothing in /dev/shm, and a later init() must work."""
    before = set(glob.glob("/dev/shm/wagma-*"))
    try:
        _leave_free(no_context_ids, free)
        with pytest.raises(wagma_comm.TransportError) as info:
            wagma_comm.init(timeout=30)
        assert isinstance(info.value, wagma_comm.WagmaError)
        message = str(info.value)
        assert message.startswith("init(): ") and "MPI error" in message, message
        if free:  # a step of the transport's own: named
            assert "duplicating the communicator for" in message, message
        WORLD.Barrier()
        if RANK == 0:
            assert set(glob.glob("/dev/shm/wagma-*")) <= before
        _leave_free(no_context_ids, 8)
        with wagma_comm.init(timeout=30) as c:
            x = np.ones(3)
            c.allreduce(x)
            assert np.all(x == SIZE)
    finally:
        _use_up(no_context_ids)


def test_dup_with_deadline_reports_an_mpi_failure_as_a_transport_error(
        no_context_ids: list[MPI.Comm]) -> None:
    """The bounded duplication other set-ups use (the gossip exchanges, the
    simulator's calibration) raised MPI's own exception too."""
    with pytest.raises(wagma_comm.TransportError, match="^sgp exchange set-up: "):
        mpi_transport.dup_with_deadline(WORLD, 30, "sgp exchange set-up")


def test_opening_channels_reports_an_mpi_failure_as_a_transport_error(
        no_context_ids: list[MPI.Comm]) -> None:
    """A persistent collective's channel set-up (on the progress thread) let
    MPI's exception out as well; it must be a TransportError naming the
    set-up and the channel, as its timeout does."""
    _leave_free(no_context_ids, 6)
    try:
        transport = mpi_transport.MPITransport(WORLD, timeout=30)
    finally:
        _use_up(no_context_ids)
    try:
        with pytest.raises(wagma_comm.TransportError) as info:
            transport.open_channels(["p9.data"])
        assert str(info.value).startswith("set-up of channels ['p9.data']: duplicating "
                                          "the communicator for channel 'p9.data' failed"), \
            info.value
        assert "p9.data" not in transport._comms
    finally:
        WORLD.Barrier()
        transport.close()


def test_a_segment_rank_0_could_not_create_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full /dev/shm (here: the creation refused with ENOSPC) was reported
    as "a rank could not map the segment, or was started with WAGMA_SHM=0",
    hiding rank 0's own error."""
    from wagma_comm.transport import shm

    if shm.unavailable_reason() is not None:
        pytest.skip("no shared memory here")

    def full(nonce: str, size: int) -> shm.Segment:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm.Segment, "create", staticmethod(full))
    transport = mpi_transport.MPITransport(WORLD, timeout=30)
    try:
        assert transport.shared_segment is None
        if RANK == 0:
            assert "rank 0 could not create the segment" in transport.shared_unavailable
            assert "No space left on device" in transport.shared_unavailable
    finally:
        WORLD.Barrier()
        transport.close()


def test_a_communicator_that_fails_to_set_up_stops_its_thread_and_transport(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after the progress engine started (here: the shared-memory
    exchange refusing) left the 'wagma-progress' thread running and the MPI
    communicators and the segment held, with nothing to close them."""
    import threading

    from wagma_comm import comm as comm_module

    def refuse(*args: object) -> None:
        raise RuntimeError("no exchange")

    monkeypatch.setattr(comm_module, "SharedExchange", refuse)
    monkeypatch.setenv("WAGMA_SHM", "1")
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="no exchange"):
        wagma_comm.init(timeout=30)
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == []
    WORLD.Barrier()
