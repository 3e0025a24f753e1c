"""GPU tests: skipped (with the reason) where no CUDA GPU, CuPy or nccl4py is
present; run on a GPU machine with `make test-gpu` (docs/gpu.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wagma_comm.transport.nccl import unavailable_reason

REASON = unavailable_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here not in Path(str(item.path)).parents:
            continue  # this hook sees the whole session's items
        item.add_marker(pytest.mark.gpu)
        if REASON is not None:
            item.add_marker(pytest.mark.skip(reason=f"no GPU path here: {REASON}"))
