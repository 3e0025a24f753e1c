"""Result files the command-line tools write (``--json`` of ``wagma bench``,
``wagma bench imbalance``, ``wagma demo``, ``wagma sim`` and cost models).

Two promises: a file is either whole or absent (written beside its path, then
renamed over it, so a full disk never leaves half a file), and a JSON file is
strict JSON. Python's ``json`` writes ``Infinity`` and ``NaN`` by default,
which jq, JavaScript and most other readers refuse; an expected rate with zero
compute time, for one, is infinite. Non-finite numbers are written as
``null``, as the readers here (plots, ``wagma sim --validate``) already read a
missing number.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """``write`` to a temporary file beside ``path``, then rename it over
    ``path`` (its directory is made)."""
    head, tail = os.path.split(os.path.abspath(path))
    os.makedirs(head, exist_ok=True)
    tmp = os.path.join(head, f".{tail}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def finite_or_null(value: Any) -> Any:
    """``value`` with every non-finite float inside (dicts, lists, tuples)
    replaced by None; dict keys are left as they are."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def write_json(path: str, payload: Any) -> None:
    """``payload`` as strict, indented JSON at ``path``, atomically."""
    text = json.dumps(finite_or_null(payload), indent=1, allow_nan=False)

    def dump(tmp: str) -> None:
        with open(tmp, "w") as fh:
            fh.write(text)

    write_atomically(path, dump)


__all__ = ["finite_or_null", "write_atomically", "write_json"]
