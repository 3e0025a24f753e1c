"""``wagma demo``: WAGMA-SGD against its baselines on a real classifier.

Every rank trains the same small MLP on scikit-learn's handwritten digits
(1,797 8x8 images shipped inside the package: nothing is downloaded), each rank
on its own shard, once per method and seed, under the reference load-imbalance
injector (at every step two ranks drawn at random sleep ``DELAY``). A step's
"compute" is the real forward/backward plus a sleep of ``--compute`` seconds,
so the run fits a small machine while the imbalance stays comparable to it.

Rank 0 snapshots its own replica (a copy, a few microseconds) after every step,
or every ``steps // 300``-th in runs of 600 steps or more, and evaluates the
snapshots after the run, so evaluation never slows training.
It prints one line per run, then a table averaged over the seeds: final test
accuracy (after a final global average of the models), wall-clock time to reach
``--target`` accuracy, iterations/s and mean wait per iteration; and it saves
a plot of test accuracy against wall-clock time.

Run under MPI (``mpiexec -n 8 wagma demo``), or as ``wagma demo --ranks 8``,
which starts mpiexec itself.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from .files import write_atomically, write_json
from .train.methods.averaging import WAGMA_GRACE

DEFAULT_METHODS = ("allreduce", "local_sgd", "dpsgd", "sgp", "solo", "majority", "wagma",
                   "ad_psgd")
_LAUNCH_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
               "MPI_LOCALNRANKS")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="train a digits classifier with WAGMA-SGD and the "
                       "baselines under load imbalance (under mpiexec, or --ranks N)",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8,
                   help="ranks to start when not already under mpiexec (default 8)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma-separated, from: " + ", ".join(DEFAULT_METHODS))
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=64, help="hidden units of the MLP")
    p.add_argument("--group-size", type=int, default=0,
                   help="WAGMA group size (default: 2**ceil(log2(sqrt(P))))")
    p.add_argument("--sync-every", type=int, default=10,
                   help="WAGMA/eager sync period, local SGD averaging period")
    p.add_argument("--activation", choices=("global", "group"), default="group",
                   help="WAGMA activation scope (docs/partial.md; default group: measured "
                        "faster here, docs/training.md)")
    p.add_argument("--round-start", choices=("gradient", "iteration", "publish"),
                   default="publish",
                   help="when a WAGMA round starts: at the first member's gradient (models "
                        "published at the start of the iteration), at the first member's "
                        "iteration start, or once every member published (docs/training.md)")
    p.add_argument("--grace", type=float, default=WAGMA_GRACE,
                   help="shared-memory WAGMA: the first member of a round waits up to this "
                        "fraction of its compute time for members one round behind "
                        f"(0: never waits; default {WAGMA_GRACE:g}; docs/training.md)")
    p.add_argument("--shards", choices=("iid", "label"), default="iid",
                   help="iid: a random 1/P of the training set per rank; label: sorted "
                        "by label, so each rank sees only one or two classes")
    p.add_argument("--compute", type=float, default=0.01,
                   help="simulated compute per step, seconds (on top of the real one)")
    p.add_argument("--imbalance", default=None,
                   help="reference:DELAY[:COUNT] | skewed:MEAN[:SIGMA] | "
                        "slownode:DELAY[:RANKS_PER_NODE[:NODE]] | none "
                        "(default: reference with DELAY = --compute, COUNT = 2)")
    p.add_argument("--target", type=float, default=0.95,
                   help="test accuracy for the time-to-accuracy column (default 0.95)")
    p.add_argument("--plot", default="build/demo/accuracy.png", help="PNG to write")
    p.add_argument("--json", default=None, help="write all measurements as JSON")
    p.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where model, data and buckets live; cuda: each rank on its node's "
                        "GPU (local rank modulo GPUs), buckets on the GPU (docs/gpu.md)")


# ----------------------------------------------------------------------- data and model


@dataclass
class Data:
    x_train: Any
    y_train: Any
    x_test: Any
    y_test: Any


def load_data(device: Any = "cpu") -> Data:
    """scikit-learn's digits, standardised, a fixed stratified 80/20 split (the
    test set is the same for every method and seed), on ``device``."""
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int64)
    rng = np.random.default_rng(12345)
    test = np.concatenate([rng.permutation(np.nonzero(y == c)[0])[:len(np.nonzero(y == c)[0])
                                                                   // 5] for c in range(10)])
    train = np.setdiff1d(np.arange(len(y)), test)
    mean, std = x[train].mean(0), x[train].std(0) + 1e-3
    x = (x - mean) / std
    return Data(*(torch.from_numpy(a).to(device) for a in (x[train], y[train], x[test],
                                                           y[test])))


def make_shard(labels: np.ndarray, rank: int, size: int, seed: int, kind: str) -> np.ndarray:
    """This rank's training indices; every rank gets ``len // size`` of them.
    ``iid``: a seeded random split. ``label``: the indices sorted by label
    (random within a label) cut into ``size`` contiguous pieces, the usual
    non-iid setting of decentralized learning."""
    n = len(labels)
    perm = np.random.default_rng(seed).permutation(n)
    if kind == "label":
        perm = perm[np.argsort(labels[perm], kind="stable")]
        per = n // size
        return perm[rank * per:(rank + 1) * per]
    return perm[rank::size][:n // size]


def make_model(hidden: int) -> Any:
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def make_trainer(comm: Any, method: str, seed: int, o: argparse.Namespace,
                 device: Any = "cpu") -> tuple[Any, Any]:
    """Collective: the demo's model (seeded) on ``device`` and its wrapped SGD
    optimizer for ``method``, from the demo's options (also used by
    bench/step_wait.py and bench/gpu/train_step.py). CUDA parameters get
    device buckets where the method allows (``buckets="auto"``)."""
    import torch

    from .train import DistributedOptimizer

    torch.manual_seed(seed)
    model = make_model(o.hidden).to(device)
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum), comm, method,
        model=model, group_size=o.group_size or None, sync_every=o.sync_every, seed=seed,
        activation=o.activation, round_start=o.round_start, grace=o.grace)
    return model, opt


def accuracy(model: Any, x: Any, y: Any) -> float:
    import torch

    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


# ----------------------------------------------------------------------------- one run


@dataclass
class Run:
    method: str
    seed: int
    iterations: int
    elapsed_s: float  # slowest rank, start to end of the final average
    mean_wait_s: float  # per iteration, averaged over ranks
    final_accuracy: float
    times: list[float] = field(default_factory=list)  # rank 0's snapshots
    accuracies: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # iterations done at each snapshot
    fresh_share: float | None = None  # partial collectives: contributions on time
    describe: str = ""
    buckets: str = ""  # where the collectives ran: "device" (GPU) or "host" buckets

    @property
    def iterations_per_s(self) -> float:
        return self.iterations / self.elapsed_s if self.elapsed_s > 0 else float("inf")


def first_reaching(xs: Sequence[Any], accuracies: Sequence[float], target: float) -> Any:
    """The ``xs`` entry (time or step) of the first snapshot at or above
    ``target``; None if none reached it."""
    for x, a in zip(xs, accuracies):
        if a >= target:
            return x
    return None


def _gather_sum(comm: Any, values: Sequence[float], op: str = "sum") -> np.ndarray:
    arr = np.array(values, dtype=np.float64)
    comm.allreduce(arr, op)
    return arr


def train(comm: Any, method: str, seed: int, data: Data, o: argparse.Namespace,
          injector: Any, iterations: int | None = None, live: bool = False) -> Run:
    """Collective: one training run of ``method`` from ``seed``; every rank
    returns the same Run (snapshots only on rank 0)."""
    import torch
    import torch.nn.functional as F

    P, rank = comm.size, comm.rank
    device = data.x_train.device
    model, opt = make_trainer(comm, method, seed, o, device)
    shard = make_shard(data.y_train.cpu().numpy(), rank, P, seed, o.shards)
    per_epoch = max(1, len(shard) // o.batch)
    total = iterations if iterations is not None else o.epochs * per_epoch
    rng = np.random.default_rng([seed, rank])
    # Rank 0 copies its model only at the steps it evaluates (at most ~300 per
    # run): a copy after every step grew with the run's length (GPU memory
    # with --device cuda), and all but ~300 were dropped unevaluated.
    stride = max(1, total // 300)
    snaps: list[tuple[int, float, Any]] = []  # (iterations done, time, weights)
    vec = torch.nn.utils.parameters_to_vector
    comm.barrier()
    t0 = time.perf_counter()
    order = shard
    for t in range(total):
        k = t % per_epoch
        if k == 0:
            order = shard[rng.permutation(len(shard))]
        idx = torch.from_numpy(order[k * o.batch:(k + 1) * o.batch]).to(device)
        opt.zero_grad()  # start of the iteration: model averaging starts here
        if o.compute > 0:  # the simulated part of forward/backward, and the injector
            time.sleep(o.compute)
        injector.sleep(rank, t)
        F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
        opt.step()
        if rank == 0:
            if t % stride == 0 or t == total - 1:
                snaps.append((t + 1, time.perf_counter() - t0,
                              vec(model.parameters()).detach()))  # a new tensor
            if live and t % 10 == 0:
                sys.stdout.write(f"\r  {method} seed {seed}: step {t + 1}/{total}")
                sys.stdout.flush()
    opt.finalize()
    elapsed = time.perf_counter() - t0
    stats = opt.statistics()
    describe = opt.method.describe()
    opt.close()
    final = accuracy(model, data.x_test, data.y_test)
    worst = _gather_sum(comm, [elapsed], "max")[0]
    wait = _gather_sum(comm, [stats["mean_wait_s"]])[0] / P
    coll = stats.get("collective") or {}
    fresh = _gather_sum(comm, [coll.get("fresh_contributions", 0),
                               coll.get("stale_contributions", 0)])
    run = Run(method, seed, total, float(worst), float(wait), final, describe=describe,
              buckets=stats["buckets"],
              fresh_share=float(fresh[0] / fresh.sum()) if fresh.sum() else None)
    if rank == 0:
        if live:
            sys.stdout.write("\r" + " " * 60 + "\r")
        probe = make_model(o.hidden).to(device)
        for done, t, v in snaps:
            torch.nn.utils.vector_to_parameters(v, probe.parameters())
            run.times.append(t)
            run.steps.append(done)
            run.accuracies.append(accuracy(probe, data.x_test, data.y_test))
        run.times.append(elapsed)  # the finalised model closes the curve
        run.steps.append(total)
        run.accuracies.append(final)
    return run


# ------------------------------------------------------------------------- reporting


@dataclass
class Row:
    method: str
    final_accuracy: float
    final_sd: float
    time_to_target: float | None
    reached: int
    seeds: int
    iterations_per_s: float
    mean_wait_s: float
    iterations_to_target: float | None = None
    fresh_share: float | None = None


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summarize(runs: Sequence[Run], target: float) -> list[Row]:
    """One row per method (in first-run order), averaged over its seeds. Time to
    target is the mean over seeds that reached it (``reached`` says how many)."""
    methods = list(dict.fromkeys(r.method for r in runs))
    rows = []
    for m in methods:
        rs = [r for r in runs if r.method == m]
        accs = [r.final_accuracy for r in rs]
        times = [tt for tt in (first_reaching(r.times, r.accuracies, target) for r in rs)
                 if tt is not None]
        rows.append(Row(m, statistics.fmean(accs),
                        statistics.stdev(accs) if len(accs) > 1 else 0.0,
                        statistics.fmean(times) if times else None, len(times), len(rs),
                        statistics.fmean(r.iterations_per_s for r in rs),
                        statistics.fmean(r.mean_wait_s for r in rs),
                        _mean_or_none([first_reaching(r.steps, r.accuracies, target)
                                       for r in rs]),
                        _mean_or_none([r.fresh_share for r in rs])))
    return rows


def format_table(rows: Sequence[Row], target: float) -> str:
    head = (f"| method | final test accuracy | time to {100 * target:g}% (s) | "
            f"iterations/s | mean wait / iteration (ms) | iterations to {100 * target:g}% | "
            "fresh contributions |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        acc = f"{100 * r.final_accuracy:.2f}% ± {100 * r.final_sd:.2f}"
        if r.time_to_target is None:
            ttt = f"not reached (0/{r.seeds})"
        else:
            ttt = f"{r.time_to_target:.2f}" + (f" ({r.reached}/{r.seeds} seeds)"
                                               if r.reached < r.seeds else "")
        its = "-" if r.iterations_to_target is None else f"{r.iterations_to_target:.0f}"
        fresh = "-" if r.fresh_share is None else f"{100 * r.fresh_share:.0f}%"
        lines.append(f"| {r.method} | {acc} | {ttt} | {r.iterations_per_s:.1f} | "
                     f"{1e3 * r.mean_wait_s:.2f} | {its} | {fresh} |")
    return "\n".join(lines)


def check_targets(rows: Sequence[Row]) -> list[str]:
    """The issue's two targets, as sentences that say met or not and by how much."""
    by = {r.method: r for r in rows}
    out = []
    w, a = by.get("wagma"), by.get("allreduce")
    if w and a:
        gap = 100 * (w.final_accuracy - a.final_accuracy)
        out.append(f"accuracy: wagma {100 * w.final_accuracy:.2f}% vs allreduce "
                   f"{100 * a.final_accuracy:.2f}% ({gap:+.2f} pp; target within 1 pp: "
                   f"{'met' if abs(gap) <= 1.0 or gap > 0 else 'NOT met'})")
    if w:
        for m in ("allreduce", "local_sgd", "dpsgd"):
            b = by.get(m)
            if b is None:
                continue
            if w.time_to_target is None or w.reached < w.seeds:
                verdict = "NOT met (wagma did not reach the target in every seed)"
            elif b.time_to_target is None:
                verdict = f"met ({m} never reached the target)"
            else:
                ratio = b.time_to_target / w.time_to_target
                verdict = (f"{'met' if w.time_to_target < b.time_to_target else 'NOT met'}"
                           f" ({ratio:.2f}x)")
            wt = "-" if w.time_to_target is None else f"{w.time_to_target:.2f}"
            bt = "-" if b.time_to_target is None else f"{b.time_to_target:.2f}"
            out.append(f"time to target: wagma {wt} s vs {m} {bt} s: {verdict}")
    return out


def plot(runs: Sequence[Run], target: float, path: str, title: str) -> None:
    """Accuracy against wall-clock time, one line per method: the mean over
    seeds of (time, accuracy) at each snapshot index."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for m in dict.fromkeys(r.method for r in runs):
        rs = [r for r in runs if r.method == m]
        n = min(len(r.times) for r in rs)
        t = np.mean([r.times[:n] for r in rs], axis=0)
        a = np.mean([r.accuracies[:n] for r in rs], axis=0)
        ax.plot(t, 100 * a, label=m, lw=2.2 if m == "wagma" else 1.2)
    ax.axhline(100 * target, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("test accuracy (%) of rank 0's model")
    ax.set_ylim(max(0.0, 100 * target - 25), 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title, fontsize=9)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    ext = os.path.splitext(path)[1].lstrip(".").lower() or "png"  # not the temporary's
    try:
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format=ext))
    finally:
        plt.close(fig)


# ------------------------------------------------------------------------------ main


def check_options(o: argparse.Namespace) -> list[str]:
    """Validate the options (locally, before any communication); returns the methods."""
    from .errors import InvalidArgumentError
    from .partial.wagma import check_grace
    from .train import METHODS

    methods = [m.strip() for m in o.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise InvalidArgumentError("methods", f"unknown method {m!r}; expected some of "
                                       f"{', '.join(METHODS)}")
        if methods.count(m) > 1:  # each repeat was averaged in as one more seed
            raise InvalidArgumentError("methods", f"{m!r} given more than once")
    if not methods:
        raise InvalidArgumentError("methods", "no method given")
    for name in ("seeds", "epochs", "batch", "hidden", "sync_every"):
        if getattr(o, name) < 1:
            raise InvalidArgumentError(name, f"must be >= 1, got {getattr(o, name)}")
    if o.group_size < 0:
        raise InvalidArgumentError("group_size", f"must be >= 0, got {o.group_size}")
    if o.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InvalidArgumentError("device", "cuda asked for but torch sees no CUDA GPU")
    # Each number named on its own; NaN and inf fail every one of these tests
    # (a NaN lr or momentum trained to NaN weights and reported ~10% accuracy;
    # a NaN or inf compute crashed every rank mid-run in time.sleep).
    finite = math.isfinite
    if not (finite(o.compute) and o.compute >= 0):
        raise InvalidArgumentError("compute", f"need finite seconds >= 0, got {o.compute}")
    if not 0 < o.target <= 1:
        raise InvalidArgumentError("target", f"need 0 < target <= 1, got {o.target}")
    if not (finite(o.lr) and o.lr > 0):
        raise InvalidArgumentError("lr", f"need a finite lr > 0, got {o.lr}")
    if not (finite(o.momentum) and o.momentum >= 0):
        raise InvalidArgumentError("momentum", f"need finite momentum >= 0, got {o.momentum}")
    if o.ranks < 1:  # was: any value below 2 silently ran one rank
        raise InvalidArgumentError("ranks", f"must be >= 1, got {o.ranks}")
    check_grace(o.grace)  # else found by WAGMA's constructor, after MPI start-up
    return methods


def _outputs(o: argparse.Namespace) -> list[Any]:
    """What rank 0 writes at the end, for the checks before any training
    (they failed only at the end, after minutes of it)."""
    from .bench.outputs import data_file, image_file

    return [data_file("json", o.json), image_file("plot", o.plot)]


def check_batch(o: argparse.Namespace, train_samples: int, size: int) -> None:
    """A step takes ``--batch`` samples of the rank's shard: a larger batch
    silently took the whole shard while the header and the JSON said
    ``--batch``."""
    from .errors import InvalidArgumentError

    shard = train_samples // size
    if o.batch > shard:
        raise InvalidArgumentError("batch", f"must be <= {shard}, the training samples per "
                                   f"rank ({train_samples} over {size} ranks), got {o.batch}")


def run_demo(comm: Any, o: argparse.Namespace, out: Any = sys.stdout) -> dict[str, Any]:
    """Collective: every run, then (rank 0) the table, the target check and the plot.
    Returns the results (complete on rank 0)."""
    import torch

    from . import imbalance as imb
    from .bench.outputs import check_outputs
    from .torch_views import use_local_gpu
    from .train import default_group_size

    methods = check_options(o)
    torch.set_num_threads(1)  # ranks outnumber cores
    P, rank = comm.size, comm.rank
    if not o.group_size:
        o.group_size = default_group_size(P)
    spec = o.imbalance or f"reference:{o.compute}:2"
    imb.make_injector(spec, P, 0)  # validate before anything runs
    check_outputs(comm, _outputs(o))
    device = use_local_gpu(timeout=comm.timeout) if o.device == "cuda" else torch.device("cpu")
    data = load_data(device)
    check_batch(o, len(data.y_train), P)
    talk = rank == 0 and not o.quiet
    live = talk and out.isatty() if hasattr(out, "isatty") else False
    if talk:
        print(f"# wagma demo: {P} ranks, digits MLP (64-{o.hidden}-10), {o.epochs} epochs of "
              f"{o.batch} samples/rank/step, SGD lr {o.lr} momentum {o.momentum}, injector "
              f"{spec}, compute {1e3 * o.compute:g} ms, group size {o.group_size}, sync every "
              f"{o.sync_every} ({o.activation} activation, rounds start at the {o.round_start}, "
              f"grace {o.grace:g}), "
              f"{o.shards} shards, {device}, seeds "
              f"0..{o.seeds - 1}", file=out, flush=True)
    # Warm-up (untimed): JIT-compiled kernels, schedules and channels; a sync
    # round if the run has one (it ran sync_every + 2 iterations whatever the
    # run's length: with --sync-every 100000, far longer than the run).
    none = imb.make_injector("none", P, 0)
    iterations = o.epochs * max(1, len(data.y_train) // P // o.batch)  # as train() counts
    for m in methods:
        train(comm, m, 0, data, o, none, iterations=min(o.sync_every + 2, iterations))
    runs: list[Run] = []
    total = len(methods) * o.seeds
    started = time.perf_counter()
    for seed in range(o.seeds):
        injector = imb.make_injector(spec, P, seed)
        order = methods[seed % len(methods):] + methods[:seed % len(methods)]
        for m in order:
            run = train(comm, m, seed, data, o, injector, live=live)
            runs.append(run)
            if talk:
                ttt = first_reaching(run.times, run.accuracies, o.target)
                print(f"[{len(runs):2d}/{total}] seed {seed} {m:<10} final "
                      f"{100 * run.final_accuracy:5.2f}%  to {100 * o.target:g}%: "
                      f"{'-' if ttt is None else f'{ttt:.2f} s':>7}  "
                      f"{run.iterations_per_s:6.1f} it/s  wait {1e3 * run.mean_wait_s:5.2f} "
                      f"ms/it  ({time.perf_counter() - started:.0f} s elapsed)",
                      file=out, flush=True)
    runs.sort(key=lambda r: (methods.index(r.method), r.seed))
    rows = summarize(runs, o.target)
    result = {"ranks": P, "options": {k: v for k, v in vars(o).items()
                                      if isinstance(v, (int, float, str, type(None)))},
              "injector": spec, "rows": [asdict(r) for r in rows],
              "runs": [asdict(r) for r in runs], "targets": check_targets(rows)}
    if rank == 0:
        title = (f"digits MLP, {P} ranks, {o.shards} shards, injector {spec}, compute "
                 f"{1e3 * o.compute:g} ms, mean of {o.seeds} seeds")
        print(file=out)
        print(format_table(rows, o.target), file=out)
        print(file=out)
        for line in result["targets"]:
            print(line, file=out)
        if o.json:  # before the plot, so a failing plot cannot lose the measurements
            write_json(o.json, result)
        if o.plot:
            plot(runs, o.target, o.plot, title)
            print(f"plot: {o.plot}", file=out)
        out.flush()
    return result


def _under_mpiexec() -> bool:
    return any(k in os.environ for k in _LAUNCH_ENV)


def _relaunch(ranks: int) -> int | None:
    """Start ``mpiexec -n ranks`` on this very command (None: no mpiexec found)."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = here if os.path.exists(here) else shutil.which("mpiexec")
    if mpiexec is None:
        return None
    argv = [mpiexec, "-n", str(ranks), sys.executable, "-m", "wagma_comm.cli", *sys.argv[1:]]
    print(f"# starting {' '.join(argv[:3])} ...", flush=True)
    os.execv(mpiexec, argv)
    return 0  # pragma: no cover - execv does not return


def run(args: argparse.Namespace) -> int:
    check_options(args)
    if args.ranks > 1 and not _under_mpiexec() and "demo" in sys.argv[1:]:
        from .bench.outputs import output_problem, raise_output_problem

        raise_output_problem(output_problem(_outputs(args)))  # rank 0, before mpiexec
        if _relaunch(args.ranks) is None:
            print("# no mpiexec found: running on 1 rank", file=sys.stderr)
    import wagma_comm

    comm = wagma_comm.init()
    try:
        run_demo(comm, args)
    finally:
        comm.close()
    return 0
