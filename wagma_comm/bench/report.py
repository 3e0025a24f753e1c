"""What ``wagma bench`` prints and writes: nccl-tests-style tables, the targets
with PASS/FAIL, and the metadata that makes a table reproducible (software
versions, MPI library, NCCL, CPU/GPU model, the command line)."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

from ..files import write_atomically

# The targets of issues #2, #3 and #5, judged on ratios measured side by side.
LARGE_BYTES = 16 << 20
LARGE_VS_MPI = 1.15
SMALL_VS_MPI = 3.0


def header(coll: str, impls: list[str], n: int) -> str:
    what = f"group of {n} ranks" if coll in ("group_allreduce", "wait_avoiding") else f"{n} ranks"
    head = f"\n# {coll}  ({what}; time = mean over ranks [min-max])\n"
    head += f"{'size':>10} {'count':>10} {'type':>8} {'redop':>5}"
    for name in impls:
        head += (f" | {name + ' time(us)':>22} {'[min-max]':>17} {'algbw':>6} {'busbw':>6} "
                 f"{'#wrong':>6}")
    for peer in _peers_of(impls):
        head += f" | {'wagma/' + peer:>12}"
    return head


def _peers_of(impls: list[str] | dict[str, Any]) -> list[str]:
    return [n for n in impls if not n.startswith("wagma")] if "wagma" in impls else []


def row_line(row: Any) -> str:
    line = f"{row.nbytes:>10} {row.count:>10} {row.dtype:>8} {row.op:>5}"
    for r in row.results.values():
        wrong = "n/a" if r["wrong"] < 0 else str(int(r["wrong"]))
        span = f"[{r['min_us']:.1f}-{r['max_us']:.1f}]"
        line += (f" | {r['time_us']:>22.1f} {span:>17} {r['algbw']:>6.2f} "
                 f"{r['busbw']:>6.2f} {wrong:>6}")
    ours = row.results.get("wagma")
    for peer in _peers_of(row.results):
        line += f" | {ours['time_us'] / row.results[peer]['time_us']:>12.2f}"
    return line


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _ratio(row: Any, peer: str) -> float | None:
    if "wagma" in row.results and peer in row.results:
        return row.results["wagma"]["time_us"] / row.results[peer]["time_us"]
    return None


def summary(rows: list[Any]) -> str:
    """Targets judged on this run (only those the run measured)."""
    lines = ["\n# targets (this run, ratios of times measured side by side)"]
    ar = [r for r in rows if r.collective == "allreduce"]
    big = [r for r in ar if r.nbytes >= LARGE_BYTES]
    for peer, limit, what in (("mpi", LARGE_VS_MPI, f"within {LARGE_VS_MPI}x of MPI_Allreduce"),
                              ("gloo", 1.0, "faster than torch.distributed gloo")):
        ratios = [x for x in (_ratio(r, peer) for r in big) if x is not None]
        if ratios:
            worst = max(ratios)
            ok = worst <= limit if peer == "mpi" else worst < limit
            lines.append(f"  allreduce >= 16 MiB {what}: worst {worst:.2f}x  {_verdict(ok)}")
    small = [x for x in (_ratio(r, "mpi") for r in ar if r.nbytes == 8) if x is not None]
    if small:
        lines.append(f"  8-byte allreduce latency within {SMALL_VS_MPI:g}x of MPI_Allreduce: "
                     f"{small[0]:.2f}x  {_verdict(small[0] <= SMALL_VS_MPI)}")
    grp = [r for r in rows if r.collective == "group_allreduce" and r.nbytes == LARGE_BYTES
           and "wagma-global" in r.results]
    if grp:
        r = grp[0]
        ratio = r.results["wagma"]["time_us"] / r.results["wagma-global"]["time_us"]
        lines.append(f"  group allreduce (group {r.group_size}) on 16 MiB faster than the "
                     f"global allreduce: {ratio:.2f}x of its time  {_verdict(ratio < 1.0)}")
    checked = [int(v["wrong"]) for r in rows for v in r.results.values() if v["wrong"] >= 0]
    unchecked = sum(1 for r in rows for v in r.results.values() if v["wrong"] < 0)
    if checked:
        wrong = sum(checked)
        also = f"; {unchecked} timed only (n/a)" if unchecked else ""
        lines.append(f"  results checked: {wrong} wrong elements in {len(checked)} checked "
                     f"results{also}  {_verdict(wrong == 0)}")
    elif rows:  # -c 0, or collectives the check does not cover: no verdict to give
        lines.append("  results not checked (-c 0, or a collective -c does not cover): "
                     "no verdict")
    if len(lines) == 1:
        lines.append("  (no target applies to this selection)")
    return "\n".join(lines)


def overlap_summary(results: list[dict[str, Any]]) -> str:
    """The overlap target: ours at least as high as MPI_Iallreduce at 16 MiB."""
    at = {r["impl"]: r for r in results if r["nbytes"] == LARGE_BYTES}
    lines = ["\n# targets (this run)"]
    if "wagma" in at and "mpi" in at:
        ours, theirs = at["wagma"]["overlap_pct"], at["mpi"]["overlap_pct"]
        lines.append(f"  non-blocking allreduce overlap at 16 MiB >= MPI_Iallreduce's: "
                     f"{ours:.1f}% vs {theirs:.1f}%  {_verdict(ours >= theirs)}")
    elif "wagma" in at:
        lines.append("  (no MPI_Iallreduce at 16 MiB to compare with: --vs none, or an op or "
                     "dtype MPI cannot reduce)")
    else:
        lines.append("  (16 MiB not in the sweep: the overlap target needs -b/-e to include it)")
    # The overlapped calls' results, judged as the sweep's summary does: a
    # high overlap from a collective that computed wrong values is no PASS.
    checked = [int(r["wrong"]) for r in results if r["wrong"] >= 0]
    if checked:
        wrong = sum(checked)
        lines.append(f"  results checked: {wrong} wrong elements in {len(checked)} checked "
                     f"results  {_verdict(wrong == 0)}")
    elif results:
        lines.append("  results not checked (-c 0): no verdict")
    return "\n".join(lines)


def metadata(comm: Any, peers: list[Any]) -> dict[str, Any]:
    """Versions and hardware (rank 0's view), so a table can be reproduced."""
    from mpi4py import MPI

    import mpi4py
    import numba
    import numpy as np

    import wagma_comm

    meta: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "ranks": comm.size, "wagma_comm": wagma_comm.__version__,
        "python": platform.python_version(), "numpy": np.__version__,
        "numba": numba.__version__, "mpi4py": mpi4py.__version__,
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        # The machine's CPUs: rank 0's own set is one core when the launcher
        # binds ranks (mpiexec -bind-to core), which is no count of the machine.
        "cpu": _cpu_model(), "cpus": os.cpu_count() or len(os.sched_getaffinity(0)),
        "rank0_cpus": len(os.sched_getaffinity(0)), "host": platform.node(),
        "gpu": None, "nccl": None,
        "peers": {p.name: p.version() for p in peers},
    }
    try:
        import torch

        meta["torch"] = torch.__version__
        if torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name(0)
            meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except ImportError:
        meta["torch"] = None
    return meta


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def write_csv(path: str, rows: list[Any]) -> None:
    """The rows as CSV at ``path``, whole or not at all (as ``--json``): a
    failure part-way leaves an earlier file as it was, not half a table."""
    def dump(tmp: str) -> None:
        with open(tmp, "w") as fh:
            fh.write("collective,impl,size,count,type,redop,group_size,time_us,min_us,max_us,"
                     "algbw,busbw,aggbw,wrong\n")
            for r in rows:
                for name, v in r.results.items():
                    fh.write(f"{r.collective},{name},{r.nbytes},{r.count},{r.dtype},{r.op},"
                             f"{r.group_size},{v['time_us']:.3f},{v['min_us']:.3f},"
                             f"{v['max_us']:.3f},{v['algbw']:.4f},{v['busbw']:.4f},"
                             f"{v.get('aggbw', '')},{int(v['wrong'])}\n")

    write_atomically(path, dump)
