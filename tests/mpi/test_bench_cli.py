"""``wagma bench`` end to end at tiny sizes, under mpiexec at any size: every
subcommand runs, its JSON has the stable schema, results check out (#wrong 0),
and the check really catches a corrupted result."""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import pytest
from mpi4py import MPI

from wagma_comm import Communicator, dtypes
from wagma_comm.bench import cli as bench_cli
from wagma_comm.cli import build_parser

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()

ROW_KEYS = {"collective", "nbytes", "count", "dtype", "op", "group_size", "results"}
RESULT_KEYS = {"time_us", "min_us", "max_us", "algbw", "busbw", "wrong"}
META_KEYS = {"command", "ranks", "wagma_comm", "python", "numpy", "numba", "mpi4py",
             "mpi_library", "cpu", "cpus", "gpu", "nccl", "torch", "peers"}


@pytest.fixture
def shared_dir(tmp_path_factory: Any) -> Iterator[str]:
    path = WORLD.bcast(str(tmp_path_factory.mktemp("bench")) if RANK == 0 else None)
    yield path


def _bench(argv: list[str]) -> int:
    args = build_parser().parse_args(["bench", *argv])
    return bench_cli.run(args)


def _load(path: str) -> dict[str, Any]:
    with open(path) as fh:
        return json.load(fh)


@pytest.mark.parametrize("collective", ["allreduce", "group_allreduce", "broadcast"])
def test_sweep_json_schema_and_no_wrong_results(shared_dir: str, collective: str) -> None:
    path = os.path.join(shared_dir, f"{collective}.json")
    csv = os.path.join(shared_dir, f"{collective}.csv")
    assert _bench([collective, "-b", "8", "-e", "1K", "-f", "8", "-n", "3", "-r", "1",
                   "--vs", "mpi", "--json", path, "--csv", csv]) == 0
    if RANK != 0:
        return
    out = _load(path)
    assert META_KEYS <= set(out["meta"])
    assert out["meta"]["ranks"] == SIZE
    rows = out["rows"]
    assert [r["nbytes"] for r in rows] == [8, 64, 512]
    for row in rows:
        assert set(row) == ROW_KEYS and row["collective"] == collective
        assert {"wagma", "mpi"} <= set(row["results"])
        for name, res in row["results"].items():
            assert RESULT_KEYS <= set(res)
            assert res["time_us"] > 0 and res["min_us"] <= res["time_us"] <= res["max_us"]
            if name != "wagma-global":
                assert res["wrong"] == 0, (name, row)
    with open(csv) as fh:
        lines = fh.read().splitlines()
    assert lines[0].startswith("collective,impl,size")
    assert len(lines) == 1 + sum(len(r["results"]) for r in rows)


@pytest.mark.parametrize("collective", ["allreduce", "broadcast"])
def test_algorithms_are_timed_side_by_side(shared_dir: str, collective: str) -> None:
    path = os.path.join(shared_dir, f"{collective}-algorithms.json")
    algs = (["shared_memory", "recursive_doubling"] if collective == "allreduce"
            else ["shared_memory", "binomial", "scatter_allgather"])
    assert _bench([collective, "-b", "64", "-e", "4K", "-f", "64", "-n", "3", "-r", "1",
                   "--algorithms", ",".join(algs), "--vs", "none", "--json", path]) == 0
    if RANK == 0:
        rows = _load(path)["rows"]
        assert [r["nbytes"] for r in rows] == [64, 4096]
        for row in rows:
            assert set(row["results"]) == {f"wagma:{a}" for a in algs}
            assert all(res["wrong"] == 0 for res in row["results"].values())


@pytest.mark.parametrize("collective", ["wait_avoiding", "solo", "majority"])
def test_partial_collectives_are_timed_per_step(shared_dir: str, collective: str) -> None:
    path = os.path.join(shared_dir, f"{collective}.json")
    assert _bench([collective, "-b", "64", "-e", "64", "-n", "4", "-r", "1", "-w", "1",
                   "--sync-every", "3", "--vs", "mpi", "--json", path]) == 0
    if RANK == 0:
        (row,) = _load(path)["rows"]
        assert row["collective"] == collective
        assert "wagma" in row["results"] and row["results"]["wagma"]["time_us"] > 0


def test_overlap_subcommand(shared_dir: str) -> None:
    path = os.path.join(shared_dir, "overlap.json")
    assert _bench(["overlap", "-b", "1K", "-e", "1K", "-n", "3", "-r", "1", "-w", "1",
                   "--json", path]) == 0
    if RANK == 0:
        results = _load(path)["overlap"]
        assert {r["impl"] for r in results} >= {"wagma", "mpi"}
        for r in results:
            assert 0.0 <= r["overlap_pct"] <= 100.0


def test_check_detects_a_corrupted_result(comm: Communicator) -> None:
    """-c counts every element that differs from the expected reduction: an
    implementation that corrupts one element per rank is caught on every rank."""
    dtype = dtypes.lookup("float32")
    args = build_parser().parse_args(["bench", "allreduce", "--vs", "none"])
    ctx = bench_cli.Context(args, comm, WORLD, dtype, [], list(range(SIZE)),
                            [list(range(SIZE))], SIZE)
    mem = bench_cli.Memory(bench_cli.pattern(RANK, 16, dtype).copy(), dtype, "cpu")
    arr = mem.arr

    def honest() -> None:
        comm.allreduce(arr, "sum")

    def corrupting() -> None:
        comm.allreduce(arr, "sum")
        arr[RANK % 16] += 1.0

    wrong = bench_cli._check("allreduce", ctx, mem, {"honest": honest, "bad": corrupting})
    assert wrong == {"honest": 0, "bad": SIZE}


def test_cuda_device_is_refused_before_communicating() -> None:
    from wagma_comm.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="--device"):
        _bench(["allreduce", "--device", "cuda"])


def _factor(res: dict[str, Any]) -> float:
    return res["busbw"] / res["algbw"]


def test_busbw_factor_is_that_of_the_ranks_each_call_spans(shared_dir: str) -> None:
    """nccl-tests' factor per implementation: in a group_allreduce row our
    global allreduce spans every rank, as does each peer's allreduce in a
    wait_avoiding row; the group calls span the group."""
    ga = os.path.join(shared_dir, "busbw-group.json")
    wa = os.path.join(shared_dir, "busbw-wait.json")
    assert _bench(["group_allreduce", "-b", "64K", "-e", "64K", "-n", "2", "-r", "1",
                   "-w", "1", "--vs", "mpi", "--json", ga]) == 0
    assert _bench(["wait_avoiding", "-b", "64K", "-e", "64K", "-n", "2", "-r", "1",
                   "-w", "1", "--vs", "mpi", "--json", wa]) == 0
    if RANK != 0:
        return
    world = bench_cli.busbw_factor("allreduce", SIZE)
    (row,) = _load(ga)["rows"]
    group = bench_cli.busbw_factor("group_allreduce", row["group_size"])
    res = row["results"]
    assert _factor(res["wagma-global"]) == pytest.approx(world)
    assert _factor(res["wagma"]) == pytest.approx(group)
    assert _factor(res["mpi"]) == pytest.approx(group)
    (row,) = _load(wa)["rows"]
    res = row["results"]
    assert _factor(res["mpi"]) == pytest.approx(world)
    assert _factor(res["wagma-blocking-group"]) == pytest.approx(group)


def test_global_allreduce_beside_a_group_one_is_checked(shared_dir: str) -> None:
    path = os.path.join(shared_dir, "global-checked.json")
    assert _bench(["group_allreduce", "-b", "64", "-e", "64", "-n", "2", "-r", "1",
                   "--vs", "none", "--json", path]) == 0
    if RANK == 0:
        (row,) = _load(path)["rows"]
        assert row["results"]["wagma-global"]["wrong"] == 0


def test_summary_gives_no_verdict_on_unchecked_results() -> None:
    """-c 0 (or solo/majority/wait_avoiding, which -c does not cover) must not
    print 'results checked: 0 wrong elements PASS'."""
    from wagma_comm.bench import report

    def row(wrong: int) -> bench_cli.Row:
        r = bench_cli.Row("allreduce", 64, 16, "float32", "sum", SIZE)
        r.results["wagma"] = {"time_us": 1.0, "min_us": 1.0, "max_us": 1.0, "algbw": 1.0,
                              "busbw": 1.0, "wrong": wrong}
        return r

    text = report.summary([row(-1), row(-1)])
    assert "PASS" not in text and "not checked" in text
    assert "0 wrong elements in 1 checked results; 1 timed only" in report.summary(
        [row(0), row(-1)])
    assert "FAIL" in report.summary([row(3)])


def test_partial_collectives_peers_run_the_rows_op(comm: Communicator) -> None:
    """A wait_avoiding row says avg: the peers' allreduce must average too."""
    from wagma_comm import groups
    from wagma_comm.bench import check
    from wagma_comm.bench.peers import close_peers, make_peers

    dtype = dtypes.lookup("float32")
    args = build_parser().parse_args(["bench", "wait_avoiding", "--vs", "mpi"])
    gsize = max(1, SIZE // 2)
    peers = make_peers(["mpi"], WORLD)
    ctx = bench_cli.Context(args, comm, WORLD, dtype, peers,
                            list(groups.group_of(RANK, SIZE, gsize, 0)),
                            [list(g) for g in groups.partition(SIZE, gsize, 0)], gsize)
    mem = bench_cli.Memory(bench_cli.pattern(RANK, 16, dtype).copy(), dtype, "cpu")
    impls, closers = bench_cli._impls("wait_avoiding", ctx, mem)
    try:
        impls["mpi"]()
        expected = check.expected_result("allreduce", range(SIZE), 16, "avg")
        assert check.count_wrong(mem.read(), dtype, expected) == 0
    finally:
        for close in closers:
            close()
        close_peers(peers)


def test_peer_that_cannot_run_is_named(shared_dir: str, capsys: Any) -> None:
    assert _bench(["allreduce", "-b", "8", "-e", "8", "-n", "2", "-r", "1", "-d",
                   "float16", "--vs", "mpi"]) == 0
    out = capsys.readouterr().out
    if RANK == 0:
        assert "# peer mpi skipped for allreduce: MPI cannot reduce float16" in out


def test_overlap_honours_vs_none(shared_dir: str) -> None:
    path = os.path.join(shared_dir, "overlap-none.json")
    assert _bench(["overlap", "-b", "1K", "-e", "1K", "-n", "2", "-r", "1", "-w", "1",
                   "--vs", "none", "--json", path]) == 0
    if RANK == 0:
        assert {r["impl"] for r in _load(path)["overlap"]} == {"wagma"}


def test_sizes_below_an_element_are_measured_once(shared_dir: str) -> None:
    """-b 1 -e 4 -d float32 asked for 1, 2 and 4 bytes, all one element:
    three identical 4-byte rows were measured and printed."""
    if SIZE != 2:
        pytest.skip("rank-count independent: run at 2 ranks")
    path = os.path.join(shared_dir, "tiny.json")
    assert _bench(["allreduce", "-b", "1", "-e", "4", "-f", "2", "-d", "float32", "-n", "1",
                   "-r", "1", "-w", "0", "--vs", "none", "--json", path]) == 0
    if RANK == 0:
        assert [r["nbytes"] for r in _load(path)["rows"]] == [4]


@pytest.mark.parametrize("flag", ["--csv", "--plot"])
def test_overlap_refuses_outputs_it_does_not_write(flag: str) -> None:
    from wagma_comm.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match=flag):
        _bench(["overlap", flag, "out.png" if flag == "--plot" else "out.csv"])


# -- wagma imbalance ---------------------------------------------------------------

IMBALANCE_KEYS = {"ranks", "compute_s", "injector", "delay_s", "sync_every", "group_size",
                  "grace", "elements", "seed", "steps", "rounds", "rates", "expected",
                  "fresh_share", "wait_per_iteration_s", "staleness_histogram",
                  "expected_wait_avoiding", "expected_wait_avoiding_exact",
                  "expected_blocking", "samples_s"}


def _imbalance_args(argv: list[str]) -> Any:
    return build_parser().parse_args(["imbalance", "--elements", "8", *argv])


def test_imbalance_json_schema(shared_dir: str) -> None:
    """`wagma imbalance --json`: every key `wagma sim --validate` and the plot read,
    one rate and one per-rank wait list per method, units as documented."""
    import statistics

    from wagma_comm.bench import imbalance as imbalance_cli

    path = os.path.join(shared_dir, "imbalance.json")
    assert imbalance_cli.run(_imbalance_args([
        "--compute", "0.001", "--sync-every", "2", "--periods", "2", "--rounds", "2",
        "--seed", "3", "--methods", "allreduce,majority", "--json", path])) == 0
    if RANK != 0:
        return
    res = _load(path)
    assert set(res) == IMBALANCE_KEYS
    assert (res["ranks"], res["steps"], res["seed"], res["rounds"]) == (SIZE, 4, 3, 2)
    assert res["injector"] == "reference:0.001:2" and res["delay_s"] == 0.001
    for key in ("rates", "fresh_share", "wait_per_iteration_s", "samples_s"):
        assert list(res[key]) == ["allreduce", "majority"], key
    for m in ("allreduce", "majority"):
        assert len(res["wait_per_iteration_s"][m]) == SIZE
        assert len(res["samples_s"][m]) == 2
        # it/s = steps / median over rounds of the slowest rank's seconds, and the
        # slowest rank took at least as long as rank 0 (samples_s is rank 0's)
        assert 0 < res["rates"][m] <= 4 / statistics.median(res["samples_s"][m]) * (1 + 1e-12)
    assert res["expected"]["allreduce"] == res["expected_blocking"]
    assert res["expected"]["majority"] is None


def test_imbalance_json_is_strict_with_zero_compute(shared_dir: str) -> None:
    """With no compute and no injected delay the expected rates are infinite:
    the file says null there (it said ``Infinity``, which strict JSON readers
    such as jq refuse)."""
    import json

    from wagma_comm.bench import imbalance as imbalance_cli

    if SIZE != 2:
        pytest.skip("rank-count independent: run at 2 ranks")
    path = os.path.join(shared_dir, "imbalance-zero.json")
    assert imbalance_cli.run(_imbalance_args([
        "--compute", "0", "--imbalance", "none", "--sync-every", "2", "--periods", "1",
        "--rounds", "1", "--methods", "allreduce,wagma", "--json", path])) == 0
    if RANK != 0:
        return

    def refuse(constant: str) -> None:
        raise AssertionError(f"non-strict JSON constant {constant} in {path}")

    with open(path) as fh:
        res = json.loads(fh.read(), parse_constant=refuse)
    assert res["expected_blocking"] is None and res["expected_wait_avoiding"] is None
    assert res["expected"] == {"allreduce": None, "wagma": None}
    assert all(rate > 0 for rate in res["rates"].values())


def test_imbalance_majority_follows_the_seed(comm: Communicator) -> None:
    """--seed seeds the majority's activators too, as `wagma sim` assumes when it
    replays a measurement (they were drawn from seed 0 whatever --seed said)."""
    import numpy as np

    from wagma_comm.bench import imbalance as imbalance_cli
    from wagma_comm.imbalance import NoImbalance
    from wagma_comm.runtime.activation import majority_activator

    if SIZE == 1:
        pytest.skip("one rank activates every round whatever the seed")
    steps = 12

    def counts(seed: int) -> list[int]:
        drawn = [majority_activator(seed, r, SIZE) for r in range(steps)]
        return [drawn.count(r) for r in range(SIZE)]

    seed = next(s for s in range(1, 100) if counts(s) != counts(0))
    args = _imbalance_args(["--compute", "0", "--sync-every", "100", "--seed", str(seed)])
    args.group_size = max(1, SIZE // 2)
    loop = imbalance_cli._loop(comm, "majority", np.zeros(8, dtype=np.float32), args,
                               NoImbalance(SIZE), steps)
    try:
        loop()
        here = loop.statistics()["activated_here"]
    finally:
        loop.close()
    assert WORLD.allgather(here) == counts(seed)


def test_imbalance_survives_an_intractable_exact_expectation(comm: Communicator) -> None:
    """Past EXACT_WORK_LIMIT the exact reference term is left out (None) instead of
    raising InvalidArgumentError('sync_every') after the whole measurement."""
    from wagma_comm import imbalance as imb
    from wagma_comm.bench import imbalance as imbalance_cli

    count = 4
    tau = next(t for t in range(1, 5000)
               if imb._exact_work(SIZE, count, t) > imb.EXACT_WORK_LIMIT)
    args = _imbalance_args(["--compute", "0", "--sync-every", str(tau), "--periods", "1",
                            "--rounds", "1", "--methods", "allreduce"])
    args.group_size = max(1, SIZE // 2)
    res = imbalance_cli.measure(comm, args, f"reference:1e-6:{count}")
    assert res["expected_wait_avoiding_exact"] is None
    assert res["rates"]["allreduce"] > 0 and res["expected_wait_avoiding"] > 0


@pytest.mark.parametrize("argv,flag", [
    (["--json", "/dev/null/out.json"], "--json"),  # under a file: no directory
    (["--group-size", str(SIZE + 1)], "--group-size"),
    (["--imbalance", "reference:0.001:2:9"], "--imbalance"),
])
def test_imbalance_refuses_on_every_rank_before_measuring(argv: list[str], flag: str) -> None:
    """An unwritable --json failed on rank 0 only, after every measurement; a
    group size beyond the ranks was recorded unused when no method needed it."""
    from wagma_comm.bench import imbalance as imbalance_cli
    from wagma_comm.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as info:
        imbalance_cli.run(_imbalance_args(["--compute", "0.001", "--sync-every", "2",
                                           "--periods", "1", "--rounds", "1",
                                           "--methods", "allreduce", *argv]))
    assert info.value.argument == flag


def test_imbalance_gather_returns_every_value_and_times_out_on_a_missing_rank() -> None:
    """The benchmark's result gathering goes through the communicator: values
    of different sizes come back in rank order, and a rank that never comes
    is a timeout naming it (it was a plain MPI allgather, waiting forever)."""
    import wagma_comm
    from wagma_comm.bench.imbalance import comm_allgather

    c = wagma_comm.init(timeout=30)
    try:
        values = [{"rank": r, "pad": "x" * (r * 37)} for r in range(SIZE)]
        assert comm_allgather(c, values[RANK]) == values
        assert comm_allgather(c, None) == [None] * SIZE
        if SIZE > 1:
            c.barrier()
            if RANK == 0:
                with pytest.raises(wagma_comm.CollectiveTimeoutError) as info:
                    comm_allgather(c, 1.0, timeout=0.5)
                assert info.value.ranks and set(info.value.ranks) <= set(range(1, SIZE))
    finally:
        WORLD.Barrier()
        c.close(cancel=True)


@pytest.mark.parametrize("argv,flag", [
    (["-n", "-3"], "-n/--iters"),  # gave negative times and a PASS/FAIL verdict
    (["-r", "0"], "-r/--rounds"),  # failed after set-up: StatisticsError
    (["-w", "-1"], "-w/--warmup"),
    (["-f", "1"], "-f/--stepfactor"),  # was raised to 2 silently
    (["--step", "-1"], "--step"),  # was taken modulo the step count
])
def test_meaningless_counts_are_refused_before_communicating(argv: list[str], flag: str) -> None:
    from wagma_comm.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as info:
        _bench(["allreduce", "-b", "8", "-e", "8", "--vs", "none", *argv])
    assert info.value.argument == flag


def test_peers_wait_as_long_as_the_communicator(monkeypatch: Any) -> None:
    """The peers' deadline is the communicator's (WAGMA_TIMEOUT), not a fixed
    300 s: a hung peer fails the run as soon as a hung wagma call would."""
    from wagma_comm.bench import peers as peers_mod

    made: list[float] = []
    real = peers_mod.make_peers

    def recording(*args: Any, **kwargs: Any) -> Any:
        made.append(args[3] if len(args) > 3 else kwargs["timeout"])
        return real(*args, **kwargs)

    monkeypatch.setenv("WAGMA_TIMEOUT", "37")
    monkeypatch.setattr(peers_mod, "make_peers", recording)
    assert _bench(["allreduce", "-b", "8", "-e", "8", "-n", "1", "-r", "1", "-w", "0",
                   "--vs", "mpi-nb"]) == 0
    assert made == [37.0]


def test_a_rank_missing_from_a_timed_round_is_a_timeout() -> None:
    """side_by_side starts each timed loop with a barrier and gathers the
    medians at the end; both were plain MPI calls, so a rank that stopped
    between two loops hung the others forever. Now: CollectiveTimeoutError
    naming the implementation and round."""
    from wagma_comm import CollectiveTimeoutError
    from wagma_comm.bench import measure
    from wagma_comm.transport.mpi import ABANDONED

    if SIZE != 2:  # the same at any size; make test's time budget
        pytest.skip("one rank never waits for another; runs at 2 ranks")
    dup = WORLD.Dup()
    try:
        if RANK == 0:  # the other ranks never start the loop
            with pytest.raises(CollectiveTimeoutError) as info:
                measure.time_calls(lambda: None, 1, dup, timeout=0.5, round=2, name="mpi")
            assert info.value.round == 2 and "before timing mpi" in str(info.value)
        WORLD.Barrier()
        if RANK != 0:
            dup.Ibarrier().Wait()  # matches rank 0's abandoned Ibarrier
        else:
            _, req = ABANDONED.pop()  # (buffers, request), kept by the timeout
            req.Wait()
        # Every rank present: the timings come back, the same on every rank.
        timings = measure.side_by_side({"a": lambda: None, "b": lambda: None}, 2, 1, 3, dup,
                                       timeout=30)
        assert set(timings) == {"a", "b"}
        assert WORLD.allgather(timings) == [timings] * SIZE
    finally:
        dup.Free()


@pytest.mark.parametrize("flag", ["--json", "--csv", "--plot"])
def test_an_output_rank_0_cannot_write_fails_on_every_rank_before_measuring(
        shared_dir: str, flag: str) -> None:
    """Before session 45 the whole sweep ran, then rank 0 alone failed with a
    bare FileExistsError from the writer (the others exited 0)."""
    from wagma_comm.errors import InvalidArgumentError

    blocker = os.path.join(shared_dir, "a-file")
    if RANK == 0:
        with open(blocker, "w"):
            pass
    WORLD.Barrier()
    with pytest.raises(InvalidArgumentError) as info:
        _bench(["allreduce", "-b", "8", "-e", "8", "-n", "1", "-r", "1", "--vs", "none",
                flag, os.path.join(blocker, "out.png")])
    assert info.value.argument == flag


def test_job_cores_counts_the_cores_of_every_rank_on_the_node() -> None:
    """Under ``mpiexec -bind-to core`` each rank may run on one core: the
    probe scripts printed "N ranks on 1 cores" (rank 0's own affinity).
    Binding each rank here to one core of its own (round robin) must count
    the union."""
    from wagma_comm.bench.measure import job_cores

    allowed = sorted(os.sched_getaffinity(0))
    mine = allowed[RANK % len(allowed)]
    try:
        os.sched_setaffinity(0, {mine})
        expected = len(set(WORLD.allgather(mine)))
        assert job_cores(WORLD, timeout=30) == expected
        assert expected == min(SIZE, len(allowed))
    finally:
        os.sched_setaffinity(0, allowed)
