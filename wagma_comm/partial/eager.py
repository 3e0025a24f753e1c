"""eager-SGD's solo and majority allreduces of gradients (ALGORITHMS.md s. 4).

Every ``step(g)`` adds ``g`` to this rank's accumulator. A round takes the whole
accumulator as this rank's contribution (and empties it), so what missed a
round -- because the round was activated before this rank arrived -- goes into
the next round it takes part in: nothing is lost or counted twice. The
released code zeroed a missed contribution; wagma_comm carries it.

Every rank gets *the result of its own round* (round ``t`` for step ``t``),
computed with or without its fresh gradient: all ranks then apply the same
sequence of results, so replicas that start equal stay equal. Results of rounds
that completed before the caller arrived are kept until it asks (at most
``sync_every`` of them, since the synchronous round bounds how far others run
ahead).

* solo: the first rank to arrive activates the round;
* majority: rank ``majority_activator(seed, first_round + t, P)`` activates round ``t``; ranks
  arriving before it wait for it, so in expectation half contribute fresh data.

``op``: "sum" or "avg" (the sum divided by P); other reductions do not compose
with carrying a missed contribution into a later round.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..runtime import activation
from .base import PartialCollective, Result, _Call

EAGER_OPS = ("sum", "avg")


class SoloAllreduce(PartialCollective):
    """Created by :meth:`Communicator.solo_allreduce`."""

    kind = "solo_allreduce"

    def __init__(self, comm: Any, buf: Any, sync_every: int, *, op: str = "avg",
                 timeout: float | None = None, algorithm: str | None = None,
                 first_round: int = 0) -> None:
        if op not in EAGER_OPS:
            raise InvalidArgumentError("op", f"expected one of {list(EAGER_OPS)}, got {op!r}")
        super().__init__(comm, buf, sync_every, timeout, algorithm, first_round)
        self.op = op
        self._acc = self._mem.zeros(self.count)
        self._acc_iterations: list[int] = []
        self._results: dict[int, Result] = {}

    def creation_options(self) -> dict[str, Any]:
        """What every rank must have created this with (base.agree)."""
        return {"sync_every": self.sync_every, "first_round": self.first_round,
                "op": self.op, "algorithm": self._algorithm}

    def _contribute(self, data: np.ndarray, t: int) -> None:
        if self._acc_iterations:
            self._mem.add(self._acc, data)
        else:
            self._mem.copy(self._acc, data)
        self._acc_iterations.append(t)

    def _snapshot(self, dst: np.ndarray, r: int) -> bool:
        if self._acc_iterations:
            self._mem.copy(dst, self._acc)
        else:
            self._mem.zero(dst)
        fresh = r in self._acc_iterations
        self._acc_iterations.clear()
        return fresh

    def _flush_snapshot(self, dst: np.ndarray, call: _Call) -> None:
        self._snapshot(dst, -1)

    def _late_result(self, t: int) -> Result:
        res = self._results.pop(t)
        res.readers += 1
        res.retired = True
        return res

    def _store(self, res: Result, wanted: bool) -> None:
        if wanted:
            res.retired = True  # delivered now, recycled after
        else:
            self._results[res.round] = res

    def _finalize(self, call: _Call, res: Result) -> None:
        out = call.data
        assert out is not None
        total = res.array[:self.count]
        if self.op == "avg":
            self._mem.average(out, [total], self.size)
        else:
            self._mem.copy(out, total)

    def _leftover(self) -> str:
        parts = []
        if self._acc_iterations:
            parts.append(f"the inputs of steps {self._acc_iterations} not yet in any round")
        if self._results:
            parts.append(f"results of rounds {sorted(self._results)} never collected by step()")
        return " and ".join(parts)

    def _extra_statistics(self) -> dict[str, Any]:
        with self._lock:
            return {"op": self.op, "pending_steps": list(self._acc_iterations),
                    "uncollected_rounds": sorted(self._results)}


class MajorityAllreduce(SoloAllreduce):
    """Created by :meth:`Communicator.majority_allreduce`."""

    kind = "majority_allreduce"

    def __init__(self, comm: Any, buf: Any, sync_every: int, *, seed: int = 0,
                 op: str = "avg", timeout: float | None = None,
                 algorithm: str | None = None, first_round: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidArgumentError("seed", f"expected an int, got {seed!r}")
        super().__init__(comm, buf, sync_every, op=op, timeout=timeout, algorithm=algorithm,
                         first_round=first_round)
        self.seed = seed
        self._ahead: set[int] = set()  # progress thread: activated rounds not yet started

    def creation_options(self) -> dict[str, Any]:
        return {**super().creation_options(), "seed": self.seed}

    def activator(self, round: int) -> int:
        """The rank that activates ``round`` (the same on every rank): round
        first_round + ``round``'s draw."""
        return activation.majority_activator(self.seed, self.first_round + round, self.size)

    def _activates(self, t: int) -> bool:
        return self.activator(t) == self.rank

    def _waiting_for(self, t: int) -> list[int]:
        """The activators of the rounds up to ``t`` not yet activated: round
        ``t`` waits for each of them (rounds run in order)."""
        return sorted({self.activator(q) for q in range(self._started + 1, t + 1)
                       if not self._synchronous(q) and not self._is_activated(q)}
                      ) or [self.activator(t)]

    def _is_activated(self, r: int) -> bool:
        return r <= self._started or r in self._ahead

    def _mark_activated(self, r: int) -> None:
        """Only round ``r``: an earlier round starts when its own activator
        arrives (ALGORITHMS.md s. 4), so a later round may wait for it."""
        self._ahead.add(r)
        self._ahead.difference_update([q for q in self._ahead if q <= self._started])

    def _round_activator(self, r: int, first_root: int) -> int:
        return self.activator(r)
