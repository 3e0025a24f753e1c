"""Throughput of the host reduction kernels (wagma_comm.kernels.host).

Prints, for 16 MiB buffers (override with --mib):
  * float32 sum: reduce_into vs np.add(out=) -- the ratio should be ~1 (both are
    memory bound);
  * float16/bfloat16 reduce_into (sum) and average_into vs a NumPy fallback
    (astype(float32), add, astype back), in GB/s.

GB/s counts the bytes the operation must move: reduce = read dst + read src +
write dst; average over k parts = k reads + 1 write. Each figure is the median
of --reps timed runs (time.perf_counter), after one untimed warm-up call that
also triggers (or loads from cache) the numba compilation; dst is restored from
a copy before every run, outside the timed region.

Usage: python bench/bench_host_kernels.py [--mib 16] [--reps 15] [--parts 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import ml_dtypes
import numpy as np

from wagma_comm import dtypes as D
from wagma_comm.kernels import host as H


def _median_time(fn: Callable[[], None], reset: Callable[[], None], reps: int) -> float:
    reset()
    fn()  # warm-up / JIT
    times = []
    for _ in range(reps):
        reset()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _line(label: str, nbytes: int, seconds: float, extra: str = "") -> None:
    print(f"  {label:<44s} {seconds * 1e3:8.3f} ms  {nbytes / seconds / 1e9:7.2f} GB/s {extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--parts", type=int, default=4, help="parts of average_into (incl. dst)")
    args = ap.parse_args()
    if args.parts < 2:  # fewer is no average (it silently averaged 2 parts divided by 1)
        ap.error(f"--parts must be at least 2, got {args.parts}")
    rng = np.random.default_rng(0)
    nbytes = int(args.mib * (1 << 20))

    # ---- float32 sum
    n = nbytes // 4
    a0 = rng.standard_normal(n, dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    a = a0.copy()

    def reset32() -> None:
        np.copyto(a, a0)

    print(f"float32 sum, {args.mib:g} MiB per buffer, median of {args.reps}")
    t_np = _median_time(lambda: np.add(a, b, out=a), reset32, args.reps)
    t_h = _median_time(lambda: H.reduce_into(a, b, "sum", D.FLOAT32), reset32, args.reps)
    _line("np.add(a, b, out=a)", 3 * nbytes, t_np)
    _line("reduce_into(sum)", 3 * nbytes, t_h, f"ratio reduce_into/np.add time = {t_h / t_np:.3f}")
    t_f64 = _median_time(lambda: H.average_into(a, [a, b], 2, D.FLOAT32), reset32, args.reps)
    _line("average_into([a, b], 2)", 3 * nbytes, t_f64)

    # ---- halves
    n = nbytes // 2
    for dt, npdt in ((D.BFLOAT16, ml_dtypes.bfloat16), (D.FLOAT16, np.float16)):
        x0 = rng.standard_normal(n, dtype=np.float32).astype(npdt).view(np.uint16)
        others = [rng.standard_normal(n, dtype=np.float32).astype(npdt).view(np.uint16)
                  for _ in range(args.parts - 1)]
        x = x0.copy()
        y = others[0]

        def reset() -> None:
            np.copyto(x, x0)

        def np_sum() -> None:
            r = x.view(npdt).astype(np.float32) + y.view(npdt).astype(np.float32)
            x[...] = r.astype(npdt).view(np.uint16)

        def np_avg() -> None:
            acc = x.view(npdt).astype(np.float32)
            for p in others:
                acc += p.view(npdt).astype(np.float32)
            acc /= np.float32(args.parts)
            x[...] = acc.astype(npdt).view(np.uint16)

        parts = [x, *others]
        k = len(parts)
        print(f"{dt.name}, {args.mib:g} MiB per buffer, median of {args.reps}")
        t_np = _median_time(np_sum, reset, args.reps)
        t_h = _median_time(lambda: H.reduce_into(x, y, "sum", dt), reset, args.reps)
        _line("numpy fallback sum (astype f32, add, back)", 3 * nbytes, t_np)
        _line("reduce_into(sum)", 3 * nbytes, t_h, f"speed-up x{t_np / t_h:.2f}")
        t_h = _median_time(lambda: H.reduce_into(x, y, "max", dt), reset, args.reps)
        _line("reduce_into(max)", 3 * nbytes, t_h)
        t_np = _median_time(np_avg, reset, args.reps)
        t_h = _median_time(lambda: H.average_into(x, parts, k, dt), reset, args.reps)
        _line(f"numpy fallback average of {k} parts", (k + 1) * nbytes, t_np)
        _line(f"average_into({k} parts, fused)", (k + 1) * nbytes, t_h,
              f"speed-up x{t_np / t_h:.2f}")
        t_h = _median_time(lambda: H.scale_into(x, 3, dt), reset, args.reps)
        _line("scale_into(3)", 2 * nbytes, t_h)


if __name__ == "__main__":
    main()
