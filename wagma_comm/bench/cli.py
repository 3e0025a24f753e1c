"""``wagma bench COLLECTIVE``: nccl-tests/OSU-style microbenchmarks with peers
measured side by side in the same run, on the same buffers.

Collectives: ``allreduce``, ``group_allreduce``, ``broadcast``,
``wait_avoiding``, ``solo``, ``majority`` (the persistent partial collectives,
timed per ``step`` with every rank on time), ``overlap`` (osu_iallreduce's
overall / compute / pure communication / overlap %), ``all`` (the first three),
and ``imbalance`` (``wagma bench imbalance``: the training-shaped loop under the
load-imbalance injectors; see ``wagma bench imbalance --help``).

Run it under mpiexec (``mpiexec -n 8 wagma bench allreduce --vs mpi,gloo``).
Every rank measures; rank 0 prints a table in the nccl-tests layout (time is the
mean over ranks of each rank's median round, with min and max over ranks), the
ratio of our time to each peer's, and the targets with PASS/FAIL.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..files import write_json
from . import check, report
from .plot import human_bytes  # pure; matplotlib is imported only to draw

SIZE_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
SWEEP_COLLECTIVES = ("allreduce", "group_allreduce", "broadcast", "wait_avoiding", "solo",
                     "majority")
COLLECTIVES = ("all", *SWEEP_COLLECTIVES, "overlap", "imbalance")


def parse_size(text: str) -> int:
    """'8', '64K', '16M' -> bytes."""
    t = text.strip().upper().removesuffix("B")
    unit = t[-1] if t and t[-1] in SIZE_SUFFIX else ""
    return int(float(t[: len(t) - len(unit)] or 1) * SIZE_SUFFIX[unit])


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="collective microbenchmarks (run under mpiexec)",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("collective", nargs="?", default="all", choices=COLLECTIVES)
    p.add_argument("-b", "--minbytes", type=parse_size, default=8)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-d", "--dtype", default="float32")
    p.add_argument("-o", "--op", default="sum")
    p.add_argument("-n", "--iters", type=int, default=0,
                   help="iterations per round (default: adaptive by size)")
    p.add_argument("-w", "--warmup", type=int, default=2)
    p.add_argument("-r", "--rounds", type=int, default=3,
                   help="alternating rounds per implementation (median is kept)")
    p.add_argument("-c", "--check", type=int, default=1, help="check results (#wrong)")
    p.add_argument("--group-size", type=int, default=0,
                   help="group size of group collectives (default: half the ranks)")
    p.add_argument("--step", type=int, default=0, help="group step for group_allreduce")
    p.add_argument("--root", type=int, default=0, help="root of broadcast")
    p.add_argument("--sync-every", type=int, default=10,
                   help="sync period of the partial collectives")
    p.add_argument("--algorithm", default=None, help="force a wagma algorithm")
    p.add_argument("--algorithms", default=None,
                   help="comma-separated wagma algorithms to time side by side "
                        "(allreduce and broadcast), e.g. recursive_doubling,rabenseifner,ring")
    p.add_argument("--vs", default="mpi",
                   help="peers, comma-separated: mpi, mpi-nb, gloo, nccl, or none")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--compute-kind", default="numpy", choices=["numpy", "python", "sleep"],
                   help="overlap: the compute kernel (numpy releases the GIL; sleep uses no CPU)")
    p.add_argument("--json", default=None, help="write results as JSON (rank 0)")
    p.add_argument("--csv", default=None, help="write results as CSV (rank 0)")
    p.add_argument("--plot", default=None, help="write a bandwidth/time plot (PNG, rank 0)")
    p.add_argument("--progress", default="auto", choices=["auto", "on", "off"],
                   help="progress bar on rank 0's stderr; auto: only on a terminal "
                        "(under mpiexec stderr is a pipe, so pass --progress on)")


@dataclass
class Row:
    """One message size of one collective: results per implementation."""

    collective: str
    nbytes: int
    count: int
    dtype: str
    op: str
    group_size: int
    results: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class Context:
    """What every collective's implementations are built from."""

    args: argparse.Namespace
    comm: Any
    world: Any
    dtype: Any
    peers: list[Any]
    group: list[int]
    partition: list[list[int]]
    gsize: int


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus bandwidth factors: allreduce moves 2(n-1)/n of the
    buffer per rank, broadcast 1; group collectives use the group's n."""
    if n <= 1:
        return 0.0
    if collective == "broadcast":
        return 1.0
    return 2.0 * (n - 1) / n


def ranks_spanned(collective: str, impl: str, group: int, world: int) -> int:
    """The n of ``impl``'s busbw factor: the ranks its call reduces over. In
    a group collective's row, our global allreduce (``wagma-global``) spans the
    world; in a wait_avoiding row so does each peer's allreduce."""
    if collective == "group_allreduce":
        return world if impl == "wagma-global" else group
    if collective == "wait_avoiding":
        return group if impl in ("wagma", "wagma-blocking-group") else world
    return world


def pattern(rank: int, count: int, dtype: Any) -> np.ndarray:
    """This rank's input as the storage view the collectives and peers share."""
    return check.pattern(rank, count, dtype).view(dtype.storage)


def sizes_of(args: argparse.Namespace) -> list[int]:
    from ..errors import InvalidArgumentError

    if args.minbytes < 1 or args.maxbytes < args.minbytes:
        raise InvalidArgumentError("-b/-e", f"need 1 <= minbytes <= maxbytes, got "
                                   f"{args.minbytes}, {args.maxbytes}")
    if args.stepfactor < 2:  # was raised to 2 silently
        raise InvalidArgumentError("-f/--stepfactor", f"must be >= 2, got {args.stepfactor}")
    out, nbytes = [], args.minbytes
    while nbytes <= args.maxbytes:
        out.append(nbytes)
        nbytes *= args.stepfactor
    return out


# -- implementations per collective ------------------------------------------------
def _peer_calls(ctx: Context, make: Callable[[Any], Callable[[], object] | None]
                ) -> dict[str, Callable[[], object]]:
    out = {}
    for peer in ctx.peers:
        call = make(peer)
        if call is not None:
            out[peer.name] = call
    return out


class Memory:
    """The benchmark's buffer where ``--device`` puts it: ``arr`` is what the
    implementations get (a NumPy array, or a torch CUDA tensor, which our
    collectives and torch.distributed's nccl both take); ``load``/``read``
    move the storage view in and out for checking."""

    def __init__(self, host: np.ndarray, dtype: Any, device: str) -> None:
        self.host, self.dtype, self.device = host, dtype, device
        if device == "cpu":
            self.arr: Any = host.view(dtype.numpy)
            return
        import torch

        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        self._raw = torch.empty(host.size, dtype=bits[dtype.itemsize], device="cuda")
        self.arr = self._raw.view(getattr(torch, dtype.name))
        self.load(host)

    def load(self, values: np.ndarray) -> None:
        if self.device == "cpu":
            self.host[:] = values
            return
        import torch

        ints = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[self.dtype.itemsize]
        self._raw.copy_(torch.from_numpy(np.ascontiguousarray(values).view(ints)))

    def read(self) -> np.ndarray:
        if self.device == "cpu":
            return self.host
        return self._raw.cpu().numpy().view(self.dtype.storage)

    def sync(self) -> None:
        """Wait for queued GPU work: a peer's call (torch.distributed) returns
        once enqueued, ours once done, so each timed loop ends with this."""
        if self.device != "cpu":
            import torch

            torch.cuda.synchronize()


def _impls(coll: str, ctx: Context, mem: Memory
           ) -> tuple[dict[str, Callable[[], object]], list[Callable[[], None]]]:
    """Zero-argument calls per implementation, and what to close afterwards."""
    args, comm = ctx.args, ctx.comm
    arr = mem.arr
    impls: dict[str, Callable[[], object]] = {}
    closers: list[Callable[[], None]] = []
    algs = args.algorithms.split(",") if args.algorithms else [args.algorithm]
    named = [(f"wagma:{alg}" if args.algorithms else "wagma", alg) for alg in algs]
    if coll == "allreduce":
        for name, alg in named:
            impls[name] = lambda a=alg: comm.allreduce(arr, args.op, algorithm=a)
        impls.update(_peer_calls(ctx, lambda p: p.allreduce(arr, args.op)))
    elif coll == "group_allreduce":
        impls["wagma"] = lambda: comm.group_allreduce(arr, ctx.gsize, args.step, args.op,
                                                      algorithm=args.algorithm)
        impls.update(_peer_calls(ctx, lambda p: p.group_allreduce(
            arr, args.op, ctx.group, ctx.partition)))
        impls["wagma-global"] = lambda: comm.allreduce(arr, args.op, algorithm=args.algorithm)
    elif coll == "broadcast":
        for name, alg in named:
            impls[name] = lambda a=alg: comm.broadcast(arr, args.root, algorithm=a)
        impls.update(_peer_calls(ctx, lambda p: p.broadcast(arr, args.root)))
    elif coll in ("wait_avoiding", "solo", "majority"):
        op = effective_op(coll, args.op)
        if coll == "wait_avoiding":
            partial = comm.wait_avoiding_group_allreduce(arr, ctx.gsize, args.sync_every)
            impls["wagma-blocking-group"] = lambda: comm.group_allreduce(
                arr, ctx.gsize, args.step, "avg")
        else:
            make = comm.solo_allreduce if coll == "solo" else comm.majority_allreduce
            partial = make(arr, args.sync_every, op=op)
            impls["wagma-allreduce"] = lambda: comm.allreduce(arr, op)
        impls = {"wagma": lambda: partial.step(arr), **impls}
        impls.update(_peer_calls(ctx, lambda p: p.allreduce(arr, op)))  # the row's op
        closers.append(lambda: (partial.flush(), partial.close()))  # nothing left pending
    return impls, closers


def effective_op(coll: str, op: str) -> str:
    """The op the benchmark really runs: WAGMA always averages; solo/majority
    allreduce only sum or average."""
    if coll == "wait_avoiding" or (coll in ("solo", "majority") and op not in ("sum", "avg")):
        return "avg"
    return op


def _check(coll: str, ctx: Context, mem: Memory,
           impls: dict[str, Callable[[], object]]) -> dict[str, int]:
    """#wrong per implementation (summed over ranks); -1 where not checked."""
    if not ctx.args.check or coll not in ("allreduce", "group_allreduce", "broadcast"):
        return {}
    members = list(range(ctx.comm.size)) if coll != "group_allreduce" else ctx.group
    count = mem.host.size
    expected = check.expected_result(coll, members, count, ctx.args.op, ctx.args.root)
    wrong = {}
    for name, call in impls.items():
        want = expected
        if name == "wagma-global":  # the global allreduce timed beside a group one
            want = check.expected_result("allreduce", range(ctx.comm.size), count,
                                         ctx.args.op)
        mem.load(pattern(ctx.comm.rank, count, ctx.dtype))
        call()
        mem.sync()
        wrong[name] = ctx.world.allreduce(check.count_wrong(mem.read(), ctx.dtype, want))
    return wrong


def sweep(coll: str, ctx: Context, sizes: list[int], progress: Any) -> list[Row]:
    """Time every implementation of ``coll`` at every size, side by side."""
    from .measure import iterations_for, side_by_side

    args, dtype = ctx.args, ctx.dtype
    # The group actually formed (shifting groups may be smaller than asked).
    members = len(ctx.group) if coll in ("group_allreduce", "wait_avoiding") else ctx.comm.size
    rows = []
    counts = []
    for nb in sizes:  # sizes below an element round to the same count: measured once
        count = max(1, nb // dtype.itemsize)
        if count not in counts:
            counts.append(count)
    for count in counts:
        mem = Memory(pattern(ctx.comm.rank, count, dtype).copy(), dtype, args.device)
        impls, closers = _impls(coll, ctx, mem)
        row = Row(coll, count * dtype.itemsize, count, dtype.name,
                  effective_op(coll, args.op), members)
        if ctx.comm.rank == 0 and not rows:  # a peer asked for but not in the table: why
            for peer in ctx.peers:
                if peer.reason is None and peer.name not in impls:
                    why = peer.why_not(mem.arr, None if coll == "broadcast" else row.op)
                    _emit(progress, f"# peer {peer.name} skipped for {coll}: {why}")
        wrong = _check(coll, ctx, mem, impls)
        mem.load(pattern(ctx.comm.rank, count, dtype))
        timings = side_by_side(impls, iterations_for(row.nbytes, args.iters), args.warmup,
                               args.rounds, ctx.world, mem.sync)
        for close in closers:
            close()
        for name, t in timings.items():
            factor = busbw_factor(coll, ranks_spanned(coll, name, members, ctx.comm.size))
            algbw = row.nbytes / t.avg / 1e9
            row.results[name] = {"time_us": t.avg * 1e6, "min_us": t.min * 1e6,
                                 "max_us": t.max * 1e6, "algbw": algbw,
                                 "busbw": algbw * factor, "wrong": wrong.get(name, -1)}
        if coll in ("group_allreduce", "wait_avoiding"):
            row.results["wagma"]["aggbw"] = row.results["wagma"]["algbw"] * len(ctx.partition)
        rows.append(row)
        if ctx.comm.rank == 0:
            if len(rows) == 1:
                _emit(progress, report.header(coll, list(impls), members))
            _emit(progress, report.row_line(row))
        progress.advance(note=f"{coll} {human_bytes(nb)}")
    return rows


# -- the command --------------------------------------------------------------------
def _emit(progress: Any, line: str) -> None:
    """Print a table line without tearing the progress bar (stderr, TTY only)."""
    clear = getattr(progress, "clear", None)
    if clear is not None:
        clear()
    print(line, flush=True)


def _check_device(device: str, collective: str) -> None:
    """Refused before any communication: --device cuda without a GPU path here,
    or with the host-only overlap benchmark."""
    from ..errors import UnsupportedError
    from ..transport.nccl import unavailable_reason

    if device != "cuda":
        return
    reason = unavailable_reason()
    if reason is not None:
        raise UnsupportedError("--device", f"cuda: {reason}")
    if collective == "overlap":
        raise UnsupportedError("--device", "the overlap benchmark runs on host memory")


def _check_overlap_options(args: argparse.Namespace) -> None:
    """Refused before any communication: outputs the overlap benchmark does not
    write (it has no bandwidth sweep to put in a CSV or a plot)."""
    from ..errors import UnsupportedError

    if args.collective != "overlap":
        return
    for flag, value in (("--csv", args.csv), ("--plot", args.plot)):
        if value:
            raise UnsupportedError(flag, "the overlap benchmark writes --json only")


def _check_counts(args: argparse.Namespace) -> None:
    """Refused before any communication: counts that make the run meaningless
    (negative iterations gave negative times and a verdict; no rounds failed
    after set-up with an untyped error)."""
    from ..errors import InvalidArgumentError

    for flag, value, least in (("-n/--iters", args.iters, 0), ("-w/--warmup", args.warmup, 0),
                               ("-r/--rounds", args.rounds, 1)):
        if value < least:
            raise InvalidArgumentError(flag, f"must be >= {least}, got {value}")


def run(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    import wagma_comm
    from wagma_comm import dtypes, groups

    from . import peers as peers_mod
    from .outputs import check_outputs, data_file, image_file
    from .progress import Progress

    if args.collective == "imbalance":  # reached only with options before it
        raise SystemExit("wagma bench: 'imbalance' has options of its own; write it right "
                         "after 'bench': wagma bench imbalance [options]")
    _check_device(args.device, args.collective)
    _check_overlap_options(args)
    _check_counts(args)
    groups.check_step(args.step, "--step")  # group_of refuses -1 naming `step`
    world = MPI.COMM_WORLD
    dtype = dtypes.lookup(args.dtype, "--dtype")
    dtypes.check_op(args.op, "--op")
    sizes = sizes_of(args)
    comm = wagma_comm.init()
    rank, size = comm.rank, comm.size
    gsize = args.group_size or max(1, size // 2)
    try:
        groups.check_group_size(size, gsize, "--group-size")
        check_outputs(comm, [data_file("--json", args.json), data_file("--csv", args.csv),
                             image_file("--plot", args.plot)])
    except BaseException:
        comm.close()
        raise
    ctx = Context(args, comm, world, dtype,
                  peers_mod.make_peers(peers_mod.parse_vs(args.vs), world, args.device,
                                       comm.timeout),
                  list(groups.group_of(rank, size, gsize, args.step)),
                  [list(g) for g in groups.partition(size, gsize, args.step)], gsize)
    if rank == 0:
        for peer in ctx.peers:
            if peer.reason is not None:
                print(f"# peer {peer.name} unavailable: {peer.reason}", flush=True)
    try:
        if args.collective == "overlap":
            return _run_overlap(ctx, sizes)
        collectives = (["allreduce", "group_allreduce", "broadcast"]
                       if args.collective == "all" else [args.collective])
        rows: list[Row] = []
        show = {"on": True, "off": False, "auto": None}[args.progress]
        with Progress(len(sizes) * len(collectives), "wagma bench",
                      enabled=show if rank == 0 else False) as progress:
            for coll in collectives:
                rows.extend(sweep(coll, ctx, sizes, progress))
        meta = report.metadata(comm, ctx.peers)
        if rank == 0:
            print(report.summary(rows), flush=True)
            _write_outputs(args, rows, meta)
        return 0
    finally:
        peers_mod.close_peers(ctx.peers)
        comm.close()


def _run_overlap(ctx: Context, sizes: list[int]) -> int:
    from . import overlap

    args = ctx.args
    # MPI_Iallreduce is the one peer with an overlap measure: timed when --vs
    # names mpi (or mpi-nb), left out with --vs none.
    names = [p.name for p in ctx.peers]
    if ctx.comm.rank == 0:
        for name in names:
            if name not in ("mpi", "mpi-nb"):
                print(f"# peer {name} skipped: the overlap benchmark compares with "
                      "MPI_Iallreduce only", flush=True)
    results = overlap.run_overlap(ctx.comm, ctx.world, sizes, ctx.dtype.name, args.op,
                                  iters=args.iters, warmup=args.warmup, rounds=args.rounds,
                                  compute=args.compute_kind, check=bool(args.check),
                                  mpi="mpi" in names or "mpi-nb" in names, quiet=False)
    meta = report.metadata(ctx.comm, ctx.peers)
    if ctx.comm.rank == 0:
        print(report.overlap_summary(results), flush=True)
        if args.json:
            write_json(args.json, {"meta": meta, "overlap": results})
    return 0


def _write_outputs(args: argparse.Namespace, rows: list[Row], meta: dict[str, Any]) -> None:
    if args.json:
        write_json(args.json, {"meta": meta, "rows": [r.__dict__ for r in rows]})
    if args.csv:
        report.write_csv(args.csv, rows)
    if args.plot:
        from .plot import plot_sweep

        plot_sweep([r.__dict__ for r in rows], args.plot, meta=meta,
                   metrics=("busbw", "time_us"))
        print(f"# plot written to {os.path.abspath(args.plot)}", flush=True)
