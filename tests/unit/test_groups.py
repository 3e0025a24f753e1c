"""Shifting groups: the reference's bit-field groups, partitions, mixing."""

from __future__ import annotations

import itertools
import subprocess
import sys
from typing import Callable

import numpy as np
import pytest

from wagma_comm import groups as G
from wagma_comm.errors import InvalidArgumentError

POW2_CASES = [(P, S) for P in (2, 4, 8, 16, 64, 256, 1024) for S in (2, 4, 8, 16, 32)
              if S <= P and round(np.log(P) / np.log(S)) == np.log(P) / np.log(S)]


def reference_group(rank: int, size: int, group_size: int, step: int) -> set[int]:
    """The reference's rule: partners r XOR (1 << (s*log2 S + j)), j < log2 S,
    closed under composition, i.e. all ranks equal to r outside that bit field."""
    bits = group_size.bit_length() - 1
    k = size.bit_length() - 1
    s = step % (k // bits)
    members = {rank}
    for j in range(bits):
        members |= {m ^ (1 << (s * bits + j)) for m in members}
    return members


@pytest.mark.parametrize("P,S", POW2_CASES)
def test_power_of_two_groups_are_the_reference_bit_fields(P: int, S: int) -> None:
    steps = G.num_steps(P, S)
    assert S ** steps == P
    for step in range(2 * steps + 1):  # step is taken modulo log_S P
        for rank in range(P):
            assert set(G.group_of(rank, P, S, step)) == reference_group(rank, P, S, step)


def test_paper_example_64_by_8() -> None:
    assert G.partition(64, 8, 0)[:2] == (tuple(range(8)), tuple(range(8, 16)))
    assert G.partition(64, 8, 1)[0] == tuple(range(0, 64, 8))
    assert G.partition(64, 8, 1)[1] == tuple(range(1, 64, 8))
    assert G.partition(64, 8, 2) == G.partition(64, 8, 0)


def _fewest(n: int, cap: int) -> int | None:
    """Brute force: the fewest factors in [2, cap] whose product is n."""
    if n == 1:
        return 0
    counts = [c + 1 for d in range(2, min(cap, n) + 1) if n % d == 0
              for c in [_fewest(n // d, cap)] if c is not None]
    return min(counts, default=None)


def test_the_rest_after_the_radices_S_takes_the_fewest_factors() -> None:
    """docs/schedules.md: P is factored into as many S as divide it, then the
    rest into the fewest factors <= S. First-fit decreasing alone gave
    144, S=13 -> (9, 8, 2): three steps where (12, 12) mixes in two."""
    assert G.radices(144, 13) == (12, 12)
    assert G.radices(360, 21) == (20, 18)
    for P in range(2, 400):
        for S in range(2, min(P, 24) + 1):
            if not G.is_exact(P, S):
                continue
            digits = G.radices(P, S)
            n_s = next(k for k, r in enumerate(digits + (0,)) if r != S)
            rest = P // S ** n_s
            assert len(digits) - n_s == _fewest(rest, S), (P, S, digits)


ALL_CASES = [(P, S) for P in range(1, 41) for S in range(1, P + 1)]


@pytest.mark.parametrize("P,S", ALL_CASES)
def test_partition_covers_every_rank_once_within_size(P: int, S: int) -> None:
    for step in range(G.num_steps(P, S)):
        parts = G.partition(P, S, step)
        flat = sorted(itertools.chain.from_iterable(parts))
        assert flat == list(range(P))
        assert all(1 <= len(g) <= S for g in parts)
        for g in parts:
            for r in g:
                assert G.group_of(r, P, S, step) == g


def _mix(values: np.ndarray, P: int, S: int, steps: int) -> np.ndarray:
    x = values.copy()
    for step in range(steps):
        for g in G.partition(P, S, step):
            x[list(g)] = x[list(g)].mean(axis=0)
    return x


def _has_only_small_primes(P: int, S: int) -> bool:
    """Every prime factor of P is at most S (trial division)."""
    n, p, largest = P, 2, 1
    while p * p <= n:
        while n % p == 0:
            n, largest = n // p, p
        p += 1
    return max(largest, n) <= S


@pytest.mark.parametrize("P,S", ALL_CASES)
def test_mixing_gives_the_global_mean_when_exact(P: int, S: int) -> None:
    if S == 1 and P > 1:
        pytest.skip("groups of one never mix")
    # exact exactly when every prime factor of P is at most S (see groups.py)
    assert G.is_exact(P, S) == _has_only_small_primes(P, S)
    rng = np.random.default_rng(P * 1000 + S)
    values = rng.standard_normal((P, 3))
    K = G.num_steps(P, S)
    if G.is_exact(P, S):
        mixed = _mix(values, P, S, K)
        np.testing.assert_allclose(mixed, np.broadcast_to(values.mean(0), mixed.shape),
                                   rtol=1e-12, atol=1e-12)
        assert G.mixing_steps(P, S) <= K
    else:
        # Not exact: every model still mixes with every other, and cycling the
        # steps converges to the global mean.
        assert G.mixing_steps(P, S) is not None
        mixed = _mix(values, P, S, 200 * K)
        np.testing.assert_allclose(mixed, np.broadcast_to(values.mean(0), mixed.shape),
                                   rtol=0, atol=1e-6)


def test_power_of_s_needs_exactly_log_s_p_steps() -> None:
    for P, S in [(64, 8), (16, 4), (27, 3), (1024, 2)]:
        K = G.num_steps(P, S)
        assert S ** K == P
        assert G.mixing_steps(P, S) == K


def test_trivial_sizes() -> None:
    assert G.partition(1, 1, 0) == ((0,),)
    assert G.partition(5, 5, 3) == (tuple(range(5)),)
    assert G.partition(4, 1, 0) == ((0,), (1,), (2,), (3,))
    assert G.mixing_steps(4, 1) is None


@pytest.mark.parametrize("bad", [0, -1, 9, 2.0, "4", None, True])
def test_bad_group_size(bad: object) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        G.check_group_size(8, bad)
    assert info.value.argument == "group_size"


@pytest.mark.parametrize("bad", [-1, 1.5, "0", None])
def test_bad_step(bad: object) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        G.check_step(bad)
    assert info.value.argument == "step"



def _in_child(code: str, timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter and return its stdout: a hang there
    fails the test (TimeoutExpired) instead of stalling the session."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.parametrize("bad", [0, -1, 2**31, 8.0, True, "8", None])
def test_bad_rank_count_is_refused_naming_size(bad: object) -> None:
    """P=0 was blamed on group_size, P="8" or None escaped as a raw TypeError
    and P=2**31 was factored. P is an MPI job's size, a C int: anything else
    is a typed error naming ``size``."""
    with pytest.raises(InvalidArgumentError) as info:
        G.check_size(bad)
    assert info.value.argument == "size"
    G.radices(1, 1), G.radices(8, 1)  # cached keys equal to (True, 1) and (8.0, 1)
    with pytest.raises(InvalidArgumentError) as info:
        G.radices(bad, 4 if type(bad) is int and bad > 4 else 1)
    assert info.value.argument == "size"
    assert G.check_size(G.MAX_SIZE) == G.MAX_SIZE


def test_absurd_rank_count_is_refused_not_factored_for_ever() -> None:
    """``wagma schedule --ranks 1000000000000000009 --group-size 4`` ran trial
    division up to sqrt(P) (1e9 tries) instead of refusing P."""
    out = _in_child(
        "from wagma_comm import groups as G\n"
        "from wagma_comm.errors import InvalidArgumentError\n"
        "try:\n"
        "    G.radices(10**18 + 9, 4)\n"
        "except InvalidArgumentError as e:\n"
        "    print(e.argument)\n")
    assert out == "size"


def test_large_composite_sizes_factor_quickly() -> None:
    """The fewest-factors search tried every d <= S: P=2e9, S=1e9-1 took
    minutes (``wagma schedule --ranks 2000000000 --group-size 999999999``)."""
    out = _in_child(
        "from wagma_comm import groups as G\n"
        "print(G.radices(2_000_000_000, 999_999_999),\n"
        "      G.group_of(0, 2_000_000_000, 999_999_999, 1),\n"
        "      G.radices(2_095_133_040, 46_340), G.radices(G.MAX_SIZE, 4)[-1] <= 4)\n")
    assert out == ("(500000000, 4) (0, 500000000, 1000000000, 1500000000) "
                   "(46189, 45360) True")


@pytest.mark.parametrize("call,argument", [
    (lambda: G.group_of(8, 8, 2, 0), "rank"),  # was (), an empty group
    (lambda: G.group_of(-1, 8, 2, 0), "rank"),  # was (-2, -1)
    (lambda: G.group_of(True, 8, 2, 0), "rank"),
    (lambda: G.group_of("0", 8, 2, 0), "rank"),  # bare TypeError
    (lambda: G.group_of(0, 8, 2, 1.0), "step"),  # bare TypeError
    (lambda: G.group_of(0, 8, 2, -1), "step"),  # answered as step K-1
    (lambda: G.partition(8, 2, -1), "step"),
    (lambda: G.partition(8, 2, 3.0), "step"),  # bare TypeError
    (lambda: G.partition(8.0, 2, 0), "size"),
    (lambda: G.mixing_steps(0, 1), "size"),  # was None, "never mixes"
    (lambda: G.mixing_steps(8.0, 2), "size"),  # bare TypeError
    (lambda: G.mixing_steps(1, 5), "group_size"),  # was 0
])
def test_group_functions_refuse_bad_input_naming_the_argument(call: Callable[[], object],
                                                              argument: str) -> None:
    """``comm.group_of`` checked its arguments, ``groups.group_of`` (what the
    CLI, the bench and the partial collectives call) did not."""
    with pytest.raises(InvalidArgumentError) as info:
        call()
    assert info.value.argument == argument


def test_partition_cache_does_not_answer_a_float_step() -> None:
    """``partition`` was cached untyped: ``1.0 == 1`` hashes alike, so a float
    step got step 1's partition when that was cached and a bare TypeError
    when it was not."""
    G.partition(8, 2, 1)
    with pytest.raises(InvalidArgumentError) as info:
        G.partition(8, 2, 1.0)
    assert info.value.argument == "step"
    assert G.partition(8, 2, 1 + 3 * G.num_steps(8, 2)) == G.partition(8, 2, 1)


def test_mixing_steps_of_a_huge_exact_job_needs_no_bitsets() -> None:
    """P = S**K mixes in exactly K steps; mixing_steps simulated bitsets of P
    bits per rank anyway, P**2/8 bytes: 128 GiB for 2**20 ranks (here under a
    1 GiB address-space cap in a child, a MemoryError)."""
    out = _in_child(
        "import resource\n"
        "from wagma_comm import groups as G\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "print(G.mixing_steps(2**20, 2), G.mixing_steps(2**30, 32), G.mixing_steps(3**12, 9))\n")
    assert out == "20 6 6"
