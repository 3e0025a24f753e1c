"""Doorbells: one rank wakes another's sleeping progress thread.

MPI offers no way to sleep until a message arrives (a blocking MPI wait spins
on a core), so a progress thread that listens for activation tokens had to
poll: a nap of at most 1 ms, then a turn of the engine, about 14 times per
training iteration, at 65-85 us of CPU each on an oversubscribed host
(docs/training.md). With a doorbell it sleeps in the kernel instead, and a
peer that sends it something it may be sleeping for (a token, a round's data)
rings it after posting the message.

A doorbell is a Unix datagram socket in Linux's abstract namespace, named by
the communicator's nonce and the rank, so it exists only where every rank of
the communicator shares one host and one network namespace
(:func:`doorbell_key`); elsewhere the transport has none and the engine
polls as before. A ring is a one-byte datagram, dropped when the peer's queue
is full: the peer then has rings pending already, and one wakes it as well as
many. Rings leave through one unbound socket per peer, not the bell itself:
a datagram counts against its sender's buffer until read, and a busy peer
reads its bell only when it sleeps, so with one sending socket the rings
queued at ~25 busy peers (a queue holds ~10 by default) filled it and a ring to a sleeping peer
with nothing pending was dropped too.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import threading

_FD_SETSIZE = 1024  # select()'s limit on descriptor numbers (glibc)
_DRAIN_MAX = 256  # datagrams read per wake-up: a burst of rings is one wake-up


def doorbell_key() -> str | None:
    """What must be equal on every rank for doorbells to reach each other
    (the network namespace of this process), or None where the platform has
    no abstract Unix sockets."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return None


class Doorbell:
    """This rank's bell (to sleep on) and the means to ring the others'."""

    def __init__(self, nonce: str, rank: int, size: int) -> None:
        self._addresses = [f"\0wagma.{nonce}.{r}".encode() for r in range(size)]
        self._self = self._addresses[rank]
        self._rank = rank
        # Per peer, made at its first ring (see the module's docstring).
        self._senders: list[socket.socket | None] = [None] * size
        self._senders_lock = threading.Lock()  # making one, and close()
        self._closed = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(self._self)
            self._sock.setblocking(False)
        except OSError:
            self._sock.close()
            raise
        fd = self._sock.fileno()
        # select() sleeps to the microsecond (the engine's naps start at 20 us);
        # poll() rounds up to whole milliseconds but takes any descriptor,
        # where select() takes only those below FD_SETSIZE.
        self._wait = self._select if fd < _FD_SETSIZE else self._poll_ms
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self.rings = 0  # rings sent (statistics)

    def ring(self, peer: int) -> None:
        """Wake ``peer``'s progress thread if it sleeps on its bell; otherwise
        its next :meth:`sleep` returns at once. Never blocks, never raises:
        a full queue already holds a ring, and a closed bell has no sleeper."""
        try:
            self._sender(peer).sendto(b"\1", self._addresses[peer])
            self.rings += 1
        except OSError:
            pass

    def ring_self(self) -> None:
        """Wake this rank's own sleeper (from another thread of this process)."""
        try:
            self._sender(self._rank).sendto(b"\1", self._self)
        except OSError:
            pass

    def _sender(self, peer: int) -> socket.socket:
        """The socket rings to ``peer`` leave through: its own, so only rings
        pending at that peer can fill it (then a ring there is not needed)."""
        sock = self._senders[peer]
        if sock is not None:
            return sock
        with self._senders_lock:
            if self._closed:
                raise OSError("doorbell closed")
            sock = self._senders[peer]
            if sock is None:
                try:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                except OSError:  # out of descriptors: the bell's own socket
                    return self._sock
                sock.setblocking(False)
                self._senders[peer] = sock
            return sock

    def sleep(self, timeout: float) -> bool:
        """Sleep until a ring or ``timeout`` seconds; returns whether rung.
        Every pending ring is consumed, so the next sleep waits again."""
        rung = self._wait(max(0.0, timeout))
        if rung:
            self.drain()
        return rung

    def _select(self, timeout: float) -> bool:
        return bool(select.select((self._sock,), (), (), timeout)[0])

    def _poll_ms(self, timeout: float) -> bool:
        return bool(self._poller.poll(timeout * 1e3))

    def drain(self) -> None:
        """Consume the pending rings."""
        recv = self._sock.recv
        try:
            for _ in range(_DRAIN_MAX):
                recv(16)
        except OSError:  # BlockingIOError: nothing (more) pending
            pass

    def close(self) -> None:
        with self._senders_lock:
            self._closed = True
            senders, self._senders = self._senders, [None] * len(self._senders)
        for sock in senders:
            if sock is not None:
                sock.close()
        self._sock.close()
