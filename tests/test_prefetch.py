"""The prefetch pass: same numerics, gathers really issued earlier, and a budget respected
both on the graph and in measured gathered memory."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.test_zero3_parity import _compare
from tests.workloads import train_sharded


def _prefetch(budget_mb, fuse_mb=0.0, **extra):
    return {"name": "prefetch", "params": {"budget_mb": budget_mb, "fuse_mb": fuse_mb, **extra}}


def _graph(result, kind, after):
    for gid, k, a, nodes in result["graphs"]:
        if gid == 0 and k == kind and a == after:
            return nodes
    raise AssertionError(f"no {kind} graph after {after}")


def _issue_distance(nodes):
    """For every wait: how many nodes separate it from the collective it waits for."""
    pos = {n["name"]: i for i, n in enumerate(nodes)}
    out = {}
    for i, n in enumerate(nodes):
        if n["target"] == "dc.wait_allgather":
            out[n["param"]] = i - pos[n["args"][0]["node"]]
    return out


def _max_bytes_ahead(nodes, meta_bytes):
    """Bytes issued but not yet waited for, at the worst point of the graph."""
    inflight, worst = {}, 0
    for n in nodes:
        if n["target"] == "dc.allgather_param":
            inflight[n["param"]] = meta_bytes[n["param"]]
        elif n["target"] == "dc.allgather_params":
            for pid in n["args"][1]:
                inflight[pid] = meta_bytes[pid]
        elif n["target"] == "dc.wait_allgather":
            worst = max(worst, sum(inflight.values()))
            inflight.pop(n["param"], None)
    return worst


def test_prefetch_preserves_numerics_and_fuses():
    results = _compare(2, 1, {"compiler": "aot_eager", "passes": ["zero3", _prefetch(64.0, 64.0)]})
    st = results[0]["stats"]
    assert st["fused_allgathers"] > 0, st  # small parameters travelled together
    fw = _graph(results[0], "forward", "prefetch")
    assert any(n["target"] == "dc.allgather_params" for n in fw)


def test_prefetch_moves_gathers_earlier_within_budget():
    small, large = 0.02, 64.0  # MiB; the model's largest gathered parameter is 16 KiB
    r_small, r_large = (
        run_ranks(train_sharded, 2, 2, 1, {"compiler": "aot_eager", "passes": ["zero3", _prefetch(b)]},
                  timeout=300)[0]
        for b in (small, large))
    base = _issue_distance(_graph(r_large, "forward", "zero3"))
    far = _issue_distance(_graph(r_large, "forward", "prefetch"))
    near = _issue_distance(_graph(r_small, "forward", "prefetch"))
    assert all(d == 1 for d in base.values()), "zero3 alone issues each gather right before its wait"
    assert sum(far.values()) > sum(near.values()) > sum(base.values())
    assert max(far.values()) > 10
    # the budget holds on the graph ...
    from tests.workloads import make_model

    m = make_model()
    names = {}
    for name, p in m.named_parameters():
        names[name] = p.numel() * 4
    # parameter ids follow first appearance, like named_parameters() (tied weight once)
    meta_bytes = dict(enumerate(names.values()))
    largest = max(meta_bytes.values())
    assert _max_bytes_ahead(_graph(r_small, "forward", "prefetch"), meta_bytes) <= max(small * 2**20, largest)
    # ... and in measured gathered memory (the runtime tracks every live gathered storage)
    assert r_small["stats"]["peak_live_gathered_bytes"] < r_large["stats"]["peak_live_gathered_bytes"]
    assert r_small["losses"] == r_large["losses"]


def _train(model, opt, rank, world, steps, after=None):
    """The plain loop on this rank's slice of the global batch; returns the losses."""
    from tests.workloads import LOCAL_BATCH, global_batch

    losses = []
    for s in range(steps):
        x, y = global_batch(s, 0, world)
        sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        loss = model(x[sl], y[sl])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if after is not None:
            after(s)
    return losses


def _scheduled(rank, world):
    import gc
    import weakref

    import deepcompile
    from tests.workloads import make_model, make_optimizer

    cfg = {"compiler": "aot_eager", "passes": ["zero3"],
           "schedule": [{"step": 2, "passes": ["zero3", _prefetch(64.0, 64.0)]}]}
    model, opt = deepcompile.initialize(make_model(), make_optimizer, cfg)
    old_graphs = []

    def after(s):
        if s == 0:
            old_graphs.extend(weakref.ref(g) for g in model.dc_backend.compiled.values())

    losses = _train(model, opt, rank, world, 4, after)
    gc.collect()
    alive = sum(r() is not None for r in old_graphs)
    versions = sorted({(v.step, v.after) for v in model.dc_graphs})
    return losses, alive, len(old_graphs), versions


def test_pass_schedule_recompiles_without_leaking():
    from tests.workloads import train_reference

    results = run_ranks(_scheduled, 2, timeout=300)
    ref_losses, _ = train_reference(2, 4, 1)
    mean = torch.tensor([r[0] for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref_losses, dtype=mean.dtype), rtol=1e-5, atol=1e-6)
    for losses, alive, n_old, versions in results:
        assert n_old >= 2 and alive == 0, f"{alive} of {n_old} step-0 graphs survived the re-compile"
        assert (0, "zero3") in versions and (2, "prefetch") in versions and (0, "prefetch") not in versions


def _profiled(rank, world):
    import deepcompile
    from deepcompile.profile import profiler
    from tests.workloads import make_model, make_optimizer

    # ranks measure slightly different latencies (as real ranks do); decisions must still agree
    orig = profiler.ProfilingInterpreter.run_node

    def jittered(self, n):
        out = orig(self, n)
        if self.records and self.records[-1].name == n.name:
            self.records[-1].latency_ms *= 1.0 + 0.05 * (rank + 1) * ((hash(n.name) % 7) / 7)
        return out

    profiler.ProfilingInterpreter.run_node = jittered
    # cover > 0: the hoist follows the measured latencies (the path the jitter must not split)
    cfg = {"compiler": "aot_eager", "passes": ["zero3"], "profile_step": 1,
           "schedule": [{"step": 2, "passes": ["zero3", _prefetch(64.0, 0.0, cover=1.2)]}]}
    model, opt = deepcompile.initialize(make_model(), make_optimizer, cfg)
    losses = _train(model, opt, rank, world, 4)
    prof = model.dc_profile
    flat = [(k, n.name, n.latency_ms, n.peak_bytes) for k, gp in sorted(prof.graphs.items()) for n in gp.nodes]
    final = [v.nodes for v in model.dc_graphs if v.step == 2 and v.after == "prefetch"]
    from deepcompile.plan.cost_model import predict

    before = predict([v for v in model.dc_graphs if v.step == 0 and v.after == "zero3"], prof)
    after = predict([v for v in model.dc_graphs if v.step == 2 and v.after == "prefetch"], prof)
    # the profiling step ran the step-0 graphs through the profiler: nothing compiled at step 1
    compiled_at_profile_step = [v.kind for v in model.dc_graphs if v.step == 1]
    # the profile carries the profiling step's optimizer.step(), in records too
    from deepcompile.profile.profiler import Profile
    back = Profile.from_records(prof.to_records())
    assert back.optimizer_ms == prof.optimizer_ms
    return (losses, flat, final, (prof.comm.alpha_us, prof.comm.bytes_per_us, prof.optimizer_ms), (before, after),
            compiled_at_profile_step)


def test_profile_step_trains_agrees_across_ranks_and_guides_prefetch():
    from tests.workloads import train_reference

    results = run_ranks(_profiled, 2, timeout=300)
    ref_losses, _ = train_reference(2, 4, 1)
    mean = torch.tensor([r[0] for r in results]).mean(0)
    # the profiling step is a real training step: numerics unchanged
    torch.testing.assert_close(mean, torch.tensor(ref_losses, dtype=mean.dtype), rtol=1e-5, atol=1e-6)
    (_, flat0, final0, comm0, pred0, at1), (_, flat1, final1, comm1, pred1, _) = results
    assert at1 == [], f"the profiling step compiled again: {at1}"
    kinds = {k for k, *_ in flat0}
    assert ((0, "forward") in kinds) and ((0, "backward") in kinds)
    assert sum(lat for _, _, lat, _ in flat0) > 0 and all(lat >= 0 for _, _, lat, _ in flat0)
    assert flat0 == flat1, "ranks hold different profiles after agreement"
    assert comm0 == comm1 and comm0[1] > 0
    assert comm0[2] > 0, "the profiling step did not time optimizer.step()"
    # a predicted step is its graphs plus the optimizer
    assert pred0[0]["step_ms"] == pytest.approx(sum(pred0[0]["per_graph_ms"].values()) + comm0[2])
    assert final0 and final0 == final1, "ranks compiled different graphs from the profile"
    moved = _issue_distance(final0[0])
    assert max(moved.values()) > 1, "the profile-guided prefetch moved nothing"

    # the cost model, fed the agreed profile, predicts what prefetch buys and what it costs
    before, after = pred0
    assert before["step_ms"] > 0 and after["step_ms"] <= before["step_ms"] + 1e-9
    assert after["peak_bytes"] >= before["peak_bytes"]
    assert pred0[0]["step_ms"] == pred1[0]["step_ms"], "ranks predict differently from one profile"


# --------------------------------------------------------------------------- moves, recorded
def _tiny_zero3_graph(n_params: int = 3, numel: int = 1024):
    """What zero3 leaves for ``x * p0 * p1 * ...``: each gather issued right before its wait.
    Returns (GraphModule, param_meta, {name: node} of the interesting nodes)."""
    import torch.fx as fx

    from deepcompile.runtime import ops

    ops.ensure_registered()
    DC = torch.ops.dc
    g = fx.Graph()
    x = g.placeholder("x")
    shards = [g.placeholder(f"s{k}") for k in range(n_params)]
    nodes, cur = {}, x
    for k, s in enumerate(shards):
        i = g.call_function(DC.allgather_param.default, (s, k))
        w = g.call_function(DC.wait_allgather.default, (i, k))
        cur = g.call_function(torch.mul, (cur, w))
        r = g.call_function(DC.release_param.default, (w, k))
        nodes.update({f"issue{k}": i, f"use{k}": cur, f"release{k}": r})
        # what Dynamo leaves on the nodes: module scopes (the record groups by them) and the user's line
        for n, path in ((i, f"layers.{k}.weight"), (w, f"layers.{k}.weight"), (cur, f"layers.{k}")):
            n.meta["nn_module_stack"] = {path: (path, torch.nn.Module)}
        cur.meta["stack_trace"] = (f'  File "/home/u/model.py", line {10 + k}, in forward\n    x = x * self.w{k}\n')
        cur.meta["val"] = torch.empty(numel)
    g.output(cur)
    meta = {k: ops.ParamMeta(id=k, name=f"layers.{k}.weight", shape=(numel,), numel=numel, chunk=numel // 2,
                             dtype=torch.float32, gather_dtype=torch.float32, requires_grad=True)
            for k in range(n_params)}
    return fx.GraphModule(torch.nn.Module(), g), meta, nodes


def _run_prefetch(budget_mb, fuse_mb, with_before: bool = False):
    """The tiny graph through prefetch: (serialized nodes, notes, {role: node name}) and with
    ``with_before`` also the serialized graph before the pass (first)."""
    from deepcompile.passes import prefetch as pf
    from deepcompile.passes.registry import PassContext
    from deepcompile.record.graph import serialize

    gm, meta, nodes = _tiny_zero3_graph()
    before = serialize(gm)
    ctx = PassContext(graph_id=0, kind="forward", world_size=2, rank=0, param_meta=meta,
                      params=pf.PrefetchParams(budget_mb=budget_mb, fuse_mb=fuse_mb, backend="gloo"))
    gm = pf.prefetch(gm, ctx)
    names = {k: n.name for k, n in nodes.items()}
    out = (serialize(gm), ctx.notes, names)
    return (before,) + out if with_before else out


def test_prefetch_records_each_move_from_to_and_first_use():
    (zero, zero_notes, nm), (far, far_notes, _) = (_run_prefetch(b, 0.0) for b in (0.0, 64.0))
    moved0 = {n["param"]: n["moved"] for n in zero if "moved" in n}
    moved = {n["param"]: n["moved"] for n in far if "moved" in n}
    assert sorted(moved0) == sorted(moved) == [0, 1, 2], "every collective carries its move, moved or not"
    # budget 0: nothing moves; each is issued where it was (after the previous parameter's release)
    assert moved0[1] == {"from": nm["release0"], "to": nm["release0"], "params": [1],
                         "first_use": {"1": nm["use1"]}, "earlier": 0, "bytes": 4096}
    assert all(m["earlier"] == 0 and m["from"] == m["to"] for m in moved0.values())
    # a large budget: all three at the top, in the order they are needed
    order = [n["name"] for n in far]
    issues = [n["name"] for n in far if n["target"] == "dc.allgather_param"]
    assert issues == [nm["issue0"], nm["issue1"], nm["issue2"]]
    assert order.index(issues[-1]) < order.index(nm["use0"])
    for k, prev in ((1, "release0"), (2, "release1")):
        m = moved[k]
        assert m["from"] == nm[prev] and m["to"] == "s2", m   # "to" skips the other collectives issued there
        assert m["first_use"] == {str(k): nm[f"use{k}"]}
        assert m["earlier"] == order.index(nm[prev]) - order.index(nm[f"issue{k}"]) > 0
    assert moved[0]["from"] == moved[0]["to"] == "s2" and moved[0]["earlier"] == 0
    # the notes say it per collective
    assert "issued earlier: 0" in zero_notes[0] and "issued earlier: 2" in far_notes[0]
    line = next(s for s in far_notes if s.startswith("param 2 (layers.2.weight)"))
    assert f"moved {nm['release1']} -> s2" in line and f"first used at {nm['use2']}" in line, line
    assert all("not moved" in s for s in zero_notes[1:])


def test_prefetch_fused_group_lists_its_params_and_their_first_uses():
    from deepcompile.record.schema import check_nodes

    nodes, notes, nm = _run_prefetch(64.0, 64.0)
    fused = [n for n in nodes if n["target"] == "dc.allgather_params"]
    assert len(fused) == 1 and not any(n["target"] == "dc.allgather_param" for n in nodes)
    f = fused[0]
    assert f["params"] == [0, 1, 2] and f["moved"]["params"] == [0, 1, 2]
    assert f["moved"]["first_use"] == {str(k): nm[f"use{k}"] for k in range(3)}
    assert f["moved"]["bytes"] == 3 * 4096
    assert notes[1].startswith("3 params fused [0, 1, 2] (layers.0.weight, layers.1.weight, layers.2.weight)")
    check_nodes("g.json", nodes)   # the record's schema accepts "moved", "params" and "source"
    use = next(n for n in nodes if n["name"] == nm["use1"])
    assert use["source"] == "model.py:11 in forward: x = x * self.w1" and use["scope"] == "layers.1"


# ------------------------------------------------------------- the hoist against a plain reference
def _hoist_reference(g, gathers, ctx):
    """prefetch._hoist as it was before it was made linear (walks the graph per gather): the
    behaviour the fast one must keep, move for move."""
    from deepcompile.passes.zero3 import is_op  # noqa: F401 - (the same helpers the pass uses)

    budget = ctx.params.budget_mb * 2**20
    gp = ctx.profile.get(ctx.graph_id, ctx.kind) if ctx.profile is not None else None
    comm = ctx.profile.comm if ctx.profile is not None else None
    lat = ({n.name: n.latency_ms * 1e3 for n in gp.nodes}
           if (gp is not None and comm is not None and ctx.params.cover > 0) else None)
    order = list(g.nodes) if lat is not None else []
    pos = {n: k for k, n in enumerate(order)}
    for i, x in enumerate(gathers):
        ahead, j_min = x.bytes, i
        while j_min > 0 and ahead + gathers[j_min - 1].bytes <= budget:
            j_min -= 1
            ahead += gathers[j_min].bytes
        j = j_min
        if lat is not None:
            need = comm.allgather_us(x.bytes) * ctx.params.cover
            end = pos[x.waits[0]]
            for cand in range(i, j_min - 1, -1):
                start = pos[gathers[cand - 1].waits[0]] + 1 if cand > 0 else 0
                covered = sum(lat.get(n.name, 0.0) for n in order[start:end]
                              if n.op == "call_function" and not str(n.target).startswith("dc."))
                if covered >= need:
                    j = cand
                    break
        elif j == i and not (i == 0 and x.bytes <= budget):
            continue
        if any(inp.op != "placeholder" for inp in x.issue.all_input_nodes):
            continue
        anchor = gathers[j - 1].waits[0] if j > 0 else next(n for n in g.nodes if n.op != "placeholder").prev
        prev_issue = gathers[i - 1].issue if i > 0 else None
        n = anchor.next
        while n is not x.issue and n.op != "root":
            if n is prev_issue:
                anchor = n
            n = n.next
        if n is not x.issue or anchor.next is x.issue:
            continue
        anchor.append(x.issue)


@pytest.mark.parametrize("cover", [0.0, 0.5, 3.0])
@pytest.mark.parametrize("fuse_mb", [0.0, 0.02])
def test_hoist_moves_exactly_as_the_plain_walk(cover, fuse_mb):
    """The linear _hoist (the planner runs prefetch on every candidate, and the walk per
    gather was quadratic in the graph) gives the reference's node order, for budgets from nothing
    to the whole model, fused or not, and with a profile deciding how far (cover > 0), including
    a gather an earlier pass already issued above its anchor."""
    from types import SimpleNamespace

    from deepcompile.passes import prefetch as pf
    from deepcompile.passes.registry import PassContext
    from deepcompile.vocab.links import default_model

    seen = set()
    for budget_mb in (0.0, 0.004, 0.01, 0.03, 0.05, 0.08, 1.0):
        orders = []
        for hoist in (pf._hoist, _hoist_reference):
            gm, meta, nodes = _tiny_zero3_graph(n_params=24, numel=512)
            g = gm.graph
            # an earlier pass put parameter 20's gather near the top already
            nodes["issue0"].append(nodes["issue20"])
            lat = {n.name: 0.002 * (1 + k % 7) for k, n in enumerate(g.nodes)}  # ms: a few nodes cover a gather
            profile = SimpleNamespace(comm=default_model("gloo"),
                                      get=lambda gid, kind, lat=lat: SimpleNamespace(
                                          nodes=[SimpleNamespace(name=k, latency_ms=v) for k, v in lat.items()]))
            ctx = PassContext(graph_id=0, kind="forward", world_size=2, rank=0, param_meta=meta,
                              params=pf.PrefetchParams(budget_mb=budget_mb, fuse_mb=fuse_mb, cover=cover, backend="gloo"),
                              profile=profile if cover > 0 else None)
            gathers = pf._collect(g, ctx)
            if fuse_mb > 0:
                gathers = pf._fuse(g, gathers, ctx)
            hoist(g, gathers, ctx)
            g.lint()
            orders.append([n.name for n in g.nodes])
        assert orders[0] == orders[1], (budget_mb, cover, fuse_mb)
        seen.add(tuple(orders[0]))
    assert len(seen) >= 2, "the budgets should give different schedules (the test would compare nothing)"
