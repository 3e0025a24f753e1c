"""Time per synchronous WAGMA round (sync_every=1) against a non-blocking
allreduce + wait of the same buffer and MPI_Allreduce, in one run.

Usage: mpiexec -n 8 .venv/bin/python bench/sync_round.py ELEMENTS ITERATIONS

Prints, per variant, the time per call of 3 consecutive rounds on rank 0 (the
first includes warm-up: kernel compilation, channel set-up). Groups of 4 ranks
(all ranks when there are fewer).
"""
import sys, time, numpy as np
from mpi4py import MPI
import wagma_comm
from wagma_comm.bench.measure import run_or_abort


def main() -> None:
    comm = wagma_comm.init()
    mpi = MPI.COMM_WORLD
    n = int(sys.argv[1]); iters = int(sys.argv[2])
    buf = np.ones(n, np.float32)
    w = comm.wait_avoiding_group_allreduce(buf.copy(), group_size=min(4, comm.size), sync_every=1)
    def wag():
        for _ in range(iters): w.step(buf)
    def ar():
        for _ in range(iters): comm.allreduce(buf, "avg")
    def ara():
        for _ in range(iters): comm.allreduce(buf, "avg", async_op=True).wait()
    def mp():
        out = np.empty_like(buf)
        for _ in range(iters): mpi.Allreduce(buf, out)
    res = {}
    for rep in range(3):
        for name, f in (("wagma sync", wag), ("allreduce async", ara), ("MPI", mp)):
            mpi.Barrier(); t = time.perf_counter(); f(); res.setdefault(name, []).append((time.perf_counter() - t) / iters)
    w.close()
    if comm.rank == 0:
        for k, v in res.items(): print(f"{k:16s}", " ".join(f"{x*1e6:8.0f}" for x in v), "us")
    comm.close()


if __name__ == "__main__":
    run_or_abort(main)
