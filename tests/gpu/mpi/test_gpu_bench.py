"""``wagma bench --device cuda`` end to end at small sizes: our collectives and
torch.distributed's nccl on the same CUDA tensors, results checked (-c), for
the collectives and the persistent partial ones."""

from __future__ import annotations

import json
import os

import pytest
from mpi4py import MPI

from wagma_comm.bench import cli as bench_cli
from wagma_comm.cli import build_parser

WORLD = MPI.COMM_WORLD


def _bench(argv: list[str]) -> int:
    return bench_cli.run(build_parser().parse_args(["bench", *argv]))


@pytest.mark.parametrize("collective", ["allreduce", "group_allreduce", "broadcast",
                                        "wait_avoiding", "solo"])
def test_bench_device_cuda_runs_and_checks(tmp_path_factory, collective):
    path = WORLD.bcast(str(tmp_path_factory.mktemp("gpubench")) if WORLD.rank == 0 else None)
    out = os.path.join(path, f"{collective}.json")
    assert _bench([collective, "--device", "cuda", "-b", "8", "-e", "64K", "-f", "32",
                   "-n", "3", "-r", "1", "-w", "1", "-c", "1", "-d", "bfloat16",
                   "--vs", "nccl", "--json", out]) == 0
    if WORLD.rank != 0:
        return
    with open(out) as fh:
        rows = json.load(fh)["rows"]
    assert len(rows) == 3
    for row in rows:
        assert "wagma" in row["results"] and "nccl" in row["results"], row
        for name, result in row["results"].items():
            assert result["time_us"] > 0, (name, result)
            if collective in ("allreduce", "group_allreduce", "broadcast"):
                assert result["wrong"] in (0, -1), (name, result)
                if name in ("wagma", "nccl"):
                    assert result["wrong"] == 0, (name, result)
