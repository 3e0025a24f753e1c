"""kill -9 of one rank during NCCL collectives on GPU buffers (issue #9 item 2).

Runs tests/faults/rank_death.py's GPU cases on 4 ranks sharing one GPU
(NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL >= 2.30.3). Every survivor must raise an
error naming the dead rank (as a missing member, or as dead outside its
group when it waited for a survivor that left) within 2 x the timeout, find the GPU free afterwards
(its NCCL kernels aborted, not left spinning on the dead peer), and exit with
the liveness exit code.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_HOST_TEST = Path(__file__).resolve().parents[1] / "unit" / "test_rank_death.py"
_spec = importlib.util.spec_from_file_location("host_rank_death", _HOST_TEST)
host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host)  # type: ignore[union-attr]

RANKS = 4
TIMEOUT_S = 10.0  # NCCL set-up of 4 ranks on one GPU takes seconds
NCCL_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "8"}


@pytest.mark.skipif(not host.MPIEXEC.exists(), reason="mpiexec not installed")
@pytest.mark.parametrize("case", ["gpu_allreduce", "gpu_group_allreduce", "gpu_absent"])
def test_a_rank_killed_during_nccl_work_is_named_and_frees_the_gpu(case: str,
                                                                   tmp_path: Path) -> None:
    _check_survivors(case, tmp_path, ("allreduce", "group_allreduce"), every_one_reports=True)


def _check_survivors(case: str, tmp_path: Path, collectives: tuple[str, ...],
                     every_one_reports: bool) -> None:
    """Run ``case``: the victim died by SIGKILL; every survivor ends with the
    liveness exit code, and each report names the victim (or, in a cascade,
    the victim as dead outside its group), within 2 x the timeout, with the
    GPU free. ``every_one_reports``: no survivor may be ended by the exit
    path before it raised (else at least one must report)."""
    elapsed, stderr, outcomes = host.run_case(case, tmp_path, RANKS, TIMEOUT_S, NCCL_ENV)
    print(case, f"{elapsed:.1f}s", json.dumps(outcomes, indent=1), stderr[-3000:])
    assert elapsed < 3 * TIMEOUT_S + 20
    victim = host.VICTIM
    assert outcomes[victim]["report"] is None and outcomes[victim]["status"] == 128 + 9
    reports = 0
    for r, outcome in outcomes.items():
        if r == victim:
            continue
        assert outcome["status"] == host.EXIT_CODE, (r, outcome)
        report = outcome["report"]
        assert report is not None or not every_one_reports, (r, outcome)
        if report is None:
            continue  # the liveness exit path ended it first (as on the host)
        reports += 1
        assert report["error"] in ("RankFailedError", "CollectiveTimeoutError"), report
        # A survivor may be waiting for another survivor that failed because
        # of the victim and left (a cascade): then it names that one, and
        # the victim as dead outside its group.
        assert (victim in report["ranks"]
                or f"ranks [{victim}], outside this group, are dead" in report["message"]), report
        assert report["collective"] in collectives, report
        assert report["elapsed"] < 2 * TIMEOUT_S, report
        assert report.get("device_free") is True, report
    assert reports >= 1, "no survivor raised: every one was ended by the exit path"


@pytest.mark.skipif(not host.MPIEXEC.exists(), reason="mpiexec not installed")
def test_a_rank_absent_from_nccl_work_times_out_and_frees_the_gpu(tmp_path: Path) -> None:
    """The victim lives but never joins: every other rank's GPU collective
    fails at its deadline with CollectiveTimeoutError naming the collective,
    its round and the members NCCL could not vouch for (the victim among
    them), the GPU is free, and the job ends normally."""
    elapsed, stderr, outcomes = host.run_case("gpu_timeout", tmp_path, RANKS, TIMEOUT_S,
                                              NCCL_ENV)
    print(f"{elapsed:.1f}s", json.dumps(outcomes, indent=1), stderr[-3000:])
    victim = host.VICTIM
    # The victim outlives the others: its exit may find them gone (code 3).
    assert outcomes[victim]["status"] in (0, host.EXIT_CODE), outcomes[victim]
    for r, outcome in outcomes.items():
        if r == victim:
            continue
        report = outcome["report"]
        assert report is not None and outcome["status"] == 0, (r, outcome)
        assert report["error"] == "CollectiveTimeoutError", report
        assert report["collective"] == "allreduce" and report["round"] == 2, report
        assert victim in report["ranks"] and r not in report["ranks"], report
        assert TIMEOUT_S * 0.9 < report["elapsed"] < 2 * TIMEOUT_S, report
        assert report.get("device_free") is True, report


@pytest.mark.skipif(not host.MPIEXEC.exists(), reason="mpiexec not installed")
@pytest.mark.parametrize("case", ["gpu_wait_avoiding", "gpu_sync_round"])
def test_a_rank_killed_inside_a_wagma_gpu_round_is_named_and_frees_the_gpu(
        case: str, tmp_path: Path) -> None:
    """WAGMA on GPU buffers: the victim dies in its 4th step (a group round,
    or the synchronous round). The survivors' rounds on the collective's own
    NCCL communicators must be aborted, not left waiting on the GPU; each
    survivor that raises names the victim (or, waiting for a survivor that
    already left, the victim as dead outside its group), within 2 x the
    timeout, and every survivor ends with the liveness exit code."""
    _check_survivors(case, tmp_path, ("wait_avoiding_group_allreduce", "allreduce"),
                     every_one_reports=False)
