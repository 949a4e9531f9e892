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


def test_kept_gathers_move_to_the_top_of_the_graph():
    # a kept gather waited on at its first use is a point where compute waits for every rank; at
    # the top they wait once, together (see the pass's docstring)
    import torch
    import torch.fx as fx

    from deepcompile.passes.selective_unshard import _hoist

    g = fx.Graph()
    x, s1, s2 = g.placeholder("x"), g.placeholder("s1"), g.placeholder("s2")
    a = g.call_function(torch.add, (x, 1))
    k1 = g.call_function(torch.neg, (s1,))       # stands for gather_persistent(s1, id)
    b = g.call_function(torch.mul, (a, k1))
    c = g.call_function(torch.relu, (b,))
    k2 = g.call_function(torch.neg, (s2,))
    k3 = g.call_function(torch.neg, (c,))         # its "shard" is computed: goes right after it
    d = g.call_function(torch.add, (k2, k3))
    g.output(d)
    _hoist(g, [k1, k2, k3])
    order = [n.name for n in g.nodes]
    assert order[:5] == ["x", "s1", "s2", k1.name, k2.name]
    assert order.index(k3.name) == order.index(c.name) + 1
    g.lint()
