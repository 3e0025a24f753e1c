"""Shifting groups: which ranks average together at each step.

Ranks are written as mixed-radix numbers with radices ``r_0, r_1, ...`` (digit
``k`` of rank ``x`` is ``(x // (r_0*...*r_{k-1})) % r_k``). At step ``s`` the group
of a rank is every rank that agrees with it on all digits except digit
``s mod K`` (K = number of digits). Averaging within the groups of steps
0..K-1 in turn is then the tensor product of per-digit averages, which is the
global mean exactly.

How the radices are chosen (``radices(P, S)``):

* P = S**K: K digits of radix S. The digit ``s`` of a base-S number is the bit
  field [s*log2 S, (s+1)*log2 S) when S is a power of two, so these are exactly
  the reference's recursive-doubling groups (ALGORITHMS.md section 1).
* Otherwise, if every prime factor of P is at most S: P is factored into as many
  radices S as divide it, then the rest into the fewest factors <= S. Groups are
  all the same size within a step (possibly smaller than S), and the exact-mean
  property still holds after ``len(radices)`` steps.
* Otherwise (a prime factor of P exceeds S, e.g. P=7, S=4) no sequence of plain
  group means of size <= S can produce the global mean exactly (its
  denominators would need that prime). Then ``K = ceil(log_S P)`` base-S digits
  are used and the top digit is truncated at P, so some groups are smaller.
  Every model still mixes with every other after ``mixing_steps(P, S)`` steps
  (computed, not assumed), and repeated cycles converge to the mean.

``S`` is an upper bound that is never exceeded; ``S == P`` is the global group and
``S == 1`` means every rank is alone (no communication).
"""

from __future__ import annotations

from functools import lru_cache

from .errors import InvalidArgumentError


# MPI counts ranks in a C int; trial division of P stays under 46341 tries.
MAX_SIZE = 2**31 - 1


def check_size(size: object, argument: str = "size") -> int:
    """Validate a rank count ``1 <= size <= MAX_SIZE`` (an MPI job cannot be
    larger; factoring an unbounded one could run for ever); typed error."""
    if isinstance(size, bool) or not isinstance(size, int):
        raise InvalidArgumentError(argument, f"expected an int, got {type(size).__name__}")
    if not 1 <= size <= MAX_SIZE:
        raise InvalidArgumentError(
            argument, f"must satisfy 1 <= size <= {MAX_SIZE} (MPI's limit), got {size}"
        )
    return size


def check_group_size(size: int, group_size: object, argument: str = "group_size") -> int:
    """Validate ``1 <= group_size <= size``; typed error naming the argument."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise InvalidArgumentError(
            argument, f"expected an int, got {type(group_size).__name__}"
        )
    if not 1 <= group_size <= size:
        raise InvalidArgumentError(
            argument, f"must satisfy 1 <= group_size <= {size} (ranks), got {group_size}"
        )
    return group_size


def check_step(step: object, argument: str = "step") -> int:
    """Validate a step: a non-negative int (it is taken modulo the step count)."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidArgumentError(argument, f"expected an int, got {type(step).__name__}")
    if step < 0:
        raise InvalidArgumentError(argument, f"must be >= 0, got {step}")
    return step


def _prime_factors(n: int) -> list[int]:
    """Trial division: at most sqrt(MAX_SIZE) ~ 46341 tries (check_size bounds n)."""
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out


def _pack_factors(n: int, limit: int) -> list[int] | None:
    """Factor ``n`` into few factors each <= ``limit`` (first-fit decreasing over
    its prime factors); None if a prime factor exceeds ``limit``."""
    primes = sorted(_prime_factors(n), reverse=True)
    if primes and primes[0] > limit:
        return None
    bins: list[int] = []
    for p in primes:
        for i, b in enumerate(bins):
            if b * p <= limit:
                bins[i] = b * p
                break
        else:
            bins.append(p)
    packed = sorted(bins, reverse=True)
    # First-fit decreasing is not always the fewest (144 with limit 13 packs
    # into 9, 8, 2 where 12, 12 exists), and each extra factor is one more
    # step before the models mix; where it loses, take the fewest.
    fewest = _fewest_factors(n, limit)
    return packed if fewest is None or len(fewest) >= len(packed) else list(fewest)


@lru_cache(maxsize=1024)
def _fewest_factors(n: int, cap: int) -> tuple[int, ...] | None:
    """The fewest factors of ``n``, each in [2, ``cap``], non-increasing (the
    largest leading factor among equally few); None if there are none.

    Only divisors of ``n`` are tried (built from its prime factors): trying
    every d <= cap took minutes for P=2e9, S=1e9-1."""
    divisors = [1]
    for p in set(_prime_factors(n)):
        power, k = 1, n
        powers = []
        while k % p == 0:
            k //= p
            power *= p
            powers.append(power)
        divisors = [d * q for d in divisors for q in [1, *powers]]
    divisors.sort(reverse=True)  # descending, as the search by every d was
    of: dict[int, list[int]] = {}  # m -> its divisors >= 2, descending
    memo: dict[tuple[int, int], tuple[int, ...] | None] = {}

    def fewest(m: int, c: int) -> tuple[int, ...] | None:
        if m == 1:
            return ()
        key = (m, c)
        if key in memo:
            return memo[key]
        if m not in of:
            of[m] = [d for d in divisors if d <= m and m % d == 0 and d > 1]
        best: tuple[int, ...] | None = None
        for d in of[m]:
            if d > c:
                continue
            rest = fewest(m // d, d)
            if rest is not None and (best is None or len(rest) + 1 < len(best)):
                best = (d, *rest)
        memo[key] = best
        return best

    return fewest(n, cap)


@lru_cache(maxsize=1024, typed=True)  # typed: 8.0 must not hit 8's entry unchecked
def radices(size: int, group_size: int) -> tuple[int, ...]:
    """The mixed-radix digits for P=``size`` ranks and groups of at most
    ``group_size``; their product is >= size (== size when exact)."""
    check_size(size)
    check_group_size(size, group_size)
    if size == 1 or group_size == 1:
        return (1,)
    digits: list[int] = []
    rest = size
    while rest % group_size == 0:
        digits.append(group_size)
        rest //= group_size
    if rest > 1:
        packed = _pack_factors(rest, group_size)
        if packed is None:  # not exactly factorable: truncated base-S digits
            digits, span = [], 1
            while span < size:
                digits.append(group_size)
                span *= group_size
            top = -(-size // (span // group_size))
            digits[-1] = top
            return tuple(digits)
        digits.extend(packed)
    return tuple(digits)


def is_exact(size: int, group_size: int) -> bool:
    """True when averaging over ``num_steps`` consecutive steps gives the exact
    global mean (the product of the radices is P)."""
    prod = 1
    for r in radices(size, group_size):
        prod *= r
    return prod == size


def num_steps(size: int, group_size: int) -> int:
    """K: the number of distinct steps; ``step`` is taken modulo K."""
    return len(radices(size, group_size))


def group_of(rank: int, size: int, group_size: int, step: int) -> tuple[int, ...]:
    """The sorted global ranks in ``rank``'s group at ``step``. A rank outside
    [0, size) is refused: the digit arithmetic would answer an empty or
    negative "group" for it."""
    digits = radices(size, group_size)
    check_step(step)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise InvalidArgumentError("rank", f"must be an int in [0, {size}), got {rank!r}")
    k = step % len(digits)
    place = 1
    for r in digits[:k]:
        place *= r
    digit = (rank // place) % digits[k]
    base = rank - digit * place
    return tuple(
        m for m in (base + j * place for j in range(digits[k])) if m < size
    )


def partition(size: int, group_size: int, step: int) -> tuple[tuple[int, ...], ...]:
    """All groups at ``step``, ordered by their smallest rank. Checked before
    the cache (``1.0 == 1`` hashes alike), which is keyed by the step modulo
    the step count (a training loop's step grows without bound)."""
    check_step(step)
    return _partition(size, group_size, step % num_steps(size, group_size))


@lru_cache(maxsize=1024)
def _partition(size: int, group_size: int, step: int) -> tuple[tuple[int, ...], ...]:
    seen: set[int] = set()
    out: list[tuple[int, ...]] = []
    for r in range(size):
        if r not in seen:
            g = group_of(r, size, group_size, step)
            seen.update(g)
            out.append(g)
    return tuple(out)


def mixing_steps(size: int, group_size: int) -> int | None:
    """The number of consecutive steps (from step 0) after which every rank's
    model depends on every other rank's; None if it never does (S == 1, P > 1).

    Exact radices (each >= 2) mix in exactly one step per radix: after k
    steps a rank has met the ranks that differ from it in digits < k only.
    Only the other case is simulated, on bitsets of P bits per rank."""
    digits = radices(size, group_size)  # checks size and group_size
    if size == 1:
        return 0
    if group_size == 1:
        return None
    if is_exact(size, group_size):
        return len(digits)
    full = (1 << size) - 1
    reach = [1 << r for r in range(size)]
    limit = 4 * num_steps(size, group_size) + 4
    for step in range(limit):
        nxt = list(reach)
        for g in partition(size, group_size, step % num_steps(size, group_size)):
            union = 0
            for m in g:
                union |= reach[m]
            for m in g:
                nxt[m] = union
        reach = nxt
        if all(x == full for x in reach):
            return step + 1
    return None
