"""The host-side pieces of the GPU path of the partial collectives
(wagma_comm/partial/device.py) that need no GPU: which NCCL communicators a
collective makes, in which order, the bounded wait on a stream, and whom a
failed round names."""

from __future__ import annotations

import time
from typing import Sequence

import pytest

from wagma_comm import groups
from wagma_comm.partial.device import distinct_groups, wait_stream


@pytest.mark.parametrize("size,group_size", [(1, 1), (2, 2), (4, 2), (6, 4), (8, 2), (9, 3)])
def test_every_group_once_in_one_order_for_all_ranks(size: int, group_size: int) -> None:
    everyone = (tuple(range(size)),)
    partitions = [everyone] + [groups.partition(size, group_size, s)
                               for s in range(groups.num_steps(size, group_size))]
    made = distinct_groups(partitions)
    assert len(made) == len(set(made))
    assert all(len(g) > 1 for g in made)  # a group of one needs no communicator
    wanted = {tuple(g) for p in partitions for g in p if len(g) > 1}
    assert set(made) == wanted
    # Deadlock freedom of making them one by one: each rank makes its groups
    # in the global order, so the first group not yet made has all its
    # members at it. Simulate: repeatedly make the lowest group whose members
    # all have it next.
    todo = {r: [g for g in made if r in g] for r in range(size)}
    done: set[tuple[int, ...]] = set()
    while any(todo.values()):
        ready = [g for g in made if g not in done and all(todo[m] and todo[m][0] == g
                                                          for m in g)]
        assert ready, f"stuck with {todo}"
        for m in ready[0]:
            todo[m].pop(0)
        done.add(ready[0])


def test_the_world_group_comes_first_and_is_shared() -> None:
    partitions = [((0, 1, 2, 3),), ((0, 1, 2, 3),), ((0, 1), (2, 3))]
    assert distinct_groups(partitions) == [(0, 1, 2, 3), (0, 1), (2, 3)]


class _Stream:
    def __init__(self, done_after: float) -> None:
        self._at = time.monotonic() + done_after

    @property
    def done(self) -> bool:
        return time.monotonic() >= self._at


def test_wait_stream_returns_when_done_and_raises_at_the_deadline() -> None:
    wait_stream(_Stream(0.01), time.monotonic() + 5, "work")
    with pytest.raises(TimeoutError, match="still running"):
        wait_stream(_Stream(60), time.monotonic() + 0.05, "work")


def test_a_death_behind_an_nccl_error_is_looked_for_within_the_grace() -> None:
    """NCCL may report a killed member's closed socket before its process is
    reaped: the liveness answer is asked again until the grace ends."""
    from wagma_comm.runtime.gpu import dead_elsewhere, dead_within, timeout_blame

    asked: list[float] = []

    def reaped_on_third_look(members: Sequence[int]) -> list[int]:
        asked.append(time.monotonic())
        return [2] if len(asked) >= 3 and 2 in members else []

    assert dead_within(reaped_on_third_look, [1, 2], grace=5.0) == [2]
    assert len(asked) == 3 and asked[-1] - asked[0] < 1.0
    started = time.monotonic()
    assert dead_within(lambda members: [], [1, 2], grace=0.1) == []
    assert 0.1 <= time.monotonic() - started < 1.0
    # a cascade: the round's group lost member 3, which left after rank 2 died
    gone = {2, 3}

    def dead(members: Sequence[int]) -> list[int]:
        return sorted(gone & set(members))

    note = dead_elsewhere(dead, (1, 3), range(4))
    assert note.startswith("; ranks [2], outside this group, are dead")
    assert dead_elsewhere(dead, (2, 3), range(4)) == ""
    assert timeout_blame(dead, (1, 3), 1, range(4)) == ([3], "these members' processes are "
                                                        "gone" + note)
    blamed, why = timeout_blame(None, (0, 1, 3), 1, range(4))
    assert blamed == [0, 3] and "NCCL does not say which members arrived" in why


def _gpu_works(deadlines: Sequence[float]) -> list:
    """Real GpuWork records (real schedules and handles, no GPU needed) of
    allreduce rounds 4, 5, ... with the given deadlines."""
    from wagma_comm import dtypes
    from wagma_comm.runtime.gpu import GpuWork, plan
    from wagma_comm.runtime.handle import Handle

    scheds, waves = plan("allreduce", (0, 1), 8, "sum", "native", -1)
    return [GpuWork(4 + i, "allreduce", Handle("allreduce", 4 + i, d, lambda: True),
                    scheds[0], waves[0], 0, dtypes.FLOAT32, None, d, 1.0, None, None)
            for i, d in enumerate(deadlines)]


def test_a_gpu_failure_goes_to_the_collective_it_is_about() -> None:
    """The GPU path breaking at round 5 (say its group communicator's set-up
    timed out) while round 4 is in flight: round 5 gets the error naming it,
    round 4 and the queued round 6 a CommunicatorClosedError (round 4 used to
    get round 5's timeout, and round 5 "not run ... at an earlier collective")."""
    from wagma_comm.errors import CollectiveTimeoutError, CommunicatorClosedError
    from wagma_comm.runtime.gpu import failure_errors

    works = _gpu_works([time.monotonic() + 60] * 3)
    error = CollectiveTimeoutError("allreduce", 5, [1], "GPU collective NCCL ... deadline")
    got = failure_errors(works, error, works[1])
    assert got[1] is error
    for k in (0, 2):
        assert isinstance(got[k], CommunicatorClosedError), got[k]
        assert f"(round {4 + k})" in str(got[k]) and "(round 5)" in str(got[k])
        assert "earlier" not in str(got[k])
    # Not about one collective (the engine closed): the first in flight leads.
    assert failure_errors(works, error, None)[0] is error


def test_a_shorter_deadline_behind_a_slower_gpu_collective_is_enforced() -> None:
    """Each call has its own timeout: round 5 (deadline passed) queued on the
    stream behind round 4 (deadline far ahead) must fail now, not when round
    4's deadline passes (only the oldest's deadline used to be checked)."""
    from wagma_comm.runtime.gpu import overdue

    now = time.monotonic()
    works = _gpu_works([now + 100, now - 1, now - 0.5])
    assert overdue(works, now) is works[1]
    assert overdue(works[:1], now) is None
    assert overdue([], now) is None
