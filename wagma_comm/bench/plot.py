"""Plots of benchmark results: bandwidth or time against message size (``wagma
bench``) and throughput against injected imbalance (``wagma imbalance``).

Figures are built on matplotlib's Agg canvas directly, without pyplot: no
display is needed, the caller's pyplot backend and figure registry are left
alone, and nothing stays open after saving. Every function returns the
:class:`~matplotlib.figure.Figure` it saved so callers and tests can inspect it.

Re-plot a saved result (handy for docs)::

    python -m wagma_comm.bench.plot bench/results/host-8.json -o out.png
    python -m wagma_comm.bench.plot bench/results/host-8.json --metric busbw,time_us -o out.png
    python -m wagma_comm.bench.plot imb-0.json imb-1.json imb-2.json -o imbalance.png

matplotlib is an optional dependency (``pip install 'wagma_comm[bench]'``); it is
imported only when a plot is drawn.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from wagma_comm.errors import InvalidArgumentError, UnsupportedError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "METRICS",
    "human_bytes",
    "load_bench_json",
    "main",
    "plot_bandwidth",
    "plot_imbalance",
    "plot_sweep",
    "plot_time",
    "points_from_imbalance",
]

ARG = "--plot"  # the CLI option errors are reported against

#: Per-implementation result fields that can be plotted, with their axis labels.
METRICS: dict[str, str] = {
    "busbw": "bus bandwidth (GB/s)",
    "algbw": "algorithm bandwidth (GB/s)",
    "aggbw": "aggregate bandwidth, all groups (GB/s)",
    "time_us": "time per call (µs)",
    "min_us": "fastest rank, time per call (µs)",
    "max_us": "slowest rank, time per call (µs)",
}

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
# Tick tiers for the size axis, densest first: exponents of 2 kept, by their
# residue mod 10 (0 -> 1 B/KiB/MiB, 3 -> 8, 6 -> 64, ...).
_TICK_TIERS: tuple[tuple[int, ...], ...] = (
    tuple(range(10)), (0, 2, 4, 6, 8), (0, 3, 6), (0, 5), (0,),
)
_MAX_TICKS = 9
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
# Rows whose group_size is one group's size, not the job's ranks.
_GROUP_COLLECTIVES = ("group_allreduce", "wait_avoiding")


# ----------------------------------------------------------------- helpers


def human_bytes(n: float) -> str:
    """8 -> '8 B', 1024 -> '1 KiB', 3 << 20 -> '3 MiB' (binary units, as the
    sweep sizes are powers of two)."""
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    text = f"{value:.0f}" if value == int(value) else f"{value:.3g}"
    return f"{text} {_UNITS[unit]}"


def _matplotlib() -> tuple[Any, Any]:
    """(Figure, FigureCanvasAgg), or a typed error naming the missing extra."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise UnsupportedError(
            ARG, f"plotting needs matplotlib ({exc}); pip install 'wagma_comm[bench]'"
        ) from None
    return Figure, FigureCanvasAgg


def _new_figure(width: float, height: float) -> "Figure":
    figure_cls, canvas_cls = _matplotlib()
    fig = figure_cls(figsize=(width, height), layout="constrained")
    canvas_cls(fig)  # attaches the Agg canvas: rendering never touches a display
    return fig


def check_output_path(path: str | os.PathLike[str], argument: str) -> str:
    """Fail before minutes of measuring when rank 0 could not write ``path`` at
    the end (empty, a directory, unwritable); creates its directory. Returns
    the path as a string."""
    try:
        text = os.fspath(path)
    except TypeError:
        text = None
    if not isinstance(text, str) or not text:
        raise InvalidArgumentError(argument, f"expected a file name, got {path!r}")
    parent = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise InvalidArgumentError(argument, f"{text!r} is a directory")
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise InvalidArgumentError(argument, f"cannot create {parent!r}: {exc.strerror}") from None
    if not os.access(parent, os.W_OK | os.X_OK) or (
            os.path.exists(text) and not os.access(text, os.W_OK)):
        raise InvalidArgumentError(argument, f"{text!r} is not writable")
    return text


def check_image_path(path: str | os.PathLike[str], argument: str = ARG) -> str:
    """:func:`check_output_path`, and an extension matplotlib can render to."""
    _, canvas_cls = _matplotlib()
    text = check_output_path(path, argument)
    ext = os.path.splitext(text)[1].lstrip(".").lower()
    supported = canvas_cls.get_supported_filetypes()
    if ext not in supported:
        raise InvalidArgumentError(
            argument, f"{text!r}: unknown image format {ext or '(none)'!r}; "
                      f"use one of {', '.join('.' + e for e in sorted(supported))}")
    return text


def _save(fig: "Figure", path: str) -> None:
    """Whole or not at all, as the JSON files (wagma_comm/files.py); the
    format from ``path``'s extension, not the temporary file's."""
    from ..files import write_atomically

    ext = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    try:
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120, format=ext))
    except OSError as exc:
        raise InvalidArgumentError(ARG, f"cannot write {path!r}: {exc}") from None


def _field(row: Any, name: str, index: int) -> Any:
    """A row's field, whether the row is a JSON dict or a ``bench.cli.Row``."""
    try:
        return row[name] if isinstance(row, Mapping) else getattr(row, name)
    except (KeyError, AttributeError):
        raise InvalidArgumentError(ARG, f"row {index}: missing field {name!r}") from None


def _number(value: Any) -> float | None:
    """A plottable number, or None (missing, NaN, or not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _machine(meta: Mapping[str, Any] | None) -> str:
    """'8 ranks, AMD EPYC (2 CPUs), MPICH 5.0.2' from a result file's meta
    (and the GPU, when the run had one)."""
    if not meta:
        return ""
    parts = []
    if meta.get("ranks"):
        parts.append(f"{meta['ranks']} ranks")
    cpu = str(meta.get("cpu") or "").strip()
    if cpu:
        parts.append(cpu + (f" ({meta['cpus']} CPUs)" if meta.get("cpus") else ""))
    gpu = str(meta.get("gpu") or "").strip()
    if gpu:  # a --device cuda run measured the GPU, not the CPU
        parts.append(gpu)
    lib = " ".join(str(meta.get("mpi_library") or "").split())
    lib = re.sub(r"\s*Version:\s*", " ", lib)  # "MPICH Version: 5.0.2" -> "MPICH 5.0.2"
    if lib:
        parts.append(lib)
    return ", ".join(parts)


def _size_ticks(ax: "Axes", sizes: Iterable[float]) -> None:
    """log2 size axis with ticks at powers of two labelled 8 B, 1 KiB, 64 MiB...;
    the densest tier that keeps at most _MAX_TICKS labels is used."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    values = [s for s in sizes if s > 0]
    lo, hi = math.floor(math.log2(min(values))), math.ceil(math.log2(max(values)))
    exps = list(range(lo, hi + 1))
    major = exps
    for tier in _TICK_TIERS:
        major = [e for e in exps if e % 10 in tier]
        if len(major) <= _MAX_TICKS:
            break
    if len(major) < 2:  # a narrow sweep: label its ends
        major = sorted({lo, hi})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator([2.0**e for e in major]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: human_bytes(x)))
    ax.xaxis.set_minor_locator(FixedLocator([2.0**e for e in exps]))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(2.0**lo / 1.25, 2.0**hi * 1.25)


# ------------------------------------------------------------- size sweeps


def load_bench_json(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows, meta) of a ``wagma bench --json`` file."""
    data = _read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise InvalidArgumentError(ARG, f"{os.fspath(path)!r}: not a 'wagma bench --json' file "
                                        "(no 'rows' list)")
    return data["rows"], dict(data.get("meta") or {})


def _read_json(path: str | os.PathLike[str]) -> Any:
    try:
        with open(path) as fh:
            return json.load(fh)
    except OSError as exc:
        raise InvalidArgumentError(ARG, f"cannot read {os.fspath(path)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(ARG, f"{os.fspath(path)!r}: not JSON ({exc})") from None


def _series(rows: Sequence[Any], metric: str
            ) -> dict[str, dict[tuple[str, str], list[tuple[float, float, float, float, int]]]]:
    """collective -> series label -> sorted (nbytes, value, min_us, max_us, wrong).

    A series is one implementation; when a collective's rows mix dtypes or ops
    the label carries them too, so a line never joins different experiments.
    """
    by_coll: dict[str, dict[tuple[str, str, str], list[tuple[float, float, float, float, int]]]] = {}
    for i, row in enumerate(rows):
        coll = str(_field(row, "collective", i))
        nbytes = _number(_field(row, "nbytes", i))
        results = _field(row, "results", i)
        if nbytes is None or nbytes <= 0 or not isinstance(results, Mapping):
            raise InvalidArgumentError(ARG, f"row {i}: needs a positive 'nbytes' and a "
                                            "'results' mapping")
        dtype = str(_field(row, "dtype", i)) if _has(row, "dtype") else ""
        op = str(_field(row, "op", i)) if _has(row, "op") else ""
        for impl, res in results.items():
            if not isinstance(res, Mapping):
                continue
            value = _number(res.get(metric))
            if value is None or value <= 0:  # not measured, or 0 GB/s on one rank
                continue
            wrong = _number(res.get("wrong"))
            by_coll.setdefault(coll, {}).setdefault((str(impl), dtype, op), []).append(
                (nbytes, value, _number(res.get("min_us")) or math.nan,
                 _number(res.get("max_us")) or math.nan, int(wrong) if wrong else 0))
    out: dict[str, dict[tuple[str, str], list[tuple[float, float, float, float, int]]]] = {}
    for coll, per in by_coll.items():
        kinds = {(d, o) for (_, d, o) in per}
        out[coll] = {}
        for (impl, dtype, op), pts in per.items():
            extra = f" ({dtype} {op})".replace(" )", ")") if len(kinds) > 1 else ""
            out[coll][(impl + extra, impl)] = sorted(pts)
    return out


def _has(row: Any, name: str) -> bool:
    return name in row if isinstance(row, Mapping) else hasattr(row, name)


def _group_info(rows: Sequence[Any], coll: str) -> int | None:
    for i, row in enumerate(rows):
        if _field(row, "collective", i) == coll and _has(row, "group_size"):
            g = _number(_field(row, "group_size", i))
            return int(g) if g else None
    return None


def plot_sweep(rows: Sequence[Any], path: str | os.PathLike[str],
               meta: Mapping[str, Any] | None = None,
               metrics: Sequence[str] = ("busbw",),
               collectives: Sequence[str] | None = None) -> "Figure":
    """Draw ``metrics`` (one subplot row each) against message size for every
    collective in ``rows`` (one subplot column each), one line per
    implementation, log-log, and save to ``path``.

    ``rows``: the ``rows`` of a ``wagma bench --json`` file, or ``bench.cli.Row``
    objects. ``meta``: that file's ``meta`` (ranks, CPU and MPI go into the
    title). ``collectives``: keep only these, in this order. Implementations keep
    one colour and marker across subplots; points whose result was checked wrong
    are crossed out in red. For time metrics a band spans the fastest to the
    slowest rank. Returns the saved Figure (not attached to pyplot).
    """
    metrics = list(metrics)
    for m in metrics:
        if m not in METRICS:
            raise InvalidArgumentError("metric", f"unknown metric {m!r}; expected one of "
                                                 f"{', '.join(METRICS)}")
    if not metrics:
        raise InvalidArgumentError("metric", "no metric to plot")
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
        raise InvalidArgumentError(ARG, f"expected a list of rows, got {type(rows).__name__}")
    rows = list(rows)
    if not rows:
        raise InvalidArgumentError(ARG, "no rows to plot")
    series = {m: _series(rows, m) for m in metrics}
    colls = list(dict.fromkeys(c for m in metrics for c in series[m]))
    if collectives is not None:
        missing = [c for c in collectives if c not in colls]
        if missing:
            raise InvalidArgumentError(ARG, f"no {', '.join(missing)} rows with "
                                            f"{'/'.join(metrics)} (have {', '.join(colls) or 'none'})")
        colls = list(collectives)
    if not colls:
        raise InvalidArgumentError(ARG, f"no {'/'.join(metrics)} values in the rows")

    fig = _new_figure(4.8 * len(colls) + 0.6, 3.6 * len(metrics) + 1.0)
    path = check_image_path(path)
    labels = list(dict.fromkeys(lab for m in metrics for c in colls for lab in series[m].get(c, {})))
    impls = list(dict.fromkeys(impl for _, impl in labels))
    colors = {impl: f"C{k % 10}" for k, impl in enumerate(impls)}
    markers = {impl: _MARKERS[k % len(_MARKERS)] for k, impl in enumerate(impls)}
    handles: dict[str, Any] = {}
    axes = fig.subplots(len(metrics), len(colls), squeeze=False, sharex="col")
    any_wrong = False
    for r, metric in enumerate(metrics):
        for c, coll in enumerate(colls):
            ax = axes[r][c]
            lines = series[metric].get(coll, {})
            for (label, impl), pts in lines.items():
                xs = [p[0] for p in pts]
                ys = [p[1] for p in pts]
                (line,) = ax.plot(xs, ys, marker=markers[impl], markersize=4, linewidth=1.5,
                                  color=colors[impl], label=label)
                handles.setdefault(label, line)
                if metric == "time_us":
                    lo = [p[2] for p in pts]
                    hi = [p[3] for p in pts]
                    if all(math.isfinite(v) and v > 0 for v in lo + hi):
                        ax.fill_between(xs, lo, hi, color=colors[impl], alpha=0.15,
                                        linewidth=0)
                bad = [(p[0], p[1]) for p in pts if p[4] > 0]
                if bad:
                    any_wrong = True
                    ax.scatter(*zip(*bad), marker="x", s=60, color="red", zorder=5)
            ax.set_yscale("log")
            ax.grid(True, which="major", alpha=0.4)
            ax.grid(True, which="minor", axis="y", alpha=0.12)
            _size_ticks(ax, [p[0] for pts in lines.values() for p in pts] or [1, 2])
            if r == len(metrics) - 1:
                ax.set_xlabel("message size")
            if c == 0:
                ax.set_ylabel(METRICS[metric])
            if r == 0:
                group = _group_info(rows, coll)
                ranks = (meta or {}).get("ranks")
                if coll in _GROUP_COLLECTIVES and group:  # group_size: one group's ranks
                    ax.set_title(f"{coll} (groups of {group}" +
                                 (f" of {ranks} ranks)" if ranks else ")"))
                else:
                    ax.set_title(f"{coll}" + (f" ({group} ranks)" if group else ""))
    if any_wrong:
        from matplotlib.lines import Line2D

        handles["wrong result"] = Line2D([], [], marker="x", color="red", linestyle="none")
    fig.legend(list(handles.values()), list(handles), loc="outside lower center",
               ncols=min(len(handles), 6), frameon=False)
    title = "wagma bench"
    kinds = _dtype_op(rows)
    if kinds:
        title += f": {kinds}"
    machine = _machine(meta)
    if machine:
        title += f" — {machine}"
    fig.suptitle(title, fontsize="medium", wrap=True)  # one panel is narrower than the title
    _save(fig, path)
    return fig


def _dtype_op(rows: Sequence[Any]) -> str:
    """'float32 sum' when every row shares them, else ''."""
    kinds = {(row.get("dtype"), row.get("op")) if isinstance(row, Mapping)
             else (getattr(row, "dtype", None), getattr(row, "op", None)) for row in rows}
    if len(kinds) == 1:
        dtype, op = next(iter(kinds))
        return " ".join(str(v) for v in (dtype, op) if v)
    return ""


def plot_bandwidth(rows: Sequence[Any], path: str | os.PathLike[str],
                   meta: Mapping[str, Any] | None = None, metric: str = "busbw",
                   collectives: Sequence[str] | None = None) -> "Figure":
    """Bandwidth (``busbw``, ``algbw`` or ``aggbw``, GB/s) against message size,
    log-log, one subplot per collective and one line per implementation.
    Returns the saved Figure. See :func:`plot_sweep`."""
    if metric not in ("busbw", "algbw", "aggbw"):
        raise InvalidArgumentError("metric", f"expected busbw, algbw or aggbw, got {metric!r}")
    return plot_sweep(rows, path, meta, (metric,), collectives)


def plot_time(rows: Sequence[Any], path: str | os.PathLike[str],
              meta: Mapping[str, Any] | None = None, metric: str = "time_us",
              collectives: Sequence[str] | None = None) -> "Figure":
    """Time per call (µs) against message size, log-log: the view that shows
    latency at small sizes, where bandwidth plots flatten to nothing.
    Returns the saved Figure. See :func:`plot_sweep`."""
    if metric not in ("time_us", "min_us", "max_us"):
        raise InvalidArgumentError("metric", f"expected time_us, min_us or max_us, got {metric!r}")
    return plot_sweep(rows, path, meta, (metric,), collectives)


# --------------------------------------------------------------- imbalance


def _injected_delay(spec: str, ranks: int) -> tuple[str, float]:
    """(kind, seconds) of an injector spec: the delay of a slow rank for
    'reference', the mean extra compute for 'skewed', 0 for 'none'."""
    from wagma_comm.imbalance import ReferenceImbalance, SkewedCompute, make_injector

    inj = make_injector(spec, max(1, ranks))
    if isinstance(inj, ReferenceImbalance):
        return "reference", inj.delay_s
    if isinstance(inj, SkewedCompute):
        return "skewed", inj.mean_s
    return "none", 0.0


def _imbalance_runs(results: Iterable[str | os.PathLike[str] | Mapping[str, Any]]
                    ) -> Iterable[tuple[str, Any]]:
    """(name for errors, one run's result) per run: a ``--delays`` sweep's
    JSON (``{"sweep": [...]}``) holds one result per delay, and the plot it
    came with must be redrawable from it."""
    for item in results:
        data = item if isinstance(item, Mapping) else _read_json(item)
        name = "result" if isinstance(item, Mapping) else repr(os.fspath(item))
        sweep = data.get("sweep") if isinstance(data, Mapping) else None
        if isinstance(sweep, list) and "rates" not in data:
            for k, run in enumerate(sweep):
                yield f"{name} sweep[{k}]", run
        else:
            yield name, data


def points_from_imbalance(results: Iterable[str | os.PathLike[str] | Mapping[str, Any]]
                          ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Points and meta for :func:`plot_imbalance` from several ``wagma imbalance
    --json`` outputs (file paths or loaded dicts), typically one per delay, or
    from the one JSON of a ``--delays`` sweep.

    Each point is ``{"method", "delay_s", "it_per_s", "expected"}`` (expected:
    the analytic it/s for that method, or None). ``meta`` carries ``ranks``,
    ``compute_s`` (when all runs share them) and ``injector`` (the kind)."""
    points: list[dict[str, Any]] = []
    kinds: set[str] = set()
    compute: set[float] = set()
    ranks: set[int] = set()
    n = 0
    for n, (name, data) in enumerate(_imbalance_runs(results), 1):
        if not isinstance(data, Mapping) or not isinstance(data.get("rates"), Mapping):
            raise InvalidArgumentError(ARG, f"{name}: not a 'wagma imbalance --json' output "
                                            "(no 'rates')")
        kind, delay = _injected_delay(str(data.get("injector", "none")),
                                      int(data.get("ranks") or 1))
        if kind != "none":
            kinds.add(kind)
        if _number(data.get("compute_s")) is not None:
            compute.add(float(data["compute_s"]))
        if data.get("ranks"):
            ranks.add(int(data["ranks"]))
        expected = data.get("expected") or {}
        for method, rate in data["rates"].items():
            value = _number(rate)
            if value is None:
                continue
            points.append({"method": str(method), "delay_s": delay, "it_per_s": value,
                           "expected": _number(expected.get(method))})
    if n == 0:
        raise InvalidArgumentError(ARG, "no imbalance results given")
    if len(kinds) > 1:
        raise InvalidArgumentError(ARG, f"results mix injector kinds ({', '.join(sorted(kinds))});"
                                        " their delays are not on one axis")
    meta: dict[str, Any] = {"injector": kinds.pop() if kinds else "none"}
    if len(compute) == 1:
        meta["compute_s"] = compute.pop()
    if len(ranks) == 1:
        meta["ranks"] = ranks.pop()
    return points, meta


def plot_imbalance(points: Sequence[Mapping[str, Any]], path: str | os.PathLike[str],
                   meta: Mapping[str, Any] | None = None) -> "Figure":
    """Throughput (iterations/s) against injected delay (s), one line per method,
    and save to ``path``.

    ``points``: ``{"method", "delay_s", "it_per_s"}`` dicts, optionally with
    ``"expected"`` (analytic it/s, drawn dotted in the method's colour). With
    ``meta["compute_s"]`` a top axis gives the delay as a multiple of the compute
    step; ``meta["ranks"]`` and ``meta["injector"]`` go into the title/label.
    Returns the saved Figure; its solid lines are the methods, in order.
    """
    if isinstance(points, (str, bytes, Mapping)) or not isinstance(points, Iterable):
        raise InvalidArgumentError(ARG, f"expected a list of points, got {type(points).__name__}")
    by_method: dict[str, list[tuple[float, float, float | None]]] = {}
    for i, p in enumerate(points):
        if not isinstance(p, Mapping):
            raise InvalidArgumentError(ARG, f"point {i}: expected a mapping, got "
                                            f"{type(p).__name__}")
        missing = [k for k in ("method", "delay_s", "it_per_s") if k not in p]
        if missing:
            raise InvalidArgumentError(ARG, f"point {i}: missing {', '.join(missing)}")
        delay, rate = _number(p["delay_s"]), _number(p["it_per_s"])
        if delay is None or delay < 0 or rate is None or rate < 0:
            raise InvalidArgumentError(ARG, f"point {i}: delay_s and it_per_s must be "
                                            f"non-negative numbers, got {p['delay_s']!r}, "
                                            f"{p['it_per_s']!r}")
        by_method.setdefault(str(p["method"]), []).append((delay, rate, _number(p.get("expected"))))
    if not by_method:
        raise InvalidArgumentError(ARG, "no points to plot")
    meta = dict(meta or {})

    fig = _new_figure(8.4, 4.6)
    path = check_image_path(path)
    ax = fig.add_subplot()
    has_expected = False
    for k, (method, pts) in enumerate(by_method.items()):
        pts.sort(key=lambda t: t[0])
        color = f"C{k % 10}"
        ax.plot([t[0] for t in pts], [t[1] for t in pts], marker=_MARKERS[k % len(_MARKERS)],
                markersize=5, linewidth=1.6, color=color, label=method)
        exp = [(t[0], t[2]) for t in pts if t[2] is not None]
        if exp:
            has_expected = True
            ax.plot(*zip(*exp), linestyle=":", linewidth=1.2, color=color,
                    label=f"_expected {method}")
    if has_expected:
        from matplotlib.lines import Line2D

        handles, labels = ax.get_legend_handles_labels()
        handles.append(Line2D([], [], linestyle=":", color="grey"))
        labels.append("analytic expectation")
    else:
        handles, labels = ax.get_legend_handles_labels()
    # Outside the axes: with many methods an inner legend hides data points.
    fig.legend(handles, labels, fontsize="small", loc="outside right upper", frameon=False)
    kind = meta.get("injector", "")
    ax.set_xlabel({"reference": "injected delay of a slow rank per step (s)",
                   "skewed": "mean injected extra compute per rank and step (s)"
                   }.get(kind, "injected delay per step (s)"))
    ax.set_ylabel("throughput (iterations/s)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.4)
    compute = _number(meta.get("compute_s"))
    if compute and compute > 0:
        top = ax.secondary_xaxis("top", functions=(lambda d: d / compute,
                                                   lambda m: m * compute))
        top.set_xlabel(f"delay as a multiple of the compute step ({compute * 1e3:g} ms)")
    title = "wagma imbalance: throughput under injected imbalance"
    if meta.get("ranks"):
        title += f", {meta['ranks']} ranks"
    fig.suptitle(title, fontsize="medium")
    _save(fig, path)
    return fig


# --------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """Re-plot saved results: one ``wagma bench --json`` file, or one or more
    ``wagma imbalance --json`` files (one per delay, or a ``--delays`` sweep)."""
    p = argparse.ArgumentParser(prog="python -m wagma_comm.bench.plot",
                                description=main.__doc__)
    p.add_argument("results", nargs="+", help="JSON result file(s)")
    p.add_argument("-o", "--output", required=True, help="image to write (.png, .svg, .pdf)")
    p.add_argument("--metric", default="busbw",
                   help=f"bench: comma-separated, one subplot row each ({', '.join(METRICS)})")
    p.add_argument("--collective", default=None,
                   help="bench: comma-separated collectives to keep (default: all)")
    args = p.parse_args(argv)
    try:
        loaded = [(f, _read_json(f)) for f in args.results]
        bench = [f for f, d in loaded if isinstance(d, dict) and "rows" in d]
        if bench:
            if len(loaded) != 1:
                raise InvalidArgumentError(ARG, "give one 'wagma bench' file at a time "
                                                f"(got {len(loaded)} files)")
            rows, meta = load_bench_json(bench[0])
            plot_sweep(rows, args.output, meta,
                       [m.strip() for m in args.metric.split(",") if m.strip()],
                       [c.strip() for c in args.collective.split(",") if c.strip()]
                       if args.collective else None)
        else:
            points, meta = points_from_imbalance(args.results)  # errors name the file
            plot_imbalance(points, args.output, meta)
    except (InvalidArgumentError, UnsupportedError) as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
