"""Checkpoints for :class:`~wagma_comm.train.DistributedOptimizer` training:
the model, the wrapped optimizer and the round counter, one file per rank.

Why per rank: with model-averaging methods the replicas differ between sync
rounds (and so do the optimizers' momentum buffers), so one file from rank 0
would not resume the others. Gradient methods keep replicas identical; for
them a path without ``{rank}`` is allowed and only rank 0 writes it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import zlib
from collections.abc import Mapping
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
    whole or not at all, and no ``.tmp`` file is left behind. An ``extra``
    that :func:`load_checkpoint` could not read back (NumPy values) raises
    InvalidArgumentError naming ``extra`` on every rank, before any file is
    replaced."""
    file = checkpoint_path(path, optimizer)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    writes = "{rank}" in os.fspath(path) or optimizer.comm.rank == 0
    error: BaseException | None = None
    try:
        state["extra"] = _checked_extra(extra) if writes else {}
    except Exception as exc:  # noqa: BLE001 - every rank hears of it below
        error = exc
    # Before the file is replaced: the last good checkpoint stays.
    agree_on_failure(optimizer.comm, error, "extra", "save 'extra'")
    if writes:
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


def _checked_extra(extra: Any) -> dict[str, Any]:
    """``extra`` as saved, if :func:`load_checkpoint` can read it back: it
    loads with ``torch.load(weights_only=True)``, which refuses NumPy arrays
    and scalars (``np.float64`` losses, ``np.random.get_state()``). Saved
    unchecked, such a checkpoint replaced the last good one and could never
    be loaded ("not a readable checkpoint"). Only ``extra`` is round-tripped
    (in memory): it is small, the model and optimizer states are tensors."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise InvalidArgumentError("extra", f"expected a dict, got {type(extra).__name__}")
    out = dict(extra)
    buf = io.BytesIO()
    torch.save(out, buf)
    buf.seek(0)
    try:
        torch.load(buf, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling raises anything
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = found.group(1) if found else type(exc).__name__
        raise InvalidArgumentError(
            "extra", f"load_checkpoint could not read it back (torch.load(weights_only=True) "
            f"refuses {what}): save plain Python values and tensors (float(x), "
            "torch.from_numpy(a))") from exc
    return out


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
