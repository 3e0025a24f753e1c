"""``wagma imbalance``: iterations per second under injected load imbalance.

Every rank runs the same loop for each method: "compute" (sleep ``c``), the
injector's extra delay for this (rank, step), then the method's collective on a
model/gradient buffer. Methods run one after another in alternating rounds, each
over the *same* injector draws (steps 0..N-1), so the machine's noise and the
imbalance hit all of them alike. Rank 0 prints iterations/s, the ratio to the
global allreduce, and the analytic expectation:

* a globally synchronous method pays ``c + E[max_r delay(r, t)]`` per step;
* a wait-avoiding method with period ``tau`` pays, per period,
  ``tau * c + E[max_r sum of delay(r, t) over the period]``: each rank
  accumulates only its own delays and only the sync round waits for the
  most-delayed rank (computed over the very draws used, and exactly for the
  reference injector).

Run it under mpiexec: ``mpiexec -n 8 wagma imbalance``.
"""

from __future__ import annotations

import argparse
import math
import pickle
import statistics
import time
from typing import Any, Callable

import numpy as np

from ..files import write_json

METHODS = ("wagma", "wagma_group_scope", "group_allreduce", "allreduce", "solo", "majority",
           "dpsgd", "local_sgd")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("imbalance", help="throughput under load imbalance (under mpiexec)",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compute", type=float, default=0.05, help="compute time c per step (s)")
    p.add_argument("--imbalance", default=None,
                   help="injector: reference:DELAY[:COUNT] | skewed:MEAN[:SIGMA] | "
                        "slownode:DELAY[:RANKS_PER_NODE[:NODE]] | none "
                        "(default: reference with DELAY = compute, COUNT = 2)")
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--group-size", type=int, default=0, help="default: half the ranks")
    p.add_argument("--elements", type=int, default=1 << 16, help="float32 model elements")
    p.add_argument("--periods", type=int, default=3, help="sync periods per measurement")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per method")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the injector and the majority allreduce's activators "
                        "(as wagma sim does)")
    p.add_argument("--grace", type=float, default=0.0,
                   help="WAGMA on one host: wait up to this fraction of the compute time for "
                        "group members one round behind (default 0, the collective's own; "
                        "docs/partial.md)")
    p.add_argument("--delays", default=None,
                   help="sweep: comma-separated reference-injector delays in seconds "
                        "(e.g. 0,0.025,0.05,0.1); one measurement per delay (not with "
                        "--imbalance)")
    p.add_argument("--json", default=None, help="write results as JSON (rank 0)")
    p.add_argument("--plot", default=None,
                   help="PNG of throughput against injected delay (with --delays)")


def parse_methods(text: str) -> list[str]:
    """``--methods``: known, distinct names, at least one."""
    from ..errors import InvalidArgumentError

    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise InvalidArgumentError("--methods", f"no method given; expected some of "
                                                f"{', '.join(METHODS)}")
    for m in methods:
        if m not in METHODS:
            raise InvalidArgumentError("--methods", f"unknown method {m!r}; expected some of "
                                                    f"{', '.join(METHODS)}")
        if methods.count(m) > 1:
            raise InvalidArgumentError("--methods", f"{m!r} given more than once")
    return methods


def check_options(args: argparse.Namespace) -> None:
    """Refuse bad options before any communication, naming the option: otherwise
    they fail mid-measurement (a negative sleep), after it (no rounds to take a
    median of), or are silently ignored (``--imbalance`` beside ``--delays``)."""
    from ..errors import InvalidArgumentError
    from ..imbalance import check_delay

    check_delay("--compute", args.compute)
    for flag, value, minimum in (("--sync-every", args.sync_every, 1),
                                 ("--group-size", args.group_size, 0),
                                 ("--elements", args.elements, 1),
                                 ("--periods", args.periods, 1),
                                 ("--rounds", args.rounds, 1),
                                 ("--seed", args.seed, 0)):
        if value < minimum:
            raise InvalidArgumentError(flag, f"must be >= {minimum}, got {value}")
    if not (math.isfinite(args.grace) and 0 <= args.grace <= 1):
        raise InvalidArgumentError(
            "--grace", f"expected a fraction of the compute time in [0, 1], got {args.grace}")
    parse_methods(args.methods)
    if args.delays is not None:
        if args.imbalance is not None:
            raise InvalidArgumentError("--delays", "sweeps the reference injector; "
                                                   "give --delays or --imbalance, not both")
        delay_list(args.delays)


def delay_list(text: str) -> list[float]:
    """``--delays``: at least one delay, each a valid sleep length."""
    from ..errors import InvalidArgumentError
    from ..imbalance import check_delay

    out = []
    for item in (d.strip() for d in text.split(",")):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            raise InvalidArgumentError("--delays", f"{item!r} is not a number") from None
        out.append(check_delay("--delays", value))
    if not out:
        raise InvalidArgumentError("--delays", f"no delay given in {text!r}")
    return out


def injector_specs(args: argparse.Namespace, size: int) -> list[str]:
    """The injector of each measurement, each checked against ``size`` ranks
    (an error names ``--imbalance`` or ``--delays``)."""
    from ..errors import InvalidArgumentError
    from ..imbalance import make_injector

    if args.delays is not None:
        flag, specs = "--delays", [f"reference:{d}:2" for d in delay_list(args.delays)]
    else:
        flag = "--imbalance"
        specs = [args.imbalance if args.imbalance is not None else f"reference:{args.compute}:2"]
    for spec in specs:
        try:
            make_injector(spec, size, seed=args.seed)
        except InvalidArgumentError as exc:
            message = str(exc).split(": ", 1)[1] if exc.argument == "imbalance" else str(exc)
            raise InvalidArgumentError(flag, message) from None
    return specs


def _outputs(args: argparse.Namespace) -> list[Any]:
    """What rank 0 writes at the end, checked before minutes of measuring."""
    from .outputs import data_file, image_file

    return [data_file("--json", args.json), image_file("--plot", args.plot)]


def check_outputs(comm: Any, args: argparse.Namespace) -> None:
    """Collective: rank 0 checks that it can write ``--json``/``--plot``; every
    rank raises the same typed error if not."""
    from .outputs import check_outputs as check

    check(comm, _outputs(args))


def _loop(comm: Any, method: str, model: np.ndarray, args: argparse.Namespace,
          injector: Any, steps: int) -> Callable[[], float]:
    """Build one measurement: returns a function that runs ``steps`` iterations
    and returns this rank's elapsed seconds."""
    group_size, tau = args.group_size, args.sync_every
    closer: Callable[[], None] = lambda: None

    if method in ("wagma", "wagma_group_scope"):
        scope = "group" if method == "wagma_group_scope" else "global"
        coll = comm.wait_avoiding_group_allreduce(model, group_size, tau, activation=scope,
                                                  grace=args.grace)

        def collective(t: int) -> None:
            coll.step(model)
    elif method in ("solo", "majority"):
        # The majority's activators follow --seed, as in wagma sim and the training
        # layer (they were always drawn from seed 0 here).
        coll = (comm.solo_allreduce(model, tau) if method == "solo"
                else comm.majority_allreduce(model, tau, seed=args.seed))

        def collective(t: int) -> None:
            coll.step(model)
    elif method == "group_allreduce":
        coll = None

        def collective(t: int) -> None:  # the same schedule, every step blocking
            if (t + 1) % tau == 0:
                comm.allreduce(model, "avg")
            else:
                comm.group_allreduce(model, group_size, t - (t + 1) // tau, "avg")
    elif method == "allreduce":
        coll = None

        def collective(t: int) -> None:
            comm.allreduce(model, "avg")
    elif method in ("dpsgd", "local_sgd"):  # the training layer's own baselines
        from ..train.methods import DPSGD, LocalSGD

        coll = None
        baseline = DPSGD() if method == "dpsgd" else LocalSGD(tau)
        baseline.setup(comm, [model])
        closer = baseline.close

        def collective(t: int) -> None:
            baseline.start(t, [model])
            baseline.finish()
    else:
        raise SystemExit(f"unknown method {method!r}; expected some of {', '.join(METHODS)}")

    waits: list[float] = []

    def run() -> float:
        comm.barrier()
        waited = 0.0
        t0 = time.perf_counter()
        for t in range(steps):
            time.sleep(args.compute)
            injector.sleep(comm.rank, t)
            c0 = time.perf_counter()
            collective(t)
            waited += time.perf_counter() - c0
        elapsed = time.perf_counter() - t0
        waits.append(waited / steps)
        if coll is not None:
            coll.flush()
        return elapsed

    run.close = coll.close if coll is not None else closer  # type: ignore[attr-defined]
    run.statistics = (lambda: coll.statistics()) if coll is not None else dict  # type: ignore[attr-defined]
    run.waits = waits  # type: ignore[attr-defined]
    return run


def comm_allgather(comm: Any, value: Any, timeout: float | None = None) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, through ``comm``'s own
    collectives: their timeout turns a rank that stopped into an error naming
    it (a plain MPI allgather would wait forever). Two exact sum-allreduces:
    the sizes, then a table that is zero outside each rank's row."""
    blob = np.frombuffer(pickle.dumps(value), dtype=np.uint8)
    sizes = np.zeros(comm.size, dtype=np.int64)
    sizes[comm.rank] = blob.size
    comm.allreduce(sizes, "sum", timeout=timeout)
    table = np.zeros((comm.size, int(sizes.max())), dtype=np.uint8)
    table[comm.rank, :blob.size] = blob
    comm.allreduce(table, "sum", timeout=timeout)
    return [pickle.loads(table[r, :sizes[r]].tobytes()) for r in range(comm.size)]


def measure(comm: Any, args: argparse.Namespace, spec: str) -> dict[str, Any]:
    """One measurement of every method under the injector ``spec``; the
    returned summary (rates, expectations, waits, staleness) is the same on
    every rank."""
    from wagma_comm import imbalance as imb
    from wagma_comm.errors import InvalidArgumentError

    P = comm.size
    injector = imb.make_injector(spec, P, seed=args.seed)
    steps = args.periods * args.sync_every
    methods = parse_methods(args.methods)
    model = np.zeros(args.elements, dtype=np.float32)
    loops = {m: _loop(comm, m, model, args, injector, steps) for m in methods}
    samples: dict[str, list[float]] = {m: [] for m in methods}
    for m in methods:  # warm-up: kernels JIT-compiled, schedules and channels made
        loops[m]()
    # statistics() counts from creation: what the warm-up counted is taken off
    # below, so freshness and staleness cover the timed rounds, as rates and waits do.
    warm = {m: loops[m].statistics() for m in methods}  # type: ignore[attr-defined]
    for r in range(args.rounds):
        order = methods if r % 2 == 0 else list(reversed(methods))
        for m in order:
            samples[m].append(loops[m]())
    fresh: dict[str, float | None] = {}
    staleness: dict[str, dict[int, int]] = {}
    waits: dict[str, list[float]] = {}
    for m, loop in loops.items():
        stats, before = loop.statistics(), warm[m]  # type: ignore[attr-defined]
        mine = tuple(stats.get(k, 0) - before.get(k, 0)
                     for k in ("fresh_contributions", "stale_contributions"))
        f, s = (sum(v) for v in zip(*comm_allgather(comm, mine)))
        fresh[m] = f / (f + s) if f + s else None  # share of contributions that were current
        warm_hist = before.get("staleness_histogram", {})
        timed = {k: v - warm_hist.get(k, 0)
                 for k, v in stats.get("staleness_histogram", {}).items()}
        merged: dict[int, int] = {}
        for hist in comm_allgather(comm, {k: v for k, v in timed.items() if v}):
            for k, v in hist.items():
                merged[int(k)] = merged.get(int(k), 0) + int(v)
        staleness[m] = dict(sorted(merged.items()))
        # Mean seconds per iteration inside the collective, per rank (timed rounds).
        waits[m] = comm_allgather(comm, statistics.median(loop.waits[1:]))  # type: ignore[attr-defined]
        loop.close()  # type: ignore[attr-defined]

    rates: dict[str, float] = {}
    for m in methods:  # a run lasts until its slowest rank is done
        per_round = [max(comm_allgather(comm, v)) for v in samples[m]]
        rates[m] = steps / statistics.median(per_round)
    blocking = imb.iterations_per_second_blocking(injector, args.compute, steps=steps)
    waitavoid = imb.iterations_per_second_wait_avoiding(
        injector, args.compute, args.sync_every, periods=args.periods)
    exact = None
    if isinstance(injector, imb.ReferenceImbalance) and injector.delay_s > 0:
        try:
            period = (args.sync_every * args.compute + imb.exact_reference_period_max(
                P, injector.count, args.sync_every, injector.delay_s))
            exact = args.sync_every / period
        except InvalidArgumentError:  # intractable here (EXACT_WORK_LIMIT): simulated only
            exact = None
    expected = {m: (blocking if m == "allreduce" else
                    waitavoid if m in ("wagma", "wagma_group_scope", "solo") else None)
                for m in methods}
    return {"ranks": P, "compute_s": args.compute, "injector": injector.spec,
            "delay_s": getattr(injector, "delay_s", None),
            "sync_every": args.sync_every, "group_size": args.group_size,
            "grace": args.grace, "elements": args.elements, "seed": args.seed,
            "steps": steps, "rounds": args.rounds,
            "rates": rates, "expected": expected, "fresh_share": fresh,
            "wait_per_iteration_s": waits, "staleness_histogram": staleness,
            "expected_wait_avoiding": waitavoid, "expected_wait_avoiding_exact": exact,
            "expected_blocking": blocking, "samples_s": samples}


def print_result(res: dict[str, Any]) -> None:
    """Rank 0's table: it/s, expectations, freshness, waits per rank, staleness."""
    rates, expected, fresh = res["rates"], res["expected"], res["fresh_share"]
    base = rates.get("allreduce")
    print(f"# wagma imbalance: {res['ranks']} ranks, compute {res['compute_s'] * 1e3:g} ms, "
          f"injector {res['injector']}, sync_every {res['sync_every']}, group_size "
          f"{res['group_size']}, grace {res['grace']:g}, {res['elements']} x float32, "
          f"{res['steps']} steps x "
          f"{res['rounds']} rounds (median)")
    exact = res["expected_wait_avoiding_exact"]
    print(f"# expected it/s over these draws: wait-avoiding {res['expected_wait_avoiding']:.2f}"
          + (f" (exact for this injector: {exact:.2f})" if exact else "")
          + f", globally synchronous {res['expected_blocking']:.2f}")
    print(f"{'method':>18} {'it/s':>8} {'vs allreduce':>13} {'expected':>9} "
          f"{'of expected':>12} {'fresh':>6}")
    for m, rate in rates.items():
        ratio = f"{rate / base:.2f}x" if base else "-"
        exp = expected[m]
        print(f"{m:>18} {rate:8.2f} {ratio:>13} {(f'{exp:.2f}' if exp else '-'):>9} "
              f"{(f'{100 * rate / exp:.0f}%' if exp else '-'):>12} "
              f"{(f'{100 * fresh[m]:.0f}%' if fresh[m] is not None else '-'):>6}")
    print("# wait per iteration inside the collective, ms, per rank 0..P-1")
    for m, per_rank in res["wait_per_iteration_s"].items():
        print(f"{m:>18} " + " ".join(f"{1e3 * w:6.1f}" for w in per_rank))
    print("# staleness histogram over all ranks' calls {staleness: calls}")
    for m, hist in res["staleness_histogram"].items():
        if hist:
            print(f"{m:>18} {hist}")


def run(args: argparse.Namespace) -> int:
    import wagma_comm
    from wagma_comm import groups

    check_options(args)
    comm = wagma_comm.init()
    try:
        if not args.group_size:
            args.group_size = max(1, comm.size // 2)
        groups.check_group_size(comm.size, args.group_size, "--group-size")
        specs = injector_specs(args, comm.size)
        check_outputs(comm, args)
    except BaseException:
        comm.close()
        raise
    results = []
    for spec in specs:
        res = measure(comm, args, spec)
        results.append(res)
        if comm.rank == 0:
            print_result(res)
            print(flush=True)
    if comm.rank == 0:
        if args.json:
            write_json(args.json, results[0] if len(results) == 1 else {"sweep": results})
        if args.plot:
            from .plot import plot_imbalance, points_from_imbalance

            points, meta = points_from_imbalance(results)
            plot_imbalance(points, args.plot, meta=meta)
            print(f"# plot written to {args.plot}", flush=True)
    comm.close()
    return 0
