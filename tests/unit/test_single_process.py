"""``wagma_comm.init()`` works in a plain process, without mpiexec (MPI
singleton start), and the CLI entry point runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def test_init_without_mpiexec() -> None:
    code = textwrap.dedent("""
        import numpy as np, torch, wagma_comm
        with wagma_comm.init(timeout=30) as comm:
            assert (comm.rank, comm.size) == (0, 1)
            a = np.arange(5, dtype=np.float32)
            assert comm.allreduce(a, "avg") is a and a.tolist() == [0, 1, 2, 3, 4]
            t = torch.ones(3, dtype=torch.bfloat16)
            h = comm.group_allreduce(t, 1, 0, async_op=True)
            assert h.wait() is t and bool((t == 1).all())
            comm.broadcast(a, root=0)
            comm.barrier()
            assert comm.groups(1, 0) == [[0]]
            assert comm.statistics()["failed"] == 0
        print("single-process ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "single-process ok" in out.stdout


def test_wagma_schedule_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "wagma_comm.cli", "schedule", "--ranks", "8",
         "--group-size", "4", "--step", "1", "--dot"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("digraph") and "r4" in out.stdout
    assert "verified" in out.stderr


def test_bad_init_arguments_and_environment_are_refused_naming_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad WAGMA_TIMEOUT was a bare ValueError (or blamed ``timeout``,
    which nobody passed), and ``debug="yes"`` was taken as is. All are
    refused before any MPI call."""
    import wagma_comm

    for value, words in (("abc", "number"), ("0", "> 0"), ("nan", "> 0"), ("-5", "> 0")):
        monkeypatch.setenv("WAGMA_TIMEOUT", value)
        with pytest.raises(wagma_comm.InvalidArgumentError, match=words) as info:
            wagma_comm.init()
        assert info.value.argument == "WAGMA_TIMEOUT"
    with pytest.raises(wagma_comm.InvalidArgumentError) as info:
        wagma_comm.init(timeout=-1.0)  # an explicit timeout is still named as such
    assert info.value.argument == "timeout"
    monkeypatch.delenv("WAGMA_TIMEOUT")
    for debug in ("yes", 1, 0.0):
        with pytest.raises(wagma_comm.InvalidArgumentError) as info:
            wagma_comm.init(timeout=5, debug=debug)  # type: ignore[arg-type]
        assert info.value.argument == "debug"


def test_init_refuses_what_is_not_an_intracommunicator() -> None:
    """``mpi_comm`` that is not an mpi4py intracommunicator failed deep in
    the transport with an AttributeError ('str' object has no attribute
    'Idup') or a raw MPI.Exception (MPI_COMM_NULL, a freed communicator)."""
    code = textwrap.dedent("""
        from mpi4py import MPI
        import wagma_comm
        freed = MPI.COMM_WORLD.Dup()
        freed.Free()
        for bad in ("world", 3, MPI.COMM_NULL, freed):
            try:
                wagma_comm.init(timeout=10, mpi_comm=bad)
            except wagma_comm.InvalidArgumentError as exc:
                assert exc.argument == "mpi_comm", exc
            else:
                raise AssertionError(f"{bad!r} accepted")
        with wagma_comm.init(timeout=10, mpi_comm=MPI.COMM_SELF) as comm:
            assert comm.size == 1  # a real one still works afterwards
        print("mpi_comm ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "mpi_comm ok" in out.stdout


EXIT_CHECK = textwrap.dedent("""
    import atexit
    import numpy as np, wagma_comm

    def after() -> None:
        # Registered before wagma_comm's hook: runs after it.
        print("engine stopped" if not comm._engine.alive() else "engine RUNNING", flush=True)

    atexit.register(after)
    comm = wagma_comm.init(timeout=30)
    comm.allreduce(np.ones(4))
    print("exiting without close()", flush=True)
""")


@pytest.mark.parametrize("drain", ["abc", "-1", "0"])
def test_exit_without_close_stops_the_engine_whatever_WAGMA_EXIT_DRAIN_says(
        drain: str) -> None:
    """A non-numeric WAGMA_EXIT_DRAIN raised ValueError inside the atexit
    hook after marking the communicator closed: it was never closed (its
    engine ran on into MPI_Finalize). A drain of 0 (or below) made an idle
    communicator report collectives that "did not complete" and were
    "cancelled": there were none."""
    import os

    env = dict(os.environ, WAGMA_EXIT_DRAIN=drain)
    out = subprocess.run([sys.executable, "-c", EXIT_CHECK], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "engine stopped" in out.stdout, (out.stdout, out.stderr)
    assert "failed" not in out.stderr and "did not complete" not in out.stderr, out.stderr
    if drain != "0":
        assert "WAGMA_EXIT_DRAIN" in out.stderr  # a bad value is said, then the default used


@pytest.mark.parametrize("name,raw", [("WAGMA_SPIN_US", "abc"), ("WAGMA_SPIN_US", "-5"),
                                      ("WAGMA_LISTEN_SPIN_US", "nan"),
                                      ("WAGMA_HOST_THREADS", "abc"),
                                      ("WAGMA_SHM_MAX_BYTES", "1M")])
def test_a_bad_environment_variable_is_refused_by_init_naming_it(name: str, raw: str) -> None:
    """WAGMA_SPIN_US=abc failed ``import wagma_comm`` with a bare ValueError
    (a negative value was taken); WAGMA_HOST_THREADS=abc passed init() and
    failed inside the first large reduction, after communication began;
    WAGMA_SHM_MAX_BYTES=1M was checked only where a segment was made, after
    MPI's set-up (and ignored in a job of one rank)."""
    code = ("import wagma_comm\n"
            "try:\n"
            "    wagma_comm.init()\n"
            "except wagma_comm.InvalidArgumentError as exc:\n"
            "    print('refused', exc.argument)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI", "MPI_"))}
    env[name] = raw
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["refused", name]
