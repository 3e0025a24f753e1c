"""The ``wagma`` command: ``wagma schedule`` prints compiled schedules,
``wagma bench`` runs the collective benchmark and ``wagma imbalance`` the
throughput-under-stragglers benchmark (both under mpiexec); ``wagma demo`` trains
a classifier with WAGMA-SGD and its baselines; ``wagma sim`` simulates the
compiled schedules at any scale and ``wagma plan`` picks a group size and sync
period."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from . import demo as demo_cli
    from .bench import cli as bench_cli
    from .bench import imbalance as imbalance_cli
    from .schedule import cli as schedule_cli
    from .sim import cli as sim_cli

    parser = argparse.ArgumentParser(prog="wagma", description=__doc__)
    parser.add_argument("--version", action="version", version=f"wagma_comm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    schedule_cli.add_parser(sub)
    bench_cli.add_parser(sub)
    imbalance_cli.add_parser(sub)
    demo_cli.add_parser(sub)
    sim_cli.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from . import demo as demo_cli
    from .bench import cli as bench_cli
    from .bench import imbalance as imbalance_cli
    from .schedule import cli as schedule_cli
    from .sim import cli as sim_cli

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "imbalance"]:  # `wagma bench imbalance` = `wagma imbalance`
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    commands = {"schedule": schedule_cli.run, "bench": bench_cli.run,
                "imbalance": imbalance_cli.run, "demo": demo_cli.run,
                "sim": sim_cli.run_sim, "plan": sim_cli.run_plan}
    return int(commands[args.command](args) or 0)


def console() -> int:
    """The ``wagma`` script: bad input (InvalidArgumentError, BufferError,
    UnsupportedError, each naming its option) is one line on stderr and exit
    status 2, as argparse's own errors are, not a traceback from every rank."""
    from .errors import BufferError, InvalidArgumentError, UnsupportedError

    try:
        return main()
    except (InvalidArgumentError, BufferError, UnsupportedError) as exc:
        command = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
        print(f"wagma {command}: error: {exc}".replace(" :", ":"), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(console())
