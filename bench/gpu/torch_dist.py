"""What the GPU benchmarks share: torch.distributed's NCCL process group over
the ranks of an MPI job (the baseline they compare with), and the timing of
a call."""

from __future__ import annotations

import os
import time
from typing import Callable

import torch
import torch.distributed as dist
from mpi4py import MPI

from wagma_comm.torch_views import use_local_gpu


def init_torch_nccl(world: MPI.Comm = MPI.COMM_WORLD) -> torch.device:
    """Put this rank on its GPU, start the NCCL process group (rank 0's port,
    broadcast over MPI) and return the device."""
    rank, size = world.Get_rank(), world.Get_size()
    device = use_local_gpu(world)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000 if rank == 0 else 0))
    os.environ["MASTER_PORT"] = world.bcast(os.environ["MASTER_PORT"], root=0)
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=device)
    return device


def seconds_per_call(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """The slowest rank's mean seconds per ``fn()`` over ``iters`` calls, after
    ``warmup`` untimed ones, the GPU drained before and after."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / iters
    return MPI.COMM_WORLD.allreduce(elapsed, op=MPI.MAX)
