"""The liveness check (runtime/liveness.py) on real processes: running, killed
and reaped, killed and not yet reaped (a zombie)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from wagma_comm.runtime import liveness


@pytest.fixture(autouse=True)
def _no_exit_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """A death seen here must not make this test process skip its exit."""
    monkeypatch.setattr(liveness, "_DEATHS", [])
    monkeypatch.setattr(liveness, "_ALL", [])


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _wait_for_zombie(pid: int) -> None:
    for _ in range(200):
        with open(f"/proc/{pid}/stat", "rb") as f:
            if b") Z" in f.read():
                return
        time.sleep(0.01)
    raise AssertionError("child did not turn into a zombie")


def test_process_gone_running_zombie_reaped() -> None:
    child = _sleeper()
    try:
        assert not liveness.process_gone(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        _wait_for_zombie(child.pid)  # killed, not reaped: still in /proc
        assert liveness.process_gone(child.pid)
    finally:
        child.kill()
        child.wait()
    assert liveness.process_gone(child.pid)  # reaped: gone from /proc


def test_dead_ranks_on_this_host_only() -> None:
    host = socket.gethostname()
    child = _sleeper()
    other = _sleeper()
    try:
        peers = [(host, os.getpid()), (host, child.pid), ("elsewhere", other.pid),
                 (host, other.pid)]
        live = liveness.Liveness(0, peers)
        assert live.checkable == {1, 3}  # not itself, not the other host
        assert live.dead(range(4)) == []
        child.kill()
        child.wait()
        assert live.dead(range(4)) == [1]
        assert live.dead([2, 3]) == []  # rank 2's pid is alive, but it is not ours to judge
        assert live.dead([1]) == [1]  # a death is final
        assert "rank 1 (pid" in live.describe_dead()
    finally:
        for p in (child, other):
            p.kill()
            p.wait()


_EXIT_ORDER_SCRIPT = """
import atexit, os, subprocess, sys
from wagma_comm.runtime import liveness

host = liveness.identity()[0]
me = (host, os.getpid())
liveness.Liveness(0, [me])  # a first communicator with no same-host peer (MPI.COMM_SELF)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def drain():
    # comm._close_all_at_exit, registered by that first communicator: the
    # peer dies while it drains, and the engine's driver sees it there.
    child.kill()
    child.wait()
    assert live.dead([1]) == [1]


atexit.register(drain)
live = liveness.Liveness(0, [me, (host, child.pid)])  # then one with a same-host peer
"""


def test_a_death_seen_in_the_exit_drain_skips_finalize_when_the_first_comm_had_no_peer() -> None:
    """The last look at exit must run after every communicator's drain,
    also when the first communicator had no same-host peer: before, it was
    registered with the first one that had, after the drain hook, so it ran
    first, and a death the drain saw left the exit to MPI_Finalize, which
    waits for the dead peer for ever (seen with mpiexec: a 90 s hang)."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_ORDER_SCRIPT], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == liveness.EXIT_CODE, (proc.returncode, proc.stderr)
    assert "rank 1 (pid" in proc.stderr and "skipping MPI_Finalize" in proc.stderr, proc.stderr


def test_stopping_the_monitor_joins_its_thread_even_mid_look() -> None:
    """close() stops the monitor: its thread must be gone when stop()
    returns, also when stop() comes while it is looking (before, stop() only
    set the event and returned with the thread still running)."""
    host = liveness.identity()[0]
    child = _sleeper()
    looking = threading.Event()

    def in_flight() -> int:
        looking.set()
        time.sleep(0.2)  # a slow look: stop() arrives in the middle of it
        return 1

    try:
        live = liveness.Liveness(0, [(host, os.getpid()), (host, child.pid)])
        monitor = liveness.Monitor(live, in_flight)
        assert looking.wait(5.0)
        monitor.stop()
        assert not monitor._thread.is_alive()
        assert monitor.dead == []
    finally:
        child.kill()
        child.wait()


def _spawn_with_pid(pid: int) -> subprocess.Popen | None:
    """A new sleeper that gets ``pid`` (a dead process's, freed): the next
    pid is set through /proc/sys/kernel/ns_last_pid. None where that is not
    allowed, or other processes keep taking the pid first."""
    for _ in range(50):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError:
            return None
        child = _sleeper()
        if child.pid == pid:
            return child
        child.kill()
        child.wait()
    return None


def test_a_dead_ranks_pid_taken_by_a_new_process_is_still_dead() -> None:
    """The kernel hands a freed pid to the next process once the pid
    counter wraps (pid_max is 32768 on many hosts), and nobody looks while
    nothing is in flight: before session 47 a peer that died in such a
    pause was judged alive from then on, so the next collective waited for
    its timeout and MPI_Finalize for the dead rank at exit. The start time
    seen at construction tells the newcomer apart."""
    host = liveness.identity()[0]
    child = _sleeper()
    live = liveness.Liveness(0, [(host, os.getpid()), (host, child.pid)])
    assert live.dead([1]) == []
    time.sleep(0.1)  # start times count clock ticks (10 ms): a later one must differ
    pid = child.pid
    child.kill()
    child.wait()
    newcomer = _spawn_with_pid(pid)
    if newcomer is None:
        pytest.skip("cannot choose the next pid here (/proc/sys/kernel/ns_last_pid)")
    try:
        assert not liveness.process_gone(pid)  # a process runs under that pid
        assert live.dead([1]) == [1]
        assert f"rank 1 (pid {pid})" in live.describe_dead()
    finally:
        newcomer.kill()
        newcomer.wait()
