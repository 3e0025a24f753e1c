"""The interface every transport (MPI for host memory, NCCL for GPU memory)
implements. The progress engine is its only caller, from one thread.

A transport moves bytes and may run a whole collective natively; it knows
nothing of schedules' meaning, groups or WAGMA. Message identity is explicit:
``(channel, seq, msg)`` where ``seq`` is the collective's sequence number on the
communicator and ``msg`` the message's number between the two ranks within it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

import numpy as np

from ..dtypes import DType
from ..errors import TransportError
from .doorbell import Doorbell
from .shm import Segment

# Channels keep traffic of different purposes apart (each maps to its own
# duplicated communicator or tag space), so a debug fingerprint can never be
# matched against collective data.
CHANNEL_DATA = "data"
CHANNEL_DEBUG = "debug"
CHANNEL_SETUP = "setup"
CHANNELS = (CHANNEL_DATA, CHANNEL_DEBUG, CHANNEL_SETUP)

MSG_BITS = 15  # messages per peer per collective: the schedule builder enforces it
MSG_MASK = (1 << MSG_BITS) - 1


class Transport(ABC):
    """Point-to-point and native collective calls, all non-blocking."""

    name: str
    rank: int
    size: int
    # (host, pid) of every rank when the transport knows them (liveness check)
    identities: list[tuple[str, int]] | None = None
    # Wakes a peer's sleeping progress thread (transport/doorbell.py): only
    # where every rank can reach every other's; None: the engine polls.
    doorbell: Doorbell | None = None
    # Every rank's rows and flags in one mapping (transport/shm.py): only
    # where every rank is on this host; None: no shared-memory exchange.
    shared_segment: Segment | None = None
    shared_unavailable = "this transport has no shared-memory segment"  # why, when None

    @property
    @abstractmethod
    def seq_window(self) -> int:
        """How many consecutive sequence numbers have distinct message
        identities; the engine never has collectives further apart than this in
        flight, so identities never wrap silently."""

    @abstractmethod
    def isend(self, array: np.ndarray, peer: int, channel: str, seq: int, msg: int) -> Any:
        """Start sending ``array``; returns a request for :meth:`test_some`."""

    @abstractmethod
    def irecv(self, array: np.ndarray, peer: int, channel: str, seq: int, msg: int) -> Any:
        """Start receiving into ``array``; returns a request."""

    def posters(self, channel: str) -> tuple[Callable[[np.ndarray, int, int], Any],
                                             Callable[[np.ndarray, int, int], Any]]:
        """``(isend, irecv)`` for many messages on ``channel``:
        ``isend(array, peer, tag_base(seq) | msg)`` and ``irecv(...)`` start
        message ``msg`` of sequence number ``seq``. Made once per channel, so
        they can be the bare transport calls of a loop that posts many messages
        (runtime/inline.py, runtime/straight.py). Pass what isend returns
        through :meth:`as_send` before any other transport call sees it."""
        def isend(array: np.ndarray, peer: int, tag: int) -> Any:
            return self.isend(array, peer, channel, tag >> MSG_BITS, tag & MSG_MASK)

        def irecv(array: np.ndarray, peer: int, tag: int) -> Any:
            return self.irecv(array, peer, channel, tag >> MSG_BITS, tag & MSG_MASK)
        return isend, irecv

    def receive_buffer(self, array: np.ndarray) -> Any:
        """What a receive into ``array`` passes to :meth:`posters`' irecv
        (made once for a buffer received into again and again)."""
        return array

    def tag_base(self, seq: int) -> int:
        """The tag bits of sequence number ``seq`` for :meth:`posters`."""
        return seq << MSG_BITS

    def test_one(self, request: Any, status: Any = None) -> bool:
        """Whether ``request`` completed (then it is replaced by a null request
        in place, and ``status``, one of :meth:`statuses`, says what it got).
        The cheap poll of a waiting loop: one request per call costs less than
        :meth:`test_some` over all, and a failed poll is the common case.
        Raises TransportError on a failed request."""
        return bool(self.test_some([request], None if status is None else [status]))

    # -- what a completed receive got: the check that ranks agree on sizes ----
    def statuses(self, n: int) -> list[Any] | None:
        """``n`` objects for the test calls to fill with what each completed
        request got (a test call extends a short list), or None where this
        transport cannot tell: then received sizes go unchecked."""
        return None

    def received_bytes(self, status: Any) -> int:
        """The bytes a completed receive got, from its ``status``."""
        raise NotImplementedError(f"{self.name} does not report received sizes")

    def overlong(self, error: TransportError,
                 statuses: list[Any]) -> list[tuple[int, int, int]]:
        """``(position in statuses, sender, tag)`` of each receive that got a
        message longer than its buffer, as ``error``, raised by the test call
        that filled ``statuses``, reports. Empty when
        the error is something else. (A test of some requests fills statuses
        in completion order, not request order: the sender and the tag are
        what name the receive then.)"""
        return []

    def tag(self, seq: int, msg: int) -> int:
        """The tag of message ``msg`` of collective ``seq`` (as :meth:`posters` take it)."""
        return self.tag_base(seq) | msg

    # Exceptions the bare calls (posters, tester) may raise; error_of turns
    # one into the TransportError the rest of the runtime expects.
    raw_errors: tuple[type[BaseException], ...] = ()

    def error_of(self, exc: BaseException) -> BaseException:
        """The TransportError for an exception of :attr:`raw_errors`."""
        return TransportError(f"{self.name} error: {exc}")

    def tester(self) -> Callable[[list[Any], Any], bool]:
        """A function ``test_all(requests, statuses) -> bool``: whether every
        request in the list completed (then ``statuses``, from
        :meth:`statuses` or None, says what each got), for a loop that waits
        for one set at a time (runtime/straight.py); made once, so it can be
        the bare transport call. This default tests with :meth:`test_some`
        and removes the completed requests from the list (so it cannot fill
        ``statuses``: a transport that has them overrides it)."""
        def test_all(requests: list[Any], statuses: Any = None) -> bool:
            for k in sorted(self.test_some(requests), reverse=True):
                del requests[k]
            return not requests
        return test_all

    def native_starter(self, op: Any, dtype: DType) -> Callable[[np.ndarray], Any]:
        """A function starting the Native ``op`` on an array (its group set
        up already): the per-call work of :meth:`native_allreduce` and
        :meth:`native_broadcast` done once, for a schedule run many times."""
        if op.kind == "allreduce":
            return lambda arr: self.native_allreduce(arr, op.op, dtype, op.ranks)
        return lambda arr: self.native_broadcast(arr, op.root, op.ranks)

    def as_send(self, request: Any) -> Any:
        """A request of :meth:`posters`' isend as :meth:`isend` returns it."""
        return request

    @abstractmethod
    def irecv_any(self, array: np.ndarray, channel: str) -> Any:
        """Start receiving ``array`` from any rank with message number 0 and
        sequence 0 (activation tokens, which carry their identity inside)."""

    @abstractmethod
    def open_channels(self, names: Sequence[str]) -> None:
        """Create channels beyond the built-in ones (a persistent collective's
        own message space). Blocking and collective over all ranks, in the same
        order everywhere: called only after a barrier proved every rank there.
        A barrier that completed here may have timed out on a peer, which then
        never joins: raises CollectiveTimeoutError after the transport's
        timeout rather than blocking for ever; TransportError, naming the
        channel, where the transport fails a duplication (e.g. MPI has no
        context id left)."""

    @abstractmethod
    def close_channels(self, names: Sequence[str]) -> None:
        """Release channels made by :meth:`open_channels` (local)."""

    @abstractmethod
    def has_group(self, ranks: Sequence[int]) -> bool:
        """Whether a native collective over ``ranks`` can start without setup."""

    @abstractmethod
    def create_group(self, ranks: Sequence[int]) -> None:
        """Create what native collectives over ``ranks`` need. Blocking and
        collective over ``ranks``: the engine calls it only after a barrier over
        them completed, so every member is known to be present. Over MPI it
        is not bounded (MPI has no non-blocking MPI_Comm_create_group): a
        member whose barrier timed out just as it completed here never calls
        it, and this call then blocks for good (a known limit)."""

    @abstractmethod
    def native_allreduce(self, array: np.ndarray, op: str, dtype: DType,
                         ranks: Sequence[int]) -> Any:
        """Start an allreduce over ``ranks`` in place; returns a request."""

    @abstractmethod
    def native_broadcast(self, array: np.ndarray, root: int, ranks: Sequence[int]) -> Any:
        """Start a broadcast from global rank ``root`` over ``ranks``."""

    @abstractmethod
    def supports_native(self, op: str, dtype: DType) -> bool:
        """Whether :meth:`native_allreduce` can reduce ``dtype`` with ``op``."""

    @abstractmethod
    def test_some(self, requests: list[Any], statuses: list[Any] | None = None) -> list[int]:
        """Indices of completed requests (completed entries are replaced by a
        null request in place; ``statuses``, from :meth:`statuses`, says what
        each got, in the order of the returned indices, as MPI_Testsome
        fills them). Raises TransportError on a failed request."""

    @abstractmethod
    def abandon(self, request: Any) -> None:
        """Give up on a request after a timeout (cancel a receive; a send is
        left to finish on its own)."""

    @abstractmethod
    def cancel_recv(self, request: Any) -> None:
        """Cancel a pending receive and complete it (a listener being shut)."""

    @abstractmethod
    def close(self, keep: list[Any] | None = None) -> None:
        """Release communicators. ``keep`` (the communicator broke): a peer's
        message for a call this rank gave up on may still arrive, and MPI may
        still read or write the buffers in ``keep``; the communicators'
        contexts (never freed, so never reused by a later communicator) and
        those buffers stay referenced for the life of the process."""
