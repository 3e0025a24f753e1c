"""``wagma bench overlap``: how much of a non-blocking allreduce hides behind compute.

The measure is the one the OSU Micro-Benchmarks report for their non-blocking
collectives (``osu_iallreduce``: overall, compute, pure communication and
overlap); the definition is theirs, the code here is ours. Per message size and
implementation, every rank measures

* ``t_pure``: post the collective and wait for it at once;
* ``t_overall``: post, compute for about ``t_pure``, wait;
* ``t_compute``: the same compute alone, with no collective in flight;

and reports ``overlap % = max(0, min(100, 100 * (1 - (t_overall - t_compute) /
t_pure)))``: 100 % when the collective costs nothing beyond the compute, 0 %
when it all happens after the compute, in ``wait``. ``t_compute`` is measured
*alone*, so a compute slowed down by the communication running beside it counts
against the overlap (OSU times the compute inside the overlapped loop, which
would hide that); the compute time seen inside the overlapped loop is kept
too (``compute_in_overlap_us``).

Implementations: wagma_comm's ``comm.allreduce(buf, op, async_op=True)`` +
``handle.wait()``, and mpi4py's ``Iallreduce`` + ``Wait`` on a ``Dup()`` of the
world communicator, on the same buffer, measured side by side in alternating
rounds as in :mod:`wagma_comm.bench.measure`: per rank the median over rounds
(for the overlap, the median of each round's overlap), then the mean, min and
max over ranks.

Compute kinds:

* ``numpy`` (default): batched 64x64 float32 matmuls, one call about 50-100 us.
  NumPy releases the GIL inside the call and a 64x64 product stays on one
  OpenBLAS thread, so it is the shape of a DL framework's compute: long
  stretches of native code without the GIL, from one core.
* ``python``: a pure-Python arithmetic loop that holds the GIL. A progress
  thread then only runs when the interpreter switches threads (every
  ``sys.getswitchinterval()``, 5 ms by default): what overlap is left when the
  application's compute is Python.
* ``sleep``: the thread sleeps (no CPU, no GIL): compute offloaded to an
  accelerator, or a node with cores to spare. The ceiling of what background
  progress can hide when the collective does not compete for the CPU.

Run it under mpiexec: ``mpiexec -n 8 wagma bench overlap``.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TextIO

import numpy as np

from ..errors import InvalidArgumentError
from . import check as checking
from .measure import Timing, allgather_floats, alternating, barrier, iterations_for

COMPUTE_KINDS = ("numpy", "python", "sleep")
DEFAULT_SIZES = (64 << 10, 1 << 20, 16 << 20)
# Adaptive iterations: the calibration pass moves about CALIBRATION_BYTES; each
# timed phase then runs about PHASE_BUDGET_S (bounded by MIN/MAX_ITERS), so a
# 16 MiB size gets as many samples as its time allows, not a fixed few.
CALIBRATION_BYTES = 64 << 20
PHASE_BUDGET_S = 0.5
MIN_ITERS, MAX_ITERS = 10, 100
# Calibrate the compute for at least this long: with more ranks than cores a
# shorter run may fit inside one scheduler time slice and time an unloaded CPU.
CALIBRATE_MIN_S = 0.2

_MATRIX = 64  # one OpenBLAS thread up to 64^3 multiply-adds per product
_BATCH = 8  # products per NumPy call: one GIL-free stretch of ~50-100 us
_PY_STEPS = 1000  # loop steps per pure-Python chunk (~40 us, GIL held)
_SLEEP_CHUNK_S = 5e-4  # one sleep; calibration measures the real length


def overlap_percent(overall: float, compute: float, pure: float) -> float:
    """OSU's overlap: the share of the pure communication time that did not
    add to the compute time, clamped to [0, 100]."""
    if not pure > 0:
        return 0.0
    return max(0.0, min(100.0, 100.0 * (1.0 - (overall - compute) / pure)))


class Compute:
    """A CPU kernel run in chunks, calibrated on every rank at once.

    Calibration runs with all ranks computing together because that is how the
    kernel runs in the measurement: on an oversubscribed node a chunk takes
    longer than on an idle one. Ranks agree on the mean chunk time so that all
    of them run the same number of chunks.
    """

    def __init__(self, kind: str = "numpy") -> None:
        if kind not in COMPUTE_KINDS:
            raise InvalidArgumentError("compute", f"expected one of {list(COMPUTE_KINDS)}, "
                                       f"got {kind!r}")
        self.kind = kind
        rng = np.random.default_rng(0)
        self._a = rng.random((_BATCH, _MATRIX, _MATRIX), dtype=np.float32)
        self._b = rng.random((_BATCH, _MATRIX, _MATRIX), dtype=np.float32) / _MATRIX
        self._out = np.empty_like(self._a)
        self.chunk_s = 0.0
        self.sink = 0.0  # keeps the Python loop's result alive

    def chunk(self) -> None:
        """One unit of compute (tens of microseconds)."""
        if self.kind == "numpy":
            np.matmul(self._a, self._b, out=self._out)  # GIL released inside
        elif self.kind == "sleep":
            time.sleep(_SLEEP_CHUNK_S)
        else:
            x = 1.0
            for _ in range(_PY_STEPS):
                x = x * 0.999 + 0.5
            self.sink = x

    def run(self, chunks: int) -> None:
        for _ in range(chunks):
            self.chunk()

    def calibrate(self, seconds: float, world: Any, timeout: float | None = None) -> float:
        """Time chunks for about ``seconds`` (at least 3 chunks), every rank at
        once; store and return the mean seconds per chunk over ranks (the
        same on every rank). Collective over ``world``, bounded by ``timeout``."""
        self.chunk()  # first-touch and BLAS set-up stay out of the timing
        barrier(world, "before calibrating the compute", timeout=timeout)
        n, t0 = 0, time.perf_counter()
        while True:
            self.chunk()
            n += 1
            elapsed = time.perf_counter() - t0
            if n >= 3 and elapsed >= seconds:
                break
        each = allgather_floats(world, [elapsed / n], "of the compute calibration",
                                timeout=timeout)
        self.chunk_s = float(each.sum() / world.Get_size())
        return self.chunk_s

    def chunks_for(self, seconds: float) -> int:
        """Chunks that take about ``seconds`` (at least one)."""
        if not self.chunk_s > 0:
            raise InvalidArgumentError("compute", "calibrate() before chunks_for()")
        return max(1, round(seconds / self.chunk_s))

    def callable_for(self, seconds: float) -> Callable[[], None]:
        chunks = self.chunks_for(seconds)
        return lambda: self.run(chunks)


@dataclass
class RoundTimes:
    """This rank's seconds per iteration in one round of one implementation."""

    pure: float
    overall: float
    compute: float
    compute_in_overlap: float  # compute phase inside the overlapped loop
    post: float  # time spent in the posting call of the overlapped loop


@dataclass
class OverlapResult:
    """Per rank the median over rounds, then mean/min/max over ranks
    (seconds; ``overlap`` in percent, per round then its median per rank)."""

    overall: Timing
    compute: Timing
    pure: Timing
    overlap: Timing
    compute_in_overlap: Timing
    post: Timing


def time_overlap_round(post: Callable[[], Any], wait: Callable[[Any], Any],
                       compute: Callable[[], None], iters: int, world: Any,
                       timeout: float | None = None, round: int = -1,
                       name: str = "") -> RoundTimes:
    """One round on this rank: ``iters`` pure, overlapped and compute-only
    iterations, each phase started together after a barrier (bounded by
    ``timeout``; ``round`` and ``name`` are what a timeout names)."""
    of = f" of {name}" if name else ""
    barrier(world, f"before the pure phase{of}", round, timeout)
    t0 = time.perf_counter()
    for _ in range(iters):
        wait(post())
    pure = (time.perf_counter() - t0) / iters

    barrier(world, f"before the overlapped phase{of}", round, timeout)
    in_post = in_compute = 0.0
    t0 = time.perf_counter()
    for _ in range(iters):
        ta = time.perf_counter()
        handle = post()
        tb = time.perf_counter()
        compute()
        tc = time.perf_counter()
        wait(handle)
        in_post += tb - ta
        in_compute += tc - tb
    overall = (time.perf_counter() - t0) / iters

    barrier(world, f"before the compute phase{of}", round, timeout)
    t0 = time.perf_counter()
    for _ in range(iters):
        compute()
    alone = (time.perf_counter() - t0) / iters
    return RoundTimes(pure, overall, alone, in_compute / iters, in_post / iters)


def summarize(rounds: Sequence[RoundTimes], world: Any,
              timeout: float | None = None) -> OverlapResult:
    """Median over this rank's rounds (overlap: median of the rounds'
    overlaps), then mean/min/max over ranks. Collective, bounded by ``timeout``."""
    med = {f: statistics.median(getattr(r, f) for r in rounds)
           for f in ("pure", "overall", "compute", "compute_in_overlap", "post")}
    # Overlap per round, then the median: the three times of one round are
    # measured seconds apart, so a shared machine's drifting load cancels out.
    med["overlap"] = statistics.median(overlap_percent(r.overall, r.compute, r.pure)
                                       for r in rounds)
    fields = list(med)
    everyone = allgather_floats(world, [med[f] for f in fields], "of the overlap times",
                                len(rounds), timeout)
    out = {}
    for i, f in enumerate(fields):
        vals = everyone[:, i]
        out[f] = Timing(float(vals.mean()), float(vals.min()), float(vals.max()))
    return OverlapResult(**out)


def measure_overlap(post: Callable[[], Any], wait: Callable[[Any], Any],
                    compute: Callable[[], None], iters: int, world: Any,
                    rounds: int = 1, timeout: float | None = None) -> OverlapResult:
    """Overlap of one implementation: ``post()`` starts the collective and
    returns what ``wait`` completes; ``compute()`` runs about one pure
    communication time. Collective over ``world`` (mpi4py communicator); its
    barriers and exchanges time out after ``timeout`` (None: WAGMA_TIMEOUT)."""
    _check_int("iters", iters)
    _check_int("rounds", rounds)
    return summarize([time_overlap_round(post, wait, compute, iters, world, timeout, r)
                      for r in range(rounds)], world, timeout)


def _check_int(argument: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(argument, f"expected an int >= {minimum}, got {value!r}")
    return value


def run_overlap(comm: Any, world: Any, sizes: Sequence[int] = DEFAULT_SIZES,
                dtype: str = "float32", op: str = "sum", iters: int = 0, warmup: int = 2,
                rounds: int = 3, compute: str = "numpy", check: bool = True,
                mpi: bool = True, quiet: bool = True) -> list[dict[str, Any]]:
    """Measure overlap per message size for wagma and MPI_Iallreduce.

    ``comm``: a wagma_comm Communicator over ``world`` (an mpi4py communicator,
    used for barriers and the timing exchanges, which time out after
    ``comm.timeout``, and, via ``Dup()``, MPI's own Iallreduce). ``sizes`` in
    bytes; ``iters`` per phase and round (0: adaptive,
    about PHASE_BUDGET_S per phase; a fixed ``iters`` also shortens the compute
    calibration, for tests); ``warmup`` post+wait calls per implementation
    before calibrating; ``rounds`` alternating rounds (median kept);
    ``compute`` in COMPUTE_KINDS; ``check``:
    verify one overlapped call of each implementation (``wrong`` = elements
    wrong over all ranks, -1 if not checked); ``mpi``: include MPI_Iallreduce
    (skipped anyway for ops or dtypes MPI cannot reduce, e.g. avg, bfloat16).
    ``quiet=False`` prints each size's rows on rank 0 as soon as measured.

    Per size, the compute is calibrated once: each implementation's pure
    communication time is measured after the warm-up (mean over ranks) and the
    compute for that implementation is sized to it. Collective over ``world``.

    Returns one dict per (size, implementation), the same on every rank, with
    ``*_us`` times (mean over ranks, and ``*_min_us``/``*_max_us``),
    ``overlap_pct`` (and min/max), ``target_us`` and ``chunks``.
    """
    from mpi4py import MPI

    from .. import dtypes

    dt = dtypes.lookup(dtype, "dtype")
    dtypes.check_op(op, "op")
    if isinstance(sizes, (int, str)) or not len(sizes):
        raise InvalidArgumentError("sizes", f"expected a non-empty list of byte counts, "
                                   f"got {sizes!r}")
    for nb in sizes:
        _check_int("sizes", nb, dt.itemsize)
    _check_int("iters", iters, 0)
    _check_int("warmup", warmup, 0)
    _check_int("rounds", rounds)
    kernel = Compute(compute)
    if comm.size != world.Get_size():
        raise InvalidArgumentError("world", f"has {world.Get_size()} ranks, comm has "
                                   f"{comm.size}")

    rank, size = world.Get_rank(), world.Get_size()
    timeout = comm.timeout  # the benchmark's own barriers wait as long as a collective
    mpi_op = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}.get(op)
    use_mpi = mpi and mpi_op is not None and dt.mpi_name is not None
    peer = world.Dup() if use_mpi else None
    rows: list[dict[str, Any]] = []
    try:
        for nbytes in sizes:
            count = nbytes // dt.itemsize
            arr = checking.pattern(rank, count, dt)
            storage = arr.view(dt.storage)
            impls: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
                "wagma": (lambda: comm.allreduce(arr, op, async_op=True),
                          lambda h: h.wait()),
            }
            if use_mpi:
                mtype = getattr(MPI, dt.mpi_name)
                impls["mpi"] = (lambda: peer.Iallreduce(MPI.IN_PLACE, [storage, mtype],
                                                        mpi_op),
                                lambda req: req.Wait())
            n_cal = iterations_for(count * dt.itemsize, iters, CALIBRATION_BYTES)
            targets: dict[str, float] = {}
            for name, (post, wait) in impls.items():
                for _ in range(warmup):
                    wait(post())
                barrier(world, f"before calibrating {name}", timeout=timeout)
                t0 = time.perf_counter()
                for _ in range(n_cal):
                    wait(post())
                each = allgather_floats(world, [(time.perf_counter() - t0) / n_cal],
                                        f"of {name}'s pure time", timeout=timeout)
                targets[name] = float(each.sum() / size)  # the same on every rank
            n = iters or int(min(MAX_ITERS, max(MIN_ITERS,
                                                PHASE_BUDGET_S // max(targets.values()))))
            kernel.calibrate(max(targets.values()) if iters
                             else max(CALIBRATE_MIN_S, *targets.values()), world, timeout)
            computes = {name: kernel.callable_for(t) for name, t in targets.items()}
            wrong: dict[str, int] = {}
            for name, (post, wait) in impls.items():
                if not check:
                    wrong[name] = -1
                    continue
                arr[...] = checking.pattern(rank, count, dt)
                handle = post()
                computes[name]()
                wait(handle)
                expected = checking.expected_result("allreduce", range(size), count, op)
                mine = checking.count_wrong(arr, dt, expected)
                wrong[name] = int(allgather_floats(world, [mine], f"of {name}'s check",
                                                   timeout=timeout).sum())
            samples: dict[str, list[RoundTimes]] = {name: [] for name in impls}
            for r in range(rounds):
                for name in alternating(list(impls), r):
                    post, wait = impls[name]
                    samples[name].append(
                        time_overlap_round(post, wait, computes[name], n, world, timeout, r,
                                           name))
            for name in impls:
                res = summarize(samples[name], world, timeout)
                row: dict[str, Any] = {
                    "nbytes": count * dt.itemsize, "count": count, "dtype": dt.name,
                    "op": op, "impl": name, "compute_kind": compute, "ranks": size,
                    "iters": n, "rounds": rounds, "target_us": targets[name] * 1e6,
                    "chunks": kernel.chunks_for(targets[name]),
                    "chunk_us": kernel.chunk_s * 1e6, "wrong": wrong[name],
                }
                for field in ("overall", "compute", "pure", "compute_in_overlap", "post"):
                    t = getattr(res, field)
                    row[f"{field}_us"] = t.avg * 1e6
                    row[f"{field}_min_us"] = t.min * 1e6
                    row[f"{field}_max_us"] = t.max * 1e6
                row["overlap_pct"] = res.overlap.avg
                row["overlap_min_pct"] = res.overlap.min
                row["overlap_max_pct"] = res.overlap.max
                rows.append(row)
            if not quiet and rank == 0:
                if len(rows) == len(impls):
                    print(format_header(compute, size), flush=True)
                for row in rows[-len(impls):]:
                    print(format_row(row), flush=True)
    finally:
        if peer is not None:
            peer.Free()
    return rows


# -- output -------------------------------------------------------------------
_COLUMNS = (f"{'size':>10} {'count':>10} {'impl':>6} {'overall(us)':>12} "
            f"{'compute(us)':>12} {'pure comm(us)':>14} {'overlap(%)':>10} "
            f"{'ranks min..max(%)':>18} {'#wrong':>6}")


def format_header(compute: str, ranks: int) -> str:
    return (f"# non-blocking allreduce overlap (OSU definition), {ranks} ranks, "
            f"compute={compute}\n{_COLUMNS}")


def format_row(row: dict[str, Any]) -> str:
    spread = f"{row['overlap_min_pct']:.1f}..{row['overlap_max_pct']:.1f}"
    wrong = "n/a" if row["wrong"] < 0 else str(row["wrong"])
    return (f"{row['nbytes']:>10} {row['count']:>10} {row['impl']:>6} "
            f"{row['overall_us']:>12.1f} {row['compute_us']:>12.1f} "
            f"{row['pure_us']:>14.1f} {row['overlap_pct']:>10.1f} {spread:>18} {wrong:>6}")


def print_overlap_table(rows: Sequence[dict[str, Any]], file: TextIO | None = None) -> None:
    """The table of ``run_overlap``'s rows (call it on rank 0): size, count,
    impl, overall, compute, pure comm (us, mean over ranks), overlap % (mean
    over ranks, then min..max over ranks) and #wrong."""
    out = file or sys.stdout
    if not rows:
        return
    print(format_header(rows[0]["compute_kind"], rows[0]["ranks"]), file=out)
    for row in rows:
        print(format_row(row), file=out)
    out.flush()


__all__ = ["COMPUTE_KINDS", "Compute", "OverlapResult", "RoundTimes", "format_header",
           "format_row", "measure_overlap", "overlap_percent", "print_overlap_table",
           "run_overlap", "summarize", "time_overlap_round"]
