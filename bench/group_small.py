"""Small blocking group allreduce against the global allreduce: a probe.

A training loop calls ``group_allreduce(buf, S, step)`` with a step that
grows every iteration; both calls here take NumPy arrays of 2 float32, the
group allreduce with groups of ``max(1, P // 2)`` and the loop counter as its
step. Alternating rounds, time per call (median over rounds, mean over ranks).

    mpiexec -n 8 .venv/bin/python bench/group_small.py   # bench/results/group-small-8.txt
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import wagma_comm
from wagma_comm.bench.measure import alternating, run_or_abort


def main() -> None:
    world = MPI.COMM_WORLD
    comm = wagma_comm.init(timeout=120)
    buf = np.ones(2, np.float32)
    group_size = max(1, world.size // 2)
    impls: dict[str, Callable[[int], object]] = {
        "allreduce": lambda i: comm.allreduce(buf),
        "group_allreduce": lambda i: comm.group_allreduce(buf, group_size, i),
    }
    for call in impls.values():
        for i in range(50):
            call(i)
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for r in range(3):
        for name in alternating(list(impls), r):
            world.Barrier()
            t0 = time.perf_counter()
            for i in range(300):
                impls[name](i)
            samples[name].append((time.perf_counter() - t0) / 300 * 1e6)
    medians = world.gather({name: statistics.median(v) for name, v in samples.items()})
    if world.rank == 0:
        assert medians is not None
        print("  ".join(f"{world.size} ranks {name}: "
                        f"{statistics.fmean(m[name] for m in medians):.1f} us"
                        for name in impls))
    comm.close()


if __name__ == "__main__":
    run_or_abort(main)
