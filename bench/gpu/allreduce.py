"""GPU allreduce side by side with torch.distributed's NCCL allreduce, on the
same ranks, sizes and tensors in one run (issue #4/#9).

    mpiexec -n 2 python bench/gpu/allreduce.py [--max-bytes 256M] [--json F]
    mpiexec -n 4 python bench/gpu/allreduce.py --group-size 2   # group allreduce, step 0

Columns: our blocking call (each call waits for its result on the host, what
a user of the blocking API sees), our non-blocking calls (all issued, then
waited: pipelined throughput), the DAG lowering (recursive doubling or ring
over ncclSend/ncclRecv plus our kernels) and torch.distributed (issued back to
back, one synchronize at the end). Bus bandwidth as nccl-tests computes it:
bytes / time * 2 (n - 1) / n.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from mpi4py import MPI

import wagma_comm
from torch_dist import init_torch_nccl, seconds_per_call  # bench/gpu/, beside this script


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-bytes", default="8")
    ap.add_argument("--max-bytes", default="256M")
    ap.add_argument("--factor", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--group-size", type=int, default=0,
                    help="time the group allreduce over groups of this size (step 0) "
                         "against torch's allreduce on the same groups; 0: everyone")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    init_torch_nccl(world)
    comm = wagma_comm.init(timeout=120)
    gsize = args.group_size or size
    partition = wagma_comm.groups.partition(size, gsize, 0)
    torch_groups = [dist.new_group(list(g)) for g in partition]  # collective, every rank
    mine = next(k for k, g in enumerate(partition) if rank in g)
    members = len(partition[mine])

    def ours_call(x, algorithm, async_op=False):
        if gsize == size:
            return comm.allreduce(x, "sum", algorithm=algorithm, async_op=async_op)
        return comm.group_allreduce(x, gsize, 0, "sum", algorithm=algorithm,
                                    async_op=async_op)
    rows = []
    nbytes = _parse_size(args.min_bytes)
    limit = _parse_size(args.max_bytes)
    while nbytes <= limit:
        n = max(1, nbytes // 4)
        x = torch.randn(n, device="cuda")
        y = x.clone()
        iters = 200 if nbytes <= (1 << 20) else 20
        warmup = 20 if nbytes <= (1 << 20) else 5
        ours = seconds_per_call(lambda: ours_call(x, "native"), iters, warmup)

        def ours_async() -> None:
            hs = [ours_call(x, "native", async_op=True) for _ in range(4)]
            for h in hs:
                h.wait()
        ours_nb = seconds_per_call(ours_async, max(1, iters // 4), max(1, warmup // 4)) / 4
        dag_alg = "recursive_doubling" if nbytes < (1 << 20) else "ring"
        dag = seconds_per_call(lambda: ours_call(x, dag_alg), iters, warmup)
        theirs = seconds_per_call(lambda: dist.all_reduce(y, group=torch_groups[mine]), iters, warmup)
        factor = 2 * (members - 1) / members if members > 1 else 1.0
        rows.append({"bytes": n * 4, "ours_us": ours * 1e6, "ours_async_us": ours_nb * 1e6,
                     "dag_us": dag * 1e6, "dag_algorithm": dag_alg, "torch_us": theirs * 1e6,
                     "ours_busbw": n * 4 / ours / 1e9 * factor,
                     "ours_async_busbw": n * 4 / ours_nb / 1e9 * factor,
                     "torch_busbw": n * 4 / theirs / 1e9 * factor})
        nbytes *= args.factor
    if rank == 0:
        print(f"ranks {size}  groups of {members}  device {torch.cuda.get_device_name()}  "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} (torch)  float32 sum")
        print(f"{'bytes':>11}{'ours us':>10}{'async us':>10}{'DAG us':>10}{'torch us':>10}"
              f"{'ours GB/s':>11}{'async GB/s':>11}{'torch GB/s':>11}{'async/torch bw':>15}")
        for r in rows:
            print(f"{r['bytes']:>11}{r['ours_us']:>10.1f}{r['ours_async_us']:>10.1f}"
                  f"{r['dag_us']:>10.1f}{r['torch_us']:>10.1f}{r['ours_busbw']:>11.2f}"
                  f"{r['ours_async_busbw']:>11.2f}{r['torch_busbw']:>11.2f}"
                  f"{r['ours_async_busbw'] / r['torch_busbw']:>15.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": size, "group_size": members, "rows": rows}, f, indent=1)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
