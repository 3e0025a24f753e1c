"""wagma_comm: wait-avoiding group collectives for distributed deep learning.

Public names only; see README.md and docs/ for how to use them.
"""

from .comm import DEFAULT_TIMEOUT_S, Communicator, init
from .errors import (
    BufferError,
    CollectiveError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
    MessageSizeError,
    MismatchError,
    RankFailedError,
    ScheduleError,
    TransportError,
    UnsupportedError,
    WagmaError,
    WaitTimeoutError,
)
from .partial import (
    MajorityAllreduce,
    PartialCollective,
    RoundInfo,
    SoloAllreduce,
    WaitAvoidingGroupAllreduce,
)
from .runtime.handle import Handle

__version__ = "0.1.0"

__all__ = [
    "init",
    "Communicator",
    "Handle",
    "RoundInfo",
    "PartialCollective",
    "WaitAvoidingGroupAllreduce",
    "SoloAllreduce",
    "MajorityAllreduce",
    "DEFAULT_TIMEOUT_S",
    "WagmaError",
    "InvalidArgumentError",
    "BufferError",
    "UnsupportedError",
    "CommunicatorClosedError",
    "WaitTimeoutError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "MismatchError",
    "MessageSizeError",
    "RankFailedError",
    "TransportError",
    "ScheduleError",
    "__version__",
]
