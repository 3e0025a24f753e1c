"""Is a compiled progress loop the fix for small-message latency? A probe.

Runs the same 8-byte recursive-doubling allreduce three ways beside
MPI_Allreduce and wagma_comm's allreduce, in alternating rounds, and prints
wall time, CPU time and failed polls (each followed by sched_yield) per call:

* ``python loop``: the leanest Python: Irecv, Isend, Testall + sched_yield.
* ``python Waitall``: the same, but waiting inside MPI (MPI_Waitall, which
  polls in C with the GIL released, as MPI_Allreduce waits).
* ``numba loop``: the same loop compiled (numba ``nogil``), calling MPI_Irecv,
  MPI_Isend and MPI_Testall through the MPICH C ABI (int handles) with ctypes.

    mpiexec -n 8 .venv/bin/python bench/latency_probe.py   # bench/results/latency-probe-8.txt

MPICH only (it reads int handles with ``MPI._handleof``); it is a measurement,
not part of the runtime.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from typing import Callable

import numpy as np
from mpi4py import MPI
from numba import njit

import wagma_comm
from wagma_comm.bench.measure import alternating, job_cores, run_or_abort

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def _mpi_functions() -> tuple[object, object, object, object]:
    path = next(line.split()[-1] for line in open("/proc/self/maps") if "libmpi.so" in line)
    lib, libc = ctypes.CDLL(path), ctypes.CDLL(None)
    i32, ptr = ctypes.c_int, ctypes.c_int64  # pointers passed as 64-bit integers
    for name in ("MPI_Isend", "MPI_Irecv"):
        getattr(lib, name).argtypes = [ptr, i32, i32, i32, i32, i32, ptr]
        getattr(lib, name).restype = i32
    lib.MPI_Testall.argtypes = [i32, ptr, ptr, ptr]
    lib.MPI_Testall.restype = i32
    libc.sched_yield.argtypes = []
    libc.sched_yield.restype = i32
    return lib.MPI_Isend, lib.MPI_Irecv, lib.MPI_Testall, libc.sched_yield


_isend, _irecv, _testall, _yield = _mpi_functions()
_STATUSES_IGNORE = 1  # MPICH's MPI_STATUSES_IGNORE


@njit(nogil=True)
def _numba_loop(buf, tmp, rank, size, comm, dtype, tag, reqs, flag):  # type: ignore[no-untyped-def]
    failed = 0
    d = 1
    while d < size:
        peer = rank ^ d
        _irecv(tmp.ctypes.data, buf.size, dtype, peer, tag, comm, reqs.ctypes.data)
        _isend(buf.ctypes.data, buf.size, dtype, peer, tag, comm, reqs.ctypes.data + 4)
        while True:
            _testall(2, reqs.ctypes.data, flag.ctypes.data, _STATUSES_IGNORE)
            if flag[0]:
                break
            failed += 1
            _yield()
        for i in range(buf.size):
            buf[i] += tmp[i]
        d <<= 1
    return failed


def main() -> None:
    comm = wagma_comm.init(timeout=120)
    dup = WORLD.Dup()
    handles = (MPI._handleof(dup), MPI._handleof(MPI.FLOAT))
    buf, tmp = np.zeros(2, np.float32), np.zeros(2, np.float32)
    reqs, flag = np.zeros(2, np.int32), np.zeros(1, np.int32)
    failed = {"python loop": 0, "numba loop": 0}

    def python_loop() -> None:
        d = 1
        while d < SIZE:
            peer = RANK ^ d
            pending = [WORLD.Irecv(tmp, peer, 7), WORLD.Isend(buf, peer, 7)]
            while not MPI.Request.Testall(pending):
                failed["python loop"] += 1
                os.sched_yield()
            np.add(buf, tmp, out=buf)
            d <<= 1

    def python_waitall() -> None:
        d = 1
        while d < SIZE:
            peer = RANK ^ d
            MPI.Request.Waitall([WORLD.Irecv(tmp, peer, 7), WORLD.Isend(buf, peer, 7)])
            np.add(buf, tmp, out=buf)
            d <<= 1

    def numba_loop() -> None:
        failed["numba loop"] += _numba_loop(buf, tmp, RANK, SIZE, handles[0], handles[1], 5,
                                            reqs, flag)

    impls: dict[str, Callable[[], object]] = {
        "MPI_Allreduce": lambda: WORLD.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
        "python loop": python_loop,
        "python Waitall": python_waitall,
        "numba loop": numba_loop,
        "wagma allreduce": lambda: comm.allreduce(buf),
    }
    iters, rounds = 300, 3
    for call in impls.values():
        for _ in range(20):
            call()
    for key in failed:
        failed[key] = 0
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in impls}
    for r in range(rounds):
        for name in alternating(list(impls), r):
            WORLD.Barrier()
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iters):
                impls[name]()
            samples[name].append(((time.perf_counter() - w0) / iters,
                                  (time.process_time() - c0) / iters))
    cores = job_cores(WORLD)
    if RANK == 0:
        print(f"# 8-byte float32 sum, {SIZE} ranks on {cores} cores, "
              f"{iters} calls x {rounds} rounds (median per rank, mean over ranks)")
        print(f"{'implementation':>18} {'wall us':>9} {'CPU us/rank':>12} {'failed polls/call':>18}")
    for name, values in samples.items():
        wall = WORLD.gather(statistics.median(v[0] for v in values))
        cpu = WORLD.gather(statistics.median(v[1] for v in values))
        polls = WORLD.gather(failed.get(name, 0) / (iters * rounds))
        if RANK == 0:
            shown = f"{np.mean(polls):18.1f}" if name in failed else f"{'-':>18}"
            print(f"{name:>18} {np.mean(wall) * 1e6:9.1f} {np.mean(cpu) * 1e6:12.1f} {shown}")
    dup.Free()
    comm.close()


if __name__ == "__main__":
    run_or_abort(main)
