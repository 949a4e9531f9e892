#!/usr/bin/env python
"""Host time per step by op kind, from a ``BENCH_TRACE`` Chrome trace (``zero3.py``).

Where does the host spend a step? For every compiled graph call (``## Call CompiledFxGraph``) the
direct children on its thread are summed by kind (the runtime's ``dc::`` ops one by one, matmuls,
attention, Inductor's Triton kernels, the rest), and the time between them ("python") is the
generated wrapper's own Python. The optimizer step and the autograd engine's own entries are
listed beside them. Divided by the number of steps the trace holds (``Optimizer.step`` entries).
The profiler inflates every op's host cost (about 20-30 us an op on the H200 host), so read the
shares, and compare traces taken the same way.

    python benchmarks/host_profile.py TRACE.json[.gz] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d


def kind(name: str) -> str:
    if name.startswith("dc::"):
        return name
    if name.startswith("triton_") or name.startswith("cpp_fused"):
        return "inductor kernels"
    if "scaled_dot_product" in name or "attention" in name:
        return "attention"
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm"):
        return "matmul"
    return "other aten / runtime"


def direct_children(events: list[dict], outer: dict) -> list[dict]:
    a, b = outer["ts"], outer["ts"] + outer["dur"]
    inside = sorted((e for e in events if a <= e["ts"] < b and e is not outer),
                    key=lambda e: (e["ts"], -e.get("dur", 0)))
    top, end = [], -1.0
    for e in inside:
        if e["ts"] >= end:
            top.append(e)
            end = e["ts"] + e.get("dur", 0)
    return top


def summarize(events: list[dict]) -> dict:
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime")
            and "dur" in e]
    steps = max(1, sum(1 for e in host if e["name"].startswith("Optimizer.step")))
    by_kind: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    graphs_ms = 0.0
    for g in (e for e in host if e["name"].startswith("## Call CompiledFxGraph")):
        same_thread = [e for e in host if e.get("tid") == g.get("tid") and e.get("pid") == g.get("pid")]
        kids = direct_children(same_thread, g)
        graphs_ms += g["dur"] / 1e3
        for k in kids:
            by_kind[kind(k["name"])] += k["dur"] / 1e3
            calls[kind(k["name"])] += 1
        by_kind["python (generated wrapper)"] += (g["dur"] - sum(k["dur"] for k in kids)) / 1e3
    opt_ms = sum(e["dur"] for e in host if e["name"].startswith("Optimizer.step")) / 1e3
    rows = sorted(by_kind.items(), key=lambda kv: -kv[1])
    return {
        "steps": steps,
        "compiled_graphs_ms_per_step": graphs_ms / steps,
        "optimizer_step_ms_per_step": opt_ms / steps,
        "by_kind_ms_per_step": {k: v / steps for k, v in rows},
        "calls_per_step": {k: calls[k] / steps for k, _ in rows if calls[k]},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--json", help="write the summary here too")
    a = p.parse_args(argv)
    s = summarize(load(a.trace))
    print(f"{s['steps']} steps; compiled graphs {s['compiled_graphs_ms_per_step']:.2f} ms/step host, "
          f"optimizer.step {s['optimizer_step_ms_per_step']:.2f} ms/step")
    for k, v in s["by_kind_ms_per_step"].items():
        n = s["calls_per_step"].get(k)
        print(f"  {v:8.2f} ms  {'' if n is None else f'{n:6.0f} calls'}  {k}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
