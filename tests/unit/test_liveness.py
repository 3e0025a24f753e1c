"""The liveness check (runtime/liveness.py) on real processes: running, killed
and reaped, killed and not yet reaped (a zombie)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
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
