"""``wagma demo`` under a real MPI job: an output rank 0 cannot write fails on
every rank, before any training (the whole run in tests/mpi/test_train.py)."""

from __future__ import annotations

import os
import tempfile

import pytest
from mpi4py import MPI

from wagma_comm import Communicator, InvalidArgumentError

RANK = MPI.COMM_WORLD.Get_rank()


def test_an_output_rank_0_cannot_write_fails_on_every_rank(comm: Communicator) -> None:
    """Only rank 0 writes --json, at the end: it failed there alone, after the
    whole run, while the others returned as if all went well."""
    pytest.importorskip("sklearn")
    from wagma_comm import demo

    parser = demo.argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    with tempfile.TemporaryDirectory(prefix=f"wagma-demo-r{RANK}-") as d:
        blocker = os.path.join(d, "a-file")
        open(blocker, "w").close()
        # Only rank 0's path is unwritable: the others' would do.
        path = os.path.join(blocker if RANK == 0 else d, "out.json")
        opts = parser.parse_args(["demo", "--seeds", "1", "--epochs", "1", "--compute", "0",
                                  "--methods", "allreduce", "--plot", "", "--quiet",
                                  "--json", path])
        with pytest.raises(InvalidArgumentError) as err:
            demo.run_demo(comm, opts)
    assert err.value.argument == "json" and "a-file" in str(err.value)
