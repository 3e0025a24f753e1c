"""Timing of one collective implementation on one buffer, on every rank.

Implementations are measured side by side in the same run on the same buffers,
alternating in rounds (ours, theirs, ours, theirs, ...) so that the noise of a
shared machine hits both alike; the reported figure per rank is the median of
the rounds, then averaged over ranks (min and max over ranks are kept too).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from mpi4py import MPI


@dataclass
class Timing:
    """Seconds per call: mean over ranks of each rank's median, min and max."""

    avg: float
    min: float
    max: float


def time_calls(call: Callable[[], object], iters: int, comm: MPI.Comm,
               sync: Callable[[], None] | None = None) -> float:
    """Seconds per call for ``iters`` back-to-back calls, started together;
    ``sync`` (GPU buffers) waits for work the calls only queued."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    if sync is not None:
        sync()
    return (time.perf_counter() - t0) / iters


def alternating(names: Sequence[str], r: int) -> list[str]:
    """Round ``r``'s order: forwards, then backwards, so no implementation
    always runs first (or right after the same neighbour) on a noisy machine."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def side_by_side(impls: dict[str, Callable[[], object]], iters: int, warmup: int,
                 rounds: int, comm: MPI.Comm,
                 sync: Callable[[], None] | None = None) -> dict[str, Timing]:
    """Time every implementation in alternating rounds; reduce over ranks."""
    for call in impls.values():
        for _ in range(warmup):
            call()
        if sync is not None:
            sync()
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for r in range(rounds):
        for name in alternating(list(impls), r):
            samples[name].append(time_calls(impls[name], iters, comm, sync))
    out = {}
    for name, values in samples.items():
        mine = statistics.median(values)
        gathered = np.array(comm.allgather(mine))
        out[name] = Timing(float(gathered.mean()), float(gathered.min()), float(gathered.max()))
    return out


def iterations_for(nbytes: int, requested: int | None, budget_bytes: int = 256 << 20) -> int:
    """Iterations per round: the requested count, else enough to move about
    ``budget_bytes`` per round (small sizes get many, 64 MiB gets a few)."""
    if requested:
        return requested
    return int(min(200, max(2, budget_bytes // max(nbytes, 1))))
