"""The pure logic of ``wagma bench``: the result check's inputs and the
summaries' verdicts (no MPI needed)."""

from __future__ import annotations

import numpy as np

from wagma_comm import dtypes, groups
from wagma_comm.bench import check

F32 = dtypes.lookup("float32")


def _wrong(got: np.ndarray, want: np.ndarray) -> int:
    return check.count_wrong(got.astype(np.float32), F32, want)


def test_check_tells_every_rank_of_eight_apart() -> None:
    """Ranks r and r+4 had the same input: at 8 ranks (the documented runs)
    the default group_allreduce's two groups of 4 had the same expected
    result, and rank 0 counted twice with rank 4 dropped summed right."""
    count = 16
    first, second = groups.partition(8, 4, 0)
    assert _wrong(check.expected_result("group_allreduce", second, count, "sum"),
                  check.expected_result("group_allreduce", first, count, "sum")) > 0
    duplicated = [0, 1, 2, 3, 0, 5, 6, 7]
    assert _wrong(check.expected_result("allreduce", duplicated, count, "sum"),
                  check.expected_result("allreduce", range(8), count, "sum")) > 0
    assert _wrong(check.expected_result("broadcast", range(8), count, "sum", root=4),
                  check.expected_result("broadcast", range(8), count, "sum", root=0)) > 0
    for a in range(64):  # any two ranks differ in a buffer of 4 elements
        for b in range(a + 1, 64):
            assert not np.array_equal(check.pattern(a, 4, F32), check.pattern(b, 4, F32))


def test_check_inputs_stay_exact_in_every_dtype() -> None:
    """Small integers in [1, 6] whose sums over 8 ranks fit uint8 and are
    exact in bfloat16, so the check needs no tolerance for sums."""
    for rank in range(256):
        values = check.pattern(rank, 48, F32)
        assert values.min() >= 1 and values.max() <= 6
    total = check.expected_result("allreduce", range(8), 48, "sum")
    assert total.max() <= 255
    for row in dtypes.ALL:
        for rank in range(8):
            got = check.pattern(rank, 48, row).view(row.storage)
            assert check.count_wrong(got, row, check.pattern(rank, 48, F32)
                                     .astype(np.float64)) == 0


def _overlap_row(impl: str, wrong: int) -> dict:
    return {"impl": impl, "nbytes": 16 << 20, "overlap_pct": 50.0 if impl == "wagma" else 0.0,
            "wrong": wrong}


def test_overlap_summary_judges_the_checked_results() -> None:
    """`wagma bench overlap` printed the overlap target's PASS and nothing
    else, even when the overlapped allreduce had wrong elements (#wrong)."""
    from wagma_comm.bench import report

    bad = report.overlap_summary([_overlap_row("wagma", 7), _overlap_row("mpi", 0)])
    assert "results checked: 7 wrong elements in 2 checked results  FAIL" in bad
    good = report.overlap_summary([_overlap_row("wagma", 0), _overlap_row("mpi", 0)])
    assert "results checked: 0 wrong elements in 2 checked results  PASS" in good
    unchecked = report.overlap_summary([_overlap_row("wagma", -1)])
    assert "results not checked" in unchecked and "FAIL" not in unchecked
