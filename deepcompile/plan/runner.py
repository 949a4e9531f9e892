"""Pricing a pass list on graphs already traced: the planner's and the what-if's one runner.

Both the live planner (``plan.planner.plan_model``, on the graphs the profiling step measured)
and the what-if (``plan.whatif``, on a record's rebuilt graphs) ask the same question many times
over: what does the cost model predict for these graphs after these passes with these
parameters? :class:`GraphRunner` answers it: the passes run on fast copies of the base graphs
(``fx_compat.fast_graph_copy``; no GraphModule, no code generation, no lint), the result is read
into the cost model's node dicts once per value and target (:func:`model_nodes`), and the
per-graph costs that no pass after zero3 changes (matched latencies, the memory-bound rate,
Inductor's fused costs: ``estimate.static_costs``) are computed once per base.

A *source* is anything with the fields :class:`Source` declares (``plan.record_base.RecordBase`` is one,
built from a record; :func:`live_source` builds one from a Backend's compiled graphs).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

FULL_KEPT = 6   # whole predictions (versions, events, samples) kept per source for going back


class GraphOnly:
    """What a pass touches of a GraphModule: its graph and ``recompile()``. The runner runs the
    passes on copies of the profiled graphs only to predict them, so no Python code is generated
    for the copies (a GraphModule would codegen each one, several times per candidate)."""

    def __init__(self, graph):
        self.graph = graph

    def recompile(self) -> None:
        pass


@dataclass
class Source:
    """What a runner prices on: base graphs (never mutated), their record-style version dicts,
    the profile and the facts. ``plan.record_base.RecordBase`` has these fields too."""
    graphs: dict                    # (gid, kind) -> fx.Graph the passes start from
    base: dict                      # (gid, kind) -> its version dict (graph_id, kind, after, seq, nodes, notes)
    profiled: dict                  # (gid, kind) -> the version the profile measured (or None)
    static: dict                    # (gid, kind) -> estimate.static_costs of the base
    meta: dict                      # pid -> ParamMeta
    world: int
    rank: int
    profile: Any
    fused: bool
    accumulation: int
    facts: Any                      # plan.memory.MemoryFacts
    scope: dict = field(default_factory=dict)    # (gid, kind) -> {node name: scope} (shown versions only)
    times: dict = field(default_factory=dict)    # run key -> priced scalars
    full: dict = field(default_factory=dict)     # run key -> (model versions, shown versions, prediction)
    shapes: dict = field(default_factory=dict)   # model_nodes' cache


def live_source(compiled: dict, versions: list, last_pass: str | None, *, meta: dict, world: int, rank: int,
                profile, fused: bool, accumulation: int, facts) -> Source:
    """A source from a Backend's compiled graphs (``Backend.compiled``: (gid, kind) ->
    GraphModule, the graphs the profile measured). Their serialized nodes are the versions the
    backend already recorded (``versions``, after ``last_pass``) where those match the graph
    node for node; else the graph is serialized here."""
    from deepcompile.plan.estimate import static_costs
    from deepcompile.record.graph import serialize

    latest: dict = {}
    for v in versions:
        if v.kind != "dynamo" and v.after == (last_pass or "input"):
            latest[(v.graph_id, v.kind)] = v
    graphs, base, profiled, static = {}, {}, {}, {}
    for key, gm in compiled.items():
        v = latest.get(key)
        names = [n.name for n in gm.graph.nodes]
        nodes = v.nodes if v is not None and [n["name"] for n in v.nodes] == names else serialize(gm)
        d = {"graph_id": key[0], "kind": key[1], "after": last_pass or "input", "seq": 0, "nodes": nodes, "notes": []}
        graphs[key], base[key], profiled[key] = gm.graph, d, d  # the profile measured these very graphs
        static[key] = static_costs(profile, [d], d, fused)
    return Source(graphs, base, profiled, static, meta, world, rank, profile, fused, accumulation, facts)


# ------------------------------------------------------------------------------------ graph -> model nodes
def _plain(a, refs: list):
    """``a`` as the record writes it; the names of the nodes it refers to appended to ``refs``
    (in ``estimate.inputs_of``'s order)."""
    if isinstance(a, fx.Node):
        refs.append(a.name)
        return {"node": a.name}
    if isinstance(a, (list, tuple)):
        return [_plain(x, refs) for x in a]
    if isinstance(a, dict):
        return {str(k): _plain(v, refs) for k, v in a.items()}
    if isinstance(a, (int, float, bool, str)) or a is None:
        return a
    return repr(a)


def _shape_of(v) -> tuple:
    def one(t):
        return [int(x) if not isinstance(x, torch.SymInt) else str(x) for x in t.shape]
    if isinstance(v, torch.Tensor):
        return one(v), str(v.dtype).replace("torch.", "")
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, torch.Tensor) for x in v):
        return [one(x) for x in v], "tuple"
    return None, None


def model_nodes(g: fx.Graph, cache: dict) -> list[dict]:
    """What the cost model reads of a graph (``record.graph.serialize``'s name, op, target,
    args, kwargs, shape and dtype; not its scope, moves or source lines), for the planner's
    candidates, which are priced, never shown. A candidate's nodes share their values with the
    base graph's (a copy's meta is shallow), so each value's shape and each target's name is
    worked out once per source (``cache``)."""
    from deepcompile.plan.estimate import INPUTS
    from deepcompile.record.graph import target_name

    out = []
    for n in g.nodes:
        v = n.meta.get("val")
        hit = cache.get(id(v))
        if hit is None or hit[0] is not v:
            hit = cache[id(v)] = (v, *_shape_of(v))  # the value is held, so its id is not reused
        t = cache.get(("t", n.target))
        if t is None:
            t = cache[("t", n.target)] = target_name(n)
        refs: list = []
        d = {"name": n.name, "op": n.op, "target": t, "args": _plain(n.args, refs), "shape": hit[1], "dtype": hit[2]}
        if n.kwargs:
            d["kwargs"] = _plain(n.kwargs, refs)
        d[INPUTS] = refs  # what estimate.inputs_by_name would work out again
        out.append(d)
    return out


def _no_lint() -> None:
    pass


def copy_graph(g: fx.Graph) -> fx.Graph:
    """A copy to run passes on for a prediction. Its ``lint`` is a no-op: the passes lint
    what they produce (a tenth of a candidate's price on the 953M record), and the same passes
    with the same parameters are linted on the real graphs when the chosen plan is compiled
    (and the what-if's shown versions come from the same code); a copy priced and dropped gains
    nothing from it."""
    from deepcompile.compat import fx as fx_compat

    out = fx_compat.fast_graph_copy(g)
    out.lint = _no_lint  # an instance attribute over fx.Graph.lint (a plain Python method)
    return out


# ------------------------------------------------------------------------------------ the runner
class GraphRunner:
    """Runs a pass list (``names``, in order) on copies of a source's base graphs and prices
    it: the planner's step-time callable (:meth:`step_ms`) and the what-if's prediction
    (:meth:`evaluate`). ``fixed``: parameters every run uses (hand-set ones), under the
    candidate's."""

    def __init__(self, b, names: list[str], fixed: dict, ctx_path: str = "passes.{}.params"):
        self.b, self.names, self.fixed, self.ctx_path = b, names, fixed, ctx_path
        self.handoff: dict[int, dict] = {}   # graph id -> PassContext.handoff (forward to backward)

    def ctx(self, gid, kind, name, params):
        from deepcompile.params import build
        from deepcompile.passes import PASSES, PassContext

        return PassContext(graph_id=gid, kind=kind, params=build(PASSES[name].params_cls, params, self.ctx_path.format(name)),
                           param_meta=self.b.meta, world_size=self.b.world, rank=self.b.rank, profile=self.b.profile,
                           handoff=self.handoff.setdefault(gid, {}))

    def key(self, params: dict) -> str:
        return json.dumps([self.names, {n: params.get(n, {}) for n in self.names}], sort_keys=True, default=str)

    def evaluate(self, params: dict, keep_versions: bool) -> tuple[list[dict], list[dict], dict]:
        """(model versions, shown versions, cost_model.predict's dict) of ``params``; the last
        few are kept per source, so going back to an earlier edit is instant."""
        from deepcompile.plan.cost_model import predict

        b, k = self.b, self.key(params)
        hit = b.full.get(k)
        if hit is not None and (hit[1] is not None or not keep_versions):
            return hit
        mv, shown = self.run(params, keep_versions)
        p = predict(mv, b.profile, fused=b.fused, static=b.static)
        out = (mv, shown if keep_versions else None, p)
        b.full[k] = out
        while len(b.full) > FULL_KEPT:
            b.full.pop(next(iter(b.full)))
        b.times[k] = {"step_ms": p["step_ms"], "optimizer_ms": p["optimizer_ms"]}
        return out

    def run(self, params: dict, keep_versions: bool) -> tuple[list[dict], list[dict]]:
        """(versions for the cost model, versions to show: one per pass that ran, per graph)."""
        from deepcompile.passes import PASSES
        from deepcompile.record.graph import serialize

        b = self.b
        model, shown = [], []
        for key in sorted(b.graphs, key=lambda k: (k[0], k[1] != "forward")):
            gid, kind = key
            cp = GraphOnly(copy_graph(b.graphs[key]))
            seq = b.base[key].get("seq", 0)
            if b.profiled.get(key) is not None:
                model.append(b.profiled[key])  # the profiled version: the latencies' names are matched on it
            for name in self.names:
                c = self.ctx(gid, kind, name, params.get(name, {}))
                t0 = time.perf_counter()
                cp = PASSES[name].fn(cp, c)
                if keep_versions:
                    seq += 1
                    nodes = serialize(cp)
                    sc = b.scope.get(key, {})
                    for n in nodes:
                        if not n.get("scope"):
                            n["scope"] = sc.get(n["name"], "")
                    shown.append({"graph_id": gid, "kind": kind, "after": name, "seq": seq, "nodes": nodes,
                                  "notes": list(c.notes), "seconds": round(time.perf_counter() - t0, 4),
                                  "source": "predicted"})
            final = shown[-1]["nodes"] if (keep_versions and self.names) else (
                model_nodes(cp.graph, b.shapes) if self.names else b.base[key]["nodes"])
            model.append({"graph_id": gid, "kind": kind, "after": "whatif", "nodes": final})
        return model, shown

    def gpu_ms(self, p: dict, kept: int, offloaded: int, streamed: bool = False) -> float:
        """The step on the GPU's timeline: the graphs once per micro-batch (kept parameters
        gathered once per optimizer step), the optimizer step, the offload copies not hidden."""
        from deepcompile.plan.estimate import offload_ms

        b = self.b
        graphs_ms = p["step_ms"] - p["optimizer_ms"]
        comm = getattr(b.profile, "comm", None)
        again = (b.accumulation - 1) * (comm.allgather_us(kept) / 1e3 if (comm and kept) else 0.0)
        return (b.accumulation * graphs_ms - again + p["optimizer_ms"]
                + offload_ms(offloaded, b.accumulation * graphs_ms, streamed))

    def predicted(self, cand) -> dict:
        """``plan.cost_model.predict``'s whole result (events included) for a candidate: from
        the last few kept per source, else priced again here (as is one another rank priced,
        ``pricing.SplitTimer``)."""
        return self.evaluate(merge(self.fixed, cand.params()), False)[2]

    def step_ms(self, cand) -> float:
        """The planner's callable: a candidate's predicted GPU step (priced once per source and
        parameters: a changed memory limit re-plans from the times already known)."""
        params = merge(self.fixed, cand.params())
        p = self.b.times.get(self.key(params))
        if p is None:
            p = self.evaluate(params, False)[2]
        return self.gpu_ms(p, cand.kept, cand.offloaded, cand.streamed)

    step_ms.coarse_to_fine = True  # priced by running the passes: planner.price searches coarse to fine

    def kept(self, budget_mb: float) -> tuple[int, list[int]]:
        """(bytes, parameter ids) selective_unshard keeps under ``budget_mb``."""
        from deepcompile.passes import selective_unshard as su

        ids = su.choose(self.ctx(0, "forward", su.NAME, {"budget_mb": budget_mb}))
        return sum(self.b.facts.gathered.get(p, 0) for p in ids), ids


def merge(explicit: dict, planned: dict) -> dict:
    """``planned`` under ``explicit``: a hand-set value wins."""
    out = {k: dict(v) for k, v in explicit.items()}
    for name, ps in planned.items():
        for k, v in ps.items():
            out.setdefault(name, {}).setdefault(k, v)
    return out
