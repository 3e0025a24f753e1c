"""Output files that rank 0 writes at the end of a run (``--json``, ``--csv``,
``--plot``), checked before the run: a path rank 0 could not write used to
fail after minutes of measuring or training, and on rank 0 only.

``wagma bench``, ``wagma bench imbalance`` and ``wagma demo`` share these."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..errors import InvalidArgumentError, UnsupportedError
from .plot import check_image_path, check_output_path

# (the argument named in errors, the path or None, its check)
Output = tuple[str, Any, Callable[[Any, str], str]]
# (error class name, argument, message): picklable, so rank 0 can share it
Problem = tuple[str, str, str]


def data_file(argument: str, path: Any) -> Output:
    """A JSON or CSV file: writable, not a directory (its directory is made)."""
    return argument, path, check_output_path


def image_file(argument: str, path: Any) -> Output:
    """A plot: as :func:`data_file`, with an extension matplotlib renders."""
    return argument, path, check_image_path


def output_problem(outputs: Sequence[Output]) -> Problem | None:
    """The first output this process could not write, or None (creates the
    outputs' directories)."""
    for argument, path, check in outputs:
        if not path:
            continue
        try:
            check(path, argument)
        except (InvalidArgumentError, UnsupportedError) as exc:
            return type(exc).__name__, argument, str(exc).removeprefix(f"{exc.argument}: ")
    return None


def raise_output_problem(problem: Problem | None) -> None:
    """Raise ``problem`` as the typed error it was found as."""
    if problem is not None:
        kind, argument, message = problem
        error = UnsupportedError if kind == "UnsupportedError" else InvalidArgumentError
        raise error(argument, message)


def check_outputs(comm: Any, outputs: Sequence[Output]) -> None:
    """Collective: rank 0, the only writer, checks ``outputs``; every rank
    raises the same typed error if it could not write one."""
    from .imbalance import comm_allgather

    raise_output_problem(comm_allgather(comm, output_problem(outputs) if comm.rank == 0
                                        else None)[0])


__all__ = ["Output", "check_outputs", "data_file", "image_file", "output_problem",
           "raise_output_problem"]
