"""Small non-blocking allreduce against the blocking one and MPI's: a probe.

A training loop posts its buckets with ``async_op=True`` and waits for
them; when a bucket is small, what counts is the post-to-completion time of
one call. Per size, side by side in alternating rounds on the same float32
buffer (time per call; median over rounds, mean over ranks):

- ``blocking``: ``comm.allreduce(buf)``
- ``async+wait``: ``comm.allreduce(buf, async_op=True).wait()``
- ``async+test``: the same, polling ``Handle.test()`` instead of waiting
- ``MPI_Iallreduce``: mpi4py's ``Iallreduce`` + ``Wait`` on the same buffer
- ``MPI_Allreduce``: mpi4py's blocking ``Allreduce``

    mpiexec -n 8 .venv/bin/python bench/async_small.py   # bench/results/async-small-8.txt
"""

from __future__ import annotations

import sys
from typing import Callable

import numpy as np
from mpi4py import MPI

import wagma_comm
from wagma_comm.bench.measure import run_or_abort, side_by_side

SIZES = (8, 1024, 64 << 10)  # bytes; 64 KiB is the largest small call (INLINE_MAX_BYTES)


def main() -> None:
    world = MPI.COMM_WORLD
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    comm = wagma_comm.init(timeout=120)
    for nbytes in SIZES:
        buf = np.ones(nbytes // 4, np.float32)

        def async_test() -> None:
            handle = comm.allreduce(buf, async_op=True)
            while not handle.test():
                pass

        impls: dict[str, Callable[[], object]] = {
            "blocking": lambda: comm.allreduce(buf),
            "async+wait": lambda: comm.allreduce(buf, async_op=True).wait(),
            "async+test": async_test,
            "MPI_Iallreduce": lambda: world.Iallreduce(MPI.IN_PLACE, buf).Wait(),
            "MPI_Allreduce": lambda: world.Allreduce(MPI.IN_PLACE, buf),
        }
        timings = side_by_side(impls, iters, warmup=50, rounds=3, comm=world)
        if world.rank == 0:
            base = timings["blocking"].avg
            print(f"{world.size} ranks {nbytes:>6} B  " + "  ".join(
                f"{name}: {t.avg * 1e6:.1f} us ({t.avg / base:.2f}x)"
                for name, t in timings.items()), flush=True)
    comm.close()


if __name__ == "__main__":
    run_or_abort(main)
