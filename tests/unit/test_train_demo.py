"""The demo's reporting: time to target, averaging over seeds, the table and the
target verdicts (no MPI; the end-to-end run is in tests/mpi/test_train.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from wagma_comm import InvalidArgumentError
from wagma_comm.cli import build_parser
from wagma_comm.demo import (
    Run,
    check_options,
    check_targets,
    format_table,
    summarize,
    first_reaching,
)


def _run(method: str, seed: int, acc: float, times: list[float], accs: list[float],
         elapsed: float = 10.0) -> Run:
    return Run(method, seed, 100, elapsed, 0.002, acc, times, accs)


def test_time_to_target_is_the_first_crossing() -> None:
    assert first_reaching([1, 2, 3, 4], [0.5, 0.91, 0.85, 0.95], 0.9) == 2
    assert first_reaching([1, 2], [0.5, 0.6], 0.9) is None
    assert first_reaching([], [], 0.9) is None
    assert first_reaching([10, 20, 30], [0.5, 0.95, 0.99], 0.9) == 20
    assert first_reaching([10], [0.5], 0.9) is None


def test_summary_averages_over_seeds_and_counts_misses() -> None:
    runs = [_run("wagma", 0, 0.96, [1, 2], [0.9, 0.96]),
            _run("wagma", 1, 0.98, [1, 2], [0.95, 0.98]),
            _run("allreduce", 0, 0.97, [2, 4], [0.9, 0.97], elapsed=20.0),
            _run("allreduce", 1, 0.93, [2, 4], [0.9, 0.93], elapsed=20.0)]
    rows = {r.method: r for r in summarize(runs, 0.95)}
    w, a = rows["wagma"], rows["allreduce"]
    assert w.final_accuracy == pytest.approx(0.97) and w.final_sd == pytest.approx(0.01414, 1e-3)
    assert w.time_to_target == pytest.approx(1.5) and w.reached == 2
    assert a.time_to_target == 4 and a.reached == 1 and a.seeds == 2
    assert w.iterations_per_s == 10 and a.iterations_per_s == 5
    table = format_table(list(rows.values()), 0.95)
    assert "| wagma | 97.00% ± 1.41 | 1.50 | 10.0 | 2.00 | - | - |" in table
    assert "4.00 (1/2 seeds)" in table and "time to 95% (s)" in table
    verdicts = check_targets(list(rows.values()))
    assert verdicts[0].startswith("accuracy: wagma 97.00% vs allreduce 95.00% (+2.00 pp")
    assert "met (2.67x)" in verdicts[1]


def test_verdicts_say_not_met_and_by_how_much() -> None:
    runs = [_run("wagma", 0, 0.95, [3], [0.95]), _run("local_sgd", 0, 0.97, [1], [0.97]),
            _run("allreduce", 0, 0.97, [2], [0.97])]
    lines = check_targets(summarize(runs, 0.95))
    assert "-2.00 pp; target within 1 pp: NOT met" in lines[0]
    assert any("local_sgd 1.00 s: NOT met (0.33x)" in s for s in lines)


def test_demo_is_a_wagma_command_with_its_options() -> None:
    args = build_parser().parse_args(["demo", "--methods", "wagma,allreduce", "--seeds", "2",
                                      "--group-size", "2", "--sync-every", "5",
                                      "--imbalance", "reference:0.01:2", "--epochs", "3"])
    assert args.command == "demo" and args.seeds == 2 and args.group_size == 2
    assert check_options(args) == ["wagma", "allreduce"]


@pytest.mark.parametrize("bad,argument", [(["--methods", "wagma,sgd"], "methods"),
                                          (["--epochs", "0"], "epochs"),
                                          (["--group-size", "-1"], "group_size"),
                                          (["--target", "1.5"], "target"),
                                          (["--target", "nan"], "target"),
                                          # Accepted before: NaN weights reported as a
                                          # ~10% accuracy, or time.sleep crashing mid-run.
                                          (["--lr", "nan"], "lr"),
                                          (["--lr", "inf"], "lr"),
                                          (["--lr", "0"], "lr"),
                                          (["--momentum", "nan"], "momentum"),
                                          (["--momentum", "-0.5"], "momentum"),
                                          (["--compute", "nan"], "compute"),
                                          (["--compute", "inf"], "compute"),
                                          (["--compute", "-0.01"], "compute"),
                                          # Silently ran one rank.
                                          (["--ranks", "0"], "ranks"),
                                          (["--ranks", "-2"], "ranks")])
def test_bad_options_are_refused_before_mpi(bad: list[str], argument: str) -> None:
    args: argparse.Namespace = build_parser().parse_args(["demo", *bad])
    with pytest.raises(InvalidArgumentError) as err:
        check_options(args)
    assert err.value.argument == argument


def test_cuda_without_a_gpu_is_refused_before_mpi() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu/mpi/test_gpu_train.py runs the demo on it")
    args = build_parser().parse_args(["demo", "--device", "cuda"])
    with pytest.raises(InvalidArgumentError) as err:
        check_options(args)
    assert err.value.argument == "device" and "no CUDA GPU" in str(err.value)


# -- session 45 review: regressions ---------------------------------------------------


def test_a_method_given_twice_is_refused() -> None:
    """Each repeat ran again and was averaged in as one more seed (the table
    said "(1/2 seeds)" under --seeds 1)."""
    args = build_parser().parse_args(["demo", "--methods", "wagma,allreduce,wagma"])
    with pytest.raises(InvalidArgumentError) as err:
        check_options(args)
    assert err.value.argument == "methods" and "more than once" in str(err.value)


@pytest.mark.parametrize("grace", ["nan", "-0.1", "2"])
def test_a_bad_grace_is_refused_before_mpi(grace: str) -> None:
    """It was found only by WAGMA's constructor: after MPI start-up, the data
    and the header, once per rank under --ranks N."""
    args = build_parser().parse_args(["demo", "--grace", grace])
    with pytest.raises(InvalidArgumentError) as err:
        check_options(args)
    assert err.value.argument == "grace"


def _demo(*extra: str, timeout: float = 180) -> "subprocess.CompletedProcess[str]":
    """``wagma demo`` on one rank (MPI singleton, no mpiexec), tiny and quiet."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                        "MPI_LOCALNRANKS")}
    return subprocess.run([sys.executable, "-m", "wagma_comm.cli", "demo", "--ranks", "1",
                           "--seeds", "1", "--epochs", "1", "--methods", "allreduce",
                           "--compute", "0", "--quiet", *extra],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("option,name", [("--json", "out.json"), ("--plot", "acc.png")])
def test_an_unwritable_output_is_refused_before_training(tmp_path: Any, option: str,
                                                         name: str) -> None:
    """Found only at the end before: minutes of training lost to a
    NotADirectoryError (and a failing plot lost the JSON too)."""
    pytest.importorskip("sklearn")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = _demo(option, str(blocker / name), timeout=120)
    assert out.returncode == 2
    assert f"wagma demo: error: {option[2:]}:" in out.stderr, out.stderr[-2000:]
    assert "# wagma demo" not in out.stdout and "| allreduce |" not in out.stdout


def test_json_and_plot_go_to_new_directories(tmp_path: Any) -> None:
    """--plot created its directory, --json did not: a FileNotFoundError after
    the whole run."""
    pytest.importorskip("sklearn")
    js, png = tmp_path / "new" / "deep" / "out.json", tmp_path / "other" / "acc.png"
    out = _demo("--json", str(js), "--plot", str(png), "--target", "0.5")
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(js.read_text())
    assert [r["method"] for r in result["rows"]] == ["allreduce"] and len(result["runs"]) == 1
    assert png.stat().st_size > 10_000
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]  # no temporaries left


def test_the_warm_up_is_no_longer_than_the_run() -> None:
    """The untimed warm-up ran sync_every + 2 iterations per method whatever
    the run's length: --sync-every 1000000 (no sync round in a 90-iteration
    run) sat silent for a million warm-up iterations."""
    pytest.importorskip("sklearn")
    t0 = time.monotonic()
    out = _demo("--sync-every", "1000000", "--plot", "", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert time.monotonic() - t0 < 120


def test_a_batch_larger_than_a_shard_is_refused() -> None:
    """Each step silently took the whole shard (1,442 samples on one rank)
    while the header and the JSON said --batch."""
    pytest.importorskip("sklearn")
    out = _demo("--batch", "5000", "--plot", "", timeout=120)
    assert out.returncode == 2
    assert "wagma demo: error: batch:" in out.stderr, out.stderr[-2000:]
    assert "must be <= 1442" in out.stderr and "got 5000" in out.stderr


def test_rank_0_keeps_only_the_snapshots_it_evaluates() -> None:
    """Rank 0 kept a copy of the model after every step but evaluated at most
    ~300: memory (GPU memory with --device cuda) grew with the run's length.
    3,000 steps of a 38,410-parameter model held ~460 MB; now ~46 MB."""
    pytest.importorskip("sklearn")
    if not os.path.exists("/proc/self/status"):
        pytest.skip("peak RSS is read from /proc")
    code = textwrap.dedent("""
        import wagma_comm
        from wagma_comm import demo, imbalance
        from wagma_comm.cli import build_parser

        def peak_kb():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])

        o = build_parser().parse_args(["demo", "--hidden", "512", "--compute", "0"])
        with wagma_comm.init(timeout=60) as comm:
            data = demo.load_data()
            none = imbalance.make_injector("none", 1, 0)
            demo.train(comm, "allreduce", 0, data, o, none, iterations=50)
            before = peak_kb()
            run = demo.train(comm, "allreduce", 0, data, o, none, iterations=3000)
            grew = peak_kb() - before
        print("grew", grew, "evaluated", len(run.times), run.steps[:3], run.steps[-2:])
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI", "MPI_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    words = out.stdout.split()
    grew_mb, evaluated = int(words[1]) / 1024, int(words[3])
    assert 300 <= evaluated <= 302  # every 10th step, the last, and the final model
    assert "[1, 11, 21] [3000, 3000]" in out.stdout
    assert grew_mb < 200, out.stdout


def test_an_unwritable_output_is_refused_before_mpiexec_starts(tmp_path: Any) -> None:
    """--ranks N: the launcher checks the outputs before starting the ranks."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = _demo("--ranks", "2", "--json", str(blocker / "out.json"), timeout=120)
    assert out.returncode == 2
    assert "wagma demo: error: json:" in out.stderr, out.stderr[-2000:]
    assert "# starting" not in out.stdout
