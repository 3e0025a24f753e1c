"""Where a training layer's flat buckets live, agreed by every rank.

Both :class:`~wagma_comm.train.Averager` and
:class:`~wagma_comm.train.DistributedOptimizer` take ``buckets="auto" |
"device" | "host"``. The answer must be the same on every rank: a GPU
collective on some ranks and a host one on others would only end at the
deadline. This module needs no torch, so NumPy and JAX users of the Averager
take part in the vote without it.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .methods import Method
from .specs import allgather_ints, minority

__all__ = ["BUCKET_MEMORY", "agree_at_setup", "nccl_usable"]

BUCKET_MEMORY = ("auto", "device", "host")


def nccl_usable() -> bool:
    from ..transport.nccl import unavailable_reason

    return unavailable_reason() is None


def check_choice(choice: Any, method: Method) -> None:
    """The local checks of ``buckets``, raised before any communication."""
    if not isinstance(choice, str) or choice not in BUCKET_MEMORY:
        raise InvalidArgumentError("buckets", f"expected one of {list(BUCKET_MEMORY)}, "
                                   f"got {choice!r}")
    if choice == "device" and not method.device_buffers:
        raise InvalidArgumentError("buckets", f"{method.name} exchanges models through host "
                                   "memory (mpi4py); use buckets='host' or 'auto'")


def agree_at_setup(comm: Any, choice: str, device_type: str | None, method: Method) -> bool:
    """Collective: whether the buckets live on the tensors' device, and a
    check that every rank runs the same method with the same knobs.

    ``device_type`` is the tensors' common device kind (``"cuda"``,
    ``"cpu"``, ...; None when they are spread over several). ``"auto"``
    takes device buckets only for CUDA tensors, a method that takes device
    buffers and a usable NCCL, and only where every rank can. Device
    buckets over different device kinds (``"device"`` with CUDA tensors on
    some ranks and CPU tensors on others) raise on every rank: a GPU
    collective on some ranks and a host one on others would only end at
    the deadline (before, every rank took device buckets). Ranks that
    asked for different buckets, or run different methods (as
    ``method.describe()`` shows them: name and knobs), raise on every rank:
    a blocking method would otherwise pair one rank's gradient average with
    another's model average. One small allreduce (a second to name the ranks
    that differ)."""
    check_choice(choice, method)
    can = choice == "device" or (choice == "auto" and method.device_buffers
                                 and device_type == "cuda" and nccl_usable())
    code = BUCKET_MEMORY.index(choice)
    described = method.describe()
    mark = zlib.crc32(described.encode())
    kind = zlib.crc32(str(device_type).encode())
    vote = np.array([code, -code, -int(can), mark, -mark, kind, -kind], dtype=np.int64)
    comm.allreduce(vote, "max")
    if vote[3] != -vote[4]:
        marks = [int(m) for m in allgather_ints(comm, [mark], 1)[:, 0]]
        _, odd = minority(marks)
        raise InvalidArgumentError("method", f"the ranks set up different methods or knobs: "
                                   f"this rank runs {described}; ranks that differ from the "
                                   f"majority: {odd or list(range(comm.size))}")
    if vote[0] != -vote[1]:
        raise InvalidArgumentError("buckets", "ranks passed different values (this rank "
                                   f"{choice!r}); pass the same on every rank")
    on_device = int(vote[2]) == -1  # max(-can) == -min(can): every rank can
    if on_device and vote[5] != -vote[6]:
        kinds = [int(k) for k in allgather_ints(comm, [kind], 1)[:, 0]]
        _, odd = minority(kinds)
        raise InvalidArgumentError("buckets", f"device buckets need the tensors on the same "
                                   f"kind of device on every rank; this rank's are on "
                                   f"{device_type}, ranks that differ from the majority: "
                                   f"{odd or list(range(comm.size))} (use 'host' or 'auto')")
    return on_device
