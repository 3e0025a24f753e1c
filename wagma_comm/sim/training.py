"""Simulated training iterations: every method of the training issue, on the
timed collectives of :mod:`.collectives`, under an injector of
:mod:`wagma_comm.imbalance`.

Each rank loops "compute (``compute_s`` + the injector's delay), then the
method's communication", exactly as ``wagma imbalance`` measures it; all ranks
start at 0 and the run lasts until the slowest rank finishes its last step.

Blocking methods: the collective starts on each rank when it arrives (plus
the call overhead) and the iteration ends when its schedule ends there.

Partial collectives (WAGMA, solo, majority) follow ``partial/base.py``:

* a round is activated by the first arrival (the agreed activator for
  majority); tokens reach the others along the activation tree, and every
  rank's progress thread starts the round at ``max(activation, its previous
  round's end)`` with whatever its application last published;
* a rank whose application arrives after its round started contributes a
  stale model and, if the round has also ended, does not wait at all;
* every ``sync_every``-th round is synchronous: it starts on each rank when
  its application arrives and runs the all-to-all arrival check beside the
  data (as ``partial/base.py`` does); it ends when both have.

Staleness is what the runtime reports to ``step()``: 0 when the rank's current
contribution made its round; else, for solo and majority, the number of rounds
at or after this one that had started on the rank when its application arrived;
for WAGMA (``partial/wagma.py``: a late step gets the newest completed round,
``round - iteration + 1``) the number of those that had completed, or 1 when its
own round was still running. Before session 47 WAGMA's counted started rounds
too, one more than the runtime whenever a later round was running.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .. import groups
from ..errors import InvalidArgumentError
from ..imbalance import make_injector
from ..runtime import activation
from ..schedule.algorithms import ALLREDUCE_ALGORITHMS
from .collectives import Collectives, token_arrivals
from .cost import TOKEN_BYTES, CostModel

BLOCKING = ("allreduce", "group_allreduce", "local_sgd", "dpsgd")
PARTIAL = ("wagma", "wagma_group_scope", "solo", "majority")
METHODS: tuple[str, ...] = ("allreduce", "group_allreduce", "wagma", "wagma_group_scope",
                            "solo", "majority", "dpsgd", "local_sgd")


@dataclass(frozen=True)
class Workload:
    """What one simulated run trains: ``size`` ranks, a model of ``elements``
    elements of ``itemsize`` bytes, ``compute_s`` per step plus the injector's
    delay (``imbalance``: a :func:`~wagma_comm.imbalance.make_injector` spec),
    ``steps`` iterations. ``first_round``: the partial collectives' round
    number of step 0 (their ``first_round``): their sync rounds, group steps
    and majority activators follow ``first_round + t``, the injector and the
    blocking methods ``t``. ``wagma imbalance`` keeps one collective across its
    warm-up and timed runs, so its k-th timed run starts at round k * steps."""

    size: int
    elements: int
    compute_s: float
    imbalance: str = "none"
    steps: int = 100
    group_size: int = 0  # 0: half the ranks, as ``wagma imbalance``
    sync_every: int = 10
    itemsize: int = 4
    seed: int = 0
    algorithm: str | None = None
    first_round: int = 0

    def __post_init__(self) -> None:
        for name, minimum in (("size", 1), ("elements", 0), ("steps", 1), ("sync_every", 1),
                              ("itemsize", 1), ("seed", 0), ("group_size", 0),
                              ("first_round", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise InvalidArgumentError(name, f"expected an int >= {minimum}, got {value!r}")
        c = self.compute_s
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) \
                or c < 0:
            raise InvalidArgumentError("compute_s", f"expected finite seconds >= 0, got {c!r}")
        if self.algorithm is not None and self.algorithm not in ALLREDUCE_ALGORITHMS:
            raise InvalidArgumentError("algorithm", f"unknown algorithm {self.algorithm!r}; "
                                       f"expected one of {list(ALLREDUCE_ALGORITHMS)}")
        groups.check_group_size(self.size, self.group)
        make_injector(self.imbalance, self.size, self.seed)  # reject a bad spec now

    @property
    def group(self) -> int:
        return self.group_size or max(1, self.size // 2)


@dataclass
class SimResult:
    method: str
    iterations_per_s: float
    makespan_s: float
    wait_per_iteration_s: list[float]  # per rank: mean time inside the collective call
    messages_per_iteration: float  # per rank, mean over ranks (tokens included)
    bytes_per_iteration: float
    fresh_share: float | None  # partial collectives: share of current contributions
    staleness_histogram: dict[int, int] = field(default_factory=dict)
    simulated_in_s: float = 0.0

    @property
    def mean_wait_s(self) -> float:
        return float(np.mean(self.wait_per_iteration_s))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mean_wait_s"] = self.mean_wait_s
        return out


def simulate(method: str, workload: Workload, cost: CostModel,
             collectives: Collectives | None = None) -> SimResult:
    """Simulate ``workload.steps`` iterations of ``method``."""
    if method not in METHODS:
        raise InvalidArgumentError("method", f"unknown method {method!r}; expected one of "
                                   f"{list(METHODS)}")
    w = workload
    lib = collectives or Collectives(w.size, cost, w.itemsize, w.algorithm)
    if (lib.size, lib.cost, lib.itemsize, lib.algorithm) != (w.size, cost, w.itemsize,
                                                             w.algorithm):
        raise InvalidArgumentError("collectives", "built for another job or cost model")
    if method in PARTIAL and w.algorithm == "native":
        raise InvalidArgumentError("algorithm", "partial collectives never run native rounds "
                                   "(their results must be bitwise identical on every member)")
    t0 = time.perf_counter()
    run = _Run(method, w, lib)
    for t in range(w.steps):
        run.step(t)
    return run.result(time.perf_counter() - t0)


class _Run:
    def __init__(self, method: str, w: Workload, lib: Collectives) -> None:
        self.method, self.w, self.lib = method, w, lib
        self.c = lib.cost.call_overhead_s
        self.injector = make_injector(w.imbalance, w.size, w.seed)
        P = w.size
        self.end = np.zeros(P)
        self.busy_until = np.zeros(P)  # progress thread: end of its last round
        self.waited = np.zeros(P)
        self.messages = np.zeros(P)
        self.sent = np.zeros(P)
        # partial collectives only: when step() had contributed, when rounds started
        self.arrivals = np.zeros((w.steps, P))
        self.starts = np.zeros((w.steps, P))
        self.ends = np.zeros((w.steps, P))
        self.fresh = 0
        self.contributions = 0

    def _count(self, timed: Any) -> None:
        """Add one execution's messages and bytes (per member) to the totals."""
        self.messages[timed.members] += timed.traffic.messages
        self.sent[timed.members] += timed.traffic.bytes

    def _blocking(self, dag: Any, a: np.ndarray) -> np.ndarray:
        e = dag.evaluate(a[dag.members] + self.c)
        out = np.empty_like(a)
        out[dag.members] = e
        self._count(dag)
        return out

    def step(self, t: int) -> None:
        w, lib = self.w, self.lib
        a = self.end + w.compute_s + self.injector.delays(t)
        sync = activation.is_sync_round(t, w.sync_every)
        m = self.method
        if m == "allreduce" or (sync and m in ("group_allreduce", "local_sgd")):
            e = self._blocking(lib.allreduce(w.elements), a)
        elif m == "local_sgd":
            e = a
        elif m == "group_allreduce":
            e = self._blocking(lib.partition(w.group, activation.group_step(t, w.sync_every),
                                             w.elements), a)
        elif m == "dpsgd":
            e = self._blocking(lib.neighbours(w.elements), a)
        else:
            e = self._partial(t, a)
        self.waited += e - a
        self.end = e

    def _partial(self, t: int, a: np.ndarray) -> np.ndarray:
        """One round of a persistent partial collective. Besides its schedule a
        round costs what ``partial/`` does on the host: step() copies the
        contribution in (before it activates), the progress thread copies the
        published model into the round buffer, and the result is averaged into
        the caller's buffer before step() returns."""
        w, lib, cost = self.w, self.lib, self.lib.cost
        nbytes = w.elements * w.itemsize
        copy = cost.op_overhead_s + nbytes * cost.copy_s_per_byte
        finish = cost.op_overhead_s + nbytes * cost.reduce_s_per_byte
        a = a + copy  # _contribute
        r = w.first_round + t  # the collective's own round number
        if activation.is_sync_round(r, w.sync_every):
            # partial/base.py starts the arrival check beside the data exchange
            # (not before it: docs/partial.md); the model gives the two no shared
            # port, so the round ends when both have.
            s = np.maximum(a, self.busy_until)
            begin = s + self.c + copy
            e = np.maximum(lib.global_round(w.elements).evaluate(begin),
                           lib.arrival_check().evaluate(begin))
            self._count(lib.arrival_check())
            self._count(lib.global_round(w.elements))
            fresh = np.ones(w.size, dtype=bool)
        else:
            act = self._activation(t, a)
            s = np.maximum(act, self.busy_until)
            if self.method in ("wagma", "wagma_group_scope"):
                dag = lib.partition(w.group, activation.group_step(r, w.sync_every),
                                    w.elements, "sum", flags=True)
            else:
                dag = lib.global_round(w.elements)
            e = np.empty(w.size)
            e[dag.members] = dag.evaluate(s[dag.members] + self.c + copy)
            self._count(dag)
            fresh = a <= s
        self.starts[t] = s
        self.ends[t] = e
        self.arrivals[t] = a
        self.busy_until = e
        self.fresh += int(fresh.sum())
        self.contributions += w.size
        return np.maximum(a, e) + finish

    def _activation(self, t: int, a: np.ndarray) -> np.ndarray:
        """When each rank's progress thread learns that round ``t`` is on."""
        w, cost = self.w, self.lib.cost
        r = w.first_round + t
        if self.method == "wagma_group_scope":
            scopes = [np.asarray(g) for g in groups.partition(
                w.size, w.group, activation.group_step(r, w.sync_every))]
        else:
            scopes = [np.arange(w.size)]
        act = np.empty(w.size)
        for members in scopes:
            if self.method == "majority":
                root = int(activation.majority_activator(w.seed, r, w.size))
                tok, sent = token_arrivals(members, root, a[root], cost)
                tok[root] = a[root]  # only the activator's own arrival activates
            else:
                root = int(np.argmin(a[members]))
                flat = (self.method == "wagma_group_scope"
                        and len(members) <= activation.FLAT_MAX)
                tok, sent = token_arrivals(members, root, a[members][root], cost, flat)
                tok = np.minimum(tok, a[members])  # an arrival activates its own rank
            act[members] = tok
            self.messages[members] += sent
            self.sent[members] += sent * TOKEN_BYTES
        return act

    def result(self, elapsed: float) -> SimResult:
        w = self.w
        makespan = float(self.end.max())
        hist: dict[int, int] = {}
        fresh_share = None
        if self.method in PARTIAL:
            fresh_share = self.fresh / self.contributions if self.contributions else None
            for i in range(w.size):
                steps = np.arange(w.steps)
                started = np.searchsorted(self.starts[:, i], self.arrivals[:, i], side="left")
                stale = np.maximum(0, started - steps)
                if self.method in ("wagma", "wagma_group_scope"):
                    # the newest round completed here when it arrived (rounds run
                    # in order, so ends are sorted), or its own if none had
                    done = np.searchsorted(self.ends[:, i], self.arrivals[:, i], side="left")
                    stale = np.where(stale > 0, np.maximum(1, done - steps), 0)
                for k, v in zip(*np.unique(stale, return_counts=True)):
                    hist[int(k)] = hist.get(int(k), 0) + int(v)
        return SimResult(
            method=self.method,
            iterations_per_s=w.steps / makespan if makespan > 0 else float("inf"),
            makespan_s=makespan,
            wait_per_iteration_s=(self.waited / w.steps).tolist(),
            messages_per_iteration=float(self.messages.mean() / w.steps),
            bytes_per_iteration=float(self.sent.mean() / w.steps),
            fresh_share=fresh_share,
            staleness_histogram=dict(sorted(hist.items())),
            simulated_in_s=elapsed)

