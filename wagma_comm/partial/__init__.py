"""Persistent partial collectives: WAGMA's wait-avoiding group allreduce and
eager-SGD's solo/majority allreduces (see docs/partial.md)."""

from .base import PartialCollective
from .eager import MajorityAllreduce, SoloAllreduce
from .info import RoundInfo
from .wagma import WaitAvoidingGroupAllreduce

__all__ = ["PartialCollective", "RoundInfo", "WaitAvoidingGroupAllreduce",
           "SoloAllreduce", "MajorityAllreduce"]
