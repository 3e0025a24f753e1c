"""The SlowNode injector: one node's ranks pay a fixed delay at every step."""

from __future__ import annotations

import numpy as np
import pytest

from wagma_comm.errors import InvalidArgumentError
from wagma_comm.imbalance import (
    SlowNode,
    expected_period_time,
    expected_step_time_blocking,
    iterations_per_second_blocking,
    iterations_per_second_wait_avoiding,
    make_injector,
)


def test_delay_pattern_every_step() -> None:
    inj = SlowNode(10, 0.25, ranks_per_node=4, node=1)
    want = [0.0] * 4 + [0.25] * 4 + [0.0] * 2
    for step in (0, 1, 7, 10**6):
        assert inj.delays(step).tolist() == want
        assert [inj.delay(r, step) for r in range(10)] == want
    # the last node may be partial: ranks 8 and 9 of 10
    last = SlowNode(10, 0.5, ranks_per_node=4, node=2)
    assert last.delays(3).tolist() == [0.0] * 8 + [0.5] * 2
    # defaults: 8 ranks per node, node 0
    default = SlowNode(20, 0.1)
    assert np.flatnonzero(default.delays(0)).tolist() == list(range(8))
    assert (default.ranks_per_node, default.node) == (8, 0)
    # one node holding every rank
    assert SlowNode(3, 0.2).delays(0).tolist() == [0.2] * 3


def test_delays_are_fresh_arrays_and_blocks_agree() -> None:
    inj = SlowNode(6, 0.3, ranks_per_node=2, node=2)
    d = inj.delays(0)
    d[:] = 9.0
    assert inj.delays(0).tolist() == [0, 0, 0, 0, 0.3, 0.3]
    block = inj._delays_block(5, 4)
    assert block.shape == (4, 6)
    for k in range(4):
        assert block[k].tolist() == inj.delays(5 + k).tolist()
    block[:] = 1.0
    assert inj._delays_block(5, 1)[0].tolist() == [0, 0, 0, 0, 0.3, 0.3]


def test_zero_delay_and_fast_ranks_do_not_sleep() -> None:
    inj = SlowNode(4, 0.0, ranks_per_node=2)
    assert inj.delays(0).tolist() == [0.0] * 4
    fast = SlowNode(4, 5.0, ranks_per_node=2, node=1)
    assert fast.sleep(0, 3) == 0.0  # rank 0 is on node 0, returns at once


@pytest.mark.parametrize("inj", [
    SlowNode(16, 0.32), SlowNode(10, 0.25, 4, 2), SlowNode(7, 1e-3, 1, 6),
    SlowNode(9, 0.1, 3, 1)])
def test_spec_round_trip(inj: SlowNode) -> None:
    again = make_injector(inj.spec, inj.size)
    assert isinstance(again, SlowNode)
    assert again.spec == inj.spec
    for step in (0, 5):
        assert again.delays(step).tolist() == inj.delays(step).tolist()
    assert repr(inj) == f"SlowNode(size={inj.size}, spec={inj.spec!r})"


def test_make_injector_forms() -> None:
    assert make_injector("slownode:0.5", 16).spec == "slownode:0.5:8:0"
    assert make_injector("slownode:0.5:4", 16).spec == "slownode:0.5:4:0"
    assert make_injector(" SlowNode : 0.5 : 4 : 3 ", 16).spec == "slownode:0.5:4:3"
    assert make_injector("slownode:2:4:3", 16).delays(0).tolist() == [0.0] * 12 + [2.0] * 4
    # the seed does not matter: the same ranks are slow every step
    a, b = make_injector("slownode:0.1:2:1", 6, seed=1), make_injector("slownode:0.1:2:1", 6)
    assert a.delays(4).tolist() == b.delays(4).tolist() == [0, 0, 0.1, 0.1, 0, 0]


def test_node_without_ranks_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="node 2 has no ranks") as e:
        SlowNode(8, 0.1, ranks_per_node=4, node=2)
    assert e.value.argument == "node"
    SlowNode(9, 0.1, ranks_per_node=4, node=2)  # rank 8 is there
    with pytest.raises(InvalidArgumentError, match="no ranks") as e:
        make_injector("slownode:0.1:8:1", 8)
    assert e.value.argument == "imbalance"
    with pytest.raises(InvalidArgumentError) as e:
        make_injector("slownode:0.1:1:8", 8)  # ranks 0..7: node 8 of 1 is past them
    assert e.value.argument == "imbalance"
    assert make_injector("slownode:0.1:1:7", 8).delays(0).tolist() == [0.0] * 7 + [0.1]


@pytest.mark.parametrize("kwargs,argument", [
    (dict(size=0, delay_s=0.1), "size"), (dict(size=4, delay_s=-0.1), "delay_s"),
    (dict(size=4, delay_s=float("nan")), "delay_s"), (dict(size=4, delay_s=float("inf")),
                                                      "delay_s"),
    (dict(size=4, delay_s=0.1, ranks_per_node=0), "ranks_per_node"),
    (dict(size=4, delay_s=0.1, ranks_per_node=True), "ranks_per_node"),
    (dict(size=4, delay_s=0.1, node=-1), "node"), (dict(size=4, delay_s=0.1, node=1.0), "node")])
def test_constructor_rejects_bad_arguments(kwargs, argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        SlowNode(**kwargs)
    assert e.value.argument == argument


@pytest.mark.parametrize("spec", [
    "slownode", "slownode:", "slownode:x", "slownode:0.1:y", "slownode:0.1:2:z",
    "slownode:0.1:2:0:5", "slownode:-1", "slownode:0.1:0", "slownode:0.1:2.5"])
def test_bad_specs(spec: str) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        make_injector(spec, 8)
    assert e.value.argument == "imbalance"


def test_expected_times_by_hand() -> None:
    """The slow node is slow every step: a blocking method pays the delay every
    step, a wait-avoiding one too (its period's maximum is S delays)."""
    inj = SlowNode(16, 0.2, ranks_per_node=4, node=3)
    assert expected_step_time_blocking(inj, 0.05, steps=50) == pytest.approx(0.25)
    assert expected_period_time(inj, 0.05, 5, periods=10) == pytest.approx(5 * 0.25)
    assert iterations_per_second_blocking(inj, 0.05, steps=10) == pytest.approx(4.0)
    assert iterations_per_second_wait_avoiding(inj, 0.05, 5, periods=3) == pytest.approx(4.0)
