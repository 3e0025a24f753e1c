"""The simulator's figure: iterations/s against job size, one line per method."""

from __future__ import annotations

from typing import Any, Sequence


def plot_scale(runs: Sequence[dict[str, Any]], path: str) -> Any:
    """``runs``: what ``wagma sim --json`` writes under "runs". Log-x plot of
    simulated it/s per method; returns the saved Figure."""
    from ..bench.plot import _MARKERS, _new_figure, _save, check_image_path

    fig = _new_figure(8.4, 4.6)
    path = check_image_path(path)
    ax = fig.add_subplot()
    methods = list(runs[0]["results"]) if runs else []
    for k, m in enumerate(methods):
        pts = sorted((r["ranks"], r["results"][m]["iterations_per_s"]) for r in runs
                     if m in r["results"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=_MARKERS[k % len(_MARKERS)],
                color=f"C{k % 10}", linewidth=1.6, markersize=5, label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks (GPUs)")
    ax.set_ylabel("simulated iterations / s")
    if runs:
        w, cost = runs[0]["workload"], runs[0]["cost_model"]
        # Each job's own group: --group-size is capped at each job size, and 0
        # means half of it (the first run's figure was shown for every size).
        sizes = sorted({r["workload"]["group_size"] or max(1, r["ranks"] // 2) for r in runs})
        group = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        ax.set_title(f"wagma sim: {w['elements'] * w['itemsize'] / 1e6:g} MB model, "
                     f"compute {w['compute_s'] * 1e3:g} ms, {w['imbalance']}, group "
                     f"{group}, sync {w['sync_every']}, cost {cost['name']}",
                     fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return fig
