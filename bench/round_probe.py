"""Where the time of one wait-avoiding group round goes: a probe.

WAGMA-SGD's rounds decide how long the first member to arrive waits
(docs/training.md). This script steps a wait-avoiding group allreduce with
every rank on time (a barrier before each step) and timestamps, with the
system-wide monotonic clock, the events of each round on every rank: the
step call, the round's start on this rank (its own arrival or a peer's
token), the end of its data exchange, the delivery of the result into the
caller's buffer (with the fused average inside it), and the return of
``step``. It prints medians over rounds and ranks.

    mpiexec -n 8 .venv/bin/python bench/round_probe.py [--elements 4096] [--steps 200]

With ``--imbalance SPEC`` (e.g. ``reference:0.01:2``) the ranks do not meet at
a barrier: each step sleeps ``--compute`` plus the injector's delay, as in
training, and only the rounds this rank started (it arrived first, on time)
are counted: their step time is what the first member to arrive waits. It
also prints iterations/s and CPU time over wall time per rank (the progress
threads' polling shows there).

It wraps private methods of ``wagma_comm.partial`` to take the timestamps: a
measurement, not part of the runtime (bench/results/round-probe-8.txt).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import wagma_comm
from wagma_comm.bench.measure import job_cores, run_or_abort
from wagma_comm.imbalance import make_injector
from wagma_comm.partial import base, wagma

Events = list[tuple[str, float]]


def _timed(cls: type, name: str, on_enter: str | None, on_exit: str | None,
           events: list[Events]) -> None:
    """Wrap ``cls.name`` to record its entry and/or exit in the current round."""
    inner: Callable[..., Any] = getattr(cls, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if on_enter:
            events[-1].append((on_enter, time.monotonic()))
        try:
            return inner(self, *args, **kwargs)
        finally:
            if on_exit:
                events[-1].append((on_exit, time.monotonic()))

    setattr(cls, name, wrapper)


def _round_starts() -> dict[int, float]:
    """Record when each round started on this rank (its progress thread), by
    round number, so the activator's start can be compared with its members'
    (one system-wide monotonic clock on one host)."""
    starts: dict[int, float] = {}
    inner = base.PartialCollective._start_round

    def wrapper(self: Any, r: int, *args: Any, **kwargs: Any) -> Any:
        starts.setdefault(r, time.monotonic())
        return inner(self, r, *args, **kwargs)

    base.PartialCollective._start_round = wrapper  # type: ignore[method-assign]
    return starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--elements", type=int, default=4096, help="float32 model elements")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--imbalance", default=None,
                        help="injector spec: steps are compute + delay, no barrier")
    parser.add_argument("--compute", type=float, default=0.01,
                        help="seconds of sleep per step with --imbalance")
    parser.add_argument("--activation", choices=("group", "global"), default="group")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = wagma_comm.init(timeout=120)
    events: list[Events] = [[]]
    _timed(base.PartialCollective, "_start_round", "start", None, events)
    _timed(base.PartialCollective, "_round_done", "exchanged", None, events)
    _timed(base.PartialCollective, "_deliver", "deliver", "delivered", events)
    _timed(wagma.WaitAvoidingGroupAllreduce, "_finalize", "finalize", "finalized", events)
    round_starts = _round_starts()
    model = np.ones(args.elements, np.float32)
    coll = comm.wait_avoiding_group_allreduce(model.copy(), args.group_size,
                                              sync_every=1 << 30, activation=args.activation)
    injector = make_injector(args.imbalance, world.size) if args.imbalance else None
    rounds: list[dict[str, Any]] = []
    started = (0.0, 0.0)
    for t in range(args.warmup + args.steps):
        if t == args.warmup:
            world.Barrier()
            started = (time.perf_counter(), time.process_time())
        events.append([])  # before the barrier: a peer's token may start our round
        if injector is None:
            world.Barrier()     # before our own step does
        else:
            time.sleep(args.compute)
            injector.sleep(world.rank, t)
        events[-1].append(("call", time.monotonic()))
        info = coll.step(model)
        events[-1].append(("return", time.monotonic()))
        first_here = info.activator == world.rank and info.staleness == 0
        if t >= args.warmup and (injector is None or first_here):
            first: dict[str, Any] = {}
            for name, stamp in events[-1]:
                first.setdefault(name, stamp)
            first["round"], first["group"] = info.round, info.group
            rounds.append(first)
    wall, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
    coll.close()
    everyone = world.gather(rounds)
    starts_everywhere = world.gather(round_starts)
    rates = world.gather((wall, cpu))
    cores = job_cores(world)
    if world.rank == 0:
        spans = {
            "step call -> round starts on this rank": ("call", "start"),
            "round start -> data exchanged": ("start", "exchanged"),
            "data exchanged -> result delivered": ("exchanged", "delivered"),
            "  of which the fused average (finalize)": ("finalize", "finalized"),
            "result delivered -> step returns": ("delivered", "return"),
            "step call -> step returns": ("call", "return"),
        }
        how = ("after a barrier each" if injector is None else
               f"of {1e3 * args.compute:g} ms + injector {args.imbalance}, rounds "
               f"this rank started")
        print(f"# wait-avoiding group round, {world.size} ranks on "
              f"{cores} cores, group {args.group_size}, "
              f"{args.activation} activation, {args.elements} float32, {args.steps} "
              f"steps {how} (medians over steps and ranks; a rank that started late "
              f"may see its round start before its call: negative)")
        for label, (a, b) in spans.items():
            values = [r[b] - r[a] for ranks in everyone for r in ranks if a in r and b in r]
            if values:
                print(f"{label:>42}: {statistics.median(values) * 1e6:9.1f} us")
        lags = [max(starts_everywhere[m].get(r["round"], r["start"]) for m in r["group"])
                - r["start"] for ranks in everyone for r in ranks
                if "start" in r and "group" in r]
        if lags and injector is not None:
            print(f"{'round start -> last member starts':>42}: "
                  f"{statistics.median(lags) * 1e6:9.1f} us")
        starts = []  # per step: last minus first start over ranks
        for k in range(len(everyone[0]) if injector is None else 0):
            firsts = [ranks[k]["start"] for ranks in everyone if "start" in ranks[k]]
            if len(firsts) == len(everyone):
                starts.append(max(firsts) - min(firsts))
        if starts and injector is None:
            print(f"{'spread of round starts over ranks':>42}: "
                  f"{statistics.median(starts) * 1e6:9.1f} us")
        waits = [r["return"] - r["call"] for ranks in everyone for r in ranks]
        if waits:
            print(f"{'mean step call -> return':>42}: "
                  f"{statistics.fmean(waits) * 1e6:9.1f} us over {len(waits)} rounds")
        print(f"{'iterations/s (slowest rank)':>42}: "
              f"{args.steps / max(w for w, _ in rates):9.1f}")
        print(f"{'CPU time / wall time per rank':>42}: "
              f"{statistics.fmean(c / w for w, c in rates):9.2f}")
    comm.close()


if __name__ == "__main__":
    run_or_abort(main)
