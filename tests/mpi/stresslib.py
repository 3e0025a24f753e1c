"""Load/stress test of the non-blocking collectives (issue #7 item 4), shared by
tests/mpi/test_stress.py (about 1,000 operations, part of ``make test``) and
tests/soak/test_soak.py (at least 10,000 operations, ``make soak``).

Every rank draws the same sequence of operations from one seeded generator
(kind, dtype, size, op, group, root, algorithm, front end), so all ranks issue the
same collectives in the same order. Operations are issued asynchronously in
windows of hundreds of outstanding handles (a few blocking calls mixed in), and
each rank then waits its handles in its own random order, sometimes polling
``test()`` first.

Inputs are a deterministic function of (seed, operation index, rank), so every
rank can rebuild every other rank's input and compute the expected result
itself. They are chosen so that the result is exact whatever the reduction
order, which makes a bitwise check valid:

* sum/avg over floats: integers times ``2**-shift`` small enough that every
  partial sum of up to ``size`` ranks fits the significand (float16: 11 bits,
  bfloat16: 8), so every partial sum is exact in any order; ``avg`` then
  follows the documented rounding (kernels/host.py ``scale_into``: one division
  in the element precision; float16/bfloat16 ``RN(RN_f32(sum / n))``).
* sum/prod over integers wrap like NumPy (modular arithmetic is exact in any
  order); integer ``avg`` sums never wrap and floor-divide.
* prod over floats: factors in {+-0.5, +-1, +-2} (products are powers of two).
* max/min: arbitrary finite values, plus +-0 and +-inf on the engine's own
  algorithms (documented: ``max(+0, -0) = +0``, ``min(+0, -0) = -0``; MPI's
  MAX/MIN leave that open, so the native algorithm gets no zeros).
* broadcast: random bytes (NaN payloads, signalling NaNs): a copy must keep
  every bit.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import torch

import wagma_comm
from wagma_comm.schedule import algorithms

DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8")
NUMPY = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
         "float32": np.dtype(np.float32), "float64": np.dtype(np.float64),
         "int32": np.dtype(np.int32), "int64": np.dtype(np.int64),
         "uint8": np.dtype(np.uint8)}
# Significand bits (implicit bit included): sums of integers up to 2**p are exact.
SIGNIFICAND = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}
OPS = ("sum", "avg", "max", "min", "prod")
KINDS = ("allreduce", "group_allreduce", "broadcast")
KIND_WEIGHTS = (0.45, 0.35, 0.20)
HALF = ("float16", "bfloat16")


@dataclass(frozen=True)
class Spec:
    """One collective of the stress sequence (identical on every rank)."""

    index: int
    kind: str
    dtype: str
    count: int
    op: str | None = None  # allreduce, group_allreduce
    group_size: int = 0  # group_allreduce
    step: int = 0
    root: int = 0  # broadcast
    algorithm: str | None = None  # None: the library's choice
    torch: bool = False  # pass a torch tensor aliasing the NumPy array
    blocking: bool = False  # a blocking call amid the outstanding handles
    shift: int = 0  # sum/avg floats: inputs are integers * 2**-shift

    def __str__(self) -> str:
        what = {"broadcast": f"root={self.root}",
                "allreduce": f"op={self.op}",
                "group_allreduce": f"op={self.op},group_size={self.group_size},"
                                   f"step={self.step}"}[self.kind]
        return (f"#{self.index} {self.kind}(count={self.count},dtype={self.dtype},{what},"
                f"algorithm={self.algorithm},torch={self.torch},blocking={self.blocking})")


def plan(seed: int, n_ops: int, size: int, *, big_fraction: float = 0.02,
         algorithm_fraction: float = 0.3, blocking_fraction: float = 0.03,
         native_groups: bool = True) -> list[Spec]:
    """The operation sequence: a function of (seed, n_ops, size) only.

    ``native_groups=False`` replaces a drawn ``algorithm="native"`` of a
    group_allreduce by the default algorithm (the rest of the sequence is
    unchanged), to take native group communicators out of a run. They once
    raced their set-up (fixed; tests/mpi/test_native_groups.py).
    """
    rng = np.random.default_rng([seed, 0x57E55])
    out = []
    for i in range(n_ops):
        kind = str(rng.choice(KINDS, p=KIND_WEIGHTS))
        dtype = str(rng.choice(DTYPES))
        itemsize = NUMPY[dtype].itemsize
        # Log-uniform byte size in [1 B, 64 KiB], sometimes up to 1 MiB.
        max_bytes = (1 << 20) if rng.random() < big_fraction else (64 << 10)
        nbytes = int(math.exp(rng.uniform(0.0, math.log(max_bytes))))
        count = max(1, nbytes // itemsize)
        op = str(rng.choice(OPS)) if kind != "broadcast" else None
        group_size = int(rng.integers(1, size + 1))
        step = int(rng.integers(0, 64))
        root = int(rng.integers(0, size))
        algorithm = None
        if rng.random() < algorithm_fraction:
            if kind == "broadcast":
                choices = algorithms.BROADCAST_ALGORITHMS
            else:  # MPI has no float16/bfloat16 reductions
                choices = tuple(a for a in algorithms.ALLREDUCE_ALGORITHMS
                                if a != "native" or dtype not in HALF)
            algorithm = str(rng.choice(choices))
            if algorithm == "native" and kind == "group_allreduce" and not native_groups:
                algorithm = None
        use_torch = bool(rng.random() < 0.25)
        blocking = bool(rng.random() < blocking_fraction)
        shift = int(rng.integers(0, 5))
        out.append(Spec(i, kind, dtype, count,
                        op=op if kind != "broadcast" else None,
                        group_size=group_size if kind == "group_allreduce" else 0,
                        step=step if kind == "group_allreduce" else 0,
                        root=root if kind == "broadcast" else 0,
                        algorithm=algorithm, torch=use_torch, blocking=blocking,
                        shift=shift))
    return out


def make_input(spec: Spec, rank: int, size: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s input to ``spec``: any rank can rebuild any rank's."""
    rng = np.random.default_rng([seed, spec.index, rank])
    dt = NUMPY[spec.dtype]
    n = spec.count
    if spec.kind == "broadcast":
        return rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt)
    is_float = spec.dtype in SIGNIFICAND
    if spec.op in ("max", "min"):
        if not is_float:
            info = np.iinfo(dt)
            return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
        vals = rng.uniform(-1000.0, 1000.0, n)
        if spec.algorithm != "native":
            special = rng.random(n) < 0.05
            vals[special] = rng.choice([0.0, -0.0, np.inf, -np.inf], int(special.sum()))
        return vals.astype(dt)
    if spec.op == "prod":
        if spec.dtype == "uint8":
            return rng.integers(1, 4, n).astype(dt)
        if not is_float:
            return rng.choice(np.array([-2, -1, 1, 2]), n).astype(dt)
        return rng.choice(np.array([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0]), n).astype(dt)
    # sum / avg
    if spec.dtype == "uint8":
        hi = 255 if spec.op == "sum" else 255 // size  # avg: the sum must not wrap
        return rng.integers(0, hi + 1, n).astype(dt)
    if not is_float:
        return rng.integers(-1000, 1001, n).astype(dt)
    bound = min((1 << SIGNIFICAND[spec.dtype]) // size, 1 << 20)
    k = rng.integers(-bound, bound + 1, n)
    return (k * 2.0 ** -spec.shift).astype(dt)


def members(comm: wagma_comm.Communicator, spec: Spec) -> list[int]:
    """The ranks whose inputs this rank's result depends on."""
    if spec.kind == "broadcast":
        return [spec.root]
    if spec.kind == "group_allreduce":
        return comm.group_of(spec.group_size, spec.step, comm.rank)
    return list(range(comm.size))


def expected(comm: wagma_comm.Communicator, spec: Spec, seed: int) -> np.ndarray:
    """The exact result this rank must hold after ``spec``."""
    ranks = members(comm, spec)
    if spec.kind == "broadcast":
        return make_input(spec, spec.root, comm.size, seed)
    dt = NUMPY[spec.dtype]
    stack = np.stack([make_input(spec, r, comm.size, seed) for r in ranks])
    n = len(ranks)
    if spec.dtype not in SIGNIFICAND:  # integers: NumPy's wrapping arithmetic
        if spec.op == "sum":
            return stack.sum(axis=0, dtype=dt)
        if spec.op == "prod":
            return stack.prod(axis=0, dtype=dt)
        if spec.op == "avg":
            return (stack.astype(np.int64).sum(axis=0) // n).astype(dt)
        return (stack.max if spec.op == "max" else stack.min)(axis=0)
    wide = stack.astype(np.float64)  # exact for every float dtype here
    if spec.op == "sum":
        return wide.sum(axis=0).astype(dt)
    if spec.op == "prod":
        return wide.prod(axis=0).astype(dt)
    if spec.op == "avg":
        total = wide.sum(axis=0)  # exact (see module doc)
        if spec.dtype in HALF:  # RN(RN_f32(sum / n))
            return (total.astype(np.float32) / np.float32(n)).astype(dt)
        return (total.astype(dt) / dt.type(n)).astype(dt)
    if spec.op == "max":
        out = wide.max(axis=0)
        plus_zero = ((wide == 0) & ~np.signbit(wide)).any(axis=0)
        out = np.where(out == 0, np.where(plus_zero, 0.0, -0.0), out)
    else:
        out = wide.min(axis=0)
        minus_zero = ((wide == 0) & np.signbit(wide)).any(axis=0)
        out = np.where(out == 0, np.where(minus_zero, -0.0, 0.0), out)
    return out.astype(dt)


def as_torch(arr: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``arr``'s memory (bfloat16 through its uint16 bits)."""
    if arr.dtype == NUMPY["bfloat16"]:
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def issue(comm: wagma_comm.Communicator, spec: Spec, buf: Any) -> Any:
    async_op = not spec.blocking
    if spec.kind == "broadcast":
        return comm.broadcast(buf, spec.root, async_op=async_op, algorithm=spec.algorithm)
    if spec.kind == "group_allreduce":
        return comm.group_allreduce(buf, spec.group_size, spec.step, spec.op,
                                    async_op=async_op, algorithm=spec.algorithm)
    return comm.allreduce(buf, spec.op, async_op=async_op, algorithm=spec.algorithm)


def check(comm: wagma_comm.Communicator, spec: Spec, arr: np.ndarray, seed: int) -> None:
    want = expected(comm, spec, seed)
    got_bytes, want_bytes = arr.view(np.uint8), want.view(np.uint8)
    if not np.array_equal(got_bytes, want_bytes):
        bad = np.flatnonzero(arr.view(f"u{arr.itemsize}") != want.view(f"u{arr.itemsize}"))
        i = int(bad[0])
        raise AssertionError(
            f"rank {comm.rank}: {spec} members={members(comm, spec)}: {bad.size} of "
            f"{spec.count} elements differ; first at [{i}]: got {arr[i]!r} "
            f"(0x{arr.view(f'u{arr.itemsize}')[i]:x}), expected {want[i]!r} "
            f"(0x{want.view(f'u{want.itemsize}')[i]:x})")


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@dataclass
class Report:
    ops: int = 0
    checked: int = 0
    windows: int = 0
    max_window: int = 0
    blocking: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    warmup_ops: int = 0
    rss_start: int = 0  # after the warm-up
    rss_end: int = 0
    rss_peak: int = 0  # largest RSS between windows after the warm-up
    rss_trace: list[int] = field(default_factory=list)  # after each window
    stats: dict[str, Any] = field(default_factory=dict)  # engine counters at the end

    @property
    def growth(self) -> int:
        return self.rss_end - self.rss_start

    @property
    def measured_ops(self) -> int:
        """Operations between the two RSS samples."""
        return self.ops - self.warmup_ops

    def summary(self) -> str:
        mib = 1 << 20
        return (f"{self.ops} ops ({self.by_kind}, {self.blocking} blocking) in "
                f"{self.windows} windows (largest {self.max_window} outstanding), "
                f"{self.wall_s:.1f} s; RSS after {self.warmup_ops} warm-up ops "
                f"{self.rss_start / mib:.1f} MiB, after {self.measured_ops} more "
                f"{self.rss_end / mib:.1f} MiB: growth {self.growth / mib:+.2f} MiB "
                f"(peak {self.rss_peak / mib:.1f} MiB)")


def run(comm: wagma_comm.Communicator, n_ops: int, *, seed: int,
        window: tuple[int, int] = (200, 1000), warmup_ops: int = 0,
        native_groups: bool = True) -> Report:
    """Issue ``n_ops`` random collectives in windows of ``window`` outstanding
    handles, check every result bitwise, and sample RSS after each window.

    The first windows covering at least ``warmup_ops`` operations are the
    warm-up (JIT compilation of the kernels, schedule caches, MPI internals);
    ``rss_start`` is taken right after them.
    """
    specs = plan(seed, n_ops, comm.size, native_groups=native_groups)
    sizes_rng = np.random.default_rng([seed, 0x3D])  # same windows on every rank
    local = np.random.default_rng([seed, 0x10CA1, comm.rank])  # this rank's wait order
    before = comm.statistics()
    rep = Report(ops=n_ops)
    start = time.perf_counter()
    pos = 0
    while pos < n_ops:
        width = int(sizes_rng.integers(window[0], window[1] + 1))
        batch = specs[pos:pos + width]
        pos += len(batch)
        outstanding = []
        for spec in batch:
            arr = make_input(spec, comm.rank, comm.size, seed)
            buf = as_torch(arr) if spec.torch else arr
            out = issue(comm, spec, buf)
            rep.by_kind[spec.kind] = rep.by_kind.get(spec.kind, 0) + 1
            if spec.blocking:
                rep.blocking += 1
                assert out is buf, f"{spec}: a blocking call returns its buffer"
                check(comm, spec, arr, seed)
                rep.checked += 1
            else:
                outstanding.append((spec, arr, buf, out))
        rep.max_window = max(rep.max_window, len(outstanding))
        # Wait in this rank's own random order, sometimes polling first.
        for j in local.permutation(len(outstanding)):
            spec, arr, buf, handle = outstanding[j]
            if local.random() < 0.2:
                handle.test()
            result = handle.wait()
            assert result is buf, f"{spec}: wait() returns the buffer"
            assert handle.done
            check(comm, spec, arr, seed)
            rep.checked += 1
        del outstanding, batch, arr, buf
        rep.windows += 1
        gc.collect()
        rss = rss_bytes()
        rep.rss_trace.append(rss)
        if rep.warmup_ops == 0 and pos >= warmup_ops:
            rep.warmup_ops, rep.rss_start = pos, rss
        elif rep.warmup_ops:
            rep.rss_peak = max(rep.rss_peak, rss)
    rep.wall_s = time.perf_counter() - start
    rep.rss_end = rep.rss_trace[-1]
    rep.rss_peak = max(rep.rss_peak, rep.rss_start)
    after = comm.statistics()
    rep.stats = after
    finished = after["completed"] - before["completed"]  # inline runs included
    assert rep.checked == n_ops
    assert after["failed"] == before["failed"], after
    assert after["in_flight"] == 0, after
    assert after["broken"] is None, after
    assert finished == n_ops, f"engine finished {finished} collectives, issued {n_ops}"
    return rep
