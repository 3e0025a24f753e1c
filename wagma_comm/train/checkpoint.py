"""Checkpoints for :class:`~wagma_comm.train.DistributedOptimizer` training:
the model, the wrapped optimizer and the round counter, one file per rank.

Why per rank: with model-averaging methods the replicas differ between sync
rounds (and so do the optimizers' momentum buffers), so one file from rank 0
would not resume the others. Gradient methods keep replicas identical; for
them a path without ``{rank}`` is allowed and only rank 0 writes it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import InvalidArgumentError
from .methods import GRADIENTS
from .pytorch import DistributedOptimizer

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_path"]


def checkpoint_path(path: str, optimizer: DistributedOptimizer) -> str:
    """``path`` with ``{rank}`` filled in; refuses a shared path where the
    replicas are not identical."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError("path", f"expected a path, got {type(path).__name__}")
    path = os.fspath(path)
    if "{rank}" in path:  # replaced, not format()ted: other braces stay as they are
        return path.replace("{rank}", str(optimizer.comm.rank))
    if optimizer.method.averages != GRADIENTS:
        raise InvalidArgumentError(
            "path", f"{optimizer.method.name} keeps a different model on every rank; put "
            "'{rank}' in the path (e.g. 'ckpt-{rank}.pt') so each rank saves its own")
    return path


def save_checkpoint(path: str, model: torch.nn.Module, optimizer: DistributedOptimizer,
                    extra: dict[str, Any] | None = None) -> str:
    """Save model, optimizer state and round counter (call on every rank,
    between ``step()`` and the next backward). Returns the file written (or,
    for a shared path on ranks other than 0, the file rank 0 writes)."""
    file = checkpoint_path(path, optimizer)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "extra": dict(extra or {})}
    if "{rank}" in os.fspath(path) or optimizer.comm.rank == 0:
        tmp = f"{file}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, file)  # never a half-written checkpoint
    optimizer.comm.barrier()  # a shared file exists before anyone reads it
    return file


def load_checkpoint(path: str, model: torch.nn.Module,
                    optimizer: DistributedOptimizer) -> dict[str, Any]:
    """Collective: load the model first, then the optimizer and round counter
    (which restarts the method's collectives at the saved iteration from the
    loaded weights). Returns the ``extra`` dict saved with it."""
    file = checkpoint_path(path, optimizer)
    if not os.path.exists(file):
        raise InvalidArgumentError("path", f"no checkpoint at {file!r}")
    state = torch.load(file, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return dict(state.get("extra") or {})
