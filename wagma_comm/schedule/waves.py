"""Stream-ordered lowering of a schedule: waves, and a proof that they cannot
deadlock under NCCL's semantics.

An MPI executor posts each op when its dependencies complete. A stream-ordered
transport (NCCL) instead enqueues the whole schedule at once, and the stream
runs one thing after another: a send or receive blocks the stream until the
peer has posted its match. So ops are grouped into *waves*: a wave's sends and
receives go in one ncclGroupStart/End (their order within it does not matter),
then its local ops (reduce, copy, scale) run, then the next wave.

Which wave an op joins cannot be decided from one rank's schedule alone (a
receive with no inputs would sit in wave 0 and block the stream until a peer's
late send): :func:`plan_waves` times every member's ops together, from all
members' schedules (the compiler is deterministic, so every rank computes the
same plan without talking).

NCCL matches point-to-point messages between two ranks by order, not by tag.
:func:`check_stream_order` simulates every rank's waves together and proves,
for a given set of schedules, that (a) every rank reaches its end (no cycle of
waves waiting on each other) and (b) the k-th send from a to b meets the k-th
receive on b from a with the same message number and size, so order matching
delivers exactly what the schedule's tags would.
"""

from __future__ import annotations

from typing import Mapping

from ..errors import ScheduleError
from .ir import Native, Recv, Schedule, Send


def plan_waves(schedules: Mapping[int, Schedule]) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Every member's waves for one collective, from all members' schedules.

    A send and its receive (same sender, receiver and message number), and the
    members' calls of one native collective, are one event: they get the same
    time, one more than the latest time of anything any of them depends on.
    A rank's wave k holds its ops of its k-th distinct time, so matching ops
    always sit in waves that are posted together: a wave never waits for a
    peer's later wave, and the plan cannot deadlock (check_stream_order
    proves it independently). Raises ScheduleError if the schedules' messages
    do not pair up or their dependencies form a cycle across ranks."""
    parent: dict[tuple[int, int], tuple[int, int]] = {}

    def find(x: tuple[int, int]) -> tuple[int, int]:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    def union(a: tuple[int, int], b: tuple[int, int]) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    sends: dict[tuple[int, int, int], tuple[int, int]] = {}
    recvs: dict[tuple[int, int, int], tuple[int, int]] = {}
    natives: dict[tuple, list[tuple[int, int]]] = {}
    for r, sched in schedules.items():
        count: dict[tuple[int, ...], int] = {}
        for i, op in enumerate(sched.ops):
            if isinstance(op, Send):
                sends[(r, op.peer, op.msg)] = (r, i)
            elif isinstance(op, Recv):
                recvs[(op.peer, r, op.msg)] = (r, i)
            elif isinstance(op, Native):
                k = count.get(op.ranks, 0)
                count[op.ranks] = k + 1
                natives.setdefault((op.ranks, k), []).append((r, i))
    if sends.keys() != recvs.keys():
        odd = sorted(sends.keys() ^ recvs.keys())[:4]
        raise ScheduleError(f"unmatched messages (sender, receiver, msg): {odd}")
    for key, node in sends.items():
        union(node, recvs[key])
    for members in natives.values():
        for node in members[1:]:
            union(members[0], node)

    # Longest path over the merged events (Kahn's algorithm).
    events: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r, sched in schedules.items():
        for i in range(len(sched.ops)):
            events.setdefault(find((r, i)), []).append((r, i))
    succ: dict[tuple[int, int], set[tuple[int, int]]] = {e: set() for e in events}
    indegree = {e: 0 for e in events}
    for r, sched in schedules.items():
        for i, deps in enumerate(sched.deps):
            for d in deps:
                a, b = find((r, d)), find((r, i))
                if b not in succ[a]:
                    succ[a].add(b)
                    indegree[b] += 1
    time = {e: 0 for e in events}
    ready = [e for e, n in indegree.items() if n == 0]
    seen = 0
    while ready:
        e = ready.pop()
        seen += 1
        for f in succ[e]:
            time[f] = max(time[f], time[e] + 1)
            indegree[f] -= 1
            if indegree[f] == 0:
                ready.append(f)
    if seen != len(events):
        raise ScheduleError("the schedules' messages wait on each other in a cycle")

    out: dict[int, tuple[tuple[int, ...], ...]] = {}
    for r, sched in schedules.items():
        by_time: dict[int, list[int]] = {}
        for i in range(len(sched.ops)):
            by_time.setdefault(time[find((r, i))], []).append(i)
        out[r] = tuple(tuple(sorted(by_time[t], key=lambda i: _order_key(sched.ops[i], i)))
                       for t in sorted(by_time))
    return out


def _order_key(op: object, index: int) -> tuple[int, int, int]:
    """Within a wave, messages to one peer go in message-number order on both
    sides, so NCCL's order matching pairs them as the tags would."""
    if isinstance(op, (Send, Recv)):
        return (0, op.peer, op.msg)
    return (1, index, 0)


def _pair_orders(sched: Schedule, order: tuple[tuple[int, ...], ...]):
    """(kind, peer, k) -> op index: the k-th send to / receive from ``peer`` in
    stream order, and ("native", group, k) -> op index."""
    counters: dict[tuple, int] = {}
    keys: dict[int, tuple] = {}
    for wave in order:
        for i in wave:
            op = sched.ops[i]
            if isinstance(op, Send):
                base = ("send", op.peer)
            elif isinstance(op, Recv):
                base = ("recv", op.peer)
            elif isinstance(op, Native):
                base = ("native", op.ranks)
            else:
                continue
            k = counters.get(base, 0)
            counters[base] = k + 1
            keys[i] = base + (k,)
    return keys


def check_stream_order(schedules: Mapping[int, Schedule],
                       order: Mapping[int, tuple[tuple[int, ...], ...]] | None = None) -> int:
    """Simulate the wave-by-wave execution of every rank's schedule (waves
    from :func:`plan_waves` unless ``order`` is given).

    Returns the number of simulation steps. Raises ScheduleError naming the
    ranks and waves on a deadlock, or the op on an order-matching mismatch.
    A p2p op completes once its partner's matching op is in the partner's
    current wave (both are posted); a native collective once every member has
    it in its current wave; local ops complete at once."""
    order = plan_waves(schedules) if order is None else order
    keys = {r: _pair_orders(s, order[r]) for r, s in schedules.items()}
    index = {r: {k: i for i, k in keys[r].items()} for r in schedules}
    current = {r: 0 for r in schedules}

    def partners(r: int, i: int) -> list[tuple[int, int]]:
        op, key = schedules[r].ops[i], keys[r][i]
        if isinstance(op, Native):
            return [(m, index[m].get(key, -1)) for m in op.ranks if m != r]
        other = ("recv" if key[0] == "send" else "send", r, key[2])
        j = index.get(op.peer, {}).get(other, -1)
        if j < 0:
            raise ScheduleError(f"rank {r} op {i} ({op}) has no matching op on rank {op.peer}")
        mine, theirs = op, schedules[op.peer].ops[j]
        if mine.msg != theirs.msg or _moved_count(mine) != _moved_count(theirs):
            raise ScheduleError(
                f"order matching pairs rank {r} op {i} ({mine}) with rank {op.peer} "
                f"op {j} ({theirs}): message number or size differ")
        return [(op.peer, j)]

    wave_of = {r: {i: w for w, ops in enumerate(order[r]) for i in ops} for r in schedules}
    done: dict[int, set[int]] = {r: set() for r in schedules}

    def posted(r: int, i: int) -> bool:
        return i >= 0 and wave_of[r][i] == current[r]

    steps = 0
    while True:
        active = [r for r in schedules if current[r] < len(order[r])]
        if not active:
            return steps
        # Match every posted op whose partners are all posted too: the pair
        # (or the native collective's members) completes together.
        for r in active:
            for i in order[r][current[r]]:
                if i in done[r] or i not in keys[r]:
                    continue
                group = partners(r, i)
                if all(posted(peer, j) for peer, j in group):
                    done[r].add(i)
                    for peer, j in group:
                        done[peer].add(j)
        advanced = [r for r in active
                    if all(i in done[r] or i not in keys[r] for i in order[r][current[r]])]
        if not advanced:
            stuck = {r: current[r] for r in active}
            raise ScheduleError(f"stream-ordered execution deadlocks: rank -> wave {stuck}")
        for r in advanced:
            current[r] += 1
        steps += 1


def _moved_count(op: Send | Recv) -> int:
    return op.src.count if isinstance(op, Send) else op.dst.count
