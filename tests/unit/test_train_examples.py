"""The examples run as a user would start them (one process, no mpiexec): the
JAX example goes through DLPack both ways, the PyTorch one is the few-lines
integration. Multi-rank runs of the training layer are in tests/mpi."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _accuracy(script: str, *args: str) -> float:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.search(r"test accuracy ([0-9.]+)%", out.stdout)
    assert found, out.stdout
    return float(found.group(1))


def test_jax_example_trains_through_dlpack() -> None:
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    assert _accuracy("jax_example.py", "--steps", "80") > 80.0


def test_torch_example_trains() -> None:
    assert _accuracy("torch_example.py", "--epochs", "2", "--method", "allreduce") > 70.0
