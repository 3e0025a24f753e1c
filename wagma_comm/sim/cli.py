"""``wagma sim`` and ``wagma plan``: the simulator's command lines.

``wagma sim`` simulates training iterations of every method for one or more
job sizes (``--ranks 64,256,1024``) under a cost model (``--cost FILE`` from
``--calibrate``, or a preset: ``gpu-cluster``, ``zero``). ``--calibrate``
(under mpiexec/srun) measures the cost model and writes it; ``--validate
FILE`` re-simulates a ``wagma imbalance --json`` measurement and compares.
``wagma plan`` recommends a group size and sync period.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, replace
from typing import Any

from ..bench.plot import human_bytes
from ..errors import InvalidArgumentError
from ..files import write_json
from .collectives import Collectives
from .cost import CostModel
from .training import METHODS, PARTIAL, Workload, simulate

VALIDATION_TOLERANCE = 0.20  # simulated it/s within 20% of measured (issue #8)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values:  # "," or "": nothing would run (or a default would stand in silently)
        raise argparse.ArgumentTypeError(f"expected at least one int, got {text!r}")
    return values


def _workload_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost", default="gpu-cluster",
                   help="cost model: a JSON file from --calibrate, or a preset "
                        "(gpu-cluster, zero); default gpu-cluster")
    p.add_argument("--elements", type=int, default=None, help="model elements")
    p.add_argument("--model-mb", type=float, default=100.0,
                   help="model size in MB (1e6 bytes) when --elements is not given")
    p.add_argument("--itemsize", type=int, default=4, help="bytes per element")
    p.add_argument("--compute", type=float, default=0.2, help="compute seconds per step")
    p.add_argument("--imbalance", default="reference:0.32:2",
                   help="injector: none | reference:DELAY[:COUNT] | skewed:MEAN[:SIGMA] "
                        "| slownode:DELAY[:RANKS_PER_NODE[:NODE]]")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--algorithm", default=None,
                   help="force an allreduce algorithm (default: the runtime's choice)")


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("sim", help="simulate methods at any scale (no MPI needed)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _workload_options(p)
    p.add_argument("--ranks", type=_int_list, default=[64], help="job sizes, e.g. 64,256,1024")
    p.add_argument("--group-size", type=int, default=8,
                   help="WAGMA group size, capped at the job size (0: half the ranks)")
    p.add_argument("--sync-every", type=int, default=10,
                   help="WAGMA's global average period in iterations")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated (default: all of {','.join(METHODS)}, less "
                        "the partial collectives under --algorithm native)")
    p.add_argument("--json", default=None, help="write the results as JSON")
    p.add_argument("--plot", default=None, help="PNG of it/s against ranks (several --ranks)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the cost model here (run under mpiexec/srun)")
    p.add_argument("--out", default="cost.json", help="where --calibrate writes")
    p.add_argument("--repeats", type=int, default=30, help="--calibrate repetitions")
    p.add_argument("--validate", default=None, metavar="MEASURED.json",
                   help="compare with a `wagma imbalance --json` measurement")

    q = sub.add_parser("plan", help="recommend a group size and sync period",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _workload_options(q)
    q.add_argument("--ranks", type=int, required=True)
    q.add_argument("--group-sizes", type=_int_list, default=None,
                   help="candidates (default: powers of two up to 64)")
    q.add_argument("--sync-periods", type=_int_list, default=[5, 10, 20, 40])
    q.add_argument("--tolerance", type=float, default=0.05,
                   help="throughput within this fraction of the best counts as equal")
    q.set_defaults(steps=200)


def _elements(args: argparse.Namespace) -> int:
    """Model elements from ``--elements``, else ``--model-mb`` / ``--itemsize``;
    a size that cannot be one is refused naming its option (the Workload
    checks ``--elements`` itself)."""
    if isinstance(args.itemsize, bool) or not isinstance(args.itemsize, int) \
            or args.itemsize < 1:
        raise InvalidArgumentError("itemsize", f"expected an int >= 1, got {args.itemsize!r}")
    if args.elements is not None:
        return args.elements
    mb = args.model_mb
    if not isinstance(mb, (int, float)) or not math.isfinite(mb) or mb < 0:
        raise InvalidArgumentError("model_mb", f"expected finite MB >= 0, got {mb!r}")
    return int(mb * 1e6) // args.itemsize


def _methods(text: str | None, algorithm: str | None) -> list[str]:
    """The methods to simulate. Partial collectives never run native rounds,
    so ``--algorithm native`` leaves them out of the default list (saying so)
    and refuses them when ``--methods`` names them, before simulating: they
    used to fail after the allreduce methods had run."""
    native = algorithm == "native"
    if text is None:
        methods = [m for m in METHODS if not (native and m in PARTIAL)]
        if native:
            print(f"# --algorithm native: {', '.join(PARTIAL)} left out (partial "
                  "collectives never run native rounds)")
        return methods
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise InvalidArgumentError("methods", f"unknown {unknown}; expected some of "
                                   f"{', '.join(METHODS)}")
    partial = [m for m in methods if m in PARTIAL]
    if native and partial:
        raise InvalidArgumentError("methods", f"{partial} never run native rounds (their "
                                   "results must be bitwise identical on every member); "
                                   "drop them or --algorithm native")
    return methods


def print_table(size: int, w: Workload, cost: CostModel, results: dict[str, Any]) -> None:
    base = results.get("allreduce")
    print(f"# wagma sim: {size} ranks ({cost.ranks_per_node} per node), model "
          f"{human_bytes(w.elements * w.itemsize)}, compute {w.compute_s * 1e3:g} ms, "
          f"injector {w.imbalance}, group {w.group}, sync every {w.sync_every}, "
          f"{w.steps} steps, cost model {cost.name}")
    print(f"{'method':>18} {'it/s':>8} {'vs allreduce':>12} {'wait ms':>8} {'fresh':>6} "
          f"{'msgs/it':>8} {'bytes/it':>10} {'sim s':>6}  staleness")
    for m, r in results.items():
        ratio = f"{r.iterations_per_s / base.iterations_per_s:.2f}x" if base else "-"
        fresh = f"{100 * r.fresh_share:.0f}%" if r.fresh_share is not None else "-"
        hist = r.staleness_histogram
        print(f"{m:>18} {r.iterations_per_s:8.3f} {ratio:>12} {1e3 * r.mean_wait_s:8.2f} "
              f"{fresh:>6} {r.messages_per_iteration:8.1f} "
              f"{human_bytes(r.bytes_per_iteration):>10} {r.simulated_in_s:6.1f}  "
              f"{hist if hist else ''}")


def _check_outputs(args: argparse.Namespace, plot: bool) -> None:
    """Refuse ``--json`` (and ``--plot``) before simulating when they could
    not be written at the end: a sweep at thousands of ranks takes minutes."""
    from ..bench.plot import check_image_path, check_output_path

    if args.json is not None:
        check_output_path(args.json, "--json")
    if plot and args.plot is not None:
        check_image_path(args.plot, "--plot")


def run_sim(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    cost = CostModel.load(args.cost)
    if args.validate:
        _check_outputs(args, plot=False)
        return _validate(args, cost)
    _check_outputs(args, plot=True)
    methods = _methods(args.methods, args.algorithm)
    out = []
    workloads = [_workload(size, _elements(args), args.compute, args.imbalance, args.steps,
                           min(args.group_size, size), args.sync_every, args.itemsize,
                           args.seed, args.algorithm)
                 for size in args.ranks]  # every one checked before any is simulated
    for size, w in zip(args.ranks, workloads):
        lib = Collectives(size, cost, w.itemsize, w.algorithm)
        results = {m: simulate(m, w, cost, lib) for m in methods}
        print_table(size, w, cost, results)
        print(flush=True)
        out.append({"ranks": size, "workload": asdict(w), "cost_model": cost.to_dict(),
                    "results": {m: r.to_dict() for m, r in results.items()}})
    if args.json:
        write_json(args.json, {"runs": out})
    if args.plot:
        from .plots import plot_scale

        plot_scale(out, args.plot)
        print(f"# plot written to {args.plot}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import wagma_comm

    from .calibrate import calibrate, check_repeats

    check_repeats(args.repeats)  # before init(), which communicates

    comm = wagma_comm.init()
    try:
        _check_out(comm, args.out)
        t0 = time.perf_counter()
        model, raw = calibrate(comm, repeats=args.repeats)
        if comm.rank == 0:
            model.save(args.out, {"measurements": raw})
            print(f"# wagma sim --calibrate: {raw['ranks']} ranks, "
                  f"{raw['ranks_per_node']} per node, {time.perf_counter() - t0:.1f} s")
            print_cost(model)
            for key in ("intra_node", "inter_node"):
                if key in raw:
                    print(f"# note: {key}: {raw[key]}")
            print(f"# fitted: per-op overhead, and ping-pong bandwidth / "
                  f"{raw['contention_factor']:.2f} (every rank communicating at once)")
            print("# group_allreduce (sum, float32): measured vs simulated with this model")
            for row in raw["group_allreduce"]:
                print(f"  group of {row['group_size']:>4}, {row['bytes']:>8} B: "
                      f"{1e6 * row['measured_s']:10.1f} us measured, "
                      f"{1e6 * row['simulated_s']:10.1f} us simulated "
                      f"({row['simulated_s'] / row['measured_s']:.2f}x)")
            print(f"# written to {args.out}")
    finally:
        comm.close()
    return 0


def _check_out(comm: Any, path: str) -> None:
    """Collective: rank 0 checks it can write ``--out`` before minutes of
    measuring; every rank raises the same typed error if not."""
    from ..bench.imbalance import comm_allgather
    from ..bench.plot import check_output_path

    problem = None
    if comm.rank == 0:
        try:
            check_output_path(path, "--out")
        except InvalidArgumentError as exc:
            problem = str(exc).removeprefix("--out: ")
    problem = comm_allgather(comm, problem)[0]
    if problem is not None:
        raise InvalidArgumentError("--out", problem)


def print_cost(model: CostModel) -> None:
    rows = [("latency intra-node", f"{model.latency_intra_s * 1e6:.2f} us"),
            ("latency inter-node", f"{model.latency_inter_s * 1e6:.2f} us"),
            ("bandwidth intra-node", f"{model.bandwidth_intra / 1e9:.2f} GB/s"),
            ("bandwidth inter-node", f"{model.bandwidth_inter / 1e9:.2f} GB/s"),
            ("reduce", f"{1 / model.reduce_s_per_byte / 1e9:.2f} GB/s of input"
             if model.reduce_s_per_byte else "free"),
            ("copy", f"{1 / model.copy_s_per_byte / 1e9:.2f} GB/s" if model.copy_s_per_byte
             else "free"),
            ("per-op overhead", f"{model.op_overhead_s * 1e6:.1f} us"),
            ("per-call overhead", f"{model.call_overhead_s * 1e6:.1f} us"),
            ("ranks per node", str(model.ranks_per_node))]
    for name, value in rows:
        print(f"  {name:>22}: {value}")


# The command-line option behind each Workload field, for errors.
_OPTION_OF = {"size": "--ranks", "elements": "--elements", "compute_s": "--compute",
              "imbalance": "--imbalance", "steps": "--steps", "group_size": "--group-size",
              "sync_every": "--sync-every", "itemsize": "--itemsize", "seed": "--seed",
              "algorithm": "--algorithm"}


def _workload(*fields: Any) -> Workload:
    """A Workload from the command line: its errors name the option
    (``--ranks``), not the field behind it (``size``)."""
    try:
        return Workload(*fields)
    except InvalidArgumentError as exc:
        option = _OPTION_OF.get(exc.argument)
        if option is None:
            raise
        raise InvalidArgumentError(
            option, str(exc).removeprefix(f"{exc.argument}: ")) from None


_MEASUREMENT_KEYS = ("ranks", "elements", "compute_s", "injector", "steps", "group_size",
                     "sync_every", "rates")


def _measurements(path: str) -> list[dict[str, Any]]:
    """The measurements in a ``wagma imbalance --json`` file: one, or every
    entry of a ``--delays`` sweep (``{"sweep": [...]}``)."""
    try:
        with open(path) as fh:
            res = json.load(fh)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError("validate", f"cannot read {path!r}: {exc}") from None
    found = res.get("sweep", [res]) if isinstance(res, dict) else None
    if not isinstance(found, list) or not found:
        raise InvalidArgumentError("validate", f"{path!r} is not a `wagma imbalance --json` "
                                   "file (expected an object, or {\"sweep\": [...]})")
    for k, m in enumerate(found):
        missing = [key for key in _MEASUREMENT_KEYS if not isinstance(m, dict) or key not in m]
        if missing:
            where = f" (sweep entry {k})" if "sweep" in res else ""
            raise InvalidArgumentError("validate", f"{path!r}{where} lacks {', '.join(missing)}:"
                                       " not a `wagma imbalance --json` measurement")
        rates = m["rates"]
        bad = (not isinstance(rates, dict) or not rates
               or any(method not in METHODS or isinstance(r, bool)
                      or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0
                      for method, r in rates.items()))
        if bad:  # a ratio to 0, NaN or a method we cannot simulate means nothing
            where = f" (sweep entry {k})" if "sweep" in res else ""
            raise InvalidArgumentError("validate", f"{path!r}{where}: rates must map some of "
                                       f"{', '.join(METHODS)} to measured it/s > 0, got "
                                       f"{rates!r}")
    return found


def _validate(args: argparse.Namespace, cost: CostModel) -> int:
    """Simulate what ``wagma imbalance --json`` measured, method by method
    (every measurement of a ``--delays`` sweep in turn)."""
    measurements = _measurements(args.validate)
    out = [_validate_one(res, cost) for res in measurements]
    if args.json:
        write_json(args.json, out[0] if len(out) == 1 else {"sweep": out})
    return 0


def _validate_one(res: dict[str, Any], cost: CostModel) -> dict[str, Any]:
    w = Workload(res["ranks"], res["elements"], res["compute_s"], res["injector"],
                 res["steps"], res["group_size"], res["sync_every"], 4, res.get("seed", 0))
    lib = Collectives(w.size, cost, 4)
    print(f"# validation: {w.size} ranks, compute {w.compute_s * 1e3:g} ms, injector "
          f"{w.imbalance}, group {w.group}, sync every {w.sync_every}, {w.steps} steps, "
          f"{w.elements} x float32; cost model {cost.name}")
    if res.get("grace"):
        print(f"# note: measured with grace {res['grace']:g}; the simulator does not model "
              "the grace (it simulates 0)")
    print(f"{'method':>18} {'measured it/s':>14} {'simulated':>10} {'sim/meas':>9} "
          f"{'within 20%':>11}")
    rounds = res.get("rounds")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        rounds = None  # an older file: the partial methods from round 0, as before
        print("# note: the file does not say how many timed rounds it took; partial "
              "collectives simulated from round 0")
    ok = True
    rows = []
    for m, measured in res["rates"].items():
        simulated = _measured_rate(m, w, cost, lib, rounds)
        ratio = simulated / measured
        good = abs(ratio - 1) <= VALIDATION_TOLERANCE
        ok &= good
        rows.append({"method": m, "measured": measured, "simulated": simulated,
                     "ratio": ratio, "pass": good})
        print(f"{m:>18} {measured:14.2f} {simulated:10.2f} {ratio:9.3f} "
              f"{'PASS' if good else 'FAIL':>11}")
    print(f"# {'all within' if ok else 'NOT all within'} {VALIDATION_TOLERANCE:.0%}")
    return {"workload": asdict(w), "cost_model": cost.to_dict(), "rows": rows}


def _measured_rate(method: str, w: Workload, cost: CostModel, lib: Collectives,
                   rounds: int | None) -> float:
    """The it/s ``wagma imbalance`` reports for ``method``: ``steps`` over the
    median of its timed runs. Each run replays the same injector draws and the
    blocking methods restart at step 0, but a partial collective lives through
    the warm-up and every timed run, so timed run k (1..rounds) is its rounds
    k * steps onward: other majority activators and group steps than round 0's
    (before session 47 every method was simulated from round 0)."""
    if method not in PARTIAL or rounds is None:
        return simulate(method, w, cost, lib).iterations_per_s
    spans = [simulate(method, replace(w, first_round=k * w.steps), cost, lib).makespan_s
             for k in range(1, rounds + 1)]
    span = statistics.median(spans)
    return w.steps / span if span > 0 else float("inf")


def run_plan(args: argparse.Namespace) -> int:
    from .plan import plan

    cost = CostModel.load(args.cost)
    if args.algorithm == "native":  # checked before minutes of simulation
        raise InvalidArgumentError("algorithm", "wagma plan simulates WAGMA-SGD, whose "
                                   "partial collectives never run native rounds")
    w = _workload(args.ranks, _elements(args), args.compute, args.imbalance, args.steps,
                  0, 10, args.itemsize, args.seed, args.algorithm)
    t0 = time.perf_counter()
    candidates, chosen = plan(w, cost, args.group_sizes, args.sync_periods, args.tolerance)
    base = simulate("allreduce", w, cost)
    print(f"# wagma plan: {w.size} ranks ({cost.ranks_per_node} per node), model "
          f"{human_bytes(w.elements * w.itemsize)}, compute {w.compute_s * 1e3:g} ms, injector "
          f"{w.imbalance}, {w.steps} steps, cost model {cost.name}")
    print(f"# global allreduce SGD for reference: {base.iterations_per_s:.3f} it/s")
    print(f"{'group':>6} {'sync':>5} {'it/s':>8} {'vs allreduce':>12} {'mixing it':>9} "
          f"{'wait ms':>8} {'fresh':>6}")
    for c in candidates:
        mark = "  <- recommended" if c == chosen else ""
        fresh = f"{100 * c.fresh_share:.0f}%" if c.fresh_share is not None else "-"
        print(f"{c.group_size:>6} {c.sync_every:>5} {c.iterations_per_s:8.3f} "
              f"{c.iterations_per_s / base.iterations_per_s:11.2f}x "
              f"{c.mixing_iterations:>9g} {1e3 * c.mean_wait_s:8.2f} {fresh:>6}{mark}")
    print(f"# recommended: group size {chosen.group_size}, sync every {chosen.sync_every} "
          f"({chosen.iterations_per_s:.3f} it/s; every model mixed with all others after "
          f"{chosen.mixing_iterations:g} iterations); rule: fastest mixing among "
          f"candidates within {args.tolerance:.0%} of the best throughput "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0
