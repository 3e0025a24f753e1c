"""Checkpoints for :class:`~wagma_comm.train.DistributedOptimizer` training:
the model, the wrapped optimizer and the round counter, one file per rank.

Why per rank: with model-averaging methods the replicas differ between sync
rounds (and so do the optimizers' momentum buffers), so one file from rank 0
would not resume the others. Gradient methods keep replicas identical; for
them a path without ``{rank}`` is allowed and only rank 0 writes it.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from typing import Any

import torch

from ..errors import InvalidArgumentError
from .methods import GRADIENTS
from .pytorch import DistributedOptimizer
from .specs import agree_on_failure, allgather_ints, minority

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
    for a shared path on ranks other than 0, the file rank 0 writes).

    Collective: a rank that cannot write its file (no directory, a full
    disk) raises InvalidArgumentError naming ``path``, and so does every
    other rank, naming it (their own files are written). A file is replaced
    whole or not at all, and no ``.tmp`` file is left behind."""
    file = checkpoint_path(path, optimizer)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "extra": dict(extra or {})}
    error: BaseException | None = None
    if "{rank}" in os.fspath(path) or optimizer.comm.rank == 0:
        tmp = f"{file}.tmp"
        try:
            torch.save(state, tmp)
            os.replace(tmp, file)  # never a half-written checkpoint
        except Exception as exc:  # noqa: BLE001 - every rank hears of it below
            error = exc
            with contextlib.suppress(OSError):
                os.remove(tmp)
    # Also what the barrier was for: a shared file exists before anyone reads it.
    agree_on_failure(optimizer.comm, error, "path", f"write the checkpoint {file!r}")
    return file


def _read(file: str) -> dict[str, Any]:
    if not os.path.exists(file):
        raise InvalidArgumentError("path", f"no checkpoint at {file!r}")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling raises anything
        raise InvalidArgumentError("path", f"{file!r} is not a readable checkpoint: "
                                   f"{exc}") from exc
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict) \
            or not isinstance(state.get("optimizer"), dict):
        raise InvalidArgumentError("path", f"{file!r} is no checkpoint of save_checkpoint "
                                   "(expected a dict with 'model' and 'optimizer')")
    return state


def load_checkpoint(path: str, model: torch.nn.Module,
                    optimizer: DistributedOptimizer) -> dict[str, Any]:
    """Collective: load the model first, then the optimizer and round counter
    (which restarts the method's collectives at the saved iteration from the
    loaded weights). Returns the ``extra`` dict saved with it.

    Every rank reads its file before any rank loads anything: a file missing
    or unreadable on some rank, or files saved at different iterations (or
    by another method or number of ranks), raise InvalidArgumentError naming
    ``path`` and the ranks on every rank, with nothing loaded. A model that
    does not take its state (another architecture) raises it naming
    ``model`` on every rank, before the optimizer is touched."""
    file = checkpoint_path(path, optimizer)
    comm = optimizer.comm
    state: dict[str, Any] = {}
    error: BaseException | None = None
    try:
        state = _read(file)
    except Exception as exc:  # noqa: BLE001 - every rank hears of it in agree_on_failure
        error = exc
    opt_state = state.get("optimizer") or {}
    saved = opt_state.get("iteration")
    iteration = saved if isinstance(saved, int) and not isinstance(saved, bool) else -1
    mark = zlib.crc32(repr((opt_state.get("method"), opt_state.get("size"),
                            iteration)).encode())
    marks = agree_on_failure(comm, error, "path", f"read the checkpoint {file!r}", mark)
    if len(set(marks)) > 1:
        _, odd = minority(marks)
        iterations = [int(i) for i in allgather_ints(comm, [iteration], 1)[:, 0]]
        per = ", ".join(f"rank {r}: {i}" for r, i in enumerate(iterations))
        raise InvalidArgumentError(
            "path", f"the ranks' checkpoints were saved at different iterations, or by "
            f"another method or number of ranks ({per}); ranks that differ from the "
            f"majority: {odd or list(range(comm.size))}. Load files saved together")
    error = None
    try:
        model.load_state_dict(state["model"])
    except Exception as exc:  # noqa: BLE001 - a model of another shape
        error = exc
    agree_on_failure(comm, error, "model", f"load the model state of {file!r}")
    optimizer.load_state_dict(opt_state)
    return dict(state.get("extra") or {})
