"""Doorbells (transport/doorbell.py): a ring wakes a sleeper at once, rings
are best effort, and the switch turns them off."""

from __future__ import annotations

import threading
import time

import pytest

from wagma_comm.transport.doorbell import Doorbell, make_doorbell

pytestmark = pytest.mark.skipif(not Doorbell.available(), reason="Linux only")


def _pair() -> tuple[Doorbell, Doorbell]:
    a, b = Doorbell(), Doorbell()
    addresses, hosts = [a.address, b.address], ["h", "h"]
    a.connect(0, addresses, hosts)
    b.connect(1, addresses, hosts)
    return a, b


def test_a_ring_wakes_a_long_sleep_at_once() -> None:
    a, b = _pair()
    woke: list[float] = []

    def sleeper() -> None:
        t0 = time.monotonic()
        b.sleep(30.0)
        woke.append(time.monotonic() - t0)
    thread = threading.Thread(target=sleeper)
    thread.start()
    time.sleep(0.05)
    a.ring(1)
    thread.join(10.0)
    assert woke and woke[0] < 10.0, woke
    a.close(), b.close()


def test_rings_are_cleared_and_ring_self_wakes() -> None:
    a, b = _pair()
    for _ in range(5):
        a.ring(1)
    b.sleep(1.0)  # returns at once and drains all five
    t0 = time.monotonic()
    b.sleep(0.2)
    assert time.monotonic() - t0 >= 0.15  # nothing left to wake it
    b.ring_self()
    t0 = time.monotonic()
    b.sleep(30.0)
    assert time.monotonic() - t0 < 10.0
    a.close(), b.close()


def test_only_peers_on_this_host_can_ring() -> None:
    a, b = Doorbell(), Doorbell()
    a.connect(0, [a.address, b.address, None], ["h", "other", "h"])
    assert a.covers([0]) and not a.covers([0, 1]) and not a.covers([2]) and not a.covers([5])
    a.ring(1)  # another host: nothing to do, no error
    a.close(), b.close()


def test_a_ring_to_a_closed_bell_is_silent() -> None:
    a, b = _pair()
    b.close()
    a.ring(1)
    a.close()
    a.ring_self()  # closed itself: still no error


def test_the_switch_turns_doorbells_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WAGMA_DOORBELL", "0")
    assert make_doorbell() is None
    monkeypatch.setenv("WAGMA_DOORBELL", "1")
    bell = make_doorbell()
    assert bell is not None
    bell.close()
