"""``publish(buf, ready=True)``: a WAGMA round starts once every member has
published, before anyone steps, and a late member is still never waited for
(any number of ranks).

As in test_partial.py, lateness is ordered with MPI barriers on another
communicator, not timed: if a round waited for a member that has not
published, the test would hang and fail at its timeout.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from conftest import not_at_3_or_8_ranks

import wagma_comm
from wagma_comm import Communicator, InvalidArgumentError
from wagma_comm.train import Averager

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
SLOW = SIZE - 1


@pytest.fixture(scope="module", autouse=True)
def comm(message_comm: wagma_comm.Communicator) -> wagma_comm.Communicator:
    """Ready starts are the message path's (through shared memory a ready
    publish is an ordinary one: test_shared_wagma.py)."""
    return message_comm


def _wait_round(w: object, round_: int, what: str = "completed",
                limit_s: float = 20.0) -> None:
    """Poll (without stepping) until round ``round_`` started or completed here."""
    give_up = time.monotonic() + limit_s
    while w.statistics()[f"{what}_round"] < round_:  # type: ignore[attr-defined]
        assert time.monotonic() < give_up, f"round {round_} not {what} without a step"
        time.sleep(0.002)


@pytest.mark.parametrize("scope", ["global", "group"])
def test_a_round_every_member_published_runs_before_any_step(
        comm: Communicator, scope: str) -> None:
    """Every rank publishes ready and does not step until its round completed
    here: it ran with nobody arriving and no token sent; the steps then
    return its result at once, every contribution fresh, exact values."""
    steps = 3
    w = comm.wait_avoiding_group_allreduce(np.zeros(4), SIZE, sync_every=steps + 1,
                                           activation=scope, normalization="mean")
    for t in range(steps):
        mine = float(RANK + 10 * t)
        w.publish(np.full(4, mine), ready=True)
        _wait_round(w, t)
        model = np.full(4, mine)
        info = w.step(model)
        assert info.round == t and info.fresh == tuple(range(SIZE)), info
        assert info.activator == RANK  # started here, by its own publish
        # on time: its own ready publish started the round (before session 37,
        # staleness 1: the round had started "without" this step)
        assert info.staleness == 0, info
        expected = sum(float(r + 10 * t) for r in range(SIZE)) / SIZE
        np.testing.assert_array_equal(model, expected)
    stats = w.statistics()
    assert stats["ready_starts"] == steps and stats["tokens_sent"] == 0, stats
    assert stats["activated_here"] == 0 and stats["stale_contributions"] == 0, stats
    assert stats["late_steps"] == 0, stats
    w.close()


@pytest.mark.parametrize("scope", ["global", "group"])
def test_a_member_that_never_published_is_not_waited_for(
        comm: Communicator, scope: str) -> None:
    """The fast ranks publish ready and step; the slow rank publishes and steps
    only after they finished all their steps. Each fast arrival at a round
    started by ready publishes still activates it, so the slow rank's progress
    thread contributes what it has (the initial model, 100) and nothing hangs."""
    if SIZE == 1:
        pytest.skip("needs a slow and a fast rank")
    steps = 4
    w = comm.wait_avoiding_group_allreduce(np.full(2, 100.0), SIZE, sync_every=steps + 1,
                                           activation=scope, normalization="mean")
    if RANK != SLOW:
        for t in range(steps):
            model = np.full(2, float(RANK))
            w.publish(model, ready=True)
            _wait_round(w, t, "started")  # the step comes after the ready start
            info = w.step(model)
            # >= t: a fast peer may run ahead and activate round t + 1 here
            # before this step; a late step then gets that newer round.
            assert info.round >= t and SLOW not in info.fresh, info
            expected = (sum(range(SIZE - 1)) + 100.0) / SIZE
            np.testing.assert_array_equal(model, expected)
    WORLD.Barrier()  # the fast ranks are done
    if RANK == SLOW:
        # The fast ranks' last round may still be finishing here (its last
        # message to this rank can land after they returned, e.g. with a
        # fold); a step before that would rightly get round steps - 2, the
        # latest completed here (CI caught it at 3 ranks).
        _wait_round(w, steps - 1)
        for t in range(steps):
            model = np.full(2, 100.0)
            w.publish(model, ready=True)  # its round ran already: nothing starts
            info = w.step(model)  # the latest round, at once
            assert info.round == steps - 1 and info.staleness >= 1, info
        assert w.statistics()["ready_starts"] == 0
    w.close()


@not_at_3_or_8_ranks
def test_a_round_nobody_steps_into_has_no_deadline_yet(comm: Communicator) -> None:
    """A ready round waits for a member that publishes only after the
    collective's timeout: it does not time out, because nobody waits for it
    yet; once everyone published it runs, all fresh."""
    if SIZE == 1:
        pytest.skip("needs a late member")
    timeout = 1.0
    w = comm.wait_avoiding_group_allreduce(np.zeros(2), SIZE, sync_every=10,
                                           activation="group", normalization="mean",
                                           timeout=timeout)
    if RANK != SLOW:
        w.publish(np.full(2, float(RANK)), ready=True)
    else:
        time.sleep(2.5 * timeout)
        w.publish(np.full(2, float(RANK)), ready=True)
    WORLD.Barrier()  # the slow rank published; nobody has stepped
    _wait_round(w, 0)
    model = np.full(2, float(RANK))
    info = w.step(model)
    assert info.fresh == tuple(range(SIZE)) and w.statistics()["broken"] is None
    np.testing.assert_array_equal(model, sum(range(SIZE)) / SIZE)
    w.close()


def test_sync_rounds_ignore_ready_publishes(comm: Communicator) -> None:
    """A ready publish for a synchronous round starts nothing (those start at
    the steps); the round still gives every rank the global mean."""
    w = comm.wait_avoiding_group_allreduce(np.zeros(3), 1, sync_every=1)
    model = np.full(3, float(RANK))
    w.publish(model, ready=True)
    info = w.step(model)
    assert info.synchronized and info.round == 0
    np.testing.assert_array_equal(model, sum(range(SIZE)) / SIZE)
    assert w.statistics()["ready_starts"] == 0
    w.close()


def test_flush_or_close_before_the_promised_step_is_refused(comm: Communicator) -> None:
    """A ready publish promises a step: flush() or close() before it would
    wait for a round only that step can be sure to finish, so both are
    refused locally (``argument == "ready"``); after the step both work."""
    w = comm.wait_avoiding_group_allreduce(np.zeros(2), SIZE, sync_every=10,
                                           normalization="mean")
    model = np.full(2, float(RANK))
    w.publish(model, ready=True)
    for call in (w.flush, w.close):
        with pytest.raises(InvalidArgumentError) as err:
            call()
        assert err.value.argument == "ready"
    w.step(model)
    np.testing.assert_array_equal(model, sum(range(SIZE)) / SIZE)
    w.flush()
    w.close()


def test_averager_start_then_finalize_keeps_the_promise(comm: Communicator) -> None:
    """The trainer publishes ready in start(); a finalize() or close() with no
    finish() in between steps a copy first, so nothing hangs and the weights
    become the plain global mean, as before ready publishes."""
    params = [np.full(3, float(RANK))]  # different on every rank: no broadcast
    avg = Averager(comm, params, "wagma", group_size=SIZE, sync_every=100, broadcast=False)
    avg.start(params)
    avg.finalize(params)
    np.testing.assert_array_equal(params[0], sum(range(SIZE)) / SIZE)
    avg.close()
    again = Averager(comm, params, "wagma", group_size=SIZE, sync_every=100)
    again.start(params)
    again.close()  # steps a copy: nothing waits for the started round


def test_ready_must_be_a_bool(comm: Communicator) -> None:
    """A truthy ``ready="no"`` promised a step (a later flush() was refused
    over a promise nobody meant); now refused, locally, naming ``ready``."""
    w = comm.wait_avoiding_group_allreduce(np.zeros(3), 1, sync_every=2)
    with pytest.raises(wagma_comm.InvalidArgumentError) as info:
        w.publish(np.zeros(3), ready="no")
    assert info.value.argument == "ready"
    w.flush()  # no promise was made: nothing refused
    w.close()
