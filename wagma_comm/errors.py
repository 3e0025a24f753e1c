"""The exception taxonomy of wagma_comm.

Every error the library raises on purpose derives from :class:`WagmaError`, so a
trainer can catch one base class. Each subclass says when it is raised; pick the
narrowest one. Errors that are caught locally (bad input) are raised before any
communication happens, and leave the communicator usable.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def _rebuild(cls: type, args: tuple) -> "WagmaError":
    """An error made again from its ``args`` (its message) without calling
    its ``__init__``, whose parameters are not its ``args``; pickle and copy
    then restore its attributes (``argument``, ``ranks``, ...)."""
    # The timeout errors are OSErrors too (TimeoutError): their instances
    # are laid out by OSError's __new__, which the MRO would not pick.
    new = OSError.__new__ if issubclass(cls, OSError) else Exception.__new__
    error = new(cls)
    error.args = args
    return error


class WagmaError(Exception):
    """Base class of every error raised by wagma_comm.

    Every one pickles and copies with its message and attributes (mpi4py's
    ``comm.gather(err)``, multiprocessing, ``copy.copy``): most subclasses'
    ``__init__`` takes other arguments than the message their ``args`` hold,
    so Python's default reconstruction, ``cls(*args)``, raised TypeError."""

    def __reduce__(self) -> tuple:
        return (_rebuild, (type(self), self.args), self.__dict__)


class InvalidArgumentError(WagmaError, ValueError):
    """An argument has the wrong value (unknown op, group size out of range, ...).

    Raised on the calling rank before any communication; the communicator stays
    usable. ``argument`` names the offending parameter. One exception: NaN
    in a float ``max``/``min`` is found in the result, after the collective
    completed, and raised (``argument`` "buf") on every member alike.
    """

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument


class BufferError(WagmaError, TypeError):  # noqa: A001 (shadows the builtin on purpose)
    """A buffer cannot be used: no DLPack, non-contiguous, read-only, wrong dtype.

    Raised on the calling rank before any communication; the communicator stays
    usable. ``argument`` names the parameter that carried the buffer.
    """

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument


class UnsupportedError(WagmaError, NotImplementedError):
    """A valid request this build or transport cannot serve (e.g. a GPU buffer
    with no GPU transport, a native MPI reduction of bfloat16)."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument


class CommunicatorClosedError(WagmaError, RuntimeError):
    """The communicator was closed (or broken by an earlier failure) and cannot
    start new work."""


class WaitTimeoutError(WagmaError, TimeoutError):
    """``Handle.wait(timeout)`` returned before the collective finished. The
    collective is still running and the handle can be waited on again; the
    collective's own deadline is what turns a hang into CollectiveTimeoutError."""


class CollectiveError(WagmaError, RuntimeError):
    """A collective failed while communicating. Carries what failed and where.

    Attributes: ``collective`` (name), ``round`` (the collective's sequence number
    on this communicator; -1, and left out of the message, for a call that is
    none, such as init()), ``ranks`` (the ranks blamed: missing or mismatching),
    ``detail`` (the message without the collective, round and ranks, so that a
    layer renaming the error for its own round does not repeat them).
    """

    def __init__(
        self,
        collective: str,
        round: int,
        ranks: Iterable[int],
        message: str,
    ) -> None:
        self.collective = collective
        self.round = round
        self.ranks: tuple[int, ...] = tuple(sorted(set(ranks)))
        self.detail = message
        super().__init__(
            f"{self.where}: {message}" + (f"; ranks: {list(self.ranks)}" if self.ranks else "")
        )

    @property
    def where(self) -> str:
        """The collective and its round (a negative round: no collective of
        the communicator, such as init() or a set-up, so none is shown)."""
        return self.collective if self.round < 0 else f"{self.collective} (round {self.round})"


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within its timeout. ``ranks`` are the peers
    this rank was still waiting for. The communicator is broken afterwards: MPI
    messages of the abandoned collective may still be in flight, so reusing it
    could match them against later collectives."""


class MismatchError(CollectiveError):
    """Ranks called different collectives, or the same one with different sizes,
    dtypes or ops: detected on the message path when ``WAGMA_DEBUG=1``, by the
    shared-memory exchange always, and when ranks create a persistent
    collective with different arguments. ``ranks`` are the ranks whose call
    differs from this rank's; ``details`` maps each to its call. The
    communicator stays usable (a persistent collective that finds one in its
    final calls is broken)."""

    def __init__(
        self,
        collective: str,
        round: int,
        details: dict[int, str],
        mine: str,
    ) -> None:
        self.details = dict(details)
        lines = "; ".join(f"rank {r} called {d}" for r, d in sorted(details.items()))
        super().__init__(
            collective, round, details.keys(), f"this rank called {mine} but {lines}"
        )


class RankFailedError(CollectiveError):
    """A rank taking part in the collective died (its process is gone).
    ``ranks`` are the dead ranks. Found by the liveness check
    (runtime/liveness.py) without waiting for the timeout; the communicator is
    broken afterwards, since no later collective over it can complete."""


class TransportError(WagmaError, RuntimeError):
    """The transport (MPI, NCCL) reported an error; ``code`` is its native code."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message if code is None else f"{message} (code {code})")
        self.code = code


class MessageSizeError(CollectiveError, TransportError):
    """A message this rank received had another size than the receive its
    schedule posted: ranks passed different counts (or dtypes of another
    size) to the same collective. Raised on the message path by the
    receiver, whether the message was shorter than expected (which MPI
    accepts silently) or longer (which MPI truncates); ``ranks`` names the
    sender, ``expected`` and ``received`` are byte counts (``received`` is
    None for a longer message: MPI does not say by how much). The
    communicator is broken afterwards: the sender may wait for messages this
    rank will never send."""

    def __init__(self, collective: str, round: int, sender: int, expected: int,
                 received: int | None) -> None:
        self.expected, self.received = expected, received
        got = f"more than {expected}" if received is None else f"{received}"
        super().__init__(
            collective, round, (sender,),
            f"rank {sender} sent {got} bytes where this rank expected {expected}: "
            "the ranks passed different counts or dtypes")


class ScheduleError(WagmaError, ValueError):
    """A schedule is malformed or does not compute its collective (raised by the
    builder and the verifier)."""


__all__: Sequence[str] = [
    "WagmaError",
    "InvalidArgumentError",
    "BufferError",
    "UnsupportedError",
    "CommunicatorClosedError",
    "WaitTimeoutError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "MismatchError",
    "RankFailedError",
    "TransportError",
    "MessageSizeError",
    "ScheduleError",
]
