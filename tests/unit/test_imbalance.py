"""Imbalance injectors: agreement without communication, the reference's
statistics, the CLI form, and the expected-time formulas (exact vs simulated)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from wagma_comm import imbalance
from wagma_comm.errors import InvalidArgumentError
from wagma_comm.imbalance import (
    Injector,
    NoImbalance,
    ReferenceImbalance,
    SkewedCompute,
    exact_reference_period_max,
    expected_period_time,
    expected_step_time_blocking,
    iterations_per_second_blocking,
    iterations_per_second_wait_avoiding,
    make_injector,
    reference_period_max_cdf,
)

# ------------------------------------------------------------------ reference


def test_same_seed_agrees_without_communication() -> None:
    """Two ranks build their own injector; they agree on every step, in any
    order of asking, and every accessor tells the same story."""
    a = ReferenceImbalance(8, 0.32, seed=5)
    b = ReferenceImbalance(8, 0.32, seed=5)
    forward = [a.slow_ranks(s) for s in range(200)]
    backward = [b.slow_ranks(s) for s in reversed(range(200))][::-1]
    assert forward == backward
    for s in (0, 7, 199):
        d = a.delays(s)
        assert d.shape == (8,)
        assert set(np.flatnonzero(d)) == set(forward[s])
        for r in range(8):
            expect = 0.32 if r in forward[s] else 0.0
            assert a.delay(r, s) == expect == b.delay(r, s) == d[r]


def test_different_seeds_differ() -> None:
    a = [ReferenceImbalance(16, 1.0, seed=0).slow_ranks(s) for s in range(50)]
    b = [ReferenceImbalance(16, 1.0, seed=1).slow_ranks(s) for s in range(50)]
    assert a != b
    assert sum(x != y for x, y in zip(a, b)) > 25  # not one stray step


@pytest.mark.parametrize("count", [1, 2, 3])
def test_at_most_count_slow_ranks(count: int) -> None:
    inj = ReferenceImbalance(6, 0.5, count=count, seed=3)
    sizes = set()
    for s in range(300):
        slow = inj.slow_ranks(s)
        assert list(slow) == sorted(set(slow))
        assert 1 <= len(slow) <= count
        assert all(0 <= r < 6 for r in slow)
        sizes.add(len(slow))
    assert max(sizes) == count  # draws do not always coincide


def test_slow_frequency_matches_reference() -> None:
    """A rank is slow with probability 1-(1-1/P)^count (draws with replacement),
    and the two draws coincide with probability 1/P."""
    size, count, steps = 8, 2, 20000
    inj = ReferenceImbalance(size, 1.0, count=count, seed=11)
    d = inj._delays_block(0, steps)
    np.testing.assert_array_equal(d[123], inj.delays(123))
    freq = (d > 0).mean(axis=0)
    expect = 1 - (1 - 1 / size) ** count
    np.testing.assert_allclose(freq, expect, atol=0.015)
    one_slow = ((d > 0).sum(axis=1) == 1).mean()
    assert one_slow == pytest.approx(1 / size, abs=0.01)


# -------------------------------------------------------------------- skewed


def test_skewed_mean_and_skew() -> None:
    inj = SkewedCompute(8, 0.05, sigma=1.0, seed=2)
    x = inj._delays_block(0, 4000).ravel()
    assert x.mean() == pytest.approx(0.05, rel=0.03)
    assert (x > 0).all()
    z = (x - x.mean()) / x.std()
    assert (z**3).mean() > 1.0  # right-skewed (lognormal, sigma=1: ~6.2)
    assert np.median(x) < 0.8 * x.mean()  # long tail pulls the mean up


def test_skewed_is_per_step_draw_indexed_by_rank() -> None:
    inj = SkewedCompute(5, 0.2, sigma=0.5, seed=9)
    mu = math.log(0.2) - 0.5**2 / 2
    want = np.random.default_rng([9, 17]).lognormal(mu, 0.5, 5)
    np.testing.assert_array_equal(inj.delays(17), want)
    assert [inj.delay(r, 17) for r in reversed(range(5))] == list(want[::-1])
    assert not np.array_equal(inj.delays(17), inj.delays(18))
    assert not np.array_equal(inj.delays(17), SkewedCompute(5, 0.2, 0.5, seed=10).delays(17))


def test_skewed_degenerate_cases() -> None:
    np.testing.assert_allclose(SkewedCompute(4, 0.3, sigma=0.0).delays(5), 0.3, rtol=1e-12)
    np.testing.assert_array_equal(SkewedCompute(4, 0.0).delays(5), 0.0)


def test_no_imbalance() -> None:
    inj = NoImbalance(3)
    assert inj.delay(2, 10) == 0.0
    np.testing.assert_array_equal(inj.delays(4), np.zeros(3))
    assert expected_period_time(inj, 0.1, 4, periods=10) == pytest.approx(0.4)


def test_sleep_only_when_delayed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    monkeypatch.setattr(imbalance.time, "sleep", calls.append)
    inj = ReferenceImbalance(8, 0.32, seed=1)
    slow = inj.slow_ranks(4)
    fast = next(r for r in range(8) if r not in slow)
    assert inj.sleep(fast, 4) == 0.0 and calls == []
    assert inj.sleep(slow[0], 4) == 0.32 and calls == [0.32]


# ------------------------------------------------------------------ CLI form


@pytest.mark.parametrize(
    "spec,cls,attrs",
    [
        ("none", NoImbalance, {}),
        ("reference:0.32", ReferenceImbalance, {"delay_s": 0.32, "count": 2}),
        ("reference:0.5:3", ReferenceImbalance, {"delay_s": 0.5, "count": 3}),
        (" Reference : 1e-3 : 1 ", ReferenceImbalance, {"delay_s": 1e-3, "count": 1}),
        ("skewed:0.05", SkewedCompute, {"mean_s": 0.05, "sigma": 1.0}),
        ("skewed:0.05:0.25", SkewedCompute, {"mean_s": 0.05, "sigma": 0.25}),
    ],
)
def test_make_injector(spec: str, cls: type, attrs: dict) -> None:
    inj = make_injector(spec, 8, seed=4)
    assert type(inj) is cls and inj.size == 8
    for k, v in attrs.items():
        assert getattr(inj, k) == v
    if hasattr(inj, "seed"):
        assert inj.seed == 4
    again = make_injector(inj.spec, 8, seed=4)  # spec round-trips
    assert type(again) is cls
    np.testing.assert_array_equal(again.delays(3), inj.delays(3))


@pytest.mark.parametrize(
    "spec",
    ["", "fast", "reference", "reference:", "reference:abc", "reference:0.1:2.5",
     "reference:-1", "reference:inf", "reference:nan", "reference:0.1:0",
     "reference:1:2:3", "skewed", "skewed:-0.1", "skewed:0.1:-1", "skewed:x:1",
     "none:1", 3],
)
def test_make_injector_rejects(spec: object) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        make_injector(spec, 8)  # type: ignore[arg-type]
    assert info.value.argument == "imbalance"


def test_make_injector_bad_size_and_seed() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        make_injector("none", 0)
    assert info.value.argument == "size"
    with pytest.raises(InvalidArgumentError) as info:
        make_injector("reference:1", 4, seed=-1)
    assert info.value.argument == "seed"


# ----------------------------------------------------------- expected times


def _brute_force_period_max(size: int, count: int, steps: int) -> Fraction:
    """E[max_r N_r] by enumerating every outcome of every draw of the period."""
    total = 0
    for draws in itertools.product(range(size), repeat=count * steps):
        n = [0] * size
        for t in range(steps):
            for r in set(draws[t * count:(t + 1) * count]):
                n[r] += 1
        total += max(n)
    return Fraction(total, size ** (count * steps))


@pytest.mark.parametrize("size,count,steps", [(1, 2, 3), (3, 2, 3), (4, 2, 3), (2, 3, 4),
                                              (3, 1, 5), (5, 3, 2)])
def test_exact_matches_enumeration(size: int, count: int, steps: int) -> None:
    want = float(_brute_force_period_max(size, count, steps))
    assert exact_reference_period_max(size, count, steps, 1.0) == pytest.approx(want, rel=1e-12)
    assert exact_reference_period_max(size, count, steps, 0.25) == pytest.approx(
        0.25 * want, rel=1e-12)


def test_exact_cdf_is_a_distribution() -> None:
    cdf = reference_period_max_cdf(8, 2, 10)
    assert cdf.shape == (11,)
    assert (np.diff(cdf) >= -1e-15).all() and cdf[-1] == pytest.approx(1.0)
    assert cdf[1] == 0.0  # 10 steps with >= 1 slow rank over 8 ranks: someone has 2


def test_exact_agrees_with_simulation() -> None:
    exact = exact_reference_period_max(8, 2, 10, 1.0)
    sim = expected_period_time(ReferenceImbalance(8, 1.0, 2, seed=0), 0.0, 10, periods=2000)
    assert sim == pytest.approx(exact, rel=0.03)
    # A different formula (e.g. summing instead of max) would be far off.
    assert not exact == pytest.approx(10 * (1 - (7 / 8) ** 2), rel=0.3)


def test_period_time_bounds() -> None:
    """Per period the most-delayed rank has at least ceil(T/P) and at most T
    delays (someone is slow every step), so T*c + that, and it beats blocking."""
    size, delay, compute, t = 4, 0.3, 0.01, 10
    inj = ReferenceImbalance(size, delay, seed=7)
    d = inj._delays_block(0, 100 * t).reshape(100, t, size).sum(axis=1).max(axis=1)
    assert (d >= math.ceil(t / size) * delay - 1e-12).all() and (d <= t * delay + 1e-12).all()
    got = expected_period_time(inj, compute, t, periods=100)
    assert got == pytest.approx(t * compute + d.mean(), rel=1e-12)
    assert t * compute + math.ceil(t / size) * delay <= got < t * (compute + delay)
    # periods start at first_step + k*sync_every
    one = expected_period_time(inj, compute, t, periods=1, first_step=3)
    manual = inj._delays_block(3, t).sum(axis=0).max()
    assert one == pytest.approx(t * compute + manual, rel=1e-12)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_blocking_pays_one_delay_every_step(count: int) -> None:
    inj = ReferenceImbalance(8, 0.32, count=count, seed=count)
    assert expected_step_time_blocking(inj, 0.1, steps=2000) == pytest.approx(0.42, rel=1e-12)
    assert iterations_per_second_blocking(inj, 0.1, steps=2000) == pytest.approx(1 / 0.42)


def test_rates() -> None:
    inj = ReferenceImbalance(8, 0.32, seed=0)
    wa = iterations_per_second_wait_avoiding(inj, 0.1, 10, periods=300)
    assert wa == pytest.approx(10 / expected_period_time(inj, 0.1, 10, periods=300))
    assert wa > iterations_per_second_blocking(inj, 0.1, steps=300)
    assert iterations_per_second_blocking(NoImbalance(2), 0.0, steps=5) == math.inf
    sk = SkewedCompute(8, 0.05, seed=1)
    # Blocking waits for the max of 8 lognormals each step: well above the mean.
    assert expected_step_time_blocking(sk, 0.0, steps=2000) > 2 * 0.05


def test_exact_refuses_intractable() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        reference_period_max_cdf(64, 4, 50)
    assert info.value.argument == "sync_every"


def test_injector_is_abstract() -> None:
    with pytest.raises(TypeError):
        Injector(4)  # type: ignore[abstract]


# ------------------------------------------------------------- bad arguments

_REF = ReferenceImbalance(4, 0.1)


@pytest.mark.parametrize(
    "call,argument",
    [
        (lambda: ReferenceImbalance(0, 0.1), "size"),
        (lambda: ReferenceImbalance(2.0, 0.1), "size"),  # type: ignore[arg-type]
        (lambda: ReferenceImbalance(True, 0.1), "size"),  # type: ignore[arg-type]
        (lambda: ReferenceImbalance(4, -1), "delay_s"),
        (lambda: ReferenceImbalance(4, math.inf), "delay_s"),
        (lambda: ReferenceImbalance(4, "1"), "delay_s"),  # type: ignore[arg-type]
        (lambda: ReferenceImbalance(4, 0.1, count=0), "count"),
        (lambda: ReferenceImbalance(4, 0.1, seed=-2), "seed"),
        (lambda: SkewedCompute(4, -0.1), "mean_s"),
        (lambda: SkewedCompute(4, math.nan), "mean_s"),
        (lambda: SkewedCompute(4, 0.1, sigma=-1), "sigma"),
        (lambda: NoImbalance(-1), "size"),
        (lambda: _REF.delay(4, 0), "rank"),
        (lambda: _REF.delay(-1, 0), "rank"),
        (lambda: _REF.delay(0, -1), "step"),
        (lambda: _REF.delays(-1), "step"),
        (lambda: _REF.delays(1.5), "step"),  # type: ignore[arg-type]
        (lambda: _REF.slow_ranks(-1), "step"),
        (lambda: _REF.sleep(9, 0), "rank"),
        (lambda: expected_period_time(_REF, -0.1, 10), "compute_s"),
        (lambda: expected_period_time(_REF, 0.1, 0), "sync_every"),
        (lambda: expected_period_time(_REF, 0.1, 2, periods=0), "periods"),
        (lambda: expected_period_time(_REF, 0.1, 2, first_step=-1), "first_step"),
        (lambda: expected_period_time("reference:1", 0.1, 2), "injector"),  # type: ignore
        (lambda: expected_step_time_blocking(_REF, -1.0), "compute_s"),
        (lambda: expected_step_time_blocking(_REF, 0.1, steps=0), "steps"),
        (lambda: iterations_per_second_wait_avoiding(_REF, 0.1, 0), "sync_every"),
        (lambda: iterations_per_second_blocking(_REF, math.inf), "compute_s"),
        (lambda: exact_reference_period_max(0, 2, 10, 1.0), "size"),
        (lambda: exact_reference_period_max(8, 0, 10, 1.0), "count"),
        (lambda: exact_reference_period_max(8, 2, 0, 1.0), "sync_every"),
        (lambda: exact_reference_period_max(8, 2, 10, -1.0), "delay_s"),
    ],
)
def test_bad_arguments(call, argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        call()
    assert info.value.argument == argument


# ------------------------------------------- huge values, and `wagma imbalance`'s options


@pytest.mark.parametrize(
    "call,argument",
    [
        (lambda: ReferenceImbalance(4, 1e300), "delay_s"),  # time.sleep cannot take it
        (lambda: ReferenceImbalance(4, imbalance.MAX_DELAY_S * 2), "delay_s"),
        (lambda: SkewedCompute(4, 1e12), "mean_s"),
        (lambda: SkewedCompute(4, 0.1, sigma=1e155), "sigma"),  # sigma**2 overflows
        (lambda: make_injector("reference:1e300", 4), "imbalance"),
        (lambda: make_injector("skewed:0.1:1e155", 4), "imbalance"),
        (lambda: make_injector("slownode:1e300:1", 4), "imbalance"),
    ],
)
def test_huge_values_are_refused_when_built(call, argument: str) -> None:
    """A delay nobody can sleep used to be accepted and fail (OverflowError) in
    the first step that drew it, on the slow ranks only; a sigma whose square
    overflows failed in every delays() call."""
    with pytest.raises(InvalidArgumentError) as info:
        call()
    assert info.value.argument == argument


def test_largest_delay_is_accepted() -> None:
    inj = ReferenceImbalance(4, imbalance.MAX_DELAY_S, count=4)
    assert inj.delays(0).max() == imbalance.MAX_DELAY_S
    assert np.isfinite(SkewedCompute(4, 0.1, sigma=30.0).delays(3)).all()


def _bench_args(*argv: str):
    from wagma_comm.cli import build_parser

    return build_parser().parse_args(["imbalance", *argv])


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--compute", "-1", "--imbalance", "none"], "--compute"),  # was: sleep() ValueError
        (["--compute", "nan"], "--compute"),
        (["--compute", "inf", "--imbalance", "none"], "--compute"),
        (["--compute", "1e300", "--imbalance", "none"], "--compute"),
        (["--sync-every", "0"], "--sync-every"),
        (["--group-size", "-1"], "--group-size"),
        (["--elements", "0"], "--elements"),
        (["--periods", "0"], "--periods"),  # was: ZeroDivisionError after measuring
        (["--rounds", "0"], "--rounds"),  # was: StatisticsError after measuring
        (["--seed", "-1"], "--seed"),
        (["--grace", "-0.5"], "--grace"),
        (["--grace", "nan"], "--grace"),
        (["--grace", "2"], "--grace"),
        (["--methods", ","], "--methods"),  # was: an empty benchmark, exit 0
        (["--methods", "wagma,foo"], "--methods"),
        (["--methods", "allreduce,allreduce"], "--methods"),
        (["--delays", ""], "--delays"),  # was: silently the default injector
        (["--delays", ",,"], "--delays"),  # was: no measurement, exit 0
        (["--delays", "0,abc"], "--delays"),  # was: ValueError
        (["--delays", "0,-0.1"], "--delays"),
        (["--delays", "nan"], "--delays"),
        (["--delays", "0,1e300"], "--delays"),
        (["--delays", "0,0.1", "--imbalance", "skewed:0.1"], "--delays"),  # was: ignored
    ],
)
def test_bench_options_refused_before_communicating(argv: list[str], flag: str) -> None:
    """check_options needs no communicator: every rank refuses the same way."""
    from wagma_comm.bench import imbalance as bench

    with pytest.raises(InvalidArgumentError) as info:
        bench.check_options(_bench_args("--compute", "0.01", *argv))
    assert info.value.argument == flag


def test_bench_good_options_pass() -> None:
    from wagma_comm.bench import imbalance as bench

    bench.check_options(_bench_args())
    bench.check_options(_bench_args("--delays", "0, 0.02,", "--methods", "wagma, allreduce"))
    assert bench.parse_methods(" wagma ,allreduce,") == ["wagma", "allreduce"]


@pytest.mark.parametrize(
    "argv,size,flag",
    [
        (["--imbalance", ""], 4, "--imbalance"),  # was: silently the default injector
        (["--imbalance", "bogus"], 4, "--imbalance"),
        (["--imbalance", "reference:1e300"], 4, "--imbalance"),
        (["--imbalance", "slownode:0.1:4:1"], 4, "--imbalance"),  # node 1 has no ranks
        (["--delays", "0,1e300"], 4, "--delays"),
    ],
)
def test_bench_injector_specs_name_the_option(argv: list[str], size: int, flag: str) -> None:
    from wagma_comm.bench import imbalance as bench

    with pytest.raises(InvalidArgumentError) as info:
        bench.injector_specs(_bench_args(*argv), size)
    assert info.value.argument == flag


def test_bench_injector_specs() -> None:
    from wagma_comm.bench import imbalance as bench

    assert bench.injector_specs(_bench_args("--compute", "0.03"), 4) == ["reference:0.03:2"]
    assert bench.injector_specs(_bench_args("--imbalance", "none"), 4) == ["none"]
    assert bench.injector_specs(_bench_args("--delays", "0,0.5"), 4) == [
        "reference:0.0:2", "reference:0.5:2"]


def test_bench_output_problems_found_before_measuring(tmp_path) -> None:
    """Rank 0's --json/--plot that it could not write at the end: found at the start."""
    from wagma_comm.bench import imbalance as bench
    from wagma_comm.bench.outputs import output_problem

    (tmp_path / "a-file").write_text("")
    under_a_file = str(tmp_path / "a-file" / "out.json")
    problem = output_problem(bench._outputs(_bench_args("--json", under_a_file)))
    assert problem is not None and problem[1] == "--json" and "cannot create" in problem[2]
    nested = tmp_path / "new" / "dir" / "out.json"  # made, as for --plot
    assert output_problem(bench._outputs(_bench_args("--json", str(nested)))) is None
    assert nested.parent.is_dir()
    problem = output_problem(bench._outputs(_bench_args("--json", str(tmp_path))))
    assert problem is not None and problem[1] == "--json" and "directory" in problem[2]
    bad_image = str(tmp_path / "p.nosuchformat")
    problem = output_problem(bench._outputs(_bench_args("--plot", bad_image)))
    assert problem is not None and problem[1] == "--plot"
    assert output_problem(bench._outputs(_bench_args("--json", str(tmp_path / "ok.json")))) is None


# ------------------------------------------------- bounded draws, bounded memory


def test_reference_count_is_bounded_when_built() -> None:
    """A COUNT of 1e10 was accepted by make_injector and `wagma imbalance`'s
    option check, then failed mid-run on every rank (MemoryError: 74.5 GiB for
    one step's draws), naming no option."""
    from wagma_comm.bench import imbalance as bench

    with pytest.raises(InvalidArgumentError) as info:
        ReferenceImbalance(4, 0.1, count=imbalance.MAX_COUNT + 1)
    assert info.value.argument == "count"
    with pytest.raises(InvalidArgumentError, match="count") as info:
        make_injector("reference:0.1:10000000000", 4)
    assert info.value.argument == "imbalance"
    with pytest.raises(InvalidArgumentError) as info:
        bench.injector_specs(_bench_args("--imbalance", "reference:0.1:10000000000"), 4)
    assert info.value.argument == "--imbalance"
    most = make_injector(f"reference:0.1:{imbalance.MAX_COUNT}", 4)  # more draws than ranks
    assert most.slow_ranks(0) == (0, 1, 2, 3)


def test_reference_expectation_memory_does_not_grow_with_count() -> None:
    """The expectation helpers promise n * size floats per block; the reference
    injector's block also held an (n, count) table of draws, 524 MB here."""
    import tracemalloc

    inj = ReferenceImbalance(2, 0.1, count=imbalance.MAX_COUNT, seed=1)
    tracemalloc.start()
    try:
        got = expected_period_time(inj, 0.0, 1, periods=1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == pytest.approx(0.1)  # both ranks are slow at every step
    assert peak < 16 * imbalance.MAX_COUNT * 8  # one step's draws, not 1000 steps'
    block = inj._delays_block(5, 3)
    for k in range(3):
        np.testing.assert_array_equal(block[k], inj.delays(5 + k))


def test_bench_freshness_and_staleness_cover_the_timed_rounds_only() -> None:
    """Rates and waits leave the warm-up run out; the fresh share and the
    staleness histogram counted it too (3 runs' calls for 2 timed rounds).
    One process (MPI singleton): every step call lands in the histogram."""
    import json
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import json, wagma_comm
        from wagma_comm.bench import imbalance as bench
        from wagma_comm.cli import build_parser
        args = build_parser().parse_args([
            "imbalance", "--compute", "0", "--elements", "8", "--sync-every", "2",
            "--periods", "2", "--rounds", "2", "--methods", "wagma,solo,majority"])
        args.group_size = 1
        with wagma_comm.init(timeout=60) as comm:
            res = bench.measure(comm, args, "none")
        print(json.dumps({"steps": res["steps"], "hist": res["staleness_histogram"],
                          "fresh": res["fresh_share"]}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["steps"] == 4
    for m in ("wagma", "solo", "majority"):
        assert sum(res["hist"][m].values()) == 2 * 4, (m, res["hist"][m])  # 2 timed rounds
        assert res["fresh"][m] == 1.0  # one rank: always on time
