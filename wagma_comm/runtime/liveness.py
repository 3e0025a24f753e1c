"""Liveness of peer ranks, from what the operating system already knows.

Why: MPI libraries do not survive a peer's death. When a rank is killed its
peers' receives simply never complete, and the only signal left is the
collective's timeout (minutes by default). Ranks on the same host can be
checked for free and at once: every rank publishes (host, pid) at start-up, and
a process that is gone, or a zombie its launcher has not reaped yet, is dead.
The engine asks every ``PERIOD_S`` while collectives are in flight and fails
them with RankFailedError naming the dead ranks.

Ranks on other hosts cannot be checked this way; for them the timeout error
still names the ranks that did not take part (docs/reliability.md).
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from typing import Callable, Iterable, Sequence

PERIOD_S = 0.5  # between two looks at /proc
GRACE_S = 2.0  # a death seen, collectives still in flight this long after: stuck in MPI
EXIT_CODE = 3  # what a rank exits with when a dead peer leaves it no way out
STOP_JOIN_S = 2.0  # how long Monitor.stop() waits for the thread to end


def identity() -> tuple[str, int]:
    """This process's (host key, pid), as published to the peers. The key is
    the host name plus the boot id and the pid namespace, so two containers
    sharing a host name but not their pids never judge each other's pids."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        pass  # not Linux: the host name alone
    return "|".join(parts), os.getpid()


def _read_stat(pid: int) -> bytes:
    """/proc/<pid>/stat (FileNotFoundError where the process is gone)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read()


def _stat_fields(stat: bytes) -> list[bytes]:
    """The fields after "pid (comm)" (comm may hold spaces and parentheses):
    [0] is the state, [19] the start time."""
    return stat[stat.rfind(b")") + 2:].split()


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot), or None where unknown:
    what tells a process from a later one given the same pid."""
    try:
        return int(_stat_fields(_read_stat(pid))[19])
    except (OSError, IndexError, ValueError):
        return None


def process_gone(pid: int, started: int | None = None) -> bool:
    """True if ``pid`` no longer runs: no such process, or a zombie, or (with
    ``started``, its start_time()) a later process that was given its pid."""
    try:
        stat = _read_stat(pid)
    except FileNotFoundError:
        return True
    except OSError:  # no /proc here (not Linux): fall back to a signal probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    fields = _stat_fields(stat)
    if fields[:1] and fields[0] in (b"Z", b"X", b"x"):
        return True
    if started is not None and len(fields) > 19 and fields[19] != str(started).encode():
        return True  # the pid was freed and given to another process
    return False


class Liveness:
    """Dead-rank detection for one communicator. ``peers[r]`` is rank r's
    (host, pid); only ranks on this rank's host can be judged."""

    def __init__(self, rank: int, peers: Sequence[tuple[str, int]]) -> None:
        self.rank = rank
        host = peers[rank][0]
        self._local = {r: pid for r, (h, pid) in enumerate(peers) if h == host and r != rank}
        # Read now, while every peer runs (they just published their pids):
        # a pid freed by a death is given to a later process once the pid
        # counter wraps, and nobody looks while nothing is in flight.
        self._started = {r: start_time(pid) for r, pid in self._local.items()}
        self._dead: set[int] = set()
        _watch_at_exit(self)

    @property
    def checkable(self) -> frozenset[int]:
        """The ranks whose death this rank can see."""
        return frozenset(self._local)

    def dead(self, ranks: Iterable[int]) -> list[int]:
        """The ranks among ``ranks`` known to be dead (a death is final)."""
        found = []
        for r in ranks:
            if r in self._dead:
                found.append(r)
            elif r in self._local and process_gone(self._local[r], self._started[r]):
                self._dead.add(r)
                found.append(r)
                _record_death(self)
        return sorted(found)

    def describe_dead(self) -> str:
        return ", ".join(self.describe(r) for r in sorted(self._dead))

    def describe(self, rank: int) -> str:
        pid = self._local.get(rank)
        return f"rank {rank}" if pid is None else f"rank {rank} (pid {pid})"


class Monitor:
    """Makes a dead peer end this process instead of hanging it.

    The engine's own check (runtime/watch.py) fails in-flight collectives with
    RankFailedError, but only while its driver gets to run: an MPI library that
    cannot survive a peer's death may block inside a call. This daemon thread
    looks every PERIOD_S while collectives are in flight; once a same-host peer
    is gone, if collectives are still in flight GRACE_S later, it prints why and
    exits the process with EXIT_CODE. It also keeps the exit itself from blocking: MPI_Finalize waits
    for dead peers, so after a death is seen the interpreter's exit skips it.
    """

    def __init__(self, liveness: Liveness, in_flight: Callable[[], int]) -> None:
        self._liveness = liveness
        self._in_flight = in_flight
        self._stop = threading.Event()
        self.dead: list[int] = []
        self._thread = threading.Thread(target=self._run, name="wagma-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop and join the thread (close()): none is left running, mid-look,
        once the communicator is closed. Bounded: a look is a read of /proc."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(STOP_JOIN_S)

    def _run(self) -> None:
        seen_at = 0.0
        while not self._stop.wait(PERIOD_S):
            if not self.dead:
                # Only while something is in flight: peers of a healthy job
                # exit at different times, and an idle rank has nothing to fear.
                if self._in_flight() == 0:
                    continue
                self.dead = self._liveness.dead(self._liveness.checkable)
                seen_at = time.monotonic()
            elif time.monotonic() - seen_at > GRACE_S and self._in_flight() > 0:
                _exit(self._liveness, f"collectives are still in flight {GRACE_S:g} s after "
                      "the death was seen (possibly blocked inside MPI)")


_DEATHS: list[Liveness] = []  # those that saw a peer die, in order
_ALL: list[Liveness] = []  # every one with peers to check, for the last look at exit
_LOOK_HOOKED = False  # _last_look_at_exit is registered


def _record_death(liveness: Liveness) -> None:
    """From the first death seen on, the interpreter's exit skips the drain of
    open communicators and MPI_Finalize (which would wait for the dead peer):
    registered now, after every other exit hook, so it runs first."""
    if not _DEATHS:
        atexit.register(_exit_without_finalize)
    if liveness not in _DEATHS:
        _DEATHS.append(liveness)


def _watch_at_exit(liveness: Liveness) -> None:
    """Registered with the first communicator, before its drain-at-exit hook,
    so this one runs after the drain: a death first seen there, or after
    close() stopped the monitor, still skips MPI_Finalize (a hook registered
    while the exit hooks run would never run). Also when that communicator
    has no same-host peer (say over MPI.COMM_SELF): registered with a later
    one, it ran before the drain, and a death seen in the drain left the
    exit blocked in MPI_Finalize."""
    global _LOOK_HOOKED
    if not _LOOK_HOOKED:
        atexit.register(_last_look_at_exit)
        _LOOK_HOOKED = True
    if liveness.checkable:
        _ALL.append(liveness)


def _last_look_at_exit() -> None:
    for liveness in _ALL:
        liveness.dead(liveness.checkable)  # records any death it finds
    _exit_without_finalize()


def _exit_without_finalize() -> None:
    if _DEATHS:
        _exit(_DEATHS[0], "skipping MPI_Finalize, which would wait for it")


_MPI_SEGMENT_PREFIXES = ("/dev/shm/mpich_shm_",)  # what MPI_Finalize would unlink


def _unlink_mpi_segments() -> None:
    """Unlink the named shared-memory segments of MPI that this process maps.

    Why: MPICH keeps the name of its segment (/dev/shm/mpich_shm_*, 4 MiB
    and more) until MPI_Finalize removes it, and the exit below skips
    MPI_Finalize: before session 47 every job that lost a rank left one
    behind on each host. Every rank of the host attached it at MPI_Init and
    this process is ending, so nobody needs the name any more (a segment
    still mapped lives on until its last user is gone)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:  # not Linux
        return
    paths = set()
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith(_MPI_SEGMENT_PREFIXES) \
                and not fields[5].endswith(" (deleted)"):
            paths.add(fields[5])
    for path in paths:
        try:
            os.unlink(path)
        except OSError:  # a peer on this host unlinked it first
            pass


def _exit(liveness: Liveness, why: str) -> None:
    sys.stderr.write(f"wagma_comm: rank {liveness.rank} exits (code {EXIT_CODE}): "
                     f"{liveness.describe_dead()} is gone (killed or exited) and MPI "
                     f"cannot go on; {why}\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 -- exiting regardless
            pass
    _unlink_mpi_segments()
    os._exit(EXIT_CODE)


__all__ = ["Liveness", "Monitor", "PERIOD_S", "GRACE_S", "EXIT_CODE", "identity",
           "process_gone", "start_time"]
