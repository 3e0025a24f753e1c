"""Load-imbalance injectors, and the step times they should produce.

Wait-avoiding methods only help when some ranks are slower than others, so the
benchmarks and the demo inject imbalance on purpose. The reference does this the
same way in every method (ALGORITHMS.md section 6): every rank seeds the same
generator, and at each step a rank sleeps a fixed delay (320 ms in the ImageNet
runs) if it equals either of two ranks drawn uniformly from [0, P). At most two
ranks are slow per step, and every rank agrees which with no communication.

Injectors here keep that property and add random access: the delay of
``(rank, step)`` is a pure function of the constructor arguments and
``(rank, step)``. Each step gets its own generator, ``default_rng([seed, step])``,
so a rank that skips steps, restarts, or asks about another rank's step gets the
same answer as everyone else, whatever order the questions come in.

* :class:`ReferenceImbalance`: the reference's injector (delay and count of
  draws configurable).
* :class:`SkewedCompute`: "uneven sample length": every rank pays extra compute
  drawn from a lognormal (right-skewed) distribution with a chosen mean.
* :class:`SlowNode`: a persistently slow node: the ranks of one node pay a
  fixed extra delay at every step (a thermally throttled or shared machine).
* :class:`NoImbalance`: zero everywhere.

:func:`make_injector` parses the CLI form (``none``, ``reference:DELAY[:COUNT]``,
``skewed:MEAN[:SIGMA]``, ``slownode:DELAY[:RANKS_PER_NODE[:NODE]]``). The ``expected_*`` / ``iterations_per_second_*``
functions give the time a wait-avoiding and a globally synchronous method should
take under an injector, so a benchmark can say how close it came;
:func:`exact_reference_period_max` computes the reference injector's term exactly,
to check the simulation against.
"""

from __future__ import annotations

import math
import numbers
import time
from abc import ABC, abstractmethod
from functools import lru_cache

import numpy as np

from .errors import InvalidArgumentError

__all__ = [
    "Injector",
    "NoImbalance",
    "ReferenceImbalance",
    "SkewedCompute",
    "SlowNode",
    "make_injector",
    "expected_period_time",
    "expected_step_time_blocking",
    "iterations_per_second_wait_avoiding",
    "iterations_per_second_blocking",
    "reference_period_max_cdf",
    "exact_reference_period_max",
    "EXACT_WORK_LIMIT",
    "MAX_COUNT",
    "MAX_DELAY_S",
]

# Steps simulated per block by the expectation helpers: bounds memory at
# block * size floats however many periods are asked for.
_BLOCK_STEPS = 8192


#: Largest injected delay (or skewed mean) an injector accepts: one day. A larger
#: value is a typo, and one that ``time.sleep`` cannot take (about 9.2e9 s) would
#: fail mid-run, and only on the ranks drawn slow, while the others wait.
MAX_DELAY_S = 86400.0

#: Most draws per step :class:`ReferenceImbalance` accepts. At ``P ln P`` draws
#: all but about one rank are slow at every step (65,536 is that for ~7,000
#: ranks), so more is a typo; and every step builds an array of COUNT draws, so an
#: unbounded COUNT failed (MemoryError) mid-run, on every rank, naming no option.
MAX_COUNT = 1 << 16

# --------------------------------------------------------------------------- checks


def _check_int(argument: str, value: object, minimum: int) -> int:
    """An integer (numpy ones too, never bool) that is at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(argument, f"expected an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidArgumentError(argument, f"must be >= {minimum}, got {value}")
    return int(value)


def _check_seconds(argument: str, value: object) -> float:
    """A finite, non-negative real (a duration or a spread)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(argument, f"expected a number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v):
        raise InvalidArgumentError(argument, f"must be finite, got {value}")
    if v < 0:
        raise InvalidArgumentError(argument, f"must be >= 0, got {value}")
    return v


def check_delay(argument: str, value: object) -> float:
    """A delay an injector will sleep: as :func:`_check_seconds`, at most
    :data:`MAX_DELAY_S`."""
    v = _check_seconds(argument, value)
    if v > MAX_DELAY_S:
        raise InvalidArgumentError(
            argument, f"must be <= {MAX_DELAY_S:g} s (one day), got {value}")
    return v


def _check_injector(injector: object) -> "Injector":
    if not isinstance(injector, Injector):
        raise InvalidArgumentError(
            "injector", f"expected an Injector, got {type(injector).__name__}"
        )
    return injector


# ------------------------------------------------------------------------ injectors


class Injector(ABC):
    """Extra per-(rank, step) time, identical on every rank without communicating.

    Subclasses implement :meth:`_delays` (all ranks at one already-validated step);
    everything else follows from it. The delay must depend only on the
    constructor arguments and the step, never on call order.
    """

    size: int

    def __init__(self, size: int) -> None:
        self.size = _check_int("size", size, 1)

    # -- what subclasses provide

    @abstractmethod
    def _delays(self, step: int) -> np.ndarray:
        """Delays of all ranks at ``step`` (float64, shape ``(size,)``, fresh array)."""

    @property
    @abstractmethod
    def spec(self) -> str:
        """The :func:`make_injector` string that rebuilds this injector (given size
        and seed), so a benchmark can record what it ran under."""

    def _delays_block(self, first_step: int, n: int) -> np.ndarray:
        """Delays of steps ``first_step .. first_step+n-1``, shape ``(n, size)``.
        Subclasses may vectorise; the values must equal :meth:`_delays`'."""
        out = np.empty((n, self.size), dtype=np.float64)
        for k in range(n):
            out[k] = self._delays(first_step + k)
        return out

    # -- public API

    def delays(self, step: int) -> np.ndarray:
        """Seconds of extra delay of every rank at ``step``, shape ``(size,)``."""
        step = _check_int("step", step, 0)
        return self._delays(step)

    def delay(self, rank: int, step: int) -> float:
        """Seconds of extra delay of ``rank`` at ``step``."""
        rank = self._check_rank(rank)
        step = _check_int("step", step, 0)
        return float(self._delays(step)[rank])

    def sleep(self, rank: int, step: int) -> float:
        """Sleep this rank's delay for ``step``; returns the seconds requested
        (a zero delay makes no sleep call at all, so fast ranks pay nothing)."""
        seconds = self.delay(rank, step)
        if seconds > 0:
            time.sleep(seconds)
        return seconds

    def _check_rank(self, rank: object) -> int:
        rank = _check_int("rank", rank, 0)
        if rank >= self.size:
            raise InvalidArgumentError("rank", f"must be < size={self.size}, got {rank}")
        return rank

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, spec={self.spec!r})"


class NoImbalance(Injector):
    """No injected delay: the default, so callers never need a None check."""

    def __init__(self, size: int) -> None:
        super().__init__(size)

    def _delays(self, step: int) -> np.ndarray:
        return np.zeros(self.size, dtype=np.float64)

    def _delays_block(self, first_step: int, n: int) -> np.ndarray:
        return np.zeros((n, self.size), dtype=np.float64)

    @property
    def spec(self) -> str:
        return "none"


class ReferenceImbalance(Injector):
    """The reference's injector: each step, ``count`` ranks are drawn uniformly
    from [0, size) *with replacement* and every drawn rank sleeps ``delay_s``.

    Draws may coincide (as in the reference, where a rank is slow if it equals
    either of two draws), so a step has between 1 and ``count`` slow ranks and a
    given rank is slow with probability ``1 - (1 - 1/size)**count``. ``count``
    may exceed ``size``, up to :data:`MAX_COUNT`.
    """

    def __init__(self, size: int, delay_s: float, count: int = 2, seed: int = 0) -> None:
        size = _check_int("size", size, 1)
        self.delay_s = check_delay("delay_s", delay_s)
        self.count = _check_int("count", count, 1)
        if self.count > MAX_COUNT:
            raise InvalidArgumentError("count", f"must be <= {MAX_COUNT} draws, got {count}")
        self.seed = _check_int("seed", seed, 0)
        super().__init__(size)

    def _draws(self, step: int) -> np.ndarray:
        """The ``count`` ranks drawn at ``step`` (duplicates kept)."""
        return np.random.default_rng([self.seed, step]).integers(0, self.size, self.count)

    def slow_ranks(self, step: int) -> tuple[int, ...]:
        """The ranks that are slow at ``step``: sorted, distinct, 1..count of them."""
        step = _check_int("step", step, 0)
        return tuple(int(r) for r in np.unique(self._draws(step)))

    def _delays(self, step: int) -> np.ndarray:
        out = np.zeros(self.size, dtype=np.float64)
        out[self._draws(step)] = self.delay_s
        return out

    def _delays_block(self, first_step: int, n: int) -> np.ndarray:
        # Scattered step by step: an (n, count) table of draws would break the
        # n * size bound of _BLOCK_STEPS whenever count > size.
        out = np.zeros((n, self.size), dtype=np.float64)
        for k in range(n):
            out[k, self._draws(first_step + k)] = self.delay_s
        return out

    def delay(self, rank: int, step: int) -> float:
        rank = self._check_rank(rank)
        step = _check_int("step", step, 0)
        return self.delay_s if bool(np.any(self._draws(step) == rank)) else 0.0

    @property
    def spec(self) -> str:
        return f"reference:{self.delay_s!r}:{self.count}"


class SkewedCompute(Injector):
    """The "uneven sample length" mode: every rank pays extra compute each step,
    drawn from a lognormal distribution whose mean is ``mean_s``.

    Lognormal because sample lengths (sentences, videos) are right-skewed: most
    steps are near the median and a few are much longer. With underlying normal
    N(mu, sigma**2) the mean is ``exp(mu + sigma**2 / 2)``, so
    ``mu = ln(mean_s) - sigma**2 / 2``; ``sigma`` sets the skew (0: constant).
    Step ``s`` draws all ``size`` values from ``default_rng([seed, s])`` and rank
    ``r`` takes the ``r``-th, so every rank knows every other rank's time.
    """

    def __init__(self, size: int, mean_s: float, sigma: float = 1.0, seed: int = 0) -> None:
        size = _check_int("size", size, 1)
        self.mean_s = check_delay("mean_s", mean_s)
        self.sigma = _check_seconds("sigma", sigma)
        if not math.isfinite(self.sigma * self.sigma):  # mu needs sigma**2 / 2
            raise InvalidArgumentError("sigma", f"too large (sigma**2 overflows), got {sigma}")
        self.seed = _check_int("seed", seed, 0)
        super().__init__(size)

    @property
    def mu(self) -> float:
        """Mean of the underlying normal (``-inf`` when ``mean_s`` is 0)."""
        if self.mean_s == 0:
            return -math.inf
        return math.log(self.mean_s) - self.sigma**2 / 2

    def _delays(self, step: int) -> np.ndarray:
        if self.mean_s == 0:
            return np.zeros(self.size, dtype=np.float64)
        rng = np.random.default_rng([self.seed, step])
        return rng.lognormal(self.mu, self.sigma, self.size)

    @property
    def spec(self) -> str:
        return f"skewed:{self.mean_s!r}:{self.sigma!r}"


class SlowNode(Injector):
    """A persistently slow node: ranks ``node * ranks_per_node`` up to the next
    node's first rank pay ``delay_s`` at every step; everyone else nothing.
    Unlike the reference injector the same ranks are slow every time, which is
    what hurts gossip (their neighbours wait every step) and what wait-avoiding
    rounds are meant to hide."""

    def __init__(self, size: int, delay_s: float, ranks_per_node: int = 8,
                 node: int = 0) -> None:
        size = _check_int("size", size, 1)
        self.delay_s = check_delay("delay_s", delay_s)
        self.ranks_per_node = _check_int("ranks_per_node", ranks_per_node, 1)
        self.node = _check_int("node", node, 0)
        if self.node * self.ranks_per_node >= size:
            raise InvalidArgumentError(
                "node", f"node {node} has no ranks ({size} ranks, {ranks_per_node} per node)")
        super().__init__(size)
        self._pattern = np.zeros(size, dtype=np.float64)
        self._pattern[self.node * self.ranks_per_node:
                      (self.node + 1) * self.ranks_per_node] = self.delay_s

    def _delays(self, step: int) -> np.ndarray:
        return self._pattern.copy()

    def _delays_block(self, first_step: int, n: int) -> np.ndarray:
        return np.tile(self._pattern, (n, 1))

    @property
    def spec(self) -> str:
        return f"slownode:{self.delay_s!r}:{self.ranks_per_node}:{self.node}"


def make_injector(spec: str, size: int, seed: int = 0) -> Injector:
    """Build an injector from its CLI form.

    ``none`` | ``reference:DELAY[:COUNT]`` (DELAY seconds, COUNT draws, default 2)
    | ``skewed:MEAN[:SIGMA]`` (MEAN seconds, SIGMA default 1.0)
    | ``slownode:DELAY[:RANKS_PER_NODE[:NODE]]`` (defaults 8 and 0). Anything else, or
    a value out of range, raises ``InvalidArgumentError("imbalance", ...)``.
    """
    size = _check_int("size", size, 1)
    seed = _check_int("seed", seed, 0)
    if not isinstance(spec, str):
        raise InvalidArgumentError("imbalance", f"expected a string, got {type(spec).__name__}")
    parts = [p.strip() for p in spec.strip().split(":")]
    kind, args = parts[0].lower(), parts[1:]
    usage = ("expected 'none', 'reference:DELAY[:COUNT]', 'skewed:MEAN[:SIGMA]' or "
             "'slownode:DELAY[:RANKS_PER_NODE[:NODE]]'")

    def number(text: str, what: str, convert: type) -> float | int:
        try:
            return convert(text)
        except ValueError:
            raise InvalidArgumentError(
                "imbalance", f"{what} must be {convert.__name__}, got {text!r} in {spec!r}"
            ) from None

    try:
        if kind == "none" and not args:
            return NoImbalance(size)
        if kind == "reference" and 1 <= len(args) <= 2:
            delay_s = number(args[0], "DELAY", float)
            count = number(args[1], "COUNT", int) if len(args) == 2 else 2
            return ReferenceImbalance(size, delay_s, count, seed)
        if kind == "skewed" and 1 <= len(args) <= 2:
            mean_s = number(args[0], "MEAN", float)
            sigma = number(args[1], "SIGMA", float) if len(args) == 2 else 1.0
            return SkewedCompute(size, mean_s, sigma, seed)
        if kind == "slownode" and 1 <= len(args) <= 3:
            delay_s = number(args[0], "DELAY", float)
            per_node = number(args[1], "RANKS_PER_NODE", int) if len(args) >= 2 else 8
            node = number(args[2], "NODE", int) if len(args) == 3 else 0
            return SlowNode(size, delay_s, per_node, node)
    except InvalidArgumentError as exc:
        if exc.argument == "imbalance":
            raise
        raise InvalidArgumentError("imbalance", f"{spec!r}: {exc}") from None
    raise InvalidArgumentError("imbalance", f"{usage}, got {spec!r}")


# ----------------------------------------------------------------- expected times


def _blocks(first_step: int, n: int, unit: int):
    """Split ``n`` steps from ``first_step`` into blocks of whole ``unit``s."""
    per = max(unit, (_BLOCK_STEPS // unit) * unit)
    for start in range(0, n, per):
        yield first_step + start, min(per, n - start)


def expected_period_time(
    injector: Injector,
    compute_s: float,
    sync_every: int,
    periods: int = 2000,
    first_step: int = 0,
) -> float:
    """Expected wall time of one sync period of a wait-avoiding method.

    ``sync_every * compute_s + E[max_r sum_{steps t of the period} delay(r, t)]``:
    between syncs every rank runs ahead on its own and accumulates only its own
    delays; the sync round then waits for the most-delayed rank. The expectation
    is the average over ``periods`` consecutive periods of this injector's own
    draws (period k is steps ``first_step + k*sync_every ...``), so it is the
    time the benchmark should see when its steps are the same.
    """
    injector = _check_injector(injector)
    compute_s = _check_seconds("compute_s", compute_s)
    sync_every = _check_int("sync_every", sync_every, 1)
    periods = _check_int("periods", periods, 1)
    first_step = _check_int("first_step", first_step, 0)
    total = 0.0
    for start, n in _blocks(first_step, periods * sync_every, sync_every):
        d = injector._delays_block(start, n).reshape(n // sync_every, sync_every, -1)
        total += float(d.sum(axis=1).max(axis=1).sum())
    return sync_every * compute_s + total / periods


def expected_step_time_blocking(
    injector: Injector,
    compute_s: float,
    steps: int = 20000,
    first_step: int = 0,
) -> float:
    """Expected time of one step of a globally synchronous method.

    ``compute_s + E[max_r delay(r, t)]``: a global allreduce every step makes
    everyone wait for that step's slowest rank, so delays never overlap. Averaged
    over ``steps`` consecutive steps from ``first_step``. For
    :class:`ReferenceImbalance` some rank is slow at every step, so this is
    exactly ``compute_s + delay_s``.
    """
    injector = _check_injector(injector)
    compute_s = _check_seconds("compute_s", compute_s)
    steps = _check_int("steps", steps, 1)
    first_step = _check_int("first_step", first_step, 0)
    total = 0.0
    for start, n in _blocks(first_step, steps, 1):
        total += float(injector._delays_block(start, n).max(axis=1).sum())
    return compute_s + total / steps


def iterations_per_second_wait_avoiding(
    injector: Injector,
    compute_s: float,
    sync_every: int,
    periods: int = 2000,
    first_step: int = 0,
) -> float:
    """Expected iterations/s of a wait-avoiding method:
    ``sync_every / expected_period_time(...)`` (``inf`` if that time is 0)."""
    t = expected_period_time(injector, compute_s, sync_every, periods, first_step)
    return math.inf if t == 0 else sync_every / t


def iterations_per_second_blocking(
    injector: Injector,
    compute_s: float,
    steps: int = 20000,
    first_step: int = 0,
) -> float:
    """Expected iterations/s of a globally synchronous method:
    ``1 / expected_step_time_blocking(...)`` (``inf`` if that time is 0)."""
    t = expected_step_time_blocking(injector, compute_s, steps, first_step)
    return math.inf if t == 0 else 1 / t


# ------------------------------------------------ exact reference period maximum

#: Largest ``size * C(sync_every + 2L, 2L) * sync_every`` (L = min(count, size))
#: that :func:`reference_period_max_cdf` accepts: at most a few seconds of work.
#: At size 64 it covers count=1 up to sync_every=50+, count=2 up to 31, count=3
#: up to 17 and count=4 up to 12; beyond it, use :func:`expected_period_time`.
EXACT_WORK_LIMIT = 120_000_000


def _exact_work(size: int, count: int, sync_every: int) -> int:
    levels = min(count, size)
    return size * math.comb(sync_every + 2 * levels, 2 * levels) * sync_every


@lru_cache(maxsize=16)
def _transitions(levels: int, steps: int):
    """Every one-rank move of the step histogram, for the exact DP.

    A state is ``h = (h_1..h_L)``: ``h_a`` steps of the period still need ``a``
    more slow ranks among the ranks not yet processed (the others need none).
    The next rank joins ``i_a`` of the ``h_a`` steps at each level, which moves
    them to level ``a-1``; its own count for the period is ``s = sum(i)``.
    Returns (number of states, index of the empty state, src, dst, h of src, i,
    s), sorted by dst.
    """
    # States: compositions with sum(h) <= steps, built one level at a time.
    states = np.zeros((1, 0), dtype=np.int64)
    for _ in range(levels):
        room = steps - states.sum(axis=1)
        reps = room + 1
        base = np.repeat(states, reps, axis=0)
        offs = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
        states = np.column_stack([base, offs])
    radix = steps + 1
    keys = states @ (radix ** np.arange(levels))
    order_keys = np.argsort(keys)
    sorted_keys = keys[order_keys]

    # Moves: for each state every i with 0 <= i_a <= h_a, one level at a time.
    src = np.arange(len(states))
    moves = np.zeros((len(states), 0), dtype=np.int64)
    for a in range(levels):
        reps = states[src, a] + 1
        offs = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
        src = np.repeat(src, reps)
        moves = np.column_stack([np.repeat(moves, reps, axis=0), offs])
    h_src = states[src]
    shifted = np.zeros_like(moves)
    shifted[:, :-1] = moves[:, 1:]
    new = h_src - moves + shifted
    dst = order_keys[np.searchsorted(sorted_keys, new @ (radix ** np.arange(levels)))]
    order = np.argsort(dst, kind="stable")
    src, dst, h_src, moves = src[order], dst[order], h_src[order], moves[order]
    empty = int(order_keys[np.searchsorted(sorted_keys, 0)])
    return len(states), empty, states, src, dst, h_src, moves, moves.sum(axis=1)


def reference_period_max_cdf(size: int, count: int, sync_every: int) -> np.ndarray:
    """Exact ``P(max_r N_r <= m)`` for ``m = 0..sync_every``, where ``N_r`` is the
    number of steps of one period at which rank ``r`` is slow under
    :class:`ReferenceImbalance` (any delay, any seed).

    Why it is exact and small: steps are independent; at each step the number of
    distinct slow ranks ``j`` has ``P(j) = C(P, j) * surj(count, j) / P**count``
    (``surj`` = onto maps from the draws to j ranks) and, given ``j``, the slow
    set is a uniform j-subset. Instead of following ``P`` rank counts over the
    steps (a state space growing like ``C(P+m, m)``), the DP walks over the
    *ranks*: given that a step still needs ``a`` slow ranks among the ``R``
    ranks left, the next rank is one of them with probability ``a/R``,
    independently across steps. The state is how many steps need ``a`` more
    ranks (``C(T+L, L)`` states, T = sync_every, L = min(count, P)), and the
    running maximum is carried as a cumulative vector over ``m``. Cost is about
    ``P * C(T+2L, 2L) * T``; beyond :data:`EXACT_WORK_LIMIT` this raises
    ``InvalidArgumentError("sync_every", ...)``.
    """
    size = _check_int("size", size, 1)
    count = _check_int("count", count, 1)
    sync_every = _check_int("sync_every", sync_every, 1)
    work = _exact_work(size, count, sync_every)
    if work > EXACT_WORK_LIMIT:
        raise InvalidArgumentError(
            "sync_every",
            f"exact computation for size={size}, count={count}, sync_every={sync_every} "
            f"needs ~{work:.2g} operations (limit {EXACT_WORK_LIMIT:.2g}); "
            "use expected_period_time (simulation) instead",
        )
    levels, steps = min(count, size), sync_every
    n_states, empty, states, src, dst, h_src, moves, s_mv = _transitions(levels, steps)

    # Initial state: each step independently needs j distinct slow ranks.
    surj = [sum((-1) ** k * math.comb(j, k) * (j - k) ** count for k in range(j + 1))
            for j in range(levels + 1)]
    p_j = [math.comb(size, j) * surj[j] / size**count for j in range(levels + 1)]
    init = np.zeros(n_states)
    for k in np.flatnonzero(states.sum(axis=1) == steps):
        h = [int(x) for x in states[k]]
        ways = math.factorial(steps)
        for x in h:
            ways //= math.factorial(x)
        init[k] = ways * math.prod(p_j[a + 1] ** x for a, x in enumerate(h))

    # cum[state, m] = P(state, and every rank processed so far slow <= m times).
    m_range = np.arange(steps + 1)
    cum = np.repeat(init[:, None], steps + 1, axis=1)
    starts = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]])
    # Chunks of whole dst groups keep the (moves x m) temporaries near 2**21 floats.
    per_chunk = max(1, (1 << 21) // (steps + 1))
    cuts = [0]
    for g in range(len(starts)):
        if starts[g] - starts[cuts[-1]] >= per_chunk:
            cuts.append(g)
    cuts.append(len(starts))
    n = np.arange(steps + 1)
    comb = np.array([[math.comb(x, k) for k in n] for x in n], dtype=np.float64)
    below = n[None, :] <= n[:, None]
    for left in range(size, 0, -1):
        # A step needing a ranks among the `left` remaining takes this one with
        # probability a/left: Binomial(h_a, a/left) moves per level, multiplied.
        weight = np.ones(len(src))
        for a in range(levels):
            p = min(1.0, (a + 1) / left)
            pmf = comb * p ** n[None, :] * (1 - p) ** np.clip(n[:, None] - n[None, :], 0, None)
            weight *= np.where(below, pmf, 0.0)[h_src[:, a], moves[:, a]]
        new = np.zeros_like(cum)
        for g0, g1 in zip(cuts[:-1], cuts[1:]):
            lo = starts[g0]
            hi = starts[g1] if g1 < len(starts) else len(src)
            contrib = cum[src[lo:hi]] * weight[lo:hi, None]
            contrib *= s_mv[lo:hi, None] <= m_range[None, :]  # this rank's count <= m
            new[dst[starts[g0:g1]]] = np.add.reduceat(contrib, starts[g0:g1] - lo, axis=0)
        cum = new
    return np.clip(cum[empty], 0.0, 1.0)


def exact_reference_period_max(size: int, count: int, sync_every: int, delay_s: float) -> float:
    """Exact ``E[max_r sum_{period} delay(r, t)]`` under :class:`ReferenceImbalance`:
    ``delay_s * E[max_r N_r] = delay_s * sum_{k>=1} P(max_r N_r >= k)``, with the
    distribution from :func:`reference_period_max_cdf` (same limits). Independent
    of the seed; :func:`expected_period_time` minus ``sync_every * compute_s``
    estimates the same number by simulation.
    """
    size = _check_int("size", size, 1)
    count = _check_int("count", count, 1)
    sync_every = _check_int("sync_every", sync_every, 1)
    delay_s = _check_seconds("delay_s", delay_s)
    cdf = reference_period_max_cdf(size, count, sync_every)
    return delay_s * float(np.sum(1.0 - cdf[:-1]))
