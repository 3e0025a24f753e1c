"""JSON / DOT / text dumps of schedules and the ``wagma schedule`` command."""

from __future__ import annotations

import json
import re
from typing import Callable

import pytest

from wagma_comm.errors import ScheduleError
from wagma_comm.schedule import algorithms as alg
from wagma_comm.schedule import cli
from wagma_comm.schedule.export import from_json, op_label, to_dot, to_json, to_text
from wagma_comm.schedule.ir import DATA, Copy, Native, Recv, Reduce, Scale, Send, Slot

GROUPS = [
    ("allreduce", (3, 11, 19, 27), 10, "avg", -1, name) for name in alg.ALLREDUCE_ALGORITHMS
] + [
    ("broadcast", (0, 1, 2, 3, 4), 7, "", 3, name) for name in alg.BROADCAST_ALGORITHMS
] + [("barrier", (0, 1, 2), 0, "", -1, "dissemination")]


@pytest.mark.parametrize("case", GROUPS, ids=lambda c: f"{c[0]}-{c[5]}")
def test_json_round_trips_exactly(case: tuple[str, tuple[int, ...], int, str, int, str]
                                  ) -> None:
    group = alg.compile_group(*case)
    assert from_json(to_json(group)) == group


def test_json_lists_every_op_with_type_fields_and_deps() -> None:
    group = alg.compile_group("allreduce", (0, 1, 2), 5, "avg", algorithm="ring")
    doc = json.loads(to_json(group))
    assert [s["rank"] for s in doc["schedules"]] == [0, 1, 2]
    for s, sched in zip(doc["schedules"], group):
        assert [o["index"] for o in s["ops"]] == list(range(len(sched.ops)))
        assert [tuple(o["deps"]) for o in s["ops"]] == list(sched.deps)
        assert s["scratch"] == dict(sched.scratch)
    op = doc["schedules"][0]["ops"][0]
    assert op == {"index": 0, "type": "send", "src": {"buf": "data", "offset": 0, "count": 2},
                  "peer": 1, "msg": 0, "deps": []}


def test_labels() -> None:
    assert op_label(Send(Slot(DATA, 0, 4), 2, 0)) == "send d[0:4]->r2 #0"
    assert op_label(Recv(Slot("tmp0", 2, 3), 5, 1)) == "recv tmp0[2:5]<-r5 #1"
    assert op_label(Reduce(Slot(DATA, 0, 4), Slot("t", 0, 4), "max")) == "max d[0:4] <- t[0:4]"
    assert op_label(Copy(Slot(DATA, 0, 1), Slot("t", 0, 1))) == "copy d[0:1] <- t[0:1]"
    assert op_label(Scale(Slot(DATA, 0, 4), 3)) == "scale d[0:4] /= 3"
    assert op_label(Native("broadcast", Slot(DATA, 0, 4), "", (1, 2), 2)) == \
        "native broadcast d[0:4] over [1, 2] root r2"


def test_dot_has_clusters_dep_edges_and_message_edges() -> None:
    group = alg.compile_group("allreduce", (3, 11, 19, 27), 8, "avg",
                              algorithm="rabenseifner")
    dot = to_dot(group)
    assert dot.startswith("digraph schedule {") and dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}")
    for s in group:
        assert f"subgraph cluster_r{s.rank} {{" in dot
    sends = sum(isinstance(op, Send) for s in group for op in s.ops)
    deps = sum(len(d) for s in group for d in s.deps)
    assert len(re.findall(r"-> r\d+_\d+ \[style=dashed\];", dot)) == sends
    assert len(re.findall(r"-> r\d+_\d+;", dot)) == deps
    assert 'r3_0 [label="0: send d[4:8]->r19 #0"];' in dot


def test_dot_of_one_rank_has_no_dangling_message_edges() -> None:
    group = alg.compile_group("allreduce", (0, 1, 2, 3), 8, "sum", algorithm="ring")
    assert "dashed" not in to_dot(group[:1])


def test_dot_joins_native_members() -> None:
    group = alg.compile_group("broadcast", (0, 1, 2), 4, root=1, algorithm="native")
    assert to_dot(group).count("style=dotted") == 2


def test_dot_quotes_labels() -> None:
    group = alg.compile_group("barrier", (0, 1))
    assert all(line.count('"') % 2 == 0 for line in to_dot(group).splitlines())


def test_text_has_one_line_per_op() -> None:
    group = alg.compile_group("allreduce", (0, 1), 4, "avg", algorithm="recursive_doubling")
    lines = to_text(group).splitlines()
    assert len(lines) == len(group) + sum(len(s.ops) for s in group)
    assert "    2: sum d[0:4] <- tmp0[0:4]  after 0,1" in lines


# -- the command ---------------------------------------------------------------------
def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(["schedule", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_dot_for_a_shifting_group(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys, "--ranks", "8", "--group-size", "4", "--step", "1",
                               "--dot")
    assert status == 0 and err.strip() == "verified"
    assert out.startswith("digraph")
    from wagma_comm.groups import group_of

    for r in group_of(0, 8, 4, 1):
        assert f"cluster_r{r} " in out


def test_cli_json_for_one_rank(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "--ranks", "16", "--group-size", "4", "--step", "1",
                             "--rank", "6", "--json", "--algorithm", "ring", "--count", "9")
    assert status == 0
    (sched,) = from_json(out)
    assert sched.rank == 6 and sched.ranks == (2, 6, 10, 14) and sched.count == 9
    assert sched.algorithm == "ring" and sched.op == "avg"


def test_cli_broadcast_root_is_a_group_position(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys, "--ranks", "9", "--group-size", "3", "--step", "1",
                               "--rank", "4", "--collective", "broadcast", "--root", "2",
                               "--json")
    assert status == 0 and "verified" in err
    assert {s.root for s in from_json(out)} == {7}


def test_cli_barrier_text(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "--ranks", "5", "--collective", "barrier")
    assert status == 0 and out.count("rank ") == 5


@pytest.mark.parametrize("argv", [
    ["--ranks", "4", "--group-size", "5"],
    ["--ranks", "4", "--rank", "4"],
    ["--ranks", "4", "--algorithm", "bogus"],
    ["--ranks", "4", "--collective", "broadcast", "--root", "4"],
    ["--ranks", "4", "--op", "mean"],
])
def test_cli_bad_arguments(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    status, out, err = run_cli(capsys, *argv)
    assert status == 2 and out == "" and "error" in err


def test_wagma_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    """The ``wagma`` command registers this subcommand through add_parser/run."""
    main_cli = pytest.importorskip("wagma_comm.cli")
    status = main_cli.main(["schedule", "--ranks", "8", "--group-size", "4", "--step", "1",
                            "--dot"])
    out, err = capsys.readouterr()
    assert status == 0 and out.startswith("digraph") and "verified" in err


@pytest.mark.parametrize("argv,flag", [
    (["--ranks", "4", "--group-size", "0"], "--group-size"),
    (["--ranks", "4", "--group-size", "5"], "--group-size"),
    (["--ranks", "4", "--count", "-1"], "--count"),
    (["--ranks", "4", "--op", "mean"], "--op"),
    (["--ranks", "4", "--algorithm", "bogus"], "--algorithm"),
    (["--ranks", "4", "--collective", "broadcast", "--algorithm", "ring"], "--algorithm"),
    (["--ranks", "4", "--collective", "barrier", "--algorithm", "binomial"], "--algorithm"),
])
def test_cli_errors_name_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str],
                                  flag: str) -> None:
    """A command-line user fixes a flag, not the compiler's parameter: the
    error names ``--group-size``, not ``group_size``."""
    status, out, err = run_cli(capsys, *argv)
    assert status == 2 and out == ""
    assert err.startswith(f"wagma schedule: error: {flag}: "), err


def _edit_first_op(doc: dict, change: Callable[[dict], None]) -> str:
    change(doc["schedules"][0]["ops"][0])
    return json.dumps(doc)


def test_from_json_rejects_malformed_documents_with_schedule_error() -> None:
    """A hand-edited dump that lost a field gets ScheduleError naming the
    schedule and op, never a bare KeyError/AttributeError/JSONDecodeError."""
    text = to_json(alg.compile_group("allreduce", (0, 1, 2), 5, "avg", algorithm="ring"))
    fmt = json.loads(text)["format"]
    cases = {
        "not json": ("{", "not a"),
        "a list": ("[]", "not a"),
        "no schedules": (json.dumps({"format": fmt}), "schedules"),
        "schedule not an object": (json.dumps({"format": fmt, "schedules": [3]}),
                                   "schedule 0"),
        "schedule without ops": (json.dumps({"format": fmt, "schedules": [{}]}),
                                 "schedule 0: missing field 'ops'"),
        "op without peer": (_edit_first_op(json.loads(text), lambda o: o.pop("peer")),
                            "schedule 0, op 0: missing field 'peer'"),
        "op without deps": (_edit_first_op(json.loads(text), lambda o: o.pop("deps")),
                            "schedule 0, op 0: missing field 'deps'"),
        "deps not a list": (_edit_first_op(json.loads(text), lambda o: o.update(deps=3)),
                            "schedule 0, op 0"),
    }
    for name, (bad, where) in cases.items():
        with pytest.raises(ScheduleError) as info:
            from_json(bad)
        assert where in str(info.value), (name, str(info.value))


def test_cli_refuses_a_group_too_large_to_print(capsys) -> None:
    # --ranks 100000000 (group size defaults to every rank) ran out of memory.
    from wagma_comm.schedule import cli as schedule_cli

    assert schedule_cli.main(["schedule", "--ranks", "100000000"]) == 2
    assert "--group-size" in capsys.readouterr().err
    assert schedule_cli.main(["schedule", "--ranks", str(2**31)]) == 2
    assert "--ranks" in capsys.readouterr().err


def test_cli_limit_is_on_the_group_shown_not_on_group_size(
        capsys: pytest.CaptureFixture[str]) -> None:
    """P=10000, S=5000 has radices (5000, 2): at step 1 rank 0's group is
    {0, 5000}, yet it was refused as "a group of 5000 ranks"."""
    status, out, err = run_cli(capsys, "--ranks", "10000", "--group-size", "5000", "--step",
                               "1", "--count", "1", "--json")
    assert status == 0 and "verified" in err
    assert {s.rank for s in from_json(out)} == {0, 5000}
    status, out, err = run_cli(capsys, "--ranks", "10000", "--group-size", "5000",
                               "--count", "1")  # step 0: 5000 ranks, still refused
    assert status == 2 and out == "" and "--group-size" in err and "5000 ranks" in err


def test_from_json_refuses_ops_whose_index_is_not_their_position() -> None:
    """Deps name ops by position, and the dump writes each op's index: an op
    line deleted or moved by hand shifted every later op under its deps
    silently (the document said ``"index": 1`` at position 0)."""
    text = to_json(alg.compile_group("allreduce", (0, 1, 2), 5, "avg", algorithm="ring"))
    doc = json.loads(text)
    del doc["schedules"][0]["ops"][0]
    with pytest.raises(ScheduleError, match=r"schedule 0, op 0: .*index 1"):
        from_json(json.dumps(doc))
    doc = json.loads(text)
    ops = doc["schedules"][1]["ops"]
    ops[2], ops[3] = ops[3], ops[2]
    with pytest.raises(ScheduleError, match=r"schedule 1, op 2: .*index 3"):
        from_json(json.dumps(doc))
    assert from_json(text) == alg.compile_group("allreduce", (0, 1, 2), 5, "avg",
                                                algorithm="ring")
