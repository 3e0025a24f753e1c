"""The robust process-shared locks (transport/shm_lock.py) and the board of
a wait-avoiding collective (transport/shm_board.py), with real processes."""

from __future__ import annotations

import mmap
import os
import secrets
import time

import numpy as np
import pytest

from wagma_comm.transport import shm_lock
from wagma_comm.transport.shm_board import DIED, PUBLISHED, RESULT, Board, block_bytes

pytestmark = pytest.mark.skipif(shm_lock.UNAVAILABLE is not None,
                                reason=str(shm_lock.UNAVAILABLE))


@pytest.fixture
def lock_address() -> int:
    memory = mmap.mmap(-1, 4096)  # MAP_SHARED: a forked child sees the same page
    address = np.frombuffer(memory, np.uint8).ctypes.data
    shm_lock.init_lock(address)
    yield address
    memory.close()


def _in_child(fn) -> int:
    """Run ``fn`` in a forked process; its exit status (0: fn returned True)."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if fn() else 1)
        except BaseException:
            os._exit(2)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_held_lock_times_out_in_another_process(lock_address: int) -> None:
    shm_lock.acquire(lock_address, time.monotonic() + 1)

    def contend() -> bool:
        start = time.monotonic()
        try:
            shm_lock.acquire(lock_address, start + 0.2)
        except shm_lock.LockTimeout:
            return 0.15 < time.monotonic() - start < 5
        return False
    assert _in_child(contend) == 0
    shm_lock.release(lock_address)
    assert _in_child(lambda: shm_lock.acquire(lock_address, time.monotonic() + 1)) == 0


def test_a_holder_that_died_is_reported_to_the_next_holder_and_the_lock_works_again(
        lock_address: int) -> None:
    assert _in_child(lambda: shm_lock.acquire(lock_address, time.monotonic() + 1)) == 0
    assert shm_lock.acquire(lock_address, time.monotonic() + 1) is False  # held now
    assert _in_child(lambda: _times_out(lock_address)) == 0
    shm_lock.release(lock_address)
    assert shm_lock.acquire(lock_address, time.monotonic() + 1) is True  # consistent again
    shm_lock.release(lock_address)
    assert _in_child(lambda: shm_lock.acquire(lock_address, time.monotonic() + 1)) == 0


def test_an_unlock_by_a_process_not_holding_the_lock_raises(lock_address: int) -> None:
    """pthread_mutex_unlock's EPERM (a robust mutex released by a process that
    does not hold it) was ignored: the lock silently stayed held."""
    import errno

    shm_lock.acquire(lock_address, time.monotonic() + 1)

    def release_not_held() -> bool:
        try:
            shm_lock.release(lock_address)
        except OSError as exc:
            return exc.errno == errno.EPERM
        return False
    assert _in_child(release_not_held) == 0
    shm_lock.release(lock_address)


class _Cancelled(Exception):
    pass


def test_a_contended_wait_calls_its_check_which_can_end_it(lock_address: int) -> None:
    """A wait for a holder that stopped must let a cancel end it long before
    the deadline: ``check`` is called every CHECK_EVERY_S while waiting
    (never when the lock is free), what it raises ends the wait without the
    lock, and a check that never raises leaves the deadline as it was."""
    calls: list[float] = []
    assert shm_lock.acquire(lock_address, time.monotonic() + 1, lambda: calls.append(1))
    shm_lock.release(lock_address)
    assert calls == []  # uncontended: no slices, no checks
    shm_lock.acquire(lock_address, time.monotonic() + 1)

    def cancelled() -> bool:
        start = time.monotonic()
        seen = []

        def check() -> None:
            seen.append(time.monotonic())
            if seen[-1] - start > 0.1:
                raise _Cancelled()
        try:
            shm_lock.acquire(lock_address, start + 30, check)
        except _Cancelled:
            return 0.1 < time.monotonic() - start < 1.0 and len(seen) >= 3
        return False

    def times_out_with_a_check() -> bool:
        start, seen = time.monotonic(), []
        try:
            shm_lock.acquire(lock_address, start + 0.2, lambda: seen.append(1))
        except shm_lock.LockTimeout:
            return 0.15 < time.monotonic() - start < 5 and len(seen) >= 3
        return False

    assert _in_child(cancelled) == 0
    assert _in_child(times_out_with_a_check) == 0
    shm_lock.release(lock_address)
    # The cancelled child never held it: this process takes it normally.
    assert shm_lock.acquire(lock_address, time.monotonic() + 1) is True
    shm_lock.release(lock_address)


def _times_out(address: int) -> bool:
    try:
        shm_lock.acquire(address, time.monotonic() + 0.05)
    except shm_lock.LockTimeout:
        return True
    return False


def test_the_board_is_laid_out_per_rank_and_shared_between_mappings() -> None:
    path = f"/dev/shm/wagma-test-{secrets.token_hex(6)}"
    size, nbytes = 3, 100
    board = Board.create(path, size, nbytes)
    try:
        assert os.path.getsize(path) == size * block_bytes(size, nbytes)
        other = Board.attach(path, size, nbytes)
        for k in range(size):
            assert board.words[k][PUBLISHED] == -1 and board.words[k][RESULT] == -1
            assert board.words[k][DIED] == -1  # nobody died holding its lock
            assert board.published[k].size == nbytes == board.result[k].size
            assert board.locks[k] % 64 == 0 and board.published[k].ctypes.data % 64 == 0
        board.published[1][:] = 7
        board.words[2][RESULT] = 5
        assert np.all(other.published[1] == 7) and other.words[2][RESULT] == 5
        assert np.all(other.published[0] == 0) and np.all(other.result[1] == 0)
        deadline = time.monotonic() + 1
        shm_lock.acquire(board.locks[0], deadline)
        with pytest.raises(shm_lock.LockTimeout):  # the same lock through the other mapping
            shm_lock.acquire(other.locks[0], time.monotonic() + 0.05)
        shm_lock.release(board.locks[0])
        other.close()
    finally:
        board.unlink()
        board.close()
    assert not os.path.exists(path)
    with pytest.raises(OSError):
        Board.attach(path, size, nbytes)


_MAP_FAILS = r"""
import os, resource, secrets, sys
from wagma_comm.transport.shm_board import Board
path = f"/dev/shm/wagma-test-{secrets.token_hex(6)}-p0"
# Address space for what is mapped now and a little more, not for the board:
# /dev/shm reserves its pages, the mapping then fails (ENOMEM).
with open("/proc/self/status") as fh:
    vm = next(int(l.split()[1]) for l in fh if l.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), resource.RLIM_INFINITY))
try:
    Board.create(path, 2, 256 << 20)
except OSError as exc:
    print("refused:", exc)
print("left:", os.path.exists(path))
if os.path.exists(path):
    os.unlink(path)
"""


def test_a_board_that_cannot_be_mapped_leaves_no_file() -> None:
    """create_file reserved the pages, then the mapping failed: the file
    stayed in /dev/shm (twice P times the model) with nobody to unlink it."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MAP_FAILS], capture_output=True, text=True,
                         timeout=120)
    assert "refused:" in out.stdout, out.stdout + out.stderr
    assert "left: False" in out.stdout, out.stdout
