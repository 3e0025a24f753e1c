"""CPU time per training iteration, per thread, for each training method.

On an oversubscribed machine (8 ranks on 2 cores) every CPU microsecond a
method spends per iteration, on any thread, delays someone's compute. This
script runs the demo's training loop (``wagma_comm.demo.train``) for each
method, alternating methods, and reads every thread's CPU time from
``/proc/self/task/*/schedstat`` (nanoseconds on a core) before and after, so
the cost of the progress thread is seen apart from the application's.

    mpiexec -n 8 .venv/bin/python bench/train_cpu.py [--methods wagma,local_sgd,dpsgd]
        [--iterations 200] [--repeats 2] [--imbalance none] [--round-start publish]
        [--group-size S]

Linux only (schedstat). Prints, per method, the mean over ranks of: wall time
per iteration, the main thread's CPU per iteration, the other threads' CPU per
iteration (the progress thread, and anything else the process started), and
the total times ranks / cores, the wall-clock floor that CPU alone sets.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

import wagma_comm
from wagma_comm import demo
from wagma_comm.bench.measure import job_cores
from wagma_comm.cli import build_parser
from wagma_comm.train import default_group_size
from wagma_comm import imbalance as imb


def thread_cpu_ns() -> dict[int, int]:
    """Nanoseconds on a core so far, per thread id of this process."""
    out: dict[int, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as fh:
                out[int(tid)] = int(fh.read().split()[0])
        except OSError:  # the thread ended between listdir and open
            pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--methods", default="wagma,local_sgd,dpsgd")
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--imbalance", default="none",
                        help="injector spec, as the demo's --imbalance (default none)")
    parser.add_argument("--round-start", default="publish")
    parser.add_argument("--group-size", type=int, default=None,
                        help="WAGMA's group size (default: the demo's)")
    args = parser.parse_args()

    import torch
    torch.set_num_threads(1)
    comm = wagma_comm.init()
    P = comm.size
    o = build_parser().parse_args(["demo", "--quiet", "--round-start", args.round_start])
    o.group_size = args.group_size or default_group_size(P)
    data = demo.load_data()
    injector = imb.make_injector(args.imbalance, P, 0)
    methods = args.methods.split(",")
    none = imb.make_injector("none", P, 0)
    for m in methods:  # warm-up: JIT, schedules, channels
        demo.train(comm, m, 0, data, o, none, iterations=o.sync_every + 2)
    main_tid = os.getpid()
    rows: dict[str, list[tuple[float, float, float]]] = {m: [] for m in methods}
    for rep in range(args.repeats):
        for m in methods if rep % 2 == 0 else methods[::-1]:
            before = thread_cpu_ns()
            w0 = time.perf_counter()
            demo.train(comm, m, rep, data, o, injector, iterations=args.iterations)
            wall = time.perf_counter() - w0
            after = thread_cpu_ns()
            main_ns = after.get(main_tid, 0) - before.get(main_tid, 0)
            other_ns = sum(v - before.get(t, 0) for t, v in after.items() if t != main_tid)
            n = args.iterations
            rows[m].append((wall / n, main_ns / 1e9 / n, other_ns / 1e9 / n))
    cores = job_cores(MPI.COMM_WORLD)
    lines = [f"# {P} ranks on {cores} cores, {args.iterations} iterations x {args.repeats} "
             f"repeats per method, injector {args.imbalance}, compute {1e3 * o.compute:g} ms, "
             f"round start {args.round_start}, group size {o.group_size} "
             "(mean over ranks and repeats; us per iteration)",
             f"{'method':>10} {'wall':>8} {'main CPU':>9} {'other CPU':>10} "
             f"{'total CPU':>10} {'x P/cores':>10}"]
    for m in methods:
        mine = np.array(rows[m]).mean(axis=0)
        everyone = comm.allreduce(mine, op="sum") / P  # in place; mine is ours
        wall, main_cpu, other_cpu = everyone * 1e6
        total = main_cpu + other_cpu
        lines.append(f"{m:>10} {wall:8.0f} {main_cpu:9.0f} {other_cpu:10.0f} "
                     f"{total:10.0f} {total * P / cores:10.0f}")
    if comm.rank == 0:
        print("\n".join(lines), flush=True)
    comm.close()


if __name__ == "__main__":
    main()
