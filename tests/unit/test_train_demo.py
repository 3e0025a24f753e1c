"""The demo's reporting: time to target, averaging over seeds, the table and the
target verdicts (no MPI; the end-to-end run is in tests/mpi/test_train.py)."""

from __future__ import annotations

import argparse

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
