"""Reduced load/stress test (issue #7 item 4), part of ``make test``: 1,000
random non-blocking collectives in windows of 100-400 outstanding handles, every
result checked bitwise (tests/mpi/stresslib.py). The full soak, at least 10,000
operations with an RSS bound, is tests/soak (``make soak``).
"""

from __future__ import annotations

import wagma_comm
from stresslib import run


def test_stress_random_nonblocking_collectives(comm: wagma_comm.Communicator) -> None:
    # RSS is not checked here: 1,000 operations cannot tell a leak from the
    # warm-up of the bounded caches (the soak's bound).
    rep = run(comm, 1000, seed=7, window=(100, 400), native_groups=True)
    assert rep.checked == 1000
