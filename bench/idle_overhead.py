"""What an idle wagma_comm engine costs a compute-bound application thread.

Usage: mpiexec -n 2 .venv/bin/python bench/idle_overhead.py [--rounds 7]

Each rank times the same compute kernels with no communicator and with an open
communicator whose engine is idle (its progress thread parked on a condition
variable), in alternating order (ABBA) over rounds so noise hits both alike.
Two kernels: a pure-Python loop (holds the GIL, the worst case for a Python
progress thread) and a NumPy matmul (releases the GIL). Rank 0 prints the
median slowdown per kernel, averaged over ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

import wagma_comm
from wagma_comm.bench.measure import run_or_abort


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


def thread_cpu_seconds(native_id: int) -> float:
    """CPU time (user + system) a thread of this process has used, from /proc."""
    with open(f"/proc/self/task/{native_id}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def progress_thread_cpu(seconds: float) -> float:
    """Fraction of one core the idle progress thread used while the
    application thread computed for ``seconds``: a direct, noise-free measure."""
    comm = wagma_comm.init()
    comm.barrier()
    thread = comm._engine._thread  # noqa: SLF001 (measuring the engine itself)
    assert thread.native_id is not None
    before = thread_cpu_seconds(thread.native_id)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        python_loop(200_000)
    used = thread_cpu_seconds(thread.native_id) - before
    comm.close()
    return used / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    kernels = {"python loop (GIL-bound)": python_loop, "numpy matmul": numpy_matmul}
    ratios: dict[str, list[float]] = {k: [] for k in kernels}
    for fn in kernels.values():
        fn()  # warm up
    for r in range(args.rounds):
        for name, fn in kernels.items():
            # Alternate which variant runs first (ABBA), so warm-up and
            # frequency drift do not favour either.
            first_with = r % 2 == 1
            comm = wagma_comm.init() if first_with else None
            if comm is not None:
                comm.barrier()  # the engine has run once and is now idle
            world.Barrier()
            t_first = timed(fn)
            if comm is not None:
                comm.close()
            else:
                comm = wagma_comm.init()
                comm.barrier()
            world.Barrier()
            t_second = timed(fn)
            if not first_with:
                comm.close()
            base, with_engine = (t_second, t_first) if first_with else (t_first, t_second)
            ratios[name].append(with_engine / base)
    summary = {k: world.allgather(statistics.median(v)) for k, v in ratios.items()}
    cpu = world.allgather(progress_thread_cpu(10.0))
    if world.Get_rank() == 0:
        print(f"# idle engine overhead, {world.Get_size()} ranks, {args.rounds} rounds "
              "(median per rank, mean over ranks)")
        for name, per_rank in summary.items():
            slowdown = (float(np.mean(per_rank)) - 1.0) * 100
            verdict = "PASS" if slowdown <= 3.0 else "FAIL"
            print(f"  {name:<26} slowdown {slowdown:+.2f}%  (target <= 3%)  {verdict}")
        share = max(cpu) * 100
        print(f"  idle progress thread CPU over 10 s of compute: {share:.4f}% of a core "
              f"(max over ranks)  {'PASS' if share <= 3.0 else 'FAIL'}")


if __name__ == "__main__":
    run_or_abort(main)
