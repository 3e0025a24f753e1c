"""Method registry, knob validation and peer rules (no MPI)."""

from __future__ import annotations

import pytest

from wagma_comm import InvalidArgumentError
from wagma_comm.train import METHODS, default_group_size, make_method
from wagma_comm.train.methods import GRADIENTS, MODEL, ring_neighbours, sgp_peers
from wagma_comm.train.methods.averaging import LocalSGD


def test_every_method_by_name_averages_what_the_paper_says() -> None:
    kinds = {m: make_method(m).averages for m in METHODS}
    assert kinds == {"allreduce": GRADIENTS, "local_sgd": MODEL, "dpsgd": MODEL,
                     "sgp": MODEL, "solo": GRADIENTS, "majority": GRADIENTS,
                     "wagma": MODEL, "ad_psgd": MODEL}
    assert all(make_method(m).name == m for m in METHODS)


def test_bad_knobs_raise_before_any_communication() -> None:
    with pytest.raises(InvalidArgumentError, match="method: unknown method 'sgd'"):
        make_method("sgd")
    with pytest.raises(InvalidArgumentError, match="sync_every"):
        make_method("wagma", sync_every=0)
    with pytest.raises(InvalidArgumentError, match="sync_every"):
        make_method("local_sgd", sync_every=1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="group_size"):
        make_method("wagma", group_size=0)
    with pytest.raises(InvalidArgumentError, match="activation"):
        make_method("wagma", activation="world")
    with pytest.raises(InvalidArgumentError, match="normalization"):
        make_method("wagma", normalization="median")
    with pytest.raises(InvalidArgumentError, match="round_start"):
        make_method("wagma", round_start="backward")
    assert make_method("wagma").round_start == "publish"  # type: ignore[attr-defined]
    m = make_method("wagma", round_start="iteration")
    assert m.round_start == "iteration"  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgumentError, match="seed"):
        make_method("majority", seed=-1)
    for grace in (-0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(InvalidArgumentError, match="grace"):
            make_method("wagma", grace=grace)  # type: ignore[arg-type]
    assert make_method("wagma", grace=0.25).grace == 0.25  # type: ignore[attr-defined]
    assert make_method("ad_psgd").grace == 0.0  # type: ignore[attr-defined]


def test_a_misspelt_knob_or_knobs_for_a_method_instance_are_refused_by_name() -> None:
    """Both reach make_method through Averager/DistributedOptimizer's
    ``**knobs``: a misspelt knob was a bare TypeError, and knobs next to a
    Method instance were ignored silently."""
    with pytest.raises(InvalidArgumentError, match="sync_evry: not a knob") as info:
        make_method("wagma", sync_evry=5)
    assert info.value.argument == "sync_evry"
    with pytest.raises(InvalidArgumentError, match="sync_every: a LocalSGD instance") as info:
        make_method(LocalSGD(4), sync_every=8)
    assert info.value.argument == "sync_every"
    m = LocalSGD(4)
    assert make_method(m) is m


def test_local_sgd_communicates_every_period() -> None:
    m = LocalSGD(4)
    assert [t for t in range(12) if m.communicates(t)] == [3, 7, 11]


def test_start_and_finish_must_alternate() -> None:
    m = make_method("local_sgd", sync_every=5)
    with pytest.raises(InvalidArgumentError, match="no iteration was started"):
        m.finish()
    m.start(0, [])  # a local step: nothing communicated, no communicator needed
    with pytest.raises(InvalidArgumentError, match="started and not finished"):
        m.start(1, [])
    info = m.finish()
    assert info.averaged is None and info.iteration == 0 and info.wait_s == 0.0


def test_checkpoints_of_partial_methods_only_after_sync_rounds() -> None:
    assert make_method("wagma", sync_every=4).checkpoint_error(8) is None
    assert "multiple of sync_every=4" in make_method("solo", sync_every=4).checkpoint_error(6)
    assert make_method("ad_psgd").checkpoint_error(7) is None  # no sync rounds at all
    assert make_method("dpsgd").checkpoint_error(7) is None


@pytest.mark.parametrize("size", range(1, 10))
def test_ring_neighbours_are_distinct_and_symmetric(size: int) -> None:
    for r in range(size):
        n = ring_neighbours(r, size)
        assert r not in n and len(n) == min(2, size - 1)
        assert all(r in ring_neighbours(q, size) for q in n)


@pytest.mark.parametrize("size", range(1, 10))
def test_sgp_peers_pair_up_every_iteration(size: int) -> None:
    for t in range(6):
        peers = [sgp_peers(r, size, t) for r in range(size)]
        if size == 1:
            assert peers == [None]
            continue
        # Whoever r sends to receives from r: one message in, one out, per rank.
        for r, (to, frm) in enumerate(peers):  # type: ignore[misc]
            assert to != r and frm != r and peers[to][1] == r  # type: ignore[index]
        assert sorted(p[0] for p in peers) == list(range(size))  # type: ignore[index]


def test_default_group_size() -> None:
    assert [default_group_size(p) for p in (1, 2, 3, 4, 8, 9, 16, 64, 100)] == \
        [1, 2, 2, 2, 4, 4, 4, 8, 16]


def test_a_gossip_mpi_comm_that_is_no_communicator_is_refused_when_made() -> None:
    """It was refused only at set-up, after the set-up's collectives (and on
    the ranks that passed it only: the others then waited for them)."""
    for name in ("dpsgd", "sgp"):
        with pytest.raises(InvalidArgumentError, match="mpi_comm: expected an mpi4py") as info:
            make_method(name, mpi_comm="world")
        assert info.value.argument == "mpi_comm"
    from mpi4py import MPI

    assert make_method("dpsgd", mpi_comm=MPI.COMM_WORLD).averages == MODEL
