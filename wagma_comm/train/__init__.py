"""Training integration: WAGMA-SGD and its baselines for any framework.

* :class:`Averager` -- framework-agnostic: a list of tensors (DLPack: NumPy,
  PyTorch, JAX, ...) kept as one flat bucket per dtype, one iteration's
  averaging at a time.
* :class:`DistributedOptimizer` -- wraps any ``torch.optim`` optimizer (imported
  lazily: this package does not need torch unless you use it).
* :func:`make_method` / :data:`METHODS` -- the methods by name.
* :func:`save_checkpoint` / :func:`load_checkpoint` -- per-rank checkpoints.

See docs/training.md.
"""

from __future__ import annotations

from typing import Any

from .averager import Averaged, Averager
from .bucket import FlatBucket, host_view
from .methods import (
    GRADIENTS,
    METHODS,
    MODEL,
    AveragingInfo,
    Method,
    default_group_size,
    make_method,
)
from .specs import ParameterMismatchError, TensorSpec, check_consistent

_TORCH_NAMES = {"DistributedOptimizer": "pytorch", "TorchBucket": "pytorch",
                "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint"}


def __getattr__(name: str) -> Any:
    """The PyTorch parts load on first use, so NumPy/JAX users need no torch."""
    if name in _TORCH_NAMES:
        import importlib

        module = importlib.import_module(f".{_TORCH_NAMES[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Averager", "Averaged", "AveragingInfo", "DistributedOptimizer", "FlatBucket",
           "GRADIENTS", "METHODS", "MODEL", "Method", "ParameterMismatchError", "TensorSpec",
           "TorchBucket", "check_consistent", "default_group_size", "host_view",
           "load_checkpoint", "make_method", "save_checkpoint"]
