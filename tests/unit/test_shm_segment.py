"""The shared-memory segment (transport/shm.py), in one process: its size
rule, the create/attach/unlink life cycle, and when it is unavailable. The
exchange over it runs under MPI (tests/mpi/test_shared.py)."""

from __future__ import annotations

import os
import secrets
import typing

import numpy as np
import pytest

from wagma_comm.transport import shm


def test_rows_shrink_where_many_ranks_share_a_host() -> None:
    assert shm.slot_bytes_for(2) == shm.slot_bytes_for(4) == shm.SLOT_BYTES
    assert shm.slot_bytes_for(8) == 512 << 10 and shm.slot_bytes_for(64) == 64 << 10
    previous = shm.SLOT_BYTES
    for size in (1, 3, 5, 8, 100, 1000, 5000, 10**6):
        slot = shm.slot_bytes_for(size)
        assert slot >= 64 and slot & (slot - 1) == 0  # a power of two: whole pieces
        assert slot <= previous  # more ranks, never larger rows
        previous = slot
        if slot > 64:  # the floor of one cache line aside, the rows stay bounded
            assert shm.DEPTH * size * slot <= shm.ROWS_MAX_BYTES


@pytest.mark.skipif(shm.unavailable_reason() is not None, reason="no shared memory here")
def test_create_attach_unlink_close() -> None:
    nonce = secrets.token_hex(8)
    made = shm.Segment.create(nonce, 3)
    try:
        other = shm.Segment.attach(nonce, 3)
        with pytest.raises(FileExistsError):
            shm.Segment.create(nonce, 3)  # a nonce names one segment
        assert not made.flags.any()  # zeroed: no call has arrived
        made.rows[1, 2, :4] = [1, 2, 3, 4]
        made.flags[1, 2, shm.ARRIVE] = 7
        np.testing.assert_array_equal(other.rows[1, 2, :4], [1, 2, 3, 4])
        assert other.flags[1, 2, shm.ARRIVE] == 7
        made.unlink()  # once everyone mapped it: nothing left in /dev/shm
        assert not os.path.exists(shm.segment_path(nonce))
        with pytest.raises(FileNotFoundError):
            shm.Segment.attach(nonce, 3)
        np.testing.assert_array_equal(other.rows[1, 2, :4], [1, 2, 3, 4])  # still mapped
        other.close()
        assert other.rows is None
    finally:
        made.unlink()
        made.close()


@pytest.mark.skipif(shm.unavailable_reason() is not None, reason="no shared memory here")
def test_attach_refuses_a_segment_of_another_size() -> None:
    nonce = secrets.token_hex(8)
    made = shm.Segment.create(nonce, 2)
    try:
        with pytest.raises(OSError, match="expected"):
            shm.Segment.attach(nonce, 4)
    finally:
        made.unlink()
        made.close()


def test_disabled_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WAGMA_SHM", "0")
    assert shm.unavailable_reason() == "disabled by WAGMA_SHM=0"


class _Interrupted(Exception):
    pass


@pytest.mark.skipif(shm.unavailable_reason() is not None, reason="no shared memory here")
def test_a_signal_during_the_reservation_leaves_no_file() -> None:
    """tmpfs stops posix_fallocate with EINTR when a signal comes, and Python
    then runs the handler, which may raise (Ctrl-C in init()): the file was
    left in /dev/shm, its pages reserved so far, with nobody to unlink it."""
    import signal

    total = 256 << 20  # tens of ms to reserve: the signal comes first
    free = os.statvfs("/dev/shm")
    if free.f_bavail * free.f_frsize < 2 * total:
        pytest.skip("/dev/shm has too little room")
    path = shm.segment_path(f"test-{secrets.token_hex(6)}")
    raised: list[bool] = []

    def interrupt(signum: int, frame: typing.Any) -> None:
        while frame is not None and frame.f_code is not shm.create_file.__code__:
            frame = frame.f_back
        if frame is not None:  # only inside create_file: what it must clean up
            raised.append(True)
            raise _Interrupted()
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.002)
        try:
            os.close(shm.create_file(path, total))
        except _Interrupted:
            pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        left = os.path.exists(path)
        if left:
            os.unlink(path)
    if not raised:
        pytest.skip("the reservation finished before the signal came")
    assert not left, "the interrupted reservation left its file in /dev/shm"
