"""A lean executor for one schedule, run on the calling thread.

Why: on a loaded machine a small collective costs what its Python costs per
call (docs/benchmarks.md, "Why small messages miss"). The engine's general
turn walks services, queues, deadlines and every active run for each message
round; a blocking small collective with nothing else in flight needs none of
that. :func:`execute` runs the same dataflow (post what is ready, test all
outstanding requests with one transport call, yield the CPU between tests) for
one schedule, and stops early when a peer is late, so the engine can take the
rest over with the very same requests (:class:`InlineState`). The engine stays
the only issuer: see ``Engine.try_inline``.

The local ops (reduce, copy, scale) live here too; the engine runs them the
same way.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

import numpy as np

from ..dtypes import DType
from ..kernels import host as host_kernels
from ..schedule.ir import Copy, Native, Recv, Reduce, Scale, Send, Slot
from ..transport.base import Transport

_CLOCK_EVERY = 64  # failed tests between two looks at the clock


def view(arrays: dict[str, np.ndarray], slot: Slot) -> np.ndarray:
    return arrays[slot.buf][slot.offset:slot.offset + slot.count]


def run_local(op: Any, arrays: dict[str, np.ndarray], dtype: DType) -> None:
    """Run a reduce, copy or scale op on the host."""
    if isinstance(op, Reduce):
        host_kernels.reduce_views(view(arrays, op.dst), view(arrays, op.src), op.op, dtype)
    elif isinstance(op, Copy):
        np.copyto(view(arrays, op.dst), view(arrays, op.src))
    elif isinstance(op, Scale):
        host_kernels.scale_into(view(arrays, op.dst), op.divisor, dtype)
    else:
        raise TypeError(f"unknown op {op!r}")


def post(op: Any, arrays: dict[str, np.ndarray], dtype: DType, transport: Transport,
         channel: str, seq: int) -> Any:
    """Post a Send, Recv or Native op and return its request; None for a local
    op (which the caller runs with :func:`run_local`)."""
    kind = type(op)
    if kind is Send:
        return transport.isend(view(arrays, op.src), op.peer, channel, seq, op.msg)
    if kind is Recv:
        return transport.irecv(view(arrays, op.dst), op.peer, channel, seq, op.msg)
    if kind is Native:
        arr = view(arrays, op.buf)
        if op.kind == "allreduce":
            return transport.native_allreduce(arr, op.op, dtype, op.ranks)
        return transport.native_broadcast(arr, op.root, op.ranks)
    return None


class InlineState:
    """Where an inline run stands: the same facts an engine run keeps, so a
    late run is handed over without reposting anything."""

    __slots__ = ("remaining", "ready", "completed", "posted", "sent", "bytes_sent",
                 "received", "bytes_received", "local_ops")

    def __init__(self, indegree: list[int], first: list[int]) -> None:
        self.remaining = list(indegree)
        self.ready: deque[int] = deque(first)
        self.completed = 0
        self.posted: dict[int, Any] = {}  # op index -> outstanding request
        self.sent = self.bytes_sent = self.received = self.bytes_received = 0
        self.local_ops = 0


DONE, LATE, EXPIRED = "done", "late", "expired"


def execute(state: InlineState, ops: tuple[Any, ...], succ: tuple[tuple[int, ...], ...],
            arrays: dict[str, np.ndarray], dtype: DType, transport: Transport,
            channel: str, seq: int, deadline: float, patience: float) -> str:
    """Advance ``state`` until the schedule is done (DONE), ``deadline``
    (monotonic) passes (EXPIRED), or ``patience`` seconds go by without any
    completion (LATE). Exceptions propagate with ``state`` current."""
    remaining, ready, posted = state.remaining, state.ready, state.posted
    test_some = transport.test_some
    itemsize = dtype.itemsize
    requests = list(posted.values())
    owners = list(posted)
    total = len(ops)

    def release(i: int) -> None:  # op i is done: its successors may be ready
        state.completed += 1
        for s in succ[i]:
            remaining[s] -= 1
            if remaining[s] == 0:
                ready.append(s)

    while True:
        while ready:
            i = ready.popleft()
            op = ops[i]
            req = post(op, arrays, dtype, transport, channel, seq)
            if req is None:
                run_local(op, arrays, dtype)
                state.local_ops += 1
                release(i)
                continue
            if type(op) is Send:
                state.sent += 1
                state.bytes_sent += op.src.count * itemsize
            posted[i] = req
            requests.append(req)
            owners.append(i)
        if state.completed == total:
            return DONE
        give_up = time.monotonic() + patience
        polls = 0
        while True:
            done = test_some(requests)
            if done:
                break
            polls += 1
            if polls % _CLOCK_EVERY == 0:
                now = time.monotonic()
                if now > deadline:
                    return EXPIRED
                if now > give_up:
                    return LATE
            os.sched_yield()  # the CPU we do not burn is what a late peer needs
        finished = set(done)
        for k in sorted(done):
            i = owners[k]
            del posted[i]
            op = ops[i]
            if type(op) is Recv:
                state.received += 1
                state.bytes_received += op.dst.count * itemsize
            release(i)
        keep = [k for k in range(len(requests)) if k not in finished]
        requests = [requests[k] for k in keep]
        owners = [owners[k] for k in keep]


__all__ = ["InlineState", "execute", "run_local", "post", "view",
           "DONE", "LATE", "EXPIRED"]
