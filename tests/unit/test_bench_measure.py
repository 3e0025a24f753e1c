"""The pure logic of ``wagma bench``: the result check's inputs and the
summaries' verdicts (no MPI needed); its CSV and metadata; and the probe
scripts in bench/ (a few runs under mpiexec)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wagma_comm import dtypes, groups
from wagma_comm.bench import check

F32 = dtypes.lookup("float32")


def _wrong(got: np.ndarray, want: np.ndarray) -> int:
    return check.count_wrong(got.astype(np.float32), F32, want)


def test_check_tells_every_rank_of_eight_apart() -> None:
    """Ranks r and r+4 had the same input: at 8 ranks (the documented runs)
    the default group_allreduce's two groups of 4 had the same expected
    result, and rank 0 counted twice with rank 4 dropped summed right."""
    count = 16
    first, second = groups.partition(8, 4, 0)
    assert _wrong(check.expected_result("group_allreduce", second, count, "sum"),
                  check.expected_result("group_allreduce", first, count, "sum")) > 0
    duplicated = [0, 1, 2, 3, 0, 5, 6, 7]
    assert _wrong(check.expected_result("allreduce", duplicated, count, "sum"),
                  check.expected_result("allreduce", range(8), count, "sum")) > 0
    assert _wrong(check.expected_result("broadcast", range(8), count, "sum", root=4),
                  check.expected_result("broadcast", range(8), count, "sum", root=0)) > 0
    for a in range(64):  # any two ranks differ in a buffer of 4 elements
        for b in range(a + 1, 64):
            assert not np.array_equal(check.pattern(a, 4, F32), check.pattern(b, 4, F32))


def test_check_inputs_stay_exact_in_every_dtype() -> None:
    """Small integers in [1, 6] whose sums over 8 ranks fit uint8 and are
    exact in bfloat16, so the check needs no tolerance for sums."""
    for rank in range(256):
        values = check.pattern(rank, 48, F32)
        assert values.min() >= 1 and values.max() <= 6
    total = check.expected_result("allreduce", range(8), 48, "sum")
    assert total.max() <= 255
    for row in dtypes.ALL:
        for rank in range(8):
            got = check.pattern(rank, 48, row).view(row.storage)
            assert check.count_wrong(got, row, check.pattern(rank, 48, F32)
                                     .astype(np.float64)) == 0


def _overlap_row(impl: str, wrong: int) -> dict:
    return {"impl": impl, "nbytes": 16 << 20, "overlap_pct": 50.0 if impl == "wagma" else 0.0,
            "wrong": wrong}


def test_overlap_summary_judges_the_checked_results() -> None:
    """`wagma bench overlap` printed the overlap target's PASS and nothing
    else, even when the overlapped allreduce had wrong elements (#wrong)."""
    from wagma_comm.bench import report

    bad = report.overlap_summary([_overlap_row("wagma", 7), _overlap_row("mpi", 0)])
    assert "results checked: 7 wrong elements in 2 checked results  FAIL" in bad
    good = report.overlap_summary([_overlap_row("wagma", 0), _overlap_row("mpi", 0)])
    assert "results checked: 0 wrong elements in 2 checked results  PASS" in good
    unchecked = report.overlap_summary([_overlap_row("wagma", -1)])
    assert "results not checked" in unchecked and "FAIL" not in unchecked


# ------------------------------------------------- the probe scripts in bench/

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).with_name("mpiexec")
# The scripts run under mpiexec that make MPI calls of their own, which have no
# timeout (MPI_Barrier, gather, MPI_Allreduce as a peer, spin loops).
MPI_SCRIPTS = ("async_small", "group_small", "idle_overhead", "latency_cpu", "latency_layers",
               "latency_probe", "listening_calls", "peers_allreduce", "round_probe",
               "shm_probe", "sync_round")


def _aborts_on_error(path: Path) -> bool:
    """Whether the script's ``if __name__ == "__main__":`` block runs its main
    through wagma_comm.bench.measure.run_or_abort (MPI_Abort on an error)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return any("run_or_abort(main)" in ast.unparse(stmt) for stmt in node.body)
    return False


@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not installed")
def test_one_ranks_error_ends_a_bench_script() -> None:
    """An error on one rank left the others blocked in an MPI call with no
    timeout for ever (here rank 1 divides by zero after its first barrier
    and rank 0 waits in MPI_Allreduce): the job now ends, with the error."""
    script = ROOT / "bench" / "latency_cpu.py"
    common = [sys.executable, str(script), "--rounds", "1"]
    try:
        done = subprocess.run([str(MPIEXEC), "-n", "1", *common, "--iters", "3", ":",
                               "-n", "1", *common, "--iters", "0"],
                              capture_output=True, text=True, timeout=90, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("rank 0 still blocked 90 s after rank 1 failed")
    assert done.returncode != 0
    assert "ZeroDivisionError" in done.stderr
    missing = [name for name in MPI_SCRIPTS
               if not _aborts_on_error(ROOT / "bench" / f"{name}.py")]
    assert missing == [], f"scripts that would hang on one rank's error: {missing}"


def test_csv_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    """`--csv` was written in place: a failure part-way (here a result
    without busbw; a full disk alike) left half a table over the last run's
    file, where `--json` keeps the earlier file whole."""
    from wagma_comm.bench import report
    from wagma_comm.bench.cli import Row

    res = {"time_us": 2.0, "min_us": 1.0, "max_us": 3.0, "algbw": 1.0, "busbw": 1.5,
           "wrong": 0}
    path = tmp_path / "out.csv"
    report.write_csv(str(path), [Row("allreduce", 64, 16, "float32", "sum", 4, {"wagma": res})])
    before = path.read_text()
    assert before.count("\n") == 2 and before.splitlines()[1].startswith("allreduce,wagma,64,")
    broken = {k: v for k, v in res.items() if k != "busbw"}
    rows = [Row("allreduce", n, n // 4, "float32", "sum", 4, {"wagma": res, "mpi": broken})
            for n in (8, 16)]
    with pytest.raises(KeyError):
        report.write_csv(str(path), rows)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]  # no temporary left


def test_metadata_counts_the_machines_cpus() -> None:
    """`meta.cpus` was the CPUs rank 0 may run on: 1 under `mpiexec -bind-to
    core`, so the plot's title said '(1 CPUs)' of a 2-CPU machine."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs a machine with 2 CPUs or more")
    code = ("import os, json; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "from mpi4py import MPI\nfrom wagma_comm.bench import report\n"
            "m = report.metadata(MPI.COMM_WORLD, [])\n"
            "print(json.dumps([m['cpus'], m['rank0_cpus'], m['ranks']]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [os.cpu_count(), 1, 1]


@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not installed")
def test_sync_round_runs_below_four_ranks() -> None:
    """bench/sync_round.py asked for groups of 4 whatever the job: at 2 or 3
    ranks it failed with an InvalidArgumentError on group_size."""
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable,
                           str(ROOT / "bench" / "sync_round.py"), "8", "3"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()] == ["wagma", "allreduce",
                                                                      "MPI"]


@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not installed")
def test_latency_layers_says_it_needs_the_message_path() -> None:
    """bench/latency_layers.py without WAGMA_SHM=0 (its docstring's command
    sets it) failed with "'SharedCall' object has no attribute 'ops'"."""
    env = {k: v for k, v in os.environ.items() if k != "WAGMA_SHM"}
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable,
                           str(ROOT / "bench" / "latency_layers.py")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode != 0
    assert "went through shared memory" in done.stderr and "WAGMA_SHM=0" in done.stderr
    assert "AttributeError" not in done.stderr
