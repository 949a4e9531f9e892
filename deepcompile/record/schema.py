"""The run record's layout and schema (format version 1).

One directory per run::

    RUN_DIR/manifest.json            {format_version, tool, created, world_size, ranks, status, command?}
    RUN_DIR/config.json              Config.to_dict()
    RUN_DIR/rank<R>/environment.json torch/python versions, devices, hostname, world size, rank
    RUN_DIR/rank<R>/graphs/index.json          [{graph_id, kind, after, seq, file, node_count, notes, seconds}]
    RUN_DIR/rank<R>/graphs/<file>.json.gz      {graph_id, kind, after, nodes: [serialize() nodes]}
    RUN_DIR/rank<R>/profile.json.gz   (optional) {graphs: [{graph_id, kind, hardware, nodes: [...]}]}
    RUN_DIR/rank<R>/schedule.json.gz  (optional) {events: [{graph_id, kind, node, stream, start_us, end_us, source}]}
    RUN_DIR/rank<R>/memory.json.gz    (optional) the measured memory timeline of the profiled step:
                                      {source: "measured", step, categories: MEMORY_CATEGORIES,
                                       samples: [{t_ms, graph_id, kind, node, node_index, by_category,
                                                  allocated_bytes, peak_bytes}],
                                       peak: {bytes, where, t_ms, by_category, source: "measured"}};
                                      or, in a run without a profiling step, the naive estimate's
                                      samples [{node_index | t_us, allocated_bytes, source: "predicted"}]
    RUN_DIR/rank<R>/steps.jsonl       one JSON object per line: {step, time_s, loss, mem: {allocated, reserved, peak,
                                      by_category?, split?}}: by_category is the step's peak by
                                      MEMORY_CATEGORIES (no "activations" on CPU), split says how
                                      (deepcompile.profile.memory_split.step_split)

Everything is plain JSON (gzip where large). The validators here are deliberately small and
hand-written (no dependency): each raises :class:`RecordError` naming the file and the key path.
"""
from __future__ import annotations

import math
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
PLAN = "plan.json"   # the planner's choice, per rank (RunRecorder.plan; `deepcompile inspect` prints it)

GRAPH_KINDS = ("dynamo", "forward", "backward", "inference")
STREAMS = ("compute", "allgather", "reduce", "copy", "host")  # host: the cost model's launch-time span (predicted)
SOURCES = ("measured", "predicted")
COMM_FIELDS = ("alpha_us", "bytes_per_us", "copy_bytes_per_us")   # deepcompile.vocab.links.CommModel
# One vocabulary of memory, measured (memory.json.gz) and predicted (plan.json's chosen.memory):
# defined beside the memory model (deepcompile.plan.memory, no imports); every category but
# "offloaded" (host) is on the device, and those sum to a sample's allocated_bytes.
from deepcompile.vocab.memory import DEVICE_CATEGORIES, MEMORY_CATEGORIES  # noqa: E402
MEMORY_KINDS = GRAPH_KINDS + ("optimizer",)   # a memory sample is in a graph or in optimizer.step()


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


# Integers beyond int64 are no count, size or id a run writes, and they overflow the report's
# float arithmetic (int / int of 10**400 raises OverflowError); times drawn on an axis must be
# finite (a NaN start makes every tick NaN).
MAX_INT = (1 << 63) - 1


def _check_value(file: str, path: str, v: Any, types, *, finite: bool = False) -> Any:
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in _as_tuple(types))
    if not ok:
        _fail(file, path, f"expected {_tname(types)}, got {_short(v)}")
    if isinstance(v, int) and not isinstance(v, bool) and not -MAX_INT <= v <= MAX_INT:
        _fail(file, path, f"{_short(v)} is out of range (at most {MAX_INT} in magnitude)")
    if finite and isinstance(v, float) and not (math.isfinite(v) and abs(v) <= MAX_INT):
        _fail(file, path, f"expected a finite number, got {v!r}")
    return v


def _short(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 200:
        return f"an integer of {v.bit_length()} bits"   # repr of a huge int is slow and useless
    r = repr(v) if not isinstance(v, (list, dict)) else f"a {type(v).__name__} of {len(v)} item(s)"
    return r if len(r) <= 60 else r[:57] + "..."


def _field(file: str, obj: Any, key: str, types, where: str, *, optional: bool = False,
           choices: tuple | None = None, finite: bool = False, nullable: bool = False) -> Any:
    if not isinstance(obj, dict):
        _fail(file, where, f"expected an object, got {type(obj).__name__}")
    path = f"{where}.{key}" if where else key
    if key not in obj:
        if optional:
            return None
        _fail(file, path, "missing")
    v = obj[key]
    if optional and nullable and v is None:
        return None
    _check_value(file, path, v, types, finite=finite)
    if choices is not None and v not in choices:
        _fail(file, path, f"{_short(v)} is not one of {list(choices)}")
    return v


def _as_tuple(t) -> tuple:
    return t if isinstance(t, tuple) else (t,)


def _list(file: str, obj: Any, key: str, where: str, optional: bool = False) -> list:
    v = _field(file, obj, key, list, where, optional=optional)
    return v if v is not None else []


STATUSES = ("running", "complete", "failed", "interrupted")
MAX_DEPTH = 32   # nesting of a node's args: deeper is no FX graph, and would overflow recursive readers


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
    world = _field(file, m, "world_size", int, "")
    if world < 1:
        _fail(file, "world_size", f"expected at least 1, got {world}")
    ranks = _list(file, m, "ranks", "")
    for i, r in enumerate(ranks):
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world:
            _fail(file, f"ranks[{i}]", f"expected an integer from 0 to world_size - 1 ({world - 1}), got {_short(r)}")
    if len(set(ranks)) != len(ranks):
        _fail(file, "ranks", "lists a rank twice")
    _field(file, m, "status", str, "", choices=STATUSES)
    _field(file, m, "created", str, "", optional=True)
    _field(file, m, "tool", str, "", optional=True)
    _field(file, m, "reason", str, "", optional=True)
    cmd = _field(file, m, "command", dict, "", optional=True, nullable=True)
    if cmd is not None:
        check_command(file, cmd, "command")
    return m


LAUNCHERS = ("torchrun", "deepcompile demo", "none")


def check_command(file: str, c: Any, where: str) -> dict:
    """How the run was launched (``writer.launch_command``): enough to launch it again."""
    for k in ("argv", "orig_argv"):
        for i, a in enumerate(_list(file, c, k, where, optional=k == "orig_argv")):
            _check_value(file, f"{where}.{k}[{i}]", a, str)
    _field(file, c, "cwd", str, where)
    _field(file, c, "executable", str, where)
    _field(file, c, "launcher", str, where, choices=LAUNCHERS)
    w = _field(file, c, "world_size", int, where)
    if w < 1:
        _fail(file, f"{where}.world_size", f"expected at least 1, got {w}")
    env = _field(file, c, "env", dict, where, optional=True) or {}
    for k, v in env.items():
        _check_value(file, f"{where}.env.{k}", v, str)
    again = _field(file, c, "relaunch", list, where, optional=True, nullable=True) or []
    for i, a in enumerate(again):
        _check_value(file, f"{where}.relaunch[{i}]", a, str)
    _field(file, c, "why_not", str, where, optional=True)
    return c


_SCALAR = (int, float, str, bool, type(None))


def _check_pass_list(file: str, passes: Any, where: str) -> None:
    if not isinstance(passes, list):
        _fail(file, where, f"expected a list of pass names or {{name, params}} objects, got {_short(passes)}")
    for i, p in enumerate(passes):
        w = f"{where}[{i}]"
        if isinstance(p, str):
            continue
        if not isinstance(p, dict):
            _fail(file, w, f"expected a pass name or a {{name, params}} object, got {_short(p)}")
        _field(file, p, "name", str, w)
        params = _field(file, p, "params", dict, w, optional=True) or {}
        for k, v in params.items():
            if isinstance(v, list):
                for j, x in enumerate(v):
                    _check_value(file, f"{w}.params.{k}[{j}]", x, _SCALAR)
            else:
                _check_value(file, f"{w}.params.{k}", v, _SCALAR)


def check_config(file: str, c: Any) -> dict:
    """``Config.to_dict()`` as recorded. Keys are optional (another version may lack some) and
    unknown keys pass, but the keys that readers use must have their types."""
    if not isinstance(c, dict):
        _fail(file, "", "expected a JSON object")
    def typed(key, types, where="", obj=c, nullable=False):
        # absent is fine; present must have the type (null only where Config writes null)
        if key in obj and not (nullable and obj[key] is None):
            _check_value(file, f"{where}.{key}" if where else key, obj[key], types)

    typed("zero_stage", int)
    typed("compiler", str)
    typed("warmup_compiler", str, nullable=True)
    typed("profile_step", int, nullable=True)
    for k in ("gradient_accumulation_steps", "reduce_bucket_size", "max_inflight_reduces"):
        typed(k, int)
    typed("auto_schedule", bool)
    typed("mixed_precision", dict)
    for k in ("param_dtype", "reduce_dtype"):
        typed(k, str, "mixed_precision", c.get("mixed_precision") or {})
    if "passes" in c:
        _check_pass_list(file, c["passes"], "passes")
    typed("schedule", list)
    for i, e in enumerate(c.get("schedule") or []):
        _field(file, e, "step", int, f"schedule[{i}]")
        _check_pass_list(file, e.get("passes", []), f"schedule[{i}].passes")
    return c


def check_environment(file: str, e: Any) -> dict:
    if not isinstance(e, dict):
        _fail(file, "", "expected a JSON object")
    for k in ("torch", "python", "hostname"):
        _field(file, e, k, str, "")
    _field(file, e, "world_size", int, "")
    _field(file, e, "rank", int, "")
    for i, d in enumerate(_list(file, e, "devices", "")):
        _check_value(file, f"devices[{i}]", d, str)
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
        _field(file, e, "seconds", _NUM, w, optional=True, finite=True)
    return idx


def _check_arg(file: str, a: Any, where: str, depth: int = 0) -> None:
    """A node argument: a literal, a list, or an object; ``{"node": NAME}`` names another node."""
    if depth > MAX_DEPTH:
        _fail(file, where, f"nested more than {MAX_DEPTH} levels deep")
    if isinstance(a, list):
        for i, x in enumerate(a):
            _check_arg(file, x, f"{where}[{i}]", depth + 1)
    elif isinstance(a, dict):
        if set(a) == {"node"}:
            _check_value(file, f"{where}.node", a["node"], str)
        for k, x in a.items():
            _check_arg(file, x, f"{where}.{k}", depth + 1)
    else:
        _check_value(file, where, a, _SCALAR)


def _check_shape(file: str, shape: Any, where: str) -> None:
    """Sizes (int, or str for a symbolic size), or a list of those for a tuple output."""
    if shape is None:
        return
    if not isinstance(shape, list):
        _fail(file, where, f"expected a list of sizes or null, got {_short(shape)}")
    for i, s in enumerate(shape):
        for j, x in enumerate(s) if isinstance(s, list) else [(None, s)]:
            w = f"{where}[{i}]" + ("" if j is None else f"[{j}]")
            _check_value(file, w, x, (int, str))
            if isinstance(x, int) and x < 0:
                _fail(file, w, f"a size cannot be negative, got {x}")


# A record holds thousands of nodes, and checking each field with its path spelled out took
# most of a read (a 2-rank demo record: 60% of 120 ms). So each node is first accepted by the
# checks below, which build no paths and accept only what the checks with paths accept (exact
# JSON types); a node they do not accept is checked again with paths, which names the field.
def _int_ok(v: Any) -> bool:
    return type(v) is int and -MAX_INT <= v <= MAX_INT


def _arg_ok(a: Any, depth: int) -> bool:
    """What :func:`_check_arg` accepts (or less)."""
    if depth > MAX_DEPTH:
        return False
    t = type(a)
    if t is list:
        for x in a:
            if not _arg_ok(x, depth + 1):
                return False
        return True
    if t is dict:
        if len(a) == 1 and "node" in a and type(a["node"]) is not str:
            return False
        for x in a.values():
            if not _arg_ok(x, depth + 1):
                return False
        return True
    return t is str or t is float or t is bool or a is None or _int_ok(a)


def _size_ok(x: Any) -> bool:
    return type(x) is str or (type(x) is int and 0 <= x <= MAX_INT)


def _node_ok(n: Any) -> bool:
    """What one iteration of :func:`check_nodes` accepts (or less)."""
    if type(n) is not dict:
        return False
    for k in ("name", "op", "target", "scope"):
        if type(n.get(k)) is not str:
            return False
    args = n.get("args")
    if type(args) is not list or not _arg_ok(args, 0):
        return False
    shape = n.get("shape")
    if shape is not None:
        if type(shape) is not list:
            return False
        for sz in shape:
            if type(sz) is list:
                if not all(_size_ok(x) for x in sz):
                    return False
            elif not _size_ok(sz):
                return False
    if n.get("dtype") is not None and type(n["dtype"]) is not str:
        return False
    if "kwargs" in n and (type(n["kwargs"]) is not dict or not _arg_ok(n["kwargs"], 0)):
        return False
    if "param" in n and not _int_ok(n["param"]):
        return False
    return "recompute_of" not in n or type(n["recompute_of"]) is str


def check_nodes(file: str, nodes: Any, where: str = "nodes") -> list:
    if not isinstance(nodes, list):
        _fail(file, where, "expected a list of nodes")
    for i, n in enumerate(nodes):
        if not _node_ok(n):
            _check_node(file, n, f"{where}[{i}]")
    return nodes


def _check_node(file: str, n: Any, w: str) -> None:
    """One node, each field checked with its path (``w``: the node's own)."""
    _field(file, n, "name", str, w)
    _field(file, n, "op", str, w)
    _field(file, n, "target", str, w)
    _check_arg(file, _field(file, n, "args", list, w), f"{w}.args")
    _field(file, n, "scope", str, w)
    _check_shape(file, n.get("shape"), f"{w}.shape")
    _field(file, n, "dtype", str, w, optional=True, nullable=True)   # null: not a tensor
    kw = _field(file, n, "kwargs", dict, w, optional=True)
    if kw:
        _check_arg(file, kw, f"{w}.kwargs")
    _field(file, n, "param", int, w, optional=True)
    _field(file, n, "recompute_of", str, w, optional=True)


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
        comm = _field(file, g, "comm", dict, w, optional=True, nullable=True)
        if comm is not None:   # vocab.links.CommModel(**comm): exactly its fields; rates divide
            if set(comm) != set(COMM_FIELDS):
                _fail(file, f"{w}.comm", f"expected the keys {list(COMM_FIELDS)}, got {sorted(comm)}")
            for k in COMM_FIELDS:
                v = _field(file, comm, k, _NUM, f"{w}.comm", finite=True)
                if v < 0 or (v == 0 and k != "alpha_us"):
                    _fail(file, f"{w}.comm.{k}", f"expected a positive number, got {v!r}")
        host = _field(file, g, "host", dict, w, optional=True, nullable=True)
        if host is not None:   # profile.host.host_benchmark: the host model's calibration
            for k in ("dispatch_us", "python_us"):
                v = _field(file, host, k, _NUM, f"{w}.host", optional=True, finite=True)
                if v is not None and v < 0:
                    _fail(file, f"{w}.host.{k}", f"expected a time of at least 0, got {v!r}")
            _field(file, host, "device", str, f"{w}.host", optional=True)
            for k, v in (_field(file, host, "ops_us", dict, f"{w}.host", optional=True) or {}).items():
                _check_value(file, f"{w}.host.ops_us.{k}", v, _NUM, finite=True)
                if v < 0:
                    _fail(file, f"{w}.host.ops_us.{k}", f"expected a time of at least 0, got {v!r}")
        v = _field(file, g, "optimizer_ms", _NUM, w, optional=True, finite=True)
        if v is not None and v < 0:
            _fail(file, f"{w}.optimizer_ms", f"expected a time of at least 0, got {v!r}")
        _field(file, g, "optimizer_peak_bytes", int, w, optional=True)
        su = _field(file, g, "sustained", dict, w, optional=True, nullable=True)
        if su is not None:   # profile.sustained: the busy step's clock against the profiled one
            v = _field(file, su, "ratio", _NUM, f"{w}.sustained", finite=True)
            if v < 1.0:
                _fail(file, f"{w}.sustained.ratio", f"expected a ratio of at least 1, got {v!r}")
        v = _field(file, g, "state_streamed_bytes", int, w, optional=True)
        if v is not None and v < 0:
            _fail(file, f"{w}.state_streamed_bytes", f"expected a byte count of at least 0, got {v!r}")
        for j, n in enumerate(_list(file, g, "nodes", w)):
            wn = f"{w}.nodes[{j}]"
            _field(file, n, "name", str, wn)
            _field(file, n, "target", str, wn, optional=True)
            for k in ("latency_ms",):
                _field(file, n, k, _NUM, wn, optional=True, finite=True)
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
        a = _field(file, e, "start_us", _NUM, w, finite=True)
        b = _field(file, e, "end_us", _NUM, w, finite=True)
        if b < a:
            _fail(file, w, f"end_us {b} is before start_us {a}")
        _field(file, e, "source", str, w, choices=SOURCES)
    return s


def _check_categories(file: str, obj: Any, where: str) -> dict:
    d = _field(file, obj, "by_category", dict, where)
    for k, v in d.items():
        if k not in MEMORY_CATEGORIES:
            _fail(file, f"{where}.by_category", f"{_short(k)} is not one of {list(MEMORY_CATEGORIES)}")
        _check_value(file, f"{where}.by_category.{k}", v, int)
        if v < 0:
            _fail(file, f"{where}.by_category.{k}", f"bytes cannot be negative, got {v}")
    return d


def check_memory(file: str, m: Any) -> dict:
    if not isinstance(m, dict):
        _fail(file, "", "expected a JSON object")
    _field(file, m, "source", str, "", optional=True, choices=SOURCES)
    _field(file, m, "step", int, "", optional=True)
    _field(file, m, "device", str, "", optional=True)
    cats = _list(file, m, "categories", "", optional=True)
    for i, c in enumerate(cats):
        if c not in MEMORY_CATEGORIES:
            _fail(file, f"categories[{i}]", f"{_short(c)} is not one of {list(MEMORY_CATEGORIES)}")
    for i, e in enumerate(_list(file, m, "samples", "")):
        w = f"samples[{i}]"
        if not isinstance(e, dict) or ("t_us" not in e and "node_index" not in e and "t_ms" not in e):
            _fail(file, w, "each sample needs t_ms, t_us or node_index")
        _field(file, e, "t_ms", _NUM, w, optional=True, finite=True)
        _field(file, e, "t_us", _NUM, w, optional=True, finite=True)
        _field(file, e, "node_index", int, w, optional=True)
        _field(file, e, "allocated_bytes", int, w)
        _field(file, e, "peak_bytes", int, w, optional=True)
        _field(file, e, "reserved_bytes", int, w, optional=True)
        _field(file, e, "graph_id", int, w, optional=True)
        _field(file, e, "kind", str, w, optional=True, choices=MEMORY_KINDS)
        _field(file, e, "source", str, w, optional=True, choices=SOURCES)
        _field(file, e, "node", str, w, optional=True)
        if "by_category" in e:
            _check_categories(file, e, w)
    peak = _field(file, m, "peak", dict, "", optional=True, nullable=True)
    if peak is not None:
        b = _field(file, peak, "bytes", int, "peak")
        if b < 0:
            _fail(file, "peak.bytes", f"bytes cannot be negative, got {b}")
        _field(file, peak, "where", str, "peak")
        _field(file, peak, "source", str, "peak", choices=SOURCES)
        _field(file, peak, "t_ms", _NUM, "peak", optional=True, finite=True)
        if "by_category" in peak:
            _check_categories(file, peak, "peak")
    return m


def check_plan(file: str, p: Any) -> dict:
    """``plan.json`` (``RunRecorder.plan``), as far as readers use it: the chosen plan's
    predicted memory (``PlanMemory.to_dict``) and step time."""
    if not isinstance(p, dict):
        _fail(file, "", "expected a JSON object")
    c = _field(file, p, "chosen", dict, "")
    _field(file, c, "step_ms", _NUM, "chosen", optional=True, finite=True)
    _field(file, c, "peak_bytes", int, "chosen", optional=True)
    mem = _field(file, c, "memory", dict, "chosen", optional=True)
    if mem is not None:
        for k, v in mem.items():
            if k == "by_category":
                _check_categories(file, mem, "chosen.memory")
            elif k == "peak_at":
                _check_value(file, "chosen.memory.peak_at", v, str)
            elif k == "step_state" and v is None:   # the step holds all the state (not streamed)
                continue
            else:
                _check_value(file, f"chosen.memory.{k}", v, int)
    _field(file, p, "summary", str, "", optional=True)
    _field(file, p, "why", str, "", optional=True)
    pace = _field(file, p, "pace", dict, "", optional=True, nullable=True)   # planner.pace: host- or GPU-bound
    if pace is not None:
        _field(file, pace, "bound", str, "pace", choices=("host", "gpu"))
        for k in ("host_ms", "gpu_busy_ms"):
            _field(file, pace, k, _NUM, "pace", finite=True)
    return p


def check_step(file: str, line_no: int, s: Any) -> dict:
    """One step. ``time_s`` and ``loss`` may be NaN or infinite: a diverged run logs them."""
    w = f"line {line_no}"
    _field(file, s, "step", int, w)
    _field(file, s, "time_s", _NUM, w)
    _field(file, s, "loss", _NUM, w, optional=True, nullable=True)   # null: no loss reported
    mem = _field(file, s, "mem", dict, w, optional=True, nullable=True)
    if mem:
        for k in ("allocated", "reserved", "peak"):
            _field(file, mem, k, int, f"{w}.mem", optional=True)
        if "by_category" in mem:   # the step's peak by category (memory_split.step_split), how in "split"
            _check_categories(file, mem, f"{w}.mem")
        _field(file, mem, "split", str, f"{w}.mem", optional=True)
    return s
