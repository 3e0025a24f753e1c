"""wagma_comm.files: result files are whole or absent, and strict JSON."""

from __future__ import annotations

import json
import math
import os

import pytest

from wagma_comm.files import finite_or_null, write_atomically, write_json


def _strict(text: str) -> object:
    def refuse(constant: str) -> None:
        raise AssertionError(f"non-strict JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_written_as_null(tmp_path) -> None:
    import numpy as np

    path = str(tmp_path / "sub" / "out.json")
    payload = {"rate": math.inf, "nested": [1.5, -math.inf, (math.nan, 2)],
               "np": np.float64("inf"), "ok": {"x": 3, "s": "inf"}}
    write_json(path, payload)
    with open(path) as fh:
        assert _strict(fh.read()) == {"rate": None, "nested": [1.5, None, [None, 2]],
                                      "np": None, "ok": {"x": 3, "s": "inf"}}
    assert payload["rate"] == math.inf  # the caller's payload is left as it was


def test_finite_or_null_keeps_finite_values_and_types() -> None:
    assert finite_or_null({"a": [0.0, 1, True, None, "x"]}) == {"a": [0.0, 1, True, None, "x"]}


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path) -> None:
    path = str(tmp_path / "out.json")
    write_json(path, {"v": 1})
    with pytest.raises(TypeError):
        write_json(path, {"v": object()})  # not serialisable: fails before any write

    def half_then_full(tmp: str) -> None:
        with open(tmp, "w") as fh:
            fh.write("{\"v\": ")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, half_then_full)
    with open(path) as fh:
        assert json.load(fh) == {"v": 1}
    assert os.listdir(tmp_path) == ["out.json"]
