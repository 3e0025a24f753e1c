"""Training iterations on CUDA tensors, side by side in one run (issue #9, item
4): DistributedOptimizer with device buckets (the collectives run on the flat
GPU buckets), the same with host-staged buckets, and torch's
DistributedDataParallel over NCCL, on the same model, data and ranks.

    mpiexec -n 4 python bench/gpu/train_step.py [--hidden 64,4096,32768]
        [--methods allreduce,local_sgd,solo,wagma] [--iterations 50] [--rounds 3]

The model is the demo's MLP (64-H-10, float32); an iteration is zero_grad,
forward, backward and step on a 64-sample batch with no injected imbalance,
so the figures are each path's own cost per iteration. Reported: the slowest
rank's mean over ``--iterations`` (after 10 warm-up iterations), the median
of ``--rounds`` rounds; the configurations run in a different order each
round. Creation and finalize are outside the timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Callable

import torch
import torch.nn.functional as F
from mpi4py import MPI

import wagma_comm
from torch_dist import init_torch_nccl, seconds_per_call  # bench/gpu/, beside this script
from wagma_comm.demo import make_model
from wagma_comm.train import DistributedOptimizer

WARMUP = 10
BATCH = 64


def _iterate(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def time_one(make: Callable[[], tuple[Any, Any, Callable[[], None]]], x: torch.Tensor,
             y: torch.Tensor, iterations: int) -> float:
    """Seconds per iteration, the slowest rank's."""
    model, opt, done = make()
    elapsed = seconds_per_call(lambda: _iterate(model, opt, x, y), iterations, WARMUP)
    done()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", default="64,4096,32768")
    ap.add_argument("--methods", default="allreduce,local_sgd,solo,wagma")
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    device = init_torch_nccl(world)
    comm = wagma_comm.init(timeout=120)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, 64, generator=g).to(device)
    y = torch.randint(0, 10, (BATCH,), generator=g).to(device)

    def ours(hidden: int, method: str, buckets: str) -> Callable[[], Any]:
        def make() -> tuple[Any, Any, Callable[[], None]]:
            torch.manual_seed(0)
            model = make_model(hidden).to(device)
            opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01,
                                                       momentum=0.9),
                                       comm, method, model=model, buckets=buckets,
                                       sync_every=10)
            assert opt.buckets == buckets

            def done() -> None:
                opt.finalize()
                opt.close()
            return model, opt, done
        return make

    def ddp(hidden: int) -> Callable[[], Any]:
        def make() -> tuple[Any, Any, Callable[[], None]]:
            torch.manual_seed(0)
            model = torch.nn.parallel.DistributedDataParallel(
                make_model(hidden).to(device), device_ids=[device.index])
            return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), \
                lambda: None
        return make

    rows = []
    for hidden in (int(h) for h in args.hidden.split(",")):
        configs: dict[str, Callable[[], Any]] = {"torch DDP": ddp(hidden)}
        for method in args.methods.split(","):
            for buckets in ("device", "host"):
                configs[f"{method} {buckets}"] = ours(hidden, method, buckets)
        names = list(configs)
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                times[n].append(time_one(configs[n], x, y, args.iterations))
        params = sum(p.numel() for p in make_model(hidden).parameters())
        base = statistics.median(times["torch DDP"])
        for n in names:
            ms = statistics.median(times[n])
            rows.append({"hidden": hidden, "params": params, "config": n,
                         "ms_per_iteration": 1e3 * ms, "vs_ddp": ms / base,
                         "all_ms": [1e3 * t for t in times[n]]})
    if rank == 0:
        print(f"ranks {size}  device {torch.cuda.get_device_name()}  torch {torch.__version__}"
              f"  NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} (torch)  batch {BATCH}"
              f"  {args.iterations} iterations x {args.rounds} rounds (median)")
        print(f"{'hidden':>7}{'MiB':>7}  {'configuration':<18}{'ms/it':>8}{'x DDP':>8}"
              f"{'device/host':>13}")
        by = {(r["hidden"], r["config"]): r for r in rows}
        for r in rows:
            method, _, where = r["config"].partition(" ")
            ratio = ""
            if where == "device":
                host = by[(r["hidden"], method + " host")]["ms_per_iteration"]
                ratio = f"{r['ms_per_iteration'] / host:.3f}"
            print(f"{r['hidden']:>7}{4 * r['params'] / 2**20:>7.2f}  {r['config']:<18}"
                  f"{r['ms_per_iteration']:>8.3f}{r['vs_ddp']:>8.3f}{ratio:>13}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": size, "rows": rows}, f, indent=1)
    comm.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
