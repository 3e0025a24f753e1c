"""Which layer of a small blocking allreduce costs what: a probe.

Times, side by side in alternating rounds, an 8-byte float32 sum as:

* ``MPI_Allreduce``;
* ``bare Iallreduce``: MPI_Iallreduce, then Test + sched_yield until done;
* ``python loop``: recursive doubling in the leanest Python (Irecv, Isend,
  Testall + sched_yield, numba reduction) -- what any Python runtime pays;
* ``dataflow program``: the schedule run by the general inline executor
  (``Program.start`` + ``ProgramRun.execute``), without the call around it;
* ``straight line``: the same schedule as the generated straight-line
  function the call runs (runtime/straight.py), without the call around it;
* ``wagma allreduce`` and ``wagma native``: the full public call.

and prints wall time, CPU time per rank and failed polls (each followed by
sched_yield) per call. On an oversubscribed machine wall time is about CPU per
rank x ranks / cores, so the CPU column says what each layer costs.

    mpiexec -n 8 -genv WAGMA_SHM 0 .venv/bin/python bench/latency_layers.py
    # bench/results/latency-layers-8.txt; without WAGMA_SHM=0 the small call
    # goes through shared memory, which has no schedule to probe

It reaches into the engine (``_prepared``, ``program``) and counts yields
by replacing the inline and straight modules' ``os``: a measurement, not part of
the runtime.
"""

from __future__ import annotations

import os
import statistics
import time
import types
from typing import Callable

import numpy as np
from mpi4py import MPI

import wagma_comm
from wagma_comm import dtypes
from wagma_comm.bench.measure import alternating, job_cores, run_or_abort
from wagma_comm.kernels import host as host_kernels
from wagma_comm.runtime import inline, straight
from wagma_comm.transport.base import CHANNEL_DATA

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
_failed = [0]
_yield = os.sched_yield


def _counting_yield() -> None:
    _failed[0] += 1
    _yield()


def main() -> None:
    counting = types.SimpleNamespace(sched_yield=_counting_yield)
    inline.os = straight.os = counting  # type: ignore[assignment]
    comm = wagma_comm.init(timeout=120)
    buf, tmp = np.zeros(2, np.float32), np.zeros(2, np.float32)
    dtype = dtypes.from_array(buf)
    assert dtype is not None
    reduce = host_kernels.reducer("sum", dtype, buf.size)

    def python_loop() -> None:
        d = 1
        while d < SIZE:
            peer = RANK ^ d
            pending = [WORLD.Irecv(tmp, peer, 7), WORLD.Isend(buf, peer, 7)]
            while not MPI.Request.Testall(pending):
                _counting_yield()
            reduce(buf, tmp)
            d <<= 1

    def bare_iallreduce() -> None:
        request = WORLD.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM)
        while not request.Test():
            _counting_yield()

    comm.allreduce(buf)  # compiles the call; its program is then cached
    sched, _ = next(iter(comm._prepared.values()))
    if not hasattr(sched, "ops"):  # a shared-memory call: no schedule, no layers
        raise SystemExit("latency_layers.py: the 8-byte allreduce went through shared memory, "
                         "which has no schedule to probe; run it with WAGMA_SHM=0 "
                         "(mpiexec -genv WAGMA_SHM 0 ...)")
    program = comm._engine.program(sched, dtype)
    seq = [1 << 20]  # message numbers of our own, after the real calls'

    def dataflow_program() -> None:
        run = program.start(buf)
        seq[0] += 1
        outcome = run.execute(comm._transport, CHANNEL_DATA, seq[0],
                              time.monotonic() + 60, 0.02)
        assert outcome == inline.DONE, outcome

    line = program.line
    assert line is not None, "the allreduce schedule runs as a straight line"

    def straight_line() -> None:
        program.prepare()
        seq[0] += 1
        assert line.run(buf, seq[0], time.monotonic() + 60, 0.02) is None

    impls: dict[str, Callable[[], object]] = {
        "MPI_Allreduce": lambda: WORLD.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
        "bare Iallreduce": bare_iallreduce,
        "python loop": python_loop,
        "dataflow program": dataflow_program,
        "straight line": straight_line,
        "wagma allreduce": lambda: comm.allreduce(buf),
        "wagma native": lambda: comm.allreduce(buf, algorithm="native"),
    }
    iters, rounds = 300, 3
    for call in impls.values():
        for _ in range(20):
            call()
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in impls}
    for r in range(rounds):
        for name in alternating(list(impls), r):
            WORLD.Barrier()
            _failed[0] = 0
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iters):
                impls[name]()
            samples[name].append(((time.perf_counter() - w0) / iters,
                                  (time.process_time() - c0) / iters, _failed[0] / iters))
    cores = job_cores(WORLD)
    if RANK == 0:
        print(f"# 8-byte float32 sum, {SIZE} ranks on {cores} cores, "
              f"{iters} calls x {rounds} rounds (median per rank, mean over ranks)")
        print(f"{'layer':>16} {'wall us':>9} {'CPU us/rank':>12} {'failed polls':>13} "
              f"{'vs MPI_Allreduce':>17}")
    base = None
    for name, values in samples.items():
        wall = float(np.mean(WORLD.gather(statistics.median(v[0] for v in values)) or [0]))
        cpu = float(np.mean(WORLD.gather(statistics.median(v[1] for v in values)) or [0]))
        polls = float(np.mean(WORLD.gather(statistics.median(v[2] for v in values)) or [0]))
        if RANK == 0:
            base = base or wall
            print(f"{name:>16} {wall * 1e6:9.1f} {cpu * 1e6:12.1f} {polls:13.1f} "
                  f"{wall / base:16.2f}x")
    comm.close()


if __name__ == "__main__":
    run_or_abort(main)
