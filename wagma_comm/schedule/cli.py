"""``wagma schedule``: print (and verify) the compiled schedules of one group.

Example: ``wagma schedule --ranks 8 --group-size 4 --step 1 --dot | dot -Tsvg``
shows the allreduce that rank 0's shifting group runs at step 1. The group is
found with :func:`wagma_comm.groups.group_of`; the schedules are checked with
:func:`verify` before printing, and "verified" (or the failure) goes to stderr
so stdout stays a clean JSON/DOT document.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from ..dtypes import OPS
from ..errors import InvalidArgumentError, ScheduleError
from ..groups import check_group_size, check_size, check_step, group_of, radices
from .algorithms import (
    ALLREDUCE_ALGORITHMS,
    BARRIER_ALGORITHMS,
    BROADCAST_ALGORITHMS,
    compile_group,
)
from .export import to_dot, to_json, to_text
from .ir import Schedule
from .verify import verify

ELEMENT_BYTES = 4  # the size the default algorithm choice assumes (float32)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``schedule`` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "schedule", help="print the compiled schedules of one group",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, required=True, metavar="P",
                   help="number of ranks in the job")
    p.add_argument("--group-size", type=int, default=None, metavar="S",
                   help="shifting-group size (default: P, one global group)")
    p.add_argument("--step", type=int, default=0, metavar="N", help="step (default 0)")
    p.add_argument("--count", type=int, default=16, metavar="C",
                   help="elements per buffer (default 16)")
    p.add_argument("--collective", choices=("allreduce", "broadcast", "barrier"),
                   default="allreduce")
    p.add_argument("--op", default="avg", help="reduction for allreduce (default avg)")
    names = sorted(set(ALLREDUCE_ALGORITHMS + BROADCAST_ALGORITHMS + BARRIER_ALGORITHMS))
    p.add_argument("--algorithm", default=None, metavar="NAME",
                   help=f"one of {', '.join(names)} (default: the size-based choice, "
                   f"assuming {ELEMENT_BYTES}-byte elements)")
    p.add_argument("--root", type=int, default=0, metavar="I",
                   help="broadcast root as a position in the group (default 0: its "
                   "first member)")
    p.add_argument("--rank", type=int, default=None, metavar="R",
                   help="print only global rank R's schedule (its group is the one "
                   "shown); default: every member of rank 0's group")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--dot", action="store_true", help="Graphviz DOT output")
    fmt.add_argument("--json", action="store_true", help="JSON output")
    p.set_defaults(func=run)
    return p


def _group(args: argparse.Namespace) -> tuple[int, ...]:
    size = check_size(args.ranks, "--ranks")
    rank = 0 if args.rank is None else args.rank
    if not 0 <= rank < size:
        raise InvalidArgumentError("--rank", f"must be in [0, {size}), got {rank}")
    check_step(args.step, "--step")
    group_size = size if args.group_size is None else args.group_size
    check_group_size(size, group_size, "--group-size")
    # The group shown may be far smaller than S (P=10000, S=5000: radices
    # 5000, 2): bound its width, a digit's radix, before building it.
    digits = radices(size, group_size)
    width = digits[args.step % len(digits)]
    if width > MAX_PRINTED_GROUP:  # each member's schedule is compiled and verified
        raise InvalidArgumentError(
            "--group-size", f"a group of {width} ranks (at step {args.step}) is too many to "
            f"print and verify (at most {MAX_PRINTED_GROUP}); pass a smaller --group-size")
    return group_of(rank, size, group_size, args.step)


# The largest group `wagma schedule` compiles (one schedule per member, each
# verified element by element): a default group of every rank of a huge job
# ran out of memory.
MAX_PRINTED_GROUP = 4096

_ALGORITHMS = {"allreduce": ALLREDUCE_ALGORITHMS, "broadcast": BROADCAST_ALGORITHMS,
               "barrier": BARRIER_ALGORITHMS}


def _check_options(args: argparse.Namespace) -> None:
    """The compiler names its own parameters (``count``, ``op``, ...) in its
    errors; a command-line user must read the flag to fix instead."""
    if args.count < 0:
        raise InvalidArgumentError("--count", f"must be >= 0, got {args.count}")
    if args.collective == "allreduce" and args.op not in OPS:
        raise InvalidArgumentError("--op", f"unknown op {args.op!r}; expected one of {list(OPS)}")
    known = _ALGORITHMS[args.collective]
    if args.algorithm is not None and args.algorithm not in known:
        raise InvalidArgumentError(
            "--algorithm", f"unknown {args.collective} algorithm {args.algorithm!r}; "
            f"expected one of {list(known)}")


def _compile(args: argparse.Namespace, group: tuple[int, ...]) -> tuple[Schedule, ...]:
    _check_options(args)
    root = -1
    if args.collective == "broadcast":
        if not 0 <= args.root < len(group):
            raise InvalidArgumentError(
                "--root", f"position {args.root} is outside the group {list(group)}")
        root = group[args.root]
    op = args.op if args.collective == "allreduce" else ""
    algorithm = args.algorithm
    if algorithm is None and args.collective != "barrier":
        from .algorithms import choose_allreduce, choose_broadcast

        choose = choose_allreduce if args.collective == "allreduce" else choose_broadcast
        algorithm = choose(ELEMENT_BYTES * args.count, len(group))
    return compile_group(args.collective, group, args.count, op, root, algorithm)


def run(args: argparse.Namespace) -> int:
    """Print the schedules; 0 if verified, 1 if verification failed, 2 on bad
    arguments."""
    try:
        group = _group(args)
        schedules = _compile(args, group)
    except InvalidArgumentError as exc:
        print(f"wagma schedule: error: {exc}", file=sys.stderr)
        return 2
    status = 0
    try:
        verify(schedules)
        print("verified", file=sys.stderr)
    except ScheduleError as exc:
        print(f"wagma schedule: verification FAILED: {exc}", file=sys.stderr)
        status = 1
    shown = [s for s in schedules if args.rank is None or s.rank == args.rank]
    render = to_dot if args.dot else to_json if args.json else to_text
    sys.stdout.write(render(shown))
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry: ``python -m wagma_comm.schedule.cli schedule ...``."""
    parser = argparse.ArgumentParser(prog="wagma")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
