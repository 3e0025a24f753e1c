"""The MPI transport itself (wagma_comm/transport/mpi.py) under a real MPI job:
what its set-up steps raise when MPI fails them, and its message identities."""

from __future__ import annotations

import glob
import time
from typing import Iterator

import numpy as np
import pytest
from mpi4py import MPI

import wagma_comm
from wagma_comm.transport import mpi as mpi_transport

from conftest import message_path

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


# -- message identity (ALGORITHMS.md s. 3: explicit, never a narrow tag that wraps) --
def test_message_identities_are_distinct_over_the_window_and_fit_mpis_tags() -> None:
    """Within a channel the MPI tag of message ``msg`` of collective ``seq``
    is (seq mod window, msg): every one of the window's sequence numbers has
    tags of its own, the largest is a legal tag, the window is as large as
    the tag space allows (the reference packed 8 bits of schedule id), and
    isend/irecv's tag (``_tag``), posters' ``tag_base`` and ``tag`` agree.
    Beyond the window the tags repeat: the engine's guard (next test) keeps
    that from mattering."""
    from wagma_comm.transport.base import MSG_BITS, MSG_MASK

    transport = mpi_transport.MPITransport(WORLD, timeout=30)
    try:
        tag_ub = int(WORLD.Get_attr(MPI.TAG_UB))
        window = transport.seq_window
        assert transport.tag(window - 1, MSG_MASK) <= tag_ub
        assert (window + 1) << MSG_BITS > tag_ub + 1  # no larger window would fit
        assert len({transport._tag(s, 0) for s in range(window)}) == window
        assert len({transport._tag(3, m) for m in range(MSG_MASK + 1)}) == MSG_MASK + 1
        for s in (0, 1, window - 1, window, 5 * window + 7):
            assert transport._tag(s, 9) == transport.tag_base(s) | 9 == transport.tag(s, 9), s
    finally:
        WORLD.Barrier()
        transport.close()


def test_the_engine_never_has_two_collectives_of_one_tag_in_flight() -> None:
    """With the window cut to 2 sequence numbers, rank 0 posts six
    collectives that cannot finish (rank 1 posts its own only later): at
    most two may be started, the rest wait, since a third would reuse the
    first one's tags on the same channel. Then every result is right."""
    with message_path():
        c = wagma_comm.init(timeout=30)
    try:
        c._transport._window = 2
        n, count = 6, 1 << 14  # large enough for the engine (no inline run)
        bufs = [np.full(count, float(k + 10 * RANK)) for k in range(n)]
        handles = []
        if RANK == 0:
            handles = [c.allreduce(b, "sum", async_op=True) for b in bufs]
            engine = c._engine
            until = time.monotonic() + 20
            while (engine._incoming or len(engine._active) + len(engine._waiting) < n) \
                    and time.monotonic() < until:
                time.sleep(0.001)
            time.sleep(0.05)  # a start past the guard would be made by now
            assert len(engine._active) <= 2 and len(engine._waiting) >= n - 2, \
                (len(engine._active), len(engine._waiting))
        WORLD.Barrier()
        if RANK != 0:
            handles = [c.allreduce(b, "sum", async_op=True) for b in bufs]
        for h in handles:
            h.wait()
        for k, b in enumerate(bufs):
            assert np.all(b == 2 * k + 10), (k, b[:3])
    finally:
        WORLD.Barrier()
        c.close()
