"""Size-agnostic MPI tests: the same file passes at 1, 2, 3, 4 and 8 ranks.

A failed test on any rank prints its report to stderr (prefixed with the rank)
and aborts the MPI job: the other ranks would otherwise block in the next
collective until its timeout.
"""

from __future__ import annotations

import sys
from typing import Iterator

import pytest
from mpi4py import MPI

import wagma_comm

# Short deadline: a test that hangs fails within seconds, not minutes.
TEST_TIMEOUT_S = 60.0


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"\n[rank {rank}] FAILED {report.nodeid} ({report.when})\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture(scope="session")
def comm() -> Iterator[wagma_comm.Communicator]:
    c = wagma_comm.init(timeout=TEST_TIMEOUT_S)
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _in_step(comm: wagma_comm.Communicator) -> Iterator[None]:
    """Start every test together so one slow test setup cannot eat into the
    next test's collective deadlines."""
    comm.barrier()
    yield
