"""The ``wagma`` script's handling of bad input."""

from __future__ import annotations

import subprocess
import sys


def _wagma(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wagma_comm.cli", *argv],
                          capture_output=True, text=True, timeout=120)


def test_bad_input_is_one_line_and_exit_status_2() -> None:
    # Was a traceback (from every rank under mpiexec) and exit status 1.
    out = _wagma("sim", "--ranks", "4", "--steps", "2", "--algorithm", "native",
                 "--methods", "wagma")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wagma sim: error: methods:"), lines


def test_a_command_that_succeeds_exits_0() -> None:
    out = _wagma("schedule", "--ranks", "4", "--group-size", "2", "--count", "4")
    assert out.returncode == 0 and "verified" in out.stderr
