"""Zero-copy views between host NumPy arrays and PyTorch CPU tensors.

NumPy has no bfloat16 of its own (``ml_dtypes`` supplies one) and PyTorch
cannot hand a bfloat16 tensor to NumPy, so bfloat16 crosses through a 16-bit
integer view of the same memory. The training layer and the benchmarks' peers
both need this; it lives here once, with the choice of a rank's GPU. PyTorch
is imported only when called.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np


def numpy_of(tensor: Any) -> np.ndarray:
    """A NumPy view of a host (CPU) tensor, typed as wagma's dtype."""
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def torch_of(array: np.ndarray) -> Any:
    """A torch tensor over a host NumPy array's memory."""
    import torch

    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def use_local_gpu(world: Any = None, timeout: float | None = None) -> Any:
    """Make this rank's GPU torch's current device and return it: the rank's
    index among the ranks of its node, modulo the node's GPUs (ranks beyond
    the GPU count share them; docs/gpu.md, "Several ranks per GPU").
    Collective over ``world`` (default MPI_COMM_WORLD): a shared-memory split.
    The split is a blocking MPI call, so a barrier bounded by ``timeout``
    (seconds; default ``WAGMA_TIMEOUT`` or 300) first proves every rank
    present: a rank that never calls this makes the others raise
    CollectiveTimeoutError("use_local_gpu") instead of blocking for ever.
    UnsupportedError("device") where this rank sees no GPU (after the split,
    so that the other ranks are not left waiting in it)."""
    import time

    import torch
    from mpi4py import MPI

    from .comm import check_timeout, default_timeout
    from .errors import UnsupportedError
    from .transport.mpi import wait_with_deadline

    limit = check_timeout(default_timeout(timeout))  # before any MPI call
    world = MPI.COMM_WORLD if world is None else world
    wait_with_deadline(world.Ibarrier(), None, time.monotonic() + limit, "use_local_gpu",
                       detail=f"not every rank called it within {limit:g} s (an MPI "
                       "request cannot name the missing ranks)", step="barrier")
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local_rank = local.Get_rank()
    finally:
        local.Free()
    count = torch.cuda.device_count()
    if count == 0:  # was a bare ZeroDivisionError
        raise UnsupportedError("device", "no CUDA device visible to this rank "
                               "(torch.cuda.device_count() is 0)")
    index = local_rank % count
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


__all__ = ["numpy_of", "torch_of", "use_local_gpu"]
