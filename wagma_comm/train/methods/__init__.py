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


# Every knob make_method takes, with its default.
KNOBS: dict[str, Any] = {"group_size": None, "sync_every": 10, "activation": "global",
                         "normalization": "wagma", "round_start": "publish",
                         "grace": WAGMA_GRACE, "seed": 0, "mpi_comm": None}


def make_method(name: str | Method, **knobs: Any) -> Method:
    """A method by name, with the knobs (:data:`KNOBS`) that apply to it (the
    others are ignored, so one set of options can drive every method). A
    :class:`Method` instance is returned as is, and takes no knobs (it was
    built with its own), unless it is set up and not closed: it holds one
    optimizer's collectives and round count, and a second set-up replaced
    them under the first (whose collectives were never closed, and whose
    rounds then ran on the other's, so a stale member could contribute the
    other model). Knob errors, a misspelt name included, are raised here as
    InvalidArgumentError naming the knob (``method`` for a live instance),
    before any communication."""
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise InvalidArgumentError(unknown[0], f"not a knob of any method; the knobs are "
                                   f"{sorted(KNOBS)}")
    if isinstance(name, Method):
        if knobs:
            raise InvalidArgumentError(sorted(knobs)[0], f"a {type(name).__name__} instance "
                                       "was built with its own knobs; pass them to its "
                                       "constructor, or give the method by name")
        if name._live:
            raise InvalidArgumentError(
                "method", f"this {type(name).__name__} instance is already set up (by a "
                "DistributedOptimizer or Averager not closed yet); it holds that one's "
                "collectives and rounds: build one instance per optimizer")
        return name
    k = {**KNOBS, **knobs}
    if name == "allreduce":
        return AllreduceSGD()
    if name == "local_sgd":
        return LocalSGD(k["sync_every"])
    if name == "dpsgd":
        return DPSGD(k["mpi_comm"])
    if name == "sgp":
        return SGP(k["mpi_comm"])
    if name in ("solo", "majority"):
        return EagerSGD(name, k["sync_every"], k["seed"])
    if name == "wagma":
        return WagmaSGD(k["group_size"], k["sync_every"], activation=k["activation"],
                        normalization=k["normalization"], round_start=k["round_start"],
                        grace=k["grace"])
    if name == "ad_psgd":
        return ADPSGD()
    raise InvalidArgumentError("method", f"unknown method {name!r}; expected one of "
                               f"{list(METHODS)} or a Method instance")


__all__ = ["METHODS", "KNOBS", "make_method", "Method", "AveragingInfo", "MODEL", "GRADIENTS",
           "AllreduceSGD", "EagerSGD", "LocalSGD", "WagmaSGD", "ADPSGD", "DPSGD", "SGP",
           "default_group_size", "ring_neighbours", "sgp_peers"]
