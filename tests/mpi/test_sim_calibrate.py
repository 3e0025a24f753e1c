"""``wagma sim --calibrate`` under a real MPI job (any number of ranks): the
measured cost model is complete, identical on every rank, plausible in units,
survives a file round trip, and the simulator runs with it. Timing decides no
verdict here; how close simulation comes to measurement is bench/sim_validate.sh's
job (docs/scale.md)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from mpi4py import MPI

import wagma_comm
from wagma_comm import Communicator
from wagma_comm.sim import CostModel, Workload, simulate
from wagma_comm.sim.calibrate import PING_SIZES, calibrate

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def test_calibration_measures_every_parameter(comm: Communicator, tmp_path_factory: Any) -> None:
    model, raw = calibrate(comm, repeats=3)
    assert WORLD.allgather(model) == [model] * SIZE  # every rank got the same model
    assert raw["ranks"] == SIZE
    hosts = WORLD.allgather(MPI.Get_processor_name())
    assert model.ranks_per_node == hosts.count(hosts[0])
    for name in ("latency_intra_s", "latency_inter_s", "reduce_s_per_byte",
                 "copy_s_per_byte", "op_overhead_s", "call_overhead_s"):
        value = getattr(model, name)
        assert math.isfinite(value) and 0 <= value < 1.0, (name, value)
    assert model.reduce_s_per_byte > 0 and model.copy_s_per_byte > 0
    assert model.call_overhead_s > 0  # a real call always costs something
    if SIZE > 1:  # a ping-pong pair exists: every size was measured
        table = raw["ping_pong_intra"] if "ping_pong_intra" in raw else raw["ping_pong_inter"]
        assert [row["bytes"] for row in table] == list(PING_SIZES)
        assert all(row["half_rtt_s"] > 0 for row in table)
        assert 1e6 < model.bandwidth_intra < 1e13  # bytes/s, not bits or GB
        groups = [row["group_size"] for row in raw["group_allreduce"]]
        assert groups and groups[-1] == SIZE and all(g > 1 for g in groups)
        assert {row["bytes"] for row in raw["group_allreduce"]} == {8, 1 << 20, 4 << 20}
        assert all(row["measured_s"] > 0 and row["simulated_s"] > 0
                   for row in raw["group_allreduce"])
        assert raw["contention_factor"] > 0
    path = WORLD.bcast(str(tmp_path_factory.mktemp("cal") / "cost.json") if RANK == 0
                       else None)
    if RANK == 0:
        model.save(path, {"measurements": raw})
    WORLD.Barrier()
    assert CostModel.load(path) == model
    w = Workload(SIZE, 1024, 0.01, "reference:0.01:1", steps=4, sync_every=2)
    res = simulate("wagma", w, model)
    assert 0 < res.iterations_per_s < 100  # bounded by the 10 ms compute step


@pytest.mark.skipif(SIZE < 2, reason="needs a rank that stays away")
def test_a_rank_that_stops_taking_part_is_a_timeout_naming_the_step() -> None:
    """Calibration's own MPI calls are bounded by the communicator's timeout:
    a rank that joins the private duplicate and then stays away makes the
    others raise, naming the step, instead of hanging."""
    from wagma_comm.sim.calibrate import _World
    from wagma_comm.transport import mpi as mpi_transport

    slow = SIZE - 1
    with wagma_comm.init(timeout=0.5) as short:
        if RANK != slow:
            t0 = time.monotonic()
            with pytest.raises(wagma_comm.CollectiveTimeoutError, match="0.5 s") as info:
                calibrate(short, repeats=1)
            assert info.value.collective == "wagma sim --calibrate: host names"
            assert time.monotonic() - t0 < 10.0
            _, request = mpi_transport.ABANDONED.pop()
        else:
            late = _World(30.0)  # joins the duplication, then stays away
        WORLD.Barrier()
        if RANK == slow:  # joins late: the others' abandoned gather completes
            late.host_names()
            late.free()
        else:
            request.Wait()


def test_calibrate_refuses_an_out_it_could_not_write_on_every_rank(
        tmp_path_factory: Any, capsys: Any) -> None:
    """`wagma sim --calibrate --out DIR` measured for minutes, then rank 0
    died in open() with IsADirectoryError while the others exited 0. Rank 0
    now checks --out first and every rank raises the same typed error."""
    from wagma_comm.cli import main

    where = WORLD.bcast(str(tmp_path_factory.mktemp("out")) if RANK == 0 else None)
    with pytest.raises(wagma_comm.InvalidArgumentError) as e:
        main(["sim", "--calibrate", "--repeats", "1", "--out", where])
    assert e.value.argument == "--out"
    assert "directory" in str(e.value)
    assert "ranks" not in capsys.readouterr().out  # nothing measured, no report


@pytest.mark.skipif(SIZE < 2, reason="needs a communicator smaller than the world")
def test_calibrate_measures_the_communicator_it_is_given() -> None:
    """calibrate() duplicated MPI_COMM_WORLD whatever communicator it was
    given: over init(mpi_comm=half) it measured the world's ranks, then failed
    in group_allreduce with 'group_size ... got 4' (or hung where only half
    the world called it). It now runs over ``mpi_comm``, checked locally to
    match the wagma communicator before any communication."""
    half = WORLD.Split(RANK % 2, RANK)
    try:
        with wagma_comm.init(timeout=60.0, mpi_comm=half) as sub:
            with pytest.raises(wagma_comm.InvalidArgumentError) as e:
                calibrate(sub, repeats=1)  # MPI_COMM_WORLD is not what sub runs over
            assert e.value.argument == "mpi_comm"
            model, raw = calibrate(sub, repeats=1, mpi_comm=half)
            assert raw["ranks"] == sub.size == half.Get_size()
            groups = sorted({row["group_size"] for row in raw["group_allreduce"]})
            assert groups == [g for g in (2, 4, 8, 16, 32, 64) if g < sub.size] + (
                [sub.size] if sub.size > 1 else [])
    finally:
        half.Free()


@pytest.mark.skipif(SIZE > 1, reason="one rank has no ping-pong pair")
def test_one_rank_says_which_parameters_it_did_not_measure(comm: Communicator,
                                                           capsys: Any, tmp_path: Any) -> None:
    """With one rank there is no pair and no group to time: latency 0,
    1 TB/s and o = 0 were written as a calibration, and the file said only
    that the inter-node link was 'taken equal to intra-node'."""
    from wagma_comm.cli import main

    model, raw = calibrate(comm, repeats=1)
    assert "not measured" in raw["intra_node"]
    assert "not measured" in model.source
    main(["sim", "--calibrate", "--repeats", "1", "--out", str(tmp_path / "c.json")])
    assert "# note: intra_node: not measured" in capsys.readouterr().out
