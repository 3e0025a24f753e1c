"""Benchmark plots (bench/plot.py) and the sweep progress bar (bench/progress.py):
real result files render to valid images with one line per implementation,
bad input fails with typed errors, and the bar draws only where it should."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest

from wagma_comm.bench import plot  # imports matplotlib only when drawing
from wagma_comm.bench.progress import Progress, format_duration
from wagma_comm.errors import InvalidArgumentError

needs_mpl = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                               reason="matplotlib not installed (the [bench] extra)")

ROOT = Path(__file__).resolve().parents[2]
# A frozen copy of a real `wagma bench` result (8 ranks): bench/results/ is
# rewritten by every benchmark run, so the tests pin their own sample.
HOST8 = ROOT / "tests" / "data" / "bench-host-8-sample.json"
IMB8 = ROOT / "tests" / "data" / "imbalance-8-sample.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk; asserts the PNG signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _impls(rows: list[dict[str, Any]], collective: str, metric: str) -> set[str]:
    return {name for r in rows if r["collective"] == collective
            for name, res in r["results"].items() if res.get(metric, 0) > 0}


def _data_lines(ax: Any) -> list[Any]:
    """Lines with a legend label (helper lines are labelled '_...')."""
    return [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]


# ------------------------------------------------------------------ sweeps


@needs_mpl
def test_bandwidth_of_real_result(tmp_path: Path) -> None:
    rows, meta = plot.load_bench_json(HOST8)
    out = tmp_path / "bw.png"
    fig = plot.plot_bandwidth(rows, out, meta)
    w, h = _png_size(out)
    assert w > 600 and h > 300 and out.stat().st_size > 20_000
    colls = list(dict.fromkeys(r["collective"] for r in rows))
    assert colls == ["allreduce", "group_allreduce"]
    assert [ax.get_title() for ax in fig.axes] == [
        "allreduce (8 ranks)", "group_allreduce (groups of 4 of 8 ranks)"]
    for ax, coll in zip(fig.axes, colls):
        lines = _data_lines(ax)
        assert {ln.get_label() for ln in lines} == _impls(rows, coll, "busbw")
        assert len(lines) == len(_impls(rows, coll, "busbw"))  # 2 and 3
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        for ln in lines:  # every size of the sweep, in order, with the value of the file
            name = ln.get_label()
            want = sorted((r["nbytes"], r["results"][name]["busbw"]) for r in rows
                          if r["collective"] == coll and name in r["results"])
            assert list(ln.get_xdata()) == [n for n, _ in want]
            assert list(ln.get_ydata()) == pytest.approx([v for _, v in want])
    assert "8 ranks" in fig._suptitle.get_text() and "MPICH 5.0.2" in fig._suptitle.get_text()
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][:3] == ["8 B", "64 B", "1 KiB"]


@needs_mpl
def test_rows_as_objects_and_time_panel(tmp_path: Path) -> None:
    from wagma_comm.bench.cli import Row

    rows, meta = plot.load_bench_json(HOST8)
    objs = [Row(**r) for r in rows if r["collective"] == "allreduce"]
    fig = plot.plot_time(objs, tmp_path / "t.svg", meta)
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")
    (ax,) = fig.axes
    assert len(_data_lines(ax)) == 2
    assert "time" in ax.get_ylabel()
    both = plot.plot_sweep(rows, tmp_path / "both.png", meta, ("busbw", "time_us"),
                           collectives=["group_allreduce"])
    assert len(both.axes) == 2
    assert all(len(_data_lines(ax)) == 3 for ax in both.axes)
    agg = plot.plot_bandwidth(rows, tmp_path / "agg.png", meta, metric="aggbw")
    (ax,) = agg.axes  # only group_allreduce reports aggbw, and only for wagma
    assert ax.get_title().startswith("group_allreduce")
    assert [ln.get_label() for ln in _data_lines(ax)] == ["wagma"]


@needs_mpl
def test_wrong_results_are_marked(tmp_path: Path) -> None:
    rows = [{"collective": "allreduce", "nbytes": n, "count": n // 4, "dtype": "float32",
             "op": "sum", "group_size": 2,
             "results": {"a": {"busbw": 1.0 * n, "wrong": 3 if n == 16 else 0},
                         "b": {"busbw": 2.0 * n, "wrong": 0}}} for n in (8, 16, 32)]
    fig = plot.plot_bandwidth(rows, tmp_path / "w.png")
    (ax,) = fig.axes
    assert len(_data_lines(ax)) == 2
    (marks,) = ax.collections
    assert marks.get_offsets().tolist() == [[16.0, 16.0]]
    assert "wrong result" in [t.get_text() for t in fig.legends[0].get_texts()]


@pytest.mark.parametrize("rows, match", [
    ([], "no rows"),
    ("rows.json", "list of rows"),
    ([{"collective": "allreduce", "results": {}}], "missing field 'nbytes'"),
    ([{"collective": "allreduce", "nbytes": 8, "results": {"x": {"busbw": 0.0}}}],
     "no busbw values"),
])
@needs_mpl
def test_bad_rows(tmp_path: Path, rows: Any, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match) as err:
        plot.plot_bandwidth(rows, tmp_path / "x.png")
    assert err.value.argument == "--plot"
    assert not (tmp_path / "x.png").exists()


@needs_mpl
def test_bad_path_and_metric(tmp_path: Path) -> None:
    rows, _ = plot.load_bench_json(HOST8)
    blocker = tmp_path / "file"
    blocker.write_text("")
    for path, match in ((blocker / "sub" / "x.png", "cannot create"),
                        (tmp_path / "x.nope", "unknown image format"),
                        (tmp_path, "unknown image format|is a directory")):
        with pytest.raises(InvalidArgumentError, match=match) as err:
            plot.plot_bandwidth(rows, path)
        assert err.value.argument == "--plot"
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(InvalidArgumentError, match="not writable"):
            plot.plot_bandwidth(rows, ro / "x.png")
    with pytest.raises(InvalidArgumentError, match="unknown metric") as err:
        plot.plot_sweep(rows, tmp_path / "x.png", metrics=("gbps",))
    assert err.value.argument == "metric"
    with pytest.raises(InvalidArgumentError, match="no broadcast"):
        plot.plot_bandwidth(rows, tmp_path / "x.png", collectives=["broadcast"])
    with pytest.raises(InvalidArgumentError, match="not a 'wagma bench"):
        plot.load_bench_json(IMB8)


@needs_mpl
def test_human_bytes() -> None:
    assert [plot.human_bytes(n) for n in (8, 1024, 1536, 64 << 20, 1 << 30)] == [
        "8 B", "1 KiB", "1.5 KiB", "64 MiB", "1 GiB"]


# --------------------------------------------------------------- imbalance


@needs_mpl
def test_imbalance_synthetic(tmp_path: Path) -> None:
    methods = ["wagma", "allreduce", "solo"]
    points = [{"method": m, "delay_s": d, "it_per_s": 20 / (1 + d * (k + 1))}
              for d in (0.1, 0.0, 0.05) for k, m in enumerate(methods)]
    out = tmp_path / "imb.png"
    fig = plot.plot_imbalance(points, out, {"compute_s": 0.05, "ranks": 8})
    assert _png_size(out)[0] > 500
    ax = fig.axes[0]
    lines = _data_lines(ax)
    assert [ln.get_label() for ln in lines] == methods
    for k, ln in enumerate(lines):  # sorted by delay
        assert list(ln.get_xdata()) == [0.0, 0.05, 0.1]
        assert list(ln.get_ydata()) == pytest.approx([20 / (1 + d * (k + 1))
                                                      for d in (0.0, 0.05, 0.1)])
    assert len(ax.get_lines()) == 3  # no expectation given, none drawn
    (top,) = ax.child_axes  # the secondary "multiple of compute" axis
    assert "multiple of the compute step (50 ms)" in top.get_xlabel()
    assert plot.plot_imbalance(points, out).axes[0].child_axes == []  # no compute_s


@needs_mpl
def test_imbalance_from_json_files(tmp_path: Path) -> None:
    base = json.loads(IMB8.read_text())
    files = []
    for delay in (0.0, 0.025, 0.05):
        data = dict(base, injector=f"reference:{delay}:2" if delay else "none")
        files.append(tmp_path / f"imb-{delay}.json")
        files[-1].write_text(json.dumps(data))
    points, meta = plot.points_from_imbalance(files)
    assert meta == {"injector": "reference", "compute_s": 0.05, "ranks": 8}
    assert len(points) == 3 * len(base["rates"])
    assert sorted({p["delay_s"] for p in points}) == [0.0, 0.025, 0.05]
    wagma = [p for p in points if p["method"] == "wagma"]
    assert wagma[0]["expected"] == pytest.approx(base["expected"]["wagma"])
    fig = plot.plot_imbalance(points, tmp_path / "imb.png", meta)
    assert len(_data_lines(fig.axes[0])) == len(base["rates"])
    skewed = dict(base, injector="skewed:0.01:1.0")
    with pytest.raises(InvalidArgumentError, match="mix injector kinds"):
        plot.points_from_imbalance([files[1], skewed])


@pytest.mark.parametrize("points, match", [
    ([], "no points"),
    ({"method": "a", "delay_s": 0, "it_per_s": 1}, "list of points"),
    ([{"method": "a", "delay_s": 0}], "missing it_per_s"),
    ([{"method": "a", "delay_s": -1, "it_per_s": 1}], "non-negative"),
])
@needs_mpl
def test_imbalance_bad_points(tmp_path: Path, points: Any, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        plot.plot_imbalance(points, tmp_path / "x.png")


@needs_mpl
def test_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.png"
    assert plot.main([str(HOST8), "-o", str(out), "--metric", "busbw,time_us"]) == 0
    assert _png_size(out)[1] > 600  # two panel rows
    assert plot.main([str(IMB8), "-o", str(tmp_path / "imb.png")]) == 0
    assert plot.main([str(HOST8), str(IMB8), "-o", str(tmp_path / "y.png")]) == 2
    assert plot.main([str(tmp_path / "missing.json"), "-o", str(tmp_path / "z.png")]) == 2
    assert "cannot read" in capsys.readouterr().err


# ---------------------------------------------------------------- progress


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_progress_draws_on_tty_throttled() -> None:
    stream, clock = FakeTTY(), Clock()
    with Progress(10, "allreduce", stream, clock=clock, show_after_s=0) as bar:
        assert bar.enabled
        for i in range(10):
            clock.t += 0.02  # 50 advances/s: most redraws are skipped
            bar.advance(note=f"{i} KiB")
    out = stream.getvalue()
    frames = out.split("\r")[1:]
    assert out.endswith("\n")
    assert 2 <= len(frames) <= 5  # 0.2 s at <= 10 redraws/s, plus the final ones
    assert frames[0].startswith("allreduce  1/10  10% [##")
    assert "0:00 elapsed" in frames[0] and "ETA 0:00" in frames[0] and "0 KiB" in frames[0]
    last = frames[-1].rstrip("\n")
    assert last.startswith("allreduce  10/10 100% [" + "#" * 24 + "]")
    assert "done" in last and "9 KiB" in last


def test_progress_eta_and_show_after() -> None:
    stream, clock = FakeTTY(), Clock()
    bar = Progress(4, "sweep", stream, clock=clock, show_after_s=2.0)
    clock.t += 1.0
    bar.advance()
    assert stream.getvalue() == ""  # not yet "a few seconds"
    clock.t += 29.0  # 2 of 4 done in 30 s
    bar.advance()
    assert "2/4  50%" in stream.getvalue() and "0:30 elapsed, ETA 0:30" in stream.getvalue()
    bar.close()
    bar.close()
    assert stream.getvalue().count("\n") == 1
    quick = FakeTTY()
    with Progress(3, "quick", quick, clock=Clock(), show_after_s=2.0) as q:
        q.advance(3)
    assert quick.getvalue() == ""  # a fast sweep leaves no trace


def test_progress_silent_when_not_a_tty_or_disabled() -> None:
    plain, clock = io.StringIO(), Clock()
    with Progress(5, "x", plain, clock=clock, show_after_s=0) as bar:
        assert not bar.enabled
        for _ in range(5):
            clock.t += 1
            bar.advance()
    assert plain.getvalue() == "" and bar.count == 5
    tty = FakeTTY()
    with Progress(5, "x", tty, enabled=False, clock=clock, show_after_s=0) as bar:
        bar.advance(5)
    assert tty.getvalue() == ""
    forced = io.StringIO()
    with Progress(2, "x", forced, enabled=True, clock=clock, show_after_s=0) as bar:
        bar.advance(2)
    assert "2/2 100%" in forced.getvalue()


def test_progress_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError):
        Progress(-1)
    with pytest.raises(InvalidArgumentError):
        Progress(3, enabled="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        Progress(3, stream=io.StringIO()).advance(-2)
    assert [format_duration(s) for s in (0, 65.2, 3725)] == ["0:00", "1:05", "1:02:05"]


@needs_mpl
def test_wait_avoiding_title_names_groups_not_the_job(tmp_path: Path) -> None:
    """A wait_avoiding row's group_size is one group's ranks (as
    group_allreduce's): its panel said '(4 ranks)' for a run on 8."""
    rows, meta = plot.load_bench_json(HOST8)
    wa = [dict(r, collective="wait_avoiding") for r in rows
          if r["collective"] == "group_allreduce"]
    fig = plot.plot_bandwidth(wa, tmp_path / "wa.png", meta)
    assert [ax.get_title() for ax in fig.axes] == ["wait_avoiding (groups of 4 of 8 ranks)"]


@needs_mpl
def test_main_replots_a_delays_sweep(tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`wagma bench imbalance --delays ... --json F` writes {"sweep": [one
    result per delay]}; re-plotting F failed with "no 'rates'"."""
    base = json.loads(IMB8.read_text())
    runs = [dict(base, injector=f"reference:{d}:2" if d else "none") for d in (0.0, 0.025, 0.05)]
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"sweep": runs}))
    out = tmp_path / "sweep.png"
    assert plot.main([str(sweep), "-o", str(out)]) == 0, capsys.readouterr().err
    assert _png_size(out)[0] > 500
    points, meta = plot.points_from_imbalance([sweep])
    assert meta == {"injector": "reference", "compute_s": 0.05, "ranks": 8}
    assert sorted({p["delay_s"] for p in points}) == [0.0, 0.025, 0.05]
    assert len(points) == 3 * len(base["rates"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"sweep": [runs[0], {"ranks": 8}]}))
    assert plot.main([str(bad), "-o", str(out)]) == 2
    assert f"{str(bad)!r} sweep[1]: not a 'wagma imbalance --json'" in capsys.readouterr().err


@needs_mpl
def test_title_names_the_gpu_and_fits_one_panel(tmp_path: Path) -> None:
    """A one-collective plot is narrower than its title: a real CPU model
    pushed both ends of it off the image, and a --device cuda run's title
    named the CPU but never the GPU it measured."""
    rows, meta = plot.load_bench_json(HOST8)
    meta = dict(meta, cpu="Intel(R) Xeon(R) Processor", cpus=16, gpu="NVIDIA H100 80GB HBM3")
    fig = plot.plot_bandwidth([r for r in rows if r["collective"] == "allreduce"],
                              tmp_path / "one.png", meta)
    title = fig._suptitle
    assert "NVIDIA H100 80GB HBM3" in title.get_text()
    box = title.get_window_extent(fig.canvas.get_renderer())
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width, (box, fig.bbox.width)


def test_a_plot_is_written_whole_or_not_at_all(tmp_path) -> None:
    """savefig wrote to the path itself: a save that failed part-way (a full
    disk) left half an image over the last run's."""
    from wagma_comm.bench import plot
    from wagma_comm.errors import InvalidArgumentError

    path = tmp_path / "out.svg"
    path.write_text("the last run's plot")

    class HalfWritten:
        def savefig(self, target: str, **kwargs: object) -> None:
            assert kwargs.get("format") == "svg"  # from the path, not the temporary's name
            with open(target, "w") as fh:
                fh.write("<svg")
            raise OSError(28, "No space left on device")

    with pytest.raises(InvalidArgumentError, match="No space left"):
        plot._save(HalfWritten(), str(path))  # type: ignore[arg-type]
    assert path.read_text() == "the last run's plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.svg"]
