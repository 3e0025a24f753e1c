"""Doorbells: wake a peer's sleeping progress thread when MPI cannot.

Why: a persistent partial collective's progress thread listens for activation
tokens while its application computes. MPI has no way to wake a thread when
a message arrives (a blocking receive busy-polls in MPICH), so the thread
polls, and on an oversubscribed host every poll is a context switch taken
from the applications: listening with naps of at most 1 ms cost a
compute-bound loop 8-14% of its speed at 8 ranks on 2 cores, against about
2% with 20 ms naps (docs/partial.md, "Listening costs"). With a doorbell the
thread sleeps in ``select`` until a peer that sent it a token rings (one
datagram), or its own application wakes it, so it can sleep long and still
answer at once.

One UNIX datagram socket per rank and communicator, bound in Linux's abstract
namespace (nothing on the file system to clean up); addresses are exchanged
with the transport's start-up allgather. Only peers on the same host can ring
(``covers``); elsewhere, and off Linux, the engine keeps polling.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import sys
from typing import Iterable, Sequence

_SERIAL = itertools.count()


class Doorbell:
    """This rank's bell and the addresses of its peers' bells (None where a
    peer is on another host or has none)."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        name = f"wagma-bell-{os.getpid()}-{next(_SERIAL)}-{os.urandom(6).hex()}"
        self._sock.bind("\0" + name)
        self._sock.setblocking(False)
        self.address = "\0" + name
        self._peers: list[str | None] = []

    @staticmethod
    def available() -> bool:
        """Abstract-namespace sockets exist on Linux only."""
        return sys.platform.startswith("linux")

    def connect(self, rank: int, addresses: Sequence[str | None],
                hosts: Sequence[str]) -> None:
        """Remember the bells of the peers on this rank's host."""
        here = hosts[rank]
        self._peers = [a if hosts[r] == here else None for r, a in enumerate(addresses)]

    def covers(self, ranks: Iterable[int]) -> bool:
        """Whether every rank in ``ranks`` can ring this rank (same host)."""
        return all(0 <= r < len(self._peers) and self._peers[r] is not None for r in ranks)

    def ring(self, rank: int) -> None:
        """Wake ``rank``'s thread if it sleeps on its bell. Best effort: a full
        bell already holds a ring, and a closed one has nobody to wake."""
        address = self._peers[rank]
        if address is None:
            return
        try:
            self._sock.sendto(b"\0", address)
        except OSError:
            pass

    def ring_self(self) -> None:
        try:
            self._sock.sendto(b"\0", self.address)
        except OSError:
            pass

    def sleep(self, timeout: float) -> None:
        """Sleep until rung or ``timeout`` seconds passed, then clear the rings."""
        select.select([self._sock], [], [], timeout)
        try:
            while True:
                self._sock.recv(64)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            pass  # closed under us: the engine is stopping

    def close(self) -> None:
        self._sock.close()


def make_doorbell() -> Doorbell | None:
    """A bell for this process, or None where there are none (not Linux, the
    socket cannot be made, or ``WAGMA_DOORBELL=0``: the engine then polls)."""
    if not Doorbell.available() or os.environ.get("WAGMA_DOORBELL", "1") == "0":
        return None
    try:
        return Doorbell()
    except OSError:
        return None


__all__ = ["Doorbell", "make_doorbell"]
