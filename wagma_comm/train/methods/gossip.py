"""Decentralized baselines over point-to-point exchanges: D-PSGD (ring
neighbours) and SGP (push-sum to a peer at distance 2**k, rotating k).

Both block until their neighbours' models arrive (a slow rank slows its
neighbours, then theirs), and both are deterministic. The exchange is
:class:`~wagma_comm.train.neighbors.NeighborExchange` (mpi4py on a private
duplicate of the MPI communicator; see there for why).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ... import dtypes
from ...errors import InvalidArgumentError
from ...kernels import host as host_kernels
from ..neighbors import NeighborExchange, resolve_mpi_comm
from .base import MODEL, AveragingInfo, Method


def ring_neighbours(rank: int, size: int) -> list[int]:
    """The distinct ring neighbours of ``rank`` (none alone, one for P=2)."""
    return sorted({(rank - 1) % size, (rank + 1) % size} - {rank})


def sgp_peers(rank: int, size: int, t: int) -> tuple[int, int] | None:
    """(send to, receive from) at iteration ``t``: distance ``2**(t mod K)``,
    K = ceil(log2 P); None when alone."""
    if size < 2:
        return None
    k = t % max(1, (size - 1).bit_length())
    d = (1 << k) % size
    return (rank + d) % size, (rank - d) % size


class _Gossip(Method):
    averages = MODEL
    device_buffers = False  # mpi4py point-to-point on host memory (neighbors.py)

    def __init__(self, mpi_comm: Any = None) -> None:
        super().__init__()
        if mpi_comm is not None:  # its kind is checked here, before any communication
            from mpi4py import MPI

            if not isinstance(mpi_comm, MPI.Comm):
                raise InvalidArgumentError("mpi_comm", f"expected an mpi4py communicator, "
                                           f"got {type(mpi_comm).__name__}")
        self._mpi_comm = mpi_comm
        self._exchange: NeighborExchange | None = None
        self._received: list[list[np.ndarray]] = []
        self._buffers: list[np.ndarray] = []
        self._sources: list[int] = []
        # A round's sends were posted and never completed (a failed wait, or
        # a close mid-round): the exchange gave up on them without freeing
        # their buffers, which MPI may still read, so close() keeps them.
        self._sends_pending = False

    def _setup(self, comm: Any, buffers: list[np.ndarray]) -> None:
        mc = resolve_mpi_comm(comm, self._mpi_comm)
        self._exchange = NeighborExchange(mc, comm.timeout, f"{self.name} exchange",
                                          arrive=lambda t: comm.barrier(timeout=t))

    def _post(self, t: int, buffers: list[np.ndarray], dests: list[int],
              sources: list[int]) -> None:
        assert self._exchange is not None
        if len(self._received) != len(buffers) or any(
                len(r) != len(sources) for r in self._received):
            self._received = [[np.empty_like(b) for _ in sources] for b in buffers]
        self._buffers, self._sources = buffers, sources
        self._sends_pending = True
        self._exchange.start([(b, dests) for b in buffers],
                             [(r, sources) for r in self._received], label=t)

    def _combine(self) -> None:
        """Average each buffer with what came in, in rank order (the same
        summation order for the same set of models)."""
        me = self.comm.rank
        for b, recv in zip(self._buffers, self._received):
            dt = dtypes.from_numpy(b.dtype)
            assert dt is not None
            dst = b.view(dt.storage)  # the kernels compute on storage views
            parts = sorted([(me, dst)] + [(r, x.view(dt.storage))
                                          for r, x in zip(self._sources, recv)],
                           key=lambda p: p[0])
            host_kernels.average_into(dst, [p[1] for p in parts], len(parts), dt)

    def _finish(self, t: int) -> AveragingInfo:
        t0 = time.perf_counter()
        if self._sources:
            assert self._exchange is not None
            self._exchange.wait()
            self._sends_pending = False
            self._combine()
        return AveragingInfo(t, self.name, MODEL, False, time.perf_counter() - t0)

    def close(self) -> None:
        """Release the exchange, the receive buffers (a model copy per
        neighbour) and the reference to the caller's buckets: kept, they
        lived as long as the method (and its wrapper) did. The buckets'
        buffers stay referenced if a round's sends never completed (the
        exchange abandoned them; MPI may still read them)."""
        exchange, self._exchange = self._exchange, None
        self._received = []  # the exchange cancels a receive still posted
        if not self._sends_pending:
            self._buffers, self._sources = [], []
        super().close()
        if exchange is not None:
            exchange.close()


class DPSGD(_Gossip):
    """D-PSGD (Lian et al. 2017): every iteration, the model becomes the mean of
    this rank's and its ring neighbours' models (1/3 each; 1/2 at P=2)."""

    name = "dpsgd"

    def _start(self, t: int, buffers: list[np.ndarray]) -> None:
        peers = ring_neighbours(self.comm.rank, self.comm.size)
        if peers:
            self._post(t, buffers, peers, peers)
        else:
            self._sources = []


class SGP(_Gossip):
    """Stochastic gradient push (Assran et al. 2019), synchronous, one peer per
    iteration at distance ``2**k`` (k rotating): each rank keeps half of its
    push-sum mass and sends half. Every rank then receives exactly one message,
    so the push-sum weights stay 1 and the de-biased model is the model
    itself: ``x_i <- (x_i + x_{i - 2**k}) / 2``."""

    name = "sgp"

    def _start(self, t: int, buffers: list[np.ndarray]) -> None:
        peers = sgp_peers(self.comm.rank, self.comm.size, t)
        if peers is None:
            self._sources = []
        else:
            self._post(t, buffers, [peers[0]], [peers[1]])
