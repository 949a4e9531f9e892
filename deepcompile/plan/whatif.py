"""What-if: a run record's predicted step time and memory under other pass parameters, at once.

The record holds what a re-plan needs: the graphs as traced (``after == "zero3"``, the version
the later passes start from), the agreed profile (per-node latency and memory, the optimizer
step, the communication model) and the plan the run chose. :func:`predict_run` rebuilds those
graphs as FX graphs (dc ops with their real operators, which the passes match; every other op a
stand-in of the same name, which the cost model matches by name; every value a meta tensor of
its recorded shape), runs the requested passes on copies of them, and prices the result with
the cost model (:func:`deepcompile.plan.cost_model.predict`) and the memory model
(:func:`deepcompile.plan.memory.plan_memory`). No Dynamo, no torch.compile, no device: the
rebuilt graphs are cached per record, so an edit costs one pass run and one estimate
(:mod:`deepcompile.plan.rebuild` rebuilds the graphs, :mod:`deepcompile.plan.record_base` reads
and caches a record's base; how each pass is treated offline it declares itself,
``PassDef.offline``).

Parameters the planner fills (``prefetch.budget_mb``/``fuse_mb``, ``selective_unshard.budget_mb``)
may be given as ``"auto"``: the planner (:func:`deepcompile.plan.planner.choose`) decides them on
the same graphs, as the run would; with the record's config planning (``plan: true``, the
default ZeRO-3 plan) a parameter left out is ``"auto"`` too, else it takes its declared default.

The step: the cost model's GPU timeline (which on a GPU profile includes the host's launch
time per op, ``profile.host.HOST_US``: a host-bound step takes the host's pace), at least the
record's measured host time per step where its steps carry one (``host_s``). On a CPU record the
step adds what the record's own plan measured beyond the model (``WhatIf.calibration``, ms): the
passes change only collectives, and what the model leaves out is the same for every plan. The
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
import time
from dataclasses import dataclass, field

from deepcompile.params import ConfigError
from deepcompile.passes import PASSES, offload_activations, offload_optimizer, prefetch, recompute_activations
from deepcompile.passes import selective_unshard as su
from deepcompile.passes.registry import OFFLINE_MEMORY, OFFLINE_RERUN, absent_params
from deepcompile.plan.device_memory import DEFAULT_LIMIT_FRACTION
from deepcompile.plan.memory import GIB, MIB, STREAM_CHUNK_MB, PlanMemory, plan_memory, prefetch_bytes, with_reloads
from deepcompile.plan.pricing import no_gc
from deepcompile.plan.rebuild import WhatIfError, param_meta, rebuild
from deepcompile.plan.record_base import BASE_PASS, RecordBase, _measured, clear_cache, load_base
from deepcompile.plan.runner import GraphRunner
from deepcompile.vocab.memory import MEMORY_CATEGORIES

__all__ = ["WhatIf", "WhatIfError", "predict_run", "headline", "own_passes", "prediction", "predict_base", "variant",
           "plan_record", "rebuild", "param_meta", "load_base", "clear_cache", "MEMORY_CATEGORIES", "_measured"]

AUTO = "auto"
# passes whose graph rewrite the what-if runs on the rebuilt graphs (PassDef.offline); those
# declared OFFLINE_MEMORY (offload_optimizer) are priced by the memory model instead
GRAPH_PASSES = tuple(n for n, p in PASSES.items() if p.offline == OFFLINE_RERUN)
# planned passes the planner decides whenever they are listed (not only adds when nothing fits)
ALWAYS_PLANNED = tuple(n for n, p in PASSES.items() if p.planned and not p.planner_adds)
PLANNER_ADDS = tuple(n for n, p in PASSES.items() if p.planner_adds)   # ... and those it adds when nothing fits
# the passes the offline planner prices, in the default plan's order (after zero3)
PLAN_PASSES = (prefetch.NAME, su.NAME)


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
    calibration: float | None = None   # ms the record's own plan measured beyond the model (CPU), added
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
    cal = (f"; calibrated to this run's measured step ({w.calibration:+.1f} ms the model leaves out)"
           if w.calibration is not None else "")
    return w, (f"{w.headline()} — plan.whatif on {'these passes' if passes is not None else 'the run’s own passes'}: "
               f"{describe_passes(ps)}{cal}")


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

    explicit, auto, hand = {}, {}, {}
    for i, (name, params) in enumerate(entries):
        path = f"passes[{i}].params"
        pdef = PASSES[name]
        fields = {f.name for f in dataclasses.fields(pdef.params_cls)}
        a = []
        for k, v in list(params.items()):
            if isinstance(v, str) and v.strip().lower() == AUTO:
                if k not in pdef.planned or k not in fields:
                    # not the planner's: "auto" is then an ordinary value of the parameter (e.g.
                    # prefetch.backend's own default), accepted or refused by its declared spec
                    continue
                a.append(k)
                params.pop(k)
        if planning and not pdef.planner_adds:   # a pass the planner only adds is planned only then
            a += [k for k in pdef.planned if k not in params and k not in a and k in fields]
        build(pdef.params_cls, params, path)  # validates every explicit value, naming its path
        explicit[name] = params
        if a:
            auto[name] = a
        if pdef.planned and params:
            hand[name] = {k: v for k, v in params.items() if k in pdef.planned}
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


def predict_base(base: RecordBase, passes, *, memory_limit_gib: float | None = None) -> WhatIf:
    """:func:`predict_run` on a base already at hand (``load_base``, or a :func:`variant` of one)."""
    with no_gc():
        return _predict_run(base.path, passes, base.rank, memory_limit_gib, base)


def _own_passes(b: RecordBase) -> list | None:
    """The pass list the record's last compile used: the plan's (plan.json), else the config's
    last scheduled list, else its passes."""
    if b.plan and b.plan.get("passes"):
        return b.plan["passes"]
    sched = [e for e in b.config.get("schedule") or [] if isinstance(e, dict) and e.get("passes")]
    return sched[-1]["passes"] if sched else (b.config.get("passes") or None)


def _calibration(b: RecordBase) -> float | None:
    """On a CPU record: the milliseconds a step of the record's own plan measured beyond what the
    model predicts for it, added to every plan's prediction. The passes change only the
    collectives; what the model leaves out (the autograd engine, the compiled code's Python, the
    optimizer's hooks, the profiler's own per-node cost) is the same for every plan, so it is
    an offset, not a factor: an edit that adds communication adds its modelled time on top. On
    a GPU the profile's CUDA-event latencies and the host model stand as they are (within 2-10%
    of the 2-H200 runs): None."""
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
        b.calibration = float(b.measured["step_ms"]) - w.model_step_ms
    return b.calibration


def _predict_run(run_dir, passes, rank: int, memory_limit_gib: float | None, base: RecordBase | None = None,
                 calibrate: bool = True, replan: bool = True) -> WhatIf:
    from deepcompile.plan import planner as P

    t0 = time.perf_counter()
    if memory_limit_gib is not None and (isinstance(memory_limit_gib, bool) or not isinstance(memory_limit_gib, (int, float))
                                         or not (0 < memory_limit_gib < 1e6)):
        raise ConfigError(f"memory_limit_gib: expected a positive number of GiB, got {memory_limit_gib!r}")
    entries = _entries(passes)
    names = [n for n, _ in entries]
    if BASE_PASS not in names:
        raise WhatIfError(f"passes: {names} has no '{BASE_PASS}'; a what-if re-plans the ZeRO-3 graphs the record "
                          f"traced (the passes after {BASE_PASS} run on them), so the list needs {BASE_PASS}")
    b = base if base is not None else load_base(run_dir, rank)
    cfg_plan = b.config.get("plan")
    planning = bool(cfg_plan) if cfg_plan is not None else bool(b.plan)
    explicit, auto, hand = _resolve(entries, planning)
    notes: list[str] = []
    after = names[names.index(BASE_PASS) + 1:]
    # recompute_activations rewrites before zero3, but is priced from the run's block costs
    before = [n for n in names[:names.index(BASE_PASS) + 1] if n != recompute_activations.NAME]
    if before != b.prefix and b.config.get("passes"):
        notes.append(f"the passes up to {BASE_PASS} {before} differ from the record's {b.prefix}: the graphs are the "
                     f"record's (a change before {BASE_PASS} needs a new trace: use Run)")
    # offload_activations by block (the planner's lever) is priced from the run's block costs, as
    # recompute is; by its own keep_mb rule it is re-run on the graphs
    by_blocks = bool(_offload_blocks(explicit)) and bool(_offload_costs(b))
    graph_names = [n for n in after if n in GRAPH_PASSES and not (n == offload_activations.NAME and by_blocks)]
    skipped = [n for n in after if PASSES[n].offline not in (OFFLINE_RERUN, OFFLINE_MEMORY)]
    if skipped:
        notes.append(f"{', '.join(skipped)}: not re-run offline (no graph rewrite to price); its effect is not predicted")
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
        limit, limit_src = int(DEFAULT_LIMIT_FRACTION * b.capacity), "90% of the device"
    else:
        limit = 1 << 62
    plan_d = None
    params = {k: dict(v) for k, v in explicit.items()}
    recorded = (b.plan or {}).get("chosen", {}).get("params") or {}
    same = (auto and recorded and not hand and b.plan.get("limit_bytes") == limit
            and all(set(auto.get(n, ())) == {k for k in PASSES[n].planned if k in recorded.get(n, {})}
                    for n in ALWAYS_PLANNED if n in names)
            and all(n in names for n in ALWAYS_PLANNED if n in recorded))
    if same:
        # every planned value is "auto" under the run's own limit: the run's planner already
        # chose, from the same profile (plan.json); its choice is what the run would do again
        plan_d = b.plan
        for name, keys in auto.items():
            for k in keys:
                if k in recorded.get(name, {}):
                    params.setdefault(name, {})[k] = recorded[name][k]
        for n in PLANNER_ADDS:
            if n in recorded and n not in names:
                params[n] = dict(recorded[n])
        notes.append("planner: the run's own choice (plan.json, same limit and hand-set values): "
                     + ", ".join(f"{n}.{k} = {params[n][k]:g}" for n, ks in auto.items() for k in ks
                                 if k in params.get(n, {})))
    elif auto:
        cap = b.capacity or limit
        mem = P.DeviceMemory(cap, cap, limit, limit_src)
        # a pass the list lacks changes nothing: its planned parameters are held where it would not
        planned_hand = {**hand, **absent_params(names), **_chunk_hand(b)}
        plan = P.choose(facts, mem, lambda mb: runner.kept(mb)[0], runner.step_ms, planned_hand,
                        "cost model on the record's graphs (what-if)",
                        recompute_levels=P.recompute_levels(_block_costs(b), explicit), accumulation=b.accumulation,
                        offload=None if offload_activations.NAME in names else _activation_offload(b))
        P.with_pace(plan, runner)
        plan_d = plan.to_dict()
        chosen = plan.chosen.params()
        for name, keys in auto.items():
            for k in keys:
                if k in chosen.get(name, {}):
                    params.setdefault(name, {})[k] = chosen[name][k]
        for n in PLANNER_ADDS:
            if n in chosen and n not in names:
                notes.append(f"the planner adds {n} to fit {limit / GIB:.2f} GiB ({limit_src}), as the run would")
                params[n] = dict(chosen[n])
        notes.append(f"planner ({limit_src}): " + ", ".join(f"{n}.{k} = {params[n][k]:g}" for n, ks in auto.items()
                                                              for k in ks if k in params.get(n, {})))
    # the resolved plan: what it keeps, prefetches and offloads, and its memory
    from deepcompile.params import build

    full = {n: dataclasses.asdict(build(PASSES[n].params_cls, params.get(n, {}), f"passes.{n}.params")) for n in names}
    su_mb = full[su.NAME]["budget_mb"] if su.NAME in names else 0.0
    kept, kept_ids = runner.kept(su_mb) if su_mb > 0 else (0, [])
    pf = full.get(prefetch.NAME)
    ahead = prefetch_bytes(facts, kept, pf["budget_mb"], pf["fuse_mb"]) if pf else 0
    offloaded, streamed, room = 0, False, None
    recomputed = _recomputed(b, params, notes)
    act_ms, act_away = _offloaded(b, params, notes)
    oo = offload_optimizer.NAME   # priced by the memory model (OFFLINE_MEMORY)
    if oo in full or oo in params:
        o = full.get(oo) or params[oo]
        lim = int(o.get("limit_mb", 0) * MIB) or (b.capacity or limit)
        room = lim - int(o.get("headroom_mb", 1024.0) * MIB)
        # what the forward/backward needs beyond the room once the plan's recomputed and offloaded
        # activations are off the device, as the planner counts it (planner.choose)
        need = plan_memory(facts, kept, ahead, recompute=recomputed + act_away).fb_peak - room
        streamed = o.get("step") == "streamed"
        offloaded = facts.state_bytes if streamed else max(0, min(int(need), facts.state_bytes))
        notes.append(f"offload_optimizer: {offloaded / GIB:.2f} GiB of {facts.state_bytes / GIB:.2f} GiB optimizer "
                     f"state predicted off the device in forward/backward (limit {lim / GIB:.2f} GiB)")
    pm = plan_memory(facts, kept, ahead, offloaded, recompute=recomputed + act_away,
                     streamed_chunk_mb=(P.stream_chunk_mb(facts, _chunk_hand(b)) or STREAM_CHUNK_MB) if streamed else None)
    if offloaded and room is not None:
        pm = with_reloads(pm, room)
    mv, shown, p = runner.evaluate(params, True)
    gpu_ms = runner.gpu_ms(p, kept, offloaded, streamed) + b.accumulation * (sum(c.ms for c in recomputed) + act_ms)
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
        step = max(model_step + cal, 0.1 * model_step)
        notes.append(f"calibrated to this run: its own plan measured {b.measured['step_ms']:.1f} ms a step where the "
                     f"model says {b.measured['step_ms'] - cal:.1f} ms; the {cal:+.1f} ms the model leaves out of every "
                     f"plan on the CPU (autograd, the compiled code's Python, hooks) is added to the model's "
                     f"{model_step:.1f} ms")
    if b.accumulation > 1:
        notes.append(f"gradient accumulation {b.accumulation}: graphs x{b.accumulation}, kept parameters gathered once")
    notes.append(f"memory: {pm.summary()}; kept {len(kept_ids)} parameter(s) gathered ({kept / MIB:.0f} MiB), "
                 f"prefetch up to {ahead / MIB:.0f} MiB ahead")
    # the schedule as the model has it: the calibration is time outside the graphs' nodes
    sched = [{"graph_id": e["graph_id"], "kind": e["kind"], "node": e["node"], "stream": e["stream"],
              "start_ms": e["start_us"] / 1e3, "end_ms": e["end_us"] / 1e3, "source": "predicted"}
             for e in p["events"]]
    asked = int(memory_limit_gib * GIB) if memory_limit_gib else None
    warnings: list[str] = []
    if asked is not None and pm.peak > asked:
        from deepcompile.vocab.memory import fmt_bytes

        over = (f"the memory limit {fmt_bytes(asked)} ({memory_limit_gib:g} GiB) is below the predicted peak "
                f"{fmt_bytes(int(pm.peak))} of these values")
        if replan and hand:
            # the hand-set planned values do not fit: the planner chooses them under the limit
            again = [{"name": n, "params": dict({kk: v for kk, v in ps.items() if kk not in PASSES[n].planned},
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


def _block_costs(b: RecordBase) -> list:
    """What recomputing each block saves and costs, as the run's planner found it (plan.json's
    ``recompute_options``); empty where the record lacks them."""
    from deepcompile.plan.recompute_choice import BlockCost

    try:
        return [BlockCost.from_dict(d) for d in (b.plan or {}).get("recompute_options") or []]
    except (KeyError, TypeError, ValueError):
        return []


def _recomputed(b: RecordBase, params: dict, notes: list) -> tuple:
    """The block costs of the blocks ``params`` recompute (``recompute_activations.blocks``)."""
    text = params.get(recompute_activations.NAME, {}).get("blocks", "")
    if not text or text == AUTO:
        return ()
    wanted = recompute_activations.parse_blocks(text, f"passes.{recompute_activations.NAME}.params.blocks")
    costs = [c for c in _block_costs(b) if wanted == "all" or c.block in wanted]
    if not costs:
        notes.append(f"{recompute_activations.NAME}: the record has no block costs; its effect is not predicted")
        return ()
    notes.append(f"{recompute_activations.NAME}: blocks {[c.block for c in costs]} recomputed in backward, "
                 f"{sum(c.nbytes for c in costs) / GIB:.2f} GiB of activations off the device, "
                 f"+{b.accumulation * sum(c.ms for c in costs):.1f} ms a step")
    return tuple(costs)


def _chunk_hand(b: RecordBase) -> dict:
    """The run's ``optimizer_chunk_mb`` where set by hand, as the planner holds it (``{"optimizer":
    {"chunk_mb": MiB}}``); empty for 'auto'."""
    v = b.config.get("optimizer_chunk_mb", "auto")
    try:
        return {} if v in (None, "auto") else {"optimizer": {"chunk_mb": float(v)}}
    except (TypeError, ValueError):
        return {}


def _offload_blocks(params: dict) -> str:
    text = str(params.get(offload_activations.NAME, {}).get("blocks", "")).strip()
    return "" if text == AUTO else text


def _offload_costs(b: RecordBase) -> list:
    """What offloading each block's activations moves and when, as the run's planner found it
    (plan.json's ``offload_options``); empty where the record lacks them."""
    from deepcompile.plan.offload_choice import OffloadCost

    try:
        return [OffloadCost.from_dict(d) for d in (b.plan or {}).get("offload_options") or []]
    except (KeyError, TypeError, ValueError):
        return []


def _activation_offload(b: RecordBase):
    """The activation-offload lever as the run's planner weighed it (``planner.ActivationOffload``
    from plan.json's offload and recompute options); None where the record has no offload options."""
    from deepcompile.plan.planner import ActivationOffload

    return ActivationOffload.of(_offload_costs(b), None, {c.block: c.ms for c in _block_costs(b)})


def _offloaded(b: RecordBase, params: dict, notes: list) -> tuple[float, tuple]:
    """(ms the copies add to a micro-batch, the bytes' windows off the device) of the blocks whose
    activations ``params`` offload (``offload_activations.blocks``), from the run's block costs."""
    from deepcompile.plan.planner import ActivationOffload

    text = _offload_blocks(params)
    if not text:
        return 0.0, ()
    wanted = recompute_activations.parse_blocks(text, f"passes.{offload_activations.NAME}.params.blocks")
    costs = tuple(c for c in _offload_costs(b) if wanted == "all" or c.block in wanted)
    if not costs:
        notes.append(f"{offload_activations.NAME}: the record has no offload costs per block; its effect is not predicted")
        return 0.0, ()
    ms, away = ActivationOffload(list(costs), None).schedule(costs)
    notes.append(f"{offload_activations.NAME}: the activations of blocks {sorted(c.block for c in costs)} offloaded "
                 f"to host, {sum(c.nbytes for c in costs) / GIB:.2f} GiB off the device, "
                 f"+{b.accumulation * ms:.1f} ms a step for the copies (what the compute does not cover, and what covered "
                 f"copies cost it)")
    return ms, away


# ------------------------------------------------------------------------------------ the planner offline
def variant(b: RecordBase, *, world: int | None = None, gb_per_s: float | None = None, alpha_us: float | None = None,
            optimizer_peak_gib: float | None = None, accumulation: int | None = None,
            compiler: str | None = None, capacity_gib: float | None = None,
            optimizer_ms: float | None = None, facts: dict | None = None) -> RecordBase:
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
    fused = b.fused if compiler is None else compiler == "inductor"
    unmat = b.unmaterialized
    if fused != b.fused:   # only a fused compile leaves values unwritten (estimate.unmaterialized_bytes)
        from deepcompile.plan.record_base import record_unmaterialized

        unmat = record_unmaterialized(prof, b.base, b.profiled) if fused else None
    if prof is not b.profile or w != b.world or fused != b.fused:
        mf = facts_from_profile(prof, b.meta, w, b.facts.state_bytes, reduce_bytes=b.facts.reduce_bytes,
                                unmaterialized=unmat)
    if facts:  # another run's own figures (a plan.json's "facts")
        mf = dataclasses.replace(mf)
        for k in ("fb_peak", "optimizer_peak", "shard_bytes", "grad_bytes", "state_bytes", "reduce_bytes"):
            if facts.get(k) is not None:
                setattr(mf, k, int(facts[k]))
    static = b.static if fused == b.fused else {
        k: static_costs(prof, [x for x in (b.profiled[k], d) if x is not None], d, fused) for k, d in b.base.items()}
    return dataclasses.replace(b, profile=prof, world=w, facts=mf, fused=fused, static=static, unmaterialized=unmat,
                               accumulation=accumulation or b.accumulation,
                               capacity=int(capacity_gib * GIB) if capacity_gib else b.capacity,
                               times={}, full={})


def plan_record(run_dir, *, rank: int = 0, limit_gib: float | None = None, **changes):
    """The planner on a record, offline: (plan, base, [(candidate, predicted GPU ms)]) for every
    candidate it priced. ``changes``: see :func:`variant`. The limit: ``limit_gib``, else 90% of
    the capacity (``capacity_gib``, the record's plan, or the device's by name). Its levers are the
    run's planner's: keep, prefetch, optimizer offload and chunks, and the blocks to recompute or
    whose activations to offload, as that planner found them (plan.json's ``recompute_options``
    and ``offload_options``; a record without them plans without those two levers)."""
    from deepcompile.plan import planner as P

    b = load_base(run_dir, rank)
    gc.disable()  # see predict_run (a command-line run: re-enabled at exit)
    if any(v is not None for v in changes.values()):
        b = variant(b, **changes)
    cap = b.capacity or int(141.0 * GIB)
    limit = int(limit_gib * GIB) if limit_gib else int(DEFAULT_LIMIT_FRACTION * cap)
    mem = P.DeviceMemory(cap, cap, limit, f"limit {limit_gib:g} GiB" if limit_gib else "90% of the capacity")
    runner = GraphRunner(b, list(PLAN_PASSES), {})
    seen = []

    def timed(c):
        t = runner.step_ms(c)
        seen.append((c, t))
        return t
    timed.coarse_to_fine = getattr(runner.step_ms, "coarse_to_fine", False)
    block_costs = _block_costs(b)
    offload = _activation_offload(b)
    plan = P.choose(b.facts, mem, lambda mb: runner.kept(mb)[0], timed, {},
                    "cost model on the record's graphs (offline)", recompute_levels=P.recompute_levels(block_costs, {}),
                    accumulation=b.accumulation, offload=offload)
    plan.block_costs, plan.offload_costs = block_costs, list(offload.costs) if offload is not None else []
    P.with_pace(plan, runner)
    return plan, b, seen
