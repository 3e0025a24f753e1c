"""What NCCL communicators cost: set-up time and GPU memory (issue #4 item 1).

    NCCL_MULTI_RANK_GPU_ENABLE=1 mpiexec -n 4 python bench/gpu/comm_cost.py

Measured in one run, on every rank, with barriers between the phases:

* the world communicator: the first GPU allreduce (ncclCommInitRank, our
  kernels' load) against the median of later ones;
* group communicators: the first group allreduce of each new partition
  (group size 2, every step) against later ones on the same partition;
* a persistent collective on GPU buffers (WAGMA, group size 2): its creation,
  which makes and connects its own communicators (partial/device.py).

Memory: the device's free memory (cudaMemGetInfo) read by rank 0 before and
after each phase, after every rank released CuPy's cached blocks; with several
ranks on one GPU that is all ranks' communicators together, divided here by the
number of ranks (per rank) and by communicators made (per communicator).
"""

from __future__ import annotations

import statistics
import time

import cupy as cp
from mpi4py import MPI

import wagma_comm
from wagma_comm import groups

WORLD = MPI.COMM_WORLD


def free_bytes() -> int:
    cp.get_default_memory_pool().free_all_blocks()
    cp.cuda.Device().synchronize()
    WORLD.Barrier()
    free = cp.cuda.runtime.memGetInfo()[0]
    WORLD.Barrier()
    return free


def timed(call) -> float:
    WORLD.Barrier()
    started = time.perf_counter()
    call()
    return WORLD.allreduce(time.perf_counter() - started, op=MPI.MAX)


def main() -> None:
    comm = wagma_comm.init(timeout=120)
    size = comm.size
    x = cp.ones(8, dtype=cp.float32)
    rows = []

    before = free_bytes()
    first = timed(lambda: comm.allreduce(x))
    steady = statistics.median(timed(lambda: comm.allreduce(x)) for _ in range(20))
    used = before - free_bytes()
    rows.append(("world communicator (first allreduce)", first, steady, used / size, 1))

    steps = groups.num_steps(size, 2) if size > 1 else 0
    for step in range(steps):
        before = free_bytes()
        first = timed(lambda: comm.group_allreduce(x, 2, step))
        steady = statistics.median(timed(lambda: comm.group_allreduce(x, 2, step))
                                   for _ in range(20))
        used = before - free_bytes()
        rows.append((f"group communicators, group size 2, step {step}", first, steady,
                     used / size, 1))

    model = cp.ones(1 << 20, dtype=cp.float32)
    before = free_bytes()
    holder = []
    first = timed(lambda: holder.append(comm.wait_avoiding_group_allreduce(model, 2, 8)))
    used = before - free_bytes()
    wagma = holder[0]
    made = len(wagma._dev._comms)
    steady = statistics.median(timed(lambda: wagma.step(model)) for _ in range(20))
    rows.append((f"WAGMA creation (4 MiB model, its {made} communicators)", first, steady,
                 used / size, max(made, 1)))
    wagma.close()

    if comm.rank == 0:
        transport = comm._gpu.transport
        print(f"# {size} ranks on one GPU; NCCL {transport.nccl_version}; group "
              f"communicators by {transport.group_method}; world init "
              f"{transport.init_seconds:.3f} s")
        print(f"{'what':58s} {'first (ms)':>11s} {'later (ms)':>11s} "
              f"{'MiB/rank':>9s} {'MiB/comm':>9s}")
        for what, first, steady, per_rank, comms in rows:
            print(f"{what:58s} {first * 1e3:11.1f} {steady * 1e3:11.3f} "
                  f"{per_rank / 2**20:9.1f} {per_rank / comms / 2**20:9.1f}")
    comm.close()


if __name__ == "__main__":
    main()
