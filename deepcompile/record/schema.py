"""The run record's layout and schema (format version 1).

One directory per run::

    RUN_DIR/manifest.json            {format_version, tool, created, world_size, ranks, status}
    RUN_DIR/config.json              Config.to_dict()
    RUN_DIR/rank<R>/environment.json torch/python versions, devices, hostname, world size, rank
    RUN_DIR/rank<R>/graphs/index.json          [{graph_id, kind, after, seq, file, node_count, notes, seconds}]
    RUN_DIR/rank<R>/graphs/<file>.json.gz      {graph_id, kind, after, nodes: [serialize() nodes]}
    RUN_DIR/rank<R>/profile.json.gz   (optional) {graphs: [{graph_id, kind, hardware, nodes: [...]}]}
    RUN_DIR/rank<R>/schedule.json.gz  (optional) {events: [{graph_id, kind, node, stream, start_us, end_us, source}]}
    RUN_DIR/rank<R>/memory.json.gz    (optional) {samples: [{t_us | node_index, allocated_bytes, reserved_bytes, ...}]}
    RUN_DIR/rank<R>/steps.jsonl       one JSON object per line: {step, time_s, loss, mem: {allocated, reserved, peak}}

Everything is plain JSON (gzip where large). The validators here are deliberately small and
hand-written (no dependency): each raises :class:`RecordError` naming the file and the key path.
"""
from __future__ import annotations

from typing import Any

FORMAT_VERSION = 1

MANIFEST = "manifest.json"
CONFIG = "config.json"
ENVIRONMENT = "environment.json"
GRAPHS_DIR = "graphs"
GRAPH_INDEX = "index.json"
PROFILE = "profile.json.gz"
SCHEDULE = "schedule.json.gz"
MEMORY = "memory.json.gz"
STEPS = "steps.jsonl"

GRAPH_KINDS = ("dynamo", "forward", "backward", "inference")
STREAMS = ("compute", "allgather", "reduce", "copy")
SOURCES = ("measured", "predicted")


class RecordError(Exception):
    """A run record that cannot be read: missing, truncated, hand-edited wrongly or from another
    format version. The message names the file and what is wrong with it."""


def rank_dir_name(rank: int) -> str:
    return f"rank{int(rank)}"


# ---------------------------------------------------------------- tiny validators
_NUM = (int, float)


def _fail(file: str, where: str, msg: str):
    raise RecordError(f"{file}: {where}: {msg}" if where else f"{file}: {msg}")


def _tname(t) -> str:
    if isinstance(t, tuple):
        return " or ".join(_tname(x) for x in t)
    return {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object",
            bool: "true/false", type(None): "null"}.get(t, t.__name__)


def _field(file: str, obj: Any, key: str, types, where: str, *, optional: bool = False,
           choices: tuple | None = None) -> Any:
    if not isinstance(obj, dict):
        _fail(file, where, f"expected an object, got {type(obj).__name__}")
    path = f"{where}.{key}" if where else key
    if key not in obj:
        if optional:
            return None
        _fail(file, path, "missing")
    v = obj[key]
    if optional and v is None:
        return None
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in _as_tuple(types))
    if not ok:
        _fail(file, path, f"expected {_tname(types)}, got {v!r:.60}")
    if choices is not None and v not in choices:
        _fail(file, path, f"{v!r} is not one of {list(choices)}")
    return v


def _as_tuple(t) -> tuple:
    return t if isinstance(t, tuple) else (t,)


def _list(file: str, obj: Any, key: str, where: str, optional: bool = False) -> list:
    v = _field(file, obj, key, list, where, optional=optional)
    return v if v is not None else []


def check_manifest(file: str, m: Any) -> dict:
    if not isinstance(m, dict):
        _fail(file, "", "expected a JSON object")
    v = _field(file, m, "format_version", int, "")
    if v > FORMAT_VERSION:
        _fail(file, "format_version",
              f"this record has format version {v}, newer than the {FORMAT_VERSION} this deepcompile "
              "reads; upgrade deepcompile to read it")
    if v < 1:
        _fail(file, "format_version", f"{v} is not a valid format version")
    _field(file, m, "world_size", int, "")
    ranks = _list(file, m, "ranks", "")
    for i, r in enumerate(ranks):
        if not isinstance(r, int) or isinstance(r, bool):
            _fail(file, f"ranks[{i}]", f"expected an integer, got {r!r}")
    _field(file, m, "status", str, "", choices=("running", "complete", "failed"))
    _field(file, m, "created", str, "", optional=True)
    return m


def check_environment(file: str, e: Any) -> dict:
    if not isinstance(e, dict):
        _fail(file, "", "expected a JSON object")
    for k in ("torch", "python", "hostname"):
        _field(file, e, k, str, "")
    _field(file, e, "world_size", int, "")
    _field(file, e, "rank", int, "")
    _list(file, e, "devices", "")
    return e


def check_graph_index(file: str, idx: Any) -> list:
    if not isinstance(idx, list):
        _fail(file, "", "expected a JSON list of graph versions")
    for i, e in enumerate(idx):
        w = f"[{i}]"
        _field(file, e, "graph_id", int, w)
        _field(file, e, "kind", str, w, choices=GRAPH_KINDS)
        _field(file, e, "after", str, w)
        _field(file, e, "seq", int, w)
        _field(file, e, "file", str, w)
        _field(file, e, "node_count", int, w)
        notes = _list(file, e, "notes", w, optional=True)
        if not all(isinstance(n, str) for n in notes):
            _fail(file, f"{w}.notes", "expected a list of strings")
        _field(file, e, "seconds", _NUM, w, optional=True)
    return idx


def check_nodes(file: str, nodes: Any, where: str = "nodes") -> list:
    if not isinstance(nodes, list):
        _fail(file, where, "expected a list of nodes")
    for i, n in enumerate(nodes):
        w = f"{where}[{i}]"
        _field(file, n, "name", str, w)
        _field(file, n, "op", str, w)
        _field(file, n, "target", str, w)
        _field(file, n, "args", list, w)
        _field(file, n, "scope", str, w)
    return nodes


def check_graph(file: str, g: Any) -> dict:
    if not isinstance(g, dict):
        _fail(file, "", "expected a JSON object")
    _field(file, g, "graph_id", int, "")
    _field(file, g, "kind", str, "", choices=GRAPH_KINDS)
    _field(file, g, "after", str, "")
    check_nodes(file, g.get("nodes"), "nodes")
    return g


def check_profile(file: str, p: Any) -> dict:
    if not isinstance(p, dict):
        _fail(file, "", "expected a JSON object")
    for i, g in enumerate(_list(file, p, "graphs", "")):
        w = f"graphs[{i}]"
        _field(file, g, "graph_id", int, w)
        _field(file, g, "kind", str, w, choices=GRAPH_KINDS)
        _field(file, g, "hardware", (str, dict), w, optional=True)
        for j, n in enumerate(_list(file, g, "nodes", w)):
            wn = f"{w}.nodes[{j}]"
            _field(file, n, "name", str, wn)
            for k in ("latency_ms",):
                _field(file, n, k, _NUM, wn, optional=True)
            for k in ("mem_after_bytes", "peak_bytes", "out_bytes"):
                _field(file, n, k, int, wn, optional=True)
    return p


def check_schedule(file: str, s: Any) -> dict:
    if not isinstance(s, dict):
        _fail(file, "", "expected a JSON object")
    for i, e in enumerate(_list(file, s, "events", "")):
        w = f"events[{i}]"
        _field(file, e, "graph_id", int, w)
        _field(file, e, "kind", str, w, choices=GRAPH_KINDS)
        _field(file, e, "node", str, w)
        _field(file, e, "stream", str, w, choices=STREAMS)
        a = _field(file, e, "start_us", _NUM, w)
        b = _field(file, e, "end_us", _NUM, w)
        if b < a:
            _fail(file, w, f"end_us {b} is before start_us {a}")
        _field(file, e, "source", str, w, choices=SOURCES)
    return s


def check_memory(file: str, m: Any) -> dict:
    if not isinstance(m, dict):
        _fail(file, "", "expected a JSON object")
    for i, e in enumerate(_list(file, m, "samples", "")):
        w = f"samples[{i}]"
        if not isinstance(e, dict) or ("t_us" not in e and "node_index" not in e):
            _fail(file, w, "each sample needs t_us or node_index")
        _field(file, e, "t_us", _NUM, w, optional=True)
        _field(file, e, "node_index", int, w, optional=True)
        _field(file, e, "allocated_bytes", int, w)
        _field(file, e, "reserved_bytes", int, w, optional=True)
        _field(file, e, "graph_id", int, w, optional=True)
        _field(file, e, "kind", str, w, optional=True, choices=GRAPH_KINDS)
        _field(file, e, "source", str, w, optional=True, choices=SOURCES)
    return m


def check_step(file: str, line_no: int, s: Any) -> dict:
    w = f"line {line_no}"
    _field(file, s, "step", int, w)
    _field(file, s, "time_s", _NUM, w)
    _field(file, s, "loss", _NUM, w, optional=True)
    mem = _field(file, s, "mem", dict, w, optional=True)
    if mem:
        for k in ("allocated", "reserved", "peak"):
            _field(file, mem, k, int, f"{w}.mem", optional=True)
    return s
