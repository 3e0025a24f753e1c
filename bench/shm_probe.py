"""What would a small allreduce cost through shared memory instead of messages?

A probe for issue #2 (docs/benchmarks.md, "Shared memory: a probe"): the same
8-byte float32 sum as a bare Python exchange through an MPI shared-memory
window, beside MPI_Allreduce and wagma's allreduce, alternating in rounds.
Each rank writes its row and a flag (the call's number), waits for every
peer's flag, then sums the rows in rank order; rows are double-buffered by the
call's parity. Three ways to wait are compared:

* ``shm_per_peer``: wait on one late peer at a time (a scalar read per test),
  ``sched_yield`` between tests;
* ``shm_all_flags``: test all flags at once (``flags.min()``), ``sched_yield``;
* ``shm_sleep0``: as ``shm_all_flags``, but ``time.sleep(0)`` between tests.

Not the runtime: no timeouts, no argument checks, no memory fences (x86 only).

    mpiexec -n 8 .venv/bin/python bench/shm_probe.py [--calls 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import wagma_comm
from wagma_comm.bench.measure import run_or_abort

WORLD = MPI.COMM_WORLD
RANK, P = WORLD.Get_rank(), WORLD.Get_size()
ROW = 64  # bytes per row


class Slots:
    """flags[2, P] int64 and rows[2, P, ROW] in one shared window."""

    def __init__(self) -> None:
        size = 2 * P * 8 + 2 * P * ROW
        self.win = MPI.Win.Allocate_shared(size if RANK == 0 else 0, 1, comm=WORLD)
        memory, _ = self.win.Shared_query(0)
        mem = np.frombuffer(memory, dtype=np.uint8)
        self.flags = mem[: 2 * P * 8].view(np.int64).reshape(2, P)
        self.rows = mem[2 * P * 8:].reshape(2, P, ROW)
        if RANK == 0:
            self.flags[:] = 0
        WORLD.Barrier()
        self.seq = 0

    def publish(self, x: np.ndarray) -> tuple[np.ndarray, int, int]:
        self.seq += 1
        parity = self.seq & 1
        raw = x.view(np.uint8)
        self.rows[parity, RANK, : raw.size] = raw
        flags = self.flags[parity]
        flags[RANK] = self.seq
        return flags, parity, raw.size

    def reduce(self, x: np.ndarray, parity: int, nbytes: int) -> None:
        np.sum(self.rows[parity, :, :nbytes].view(x.dtype), axis=0, out=x)


def exchanges(slots: Slots) -> dict[str, Callable[[np.ndarray], object]]:
    yield_, sleep = os.sched_yield, time.sleep

    def per_peer(x: np.ndarray) -> None:
        flags, parity, n = slots.publish(x)
        seq = slots.seq
        for r in range(P):
            while flags[r] < seq:
                yield_()
        slots.reduce(x, parity, n)

    def all_flags(x: np.ndarray) -> None:
        flags, parity, n = slots.publish(x)
        while flags.min() < slots.seq:
            yield_()
        slots.reduce(x, parity, n)

    def sleep0(x: np.ndarray) -> None:
        flags, parity, n = slots.publish(x)
        while flags.min() < slots.seq:
            sleep(0)
        slots.reduce(x, parity, n)

    return {"shm_per_peer": per_peer, "shm_all_flags": all_flags, "shm_sleep0": sleep0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    slots = Slots()
    comm = wagma_comm.init()
    fns = exchanges(slots)
    fns["MPI_Allreduce"] = lambda v: WORLD.Allreduce(MPI.IN_PLACE, v)
    fns["wagma allreduce"] = comm.allreduce
    x = np.ones(2, np.float32)
    for f in fns.values():  # warm-up
        for _ in range(100):
            x[:] = 1
            f(x)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, f in fns.items():
            WORLD.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                x[:] = 1
                f(x)
            times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
            if x[0] != P:
                raise SystemExit(f"{name}: wrong result {x[0]} (expected {P})")
    slowest = {name: WORLD.allreduce(max(t), op=MPI.MAX) for name, t in times.items()}
    if RANK == 0:
        print(f"# {P} ranks, 8-byte float32 sum, {args.calls} calls x {args.rounds} rounds "
              f"(alternating); us per call on rank 0 per round, median")
        mpi = float(np.median(times["MPI_Allreduce"]))
        for name, t in times.items():
            med = float(np.median(t))
            print(f"{name:>16}: " + " ".join(f"{v:7.1f}" for v in t)
                  + f"  median {med:7.1f} ({med / mpi:.2f}x MPI; slowest rank's worst "
                  f"round {slowest[name]:.1f})")
    comm.close()
    slots.win.Free()


if __name__ == "__main__":
    run_or_abort(main)
