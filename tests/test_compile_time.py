"""Compile time must not grow faster than the graph: the passes walk the graph a fixed
number of times, however many parameters it gathers, and the record parses each node's stack
trace once, however many versions of the graph it serializes.

These count work instead of timing it (the CPU is shared): a full walk of a graph is an access
to ``Graph.nodes``. zero3's ``lower_gathers`` took every node's position once per parameter and
prefetch's profile-guided hoist once per gather: quadratic in depth, about a second of a
32-layer compile each (``benchmarks/compile_cpu.py``). No process group is needed: the passes
are run directly on small graphs shaped like the ones zero3 and prefetch see.
"""
from __future__ import annotations

import torch
import torch.fx as fx


class CountingGraph(fx.Graph):
    """An fx.Graph that counts full walks (``nodes`` accesses)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.walks = 0

    @property
    def nodes(self):
        self.walks += 1
        return super().nodes


def _meta(n_params: int, numel: int = 64):
    from deepcompile.runtime import ops

    return {k: ops.ParamMeta(id=k, name=f"layers.{k}.weight", shape=(numel,), numel=numel, chunk=numel // 2,
                             dtype=torch.float32, gather_dtype=torch.float32, requires_grad=True)
            for k in range(n_params)}


def _unsharded_graph(n_params: int, numel: int = 64) -> fx.GraphModule:
    """What AOTAutograd hands zero3 for ``x * p0 * p1 * ...``: each parameter an ``unshard``."""
    from deepcompile.runtime import ops

    ops.ensure_registered()
    g = CountingGraph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(numel)
    shards = [g.placeholder(f"s{k}") for k in range(n_params)]
    cur = x
    for k, s in enumerate(shards):
        s.meta["val"] = torch.empty(numel // 2)
        u = g.call_function(torch.ops.dc.unshard.default, (s, k))
        u.meta["val"] = torch.empty(numel)
        cur = g.call_function(torch.ops.aten.mul.Tensor, (cur, u))
        cur.meta["val"] = torch.empty(numel)
    g.output(cur)
    return fx.GraphModule(torch.nn.Module(), g)


def _walks_lower_gathers(n_params: int) -> tuple[int, fx.GraphModule]:
    from deepcompile.passes.registry import PassContext
    from deepcompile.passes.zero3 import lower_gathers

    gm = _unsharded_graph(n_params)
    ctx = PassContext(graph_id=0, kind="forward", world_size=2, rank=0, param_meta=_meta(n_params), params=None)
    gm.graph.walks = 0
    waits = lower_gathers(gm, ctx)
    assert sorted(waits) == list(range(n_params))
    return gm.graph.walks, gm


def test_zero3_lower_gathers_walks_the_graph_a_fixed_number_of_times():
    small, _ = _walks_lower_gathers(4)
    large, gm = _walks_lower_gathers(48)
    assert large == small <= 3, (f"lower_gathers walked the graph {small} times for 4 parameters and {large} for 48: "
                                 "a walk per parameter makes the pass quadratic in depth")
    # and the graph is what it was before the change: per parameter, gather, wait, use, release
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert names[:4] == ["dc.allgather_param.default", "dc.wait_allgather.default", "aten.mul.Tensor",
                         "dc.release_param.default"], names[:6]
    assert names.count("dc.release_param.default") == 48


def _zero3_graph(n_params: int, numel: int = 64) -> fx.GraphModule:
    """What zero3 leaves for ``x * p0 * p1 * ...``: each gather issued right before its wait."""
    from deepcompile.runtime import ops

    ops.ensure_registered()
    DC = torch.ops.dc
    g = CountingGraph()
    x = g.placeholder("x")
    shards = [g.placeholder(f"s{k}") for k in range(n_params)]
    cur = x
    for k, s in enumerate(shards):
        i = g.call_function(DC.allgather_param.default, (s, k))
        w = g.call_function(DC.wait_allgather.default, (i, k))
        cur = g.call_function(torch.mul, (cur, w))
        g.call_function(DC.release_param.default, (w, k))
        cur.meta["val"] = torch.empty(numel)
    g.output(cur)
    return fx.GraphModule(torch.nn.Module(), g)


def _hoist_walks(n_params: int) -> tuple[int, list[str]]:
    """Walks of prefetch's hoist when a profile guides it (``cover`` > 0), and the order it leaves."""
    from deepcompile.passes import prefetch as pf
    from deepcompile.passes.registry import PassContext
    from deepcompile.vocab.links import CommModel
    from deepcompile.profile.profiler import GraphProfile, NodeProfile, Profile

    gm = _zero3_graph(n_params)
    g = gm.graph
    # every multiply measured at 1 us, a gather at 2 us + 1 us/KiB: each collective needs a few
    # multiplies ahead of it, so the hoist moves issues and looks at several candidates
    prof = Profile(graphs={(0, "forward"): GraphProfile(0, "forward", [
        NodeProfile(n.name, 0.001, 0, 0, 0) for n in g.nodes if n.op == "call_function"])},
        comm=CommModel(alpha_us=2.0, bytes_per_us=1024.0, copy_bytes_per_us=1e4))
    ctx = PassContext(graph_id=0, kind="forward", world_size=2, rank=0, param_meta=_meta(n_params), profile=prof,
                      params=pf.PrefetchParams(budget_mb=64.0, fuse_mb=0.0, cover=1.0, backend="gloo"))
    gathers = pf._collect(g, ctx)
    g.walks = 0
    moved = pf._hoist(g, gathers, ctx)
    assert moved > 0, "the test graph should make the hoist move collectives"
    return g.walks, [n.name for n in g.nodes]


def test_prefetch_hoist_walks_the_graph_a_fixed_number_of_times():
    small, _ = _hoist_walks(4)
    large, order = _hoist_walks(48)
    assert large == small <= 6, (f"prefetch's profile-guided hoist walked the graph {small} times for 4 gathers and "
                                 f"{large} for 48: a walk per gather is quadratic in depth")
    # each issue lands a few multiplies ahead of its wait, never ahead of the previous issue
    issues = [order.index("allgather_param_default" + (f"_{k}" if k else "")) for k in range(48)]
    assert issues == sorted(issues)
    waits = [order.index("wait_allgather_default" + (f"_{k}" if k else "")) for k in range(48)]
    assert all(i < w for i, w in zip(issues, waits)) and any(w - i > 1 for i, w in zip(issues, waits))


def test_record_parses_each_stack_trace_once():
    """The record serializes every graph after every pass (a dozen versions per compile); the
    node's user source line comes from its stack trace, parsed once per trace text."""
    from deepcompile.record import graph as rg

    gm = _zero3_graph(8)
    for k, n in enumerate(gm.graph.nodes):
        n.meta["stack_trace"] = f'  File "/home/u/model.py", line {10 + k}, in forward\n    x = x * self.w{k}\n'
    calls = []
    real = rg._source_line
    rg._source_line = lambda st: calls.append(st) or real(st)
    try:
        rg._SOURCES.clear()
        first = rg.serialize(gm)
        n_first = len(calls)
        again = [rg.serialize(gm) for _ in range(5)]
    finally:
        rg._source_line = real
    assert n_first == len(list(gm.graph.nodes))
    assert len(calls) == n_first, f"serializing the same graph again parsed {len(calls) - n_first} stack traces"
    assert all(v == first for v in again)
    assert first[3]["source"] == "model.py:13 in forward: x = x * self.w3"


def _compile_counting_prints(monkeypatch) -> tuple[int, torch.Tensor]:
    """Compile and run ``f`` forward and backward through pipeline.aot_compile (AOTAutograd with our
    partitioner), counting AOTAutograd's graph prints (``GraphModule.print_readable``)."""
    from deepcompile.compat import aot as aot_compat
    from deepcompile.compile import pipeline
    from deepcompile.runtime import ops

    ops.ensure_registered()
    prints = []
    real = fx.GraphModule.print_readable
    monkeypatch.setattr(fx.GraphModule, "print_readable", lambda self, *a, **k: prints.append(1) or real(self, *a, **k))

    def backend(gm, inputs):
        def one(g, _inputs):
            return aot_compat.boxed(g.forward)
        return pipeline.aot_compile(gm, inputs, one, one, one)

    torch._dynamo.reset()
    f = torch.compile(lambda x, w: torch.tanh(x @ w).sum(), backend=backend)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g).requires_grad_()
    f(x, w).backward()
    return len(prints), w.grad


def test_aot_graph_strings_printed_only_for_a_reader(monkeypatch):
    from torch._functorch._aot_autograd import graph_compile

    from deepcompile.compile import quiet_aot

    originals = [getattr(graph_compile, n) for n in quiet_aot._AOT_LOG_FNS]
    skipped = quiet_aot.QUIET_SKIPPED[0]
    quiet, g_quiet = _compile_counting_prints(monkeypatch)
    assert quiet == 0, f"AOTAutograd printed {quiet} graphs nobody reads (seconds of host time at 32 layers)"
    assert quiet_aot.QUIET_SKIPPED[0] - skipped == 2  # the joint graph, the forward and backward pair
    assert [getattr(graph_compile, n) for n in quiet_aot._AOT_LOG_FNS] == originals, "left wrapped after the compile"
    torch._logging.set_logs(aot_graphs=True)
    try:
        logged, g_logged = _compile_counting_prints(monkeypatch)
    finally:
        torch._logging.set_logs()
    assert logged >= 2, "with TORCH_LOGS=aot_graphs the forward and backward are printed as before"
    assert torch.equal(g_quiet, g_logged)


def test_copies_and_passes_generate_no_code_until_a_graph_runs(monkeypatch):
    """fx_compat.lazy_graph / copy_graph: the deep copy of a kept graph and zero3's recompile would
    generate the whole graph's Python code, which nothing runs (3.1 s of a 32-layer CPU compile per
    rank, benchmarks/results/recompile_census_cpu_L32.txt); code is generated once, when the graph
    runs; the original keeps its graph, and the copy computes what the original does."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    from deepcompile.compat import fx as fx_compat
    from deepcompile.passes.registry import PassContext
    from deepcompile.passes.zero3 import zero3

    made = []
    real = _LazyGraphModule._real_recompile
    monkeypatch.setattr(_LazyGraphModule, "_real_recompile", lambda self: (made.append(self), real(self))[1])
    gm = _unsharded_graph(6)
    x, shards = torch.randn(64), [torch.randn(32) for _ in range(6)]
    copy = fx_compat.copy_graph(gm)
    assert gm.graph.owning_module is gm, "copying must leave the original its graph"
    assert isinstance(copy, _LazyGraphModule) and copy.graph is not gm.graph and made == []
    lazy = fx_compat.lazy_graph(copy)
    assert lazy is copy  # already lazy: no second wrapper
    ctx = PassContext(graph_id=0, kind="forward", world_size=2, rank=0, param_meta=_meta(6), params=None)
    out = zero3(copy, ctx)
    assert made == [], "zero3's recompile generated code before anything ran the graph"
    assert "dc.allgather_param" in out.code and made == [out]  # read: generated once, now
    # a lazy copy runs as its original does, generating its code at the first call (a graph of
    # plain ops: the runtime's gathers would need a process group)
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    g.output(g.call_function(torch.mul, (a, b)))
    plain = fx.GraphModule(torch.nn.Module(), g)
    made.clear()
    c = fx_compat.copy_graph(plain)
    assert made == []
    torch.testing.assert_close(c(x, shards[0].repeat(2)), plain(x, shards[0].repeat(2)))
    assert made == [c]
