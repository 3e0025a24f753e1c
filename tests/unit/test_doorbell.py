"""Doorbells (transport/doorbell.py): a ring wakes the peer's sleep, rings
are consumed, and ringing never blocks or raises, whatever the peer's state."""

from __future__ import annotations

import secrets
import sys
import threading
import time
from typing import Iterator

import pytest

from wagma_comm.transport.doorbell import Doorbell, doorbell_key

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="abstract Unix sockets are Linux only")


@pytest.fixture
def bells() -> Iterator[list[Doorbell]]:
    nonce = secrets.token_hex(8)
    pair = [Doorbell(nonce, rank, 2) for rank in range(2)]
    yield pair
    for bell in pair:
        bell.close()


def test_the_key_is_the_network_namespace() -> None:
    key = doorbell_key()
    assert key is not None and key.isdigit()


def test_a_sleep_without_a_ring_lasts_its_timeout(bells: list[Doorbell]) -> None:
    t0 = time.monotonic()
    assert bells[1].sleep(0.05) is False
    assert time.monotonic() - t0 >= 0.045


def test_a_ring_sent_before_the_sleep_ends_it_at_once(bells: list[Doorbell]) -> None:
    bells[0].ring(1)
    t0 = time.monotonic()
    assert bells[1].sleep(5.0) is True
    assert time.monotonic() - t0 < 1.0
    assert bells[0].rings == 1


def test_a_ring_wakes_a_sleeper_in_another_thread(bells: list[Doorbell]) -> None:
    woke: list[tuple[bool, float]] = []

    def sleeper() -> None:
        t0 = time.monotonic()
        woke.append((bells[1].sleep(10.0), time.monotonic() - t0))

    thread = threading.Thread(target=sleeper)
    thread.start()
    time.sleep(0.05)
    bells[0].ring(1)
    thread.join(5.0)
    assert not thread.is_alive()
    rung, slept = woke[0]
    assert rung and 0.04 <= slept < 5.0


def test_a_burst_of_rings_is_one_wake_up(bells: list[Doorbell]) -> None:
    for _ in range(50):
        bells[0].ring(1)
    assert bells[1].sleep(1.0) is True
    assert bells[1].sleep(0.01) is False  # all fifty consumed by the first


def test_ringing_yourself_wakes_your_own_sleep(bells: list[Doorbell]) -> None:
    bells[1].ring_self()
    assert bells[1].sleep(5.0) is True
    assert bells[0].sleep(0.01) is False  # the other bell heard nothing


def test_ringing_a_closed_or_absent_bell_neither_blocks_nor_raises() -> None:
    nonce = secrets.token_hex(8)
    bell = Doorbell(nonce, 0, 3)  # ranks 1 and 2 never bound theirs
    peer = Doorbell(nonce, 1, 3)
    peer.close()
    try:
        t0 = time.monotonic()
        bell.ring(1)
        bell.ring(2)
        assert time.monotonic() - t0 < 1.0
        assert bell.rings == 0  # nothing was delivered
    finally:
        bell.close()


def test_a_full_queue_drops_rings_without_blocking(bells: list[Doorbell]) -> None:
    t0 = time.monotonic()
    for _ in range(5000):  # more than a datagram queue holds
        bells[0].ring(1)
    assert time.monotonic() - t0 < 5.0
    assert 0 < bells[0].rings < 5000
    assert bells[1].sleep(1.0) is True


def test_two_communicators_bells_do_not_hear_each_other() -> None:
    nonces = secrets.token_hex(8), secrets.token_hex(8)
    first, second = ([Doorbell(nonce, r, 2) for r in range(2)] for nonce in nonces)
    try:
        first[0].ring(1)
        assert second[1].sleep(0.01) is False
        assert first[1].sleep(1.0) is True
    finally:
        for bell in first + second:
            bell.close()


def test_the_same_name_cannot_be_bound_twice(bells: list[Doorbell]) -> None:
    """Why the transport gathers a nonce: a second bell under a taken name
    fails to bind (OSError), and then nobody uses bells."""
    nonce = bells[0]._self[len(b"\0wagma."):].split(b".")[0].decode()
    with pytest.raises(OSError):
        Doorbell(nonce, 0, 2)


def test_poll_fallback_for_high_descriptors(bells: list[Doorbell]) -> None:
    """Descriptors >= FD_SETSIZE cannot go to select(); poll() serves them."""
    bells[0].ring(1)
    assert bells[1]._poll_ms(1.0) is True
    bells[1].drain()
    assert bells[1]._poll_ms(0.01) is False


def _rings_queued_at_busy_peers(n: int) -> list[Doorbell]:
    """``n`` bells; bell 0 rang bells 1..n-2 (busy: they never sleep, so
    never read) until their queues were full. Bell n-1 has nothing pending."""
    nonce = secrets.token_hex(8)
    bells = [Doorbell(nonce, r, n) for r in range(n)]
    for peer in range(1, n - 1):
        for _ in range(50):
            bells[0].ring(peer)
    return bells


def test_rings_queued_at_busy_peers_never_drop_a_ring_to_a_sleeping_one() -> None:
    """A datagram counts against its sender's buffer until it is read: with
    one sending socket, the rings queued at 38 busy peers filled it and a
    ring to a sleeping peer with nothing pending was dropped (its sleep ran
    to its end: a lost wake-up). Each peer has its own sending socket now."""
    bells = _rings_queued_at_busy_peers(40)
    try:
        sent = bells[0].rings
        bells[0].ring(39)
        assert bells[0].rings == sent + 1
        assert bells[39].sleep(0.5) is True
    finally:
        for bell in bells:
            bell.close()


def test_rings_queued_at_busy_peers_never_drop_a_ring_to_yourself() -> None:
    """The engine's own wake-up (a submission while its thread sleeps on the
    bell) must not be lost to rings pending at busy peers either."""
    bells = _rings_queued_at_busy_peers(40)
    try:
        bells[0].ring_self()
        assert bells[0].sleep(0.5) is True
    finally:
        for bell in bells:
            bell.close()


def test_ringing_after_close_neither_raises_nor_reopens(bells: list[Doorbell]) -> None:
    bells[0].ring(1)
    bells[0].close()
    bells[0].ring(1)
    bells[0].ring_self()
    assert bells[0].rings == 1
    assert all(sock is None for sock in bells[0]._senders)
