"""GPU kernel benchmark (issue #4/#9): the fused bfloat16 WAGMA average
against the device-to-device copy bandwidth and against the same arithmetic
in PyTorch tensor ops, side by side in one run.

    python bench/gpu/kernels.py [--elements N] [--inputs K] [--reps R]

Bandwidth counts the fewest bytes each must move: a copy reads and writes n
elements; the average reads K inputs and writes one output.
"""

from __future__ import annotations

import argparse
import json
import statistics

import cupy as cp
import torch

from wagma_comm import dtypes
from wagma_comm.kernels.device import kernels


def _time(fn, reps: int, stream) -> float:
    """Median seconds of ``fn`` on ``stream`` (CUDA events), after warm-up."""
    for _ in range(3):
        fn()
    stream.synchronize()
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e-3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=64 << 20)
    ap.add_argument("--inputs", type=int, default=5, help="S+1: group models + own")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n, k = args.elements, args.inputs
    k_dev = kernels(0)
    stream = cp.cuda.Stream(non_blocking=True)
    tstream = torch.cuda.ExternalStream(stream.ptr)
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(k)]
    out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    ptrs = [x.data_ptr() for x in xs]

    def copy() -> None:
        cp.cuda.runtime.memcpyAsync(dst.data_ptr(), src.data_ptr(), n * 2, 3, stream.ptr)

    def fused() -> None:
        k_dev.average(out.data_ptr(), ptrs, n, k, dtypes.BFLOAT16, stream)

    def torch_ops() -> None:
        with torch.cuda.stream(tstream):
            acc = xs[0].float()
            for x in xs[1:]:
                acc += x.float()
            out.copy_(acc / k)

    # correctness first, against float64
    fused()
    stream.synchronize()
    ref = sum(x.double() for x in xs) / k
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2, err
    res = {}
    for name, fn, nbytes in [("d2d copy", copy, 2 * n * 2),
                             ("fused average (ours)", fused, (k + 1) * n * 2),
                             ("torch ops", torch_ops, (k + 1) * n * 2)]:
        t = _time(fn, args.reps, stream)
        res[name] = {"seconds": t, "bytes": nbytes, "GBps": nbytes / t / 1e9}
    copy_bw = res["d2d copy"]["GBps"]
    print(f"device: {torch.cuda.get_device_name()}  elements {n}  inputs {k}  "
          f"dtype bfloat16  rel err vs float64 {float(err):.2e}")
    print(f"{'kernel':<22}{'time (us)':>12}{'GB/s':>10}{'of copy bw':>12}")
    for name, r in res.items():
        print(f"{name:<22}{r['seconds'] * 1e6:>12.1f}{r['GBps']:>10.0f}"
              f"{r['GBps'] / copy_bw:>12.2%}")
    speedup = res["torch ops"]["seconds"] / res["fused average (ours)"]["seconds"]
    frac = res["fused average (ours)"]["GBps"] / copy_bw
    print(f"fused vs torch ops: {speedup:.2f}x (target >= 2x: "
          f"{'PASS' if speedup >= 2 else 'FAIL'}); fused at {frac:.1%} of copy bandwidth "
          f"(target >= 85%: {'PASS' if frac >= 0.85 else 'FAIL'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"elements": n, "inputs": k, "results": res, "speedup": speedup,
                       "fraction_of_copy": frac, "rel_err": float(err)}, f, indent=1)


if __name__ == "__main__":
    main()
