"""``wagma plan``: recommend a group size and sync period for a job.

Every (group size S, sync period tau) candidate is simulated with WAGMA-SGD on
the job's size, model, compute time and imbalance, and scored on two axes:

* throughput: simulated iterations per second;
* mixing: iterations after a global sync until every rank's model depends on
  every other's, ``min(groups.mixing_steps(P, S), tau)`` (a sync mixes
  everything, and groups shift so K = log_S P group rounds mix fully).

Rule: among candidates within ``tolerance`` (default 5%) of the best
throughput, recommend the one that mixes fastest; ties go to the larger sync
period (fewer blocking rounds), then the smaller group. Throughput decides
first because the paper's convergence results hold for any fixed S and tau;
mixing breaks the tie because it is what convergence per iteration depends on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from .. import groups
from ..errors import InvalidArgumentError
from .collectives import Collectives
from .cost import CostModel
from .training import Workload, simulate


@dataclass(frozen=True)
class Candidate:
    group_size: int
    sync_every: int
    iterations_per_s: float
    mixing_iterations: float  # inf: never mixes (S == 1)
    mean_wait_s: float
    fresh_share: float | None


def default_group_sizes(size: int) -> list[int]:
    """Powers of two from 2 up to min(P, 64), plus P itself when small."""
    out = [s for s in (2, 4, 8, 16, 32, 64) if s <= size]
    if size <= 64 and size not in out and size > 1:
        out.append(size)
    return out or [1]


def mixing_iterations(size: int, group_size: int, sync_every: int) -> float:
    steps = groups.mixing_steps(size, group_size)
    return float(min(sync_every, steps if steps is not None else float("inf")))


def plan(base: Workload, cost: CostModel, group_sizes: Sequence[int] | None = None,
         sync_periods: Sequence[int] = (5, 10, 20, 40),
         tolerance: float = 0.05) -> tuple[list[Candidate], Candidate]:
    """All candidates (in sweep order) and the recommended one."""
    if not 0 <= tolerance < 1:
        raise InvalidArgumentError("tolerance", f"expected a fraction in [0, 1), got {tolerance}")
    sizes = list(group_sizes) if group_sizes else default_group_sizes(base.size)
    for s in sizes:
        groups.check_group_size(base.size, s, "group_sizes")
    periods = list(sync_periods)
    if not periods or any(not isinstance(t, int) or t < 1 for t in periods):
        raise InvalidArgumentError("sync_periods", f"expected ints >= 1, got {periods!r}")
    longer = [t for t in periods if t > base.steps]
    if longer:  # it would run no sync round, so it would look fastest
        raise InvalidArgumentError("sync_periods", f"{longer} exceed the {base.steps} simulated "
                                   "steps: no sync round would be simulated; simulate more "
                                   "steps or choose shorter periods")
    # A size or period given twice was simulated twice and shown twice, each
    # copy marked recommended.
    sizes, periods = list(dict.fromkeys(sizes)), list(dict.fromkeys(periods))
    lib = Collectives(base.size, cost, base.itemsize, base.algorithm)
    out = []
    for s in sizes:
        for tau in periods:
            w = replace(base, group_size=s, sync_every=tau)
            r = simulate("wagma", w, cost, lib)
            out.append(Candidate(s, tau, r.iterations_per_s,
                                 mixing_iterations(base.size, s, tau), r.mean_wait_s,
                                 r.fresh_share))
    best = max(c.iterations_per_s for c in out)
    near = [c for c in out if c.iterations_per_s >= (1 - tolerance) * best]
    chosen = min(near, key=lambda c: (c.mixing_iterations, -c.sync_every, c.group_size))
    return out, chosen
