"""Where a training method's step waits: sync rounds against group rounds.

The demo's table gives one mean wait per iteration. This script runs the
demo's training step (model, data, injector, compute; batches drawn at random
rather than by epoch, since only the timing matters here) for each method,
alternating methods, and splits the wait that ``step()`` reports
(``AveragingInfo.wait_s``) into synchronous rounds and the rest, with the
median ``step()`` time of each kind. For WAGMA it also prints, for the
steps outside the sync rounds, the mean wait by position between two sync
rounds, the 50th/90th/99th percentiles, the share above 2 ms, and how many
of the long waits (over 4 ms) had a stale member in their round.

    mpiexec -n 8 .venv/bin/python bench/step_wait.py [--methods wagma,local_sgd]
        [--iterations 150] [--repeats 2] [--imbalance reference:0.01:2]

The first repeat of each method in a process includes one-time costs (JIT
compilation on the first rounds), so it is printed but only the later
repeats give the detail lines. Means over ranks; milliseconds.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import wagma_comm
from wagma_comm import demo
from wagma_comm import imbalance as imb
from wagma_comm.cli import build_parser
from wagma_comm.train import default_group_size


def run_once(comm, method: str, seed: int, data, o, injector, iterations: int):
    """One training run; per step (synchronized, wait_s, step seconds,
    fresh members, group size)."""
    import torch
    import torch.nn.functional as F

    model, opt = demo.make_trainer(comm, method, seed, o)
    shard = demo.make_shard(data.y_train.numpy(), comm.rank, comm.size, seed, o.shards)
    rng = np.random.default_rng([seed, comm.rank])
    rows = []
    comm.barrier()
    t0 = time.perf_counter()
    for t in range(iterations):
        idx = torch.from_numpy(shard[rng.integers(0, len(shard), o.batch)])
        opt.zero_grad()
        time.sleep(o.compute)
        injector.sleep(comm.rank, t)
        F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
        s0 = time.perf_counter()
        opt.step()
        info = opt.last_info
        rnd = info.rounds[0] if info is not None and info.rounds else None
        rows.append((bool(info and info.synchronized), info.wait_s if info else 0.0,
                     time.perf_counter() - s0,
                     len(rnd.fresh) if rnd else 0, len(rnd.group) if rnd else 0))
    opt.finalize()
    wall = time.perf_counter() - t0
    opt.close()
    return wall, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--methods", default="wagma,local_sgd")
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--imbalance", default="reference:0.01:2")
    args = parser.parse_args()

    import torch
    torch.set_num_threads(1)
    comm = wagma_comm.init()
    P = comm.size
    o = build_parser().parse_args(["demo", "--quiet"])
    o.group_size = default_group_size(P)
    data = demo.load_data()
    injector = imb.make_injector(args.imbalance, P, 0)
    methods = args.methods.split(",")
    n = args.iterations
    out = [f"# {P} ranks, {n} iterations per run, injector {args.imbalance}, compute "
           f"{1e3 * o.compute:g} ms, group size {o.group_size}, sync every {o.sync_every} "
           "(ms; mean over ranks)",
           "method     repeat  wall/it  sync wait/it  other wait/it  step median (other)"
           "  step median (sync)"]
    for rep in range(args.repeats):
        for m in methods if rep % 2 == 0 else methods[::-1]:
            wall, rows = run_once(comm, m, rep, data, o, injector, n)
            r = np.array(rows, dtype=float)
            sync = r[:, 0] > 0
            other = ~sync
            mine = np.array([wall / n, r[sync, 1].sum() / n, r[other, 1].sum() / n,
                             np.median(r[other, 2]), np.median(r[sync, 2]) if sync.any() else 0])
            mean = comm.allreduce(mine, op="sum") / P * 1e3
            out.append(f"{m:10s} {rep:6d} " + " ".join(f"{x:8.2f}" for x in mean))
            if m == "wagma" and rep > 0:
                out.extend(wagma_detail(comm, r, other, o.sync_every))
    if comm.rank == 0:
        print("\n".join(out), flush=True)
    comm.close()


def wagma_detail(comm, r: np.ndarray, other: np.ndarray, sync_every: int) -> list[str]:
    """The distribution of WAGMA's waits outside the sync rounds."""
    P = comm.size
    wait = r[other, 1] * 1e3
    position = (np.arange(len(r)) % sync_every)[other]
    by_pos = [wait[position == k].mean() for k in range(sync_every - 1)]
    long = wait > 4.0
    stale = (r[other, 3] < r[other, 4])
    mine = np.array(by_pos + [*np.percentile(wait, [50, 90, 99]), (wait > 2.0).mean(),
                              long.sum(), (long & stale).sum()])
    mean = comm.allreduce(mine, op="sum") / P
    k = sync_every - 1
    return ["  wagma waits outside sync rounds, by position after a sync round: "
            + " ".join(f"{x:.2f}" for x in mean[:k]),
            f"  p50 {mean[k]:.2f}  p90 {mean[k + 1]:.2f}  p99 {mean[k + 2]:.2f}  "
            f"share over 2 ms {mean[k + 3]:.2f}  waits over 4 ms per run {mean[k + 4]:.1f}, "
            f"of which with a stale member {mean[k + 5]:.1f}"]


if __name__ == "__main__":
    main()
