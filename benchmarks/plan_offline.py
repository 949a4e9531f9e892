#!/usr/bin/env python
"""The planner, run offline on a recorded run (graphs + agreed profile), without a GPU: which plan
it would choose under a memory limit, every candidate's predicted step and peak, and, with
``--gb-per-s``, under another link speed (the recorded profile's communication model with its
bandwidth replaced: what --slow-links measures on the GPUs).

    BENCH_GRAPHS=DIR torchrun ... benchmarks/zero3.py --systems dc_default   # a run record in DIR/dc_default
    python benchmarks/plan_offline.py benchmarks/results/zero3_h200_2gpu_dc_default_record \
        --world 2 --limit-gib 126.9 [--gb-per-s 40] [--optimizer-peak-gib 8.5]

The graphs the planner runs its passes on are rebuilt from the record's serialized graphs of the
profiled compile (``after == "zero3"``): dc ops get their real operators (the passes match them),
every other op a stand-in of the same name (the cost model matches ops by name), every value a
meta tensor of its recorded shape. The parameters' sizes come from the gathers' shapes.
"""
from __future__ import annotations

import argparse
import dataclasses
import operator
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.fx as fx  # noqa: E402

from deepcompile.plan import planner as P  # noqa: E402
from deepcompile.plan.memory import GIB, facts_from_profile  # noqa: E402
from deepcompile.profile.profiler import Profile  # noqa: E402
from deepcompile.record.reader import read_run  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
          "bool": torch.bool, "int32": torch.int32, "float64": torch.float64, "uint8": torch.uint8}
_STANDINS: dict[str, object] = {}


def _standin(name: str):
    """A callable whose ``__name__`` is the recorded target (``record.graph.target_name`` gives it back)."""
    if name not in _STANDINS:
        def f(*a, **k):
            raise RuntimeError(f"{name}: a stand-in for planning, not runnable")
        f.__name__ = f.__qualname__ = name
        _STANDINS[name] = f
    return _STANDINS[name]


def _target(t: str):
    if t in ("getitem", "_operator.getitem", "operator.getitem"):
        return operator.getitem
    parts = t.split(".")
    if parts[0] == "dc":
        return getattr(torch.ops.dc, parts[1]).default
    return _standin(t)


def _val(shape, dtype):
    if not isinstance(shape, list):
        return None
    if shape and all(isinstance(s, list) for s in shape):
        return [torch.empty(s, device="meta") for s in shape]
    if all(isinstance(s, int) for s in shape):
        return torch.empty(shape, dtype=DTYPES.get(dtype or "", torch.float32), device="meta")
    return None


def rebuild(nodes: list[dict]) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[str, fx.Node] = {}

    def arg(a):
        if isinstance(a, dict) and set(a) == {"node"}:
            return env[a["node"]]
        if isinstance(a, list):
            return [arg(x) for x in a]
        if isinstance(a, dict):
            return {k: arg(v) for k, v in a.items()}
        return a

    for n in nodes:
        if n["op"] == "placeholder":
            node = g.placeholder(n["name"])
        elif n["op"] == "output":
            g.output(arg(n["args"][0]))
            continue
        else:
            node = g.create_node(n["op"], _target(n["target"]), tuple(arg(n["args"])), arg(n.get("kwargs") or {}),
                                 name=n["name"])
        if node.name != n["name"]:
            raise RuntimeError(f"node {n['name']!r} came back as {node.name!r}")
        env[n["name"]] = node
        v = _val(n.get("shape"), n.get("dtype"))
        if v is not None:
            node.meta["val"] = v
        if "param" in n:
            node.meta["dc_param"] = n["param"]
    return fx.GraphModule(torch.nn.Module(), g)


@dataclasses.dataclass
class Meta:  # what the planner and the passes read of runtime.ops.ParamMeta
    id: int
    chunk: int
    dtype: torch.dtype
    gather_dtype: torch.dtype
    requires_grad: bool = True


def param_meta(nodes: list[dict]) -> dict[int, Meta]:
    """From the forward's gathers: the shard (the gather's input placeholder) and the gathered value."""
    by = {n["name"]: n for n in nodes}
    out = {}
    for n in nodes:
        if n.get("target") == "dc.wait_allgather":
            issue = by[n["args"][0]["node"]]
            pid = int(n["args"][1])
            shard = by[issue["args"][0]["node"]] if issue.get("target") == "dc.allgather_param" else None
            if shard is None or pid in out:
                continue
            chunk = 1
            for s in shard["shape"]:
                chunk *= s
            out[pid] = Meta(pid, chunk, DTYPES[shard["dtype"]], DTYPES[n["dtype"]])
    return out


def plan_record(record: str, world: int = 2, limit_gib: float | None = None, capacity_gib: float = 141.0,
                gb_per_s: float | None = None, alpha_us: float | None = None,
                optimizer_peak_gib: float | None = None, accumulation: int = 1, compiler: str | None = None):
    """(plan, facts, profile, [(candidate, predicted ms)]) of the planner on ``record``."""
    from deepcompile.runtime import ops
    ops.ensure_registered()
    rec = read_run(record)
    prof = Profile.from_records(rec.profile)
    if gb_per_s or alpha_us is not None:
        prof.comm = dataclasses.replace(prof.comm, bytes_per_us=(gb_per_s * 1e3 if gb_per_s else prof.comm.bytes_per_us),
                                        alpha_us=(alpha_us if alpha_us is not None else prof.comm.alpha_us))
    if optimizer_peak_gib:
        prof.optimizer_peak_bytes = int(optimizer_peak_gib * GIB)
    graphs, meta = {}, {}
    for (gid, kind) in prof.graphs:
        vs = [v for v in rec.versions(gid, kind) if v.after == "zero3"]
        if not vs:
            raise SystemExit(f"{record}: no zero3 version of graph {gid} {kind}")
        nodes = vs[-1].nodes  # the profiled compile's (the last zero3 of a record that re-compiled)
        graphs[(gid, kind)] = rebuild(nodes)
        if kind == "forward":
            meta.update(param_meta(nodes))
    state = sum(2 * m.chunk * m.dtype.itemsize for m in meta.values())  # Adam: two moments per shard element
    facts = facts_from_profile(prof, meta, world, state)
    cap = int(capacity_gib * GIB)
    limit = int(limit_gib * GIB) if limit_gib else int(0.9 * cap)
    mem = P.DeviceMemory(cap, cap, limit, f"--limit-gib {limit_gib:g}" if limit_gib else "90% of --capacity-gib")
    compiler = compiler or rec.config.get("compiler", "inductor")
    from deepcompile.params import build
    from deepcompile.passes import PASSES, PassContext
    from deepcompile.passes import selective_unshard as su

    def ctx(gid, kind, name, params):
        return PassContext(graph_id=gid, kind=kind, params=build(PASSES[name].params_cls, params, name),
                           param_meta=meta, world_size=world, rank=0, profile=prof)

    def kept_bytes(mb):
        return sum(facts.gathered[p] for p in su.choose(ctx(0, "forward", "selective_unshard", {"budget_mb": mb})))

    timer = P.GraphTimer(graphs, ["prefetch", "selective_unshard"], ctx, prof, compiler == "inductor", accumulation)
    seen = []

    def timed(c):
        t = timer(c)
        seen.append((c, t))
        return t

    plan = P.choose(facts, mem, kept_bytes, timed, {}, "cost model on the rebuilt graphs")
    return plan, facts, prof, seen


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("record")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--limit-gib", type=float, default=None, help="memory limit (default 90%% of --capacity-gib)")
    ap.add_argument("--capacity-gib", type=float, default=141.0)
    ap.add_argument("--gb-per-s", type=float, default=None, help="replace the profile's allgather bandwidth")
    ap.add_argument("--alpha-us", type=float, default=None, help="replace the profile's per-collective latency")
    ap.add_argument("--optimizer-peak-gib", type=float, default=None,
                    help="the optimizer step's peak (older records did not measure it)")
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--compiler", default=None, help="the final compiler (default: the record's config)")
    a = ap.parse_args(argv)
    plan, facts, prof, seen = plan_record(a.record, a.world, a.limit_gib, a.capacity_gib, a.gb_per_s, a.alpha_us,
                                          a.optimizer_peak_gib, a.accumulation, a.compiler)
    print(f"profile: forward/backward peak {facts.fb_peak / GIB:.2f} GiB at {facts.fb_peak_at}; optimizer step "
          f"{facts.optimizer_peak / GIB:.2f} GiB; gathered parameters {facts.gathered_total / GIB:.2f} GiB; "
          f"comm alpha {prof.comm.alpha_us:.0f} us, {prof.comm.bytes_per_us / 1e3:.0f} GB/s")
    print(f"{'keep MiB':>10} {'prefetch':>9} {'fuse':>6} {'kept GiB':>9} {'offload':>8} {'peak GiB':>9} {'step ms':>9}")
    for c, t in sorted(seen, key=lambda x: x[1]):
        print(f"{c.keep_mb:10.1f} {c.prefetch_mb:9.0f} {c.fuse_mb:6.0f} {c.kept / GIB:9.2f} {c.offloaded / GIB:8.2f} "
              f"{c.memory.peak / GIB:9.2f} {t:9.1f}")
    print(plan.summary_line())
    print("why:", plan.why)


if __name__ == "__main__":
    main()
