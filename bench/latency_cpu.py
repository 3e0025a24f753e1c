"""Where the time of a small allreduce goes: wall time and CPU time per call.

On an oversubscribed machine (8 ranks on 2 cores) a collective's wall time is
bounded below by (CPU time per call per rank) x ranks / cores: every rank's
Python work has to get a core. This script prints both for MPI_Allreduce,
MPI_Iallreduce + Wait, and wagma_comm's allreduce (default algorithm and
``native``), measured side by side in alternating rounds.

    mpiexec -n 8 .venv/bin/python bench/latency_cpu.py [--bytes 8] [--iters 300]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import wagma_comm
from wagma_comm.bench.measure import alternating, job_cores, run_or_abort


def measure(call: Callable[[], object], iters: int, world: MPI.Comm) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) per call, this rank."""
    world.Barrier()
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        call()
    return (time.perf_counter() - w0) / iters, (time.process_time() - c0) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bytes", type=int, default=8)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = wagma_comm.init(timeout=120)
    buf = np.ones(max(1, args.bytes // 4), np.float32)
    impls: dict[str, Callable[[], object]] = {
        "MPI_Allreduce": lambda: world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
        "MPI_Iallreduce+Wait": lambda: world.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM).Wait(),
        "wagma allreduce": lambda: comm.allreduce(buf),
        "wagma allreduce native": lambda: comm.allreduce(buf, algorithm="native"),
    }
    for call in impls.values():
        for _ in range(20):
            call()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in impls}
    for r in range(args.rounds):
        for name in alternating(list(impls), r):
            samples[name].append(measure(impls[name], args.iters, world))
    cores = job_cores(world)
    rows = []
    for name, values in samples.items():
        wall = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        walls, cpus = world.gather(wall), world.gather(cpu)
        if world.rank == 0:
            rows.append((name, float(np.mean(walls)), float(np.mean(cpus))))
    if world.rank == 0:
        print(f"# {args.bytes}-byte float32 sum, {world.size} ranks on {cores} cores, "
              f"{args.iters} calls x {args.rounds} rounds (median per rank, mean over ranks)")
        print(f"{'implementation':>24} {'wall us':>9} {'CPU us/rank':>12} "
              f"{'CPU x ranks / cores':>20} {'vs MPI_Allreduce':>17}")
        base = rows[0][1]
        for name, wall, cpu in rows:
            bound = cpu * world.size / min(cores, world.size)
            print(f"{name:>24} {wall * 1e6:9.1f} {cpu * 1e6:12.1f} {bound * 1e6:20.1f} "
                  f"{wall / base:16.2f}x")
    comm.close()


if __name__ == "__main__":
    run_or_abort(main)
