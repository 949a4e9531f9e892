"""A run record's base for what-ifs: its rebuilt graphs, profile and memory facts, cached.

Everything of a record that a what-if reuses (``plan.whatif``, the offline planner) is read and
built once per record (:class:`RecordBase`, :func:`load_base`), and built again only when one of
its files changed. The graphs are the versions after the pass declared ``OFFLINE_BASE`` (zero3):
the passes after it run on copies of them.
"""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepcompile.passes import PASSES
from deepcompile.passes.registry import OFFLINE_BASE
from deepcompile.plan.memory import GIB, MemoryFacts
from deepcompile.plan.rebuild import WhatIfError, param_meta, rebuild

# the pass whose output graphs the record keeps for a what-if (the passes after it run on them)
BASE_PASS = next(n for n, p in PASSES.items() if p.offline == OFFLINE_BASE)
# device capacity by name where the record predates plan.json (what torch.cuda reports, GiB)
CAPACITY_GIB = {"H200": 139.8, "H100": 79.1, "A100-SXM4-80GB": 79.1, "A100-SXM4-40GB": 39.4}


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


@dataclass
class RecordBase:
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
    # (gid, kind) -> per profiled node, the bytes a fused compile never writes (estimate.unmaterialized_bytes)
    unmaterialized: dict | None = None


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


def load_base(run_dir, rank: int = 0) -> RecordBase:
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


def _build_base(root: Path, rank: int) -> RecordBase:
    from deepcompile.plan.estimate import profiled_version, static_costs
    from deepcompile.plan.memory import facts_from_profile
    from deepcompile.profile.agree import drop_stalls
    from deepcompile.profile.profiler import Profile
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
        if v.kind != "dynamo" and v.after == BASE_PASS:
            path = gdir / v.file
            g = S.check_graph(str(path), load_json(path, root=root))
            if (g["graph_id"], g["kind"], g["after"]) != (v.graph_id, v.kind, v.after):
                raise WhatIfError(f"{path}: holds graph {g['graph_id']}/{g['kind']}/{g['after']} but the index "
                                  f"says {v.graph_id}/{v.kind}/{v.after}")
            v.nodes = g["nodes"]
            by_key.setdefault((v.graph_id, v.kind), []).append(v)
    for key in sorted(prof.graphs):
        vs = by_key.get(key, [])
        z = [v for v in vs if v.after == BASE_PASS]
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
    fused = cfg.get("compiler", "inductor") == "inductor"
    unmat = record_unmaterialized(prof, base, profiled) if fused else None
    facts = facts_from_profile(prof, meta, world, state, reduce_bytes=int(pf.get("reduce_bytes") or 0),
                               unmaterialized=unmat)
    for k in ("fb_peak", "optimizer_peak", "shard_bytes", "grad_bytes"):
        if pf.get(k):  # the run's own figures (its optimizer's real state, its reduce buckets)
            setattr(facts, k, int(pf[k]))
    capacity = int(plan["capacity_bytes"]) if plan and plan.get("capacity_bytes") else _capacity(rec.environment)
    host, measured = _measured(rec)
    names = [str(e.get("name") if isinstance(e, dict) else e) for e in (cfg.get("passes") or [])]
    prefix = names[:names.index(BASE_PASS) + 1] if BASE_PASS in names else [BASE_PASS]
    static = {}
    for key, d in base.items():
        vs = [x for x in (profiled[key], d) if x is not None]
        static[key] = static_costs(prof, vs, d, fused)
    return RecordBase(str(root), rank, cfg, prof, graphs, base, profiled, scope, meta, world, facts, plan, capacity,
                 fused, int(cfg.get("gradient_accumulation_steps") or 1),
                 host, measured, time.perf_counter() - t0, prefix, static, unmaterialized=unmat)


def record_unmaterialized(prof, base: dict, profiled: dict) -> dict:
    """A record's ``estimate.unmaterialized_by_graph``: per graph the version the profile measured
    (``profiled``), else the base graph."""
    from deepcompile.plan.estimate import unmaterialized_by_graph

    return unmaterialized_by_graph(prof, {k: (profiled.get(k) or d)["nodes"] for k, d in base.items()})


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
