"""The shared-memory segment (transport/shm.py), in one process: its size
rule, the create/attach/unlink life cycle, and when it is unavailable. The
exchange over it runs under MPI (tests/mpi/test_shared.py)."""

from __future__ import annotations

import os
import secrets

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
