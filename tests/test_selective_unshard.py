"""selective_unshard: kept parameters are gathered once per optimizer step, numerics unchanged."""
from __future__ import annotations

import pytest

from tests.test_zero3_parity import _compare


def _cfg(compiler, budget_mb, **more):
    return {"compiler": compiler, "passes": ["zero3", {"name": "selective_unshard",
                                                       "params": {"budget_mb": budget_mb, **more}},
                                             {"name": "prefetch", "params": {"fuse_mb": 1.0}}]}


def test_kept_parameters_are_gathered_once_per_optimizer_step():
    base = _compare(2, 2, {"compiler": "aot_eager"})[0]["stats"]
    kept = _compare(2, 2, _cfg("aot_eager", 0.01))[0]["stats"]  # 10 KiB: the small parameters
    # forward, backward and the second micro-batch reuse the kept copies
    assert kept["persistent_hits"] > 0
    assert kept["allgathers"] < base["allgathers"]
    everything = _compare(2, 2, _cfg("aot_eager", 1024.0))[0]["stats"]
    # every parameter kept: one gather per parameter per optimizer step (10 steps), nothing more
    n_params = 26  # tests.workloads.MODEL (the tied weight once)
    assert everything["allgathers"] <= 10 * n_params < kept["allgathers"]


@pytest.mark.slow
def test_selective_unshard_under_inductor():
    # Inductor must not reuse a kept buffer's memory: the parity check would catch corruption.
    # 48 KiB kept in groups of up to 4 KiB: several need-order groups (gather_persistent_wait's
    # outputs are the kept buffers), beside prefetch's transient groups
    _compare(2, 2, _cfg("inductor", 0.05, group_mb=1 / 256), timeout=900)


def test_kept_after_prefetch_are_taken_out_of_its_groups():
    # the default plan runs selective_unshard after prefetch, which has coalesced every gather
    cfg = {"compiler": "aot_eager", "passes": ["zero3", {"name": "prefetch", "params": {"fuse_mb": 1.0}},
                                               {"name": "selective_unshard", "params": {"budget_mb": 0.01}}]}
    base = _compare(2, 2, {"compiler": "aot_eager", "passes": cfg["passes"][:2]})[0]["stats"]
    kept = _compare(2, 2, cfg)[0]["stats"]
    assert kept["persistent_hits"] > 0
    assert kept["allgathers"] < base["allgathers"]


def test_kept_gathers_become_one_collective_at_the_top_with_group_mb_0():
    import torch
    import torch.fx as fx

    from deepcompile.passes import selective_unshard as su
    from deepcompile.passes.registry import PassContext
    from deepcompile.runtime import ops

    ops.ensure_registered()
    DC = torch.ops.dc
    g = fx.Graph()
    x, s1, s2, s3 = (g.placeholder(n) for n in ("x", "s1", "s2", "s3"))
    a = g.call_function(torch.add, (x, 1))
    h = g.call_function(DC.allgather_params.default, ([s1, s2], [1, 2]))   # prefetch's group
    w1 = g.call_function(DC.wait_allgather.default, (h, 1))
    w2 = g.call_function(DC.wait_allgather.default, (h, 2))
    b = g.call_function(torch.mul, (a, w1))
    g.call_function(DC.release_param.default, (w1, 1))
    c = g.call_function(torch.mul, (b, w2))
    g.call_function(DC.release_param.default, (w2, 2))
    i3 = g.call_function(DC.allgather_param.default, (s3, 3))
    w3 = g.call_function(DC.wait_allgather.default, (i3, 3))
    d = g.call_function(torch.add, (c, w3))
    w3b = g.call_function(DC.wait_allgather.default, (i3, 3))          # a second use (tied weight)
    e = g.call_function(torch.add, (d, w3b))
    g.output(e)
    gm = fx.GraphModule(torch.nn.Module(), g)
    orig = su.choose
    su.choose = lambda ctx: [1, 3]
    try:
        # group_mb 0: one collective at the top (the schedule before need-order groups; the backward's)
        ctx = PassContext(graph_id=0, kind="forward", params=su.SelectiveUnshardParams(group_mb=0.0), param_meta={},
                          world_size=2, rank=0, profile=None)
        su.selective_unshard(gm, ctx)
    finally:
        su.choose = orig
    nodes = list(gm.graph.nodes)
    first = next(n for n in nodes if n.op != "placeholder")
    assert first.target is DC.gather_persistent_many.default and first.args == ([s1, s3], [1, 3])
    groups = [n for n in nodes if n.target is DC.allgather_params.default]
    assert len(groups) == 1 and groups[0].args == ([s2], [2])          # 1 taken out, 2 stays
    assert not any(n.target is DC.allgather_param.default for n in nodes)
    assert [int(n.args[1]) for n in nodes if n.target is DC.wait_allgather.default] == [2]
    assert [int(n.args[1]) for n in nodes if n.target is DC.release_param.default] == [2]
    assert "kept gathered: 2 parameters" in ctx.notes[0]
    gm.graph.lint()


def _chain_graph(sizes_kib: dict[int, int], transient: int | None = None):
    """x -> one op per parameter (in id order), each parameter gathered as zero3 leaves it
    (allgather_param, wait, use, release_param); ``transient``'s gather is hoisted to the top
    (as prefetch leaves it) and first used second. Returns (graph module, {id: its use}, param_meta)."""
    import torch
    import torch.fx as fx

    from deepcompile.runtime.ops import ParamMeta

    DC = torch.ops.dc
    g = fx.Graph()
    x = g.placeholder("x")
    ids = sorted(sizes_kib)
    shards = {p: g.placeholder(f"s{p}") for p in ids}
    for p in ids:  # their fake values, as a traced graph's placeholders have them
        shards[p].meta["val"] = torch.empty(sizes_kib[p] * 128, device="meta")
    early = g.call_function(DC.allgather_param.default, (shards[transient], transient)) if transient else None
    order = [p for p in ids if p != transient]
    if transient:
        order.insert(1, transient)
    h, uses = x, {}
    for p in order:
        if p == transient:
            w = g.call_function(DC.wait_allgather.default, (early, p))
        else:
            w = g.call_function(DC.wait_allgather.default, (g.call_function(DC.allgather_param.default, (shards[p], p)), p))
        h = uses[p] = g.call_function(torch.mul, (h, w))
        g.call_function(DC.release_param.default, (w, p))
    g.output(h)
    meta = {p: ParamMeta(p, f"p{p}", (kib * 256,), kib * 256, kib * 128, torch.float32, torch.float32, True)
            for p, kib in sizes_kib.items()}  # float32, 2 ranks: a chunk of kib * 128 gathers kib KiB
    return fx.GraphModule(torch.nn.Module(), g), uses, meta


def _run_pass(gm, meta, keep, kind, group_mb):
    from deepcompile.passes import selective_unshard as su
    from deepcompile.passes.registry import PassContext

    orig = su.choose
    su.choose = lambda ctx: list(keep)
    try:
        ctx = PassContext(graph_id=0, kind=kind, params=su.SelectiveUnshardParams(budget_mb=1e6, group_mb=group_mb),
                          param_meta=meta, world_size=2, rank=0, profile=None)
        su.selective_unshard(gm, ctx)
    finally:
        su.choose = orig
    gm.graph.lint()
    return ctx


def test_kept_gathers_are_groups_in_need_order_each_waited_before_its_first_use():
    import operator

    import torch

    from deepcompile.runtime import ops

    ops.ensure_registered()
    DC = torch.ops.dc
    # need order 1, 5 (transient, hoisted by prefetch), 2, 3, 4; 2 MiB groups -> [1, 2], [3], [4]
    gm, uses, meta = _chain_graph({1: 1024, 2: 1024, 3: 1536, 4: 1024, 5: 512}, transient=5)
    ctx = _run_pass(gm, meta, [1, 2, 3, 4], "forward", 2.0)
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    starts = [n for n in nodes if n.target is DC.gather_persistent_start.default]
    waits = [n for n in nodes if n.target is DC.gather_persistent_wait.default]
    assert [list(n.args[1]) for n in starts] == [[1, 2], [3], [4]]
    assert [list(n.args[1]) for n in waits] == [[1, 2], [3], [4]]
    assert all(w.args[0] is s for s, w in zip(starts, waits))
    # every start carries its fake value (blocks.py hands it to a later block's region as an input)
    assert all(tuple(s.meta["val"].shape) == (0,) for s in starts)
    # issue order is need order, the transient gather included: [1, 2] before 5's, [3] and [4] after
    issue5 = next(n for n in nodes if n.target is DC.allgather_param.default)
    assert int(issue5.args[1]) == 5
    assert pos[starts[0]] < pos[issue5] < pos[starts[1]] < pos[starts[2]]
    assert all(n.op == "placeholder" for n in nodes[:pos[starts[0]]])
    assert all(pos[s] < pos[uses[1]] for s in starts)  # every start before any compute
    # each group's wait right before its first use (its getitems between), the compute stream
    # waits for that group only
    for w, first in zip(waits, (uses[1], uses[3], uses[4])):
        between = nodes[pos[w] + 1:pos[first]]
        assert between and all(n.target is operator.getitem and n.args[0] is w for n in between), (w, between)
    item = {(n.args[0], n.args[1]): n for n in nodes if n.target is operator.getitem}
    assert uses[2].args[1] is item[(waits[0], 1)] and uses[1].args[1] is item[(waits[0], 0)]
    # kept: no transient gather, wait or release of theirs is left; 5's are untouched
    assert [int(n.args[1]) for n in nodes if n.target is DC.allgather_param.default] == [5]
    assert [int(n.args[1]) for n in nodes if n.target is DC.release_param.default] == [5]
    assert "in 3 group(s) of up to 2 MiB in need order" in ctx.notes[0]
    # the backward finds everything kept: one gather_persistent_many at the top, no groups
    gm, uses, meta = _chain_graph({1: 1024, 2: 1024, 3: 1536, 4: 1024})
    _run_pass(gm, meta, [1, 2, 3, 4], "backward", 2.0)
    nodes = list(gm.graph.nodes)
    assert [n.target for n in nodes if str(n.target).startswith("dc.")] == [DC.gather_persistent_many.default]


def _train_grouped(rank, world, steps, accumulation, config):
    from deepcompile.runtime import state
    from tests.workloads import train_sharded

    out = train_sharded(rank, world, steps, accumulation, config)
    out["gathers_per_step"] = out["stats"]["allgathers"] / steps
    out["n_params"] = len(state.current().params)
    return out


def test_grouped_kept_gathers_match_reference_and_gather_once_per_optimizer_step():
    """Everything kept, in need-order groups of 16 KiB (the tiny GPT's embedding is a group of
    its own; its layers' small parameters share groups), 2 micro-batches per optimizer step:
    parity with the unsharded reference, each parameter gathered once per optimizer step, and
    the forward graph cut into several groups, each waited before its first use."""
    from tests.test_zero3_parity import STEPS

    cfg = {"compiler": "aot_eager", "passes": ["zero3", {"name": "prefetch", "params": {"fuse_mb": 1.0}},
                                               {"name": "selective_unshard",
                                                "params": {"budget_mb": 1024.0, "group_mb": 1 / 64}}]}
    from tests.dist_utils import run_ranks

    import torch
    from tests.workloads import train_reference

    ref_losses, ref_state = train_reference(2, STEPS, 2)
    results = run_ranks(_train_grouped, 2, STEPS, 2, cfg, timeout=600)
    mean = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref_losses, dtype=mean.dtype), rtol=1e-5, atol=1e-6)
    for r in results:
        for k, v in ref_state.items():  # tolerance: see tests/test_zero3_parity.py
            torch.testing.assert_close(r["state"][k], v, rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")
    r = results[0]
    assert r["gathers_per_step"] == r["n_params"], (r["gathers_per_step"], r["n_params"])
    assert r["stats"]["persistent_hits"] > 0
    fwd = [nodes for gid, kind, after, nodes in r["graphs"] if kind == "forward" and after == "selective_unshard"][-1]
    names = [n["name"] for n in fwd]
    pos = {n: i for i, n in enumerate(names)}
    starts = [n for n in fwd if n.get("target") == "dc.gather_persistent_start"]
    waits = [n for n in fwd if n.get("target") == "dc.gather_persistent_wait"]
    assert len(starts) >= 3 and len(waits) == len(starts)
    ids = [p for n in starts for p in n["args"][1]]
    assert len(ids) == len(set(ids)) == r["n_params"]  # every parameter in exactly one group
    compute = [i for i, n in enumerate(fwd) if n["op"] == "call_function" and not n["target"].startswith("dc.")
               and n["target"] not in ("getitem", "_operator.getitem", "operator.getitem")]
    assert max(pos[n["name"]] for n in starts) < compute[0]  # all issued before any compute
    wait_pos = [pos[n["name"]] for n in waits]
    assert wait_pos == sorted(wait_pos) and wait_pos[-1] > compute[len(compute) // 2]  # spread over the forward
    assert [w["args"][1] for w in waits] == [s["args"][1] for s in starts]  # waited in issue order


def test_kept_groups_hold_whole_decoder_blocks():
    """Groups never split a block: cut by size alone, 1 MiB parameters in 3 MiB groups would
    straddle the 2 MiB layers ([1, 2, 3], [4, 5, 6]) so that no two layers wait alike and
    blocks.py compiles every forward region on its own. A block over ``group_mb`` starts its own
    groups, cut by size; the block after it starts afresh."""
    import torch

    from deepcompile.runtime import ops

    ops.ensure_registered()
    DC = torch.ops.dc
    sizes = {1: 1024, 2: 1024, 3: 1024, 4: 1024, 5: 1024, 6: 1024, 7: 1024, 8: 1024, 9: 1024, 10: 1024, 11: 1024}
    block = {1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 2, 7: 3, 8: 3, 9: 3, 10: 3, 11: 4}
    gm, uses, meta = _chain_graph(sizes)
    for p, n in uses.items():  # the scope Dynamo records: block i of a ModuleList
        n.meta["nn_module_stack"] = {"L__self___layers": (f"L['self'].layers.{block[p]}", torch.nn.Linear)}
    _run_pass(gm, meta, list(sizes), "forward", 3.0)
    starts = [list(n.args[1]) for n in gm.graph.nodes if n.target is DC.gather_persistent_start.default]
    # blocks 0+1 would be 4 MiB: apart; block 3 (4 MiB) is cut by size; block 4 starts afresh
    assert starts == [[1, 2], [3, 4], [5, 6], [7, 8, 9], [10], [11]], starts
