"""``wagma_comm.init()`` works in a plain process, without mpiexec (MPI
singleton start), and the CLI entry point runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_init_without_mpiexec() -> None:
    code = textwrap.dedent("""
        import numpy as np, torch, wagma_comm
        with wagma_comm.init(timeout=30) as comm:
            assert (comm.rank, comm.size) == (0, 1)
            a = np.arange(5, dtype=np.float32)
            assert comm.allreduce(a, "avg") is a and a.tolist() == [0, 1, 2, 3, 4]
            t = torch.ones(3, dtype=torch.bfloat16)
            h = comm.group_allreduce(t, 1, 0, async_op=True)
            assert h.wait() is t and bool((t == 1).all())
            comm.broadcast(a, root=0)
            comm.barrier()
            assert comm.groups(1, 0) == [[0]]
            assert comm.statistics()["failed"] == 0
        print("single-process ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "single-process ok" in out.stdout


def test_wagma_schedule_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "wagma_comm.cli", "schedule", "--ranks", "8",
         "--group-size", "4", "--step", "1", "--dot"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("digraph") and "r4" in out.stdout
    assert "verified" in out.stderr
