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

It wraps private methods of ``wagma_comm.partial`` to take the timestamps: a
measurement, not part of the runtime (bench/results/round-probe-8.txt).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import wagma_comm
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--elements", type=int, default=4096, help="float32 model elements")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = wagma_comm.init(timeout=120)
    events: list[Events] = [[]]
    _timed(base.PartialCollective, "_start_round", "start", None, events)
    _timed(base.PartialCollective, "_round_done", "exchanged", None, events)
    _timed(base.PartialCollective, "_deliver", "deliver", "delivered", events)
    _timed(wagma.WaitAvoidingGroupAllreduce, "_finalize", "finalize", "finalized", events)
    model = np.ones(args.elements, np.float32)
    coll = comm.wait_avoiding_group_allreduce(model.copy(), args.group_size,
                                              sync_every=1 << 30, activation="group")
    rounds: list[dict[str, float]] = []
    for t in range(args.warmup + args.steps):
        events.append([])  # before the barrier: a peer's token may start our round
        world.Barrier()     # before our own step does
        events[-1].append(("call", time.monotonic()))
        coll.step(model)
        events[-1].append(("return", time.monotonic()))
        if t >= args.warmup:
            first: dict[str, float] = {}
            for name, stamp in events[-1]:
                first.setdefault(name, stamp)
            rounds.append(first)
    coll.close()
    everyone = world.gather(rounds)
    if world.rank == 0:
        spans = {
            "step call -> round starts on this rank": ("call", "start"),
            "round start -> data exchanged": ("start", "exchanged"),
            "data exchanged -> result delivered": ("exchanged", "delivered"),
            "  of which the fused average (finalize)": ("finalize", "finalized"),
            "result delivered -> step returns": ("delivered", "return"),
            "step call -> step returns": ("call", "return"),
        }
        print(f"# wait-avoiding group round, {world.size} ranks on "
              f"{len(os.sched_getaffinity(0))} cores, group {args.group_size}, "
              f"{args.elements} float32, {args.steps} steps after a barrier each "
              f"(medians over steps and ranks; a rank that started late may see "
              f"its round start before its call: negative)")
        for label, (a, b) in spans.items():
            values = [r[b] - r[a] for ranks in everyone for r in ranks if a in r and b in r]
            if values:
                print(f"{label:>42}: {statistics.median(values) * 1e6:9.1f} us")
        starts = []  # per step: last minus first start over ranks
        for k in range(len(everyone[0])):
            firsts = [ranks[k]["start"] for ranks in everyone if "start" in ranks[k]]
            if len(firsts) == len(everyone):
                starts.append(max(firsts) - min(firsts))
        if starts:
            print(f"{'spread of round starts over ranks':>42}: "
                  f"{statistics.median(starts) * 1e6:9.1f} us")
    comm.close()


if __name__ == "__main__":
    main()
