"""Time compiled schedules: all members' ops as one DAG, evaluated by levels.

Every op of every member becomes a node; an edge says "may not start before".
A node ends at ``max(pred end + edge weight) + duration``:

* deps inside a schedule are edges of weight 0;
* a Recv waits for its matching Send (same sender, receiver and message
  number) with weight = latency; the Send's duration is the time it holds the
  sender's port (``o + bytes / bandwidth``), and a rank's sends leave one after
  another in schedule order (an edge from the previous Send);
* an op without deps waits for the member's start time;
* a Native op (one transport call over several ranks) is a hub that starts
  when every member reached it and costs the ring formula of :func:`native_cost`.

Everything is max-plus, so a DAG is levelled once and then evaluated for any
start times with one vectorised gather/max per level (milliseconds for a
4,096-rank allreduce). Nothing here re-implements an algorithm: the ops are
the compiler's own.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import InvalidArgumentError
from ..schedule.ir import Copy, Native, Recv, Reduce, Scale, Schedule, Send
from .cost import CostModel


@dataclass(frozen=True)
class Traffic:
    """Messages and bytes each member sends in one execution."""

    messages: np.ndarray  # per member position
    bytes: np.ndarray


def native_cost(kind: str, nbytes: int, ranks: Sequence[int], cost: CostModel) -> float:
    """A native collective as NCCL/MPI run it for large buffers: ring allreduce
    (2(n-1) steps, 2(n-1)/n of the buffer over the slowest link, (n-1)/n of it
    reduced) or a pipelined broadcast (ceil(log2 n) latencies + one buffer)."""
    n = len(ranks)
    if n <= 1:
        return 0.0
    arr = np.asarray(ranks)
    spans = not bool(np.all(cost.same_node(arr, arr[0])))
    lat = cost.latency_inter_s if spans else cost.latency_intra_s
    bw = cost.bandwidth_inter if spans else cost.bandwidth_intra
    step = lat + cost.op_overhead_s
    if kind == "broadcast":
        return (n - 1).bit_length() * step + nbytes / bw
    frac = (n - 1) / n
    return 2 * (n - 1) * step + 2 * frac * nbytes / bw + frac * nbytes * cost.reduce_s_per_byte


def _native_traffic(kind: str, nbytes: int, n: int) -> tuple[int, float]:
    if n <= 1:
        return 0, 0.0
    if kind == "broadcast":
        return 1, float(nbytes)
    return 2 * (n - 1), 2 * (n - 1) / n * nbytes


class TimedDag:
    """The schedules of one collective execution (one group, or several disjoint
    groups run at once) as a levelled DAG. ``members`` are the global ranks in
    the order of ``schedules``; :meth:`evaluate` maps their start times to
    their end times."""

    def __init__(self, schedules: Sequence[Schedule], cost: CostModel, itemsize: int) -> None:
        if itemsize < 1:
            raise InvalidArgumentError("itemsize", f"expected >= 1 byte, got {itemsize}")
        self.members = np.array([s.rank for s in schedules], dtype=np.int64)
        self.ops = sum(len(s.ops) for s in schedules)
        n = len(schedules)
        pos_of = {int(r): p for p, r in enumerate(self.members)}
        if len(pos_of) != n:
            raise InvalidArgumentError("schedules", "two schedules belong to the same rank")
        o = cost.op_overhead_s
        dur: list[float] = [0.0] * n  # nodes 0..n-1: the members' start times
        src: list[int] = []
        dst: list[int] = []
        weight: list[float] = []
        sends: dict[tuple[int, int, int], int] = {}
        recvs: list[tuple[int, int, int, int]] = []  # (node, sender, receiver, msg)
        hubs: dict[tuple[object, ...], int] = {}
        messages = np.zeros(n, dtype=np.int64)
        sent = np.zeros(n, dtype=np.float64)

        def node(duration: float) -> int:
            dur.append(duration)
            return len(dur) - 1

        def edge(a: int, b: int, w: float = 0.0) -> None:
            src.append(a)
            dst.append(b)
            weight.append(w)

        sinks = []
        for p, sched in enumerate(schedules):
            r = sched.rank
            ids: list[int] = []
            last_send = -1
            native_seen: dict[tuple[object, ...], int] = defaultdict(int)
            for i, op in enumerate(sched.ops):
                preds = [ids[d] for d in sched.deps[i]] or [p]
                if isinstance(op, Native):
                    nbytes = op.buf.count * itemsize
                    key0 = (op.kind, op.ranks, op.root, op.op)
                    key = key0 + (native_seen[key0],)
                    native_seen[key0] += 1
                    if key not in hubs:
                        hubs[key] = node(native_cost(op.kind, nbytes, op.ranks, cost))
                    ready = node(0.0)
                    for q in preds:
                        edge(q, ready)
                    edge(ready, hubs[key])
                    ids.append(hubs[key])
                    m, b = _native_traffic(op.kind, nbytes, len(op.ranks))
                    messages[p] += m
                    sent[p] += b
                    continue
                if isinstance(op, Send):
                    nbytes = op.src.count * itemsize
                    v = node(o + nbytes / cost.bandwidth(r, op.peer))
                    if last_send >= 0:
                        preds = preds + [last_send]
                    last_send = v
                    sends[(r, op.peer, op.msg)] = v
                    messages[p] += 1
                    sent[p] += nbytes
                elif isinstance(op, Recv):
                    v = node(o)
                    recvs.append((v, op.peer, r, op.msg))
                elif isinstance(op, (Reduce, Scale)):
                    v = node(o + op.dst.count * itemsize * cost.reduce_s_per_byte)
                elif isinstance(op, Copy):
                    v = node(o + op.dst.count * itemsize * cost.copy_s_per_byte)
                else:  # pragma: no cover - the IR has no other op
                    raise InvalidArgumentError("schedules", f"unknown op {op!r}")
                for q in preds:
                    edge(q, v)
                ids.append(v)
            sink = node(0.0)
            for v in set(ids) or {p}:
                edge(v, sink)
            sinks.append(sink)
        for v, sender, receiver, msg in recvs:
            s = sends.get((sender, receiver, msg))
            if s is None:
                raise InvalidArgumentError(
                    "schedules", f"rank {receiver} receives message {msg} from rank {sender}, "
                    "which is not among the schedules or never sends it")
            edge(s, v, cost.latency(sender, receiver))
        self.traffic = Traffic(messages, sent)
        self._sinks = np.array(sinks, dtype=np.int64)
        self._level(n, np.array(dur), np.array(src, dtype=np.int64),
                    np.array(dst, dtype=np.int64), np.array(weight))

    def _level(self, n: int, dur: np.ndarray, src: np.ndarray, dst: np.ndarray,
               weight: np.ndarray) -> None:
        """Longest-path levels (Kahn's algorithm), then the edges grouped by the
        level of their target and by target, for reduceat."""
        count = len(dur)
        indeg = np.bincount(dst, minlength=count)
        order = np.argsort(src, kind="stable")
        out_start = np.searchsorted(src[order], np.arange(count + 1))
        out_dst = dst[order]
        level = np.zeros(count, dtype=np.int64)
        frontier = np.flatnonzero(indeg == 0)
        remaining = indeg.copy()
        seen = len(frontier)
        depth = 0
        while len(frontier):
            lo, hi = out_start[frontier], out_start[frontier + 1]
            lengths = hi - lo
            total = int(lengths.sum())
            if total == 0:
                break
            # the out-edges of the whole frontier at once (concatenated ranges)
            idx = np.repeat(lo - np.cumsum(lengths) + lengths, lengths) + np.arange(total)
            targets = out_dst[idx]
            remaining -= np.bincount(targets, minlength=count)
            cand = np.unique(targets)
            frontier = cand[remaining[cand] == 0]
            depth += 1
            level[frontier] = depth
            seen += len(frontier)
        if seen != count:
            raise InvalidArgumentError("schedules", "the schedules deadlock: a receive waits "
                                       "for a send that waits for it (cyclic DAG)")
        if np.any(level[:n] != 0):  # pragma: no cover - start nodes have no preds
            raise AssertionError("a start node has predecessors")
        by_edge = np.lexsort((dst, level[dst]))
        self._src, self._w = src[by_edge], weight[by_edge]
        edge_dst = dst[by_edge]
        self._dur = dur
        self._levels = []
        bounds = np.searchsorted(level[edge_dst], np.arange(1, depth + 2))
        for k in range(depth):
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            if lo == hi:
                continue
            targets = edge_dst[lo:hi]
            first = np.flatnonzero(np.r_[True, targets[1:] != targets[:-1]])
            self._levels.append((lo, hi, targets[first], first))
        self.depth = len(self._levels)

    def evaluate(self, starts: np.ndarray) -> np.ndarray:
        """End times of the members for start times ``starts`` (one per member,
        or shape (members, k) to evaluate k scenarios at once)."""
        starts = np.asarray(starts, dtype=np.float64)
        if starts.shape[0] != len(self.members):
            raise InvalidArgumentError("starts", f"expected {len(self.members)} start times, "
                                       f"got {starts.shape[0]}")
        end = np.empty((len(self._dur),) + starts.shape[1:])
        end[:len(self.members)] = starts
        extra = (slice(None),) + (None,) * (starts.ndim - 1)
        for lo, hi, targets, first in self._levels:
            vals = end[self._src[lo:hi]] + self._w[lo:hi][extra]
            end[targets] = np.maximum.reduceat(vals, first, axis=0) + self._dur[targets][extra]
        return end[self._sinks]

    def cost_of(self, starts: np.ndarray | None = None) -> float:
        """The time from the earliest start to the latest end."""
        s = np.zeros(len(self.members)) if starts is None else np.asarray(starts, float)
        return float(self.evaluate(s).max() - s.min())
