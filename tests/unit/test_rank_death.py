"""kill -9 of one rank in the middle of a collective (issue #7, item 1).

Each case runs tests/faults/rank_death.py on 4 ranks under ``mpiexec
-disable-auto-cleanup``: without it MPICH's launcher kills every survivor at
once (the job ends, but nobody can say why). With it, the launcher notifies
survivors with SIGUSR1, whose default action also kills them, so each rank runs
as ``sh -c "trap '' USR1; python ...; echo $? > status<rank>"`` (docs/reliability.md
says the same to users).

Every survivor must end in one of two attributable ways, and the job must end
well within twice the timeout:

* it raised RankFailedError naming the collective, the round and the victim,
  within 2 x the timeout (its JSON report), then exited with code 3 and a
  message (MPI_Finalize would wait for the dead rank);
* it was stuck inside MPI and the liveness monitor ended it with that message
  and exit code 3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).with_name("mpiexec")
SCENARIO = ROOT / "tests" / "faults" / "rank_death.py"
RANKS, VICTIM, TIMEOUT_S = 4, 2, 5.0
EXIT_CODE = 3  # wagma_comm.runtime.liveness.EXIT_CODE

# case -> (collective that fails first on the victim's peers, its round)
CASES = {
    "allreduce": ("allreduce", 1),
    "group_allreduce": ("group_allreduce", 1),
    "wait_avoiding": (None, None),
    "sync_round": (None, None),
    # A step waiting for its round's activation (no engine Work): before
    # session 47 a survivor timed out naming the round's activator instead.
    "majority": ("majority_allreduce", 3),
    "shared_memory": ("allreduce", 1),
    "shared_memory_poll": ("allreduce", 1),  # found by the polls, not at the deadline
    # The death breaks the communicator in a shared-memory allreduce; the
    # partial collectives' next steps (solo, board WAGMA) must say it.
    "shared_memory_then_partial": ("wait_avoiding_group_allreduce", 0),
    "board_lock": ("wait_avoiding_group_allreduce", 1),  # died holding its board lock
    "board_lock_unnamed": ("wait_avoiding_group_allreduce", 1),  # ... before saying so
    "exit": (None, None),  # no error to raise: the exit itself must not block
}

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not installed")


def run_case(case: str, out: Path, ranks: int = RANKS, timeout: float = TIMEOUT_S,
             env: dict[str, str] | None = None) -> tuple[float, str, dict[int, dict]]:
    """Run one scenario; (seconds, launcher stderr, each rank's report and
    exit status). ``env`` adds variables (the GPU cases: NCCL's)."""
    command = (f"trap '' USR1; {sys.executable} {SCENARIO} {case} {VICTIM} {timeout} "
               f"{out}; echo $? > {out}/status$PMI_RANK")
    started = time.monotonic()
    proc = subprocess.run(
        [str(MPIEXEC), "-disable-auto-cleanup", "-n", str(ranks), "sh", "-c", command],
        capture_output=True, text=True, timeout=20 * timeout, cwd=ROOT,
        env=None if env is None else {**os.environ, **env})
    elapsed = time.monotonic() - started
    outcomes: dict[int, dict] = {}
    for r in range(ranks):
        report = out / f"rank{r}.json"
        status = out / f"status{r}"
        outcomes[r] = {
            "report": json.loads(report.read_text()) if report.exists() else None,
            "status": int(status.read_text()) if status.exists() else None,
        }
    return elapsed, proc.stderr, outcomes


@pytest.mark.parametrize("case", list(CASES))
def test_rank_death_ends_the_job_and_says_why(case: str, tmp_path: Path) -> None:
    elapsed, stderr, outcomes = run_case(case, tmp_path)
    print(case, f"{elapsed:.1f}s", json.dumps(outcomes, indent=1), stderr[-2000:])
    # MPI start-up takes a few seconds on this machine: the bound is 2 x timeout
    # after start-up, which itself is well under the timeout.
    assert elapsed < 3 * TIMEOUT_S + 10
    assert outcomes[VICTIM]["report"] is None and outcomes[VICTIM]["status"] == 128 + 9
    collective, round_ = CASES[case]
    for r, outcome in outcomes.items():
        if r == VICTIM:
            continue
        report, status = outcome["report"], outcome["status"]
        assert status == EXIT_CODE, (r, outcome)
        assert f"rank {r} exits (code {EXIT_CODE})" in stderr
        if case.startswith(("shared_memory", "board_lock")):
            # Waits and polls in the segment run in Python, never stuck in MPI:
            # each must see the death itself, well before the timeout.
            assert report is not None and report["elapsed"] < TIMEOUT_S, (r, outcome)
        if report is None:
            continue  # stuck inside MPI, or exiting: the exit path ended it
        assert report["error"] == "RankFailedError", report
        assert VICTIM in report["ranks"], report
        assert report["elapsed"] < 2 * TIMEOUT_S, report
        if collective is not None:
            assert report["collective"] in (collective, "allreduce"), report
            assert report["round"] >= round_, report
        else:
            assert report["collective"] in ("wait_avoiding_group_allreduce", "allreduce")


_SEGMENTS_SCRIPT = """
import os, signal, sys
import numpy as np
import wagma_comm

victim, out = int(sys.argv[1]), sys.argv[2]
comm = wagma_comm.init(timeout=5.0)
comm.barrier()
with open("/proc/self/maps") as f:  # MPI's named segments this rank maps
    names = {line.split(None, 5)[5] for line in f.read().splitlines()
             if len(line.split(None, 5)) == 6 and "/dev/shm/" in line
             and not line.endswith(" (deleted)")}
with open(os.path.join(out, f"maps{comm.rank}"), "w") as f:
    f.write("\\n".join(sorted(names)))
comm.barrier()
if comm.rank == victim:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    comm.allreduce(np.ones(1 << 20, np.float32), algorithm="ring")
except wagma_comm.RankFailedError:
    pass
"""


@pytest.mark.parametrize("victim", [0, 1])
def test_survivors_of_a_death_leave_no_mpi_segment_in_dev_shm(victim: int,
                                                               tmp_path: Path) -> None:
    """Survivors skip MPI_Finalize (it would wait for the dead rank), which
    is what unlinks MPICH's /dev/shm/mpich_shm_* segment: before session 47
    every job that lost a rank left one (4 MiB) behind, whichever rank died
    (each survivor's exit now unlinks the MPI segments it maps)."""
    script = tmp_path / "segments.py"
    script.write_text(_SEGMENTS_SCRIPT)
    command = (f"trap '' USR1; {sys.executable} {script} {victim} {tmp_path}; "
               f"echo $? > {tmp_path}/status$PMI_RANK")
    proc = subprocess.run(
        [str(MPIEXEC), "-disable-auto-cleanup", "-n", "3", "sh", "-c", command],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    statuses = {r: (tmp_path / f"status{r}").read_text().strip() for r in range(3)}
    assert statuses[victim] == str(128 + 9), (statuses, proc.stderr[-2000:])
    assert all(s == str(EXIT_CODE) for r, s in statuses.items() if r != victim), (
        statuses, proc.stderr[-2000:])
    names = {name for r in range(3) for name in (tmp_path / f"maps{r}").read_text().split()}
    if not names:
        pytest.skip("this MPI maps no named segment in /dev/shm")
    left = sorted(name for name in names if os.path.exists(name))
    assert left == [], left
