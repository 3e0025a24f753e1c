"""Small blocking allreduces while a persistent partial collective listens.

Usage: mpiexec -n 8 .venv/bin/python bench/listening_calls.py [--iters 300]

A trainer that uses WAGMA (or solo/majority) and also reduces a metric with a
blocking allreduce every iteration has a partial collective listening for
tokens the whole time. Such a call should cost what it costs with nothing
open. Per size, time per call (median of 3 alternating rounds, mean over
ranks) for: blocking with nothing open, blocking with a WAGMA collective
open, non-blocking + wait with it open, and MPI_Allreduce. Old and new code
are compared by running this script twice with ``PYTHONPATH`` pointing at
each (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import wagma_comm
from wagma_comm.bench.measure import run_or_abort

WORLD = MPI.COMM_WORLD


def per_call(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(10):
        fn()
    WORLD.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    comm = wagma_comm.init()
    names = ("blocking, nothing open", "blocking, WAGMA open", "async+wait, WAGMA open",
             "MPI_Allreduce")
    if comm.rank == 0:
        print(f"# {comm.size} ranks, time per call in us (median of 3 rounds, mean over ranks)")
        print(f"{'bytes':>8}  " + "  ".join(f"{n:>22}" for n in names))
    for nbytes in (8, 19240):
        buf = np.ones(max(1, nbytes // 4), np.float32)
        out = np.empty_like(buf)
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(3):
            times[names[0]].append(per_call(lambda: comm.allreduce(buf), args.iters))
            w = comm.wait_avoiding_group_allreduce(np.zeros(16, np.float32), 1, sync_every=10**6)
            times[names[1]].append(per_call(lambda: comm.allreduce(buf), args.iters))
            times[names[2]].append(per_call(
                lambda: comm.allreduce(buf, async_op=True).wait(), args.iters))
            w.close()
            times[names[3]].append(per_call(lambda: WORLD.Allreduce(buf, out), args.iters))
        means = [float(np.mean(WORLD.allgather(statistics.median(times[n])))) for n in names]
        if comm.rank == 0:
            print(f"{nbytes:>8}  " + "  ".join(f"{1e6 * m:>22.1f}" for m in means))
    comm.close()


if __name__ == "__main__":
    run_or_abort(main)
