"""``wagma sim --calibrate``: measure the cost model with real collectives.

Run under the launcher on the machine (or allocation) to be modelled:
``mpiexec -n 8 wagma sim --calibrate --out cost.json``. Every rank takes part;
rank 0 writes the file. What is measured, and how each parameter follows:

* latency and bandwidth: an MPI ping-pong (the library our host transport
  drives) between rank 0 and a rank on its node, and one on another node if
  there is one; half round trips over 8 B..4 MiB, fitted to ``L + n / B``.
  Idle ranks wait without spinning, so the pair is not starved of cores;
* reduction and copy rates: the host kernels (float32 sum, ``reduce_into``;
  ``np.copyto``) timed on every rank at once, as in a real collective;
* call overhead: a ``group_allreduce`` over a group of one (the whole API and
  progress-engine round trip, no message);
* per-op overhead and contention: real ``group_allreduce`` calls over groups
  of 2, 4, ... ranks at 8 B, 1 MiB and 4 MiB cost more than the parameters
  above explain (every rank communicates at once; on an oversubscribed node
  they share cores). ``o`` and a factor dividing the ping-pong bandwidths are
  fitted by least squares, with the simulator's own critical paths as the
  design matrix (ops on the path, transfer time on the path).

The file records the raw measurements too, so docs can show the fit.
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from ..dtypes import FLOAT32
from ..errors import InvalidArgumentError
from ..kernels import host as host_kernels
from ..schedule.algorithms import choose_allreduce
from ..transport.mpi import dup_with_deadline, wait_with_deadline
from .collectives import Collectives
from .cost import CostModel

PING_SIZES = (8, 64, 512, 4096, 32768, 262144, 1 << 20, 4 << 20)
KERNEL_ELEMENTS = (1 << 18, 1 << 20, 1 << 22)
FIT_ELEMENTS = (2, 1 << 18, 1 << 20)  # float32: 8 B, 1 MiB, 4 MiB


class _World:
    """The calibration's own MPI traffic, on a private duplicate of
    COMM_WORLD. Every wait is bounded by the communicator's timeout, so a rank
    that stops taking part becomes a CollectiveTimeoutError naming the step
    instead of a hang; waits outside the timed loops nap, leaving the cores
    to the ranks being measured."""

    def __init__(self, timeout: float, mpi_comm: Any = None) -> None:
        self.timeout = timeout
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.comm = dup_with_deadline(base, timeout, "wagma sim --calibrate")
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def wait(self, request: Any, uses: Any, step: str, ranks: tuple[int, ...] = (),
             spin: bool = False) -> None:
        wait_with_deadline(request, uses, time.monotonic() + self.timeout,
                           f"wagma sim --calibrate: {step}", ranks,
                           f"not complete within {self.timeout:g} s", 0.0 if spin else 1e-3)

    def barrier(self, step: str) -> None:
        self.wait(self.comm.Ibarrier(), None, step)

    def gather(self, value: float, step: str) -> list[float]:
        """Every rank's ``value``, in rank order."""
        out = np.zeros(self.size, dtype=np.float64)
        mine = np.array([value], dtype=np.float64)
        self.wait(self.comm.Iallgather(mine, out), (mine, out), step)
        return out.tolist()

    def largest(self, value: float, step: str) -> float:
        out = np.zeros(1, dtype=np.float64)
        mine = np.array([value], dtype=np.float64)
        self.wait(self.comm.Iallreduce(mine, out, op=MPI.MAX), (mine, out), step)
        return float(out[0])

    def share(self, array: np.ndarray, step: str) -> np.ndarray:
        """Rank 0's ``array`` (same shape and dtype on every rank) everywhere."""
        self.wait(self.comm.Ibcast(array, root=0), array, step)
        return array

    def host_names(self) -> list[str]:
        width = MPI.MAX_PROCESSOR_NAME + 1
        mine = np.zeros(width, dtype=np.uint8)
        name = MPI.Get_processor_name().encode()[: width - 1]
        mine[: len(name)] = np.frombuffer(name, dtype=np.uint8)
        out = np.zeros((self.size, width), dtype=np.uint8)
        self.wait(self.comm.Iallgather(mine, out), (mine, out), "host names")
        return [bytes(row).rstrip(b"\0").decode() for row in out]

    def free(self) -> None:
        self.comm.Free()


def _fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares ``y = a + b x`` weighted by 1/y (relative error), a, b >= 0."""
    w = 1.0 / np.maximum(y, 1e-12)
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(A, y * w, rcond=None)
    return max(float(a), 0.0), max(float(b), 1e-15)


def _ping_pong(world: _World, peer: int, repeats: int) -> list[tuple[int, float]]:
    """Half round-trip seconds per size between rank 0 and ``peer`` (the
    pair spins on its requests, as a blocking MPI call would)."""
    out = []
    for n in PING_SIZES:
        buf = np.zeros(max(n, 1), dtype=np.uint8)
        times = []
        step = f"ping-pong {n} B"
        world.barrier(step)
        if world.rank in (0, peer):
            other = peer if world.rank == 0 else 0
            send, recv = world.comm.Isend, world.comm.Irecv
            order = (send, recv) if world.rank == 0 else (recv, send)
            for i in range(repeats + 2):
                t0 = time.perf_counter()
                for post in order:
                    world.wait(post(buf, other, 7), buf, step, (other,), spin=True)
                if i >= 2:
                    times.append((time.perf_counter() - t0) / 2)
        out.append((n, statistics.median(times) if times else 0.0))
    return out


def _kernel_rates(repeats: int) -> tuple[float, float, list[dict[str, float]]]:
    rows, reduce_fit, copy_fit = [], [], []
    for n in KERNEL_ELEMENTS:
        dst = np.ones(n, dtype=np.float32)
        src = np.ones(n, dtype=np.float32)
        host_kernels.reduce_into(dst, src, "sum", FLOAT32)  # compile / warm
        r, c = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            host_kernels.reduce_into(dst, src, "sum", FLOAT32)
            r.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            np.copyto(dst, src)
            c.append(time.perf_counter() - t0)
        rows.append({"bytes": 4 * n, "reduce_s": statistics.median(r),
                     "copy_s": statistics.median(c)})
        reduce_fit.append(statistics.median(r) / (4 * n))
        copy_fit.append(statistics.median(c) / (4 * n))
    return statistics.median(reduce_fit), statistics.median(copy_fit), rows


def _timed_calls(comm: Any, world: _World, buf: np.ndarray, group_size: int,
                 repeats: int) -> float:
    """Seconds per blocking group_allreduce (sum) of ``buf`` over groups of
    ``group_size`` at step 0, the slowest rank's median of 3 timed batches.
    The message schedule the simulator models is asked for by name: by
    default a small buffer on one host takes the shared-memory exchange,
    which the simulator does not model (it plans for many hosts)."""
    algorithm = choose_allreduce(buf.nbytes, group_size)
    per_call = []
    for _ in range(3):
        comm.barrier()
        t0 = time.perf_counter()
        for i in range(repeats):
            comm.group_allreduce(buf, group_size, 0, "sum", algorithm=algorithm)
        per_call.append((time.perf_counter() - t0) / repeats)
    return world.largest(statistics.median(per_call),
                         f"group_allreduce timing, groups of {group_size}, {buf.nbytes} B")


def check_repeats(repeats: object) -> int:
    """Before any communication: 0 divided by zero in every timed loop."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise InvalidArgumentError("repeats", f"expected an int >= 1, got {repeats!r}")
    return repeats


def calibrate(comm: Any, repeats: int = 30,
              mpi_comm: Any = None) -> tuple[CostModel, dict[str, Any]]:
    """Measure every parameter (collective: all ranks of ``comm`` call it).
    ``mpi_comm``: the MPI communicator ``comm`` was created over
    (``init(mpi_comm=...)``; default MPI_COMM_WORLD), which the ping-pongs and
    the exchanges of results use. Returns the model and the raw measurements
    (the same on every rank)."""
    from ..train.neighbors import resolve_mpi_comm

    check_repeats(repeats)
    world = _World(comm.timeout, resolve_mpi_comm(comm, mpi_comm))
    try:
        P = world.size
        hosts = world.host_names()
        per_node = hosts.count(hosts[0])
        placed_in_blocks = all(hosts[r] == hosts[(r // per_node) * per_node] for r in range(P))
        intra_peer = next((r for r in range(1, P) if hosts[r] == hosts[0]), None)
        inter_peer = next((r for r in range(1, P) if hosts[r] != hosts[0]), None)
        raw: dict[str, Any] = {"ranks": P, "hosts": sorted(set(hosts)),
                               "ranks_per_node": per_node,
                               "placed_in_blocks": placed_in_blocks,
                               "machine": platform.processor() or platform.machine()}
        fits = {}
        for label, peer in (("intra", intra_peer), ("inter", inter_peer)):
            if peer is None:
                continue
            measured = np.array(_ping_pong(world, peer, repeats), dtype=np.float64)
            table = [(int(n), float(t)) for n, t in world.share(measured, f"{label} table")]
            raw[f"ping_pong_{label}"] = [{"bytes": n, "half_rtt_s": t} for n, t in table]
            x = np.array([n for n, _ in table], float)
            y = np.array([t for _, t in table], float)
            fits[label] = _fit_line(x, y)
        if "intra" not in fits:  # one rank per node: the inter-node pair is all there is
            fits["intra"] = fits.get("inter", (0.0, 1e-12))
            if "inter" not in fits:  # one rank: placeholders, said so in the file
                raw["intra_node"] = ("not measured (one rank: no ping-pong pair, no group to "
                                     "time): latency 0, bandwidth 1e12 B/s, per-op overhead 0")
        if "inter" not in fits:
            fits["inter"] = fits["intra"]
            raw["inter_node"] = "not measured (one node): taken equal to intra-node"
        world.barrier("kernel rates")
        reduce_b, copy_b, kernel_rows = _kernel_rates(max(5, repeats // 3))
        reduce_b = statistics.median(world.gather(reduce_b, "reduction rates"))
        copy_b = statistics.median(world.gather(copy_b, "copy rates"))
        raw["kernels_rank0"] = kernel_rows

        one = np.zeros(2, dtype=np.float32)
        call = _timed_calls(comm, world, one, 1, repeats)
        # (a same-node pair only: the placeholders of one rank, or an
        # inter-node pair standing in for it, are not copies between ranks)
        same_node = "ping_pong_intra" in raw
        intra_b = 1 / fits["intra"][1]
        if same_node:
            intra_b = _within_copy_rate(intra_b, copy_b, raw, "ping-pong")
        inter_b = intra_b if "inter_node" in raw else 1 / fits["inter"][1]
        pp = CostModel(
            latency_intra_s=fits["intra"][0], latency_inter_s=fits["inter"][0],
            bandwidth_intra=intra_b, bandwidth_inter=inter_b,
            reduce_s_per_byte=reduce_b, copy_s_per_byte=copy_b, op_overhead_s=0.0,
            call_overhead_s=call, ranks_per_node=per_node)
        raw["ping_pong_model"] = pp.to_dict()
        rows = []
        for S in sorted({s for s in (2, 4, 8, 16, 32, 64, P) if 1 < s <= P}):
            for elements in FIT_ELEMENTS:
                reps = repeats if elements < 4096 else max(3, repeats // 6)
                buf = np.zeros(elements, dtype=np.float32)
                rows.append({"group_size": S, "bytes": 4 * elements,
                             "measured_s": _timed_calls(comm, world, buf, S, reps)})
        model = _fit_overheads(pp, rows, P)
        raw["contention_factor"] = pp.bandwidth_intra / model.bandwidth_intra
        if same_node:
            capped = _within_copy_rate(model.bandwidth_intra, copy_b, raw, "fitted")
            model = model.with_(bandwidth_intra=capped,
                                bandwidth_inter=capped if "inter_node" in raw
                                else model.bandwidth_inter)
        for row in rows:
            row["simulated_s"] = _simulated(model, P, row)
        raw["group_allreduce"] = rows
        model = model.with_(
            name=f"calibrated:{hosts[0]}:P={P}",
            source=f"wagma sim --calibrate on {len(set(hosts))} node(s), {P} ranks, "
                   f"{per_node} per node, {time.strftime('%Y-%m-%d')}"
                   + ("; links and per-op overhead not measured (one rank)" if P == 1 else ""))
        return model, raw
    finally:
        world.free()


def _within_copy_rate(bandwidth: float, copy_s_per_byte: float, raw: dict[str, Any],
                      which: str) -> float:
    """An intra-node bandwidth no faster than the measured copy rate: every
    byte MPI moves between two ranks of a node is copied at least once, so a
    faster figure is noise the fit could not resolve (on an oversubscribed
    node a ping-pong's half round trips can all be one scheduler quantum,
    whatever the size, and the fitted slope is then ~0: 3.9e13 B/s was seen
    at 3 ranks on 2 cores). Capping it is said in the raw measurements."""
    ceiling = 1.0 / copy_s_per_byte if copy_s_per_byte > 0 else float("inf")
    if bandwidth <= ceiling:
        return bandwidth
    raw.setdefault("bandwidth_capped", []).append(
        f"{which} intra-node bandwidth {bandwidth:.3g} B/s exceeded the copy rate; "
        f"taken as the copy rate, {ceiling:.3g} B/s")
    return ceiling


def _simulated(model: CostModel, P: int, row: dict[str, Any]) -> float:
    """A blocking group_allreduce (sum) at step 0 as the simulator times it."""
    dag = Collectives(P, model, 4).partition(row["group_size"], 0, row["bytes"] // 4, "sum")
    return dag.cost_of() + model.call_overhead_s


def _fit_overheads(pp: CostModel, rows: list[dict[str, Any]], P: int) -> CostModel:
    """Fit the per-op overhead ``o`` and a bandwidth factor ``k`` (the ping-pong
    bandwidths divided by k: what a rank gets while every rank communicates)
    to the measured group allreduces, by least squares on relative error:
    measured ~ base + n_o * o + T_b * k, where base is the simulated time with
    o = 0 and infinite bandwidth, n_o the critical path's op count (simulated
    with only o = 1 s) and T_b its transfer time at ping-pong bandwidth."""
    inf = float("inf")
    base_m = pp.with_(bandwidth_intra=inf, bandwidth_inter=inf)
    unit_o = CostModel(0.0, 0.0, inf, inf, 0.0, 0.0, 1.0, 0.0, pp.ranks_per_node)
    unit_b = CostModel(0.0, 0.0, pp.bandwidth_intra, pp.bandwidth_inter, 0.0, 0.0, 0.0, 0.0,
                       pp.ranks_per_node)
    A, y = [], []
    for row in rows:
        base = _simulated(base_m, P, row)
        n_o = _simulated(unit_o, P, row)
        t_b = _simulated(unit_b, P, row)
        m = row["measured_s"]
        A.append([n_o / m, t_b / m])
        y.append((m - base) / m)
    if not A:
        return pp
    o, k = _nonnegative_lstsq(np.array(A), np.array(y))
    k = max(k, 1e-3)
    return pp.with_(op_overhead_s=o, bandwidth_intra=pp.bandwidth_intra / k,
                    bandwidth_inter=pp.bandwidth_inter / k)


def _nonnegative_lstsq(A: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Two-variable least squares with both variables >= 0 (try the free
    solution, else the best single-variable one)."""
    sol, *_ = np.linalg.lstsq(A, y, rcond=None)
    if np.all(sol >= 0):
        return float(sol[0]), float(sol[1])
    best: tuple[float, tuple[float, float]] | None = None
    for j in (0, 1):
        col = A[:, j]
        x = max(0.0, float(col @ y / (col @ col))) if col @ col > 0 else 0.0
        cand = (x, 0.0) if j == 0 else (0.0, x)
        err = float(np.sum((A @ np.array(cand) - y) ** 2))
        if best is None or err < best[0]:
            best = (err, cand)
    assert best is not None
    return best[1]
