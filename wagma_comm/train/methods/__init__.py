"""Training methods, selectable by name: WAGMA-SGD and the paper's baselines in
the same runtime, so they can be compared side by side in one run.

=============  =========  ==========================================================
name           averages   what happens each iteration
=============  =========  ==========================================================
``allreduce``  gradients  global mean of the gradients (blocking)
``local_sgd``  model      local steps; global model mean every ``sync_every``
``dpsgd``      model      mean with the ring neighbours (blocking exchange)
``sgp``        model      push-sum to one peer at distance 2**k (blocking)
``solo``       gradients  eager-SGD solo allreduce; global round every ``sync_every``
``majority``   gradients  eager-SGD majority allreduce; same
``wagma``      model      wait-avoiding group mean; global mean every ``sync_every``
``ad_psgd``    model      wait-avoiding pairwise mean, rotating partner, no sync
=============  =========  ==========================================================
"""

from __future__ import annotations

from typing import Any

from ...errors import InvalidArgumentError
from .averaging import WAGMA_GRACE, ADPSGD, LocalSGD, WagmaSGD, default_group_size
from .base import GRADIENTS, MODEL, AveragingInfo, Method
from .gossip import DPSGD, SGP, ring_neighbours, sgp_peers
from .gradient import AllreduceSGD, EagerSGD

METHODS: tuple[str, ...] = ("allreduce", "local_sgd", "dpsgd", "sgp", "solo", "majority",
                            "wagma", "ad_psgd")


def make_method(name: str | Method, *, group_size: int | None = None, sync_every: int = 10,
                activation: str = "global", normalization: str = "wagma",
                round_start: str = "publish", grace: float = WAGMA_GRACE, seed: int = 0,
                mpi_comm: Any = None) -> Method:
    """A method by name, with the knobs that apply to it (the others are ignored,
    so one set of options can drive every method). A :class:`Method` instance
    is returned as is. Knob errors are raised here, before any communication."""
    if isinstance(name, Method):
        return name
    if name == "allreduce":
        return AllreduceSGD()
    if name == "local_sgd":
        return LocalSGD(sync_every)
    if name == "dpsgd":
        return DPSGD(mpi_comm)
    if name == "sgp":
        return SGP(mpi_comm)
    if name in ("solo", "majority"):
        return EagerSGD(name, sync_every, seed)
    if name == "wagma":
        return WagmaSGD(group_size, sync_every, activation=activation,
                        normalization=normalization, round_start=round_start, grace=grace)
    if name == "ad_psgd":
        return ADPSGD()
    raise InvalidArgumentError("method", f"unknown method {name!r}; expected one of "
                               f"{list(METHODS)} or a Method instance")


__all__ = ["METHODS", "make_method", "Method", "AveragingInfo", "MODEL", "GRADIENTS",
           "AllreduceSGD", "EagerSGD", "LocalSGD", "WagmaSGD", "ADPSGD", "DPSGD", "SGP",
           "default_group_size", "ring_neighbours", "sgp_peers"]
