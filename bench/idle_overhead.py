"""What an idle wagma_comm engine costs a compute-bound application thread.

Usage: mpiexec -n 2 .venv/bin/python bench/idle_overhead.py [--rounds 7]

Each rank times the same compute kernels with no communicator and then with an
open communicator whose engine is idle (its progress thread parked on a
condition variable), alternating in rounds so machine noise hits both alike.
Two kernels: a pure-Python loop (holds the GIL, the worst case for a Python
progress thread) and a NumPy matmul (releases the GIL). Rank 0 prints the
median slowdown per kernel, averaged over ranks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import wagma_comm


def python_loop(n: int = 2_000_000) -> int:
    acc = 0
    for i in range(n):
        acc += i * i % 7
    return acc


_A = np.random.default_rng(0).standard_normal((384, 384))


def numpy_matmul(reps: int = 40) -> float:
    x = _A
    for _ in range(reps):
        x = (_A @ x) * 1e-3
    return float(x[0, 0])


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    kernels = {"python loop (GIL-bound)": python_loop, "numpy matmul": numpy_matmul}
    ratios: dict[str, list[float]] = {k: [] for k in kernels}
    for fn in kernels.values():
        fn()  # warm up
    for _ in range(args.rounds):
        for name, fn in kernels.items():
            world.Barrier()
            base = timed(fn)
            comm = wagma_comm.init()
            comm.barrier()  # the engine has run once and is now idle
            time.sleep(0.05)
            world.Barrier()
            with_engine = timed(fn)
            comm.close()
            ratios[name].append(with_engine / base)
    summary = {k: world.allgather(statistics.median(v)) for k, v in ratios.items()}
    if world.Get_rank() == 0:
        print(f"# idle engine overhead, {world.Get_size()} ranks, {args.rounds} rounds "
              "(median per rank, mean over ranks)")
        for name, per_rank in summary.items():
            slowdown = (float(np.mean(per_rank)) - 1.0) * 100
            verdict = "PASS" if slowdown <= 3.0 else "FAIL"
            print(f"  {name:<26} slowdown {slowdown:+.2f}%  (target <= 3%)  {verdict}")


if __name__ == "__main__":
    main()
