"""The timed collectives a simulated training iteration is made of.

:class:`Collectives` compiles (with the runtime's own compiler and its own
algorithm choice) and caches, for one job size and cost model:

* a blocking allreduce over any group, and a whole shifting-group partition
  (all groups of one step as one DAG, since they run side by side);
* the data stage of a partial-collective round (sum over ``count + members``
  elements: the data plus one freshness flag per member, as ``partial/`` sends);
* the all-to-all arrival check of a synchronous round, through
  :class:`AllToAllTiming` (a closed form of the very same schedule: at 4,096
  ranks it has 33 million ops; tests check it against :class:`TimedDag`);
* D-PSGD's ring-neighbour averaging.

:func:`token_arrivals` times the activation tokens of a wait-avoiding round
along the binomial tree of ``runtime/activation.py``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .. import groups
from ..errors import InvalidArgumentError
from ..runtime import activation
from ..schedule import algorithms
from .cost import TOKEN_BYTES, CostModel
from .dag import TimedDag, Traffic

MAX_SIMULATED_OPS = 20_000_000
"""Beyond this many ops in one collective the op-level DAG would not fit in a
minute or in memory (e.g. a ring allreduce over thousands of ranks)."""


class AllToAllTiming:
    """``algorithms.compile_exchange`` over every rank, timed in closed form.

    That schedule has no deps: each rank's sends leave in position order, each
    holding the port for ``o + bytes / bandwidth``, and each receive completes
    ``o`` after its message landed (or after the start, if later). Computed in
    blocks of senders so 4,096 ranks need no 4,096^2 temporaries at once."""

    def __init__(self, members: tuple[int, ...], count: int, cost: CostModel,
                 itemsize: int) -> None:
        self.members = np.asarray(members, dtype=np.int64)
        self.cost = cost
        self.nbytes = count * itemsize
        n = len(members)
        self.traffic = Traffic(np.full(n, n - 1, dtype=np.int64),
                               np.full(n, float((n - 1) * self.nbytes)))
        self.ops = 2 * n * (n - 1)

    def _link(self, senders: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(port time, latency) of every message from ``senders`` to every member."""
        c = self.cost
        same = c.same_node(self.members[senders][:, None], self.members[None, :])
        port = c.op_overhead_s + self.nbytes / np.where(same, c.bandwidth_intra,
                                                        c.bandwidth_inter)
        lat = np.where(same, c.latency_intra_s, c.latency_inter_s)
        return port, lat

    def evaluate(self, starts: np.ndarray) -> np.ndarray:
        s = np.asarray(starts, dtype=np.float64)
        n = len(s)
        o = self.cost.op_overhead_s
        landed = np.full(n, -np.inf)
        last_send = s.copy()
        block = max(1, 2_000_000 // max(n, 1))
        for lo in range(0, n, block):
            senders = np.arange(lo, min(n, lo + block))
            port, lat = self._link(senders)
            port[np.arange(len(senders)), senders] = 0.0  # no message to itself
            done = s[senders, None] + np.cumsum(port, axis=1)
            arrive = done + lat
            arrive[np.arange(len(senders)), senders] = -np.inf
            np.maximum(landed, arrive.max(axis=0), out=landed)
            last_send[senders] = done[:, -1]
        received = np.where(n > 1, np.maximum(landed, s) + o, s)
        return np.maximum(received, last_send)


def token_arrivals(members: np.ndarray, root: int, t0: float, cost: CostModel,
                   flat: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """When the activation started by member position ``root`` at ``t0`` reaches
    each member, and how many tokens each member sends.

    ``flat``: the per-group flat broadcast (``activation.flat_targets``): the
    root's k-th token, to member ``root + k``, leaves ``k`` port times after
    ``t0``.

    The tree of ``activation.forward``: the activator sends along dimensions
    0, 1, 2, ... in turn; a member reached along dimension d forwards along
    d+1, d+2, .... Member ``root + g`` is reached along the set bits of ``g``
    from low to high; a sender's k-th token leaves ``k`` port times after it was
    reached. Tokens that wrap around (non-power-of-two groups) reach members
    already reached and are left out."""
    n = len(members)
    arrival = np.full(n, np.inf)
    sent = np.zeros(n, dtype=np.int64)
    c = cost
    if flat:
        order = (root + np.arange(n)) % n
        a = np.full(n - 1, members[root])
        b = members[order[1:]]
        same = c.same_node(a, b)
        port = c.op_overhead_s + TOKEN_BYTES / np.where(same, c.bandwidth_intra,
                                                        c.bandwidth_inter)
        lat = np.where(same, c.latency_intra_s, c.latency_inter_s)
        arrival[order[0]] = t0
        arrival[order[1:]] = t0 + np.cumsum(port) + lat + c.op_overhead_s
        sent[root] = n - 1
        return arrival, sent
    offsets_time = np.full(n, np.inf)
    offsets_time[0] = t0
    dims = activation.dimensions(n)
    ranks_by_offset = members[(root + np.arange(n)) % n]
    for d in range(dims):
        g = np.arange(min(1 << d, n))
        h = g + (1 << d)
        ok = h < n
        g, h = g[ok], h[ok]
        if not len(g):
            break
        high = np.where(g > 0, np.floor(np.log2(np.maximum(g, 1))).astype(np.int64), -1)
        k = d - high  # this is the sender's k-th token (1-based)
        a, b = ranks_by_offset[g], ranks_by_offset[h]
        same = c.same_node(a, b)
        port = c.op_overhead_s + TOKEN_BYTES / np.where(same, c.bandwidth_intra,
                                                        c.bandwidth_inter)
        lat = np.where(same, c.latency_intra_s, c.latency_inter_s)
        offsets_time[h] = offsets_time[g] + k * port + lat + c.op_overhead_s
        np.add.at(sent, (root + g) % n, 1)
    arrival[(root + np.arange(n)) % n] = offsets_time
    return arrival, sent


class Collectives:
    """Timed collectives of one job (``size`` ranks, ``cost``, element size),
    compiled on first use and cached."""

    def __init__(self, size: int, cost: CostModel, itemsize: int = 4,
                 algorithm: str | None = None) -> None:
        self.size, self.cost, self.itemsize, self.algorithm = size, cost, itemsize, algorithm
        self.everyone = tuple(range(size))
        # Per-instance caches (a class-level lru_cache would keep every instance's
        # DAGs alive for the life of the process).
        self.allreduce = lru_cache(maxsize=64)(self._allreduce)  # type: ignore[method-assign]
        self._partition = lru_cache(maxsize=64)(self._partition_of)  # type: ignore[method-assign]
        self.global_round = lru_cache(maxsize=8)(self._global_round)  # type: ignore[method-assign]
        self.arrival_check = lru_cache(maxsize=1)(self._arrival_check)  # type: ignore[method-assign]
        self.neighbours = lru_cache(maxsize=8)(self._neighbours)  # type: ignore[method-assign]

    def _name(self, count: int, n: int) -> str:
        """The algorithm the runtime would pick (or the one forced)."""
        return self.algorithm or algorithms.choose_allreduce(count * self.itemsize, n)

    def _dag(self, group_list: list[tuple[int, ...]], count: int, op: str,
             flags: bool) -> TimedDag:
        schedules = []
        for g in group_list:
            n_el = count + (len(g) if flags else 0)
            name = self._name(n_el, len(g))
            _check_size(name, len(g))
            compile_one = algorithms.compile_allreduce.__wrapped__  # keep the LRU for the runtime
            schedules.extend(compile_one(r, g, n_el, op, name) for r in g)
        return TimedDag(schedules, self.cost, self.itemsize)

    def _allreduce(self, count: int, op: str = "avg") -> TimedDag:
        """A blocking allreduce over every rank (``comm.allreduce``)."""
        return self._dag([self.everyone], count, op, flags=False)

    def partition(self, group_size: int, step: int, count: int, op: str = "avg",
                  flags: bool = False) -> TimedDag:
        """Every group of shifting-group ``step``, side by side
        (``comm.group_allreduce``; ``flags=True``: a partial collective's round)."""
        k = groups.num_steps(self.size, group_size)
        return self._partition(group_size, step % max(k, 1), count, op, flags)

    def _partition_of(self, group_size: int, step: int, count: int, op: str,
                   flags: bool) -> TimedDag:
        parts = list(groups.partition(self.size, group_size, step))
        return self._dag(parts, count, op, flags)

    def _global_round(self, count: int) -> TimedDag:
        """The data stage of a partial collective's round over every rank."""
        return self._dag([self.everyone], count, "sum", flags=True)

    def _arrival_check(self) -> AllToAllTiming:
        """The all-to-all of two int64 per rank (the round count and which
        final call, ``partial/base.py``) beside every synchronous round's data."""
        return AllToAllTiming(self.everyone, 2, self.cost, 8)

    def _neighbours(self, count: int) -> TimedDag:
        """D-PSGD: every rank averages with its ring neighbours."""
        from ..train.methods.gossip import ring_neighbours

        compile_one = algorithms.compile_neighbor_average.__wrapped__
        schedules = [compile_one(r, self.everyone, count,
                                 tuple(ring_neighbours(r, self.size)))
                     for r in self.everyone]
        return TimedDag(schedules, self.cost, self.itemsize)


def _check_size(algorithm: str, n: int) -> None:
    estimate = {"ring": 6 * n * n, "rabenseifner": 80 * n, "recursive_doubling": 40 * n}
    if estimate.get(algorithm, 0) > MAX_SIMULATED_OPS:
        raise InvalidArgumentError(
            "algorithm", f"{algorithm} over {n} ranks has about {estimate[algorithm]:,} ops, "
            f"more than the simulator handles ({MAX_SIMULATED_OPS:,}); pick another "
            "algorithm or fewer ranks")
