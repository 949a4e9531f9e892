"""Host work per training step: the runtime's own op counters on the tiny GPT.

* one host wait per coalesced gather group (``wait_allgather_many``), not one per parameter;
* ``reduce_grad`` copies a gradient only where it must (zero padding, a dtype cast), never
  "just in case" (the clone per parameter is gone), and a bucket travels as one coalesced
  reduce-scatter of the gradients themselves, not a ``cat`` of them;
* the backward calls the runtime once per reduce bucket (``dc.reduce_grads``, one call at each
  point where the runtime flushes a bucket, one for the remainder), not once per gradient, with
  the same buckets and the same reduced gradients as one call per gradient;
* ``inductor_compat.never_reuse_inputs``: the lowering that makes holding the gradient safe under
  Inductor, on a small graph where Inductor would otherwise reuse the held buffer.
"""
from __future__ import annotations

import torch

from tests.dist_utils import run_ranks
from tests.workloads import LOCAL_BATCH, global_batch, make_model, make_optimizer


def _count_step(rank: int, world: int, config: dict, per_gradient: bool = False):
    """Two steps; the counters of the second one (compiled graphs already warm).
    ``per_gradient``: the backward calls the runtime once per gradient (the grouping's control:
    the layout says the runtime copies each gradient, which the pass never batches)."""
    import dataclasses

    import deepcompile
    from deepcompile.runtime import ops

    model, opt = deepcompile.initialize(make_model(), make_optimizer, {**config, "gradient_accumulation_steps": 1})
    if per_gradient:
        rt = model.dc_state.runtime
        rt.reduce_layout = dataclasses.replace(rt.reduce_layout, copies_each=True)
    stats, grads = [], []
    for s in range(2):
        ops.C.reset_stats()
        x, y = global_batch(s, 0, world)
        sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        loss = model(x[sl], y[sl])
        loss.backward()
        stats.append(dict(ops.C.stats()))
        grads.append([p.grad.detach().clone() for p in model.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
    metas = {pid: (m.numel, m.chunk) for pid, m in model.dc_state.runtime.params.items()}
    graphs = [(v.kind, v.after, v.nodes) for v in model.dc_graphs]
    return {"stats": stats[-1], "metas": metas, "world": world, "graphs": graphs, "grads": grads}


def _final(graphs, kind):
    return [nodes for k, after, nodes in graphs if k == kind][-1]


def test_one_wait_per_coalesced_group_and_no_gradient_copies():
    passes = ["zero3", {"name": "prefetch", "params": {"budget_mb": 64.0, "fuse_mb": 64.0}}]
    res = run_ranks(_count_step, 2, {"compiler": "aot_eager", "passes": passes}, timeout=300)
    r = res[0]
    st, world = r["stats"], r["world"]
    nodes = _final(r["graphs"], "forward") + _final(r["graphs"], "backward")
    targets = [n["target"] for n in nodes]
    groups = targets.count("dc.allgather_params")
    singles = targets.count("dc.allgather_param")
    assert groups > 0, "prefetch coalesced nothing: the test needs groups"
    # every coalesced group is waited for once, by one wait_allgather_many with its ids
    assert targets.count("dc.wait_allgather_many") == groups
    assert targets.count("dc.wait_allgather") == singles
    for kind in ("forward", "backward"):  # (node names repeat across graphs)
        g = _final(r["graphs"], kind)
        by = {n["name"]: n for n in g}
        for n in g:
            if n["target"] == "dc.wait_allgather_many":
                issue = by[n["args"][0]["node"]]
                assert issue["target"] == "dc.allgather_params" and issue["args"][1] == n["args"][1]
    # ... and the runtime waited once per collective, not once per gathered parameter
    assert st["allgather_waits"] == groups + singles, st
    assert st["allgather_waits"] < st["allgathers"], st
    # releases stay per parameter
    assert st["releases"] == st["allgathers"], st
    # gradients: a copy only for parameters whose rows do not split evenly (zero padding);
    # reduce and shard dtypes are both fp32 here, so nothing is cast
    padded = {pid for pid, (numel, chunk) in r["metas"].items() if numel != chunk * world}
    reduced = [p for n in nodes if n["target"] in ("dc.reduce_grad", "dc.reduce_grads")
               for p in n.get("params") or [n["param"]]]
    assert st["reduce_calls"] == len(reduced) > 0
    assert st["reduce_copies"] == sum(1 for pid in reduced if pid in padded), (st, padded)
    assert st["reduce_copies"] < st["reduce_calls"]
    # buckets: on gloo (the host path) one all-reduce each of the bucket packed by one cat (a lone
    # gradient is not packed); the "cat" reduce path's own count stays 0
    assert st["reduce_cats"] <= st["reduce_scatters"] and st["reduce_packed"] == 0, st
    # the two ranks computed the same reduced gradients for their own shards' sizes
    assert [g.shape for g in res[0]["grads"][-1]] == [g.shape for g in res[1]["grads"][-1]]


def test_bf16_reduce_casts_each_gradient_once_and_matches_fp32():
    """reduce_dtype bf16, small buckets: each gradient is cast once into its bucket (that is the
    copy counted), the bucket is cast back to fp32 once. (Numerics against unsharded training:
    test_zero3_parity's mixed-precision test.)"""
    cfg = {"compiler": "aot_eager", "passes": ["zero3"], "reduce_bucket_size": 2000,
           "mixed_precision": {"reduce_dtype": "bfloat16"}}
    res = run_ranks(_count_step, 2, cfg, timeout=300)
    st = res[0]["stats"]
    assert st["reduce_copies"] == st["reduce_calls"], st  # the cast is the only copy
    assert st["reduce_scatters"] > 1 and st["reduce_cats"] <= st["reduce_scatters"], st
    for g in res[0]["grads"][-1]:
        assert g.dtype == torch.float32 and torch.isfinite(g).all()


def _reduce_nodes(graphs):
    bw = _final(graphs, "backward")
    return [n for n in bw if n["target"] in ("dc.reduce_grad", "dc.reduce_grads")]


def test_plan_reduce_calls_replays_the_runtime_buckets():
    """The grouping on its own, bucket of 10 elements: (param id, elements, must call now)."""
    from deepcompile.passes.zero3 import plan_reduce_calls

    # 1+2 fill 8; 3 overflows: its arrival flushes {1, 2} (a call ending with 3); 3+4 remain
    assert plan_reduce_calls([(1, 4, False), (2, 4, False), (3, 4, False), (4, 4, False)], 10) == [[0, 1, 2], [3]]
    # 1+2 reach 10: flushed at 2; 4 (20) flushes {3} on arrival and itself at once
    assert plan_reduce_calls([(1, 4, False), (2, 6, False), (3, 4, False), (4, 20, False), (5, 1, False)],
                             10) == [[0, 1], [2, 3], [4]]
    # a parameter's second gradient starts a new call; a copied gradient ends its call
    assert plan_reduce_calls([(1, 4, False), (1, 4, False), (2, 4, True), (3, 4, False)], 10) == [[0], [1, 2], [3]]
    assert plan_reduce_calls([], 10) == []


def test_one_reduce_call_per_bucket_same_buckets_and_gradients():
    """Small buckets (several per backward): the backward's reduce calls are exactly the runtime's
    flush points plus one remainder, and the buckets and gradients equal those of one call per
    gradient (the same order into the same buckets)."""
    cfg = {"compiler": "aot_eager", "passes": ["zero3"], "reduce_bucket_size": 3000}
    grouped = run_ranks(_count_step, 2, cfg, timeout=300)
    per_grad = run_ranks(_count_step, 2, cfg, True, timeout=300)
    for rank in range(2):
        st, ref = grouped[rank]["stats"], per_grad[rank]["stats"]
        calls = _reduce_nodes(grouped[rank]["graphs"])
        batched = [n for n in calls if n["target"] == "dc.reduce_grads"]
        assert batched and len(calls) < ref["reduce_calls"], (len(calls), ref)
        assert all(len(n["params"]) == len(n["args"][0]) > 1 for n in batched)
        # every gradient handed over once, in the same order as one call per gradient
        order = [p for n in calls for p in n.get("params") or [n["param"]]]
        assert order == [n["param"] for n in _reduce_nodes(per_grad[rank]["graphs"])]
        assert st["reduce_calls"] == ref["reduce_calls"] == len(order)
        # the same buckets: one reduce-scatter per flush, as many as with a call per gradient
        assert st["reduce_scatters"] == ref["reduce_scatters"] > 2, (st, ref)
        assert st["reduce_bytes"] == ref["reduce_bytes"] and st["reduce_copies"] == ref["reduce_copies"]
        # one call per flush point: the calls that flushed a bucket are exactly the points where
        # one call per gradient flushed; besides them only the graph's remainder (flushed by
        # end_backward) and gradients called for on their own (the runtime copies them)
        assert st["reduce_ops"] == len(calls) and ref["reduce_ops"] == ref["reduce_calls"], (st, ref)
        assert st["reduce_ops_flushing"] == ref["reduce_ops_flushing"] > 2, (st, ref)
        singles = len(calls) - len(batched)
        assert len(calls) <= st["reduce_ops_flushing"] + 1 + singles, (len(calls), singles, st)
        # numerics unchanged: bit-identical reduced gradients
        for a, b in zip(grouped[rank]["grads"][-1], per_grad[rank]["grads"][-1]):
            assert torch.equal(a, b)


# -- the lowering that lets the bucket hold Inductor's buffer ----------------------------------

_HELD: list[torch.Tensor] = []
_LIB = None


def _define_ops():
    global _LIB
    if _LIB is not None:
        return
    from deepcompile.compat import fx as fx_compat
    from deepcompile.compat import inductor as inductor_compat

    _LIB = torch.library.Library("dctest_hold", "DEF")
    for name in ("plain", "kept"):
        _LIB.define(f"{name}(Tensor(a!) x) -> ()")
        _LIB.impl(name, lambda x: _HELD.append(x), "CPU")
        torch.library.register_fake(f"dctest_hold::{name}", lambda x: None, lib=_LIB)
        fx_compat.mark_side_effect(getattr(torch.ops.dctest_hold, name).default)
    assert inductor_compat.never_reuse_inputs(torch.ops.dctest_hold.kept.default, on_failure=lambda: None)


def _held_after_inductor(op, view: bool):
    """Compile (as the backend does: compile_fx_inner on an already lowered graph) a graph
    whose held buffer is dead right after ``op``: Inductor's memory planning hands it to the
    next buffer of its size (the mm's output). Returns (held value intact, shares the output)."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        a = x * 2
        op(a.view(-1) if view else a)  # a view of the buffer, as a reshaped gradient is
        c = a * 3
        return (torch.mm(c, c),)

    _HELD.clear()
    x = torch.randn(32, 32)
    gm = make_fx(f, tracing_mode="fake")(x)
    out = compile_fx_inner(gm, [x])([x])
    held = _HELD[0]
    return torch.equal(held.view(32, 32), x * 2), held.untyped_storage().data_ptr() == out[0].data_ptr()


def test_never_reuse_inputs_keeps_inductor_from_reusing_the_held_buffer():
    _define_ops()
    torch._dynamo.reset()
    from torch._inductor import config

    with config.patch(fx_graph_cache=False):
        # the control: without the lowering Inductor reuses the buffer (else this test proves nothing)
        intact, shared = _held_after_inductor(torch.ops.dctest_hold.plain.default, view=False)
        assert shared and not intact
        for view in (False, True):
            intact, shared = _held_after_inductor(torch.ops.dctest_hold.kept.default, view=view)
            assert intact and not shared, f"view={view}"


# -- the runtime's own dispatcher calls per gradient and per gathered parameter -----------------

def _runtime_calls(prof) -> dict:
    """{dc op: Counter(ATen op -> calls)} of the ATen calls each dc op makes itself (its direct
    children in the profiler's tree): what the runtime's C++ asks of the dispatcher. The process
    group's own work is left out: c10d:: ops, and gloo's reduce-scatter completion (a chunk and a
    copy_ per gradient, run inside our wait, so the profiler parents them to the dc op)."""
    import collections

    lib = {"aten::chunk", "aten::copy_"}
    out: dict = collections.defaultdict(collections.Counter)
    for ev in prof.events():
        p = ev.cpu_parent
        if p is None or not p.name.startswith("dc::") or ev.name.startswith(("c10d::", "dc::")) or ev.name in lib:
            continue
        out[p.name][ev.name] += 1
    return out


def _op_counts(rank: int, world: int):
    """The runtime ops called directly, as the compiled graphs call them, in the GPU run's shape
    (bf16 gathers and reduces of fp32 shards, .grad set to None before the backward): a backward's
    reduce_grads (one call per bucket) and end_backward, a forward's kept-parameter gathers in
    groups; one step under the profiler. Then the same backward on both reduce paths
    (config reduce_pack coalesced / cat) for the reduced gradients."""
    import deepcompile
    from deepcompile.runtime import ops

    cfg = {"compiler": "aot_eager", "reduce_bucket_size": 6000,
           "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}}
    model, _ = deepcompile.initialize(make_model(), make_optimizer, cfg)
    C, D = ops.C, torch.ops.dc
    sps = list(model.dc_state.sharded)
    shards = [sp.shard for sp in sps]
    gen = torch.Generator().manual_seed(7)  # the same gradients on both ranks (any values do)
    grads = [torch.randn(sp.meta.shape, generator=gen).to(torch.bfloat16) for sp in reversed(sps)]
    ids = [sp.meta.id for sp in reversed(sps)]
    calls = [(grads[i:i + 3], ids[i:i + 3]) for i in range(0, len(grads), 3)]
    groups = [(shards[i:i + 4], [sp.meta.id for sp in sps[i:i + 4]]) for i in range(0, len(sps), 4)]

    def backward():
        for s in shards:
            s.grad = None
        for g, p in calls:
            D.reduce_grads.default(g, p)
        D.end_backward.default(grads[:1], 0)

    def forward():
        hs = [D.gather_persistent_start.default(s, p) for s, p in groups]
        return [D.gather_persistent_wait.default(h, p) for h, (_, p) in zip(hs, groups)]

    forward()  # warm
    C.invalidate_persistent()
    backward()
    from torch.profiler import ProfilerActivity, profile

    C.reset_stats()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        kept = forward()
        C.invalidate_persistent()
        backward()
    st = dict(C.stats())
    out = {"calls": {k: dict(v) for k, v in _runtime_calls(prof).items()}, "stats": st,
           "n_grads": len(grads), "n_params": len(sps), "n_groups": len(groups),
           "kept_ok": all(k.shape == sp.meta.shape and k.dtype == torch.bfloat16 for k, sp in
                          zip([t for ks in kept for t in ks], sps))}
    # the same gradients through both reduce paths: bit-identical shards' .grad
    by_pack = {}
    for pack in ("coalesced", "cat"):
        C.set_reduce_pack(pack)
        C.reset_stats()
        backward()
        by_pack[pack] = ([s.grad.clone() for s in shards], dict(C.stats()), C.reduce_pack())
    out["same"] = all(torch.equal(a, b) for a, b in zip(by_pack["coalesced"][0], by_pack["cat"][0]))
    out["packed"] = {k: (v[1]["reduce_packed"], v[1]["reduce_cats"], v[1]["reduce_scatters"], v[2])
                     for k, v in by_pack.items()}
    # the config key sets it, and a wrong value is named with its key path
    model, _ = deepcompile.initialize(make_model(), make_optimizer, dict(cfg, reduce_pack="cat"))
    out["config"] = ops.C.reduce_pack()
    try:
        deepcompile.initialize(make_model(), make_optimizer, dict(cfg, reduce_pack="cats"))
        out["bad"] = None
    except Exception as e:  # noqa: BLE001
        out["bad"] = str(e)
    return out


def test_runtime_dispatcher_calls_per_gradient_and_parameter():
    """Host work per gradient: counted, not timed. The reduce path makes one flat view
    of each gradient (add_grad), one output slice of it (the coalesced reduce-scatter) and one
    .grad slice (apply_grads), plus an empty, a cast and a scale per bucket (and on gloo the
    bucket's packing and its row copied out); a gathered kept parameter costs one output
    allocation when started and one view when waited (and on gloo its part of the group's
    packing). Before: narrow + view pairs and reshapes, 4 calls a gradient and 5 a
    parameter. Both reduce paths give bit-identical gradients."""
    r = run_ranks(_op_counts, 2, timeout=300)[0]
    calls, n, m, groups, st = r["calls"], r["n_grads"], r["n_params"], r["n_groups"], r["stats"]
    red = {}
    for op in ("dc::reduce_grads", "dc::end_backward"):
        for k, v in calls.get(op, {}).items():
            red[k] = red.get(k, 0) + v
    buckets = st["reduce_scatters"]
    assert buckets > 3 and n > 2 * buckets, (st, n)  # several buckets of several gradients
    assert not {"aten::narrow", "aten::reshape", "aten::slice"} & set(red), red
    per_grad = {k: v for k, v in red.items() if k in ("aten::view", "aten::as_strided")}
    assert sum(per_grad.values()) <= 3 * n, red
    # per bucket an empty, a cast and a scale; on gloo also the packing cat and this rank's row of
    # the all-reduced bucket (a select), copied out
    assert sum(red.values()) <= 3 * n + 5 * buckets, (red, n, buckets)
    start, wait = calls["dc::gather_persistent_start"], calls["dc::gather_persistent_wait"]
    # one as_strided per parameter; on gloo the group's packed result is split into its members'
    # buffers at the wait (a [world, chunk] view each, one split copy per group)
    assert wait.get("aten::as_strided") == m and sum(wait.values()) <= 3 * m + groups, wait
    # per parameter its output and (gloo: no in-place cast) its cast input; per group the copy
    # kernel and the op's handle
    assert sum(start.values()) <= 2 * m + 2 * groups and "aten::view" not in start, start
    assert r["kept_ok"]
    # the packed path: one cat per bucket of several gradients, same reduced gradients
    assert r["same"]
    packed_cat, cats, rs, name = r["packed"]["cat"]
    assert name == "cat" and 0 < packed_cat == cats <= rs, r["packed"]
    assert r["packed"]["coalesced"][0] == 0 and r["packed"]["coalesced"][3] == "coalesced"
    assert r["config"] == "cat"
    assert r["bad"] and "reduce_pack" in r["bad"] and "'cats'" in r["bad"], r["bad"]
