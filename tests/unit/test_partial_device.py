"""The host-side pieces of the GPU path of the partial collectives
(wagma_comm/partial/device.py) that need no GPU: which NCCL communicators a
collective makes, in which order, and the bounded wait on a stream."""

from __future__ import annotations

import time

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
