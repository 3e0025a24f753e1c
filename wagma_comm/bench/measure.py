"""Timing of one collective implementation on one buffer, on every rank.

Implementations are measured side by side in the same run on the same buffers,
alternating in rounds (ours, theirs, ours, theirs, ...) so that the noise of a
shared machine hits both alike; the reported figure per rank is the median of
the rounds, then averaged over ranks (min and max over ranks are kept too).

The benchmark's own barriers and exchanges of timings are MPI non-blocking
calls tested under a deadline (``timeout``; default ``WAGMA_TIMEOUT``, else
300 s), so a rank that stops between two timed loops is a
CollectiveTimeoutError naming the step, not a job that waits forever.
"""

from __future__ import annotations

import os
import statistics
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from ..comm import check_timeout, default_timeout


def run_or_abort(main: Callable[[], Any]) -> None:
    """Run a ``bench/`` script's ``main``; any rank's error ends the whole job
    (MPI_Abort when it exits), since the other ranks may be waiting in a raw
    MPI call that has no timeout: MPICH does not end a job when one rank
    raises, and the job then hung until killed."""
    from mpi4py.run import set_abort_status

    try:
        main()
    except BaseException as exc:
        set_abort_status(exc)
        raise


@dataclass
class Timing:
    """Seconds per call: mean over ranks of each rank's median, min and max."""

    avg: float
    min: float
    max: float


def wait_bounded(req: MPI.Request, what: str, round: int = -1,
                 timeout: float | None = None, keep: Any = None) -> None:
    """Test ``req`` until it completes (spinning, as MPI's blocking calls
    do: a nap would let ranks leave a barrier up to a nap apart); past
    ``timeout`` seconds (None: ``WAGMA_TIMEOUT``, else 300 s) raise
    CollectiveTimeoutError naming ``what`` and ``round``. An MPI request
    cannot tell which rank is missing, so the error names none. ``keep``:
    buffers the request still uses, kept alive if it is abandoned."""
    from ..transport.mpi import wait_with_deadline

    limit = check_timeout(default_timeout(timeout))
    wait_with_deadline(req, keep, time.monotonic() + limit, what, nap_limit=0, round=round,
                       detail=f"not every rank came within {limit:g} s (an MPI request "
                       "cannot name the missing ranks)")


def barrier(comm: MPI.Comm, what: str, round: int = -1,
            timeout: float | None = None) -> None:
    """MPI_Ibarrier under a deadline: every rank past it, or a timeout error."""
    wait_bounded(comm.Ibarrier(), f"wagma bench: barrier {what}".rstrip(), round, timeout)


def allgather_floats(comm: MPI.Comm, values: Any, what: str, round: int = -1,
                     timeout: float | None = None) -> np.ndarray:
    """Every rank's ``values`` (same length on every rank) as float64 rows in
    rank order, under a deadline. Identical on every rank, so what each rank
    derives from it (means, iteration counts) agrees bit for bit."""
    send = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
    recv = np.empty((comm.Get_size(), send.size), dtype=np.float64)
    wait_bounded(comm.Iallgather(send, recv), f"wagma bench: allgather {what}".rstrip(),
                 round, timeout, keep=(send, recv))
    return recv


def job_cores(comm: MPI.Comm, timeout: float | None = None) -> int:
    """How many cores the ranks on rank 0's node may run on: the union of
    their CPU affinities (collective). A rank's own affinity is 1 core under
    ``mpiexec -bind-to core``, and ``os.cpu_count()`` counts cores a cpuset
    (taskset, a batch allocation) keeps from the job: "8 ranks on 1 cores"
    and "on 16 cores" for a job given 2 were both printed before."""
    mine = sorted(os.sched_getaffinity(0))
    width = int(allgather_floats(comm, [mine[-1] + 1], "CPU ids", timeout=timeout).max())
    row = np.zeros(width + 1)
    row[0] = zlib.crc32(MPI.Get_processor_name().encode())  # exact in a float64
    row[1 + np.array(mine)] = 1.0
    rows = allgather_floats(comm, row, "CPU affinities", timeout=timeout)
    on_node = rows[rows[:, 0] == rows[0, 0], 1:]
    return int(np.count_nonzero(on_node.max(axis=0)))


def time_calls(call: Callable[[], object], iters: int, comm: MPI.Comm,
               sync: Callable[[], None] | None = None, *, timeout: float | None = None,
               round: int = -1, name: str = "") -> float:
    """Seconds per call for ``iters`` back-to-back calls, started together;
    ``sync`` (GPU buffers) waits for work the calls only queued. ``name``,
    ``round``: what a timeout in the starting barrier names."""
    barrier(comm, f"before timing {name or 'a call'}", round, timeout)
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
                 sync: Callable[[], None] | None = None,
                 timeout: float | None = None) -> dict[str, Timing]:
    """Time every implementation in alternating rounds; reduce over ranks.
    ``timeout`` bounds the benchmark's own barriers and exchanges."""
    for call in impls.values():
        for _ in range(warmup):
            call()
        if sync is not None:
            sync()
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for r in range(rounds):
        for name in alternating(list(impls), r):
            samples[name].append(time_calls(impls[name], iters, comm, sync, timeout=timeout,
                                           round=r, name=name))
    mine = [statistics.median(values) for values in samples.values()]
    gathered = allgather_floats(comm, mine, "of the timings", rounds, timeout)
    return {name: Timing(float(gathered[:, i].mean()), float(gathered[:, i].min()),
                         float(gathered[:, i].max()))
            for i, name in enumerate(samples)}


def iterations_for(nbytes: int, requested: int | None, budget_bytes: int = 256 << 20) -> int:
    """Iterations per round: the requested count, else enough to move about
    ``budget_bytes`` per round (small sizes get many, 64 MiB gets a few)."""
    if requested:
        return requested
    return int(min(200, max(2, budget_bytes // max(nbytes, 1))))
