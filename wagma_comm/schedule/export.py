"""Dump schedules as JSON, Graphviz DOT or plain text, to read and to diff.

Serialisation only: every op is written as it is, with its index and deps, and
nothing is reordered, merged or dropped (``from_json`` gives back equal
Schedule objects). Labels are short, e.g. ``send d[0:4]->r2 #0``, where ``d``
is the user's data and other buffers keep their scratch names.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from ..errors import ScheduleError
from .ir import DATA, Copy, Native, Op, Recv, Reduce, Scale, Schedule, Send, Slot

FORMAT = "wagma_comm.schedule/1"
_TYPES: dict[str, type] = {
    "send": Send, "recv": Recv, "reduce": Reduce, "copy": Copy, "scale": Scale,
    "native": Native,
}
_NAMES = {cls: name for name, cls in _TYPES.items()}


# -- labels ----------------------------------------------------------------------
def slot_label(slot: Slot) -> str:
    """``d[0:4]`` for data, ``tmp0[0:4]`` for scratch."""
    buf = "d" if slot.buf == DATA else slot.buf
    return f"{buf}[{slot.offset}:{slot.end}]"


def op_label(op: Op) -> str:
    """One short line describing ``op``."""
    if isinstance(op, Send):
        return f"send {slot_label(op.src)}->r{op.peer} #{op.msg}"
    if isinstance(op, Recv):
        return f"recv {slot_label(op.dst)}<-r{op.peer} #{op.msg}"
    if isinstance(op, Reduce):
        return f"{op.op} {slot_label(op.dst)} <- {slot_label(op.src)}"
    if isinstance(op, Copy):
        return f"copy {slot_label(op.dst)} <- {slot_label(op.src)}"
    if isinstance(op, Scale):
        return f"scale {slot_label(op.dst)} /= {op.divisor}"
    if isinstance(op, Native):
        root = f" root r{op.root}" if op.root >= 0 else ""
        what = f" {op.op}" if op.op else ""
        return (f"native {op.kind}{what} {slot_label(op.buf)} over "
                f"{list(op.ranks)}{root}")
    return repr(op)


# -- JSON ------------------------------------------------------------------------
def _value(v: Any) -> Any:
    if isinstance(v, Slot):
        return {"buf": v.buf, "offset": v.offset, "count": v.count}
    if isinstance(v, tuple):
        return list(v)
    return v


def op_to_dict(op: Op, index: int, deps: Sequence[int]) -> dict[str, Any]:
    """``{"index", "type", <fields>, "deps"}`` for one op."""
    out: dict[str, Any] = {"index": index, "type": _NAMES[type(op)]}
    for f in dataclasses.fields(op):
        out[f.name] = _value(getattr(op, f.name))
    out["deps"] = list(deps)
    return out


def schedule_to_dict(s: Schedule) -> dict[str, Any]:
    """Plain dict/list form of one schedule."""
    return {
        "collective": s.collective, "algorithm": s.algorithm, "rank": s.rank,
        "ranks": list(s.ranks), "count": s.count, "op": s.op, "root": s.root,
        "scratch": {name: size for name, size in s.scratch},
        "ops": [op_to_dict(op, i, d) for i, (op, d) in enumerate(zip(s.ops, s.deps))],
    }


def to_json(schedules: Sequence[Schedule]) -> str:
    """JSON text ``{"format", "schedules": [...]}``, one op per line so that
    dumps of two schedules diff well."""
    parts = []
    for s in schedules:
        head = schedule_to_dict(s)
        ops = head.pop("ops")
        body = ",\n".join("    " + json.dumps(o) for o in ops)
        parts.append(f'  {json.dumps(head)[:-1]}, "ops": [\n{body}\n  ]}}')
    return (f'{{"format": {json.dumps(FORMAT)}, "schedules": [\n'
            + ",\n".join(parts) + "\n]}\n")


def _op_from_dict(d: dict[str, Any]) -> Op:
    cls = _TYPES.get(d.get("type", ""))
    if cls is None:
        raise ScheduleError(f"unknown op type {d.get('type')!r} in JSON")
    kwargs = {}
    for f in dataclasses.fields(cls):
        v = d[f.name]
        if isinstance(v, dict):
            v = Slot(v["buf"], v["offset"], v["count"])
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[f.name] = v
    return cls(**kwargs)  # type: ignore[no-any-return]


def from_json(text: str) -> tuple[Schedule, ...]:
    """The schedules written by :func:`to_json` (for tools and tests). A
    document that is not one (bad JSON, a missing or mistyped field) raises
    ScheduleError naming the schedule and op, not a bare KeyError: such a
    document is usually hand-edited, and the reader must find the spot."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ScheduleError(f"not a {FORMAT} document: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ScheduleError(f"not a {FORMAT} document")
    if not isinstance(doc.get("schedules"), list):
        raise ScheduleError(f'{FORMAT} document: "schedules" must be a list')
    out = []
    for k, s in enumerate(doc["schedules"]):
        where = f"{FORMAT} document, schedule {k}"
        try:
            ops, deps = [], []
            for i, o in enumerate(s["ops"]):
                where = f"{FORMAT} document, schedule {k}, op {i}"
                if o.get("index", i) != i:  # deps name ops by position
                    raise ScheduleError(f"{where}: the op at this position says index "
                                        f"{o['index']!r} (an op moved or deleted?)")
                ops.append(_op_from_dict(o))
                deps.append(tuple(o["deps"]))
            where = f"{FORMAT} document, schedule {k}"
            out.append(Schedule(s["collective"], s["algorithm"], s["rank"], tuple(s["ranks"]),
                                s["count"], s["op"], s["root"], tuple(ops), tuple(deps),
                                tuple(s["scratch"].items())))
        except KeyError as exc:
            raise ScheduleError(f"{where}: missing field {exc}") from None
        except (TypeError, AttributeError, ValueError) as exc:
            raise ScheduleError(f"{where}: malformed ({exc})") from None
    return tuple(out)


# -- DOT -------------------------------------------------------------------------
def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _node(rank: int, index: int) -> str:
    return f"r{rank}_{index}"


def to_dot(schedules: Sequence[Schedule]) -> str:
    """Graphviz digraph: a cluster per rank, solid dep edges, dashed message
    edges from each Send to its Recv, dotted lines joining a Native's members."""
    lines = ["digraph schedule {", "  rankdir=TB;", "  node [shape=box, fontsize=10];"]
    for s in schedules:
        lines.extend(_cluster(s))
    lines.extend(_message_edges(schedules))
    lines.extend(_native_edges(schedules))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _cluster(s: Schedule) -> list[str]:
    title = f"rank {s.rank}: {s.collective}/{s.algorithm}"
    out = [f"  subgraph cluster_r{s.rank} {{", f"    label={_quote(title)};"]
    for i, op in enumerate(s.ops):
        out.append(f"    {_node(s.rank, i)} [label={_quote(f'{i}: {op_label(op)}')}];")
    for i, deps in enumerate(s.deps):
        out.extend(f"    {_node(s.rank, j)} -> {_node(s.rank, i)};" for j in deps)
    out.append("  }")
    return out


def _message_edges(schedules: Sequence[Schedule]) -> list[str]:
    recvs = {(op.peer, s.rank, op.msg): (s.rank, i)
             for s in schedules for i, op in enumerate(s.ops) if isinstance(op, Recv)}
    out = []
    for s in schedules:
        for i, op in enumerate(s.ops):
            if isinstance(op, Send) and (s.rank, op.peer, op.msg) in recvs:
                dst = recvs[(s.rank, op.peer, op.msg)]
                out.append(f"  {_node(s.rank, i)} -> {_node(*dst)} [style=dashed];")
    return out


def _native_edges(schedules: Sequence[Schedule]) -> list[str]:
    calls: dict[tuple[tuple[int, ...], int], list[str]] = {}
    for s in schedules:
        seen: dict[tuple[int, ...], int] = {}
        for i, op in enumerate(s.ops):
            if isinstance(op, Native):
                k = seen[op.ranks] = seen.get(op.ranks, -1) + 1
                calls.setdefault((op.ranks, k), []).append(_node(s.rank, i))
    return [f"  {a} -> {b} [style=dotted, dir=none];"
            for nodes in calls.values() for a, b in zip(nodes, nodes[1:])]


# -- text ------------------------------------------------------------------------
def to_text(schedules: Sequence[Schedule]) -> str:
    """One line per op: ``  3: send d[0:4]->r2 #0  after 1,2``."""
    lines = []
    for s in schedules:
        scratch = ", ".join(f"{n}={c}" for n, c in s.scratch) or "none"
        extra = (f" op {s.op}" if s.op else "") + (f" root {s.root}" if s.root >= 0 else "")
        lines.append(f"rank {s.rank}: {s.collective}/{s.algorithm} over {list(s.ranks)} "
                     f"count {s.count}{extra}; scratch {scratch}")
        for i, (op, deps) in enumerate(zip(s.ops, s.deps)):
            after = f"  after {','.join(map(str, deps))}" if deps else ""
            lines.append(f"  {i:3d}: {op_label(op)}{after}")
    return "\n".join(lines) + "\n"
