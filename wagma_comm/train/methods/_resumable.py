"""Partial collectives that start at a given training iteration.

A persistent collective numbers its rounds from 0, but on resume the next
iteration is ``first_iteration``: the shifting group and the majority activator
of round ``r`` must be those of iteration ``first_iteration + r``, or a resumed
run averages with other partners than the uninterrupted one. WAGMA's
collectives take that ``offset`` for their groups; the majority allreduce
shifts its activator in a subclass (its ``activator`` hook). Sync rounds are at rounds ``sync_every - 1,
2*sync_every - 1, ...`` of the object, so ``first_iteration`` must be a
multiple of ``sync_every`` (the caller checks) for them to stay aligned too.
"""

from __future__ import annotations

from typing import Any

from ...partial import shared_wagma
from ...partial.eager import MajorityAllreduce, SoloAllreduce
from ...runtime import activation

# A sync period no run reaches: a wait-avoiding collective with no sync rounds.
NO_SYNC = 1 << 62


class ShiftedMajority(MajorityAllreduce):
    """Majority allreduce whose round ``r`` has iteration ``offset + r``'s activator."""

    def __init__(self, comm: Any, buf: Any, sync_every: int, *, offset: int = 0,
                 **kw: Any) -> None:
        self.offset = offset
        super().__init__(comm, buf, sync_every, **kw)

    def activator(self, round: int) -> int:
        return activation.majority_activator(self.seed, round + self.offset, self.size)


def create(comm: Any, kind: str, buf: Any, sync_every: int, offset: int,
           **kw: Any) -> Any:
    """Create (collectively) one of the above, or a plain solo allreduce, the
    way ``Communicator.wait_avoiding_group_allreduce`` & co. do."""
    if kind == "wagma":
        # Either path (shared memory or messages); it calls comm._create.
        return shared_wagma.create(comm, buf, kw.pop("group_size"), sync_every,
                                   offset=offset, **kw)
    if kind == "majority":
        obj = ShiftedMajority(comm, buf, sync_every, offset=offset, **kw)
    elif kind == "solo":
        obj = SoloAllreduce(comm, buf, sync_every, **kw)
    else:  # pragma: no cover - internal
        raise ValueError(kind)
    return comm._create(obj)
