"""selective_unshard: kept parameters are gathered once per optimizer step, numerics unchanged."""
from __future__ import annotations

import pytest

from tests.test_zero3_parity import _compare


def _cfg(compiler, budget_mb):
    return {"compiler": compiler, "passes": ["zero3", {"name": "selective_unshard", "params": {"budget_mb": budget_mb}},
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
    # Inductor must not reuse a kept buffer's memory: the parity check would catch corruption
    _compare(2, 2, _cfg("inductor", 0.01), timeout=900)


def test_kept_after_prefetch_are_taken_out_of_its_groups():
    # the default plan runs selective_unshard after prefetch, which has coalesced every gather
    cfg = {"compiler": "aot_eager", "passes": ["zero3", {"name": "prefetch", "params": {"fuse_mb": 1.0}},
                                               {"name": "selective_unshard", "params": {"budget_mb": 0.01}}]}
    base = _compare(2, 2, {"compiler": "aot_eager", "passes": cfg["passes"][:2]})[0]["stats"]
    kept = _compare(2, 2, cfg)[0]["stats"]
    assert kept["persistent_hits"] > 0
    assert kept["allgathers"] < base["allgathers"]


def test_kept_gathers_become_one_collective_at_the_top():
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
        ctx = PassContext(graph_id=0, kind="forward", params=su.SelectiveUnshardParams(), param_meta={},
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
