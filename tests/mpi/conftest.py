"""Size-agnostic MPI tests: the same file passes at 1, 2, 3, 4 and 8 ranks.

A failed test on any rank prints its report to stderr (prefixed with the rank)
and aborts the MPI job: the other ranks would otherwise block in the next
collective until its timeout.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Iterator

import numpy as np
import pytest
from mpi4py import MPI

import wagma_comm

# Short deadline: a test that hangs fails within seconds, not minutes.
TEST_TIMEOUT_S = 60.0

# Tests that wait out deadlines or race threads, whose subject does not change
# with the rank count beyond 4: they run at 2, 3 and 4 ranks and are skipped
# at 8, where each costs the most (8 ranks on 2 cores) and the 8-rank run was
# the longest part of `make test` (session 47: 370 s of 1305).
up_to_4_ranks = pytest.mark.skipif(
    MPI.COMM_WORLD.Get_size() > 4,
    reason="a deadline or thread test, independent of the rank count: run at 2-4 ranks")
# The same for tests whose subject does not depend on the group's shape either
# (no schedule is involved: a thread racing a wait, a peer that never comes):
# they run at 1, 2 and 4 ranks.
not_at_3_or_8_ranks = pytest.mark.skipif(
    MPI.COMM_WORLD.Get_size() in (3, 8),
    reason="a deadline or thread test, independent of the rank count and group shape: "
           "run at 1, 2 and 4 ranks")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"\n[rank {rank}] FAILED {report.nodeid} ({report.when})\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture(scope="session")
def comm() -> Iterator[wagma_comm.Communicator]:
    c = wagma_comm.init(timeout=TEST_TIMEOUT_S)
    yield c
    c.close()


@contextlib.contextmanager
def message_path() -> Iterator[None]:
    """Communicators made inside have no shared-memory segment (as across
    hosts, or with ``WAGMA_SHM=0``), so small reductions take the message
    path (runtime/inline.py) by default. Every rank enters it alike."""
    with env_set("WAGMA_SHM", "0"):
        yield


@contextlib.contextmanager
def env_set(name: str, value: str) -> Iterator[None]:
    """The environment variable ``name`` is ``value`` inside (communicators
    read theirs at init), as it was afterwards."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


@pytest.fixture(scope="module")
def message_comm() -> Iterator[wagma_comm.Communicator]:
    """A communicator whose small reductions take the message path, for the
    modules that test that path's inline and straight runs (they override
    ``comm`` with it, autouse). Until the module ends every communicator made
    has no shared-memory segment, their own too."""
    with message_path():
        c = wagma_comm.init(timeout=TEST_TIMEOUT_S)
        yield c
    c.close()


@pytest.fixture(autouse=True)
def _in_step(comm: wagma_comm.Communicator) -> Iterator[None]:
    """Start every test together so one slow test setup cannot eat into the
    next test's collective deadlines."""
    comm.barrier()
    yield


@pytest.fixture
def shared(comm: wagma_comm.Communicator) -> wagma_comm.Communicator:
    """``comm``, where it has the segment (every rank on one host, x86-64)."""
    if MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip("one rank has nothing to exchange (no segment is made)")
    if comm._shared is None:
        pytest.skip("no shared-memory segment on this machine")
    return comm


def posted(comm: wagma_comm.Communicator) -> int:
    """Calls this rank posted to the shared-memory exchange so far."""
    return int(comm.statistics()["shared_memory_calls"])


@contextlib.contextmanager
def own_communicator(timeout: float, why: str) -> Iterator[wagma_comm.Communicator]:
    """A communicator of the test's own (it will be broken or closed early),
    closed on every rank after a barrier; skipped (``why``) on one rank, or
    where it has no segment."""
    if MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip(why)
    c = wagma_comm.init(timeout=timeout)
    try:
        if c._shared is None:
            pytest.skip("no shared-memory segment on this machine")
        yield c
    finally:
        MPI.COMM_WORLD.Barrier()
        c.close()


def step_into_a_missing_sync_round(w: object, slow: int) -> None:
    """Ranks other than ``slow`` (which never steps): two group rounds go
    ahead without it, and the sync round (round 2 of ``sync_every=3``) fails
    with a timeout naming it; the collective is broken afterwards and is
    released locally. Either path of the wait-avoiding group allreduce."""
    model = np.zeros(2)
    w.step(model)
    w.step(model)
    with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
        w.step(model)
    err = info.value
    assert err.collective == "wait_avoiding_group_allreduce" and err.round == 2
    assert err.ranks == (slow,)
    assert str(err).count("ranks:") == 1, str(err)  # a renamed error kept one list
    with pytest.raises(wagma_comm.CommunicatorClosedError, match="broken"):
        w.step(model)
    w.close()


def wagma_rounds_follow(first_round: int, w: object, steps: int,
                        group_size: int) -> list[object]:
    """Step ``w`` (a wait-avoiding group allreduce created with
    ``first_round``) ``steps`` times on every rank together; check that each
    round applied is round first_round + r of the rules: synchronous exactly
    at those rounds, else the shifting group of that round. Returns the
    RoundInfos."""
    from wagma_comm.runtime.activation import group_step, is_sync_round

    comm = w._comm  # type: ignore[attr-defined]
    sync_every = w.sync_every  # type: ignore[attr-defined]
    infos = []
    for _ in range(steps):
        model = np.full(4, comm.rank, np.float32)
        info = w.step(model)  # type: ignore[attr-defined]
        absolute = first_round + info.round
        assert info.synchronized == is_sync_round(absolute, sync_every), info
        if not info.synchronized:
            assert info.step == group_step(absolute, sync_every), info
            assert info.group == tuple(comm.group_of(group_size, info.step)), info
        else:  # a global mean: the same everywhere
            assert np.all(model == np.float32(sum(range(comm.size)) / comm.size))
        infos.append(info)
    assert any(i.synchronized for i in infos) and not all(i.synchronized for i in infos)
    return infos


def mismatched_creations_are_refused(comm: wagma_comm.Communicator, make: object,
                                     what: str) -> None:
    """``make(differs)`` creates a partial collective; rank 0 passes True, so
    its ``what`` differs. Every rank must get MismatchError at creation,
    naming the ranks whose creation differs from its own, and the
    communicator stays usable."""
    rank, size = comm.rank, comm.size
    with pytest.raises(wagma_comm.MismatchError) as info:
        make(rank == 0)  # type: ignore[operator]
    assert sorted(info.value.ranks) == ([0] if rank else list(range(1, size)))
    assert what in str(info.value)
    ones = np.ones(2, np.float64)
    comm.allreduce(ones)
    assert np.all(ones == size)


FINAL_CALLS = {
    "close": ("close()", lambda w: w.close()),
    "flush": ("flush() without a round", lambda w: w.flush()),
    "flush(buf)": ("flush() with a round", lambda w: w.flush(np.ones(4))),
}


def mismatched_final_calls_are_named(comm: wagma_comm.Communicator, make: object,
                                     rank0: str, others: str, steps: tuple[int, int] = (1, 1)
                                     ) -> None:
    """``make()`` creates a partial collective of 4 float64; rank 0 takes
    ``steps[0]`` steps and ends with ``rank0``, the others take ``steps[1]``
    and end with ``others`` (keys of FINAL_CALLS). Every rank must get
    MismatchError from that call naming the ranks that differ and what they
    called (not a timeout in a round only some of them run), the collective
    is then released locally, and the communicator stays usable."""
    rank, size = comm.rank, comm.size
    w = make()  # type: ignore[operator]
    for _ in range(steps[0] if rank == 0 else steps[1]):
        w.step(np.zeros(4))
    name, call = FINAL_CALLS[rank0 if rank == 0 else others]
    started = time.monotonic()
    with pytest.raises(wagma_comm.MismatchError) as info:
        call(w)
    assert time.monotonic() - started < 0.5 * TEST_TIMEOUT_S  # named, not timed out
    assert sorted(info.value.ranks) == ([0] if rank else list(range(1, size)))
    theirs = FINAL_CALLS[others if rank == 0 else rank0][0]
    mine_steps, their_steps = (steps[0], steps[1]) if rank == 0 else (steps[1], steps[0])
    assert f"{theirs} after {their_steps} steps" in str(info.value), info.value
    assert f"{name} after {mine_steps} steps" in str(info.value), info.value
    w.close()  # broken: released here
    ones = np.ones(2, np.float64)
    comm.allreduce(ones)
    assert np.all(ones == size)
