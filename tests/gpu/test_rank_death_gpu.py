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
    elapsed, stderr, outcomes = host.run_case(case, tmp_path, RANKS, TIMEOUT_S, NCCL_ENV)
    print(case, f"{elapsed:.1f}s", json.dumps(outcomes, indent=1), stderr[-3000:])
    assert elapsed < 3 * TIMEOUT_S + 20
    victim = host.VICTIM
    assert outcomes[victim]["report"] is None and outcomes[victim]["status"] == 128 + 9
    for r, outcome in outcomes.items():
        if r == victim:
            continue
        report = outcome["report"]
        assert report is not None, (r, outcome)
        assert report["error"] in ("RankFailedError", "CollectiveTimeoutError"), report
        # A survivor may be waiting for another survivor that failed because
        # of the victim and left (a cascade): then it names that one, and
        # the victim as dead outside its group.
        assert (victim in report["ranks"]
                or f"ranks [{victim}], outside this group, are dead" in report["message"]), report
        assert report["collective"] in ("allreduce", "group_allreduce"), report
        assert report["elapsed"] < 2 * TIMEOUT_S, report
        assert report.get("device_free") is True, report
        assert outcome["status"] == host.EXIT_CODE, (r, outcome)
