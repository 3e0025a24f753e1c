"""WAGMA_DEBUG=1: per-collective fingerprints exchanged before each collective.

Every rank must call every collective of a communicator in the same order (group
collectives included: each rank joins its own group). In debug mode each rank
sends a short text fingerprint of its call to every other rank before the
collective runs, and compares: a different collective, size, dtype, op, group or
algorithm is reported as MismatchError naming the ranks and what they called,
and a rank that never arrives is named by the timeout of this exchange.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..dtypes import UINT8
from ..errors import MismatchError
from ..schedule.algorithms import EXCHANGE_SCRATCH, compile_exchange
from ..schedule.ir import DATA
from ..transport.base import CHANNEL_DEBUG
from .engine import Stage

FINGERPRINT_BYTES = 256


def encode(text: str) -> np.ndarray:
    raw = text.encode()[:FINGERPRINT_BYTES]
    out = np.zeros(FINGERPRINT_BYTES, dtype=np.uint8)
    out[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return out


def decode(arr: np.ndarray) -> str:
    return bytes(arr).rstrip(b"\0").decode(errors="replace")


def fingerprint_stage(rank: int, size: int, seq: int, collective: str,
                      text: str) -> Stage:
    """A stage that exchanges ``text`` with every rank and raises MismatchError
    on any difference."""
    sched = compile_exchange(rank, tuple(range(size)), FINGERPRINT_BYTES)
    mine = encode(text)
    peers = np.zeros(FINGERPRINT_BYTES * size, dtype=np.uint8)

    def compare() -> None:
        details = {}
        for r in range(size):
            if r == rank:
                continue
            theirs = decode(peers[r * FINGERPRINT_BYTES:(r + 1) * FINGERPRINT_BYTES])
            if theirs != text:
                details[r] = theirs
        if details:
            raise MismatchError(collective, seq, details, text)

    on_done: Callable[[], None] = compare
    return Stage(sched, CHANNEL_DEBUG, {DATA: mine, EXCHANGE_SCRATCH: peers}, UINT8, on_done)
