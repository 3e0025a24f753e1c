"""MPI tests on GPU buffers (torch CUDA tensors and CuPy arrays) over NCCL.
Run with `make test-gpu` on a GPU machine: every rank of the job uses the
GPU of its node (several ranks per GPU with NCCL_MULTI_RANK_GPU_ENABLE=1)."""

from __future__ import annotations

import sys
from typing import Iterator

from pathlib import Path

import pytest
from mpi4py import MPI

import wagma_comm
from wagma_comm.transport.nccl import unavailable_reason

TEST_TIMEOUT_S = 60.0
REASON = unavailable_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here not in Path(str(item.path)).parents:
            continue  # this hook sees the whole session's items
        item.add_marker(pytest.mark.gpu)
        if REASON is not None:
            item.add_marker(pytest.mark.skip(reason=f"no GPU path here: {REASON}"))


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
    comm.barrier()
    yield
