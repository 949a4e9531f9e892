"""The measured schedule: one training step under the PyTorch profiler, mapped back to
graph ids, graph kinds and streams (compute, allgather, reduce, copy).

On GPU every CUDA kernel becomes an event on its stream class (NCCL AllGather kernels on
``allgather``, ReduceScatter on ``reduce``, memcpy on ``copy``, the rest ``compute``), attributed to
the compiled forward/backward graph whose host-side call launched it, and named after the
innermost operator that launched it. Without CUDA the host-side operators themselves are the
events (time spent blocked in ``wait_allgather`` shows as the exposed allgather).
"""
from __future__ import annotations

import bisect
import contextlib
import json
import os
import re
import sys
import tempfile
from typing import Callable

import torch


def union(intervals):
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def intersection_length(a, b) -> float:
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            tot += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def overlap_summary(events: list[dict]) -> dict:
    comm = union([(e["start_us"], e["end_us"]) for e in events if e["stream"] in ("allgather", "reduce")])
    comp = union([(e["start_us"], e["end_us"]) for e in events if e["stream"] == "compute"])
    comm_t = sum(e - s for s, e in comm)
    ov = intersection_length(comm, comp)
    return {"compute_busy_us": sum(e - s for s, e in comp), "comm_busy_us": comm_t,
            "comm_overlapped_us": ov, "overlap_fraction": (ov / comm_t) if comm_t else None}


def _stream_of(name: str) -> str:
    n = name.lower()
    if "allgather" in n or "all_gather" in n:
        return "allgather"
    if "reducescatter" in n or "reduce_scatter" in n or "reduce_grad" in n or "end_backward" in n:
        return "reduce"
    if "memcpy" in n:
        return "copy"
    return "compute"


def _target_key(name: str) -> str | None:
    """Host op name -> the record's target without overload ("aten::mm" -> "aten.mm")."""
    ns, sep, op = name.partition("::")
    return f"{ns}.{op.split('.')[0]}" if sep and ns in ("aten", "dc") else None


def _node_key(target: str) -> str:
    parts = (target or "").split(".")
    return ".".join(parts[:2])


def _top_level_nodes(cpu: list[dict], regions: list[tuple], graphs: dict, exact_aten: bool) -> dict:
    """(tid, ts) of each top-level host op inside a compiled graph -> that graph's node name.

    The graph's code calls its nodes' ops in order, so the k-th top-level call of an op is the
    k-th node with that target. That holds exactly for our ``dc`` ops under every compiler; for
    ``aten`` ops only where the graph runs as written (aot_eager, eager), not under Inductor,
    which fuses them into its own kernels."""
    out: dict = {}
    for start, end, gid, kind, tid in regions:
        nodes = graphs.get((gid, kind))
        if not nodes:
            continue
        by_key: dict[str, list[str]] = {}
        for n in nodes:
            if n.get("op") == "call_function":
                k = _node_key(n.get("target", ""))
                if k.startswith("dc.") or exact_aten:
                    by_key.setdefault(k, []).append(n["name"])
        seen: dict[str, int] = {}
        top_end = -1.0
        for e in cpu:
            if e.get("tid") != tid or not (start < e["ts"] <= end) or e["name"] in (
                    "CompiledFunction", "CompiledFunctionBackward"):
                continue
            if e["ts"] < top_end:
                continue  # nested inside the previous top-level op
            top_end = e["ts"] + e["dur"]
            key = _target_key(e["name"])
            if key is None:
                continue
            i = seen.get(key, 0)
            seen[key] = i + 1
            names = by_key.get(key)
            if names is not None and i < len(names):
                out[(tid, e["ts"])] = (names[i], e["ts"] + e["dur"])
    return out


def schedule_from_trace(trace: dict, graphs: dict | None = None, exact_aten: bool = False) -> list[dict]:
    """Measured schedule events from a chrome trace. With ``graphs`` ({(graph_id, kind): final
    version's nodes}) each event also names the graph node it belongs to (``graph_node``), and
    that name becomes its ``node``, so selecting a measured bar selects the node in the graph."""
    evs = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and "dur" in e and "ts" in e]
    cpu = [e for e in evs if e.get("cat") == "cpu_op"]
    fw = sorted((e for e in cpu if e["name"] == "CompiledFunction"), key=lambda e: e["ts"])
    bw = sorted((e for e in cpu if e["name"] == "CompiledFunctionBackward"), key=lambda e: e["ts"])
    regions = [(e["ts"], e["ts"] + e["dur"], i, "forward") for i, e in enumerate(fw)]
    regions += [(e["ts"], e["ts"] + e["dur"], len(bw) - 1 - i, "backward") for i, e in enumerate(bw)]
    regions.sort()
    tids = {(e["ts"], e["name"]): e.get("tid") for e in fw + bw}
    cpu_sorted = sorted(cpu, key=lambda e: e["ts"])
    top = _top_level_nodes(cpu_sorted, [(a, b, g, k, tids.get((a, "CompiledFunction" if k == "forward" else
                                                                   "CompiledFunctionBackward")))
                                        for a, b, g, k in regions], graphs or {}, exact_aten)
    top_by_tid: dict = {}
    for (tid, ts), v in top.items():
        top_by_tid.setdefault(tid, []).append((ts, v[1], v[0]))
    for v in top_by_tid.values():
        v.sort()

    def graph_node(tid, ts):
        v = top_by_tid.get(tid)
        if not v:
            return None
        k = bisect.bisect_right(v, (ts, float("inf"), "")) - 1
        return v[k][2] if k >= 0 and ts <= v[k][1] else None
    starts = [r[0] for r in regions]

    def region_of(ts):
        k = bisect.bisect_right(starts, ts) - 1
        return regions[k] if k >= 0 and ts <= regions[k][1] else None

    # innermost host operator containing a timestamp, per thread
    by_tid: dict = {}
    for e in cpu:
        by_tid.setdefault(e.get("tid"), []).append(e)
    tid_starts = {}
    for tid, v in by_tid.items():
        v.sort(key=lambda e: e["ts"])
        tid_starts[tid] = [e["ts"] for e in v]

    def innermost(tid, ts):
        # nested host ranges: the innermost one containing ts is the latest-starting container
        ops, st = by_tid.get(tid, ()), tid_starts.get(tid, ())
        k = bisect.bisect_right(st, ts) - 1
        while k >= 0:
            e = ops[k]
            if ts <= e["ts"] + e["dur"] and e["name"] not in ("CompiledFunction", "CompiledFunctionBackward"):
                return e
            k -= 1
            if ts - ops[k]["ts"] > 5e6 if k >= 0 else True:
                break
        return None

    def enclosing_dc(tid, ts):
        ops, st = by_tid.get(tid, ()), tid_starts.get(tid, ())
        k = bisect.bisect_right(st, ts) - 1
        for _ in range(64):
            if k < 0:
                return None
            e = ops[k]
            if e["name"].startswith("dc::") and ts <= e["ts"] + e["dur"]:
                return e
            k -= 1
        return None

    kernels = [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy")]
    out: list[dict] = []
    if kernels:
        launch = {e["args"]["correlation"]: e for e in evs if e.get("cat") in ("cuda_runtime", "cuda_driver")
                  and isinstance(e.get("args"), dict) and "correlation" in e["args"]}
        for k in kernels:
            rt = launch.get((k.get("args") or {}).get("correlation"))
            if rt is None:
                continue
            reg = region_of(rt["ts"])
            if reg is None:
                continue  # the optimizer step and anything else outside compiled graphs
            op = innermost(rt.get("tid"), rt["ts"])
            if op is not None and not op["name"].startswith(("aten::", "dc::")):
                op = enclosing_dc(rt.get("tid"), rt["ts"]) or op  # name comm by our op, not c10d's
            stream = _stream_of(k["name"]) if k.get("cat") == "kernel" else "copy"
            out.append({"graph_id": reg[2], "kind": reg[3], "node": (op["name"] if op else k["name"])[:120],
                        "kernel": k["name"][:120], "stream": stream, "start_us": float(k["ts"]),
                        "end_us": float(k["ts"] + k["dur"]), "source": "measured",
                        "graph_node": graph_node(rt.get("tid"), rt["ts"])})
    else:
        for tid, ops in by_tid.items():
            for e in ops:
                reg = region_of(e["ts"])
                if reg is None or e["name"] in ("CompiledFunction", "CompiledFunctionBackward"):
                    continue
                inner = innermost(tid, e["ts"] + e["dur"] / 2)
                if inner is not e:
                    continue  # keep leaf operators only
                out.append({"graph_id": reg[2], "kind": reg[3], "node": e["name"][:120],
                            "stream": _stream_of(e["name"]) if e["name"].startswith("dc::") else "compute",
                            "start_us": float(e["ts"]), "end_us": float(e["ts"] + e["dur"]), "source": "measured",
                            "graph_node": graph_node(tid, e["ts"])})
    for e in out:  # the graph's name for the bar where known; the profiler's op name stays in "op"
        gn = e.pop("graph_node")
        if gn is not None:
            e["op"], e["node"] = e["node"], gn
    if out:
        t0 = min(e["start_us"] for e in out)
        for e in out:
            e["start_us"] -= t0
            e["end_us"] -= t0
    return out


def final_graphs(versions) -> dict:
    """{(graph_id, kind): nodes} of the latest version of every compiled graph."""
    last = {}
    for v in versions:
        d = v if isinstance(v, dict) else vars(v)
        if d["kind"] != "dynamo":
            last[(d["graph_id"], d["kind"])] = d["nodes"]
    return last


_KINETO_MARKER = re.compile(rb"^USDT:.*\] profiler_(start|stop)\s*$")


@contextlib.contextmanager
def _without_kineto_markers():
    """Drop the ``USDT: ... profiler_start`` / ``profiler_stop`` lines that kineto (the profiler
    library inside torch) writes to stderr when a trace starts and stops; they are noise in the
    demo's output and in a notebook cell. The only setting that hides them, ``KINETO_LOG_LEVEL``
    above kineto's USDT level, is read once per process and hides kineto's errors as well. So
    file descriptor 2 goes to a temporary file for the duration of the start or the stop only,
    and everything in it but those two lines is written back. A ``KINETO_LOG_LEVEL`` set by the
    user is left to speak."""
    saved = None
    if not os.environ.get("KINETO_LOG_LEVEL"):
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError):   # no stderr to filter
            saved = None
    if saved is None:
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = b"".join(ln for ln in tmp.read().splitlines(keepends=True) if not _KINETO_MARKER.match(ln))
            while kept:
                kept = kept[os.write(2, kept):]


def measure_step(step: Callable[[], None], graphs: Callable[[], dict] | None = None,
                 exact_aten: bool = False) -> tuple[list[dict], dict]:
    """Run ``step`` once under the profiler; return (schedule events, overlap summary).
    ``graphs()`` (called after the step) gives the compiled graphs to name the events' nodes."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    prof = profile(activities=acts)
    with _without_kineto_markers():
        prof.__enter__()
    try:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        with _without_kineto_markers():
            prof.__exit__(*sys.exc_info())
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.remove(path)
    events = schedule_from_trace(trace, graphs() if graphs is not None else None, exact_aten)
    return events, overlap_summary(events)
