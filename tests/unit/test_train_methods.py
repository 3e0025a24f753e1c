"""Method registry, knob validation and peer rules (no MPI)."""

from __future__ import annotations

import pytest

from wagma_comm import InvalidArgumentError
from wagma_comm.train import METHODS, default_group_size, make_method
from wagma_comm.train.methods import GRADIENTS, MODEL, ring_neighbours, sgp_peers
from wagma_comm.train.methods.averaging import LocalSGD, WagmaSGD


def test_every_method_by_name_averages_what_the_paper_says() -> None:
    kinds = {m: make_method(m).averages for m in METHODS}
    assert kinds == {"allreduce": GRADIENTS, "local_sgd": MODEL, "dpsgd": MODEL,
                     "sgp": MODEL, "solo": GRADIENTS, "majority": GRADIENTS,
                     "wagma": MODEL, "ad_psgd": MODEL}
    assert all(make_method(m).name == m for m in METHODS)


def test_wagma_defaults_to_the_papers_normalisation_however_it_is_made() -> None:
    """ALGORITHMS.md s. 2: the own model's weight 2/(S+1) is the default and
    the plain mean the documented other, for make_method's knobs and the
    exported WagmaSGD class alike (the wrappers pass make_method's knob, so
    the class's own default differing from it passed test_train.py)."""
    assert WagmaSGD().normalization == make_method("wagma").normalization == "wagma"
    assert WagmaSGD(normalization="mean").normalization == "mean"
    assert make_method("wagma", normalization="mean").normalization == "mean"


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


def test_describe_shows_every_knob_that_changes_the_results() -> None:
    """describe() is what the set-up compares across ranks (placement.py):
    majority's seed, WAGMA's normalization and grace were left out, so ranks
    that passed different ones were not refused (different seeds draw
    different activators; different normalizations mix models differently)."""
    base = {"wagma": {}, "majority": {}, "local_sgd": {}, "solo": {}}
    changed = [("majority", {"seed": 3}), ("wagma", {"normalization": "mean"}),
               ("wagma", {"grace": 0.25}), ("wagma", {"activation": "group"}),
               ("wagma", {"round_start": "iteration"}), ("wagma", {"group_size": 4}),
               ("wagma", {"sync_every": 5}), ("majority", {"sync_every": 5}),
               ("solo", {"sync_every": 5}), ("local_sgd", {"sync_every": 5})]
    for name, knobs in changed:
        other = make_method(name, **knobs).describe()
        assert other != make_method(name, **base[name]).describe(), (name, knobs)
    # Knobs a method ignores, and equal values spelt differently, describe alike.
    assert make_method("solo", seed=3).describe() == make_method("solo").describe()
    assert make_method("wagma", grace=0).describe() == make_method("wagma", grace=0.0).describe()
    assert "grace 0.5" in make_method("wagma").describe()
    assert "seed 3" in make_method("majority", seed=3).describe()
    assert "mean normalization" in make_method("wagma", normalization="mean").describe()


def test_a_default_group_size_describes_as_the_size_it_stands_for() -> None:
    """describe() said "groups of None" until set-up, so a rank that left
    group_size out and one that passed the same default explicitly were
    refused as running different knobs (the wrappers compare describe()
    after check_size(), before set-up)."""
    implicit, explicit = make_method("wagma"), make_method("wagma", group_size=2)
    for m in (implicit, explicit):
        m.check_size(4)
    assert implicit.describe() == explicit.describe()
    assert "groups of 2" in implicit.describe()


def test_a_method_never_set_up_refuses_to_communicate_by_name() -> None:
    """start() of a communicating iteration without setup() failed with a
    bare AttributeError (no communicator), or, after close(), an IndexError
    from finish(); a local step still needs no set-up."""
    import numpy as np

    from wagma_comm import CommunicatorClosedError

    for name in ("allreduce", "wagma", "solo", "dpsgd", "local_sgd"):
        m = make_method(name, sync_every=1)
        with pytest.raises(CommunicatorClosedError, match=f"{name}: start.. needs setup"):
            m.start(0, [np.ones(2, np.float32)])
        assert not m.in_flight
        with pytest.raises(CommunicatorClosedError, match="finalize.. needs setup"):
            m.finalize([np.ones(2, np.float32)])
    m = LocalSGD(4)
    m.start(0, [])  # a local step
    assert m.finish().averaged is None
