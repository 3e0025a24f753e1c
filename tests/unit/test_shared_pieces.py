"""How the shared-memory exchange cuts a reduction (runtime/shared.py), in one
process: the shares of a piece, when a piece is split, and the default limit
of ``algorithm=None``. The exchange itself runs under MPI
(tests/mpi/test_shared.py)."""

from __future__ import annotations

import pytest

from wagma_comm import dtypes
from wagma_comm.errors import InvalidArgumentError
from wagma_comm.runtime import shared


@pytest.mark.parametrize("length", [8 * 32, 1000, 4096 + 17, 262144])
@pytest.mark.parametrize("members", [2, 3, 8])
@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_shares_cover_the_piece_on_cache_lines(length: int, members: int, itemsize: int) -> None:
    bounds = shared.split_bounds(length, members, itemsize)
    assert bounds[0] == 0 and bounds[-1] == length and len(bounds) == members + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))  # none empty, in order
    assert all((b * itemsize) % 64 == 0 for b in bounds[:-1])  # no shared cache line
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert max(sizes) - min(sizes) <= 2 * 64 // itemsize  # as equal as lines allow


def _call(members: int, count: int) -> shared.SharedCall:
    return shared.SharedCall("allreduce", tuple(range(members)), count, dtypes.FLOAT32, "sum",
                             "")


def test_a_piece_is_split_once_its_rows_add_up() -> None:
    limit = shared.SPLIT_MIN_BYTES // 4  # float32 elements of all rows together
    assert not shared.splits(_call(8, 1), limit // 8 - 1)
    assert shared.splits(_call(8, 1), limit // 8)
    assert shared.splits(_call(2, 1), limit // 2)
    assert not shared.splits(_call(1, 1), 10 * limit)  # alone: nothing to share
    assert not shared.splits(_call(10**5, 1), 16)  # not a cache line per member


def test_the_default_limit_follows_cores_and_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(shared.MAX_BYTES_VARIABLE, raising=False)
    monkeypatch.setattr(shared.os, "cpu_count", lambda: 2)
    assert shared.default_max_bytes(2) == shared.DEFAULT_MAX_BYTES
    assert shared.default_max_bytes(3) == shared.OVERSUBSCRIBED_MAX_BYTES
    monkeypatch.setenv(shared.MAX_BYTES_VARIABLE, "4096")
    assert shared.default_max_bytes(8) == 4096
    for bad in ("-1", "lots"):
        monkeypatch.setenv(shared.MAX_BYTES_VARIABLE, bad)
        with pytest.raises(InvalidArgumentError) as info:
            shared.default_max_bytes(2)
        assert info.value.argument == shared.MAX_BYTES_VARIABLE
