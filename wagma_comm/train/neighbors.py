"""Point-to-point model exchange for the gossip baselines (D-PSGD, SGP).

The communicator has no point-to-point API, and its group allreduce works on
partitions, which cannot express overlapping ring neighbourhoods. Rather than
add a core API for two baselines, this module talks MPI directly (mpi4py) on a
private duplicate of the MPI communicator, so its messages can never match
wagma_comm's or the user's. It keeps the runtime's rules: every wait has a
finite deadline, and a peer that does not show up is named in a
:class:`~wagma_comm.errors.CollectiveTimeoutError`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import (
    CollectiveError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
)

__all__ = ["NeighborExchange", "resolve_mpi_comm"]

_TAG_ROUNDS = 1024  # tags cycle over rounds; rounds complete in order per peer
_MAX_BUFFERS = 32


def resolve_mpi_comm(comm: Any, mpi_comm: Any = None) -> Any:
    """The MPI communicator ``comm`` runs over: ``mpi_comm`` if given, else
    MPI_COMM_WORLD. Checked to have the same rank and size (a local check)."""
    from mpi4py import MPI

    mc = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    if not isinstance(mc, MPI.Comm):
        raise InvalidArgumentError("mpi_comm", f"expected an mpi4py communicator, got "
                                   f"{type(mc).__name__}")
    if (mc.Get_rank(), mc.Get_size()) != (comm.rank, comm.size):
        raise InvalidArgumentError(
            "mpi_comm", f"rank/size {mc.Get_rank()}/{mc.Get_size()} differ from the "
            f"wagma communicator's {comm.rank}/{comm.size}; pass the MPI communicator "
            "it was created over (init(mpi_comm=...))")
    return mc


class NeighborExchange:
    """Send this rank's buffers to some peers and receive theirs, once per round.

    Collective to create and to :meth:`close` (a ``Dup``/``Free`` of the MPI
    communicator). Rounds must be started and finished in the same order on
    every rank; a round's messages are tagged by its number.
    """

    def __init__(self, mpi_comm: Any, timeout: float, name: str,
                 arrive: Callable[[float], Any] | None = None) -> None:
        """``arrive(timeout)``: a timed barrier over the same ranks (the wagma
        communicator's), run first because a duplication cannot say which
        ranks never came; the duplication has its own deadline too."""
        self.timeout = timeout
        self.name = name
        if arrive is not None:
            try:
                arrive(timeout)
            except CollectiveTimeoutError as err:
                raise CollectiveTimeoutError(
                    name, -1, err.ranks, f"set-up: ranks {list(err.ranks)} did not create "
                    f"this exchange within {timeout:g} s") from err
        from ..transport.mpi import dup_with_deadline

        self._comm = dup_with_deadline(mpi_comm, timeout, f"{name} set-up")
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        self._round = 0
        self._label = 0  # the round as errors name it (the training iteration)
        self._requests: list[Any] = []
        # The peer of each request, in order: receives' sources, then sends'
        # destinations (the first _receives requests are receives).
        self._peers: list[int] = []
        self._receives = 0
        self._broken: str | None = None

    def start(self, sends: Sequence[tuple[np.ndarray, Sequence[int]]],
              recvs: Sequence[tuple[Sequence[np.ndarray], Sequence[int]]],
              label: int | None = None) -> None:
        """Post this round: ``sends[k] = (buffer, destinations)`` and
        ``recvs[k] = (buffers, sources)`` for buffer ``k``. The send buffers and
        receive buffers must stay untouched until :meth:`wait` returns.
        ``label``: the round as errors name it (the training iteration, which
        the exchange's own count restarts from 0 on resume); default that count."""
        from mpi4py import MPI

        if self._broken is not None:
            raise CommunicatorClosedError(f"{self.name}: exchange is broken: {self._broken}")
        if self._requests:
            raise InvalidArgumentError("start", f"{self.name}: round {self._round} is still "
                                       "in flight; wait() for it first")
        for argument, buffers in (("sends", sends), ("recvs", recvs)):
            if len(buffers) > _MAX_BUFFERS:  # tags base + k would run into the next round's
                raise InvalidArgumentError(argument, f"at most {_MAX_BUFFERS} buffers per round")
        base = (self._round % _TAG_ROUNDS) * _MAX_BUFFERS
        self._label = self._round if label is None else label
        for k, (bufs, sources) in enumerate(recvs):
            for buf, src in zip(bufs, sources):
                self._requests.append(self._comm.Irecv([buf.view(np.uint8), MPI.BYTE],
                                                       src, base + k))
                self._peers.append(src)
        self._receives = len(self._requests)
        for k, (buf, dests) in enumerate(sends):
            for dst in dests:
                self._requests.append(self._comm.Isend([buf.view(np.uint8), MPI.BYTE],
                                                       dst, base + k))
                self._peers.append(dst)

    def wait(self) -> float:
        """Block until this round's messages are done; returns the seconds waited.
        Past the deadline: cancel the receives, raise CollectiveTimeoutError
        naming the peers not heard from (or whose receive never came: a send
        still pending); an MPI error (a peer that gave up or went away) raises
        CollectiveError naming the peers whose messages failed. The exchange
        is broken afterwards."""
        from mpi4py import MPI

        start = time.monotonic()
        deadline = start + self.timeout
        nap = 0.0
        statuses = [MPI.Status() for _ in self._requests]
        while True:
            try:
                if MPI.Request.Testall(self._requests, statuses):
                    break
            except MPI.Exception as exc:
                ok = (MPI.SUCCESS, MPI.ERR_PENDING)
                failed = [peer for peer, st in zip(self._peers, statuses)
                          if MPI.Get_error_class(st.Get_error()) not in ok] or self._peers
                label = self._abandon(f"round {self._label} failed")
                raise CollectiveError(
                    self.name, label, failed,
                    f"MPI error in the neighbour exchange ({exc.Get_error_string()}); a "
                    "peer gave up on this round or left") from exc
            now = time.monotonic()
            if now > deadline:
                late = []
                for peer, req in zip(self._peers, self._requests):
                    try:
                        done = req.Test()
                    except MPI.Exception:
                        done = False
                    if not done:
                        late.append(peer)
                if not late:  # it completed meanwhile
                    break
                label = self._abandon(f"round {self._label} timed out")
                raise CollectiveTimeoutError(
                    self.name, label, sorted(set(late)),
                    f"neighbour exchange not complete within {self.timeout:g} s")
            # Short naps: ranks outnumber cores in the tests and the demo.
            nap = min(1e-3, nap * 2 or 2e-5) if now - start > 1e-4 else 0.0
            time.sleep(nap)
        self._requests, self._peers = [], []
        self._round += 1
        return time.monotonic() - start

    def _abandon(self, why: str) -> int:
        """Give up this round: cancel and free the receives not complete (MPI
        would otherwise write into buffers the caller reuses, or crash at
        exit), leave the sends (cancelling them is deprecated) but keep their
        requests, which hold their buffers, for the life of the process (MPI
        may still read them; dropped, a buffer could be freed under it), mark
        the exchange broken. Returns the round's label."""
        from mpi4py import MPI

        from ..transport.mpi import ABANDONED

        ABANDONED.extend((None, req) for req in self._requests[self._receives:]
                         if req != MPI.REQUEST_NULL)
        for req in self._requests[:self._receives]:
            try:
                if not req.Test():
                    req.Cancel()
                    req.Free()
            except MPI.Exception:
                pass  # failed: MPI released it already
        self._broken = why
        self._requests, self._peers, self._receives = [], [], 0
        return self._label

    def close(self) -> None:
        """Collective: free the duplicated communicator (a round posted and
        never waited for is abandoned first). After an abandoned round it is
        kept, unfreed, as the transport keeps a broken communicator's: a
        peer's messages of that round may still be in flight, and MPI would
        give the freed context to a later communicator, whose receives would
        match them (a later D-PSGD round mixed in 388.75 where 0.5 was due)."""
        from ..transport.mpi import _KEPT

        if self._requests:
            self._abandon("closed")
        abandoned = self._broken is not None
        self._broken = "closed"  # start() says so (it failed on the freed communicator)
        if self._comm is not None:
            comm, self._comm = self._comm, None
            if abandoned:
                _KEPT.append(comm)  # never freed: its context is never reused
            else:
                comm.Free()
