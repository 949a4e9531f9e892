"""What-if: a run record's predicted step time and memory under other pass parameters, at once.

The record holds what a re-plan needs: the graphs as traced (``after == "zero3"``, the version
the later passes start from), the agreed profile (per-node latency and memory, the optimizer
step, the communication model) and the plan the run chose. :func:`predict_run` rebuilds those
graphs as FX graphs (dc ops with their real operators, which the passes match; every other op a
stand-in of the same name, which the cost model matches by name; every value a meta tensor of
its recorded shape), runs the requested passes on copies of them, and prices the result with
the cost model (:func:`deepcompile.plan.cost_model.predict`) and the memory model
(:func:`deepcompile.plan.memory.plan_memory`). No Dynamo, no torch.compile, no device: the
rebuilt graphs are cached per record, so an edit costs one pass run and one estimate.

Parameters the planner fills (``prefetch.budget_mb``/``fuse_mb``, ``selective_unshard.budget_mb``)
may be given as ``"auto"``: the planner (:func:`deepcompile.plan.planner.choose`) decides them on
the same graphs, as the run would; with the record's config planning (``plan: true``, the
default ZeRO-3 plan) a parameter left out is ``"auto"`` too, else it takes its declared default.

The step: the cost model's GPU timeline (which on a GPU profile includes the host's launch
time per op, ``profile.host.HOST_US``: a host-bound step takes the host's pace), at least the
record's measured host time per step where its steps carry one (``host_s``). On a CPU record the
step is calibrated to the record's own measured steady step (``WhatIf.calibration``): the CPU
profile times each node alone under the profiler, off by the same factor for every plan. The
peak: :func:`deepcompile.plan.memory.plan_memory`, split into the record's categories.

Compared with what 2 H200s measured (``benchmarks/plan_offline.py --compare``, results in
``benchmarks/results/whatif_vs_measured_h200_2gpu.json``): the default plan's step -2.0%
(NVLink) and +9.9% (slow links), peaks within 1%.

    from deepcompile.plan.whatif import predict_run
    w = predict_run("runs/demo", [{"name": "zero3"}, {"name": "prefetch", "params": {"budget_mb": 0}},
                                  {"name": "selective_unshard", "params": {"budget_mb": "auto"}}])
    w.step_ms, w.peak_bytes, w.memory, w.schedule, w.versions, w.notes, w.seconds
"""
from __future__ import annotations

import dataclasses
import gc
import math
import operator
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from deepcompile.params import ConfigError
from deepcompile.plan.memory import GIB, MIB, MemoryFacts, PlanMemory, plan_memory, prefetch_bytes
from deepcompile.plan.planner import no_gc
from deepcompile.plan.runner import GraphRunner

__all__ = ["WhatIf", "WhatIfError", "predict_run", "headline", "own_passes", "prediction", "predict_base", "variant", "plan_record", "rebuild", "param_meta", "load_base", "clear_cache",
           "MEMORY_CATEGORIES"]

# the vocabulary of record/schema.py's MEMORY_CATEGORIES (one for measured and predicted memory)
MEMORY_CATEGORIES = ("parameter_shards", "gathered", "gradients", "optimizer_state", "activations", "offloaded")
AUTO = "auto"
# passes whose graph rewrite the what-if runs on the rebuilt graphs; offload_optimizer is priced
# by the memory model (its run-time decisions read the allocator, which an offline graph lacks)
GRAPH_PASSES = ("prefetch", "selective_unshard", "offload_activations")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
          "bool": torch.bool, "int32": torch.int32, "float64": torch.float64, "uint8": torch.uint8,
          "int8": torch.int8, "int16": torch.int16, "complex64": torch.complex64}
# device capacity by name where the record predates plan.json (what torch.cuda reports, GiB)
CAPACITY_GIB = {"H200": 139.8, "H100": 79.1, "A100-SXM4-80GB": 79.1, "A100-SXM4-40GB": 39.4}


class WhatIfError(ValueError):
    """The record cannot answer the what-if (no zero3 graphs, no profile) or a parameter is bad."""


@dataclass
class WhatIf:
    """The predicted step of a pass list on a recorded run (``source: "predicted"`` throughout)."""
    step_ms: float                 # predicted step time (max of the GPU timeline and the host floor)
    peak_bytes: int                # predicted peak (the larger of forward/backward and the optimizer step)
    memory: dict                   # category -> bytes at the predicted peak (MEMORY_CATEGORIES)
    schedule: list                 # {graph_id, kind, node, stream, start_ms, end_ms, source: "predicted"}
    versions: list                 # graph versions after each pass, as the record's (graph_id, kind, after, seq, nodes, notes)
    notes: list                    # what the passes and the planner did, and what the prediction assumes
    seconds: float                 # how long the what-if took
    params: dict = field(default_factory=dict)     # pass -> the parameters used (auto ones resolved)
    auto: dict = field(default_factory=dict)       # pass -> [parameters the planner decided]
    gpu_ms: float = 0.0            # the GPU timeline's step (graphs x accumulation + optimizer + offload)
    host_ms: float | None = None   # the recorded host time per step, where the record has it
    optimizer_ms: float = 0.0
    per_graph_ms: dict = field(default_factory=dict)
    memory_model: dict = field(default_factory=dict)   # PlanMemory's fields (fb_peak, optimizer_peak, ...)
    peak_where: str = ""           # "forward/backward" or "optimizer step"
    plan: dict | None = None       # the planner's choice when something was "auto"
    measured: dict = field(default_factory=dict)       # the record's own step/peak, to show beside it
    model_step_ms: float = 0.0     # the cost model's step before calibration (== step_ms when none)
    calibration: float | None = None   # measured / predicted step of the record's own plan, where applied
    limit_bytes: int | None = None     # the memory limit the prediction was asked to fit, where one was given
    warnings: list = field(default_factory=list)   # what the caller must see: a limit the plan cannot fit

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def headline(self) -> str:
        """The prediction in one line, worded the same in every view (the Passes tab, the
        Schedule tab's what-if lane, the report, ``deepcompile inspect``): step and peak."""
        return headline(self.step_ms, self.peak_bytes, self.peak_where)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def headline(step_ms: float, peak_bytes: int, peak_where: str = "") -> str:
    """``predicted step 825.9 ms, peak 4.6 MiB (at forward/backward)``: one wording of one
    prediction for every view."""
    from deepcompile.vocab.memory import fmt_bytes

    where = f" (at {peak_where})" if peak_where else ""
    return f"predicted step {step_ms:.1f} ms, peak {fmt_bytes(int(peak_bytes))}{where}"


def own_passes(run_dir, rank: int = 0) -> list | None:
    """The pass list the record's last compile used (see :func:`predict_run`), or None."""
    return _own_passes(load_base(run_dir, rank))


def describe_passes(passes) -> str:
    """``zero3, prefetch(budget_mb=64, fuse_mb=0), selective_unshard(budget_mb=0)``."""
    out = []
    for e in passes or []:
        if isinstance(e, str):
            out.append(e)
            continue
        ps = e.get("params") or {}
        out.append(e.get("name", "?") + (f"({', '.join(f'{k}={v:g}' if isinstance(v, (int, float)) else f'{k}={v}' for k, v in ps.items())})"
                                         if ps else ""))
    return ", ".join(out)


def prediction(run_dir, rank: int = 0, passes=None) -> tuple[WhatIf | None, str]:
    """(the WhatIf, one line) of ``passes`` (default: the record's own pass list) on the record:
    the line the report and ``deepcompile inspect`` print, its numbers :meth:`WhatIf.headline`'s
    (the Passes tab and the Schedule tab's what-if lane show the same for the same passes).
    Without a prediction: (None, the reason)."""
    try:
        ps = passes if passes is not None else own_passes(run_dir, rank)
        if not ps:
            return None, "no prediction: the record names no pass list"
        w = predict_run(run_dir, ps, rank=rank)
    except Exception as e:   # a record that cannot answer (no profile, no zero3 graphs): say why
        return None, f"no prediction from this record: {type(e).__name__}: {e}"
    cal = (f"; calibrated to this run's measured step (x{w.calibration:.3g})" if w.calibration is not None else "")
    return w, (f"{w.headline()} — plan.whatif on {'these passes' if passes is not None else 'the run’s own passes'}: "
               f"{describe_passes(ps)}{cal}")


# ------------------------------------------------------------------------------------ rebuilding graphs
_STANDINS: dict[str, Any] = {}


def _standin(name: str):
    """A callable whose ``__name__`` is the recorded target (``record.graph.target_name`` gives it back)."""
    f = _STANDINS.get(name)
    if f is None:
        def f(*a, **k):
            raise RuntimeError(f"{name}: a stand-in for planning, not runnable")
        f.__name__ = f.__qualname__ = name
        _STANDINS[name] = f
    return f


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
        if all(isinstance(x, int) for s in shape for x in s):
            return [torch.empty(s, device="meta") for s in shape]
        return None
    if all(isinstance(s, int) for s in shape):
        return torch.empty(shape, dtype=DTYPES.get(dtype or "", torch.float32), device="meta")
    return None


def rebuild(nodes: list[dict]) -> fx.Graph:
    """An FX graph of a record's serialized nodes (see the module doc)."""
    g = fx.Graph()
    env: dict[str, fx.Node] = {}

    def arg(a):
        if isinstance(a, dict):
            if len(a) == 1 and "node" in a:
                return env[a["node"]]
            return {k: arg(v) for k, v in a.items()}
        if isinstance(a, list):
            return [arg(x) for x in a]
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
            raise WhatIfError(f"node {n['name']!r} came back as {node.name!r}")
        env[n["name"]] = node
        v = _val(n.get("shape"), n.get("dtype"))
        if v is not None:
            node.meta["val"] = v
        if "param" in n:
            node.meta["dc_param"] = n["param"]
    return g


def param_meta(forward: list[dict], backward: list[dict] | None, world: int) -> dict:
    """runtime.ops.ParamMeta per parameter id, from the forward's gathers: the shard is the
    gather's input placeholder, the gathered value the wait's output; a parameter without a
    ``reduce_grad`` (or place in a ``reduce_grads``) in the backward is frozen."""
    from deepcompile.runtime.ops import ParamMeta

    by = {n["name"]: n for n in forward}
    reduced = None
    if backward:
        reduced = {int(p) for n in backward if n.get("target") in ("dc.reduce_grad", "dc.reduce_grads")
                   for p in (n.get("params") or ([n["param"]] if "param" in n else []))}
    out = {}
    for n in forward:
        if n.get("target") != "dc.wait_allgather" or len(n.get("args") or []) < 2:
            continue
        issue = by.get((n["args"][0] or {}).get("node") if isinstance(n["args"][0], dict) else None)
        pid = int(n["args"][1])
        if pid in out or issue is None or issue.get("target") != "dc.allgather_param":
            continue
        shard = by.get(issue["args"][0]["node"]) if isinstance(issue["args"][0], dict) else None
        if shard is None or not isinstance(shard.get("shape"), list) or not isinstance(n.get("shape"), list):
            continue
        chunk = math.prod(shard["shape"])
        shape = tuple(int(s) for s in n["shape"])
        out[pid] = ParamMeta(id=pid, name=n.get("scope") or f"param{pid}", shape=shape, numel=math.prod(shape),
                             chunk=chunk, dtype=DTYPES.get(shard.get("dtype") or "", torch.float32),
                             gather_dtype=DTYPES.get(n.get("dtype") or "", torch.float32),
                             requires_grad=reduced is None or pid in reduced,
                             shard_shape=tuple(shard["shape"]) if len(shard["shape"]) > 1 else None)
    return out


def _world(rec, meta: dict) -> int:
    """The run's world size: the manifest's, or (a record written by one rank of a larger run)
    what the gathers say: a gathered parameter has about ``world`` times its shard's elements."""
    w = int(rec.manifest.get("world_size") or 1)
    if meta:
        big = max(meta.values(), key=lambda m: m.numel)
        inferred = max(1, math.ceil(big.numel / max(big.chunk, 1)))
        if inferred != w:
            return inferred
    return w


# ------------------------------------------------------------------------------------ the cached base
@dataclass
class _Base:
    """Everything of a record a what-if reuses: built once per record (and its files' mtimes)."""
    path: str
    rank: int
    config: dict
    profile: Any                    # deepcompile.profile.profiler.Profile
    graphs: dict                    # (gid, kind) -> fx.Graph (never mutated: passes run on copies)
    base: dict                      # (gid, kind) -> the record's version dict the passes start from
    profiled: dict                  # (gid, kind) -> the record's version the profile measured
    scope: dict                     # (gid, kind) -> {node name: scope}
    meta: dict                      # pid -> ParamMeta
    world: int
    facts: MemoryFacts
    plan: dict | None
    capacity: int | None
    fused: bool
    accumulation: int
    host_ms: float | None
    measured: dict
    seconds: float
    prefix: list                    # the record's pass names up to zero3 (the base's)
    static: dict = field(default_factory=dict)   # (gid, kind) -> estimate.static_costs of the base
    times: dict = field(default_factory=dict)    # run key -> priced scalars (planner candidates, re-used)
    full: dict = field(default_factory=dict)     # run key -> (model versions, shown versions, prediction)
    shapes: dict = field(default_factory=dict)   # model_nodes' cache (values' shapes, targets' names)
    calibration: Any = False                     # _calibration's answer, once worked out (False: not yet)


_CACHE: dict = {}
_LOCK = threading.Lock()


def clear_cache() -> None:
    with _LOCK:
        _CACHE.clear()


def _signature(root: Path, rank: int) -> tuple:
    from deepcompile.record import schema as S

    rdir = root / S.rank_dir_name(rank)
    out = []
    for p in (root / S.MANIFEST, rdir / S.GRAPHS_DIR / S.GRAPH_INDEX, rdir / S.PROFILE, rdir / S.PLAN, rdir / S.STEPS):
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


def load_base(run_dir, rank: int = 0) -> _Base:
    """The record's rebuilt graphs, profile and memory facts (cached; rebuilt when a file changed)."""
    root = Path(run_dir).resolve()
    key = (str(root), int(rank))
    sig = _signature(root, rank)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0] == sig:
            return hit[1]
    base = _build_base(root, rank)
    with _LOCK:
        _CACHE[key] = (sig, base)
    return base


def _build_base(root: Path, rank: int) -> _Base:
    from deepcompile.plan.estimate import profiled_version, static_costs
    from deepcompile.plan.memory import facts_from_profile
    from deepcompile.profile.profiler import Profile, drop_stalls
    from deepcompile.record import schema as S
    from deepcompile.record.reader import load_json, read_run
    from deepcompile.runtime import ops

    t0 = time.perf_counter()
    ops.ensure_registered()
    # the graphs' files are most of a record; only the zero3 versions are needed (the base and
    # the profiled one), so the index is read first and those files alone after it
    rec = read_run(root, rank, load_graphs=False)
    if not rec.profile or not rec.profile.get("graphs"):
        raise WhatIfError(f"{root}: the record has no profile (profile.json.gz); a what-if prices the passes with "
                          "the profiled latencies and memory: run with profile_step set (the default ZeRO-3 plan "
                          "profiles step 1), e.g. `python -m deepcompile demo --profile-step 1`")
    prof = Profile.from_records(rec.profile)
    # records written by a profiler that kept stalls still carry them: a wait or
    # node charged with the other rank's profiler spin would price every plan ~4x too slow
    drop_stalls(prof)
    graphs, base, profiled, scope = {}, {}, {}, {}
    by_key: dict = {}
    gdir = root / S.rank_dir_name(rank) / S.GRAPHS_DIR
    for v in rec.graphs:
        if v.kind != "dynamo" and v.after == "zero3":
            path = gdir / v.file
            g = S.check_graph(str(path), load_json(path, root=root))
            if (g["graph_id"], g["kind"], g["after"]) != (v.graph_id, v.kind, v.after):
                raise WhatIfError(f"{path}: holds graph {g['graph_id']}/{g['kind']}/{g['after']} but the index "
                                  f"says {v.graph_id}/{v.kind}/{v.after}")
            v.nodes = g["nodes"]
            by_key.setdefault((v.graph_id, v.kind), []).append(v)
    for key in sorted(prof.graphs):
        vs = by_key.get(key, [])
        z = [v for v in vs if v.after == "zero3"]
        if not z:
            raise WhatIfError(f"{root}: graph {key[0]} {key[1]} has no zero3 version: a what-if re-runs the passes "
                              "after zero3 on the ZeRO-3 graphs, and this record has none (a ZeRO-1/2 run? or a re-run that "
                              "took its graphs from AOTAutograd's cache: config aot_cache false keeps them)")
        last = z[-1]  # the last compile's (the one the passes after zero3 ran on)
        d = {"graph_id": last.graph_id, "kind": last.kind, "after": last.after, "seq": last.seq,
             "nodes": last.nodes, "notes": list(last.notes), "seconds": last.seconds}
        base[key] = d
        graphs[key] = rebuild(last.nodes)
        dicts = [{"graph_id": v.graph_id, "kind": v.kind, "after": v.after, "nodes": v.nodes} for v in vs]
        profiled[key] = profiled_version(prof.graphs[key], dicts)
        scope[key] = {n["name"]: n.get("scope", "") for n in last.nodes}
    fwd = next((base[k]["nodes"] for k in sorted(base) if k[1] == "forward"), [])
    bwd = next((base[k]["nodes"] for k in sorted(base) if k[1] == "backward"), None)
    meta: dict = {}
    for k in sorted(base):
        if k[1] == "forward":
            b = base.get((k[0], "backward"))
            for pid, m in param_meta(base[k]["nodes"], b["nodes"] if b else None, 1).items():
                meta.setdefault(pid, m)
    if not meta and fwd:
        meta = param_meta(fwd, bwd, 1)
    world = _world(rec, meta)
    cfg = rec.config or {}
    plan = load_json(root / S.rank_dir_name(rank) / S.PLAN, optional=True, root=root)
    pf = (plan or {}).get("facts") or {}
    state = int(pf.get("state_bytes") or sum(2 * m.chunk * m.dtype.itemsize for m in meta.values() if m.requires_grad))
    facts = facts_from_profile(prof, meta, world, state, reduce_bytes=int(pf.get("reduce_bytes") or 0))
    for k in ("fb_peak", "optimizer_peak", "shard_bytes", "grad_bytes"):
        if pf.get(k):  # the run's own figures (its optimizer's real state, its reduce buckets)
            setattr(facts, k, int(pf[k]))
    capacity = int(plan["capacity_bytes"]) if plan and plan.get("capacity_bytes") else _capacity(rec.environment)
    host, measured = _measured(rec)
    names = [str(e.get("name") if isinstance(e, dict) else e) for e in (cfg.get("passes") or [])]
    prefix = names[:names.index("zero3") + 1] if "zero3" in names else ["zero3"]
    fused = cfg.get("compiler", "inductor") == "inductor"
    static = {}
    for key, d in base.items():
        vs = [x for x in (profiled[key], d) if x is not None]
        static[key] = static_costs(prof, vs, d, fused)
    return _Base(str(root), rank, cfg, prof, graphs, base, profiled, scope, meta, world, facts, plan, capacity,
                 fused, int(cfg.get("gradient_accumulation_steps") or 1),
                 host, measured, time.perf_counter() - t0, prefix, static)


def _capacity(env: dict) -> int | None:
    devs = [str(d) for d in (env or {}).get("devices") or []]
    for d in devs:
        for k, gib in CAPACITY_GIB.items():
            if k in d:
                return int(gib * GIB)
    return None


def _measured(rec) -> tuple[float | None, dict]:
    """(host ms per step, {step_ms, peak_bytes}) of the record's steady steps: every step but the
    compile, the profiled step and the re-compiles (``record.steps.special_steps``, the steps
    every view leaves out of its median), else the last half."""
    import statistics

    from deepcompile.record.steps import special_steps

    st = [s for s in rec.steps if isinstance(s.get("time_s"), (int, float))]
    if not st:
        return None, {}
    special = special_steps(st, rec.config or {})
    tail = [s for s in st if s.get("step") not in special]
    steady = bool(tail)
    if not tail:
        tail = st[len(st) // 2:] if len(st) > 2 else st[-1:]

    def med(xs):
        return statistics.median(xs) if xs else None
    out = {"step_ms": med([s["time_s"] * 1e3 for s in tail]), "steps": len(tail), "steady": steady,
           "source": "measured"}
    peaks = [int((s.get("mem") or {}).get("peak") or 0) for s in tail]
    if any(peaks):
        out["peak_bytes"] = max(peaks)
    host = med([float(s["host_s"]) * 1e3 for s in tail if isinstance(s.get("host_s"), (int, float))])
    if host is None:
        host = med([float(s["host_ms"]) for s in tail if isinstance(s.get("host_ms"), (int, float))])
    return host, out


# ------------------------------------------------------------------------------------ parameters
def _entries(passes) -> list[tuple[str, dict]]:
    """[(name, params)] of a pass list (names, {"name", "params"} dicts or PassEntry); unknown
    names and keys raise ConfigError naming ``passes[i]...``; "auto" values are kept for later."""
    from deepcompile.passes.registry import PassEntry
    from deepcompile.passes import PASSES

    if isinstance(passes, (str, bytes)) or not isinstance(passes, (list, tuple)):
        raise ConfigError(f"passes: expected a list of pass entries, got {passes!r:.80}")
    out = []
    for i, e in enumerate(passes):
        path = f"passes[{i}]"
        if isinstance(e, PassEntry):
            e = {"name": e.name, "params": dict(e.params)}
        elif isinstance(e, str):
            e = {"name": e}
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            raise ConfigError(f"{path}: a pass is a name or {{\"name\": ..., \"params\": {{...}}}}, got {e!r:.80}")
        unknown = sorted(set(e) - {"name", "params"})
        if unknown:
            raise ConfigError(f"{path}.{unknown[0]}: unknown key; a pass entry has 'name' and 'params'")
        name = e["name"]
        if name not in PASSES:
            raise ConfigError(f"{path}.name: unknown pass {name!r}; known: {sorted(PASSES)}")
        params = e.get("params") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{path}.params: expected a mapping of parameter names to values, got {params!r:.80}")
        out.append((name, dict(params)))
    return out


def _resolve(entries, planning: bool) -> tuple[dict, dict, dict]:
    """(explicit params per pass, validated; auto keys per pass; hand-set planned params)."""
    from deepcompile.params import build
    from deepcompile.passes import PASSES
    from deepcompile.plan.planner import PLANNED

    explicit, auto, hand = {}, {}, {}
    for i, (name, params) in enumerate(entries):
        path = f"passes[{i}].params"
        fields = {f.name for f in dataclasses.fields(PASSES[name].params_cls)}
        a = []
        for k, v in list(params.items()):
            if isinstance(v, str) and v.strip().lower() == AUTO:
                if k not in PLANNED.get(name, ()) or k not in fields:
                    # not the planner's: "auto" is then an ordinary value of the parameter (e.g.
                    # prefetch.backend's own default), accepted or refused by its declared spec
                    continue
                a.append(k)
                params.pop(k)
        if planning:
            a += [k for k in PLANNED.get(name, ()) if k not in params and k not in a and k in fields
                  and name != "offload_optimizer"]
        build(PASSES[name].params_cls, params, path)  # validates every explicit value, naming its path
        explicit[name] = params
        if a:
            auto[name] = a
        if name in PLANNED and params:
            hand[name] = {k: v for k, v in params.items() if k in PLANNED[name]}
    return explicit, auto, hand


# ------------------------------------------------------------------------------------ running the passes
# the runner (passes on graph copies, priced by the cost model) is the planner's too: plan/runner.py


def _memory(pm: PlanMemory) -> tuple[dict, str]:
    by = getattr(pm, "by_category", None)  # plan/memory.py's own split, where it has one
    if by is not None:
        return by()
    return _split(pm)


def _split(pm: PlanMemory) -> tuple[dict, str]:
    """PlanMemory onto the record's categories, at the predicted peak. At a forward/backward
    peak: shards, state left on the device, gradients (and reduce buckets), gathered (kept +
    prefetched), activations (the rest of the profiled peak, with the parameter in use) and the
    state on the host. At an optimizer-step peak: shards, gradients and the state; what the step
    holds beyond those (its temporaries) is filed under optimizer_state."""
    if pm.fb_peak >= pm.optimizer_peak:
        mem = {"parameter_shards": pm.parameter_shards, "gathered": pm.gathered_kept + pm.gathered_prefetch,
               "gradients": pm.gradients, "optimizer_state": pm.optimizer_state,
               "activations": pm.activations, "offloaded": pm.offloaded}
        rest = pm.fb_peak - sum(v for k, v in mem.items() if k != "offloaded")
        mem["activations"] = max(0, mem["activations"] + rest)
        return mem, "forward/backward"
    state = pm.optimizer_state + pm.offloaded
    rest = max(0, pm.optimizer_peak - pm.parameter_shards - pm.gradients - state)
    return ({"parameter_shards": pm.parameter_shards, "gathered": 0, "gradients": pm.gradients,
             "optimizer_state": state + rest, "activations": 0, "offloaded": 0}, "optimizer step")


def predict_run(run_dir, passes, *, rank: int = 0, memory_limit_gib: float | None = None) -> WhatIf:
    """Predicted step time and memory of ``passes`` (the config's pass list) on the record in
    ``run_dir``, without Dynamo or torch.compile (see the module doc). Raises ConfigError naming
    ``passes[i].params.<key>`` for a bad value, WhatIfError when the record cannot answer."""
    # the cyclic GC walks the whole heap (the cached graphs included): a third of a re-plan's
    # time went to it (see planner.no_gc)
    with no_gc():
        return _predict_run(run_dir, passes, rank, memory_limit_gib)


def predict_base(base: _Base, passes, *, memory_limit_gib: float | None = None) -> WhatIf:
    """:func:`predict_run` on a base already at hand (``load_base``, or a :func:`variant` of one)."""
    with no_gc():
        return _predict_run(base.path, passes, base.rank, memory_limit_gib, base)


def _own_passes(b: _Base) -> list | None:
    """The pass list the record's last compile used: the plan's (plan.json), else the config's
    last scheduled list, else its passes."""
    if b.plan and b.plan.get("passes"):
        return b.plan["passes"]
    sched = [e for e in b.config.get("schedule") or [] if isinstance(e, dict) and e.get("passes")]
    return sched[-1]["passes"] if sched else (b.config.get("passes") or None)


def _calibration(b: _Base) -> float | None:
    """On a CPU record: the record's measured steady step over the model's prediction of the
    record's own plan. The CPU profile times each node alone under the profiler, which costs
    several times the node itself on a small model (the 2-rank tiny-GPT demo: 3.1 s predicted
    against 0.27 s measured), and the same for every plan, so the ratio carries over to the
    plans the what-if compares. On a GPU the profile's CUDA-event latencies and the host model
    stand as they are (within 2-10% of the 2-H200 runs): None."""
    if b.calibration is not False:
        return b.calibration
    b.calibration = None
    own = _own_passes(b)
    hw = str(getattr(b.profile, "hardware", "") or "").lower()
    if hw == "cpu" and own and b.measured.get("step_ms") and b.measured.get("steady"):
        try:
            w = _predict_run(b.path, own, b.rank, None, b, calibrate=False)
        except (ConfigError, WhatIfError):
            return None
        if w.model_step_ms > 0:
            b.calibration = float(b.measured["step_ms"]) / w.model_step_ms
    return b.calibration


def _predict_run(run_dir, passes, rank: int, memory_limit_gib: float | None, base: _Base | None = None,
                 calibrate: bool = True, replan: bool = True) -> WhatIf:
    from deepcompile.plan import planner as P

    t0 = time.perf_counter()
    if memory_limit_gib is not None and (isinstance(memory_limit_gib, bool) or not isinstance(memory_limit_gib, (int, float))
                                         or not (0 < memory_limit_gib < 1e6)):
        raise ConfigError(f"memory_limit_gib: expected a positive number of GiB, got {memory_limit_gib!r}")
    entries = _entries(passes)
    names = [n for n, _ in entries]
    if "zero3" not in names:
        raise WhatIfError(f"passes: {names} has no 'zero3'; a what-if re-plans the ZeRO-3 graphs the record traced "
                          "(the passes after zero3 run on them), so the list needs zero3")
    b = base if base is not None else load_base(run_dir, rank)
    cfg_plan = b.config.get("plan")
    planning = bool(cfg_plan) if cfg_plan is not None else bool(b.plan)
    explicit, auto, hand = _resolve(entries, planning)
    notes: list[str] = []
    after = names[names.index("zero3") + 1:]
    before = names[:names.index("zero3") + 1]
    if before != b.prefix and b.config.get("passes"):
        notes.append(f"the passes up to zero3 {before} differ from the record's {b.prefix}: the graphs are the "
                     "record's (a change before zero3 needs a new trace: use Run)")
    graph_names = [n for n in after if n in GRAPH_PASSES]
    skipped = [n for n in after if n not in GRAPH_PASSES and n != "offload_optimizer"]
    if skipped:
        notes.append(f"{', '.join(skipped)}: not re-run offline (no graph rewrite to price); its effect is not predicted")
    fixed = dict(explicit)
    if "selective_unshard" not in names:
        fixed["selective_unshard"] = {"budget_mb": 0.0}
    if "prefetch" not in names:
        fixed["prefetch"] = {"budget_mb": 0.0, "fuse_mb": 0.0}
    runner = GraphRunner(b, graph_names, explicit)
    facts = b.facts
    # the memory limit: the caller's, the config's, the run's plan's, or 90% of the device
    limit_src = "none"
    if memory_limit_gib:
        limit, limit_src = int(memory_limit_gib * GIB), f"memory_limit_gib {memory_limit_gib:g}"
    elif b.config.get("memory_limit_gib"):
        limit, limit_src = int(float(b.config["memory_limit_gib"]) * GIB), "the record's memory_limit_gib"
    elif b.plan and b.plan.get("limit_bytes"):
        limit, limit_src = int(b.plan["limit_bytes"]), f"the run's plan ({b.plan.get('limit_source', '')})"
    elif b.capacity:
        limit, limit_src = int(P.DEFAULT_LIMIT_FRACTION * b.capacity), "90% of the device"
    else:
        limit = 1 << 62
    plan_d = None
    params = {k: dict(v) for k, v in explicit.items()}
    recorded = (b.plan or {}).get("chosen", {}).get("params") or {}
    same = (auto and recorded and not hand and b.plan.get("limit_bytes") == limit
            and all(set(auto.get(n, ())) == {k for k in P.PLANNED[n] if k in recorded.get(n, {})}
                    for n in ("prefetch", "selective_unshard") if n in names)
            and all(n in names for n in ("prefetch", "selective_unshard") if n in recorded))
    if same:
        # every planned value is "auto" under the run's own limit: the run's planner already
        # chose, from the same profile (plan.json); its choice is what the run would do again
        plan_d = b.plan
        for name, keys in auto.items():
            for k in keys:
                if k in recorded.get(name, {}):
                    params.setdefault(name, {})[k] = recorded[name][k]
        if "offload_optimizer" in recorded and "offload_optimizer" not in names:
            params["offload_optimizer"] = dict(recorded["offload_optimizer"])
        notes.append("planner: the run's own choice (plan.json, same limit and hand-set values): "
                     + ", ".join(f"{n}.{k} = {params[n][k]:g}" for n, ks in auto.items() for k in ks
                                 if k in params.get(n, {})))
    elif auto:
        cap = b.capacity or limit
        mem = P.DeviceMemory(cap, cap, limit, limit_src)
        planned_hand = {k: v for k, v in hand.items()}
        for k, v in fixed.items():
            if k not in names:
                planned_hand[k] = v
        plan = P.choose(facts, mem, lambda mb: runner.kept(mb)[0], runner.step_ms, planned_hand,
                        "cost model on the record's graphs (what-if)")
        plan_d = plan.to_dict()
        chosen = plan.chosen.params()
        for name, keys in auto.items():
            for k in keys:
                if k in chosen.get(name, {}):
                    params.setdefault(name, {})[k] = chosen[name][k]
        if "offload_optimizer" in chosen and "offload_optimizer" not in names:
            notes.append(f"the planner offloads optimizer state to fit {limit / GIB:.2f} GiB ({limit_src}): "
                         "the run would add offload_optimizer")
            params["offload_optimizer"] = dict(chosen["offload_optimizer"])
        notes.append(f"planner ({limit_src}): " + ", ".join(f"{n}.{k} = {params[n][k]:g}" for n, ks in auto.items()
                                                              for k in ks if k in params.get(n, {})))
    # the resolved plan: what it keeps, prefetches and offloads, and its memory
    from deepcompile.passes.registry import PASSES
    from deepcompile.params import build

    full = {n: dataclasses.asdict(build(PASSES[n].params_cls, params.get(n, {}), f"passes.{n}.params")) for n in names}
    su_mb = full["selective_unshard"]["budget_mb"] if "selective_unshard" in names else 0.0
    kept, kept_ids = runner.kept(su_mb) if su_mb > 0 else (0, [])
    pf = full.get("prefetch")
    ahead = prefetch_bytes(facts, kept, pf["budget_mb"], pf["fuse_mb"]) if pf else 0
    offloaded = 0
    if "offload_optimizer" in full or "offload_optimizer" in params:
        o = full.get("offload_optimizer") or params["offload_optimizer"]
        lim = int(o.get("limit_mb", 0) * MIB) or (b.capacity or limit)
        room = lim - int(o.get("headroom_mb", 1024.0) * MIB)
        need = facts.fb_peak + kept + ahead - room
        offloaded = max(0, min(int(need), facts.state_bytes))
        notes.append(f"offload_optimizer: {offloaded / GIB:.2f} GiB of {facts.state_bytes / GIB:.2f} GiB optimizer "
                     f"state predicted off the device in forward/backward (limit {lim / GIB:.2f} GiB)")
    pm = plan_memory(facts, kept, ahead, offloaded)
    mv, shown, p = runner.evaluate(params, True)
    gpu_ms = runner.gpu_ms(p, kept, offloaded)
    for v in shown:
        notes += [f"g{v['graph_id']} {v['kind']} {v['after']}: {n}" for n in v["notes"]]
    memory, where = _memory(pm)
    step = gpu_ms
    if b.host_ms and b.host_ms > gpu_ms:
        step = b.host_ms
        notes.append(f"host-bound: the recorded host time per step ({b.host_ms:.1f} ms) exceeds the GPU timeline's "
                     f"{gpu_ms:.1f} ms, so the step is predicted at the host's pace")
    model_step = step
    cal = _calibration(b) if calibrate else None
    if cal is not None:
        step = model_step * cal
        notes.append(f"calibrated to this run: its own plan measured {b.measured['step_ms']:.1f} ms a step where the "
                     f"model says {model_step / cal:.1f} ms (CPU profile: each node timed alone under the profiler), so "
                     f"the model's {model_step:.1f} ms is scaled by {cal:.3g}")
    if b.accumulation > 1:
        notes.append(f"gradient accumulation {b.accumulation}: graphs x{b.accumulation}, kept parameters gathered once")
    notes.append(f"memory: {pm.summary()}; kept {len(kept_ids)} parameter(s) gathered ({kept / MIB:.0f} MiB), "
                 f"prefetch up to {ahead / MIB:.0f} MiB ahead")
    # the schedule in the step's own time base: calibrated like the step, so its bars and the
    # step it reports are one prediction
    k = cal if cal is not None else 1.0
    sched = [{"graph_id": e["graph_id"], "kind": e["kind"], "node": e["node"], "stream": e["stream"],
              "start_ms": k * e["start_us"] / 1e3, "end_ms": k * e["end_us"] / 1e3, "source": "predicted"}
             for e in p["events"]]
    asked = int(memory_limit_gib * GIB) if memory_limit_gib else None
    warnings: list[str] = []
    if asked is not None and pm.peak > asked:
        from deepcompile.vocab.memory import fmt_bytes

        over = (f"the memory limit {fmt_bytes(asked)} ({memory_limit_gib:g} GiB) is below the predicted peak "
                f"{fmt_bytes(int(pm.peak))} of these values")
        if replan and hand:
            # the hand-set planned values do not fit: the planner chooses them under the limit
            again = [{"name": n, "params": dict({kk: v for kk, v in ps.items() if kk not in P.PLANNED.get(n, ())},
                                                **{kk: AUTO for kk in hand.get(n, ())})}
                     for n, ps in _entries(passes)]
            try:
                w2 = _predict_run(run_dir, again, rank, memory_limit_gib, b, calibrate, replan=False)
            except (P.PlanError, WhatIfError, ConfigError) as e:
                warnings.append(f"{over}; re-planning for it failed: {e}")
            else:
                if not w2.warnings:
                    w2.warnings.insert(0, f"{over}: re-planned under the limit (the planner chose "
                                       + ", ".join(f"{n}.{kk} = {w2.params[n][kk]:g}" for n, ks in w2.auto.items()
                                                   for kk in ks if kk in w2.params.get(n, {})) + ")")
                    return w2
                warnings.append(f"{over}; re-planning found no plan under it either (the planner's best peaks at "
                                f"{fmt_bytes(w2.peak_bytes)})")
        else:
            warnings.append(f"{over}: no plan of these passes fits it")
    return WhatIf(step_ms=round(step, 3), peak_bytes=int(pm.peak), memory=memory, schedule=sched, versions=shown,
                  notes=notes, seconds=round(time.perf_counter() - t0, 3), params=full,
                  auto={k: list(v) for k, v in auto.items()}, gpu_ms=round(gpu_ms, 3), host_ms=b.host_ms,
                  optimizer_ms=round(p["optimizer_ms"], 3),
                  per_graph_ms={k: round(v, 3) for k, v in p["per_graph_ms"].items()},
                  memory_model=pm.to_dict(), peak_where=where, plan=plan_d, measured=dict(b.measured),
                  model_step_ms=round(model_step, 3), calibration=cal, limit_bytes=asked, warnings=warnings)


# ------------------------------------------------------------------------------------ the planner offline
def variant(b: _Base, *, world: int | None = None, gb_per_s: float | None = None, alpha_us: float | None = None,
            optimizer_peak_gib: float | None = None, accumulation: int | None = None,
            compiler: str | None = None, capacity_gib: float | None = None,
            optimizer_ms: float | None = None, facts: dict | None = None) -> _Base:
    """A copy of a record's base with the hardware or the run changed (another link speed, the
    optimizer step's peak of an older record that did not measure it, another world size), and
    fresh caches (its prices differ)."""
    from deepcompile.plan.estimate import static_costs
    from deepcompile.plan.memory import facts_from_profile

    prof = b.profile
    if gb_per_s or alpha_us is not None or optimizer_peak_gib or optimizer_ms is not None:
        prof = dataclasses.replace(prof)
        if optimizer_ms is not None:
            prof.optimizer_ms = float(optimizer_ms)
        if gb_per_s or alpha_us is not None:
            prof.comm = dataclasses.replace(prof.comm, bytes_per_us=(gb_per_s * 1e3 if gb_per_s else prof.comm.bytes_per_us),
                                            alpha_us=(alpha_us if alpha_us is not None else prof.comm.alpha_us))
        if optimizer_peak_gib:
            prof.optimizer_peak_bytes = int(optimizer_peak_gib * GIB)
    w = world or b.world
    mf = b.facts
    if prof is not b.profile or w != b.world:
        mf = facts_from_profile(prof, b.meta, w, b.facts.state_bytes, reduce_bytes=b.facts.reduce_bytes)
    if facts:  # another run's own figures (a plan.json's "facts")
        mf = dataclasses.replace(mf)
        for k in ("fb_peak", "optimizer_peak", "shard_bytes", "grad_bytes", "state_bytes", "reduce_bytes"):
            if facts.get(k) is not None:
                setattr(mf, k, int(facts[k]))
    fused = b.fused if compiler is None else compiler == "inductor"
    static = b.static if fused == b.fused else {
        k: static_costs(prof, [x for x in (b.profiled[k], d) if x is not None], d, fused) for k, d in b.base.items()}
    return dataclasses.replace(b, profile=prof, world=w, facts=mf, fused=fused, static=static,
                               accumulation=accumulation or b.accumulation,
                               capacity=int(capacity_gib * GIB) if capacity_gib else b.capacity,
                               times={}, full={})


def plan_record(run_dir, *, rank: int = 0, limit_gib: float | None = None, **changes):
    """The planner on a record, offline: (plan, base, [(candidate, predicted GPU ms)]) for every
    candidate it priced. ``changes``: see :func:`variant`. The limit: ``limit_gib``, else 90% of
    the capacity (``capacity_gib``, the record's plan, or the device's by name)."""
    from deepcompile.plan import planner as P

    b = load_base(run_dir, rank)
    gc.disable()  # see predict_run (a command-line run: re-enabled at exit)
    if any(v is not None for v in changes.values()):
        b = variant(b, **changes)
    cap = b.capacity or int(141.0 * GIB)
    limit = int(limit_gib * GIB) if limit_gib else int(P.DEFAULT_LIMIT_FRACTION * cap)
    mem = P.DeviceMemory(cap, cap, limit, f"limit {limit_gib:g} GiB" if limit_gib else "90% of the capacity")
    runner = GraphRunner(b, ["prefetch", "selective_unshard"], {})
    seen = []

    def timed(c):
        t = runner.step_ms(c)
        seen.append((c, t))
        return t
    timed.coarse_to_fine = getattr(runner.step_ms, "coarse_to_fine", False)
    plan = P.choose(b.facts, mem, lambda mb: runner.kept(mb)[0], timed, {},
                    "cost model on the record's graphs (offline)")
    return plan, b, seen
