"""Run the MPI test files on every rank of an ``mpiexec`` job.

Rank 0 reports; the other ranks stay quiet unless a test fails there. A failure
on any rank aborts the whole job (conftest.py), so a rank that moved on to the
next test can never wait forever for one that stopped.
"""

from __future__ import annotations

import os
import sys

import pytest
from mpi4py import MPI

if __name__ == "__main__":
    # WAGMA_TEST_DIR runs another directory of MPI tests the same way (make soak).
    here = os.environ.get("WAGMA_TEST_DIR") or os.path.dirname(os.path.abspath(__file__))
    args = sys.argv[1:] or ["-q"]
    if MPI.COMM_WORLD.Get_rank() != 0:  # quiet; failures still reach stderr
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
    code = pytest.main([here, "-p", "no:cacheprovider", *args])
    MPI.COMM_WORLD.Barrier()
    sys.exit(int(code))
