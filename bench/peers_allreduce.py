"""wagma allreduce vs its peers (MPI_Allreduce, torch.distributed gloo, ...),
side by side in one run on one buffer: float32 sum at a few sizes.

Issue #5's host target: allreduce >= 16 MiB within 1.15x of MPI_Allreduce and
faster than torch.distributed gloo. Every implementation is first checked for
the right result, then timed in alternating rounds (bench.measure.side_by_side);
times are each rank's median over rounds, averaged over ranks.

    mpiexec -n 8 .venv/bin/python bench/peers_allreduce.py [--sizes 1M,16M,64M] [--vs mpi,gloo]
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Callable

import numpy as np
from mpi4py import MPI

import wagma_comm
from wagma_comm.bench.cli import parse_size
from wagma_comm.bench.measure import iterations_for, job_cores, run_or_abort, side_by_side
from wagma_comm.bench.peers import close_peers, make_peers


def pattern(rank: int, count: int) -> np.ndarray:
    return ((rank % 4) + 1 + (np.arange(count) % 3)).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1M,16M,64M")
    parser.add_argument("--vs", default="mpi,gloo")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=0, help="per round (default: by size)")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    comm = wagma_comm.init(timeout=args.timeout)
    peers = make_peers(args.vs, world, timeout=args.timeout)
    cores = job_cores(world, timeout=args.timeout)
    if rank == 0:
        print(f"# {size} ranks on {cores} cores, float32 sum, {args.rounds} "
              f"alternating rounds; load average at start {os.getloadavg()[0]:.2f}")
        print(f"# wagma_comm {wagma_comm.__version__}; "
              + "; ".join(f"{p.name}: {p.version()}" for p in peers))
        for p in peers:
            if p.reason:
                print(f"# {p.name} skipped: {p.reason}")
    names = ["wagma"] + [p.name for p in peers if p.reason is None]
    if rank == 0:
        head = f"{'size':>8}"
        for n in names:
            head += f" | {n + ' ms':>10} {'(min-max over ranks)':>20}"
        head += "".join(f" | {'wagma/' + n:>11}" for n in names[1:]) + " | #wrong"
        print(head, flush=True)
    worst: dict[str, float] = {}
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        count = nbytes // 4
        arr = pattern(rank, count)
        impls: dict[str, Callable[[], object]] = {
            "wagma": functools.partial(comm.allreduce, arr, "sum")}
        for p in peers:
            call = p.allreduce(arr, "sum")
            if call is not None:
                impls[p.name] = call
        expected = sum(pattern(r, count).astype(np.float64) for r in range(size))
        wrong = 0
        for call in impls.values():
            arr[:] = pattern(rank, count)
            call()
            wrong += world.allreduce(int(np.count_nonzero(arr != expected)))
        timings = side_by_side(impls, iterations_for(nbytes, args.iters), args.warmup,
                               args.rounds, world)
        if rank == 0:
            line = f"{nbytes >> 20:>5} MiB" if nbytes >= 1 << 20 else f"{nbytes:>8}"
            for n in names:
                t = timings[n]
                span = f"({t.min * 1e3:.1f}-{t.max * 1e3:.1f})"
                line += f" | {t.avg * 1e3:>10.2f} {span:>20}"
            for n in names[1:]:
                ratio = timings["wagma"].avg / timings[n].avg
                line += f" | {ratio:>10.2f}x"
                if nbytes >= 16 << 20:
                    worst[n] = max(worst.get(n, 0.0), ratio)
            print(line + f" | {wrong}", flush=True)
    if rank == 0:
        print("# targets (issue #5), worst ratio over sizes >= 16 MiB:")
        if "mpi" in worst:
            ok = "PASS" if worst["mpi"] <= 1.15 else "FAIL"
            print(f"  within 1.15x of MPI_Allreduce: {worst['mpi']:.2f}x  {ok}")
        if "gloo" in worst:
            ok = "PASS" if worst["gloo"] < 1.0 else "FAIL"
            print(f"  faster than torch.distributed gloo: {worst['gloo']:.2f}x  {ok}")
        print(f"# load average at end {os.getloadavg()[0]:.2f}", flush=True)
    close_peers(peers)
    comm.close()


if __name__ == "__main__":
    run_or_abort(main)
