"""Identical decoder blocks share one Inductor compile (deepcompile/compile/blocks.py).

One real 2-rank gloo run of the tiny GPT at 4 layers under Inductor with zero3 + prefetch:
- the backward's middle blocks (2 and 1) are one region compiled once: compile_fx_inner is
  called once per *distinct* region, fewer times than there are regions;
- the shared artifact takes each layer's parameter ids as inputs (a region run with the wrong
  ids would wait for a gather that was never started, and the runtime raises);
- losses and parameters match the unsharded reference;
- a gather that prefetch hoisted into the previous block is issued from that block's region;
- no gathered parameter is left alive after forward or backward (the driver frees values).
"""
from __future__ import annotations

import re

import pytest
import torch

from tests.dist_utils import run_ranks

N_LAYER = 4
STEPS = 2
PASSES = ["zero3", {"name": "prefetch", "params": {"budget_mb": 0.02, "fuse_mb": 0}}]


def _rank(rank, world):
    import os

    from torch._inductor import compile_fx as cfx

    import torch._inductor.config as icfg

    icfg.compile_threads = 2  # kernels compile in Inductor's pool: the regions defer their wait

    from deepcompile.compile import blocks
    from tests import workloads as W

    calls = []
    orig = cfx.compile_fx_inner

    def spy(gm, inputs, **kw):
        calls.append(bool(kw.get("is_backward")))
        return orig(gm, inputs, **kw)

    cfx.compile_fx_inner = spy
    # where each allgather sits: (region label, parameter ids it issues)
    placed = []
    orig_split = blocks.split

    def split(gm):
        regions = orig_split(gm)
        for r in regions:
            for n in r.nodes:
                if str(n.target).startswith("dc.allgather_param"):
                    ids = n.args[1] if isinstance(n.args[1], (list, tuple)) else [n.args[1]]
                    placed.append((r.label[1] if r.label != blocks._OUTSIDE else None, [int(i) for i in ids]))
        return regions

    blocks.split = split
    # config blocks is off by default (blocks.resolve says why)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # rank 0's progress lines
        out = W.train_sharded(rank, world, STEPS, 1, {"compiler": "inductor", "passes": PASSES, "blocks": True},
                              model_overrides={"n_layer": N_LAYER})
    from deepcompile.runtime import ops, state

    st = dict(ops.C.stats())
    layer = {}
    for pid, m in state.current().params.items():
        hit = re.match(r"blocks\.(\d+)\.", m.name)
        if hit:
            layer[pid] = int(hit.group(1))
    return {"losses": out["losses"], "state": out["state"], "stats": list(state.current().block_compiles),
            "calls": calls, "placed": placed, "layer": layer,
            "reduce_ops": st["reduce_ops"], "reduce_calls": st["reduce_calls"],
            "live": out["live_after_fwd"] + out["live_after_bwd"], "progress": err.getvalue()}


def test_identical_blocks_compile_once_and_match_reference():
    results = run_ranks(_rank, 2, timeout=600)
    r0 = results[0]
    bw = [s for s in r0["stats"] if s["kind"] == "backward"]
    assert bw, f"the backward was compiled whole: {r0['stats']}"
    s = bw[0]
    assert s["reused"] >= 1 and s["compiled"] < s["regions"], s
    assert s["labels"][1:] == [3, 2, 1, 0], s  # one region per block, in backward order
    # compile_fx_inner ran once per distinct region of the backward (plus whole graphs elsewhere)
    n_bw_calls = sum(r0["calls"])
    assert n_bw_calls == s["compiled"], (r0["calls"], s)
    # every compiled region's module waited for its kernels after the last region was lowered
    assert s["kernel_waits_deferred"] == s["compiled"], s
    # the backward's reduce calls do not cross a block boundary, so the blocks stay identical, and
    # they are still grouped (one call per gradient cost more host time than the regions saved)
    assert 0 < r0["reduce_ops"] < r0["reduce_calls"] / 2, (r0["reduce_ops"], r0["reduce_calls"])

    # the user sees it: the compiling step's progress line counts the regions
    want = (f"Inductor compiled {sum(x['compiled'] for x in r0['stats'])} distinct regions for "
            f"{sum(x['regions'] for x in r0['stats'])} block regions of {len(r0['stats'])} graphs")
    assert want in r0["progress"], r0["progress"]

    ref_losses, ref_state = _reference()
    mean = torch.tensor([sum(x) / 2 for x in zip(results[0]["losses"], results[1]["losses"])])
    torch.testing.assert_close(mean, torch.tensor(ref_losses, dtype=mean.dtype), rtol=1e-5, atol=1e-6)
    for k, v in ref_state.items():
        torch.testing.assert_close(r0["state"][k], v, rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")

    # prefetch crossed a block boundary and the gather stayed where the pass put it: the region
    # of block b issues a gather of a parameter of the block that runs next (b + 1 in forward,
    # b - 1 in backward)
    crossed = [(lab, pid) for lab, ids in r0["placed"] for pid in ids
               if lab is not None and pid in r0["layer"] and abs(r0["layer"][pid] - lab) == 1]
    assert crossed, r0["placed"]
    assert all(not live for live in r0["live"]), r0["live"]


def _reference():
    """workloads.train_reference at N_LAYER layers (one process, every rank's batch)."""
    from tests import workloads as W

    model = W.make_model(n_layer=N_LAYER)
    opt = W.make_optimizer(model.parameters())
    losses = []
    for s in range(STEPS):
        x, y = W.global_batch(s, 0, 2)
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_blocks_setting_resolves_per_device_and_auto_falls_back_to_the_whole_graph(monkeypatch):
    """Config ``blocks``: "auto" (the default) cuts on CUDA only, never with another compiler or CUDA
    graphs; false never cuts; true cuts anywhere. Where "auto" cuts and the regions fail, the graph is compiled
    whole with a warning naming the error (a user's run goes on); with true the error is raised."""
    import warnings

    from deepcompile.compile import blocks
    from deepcompile.config import Config, ConfigError

    assert Config.load({}).blocks == "auto" and blocks.resolve(Config.load({}), "cuda") == "auto"
    assert blocks.resolve(Config.load({}), "cpu") is None
    cfg = Config.load({"blocks": "auto"})
    assert blocks.resolve(cfg, "cuda") == "auto" and blocks.resolve(cfg, "cpu") is None
    assert blocks.resolve(Config.load({"blocks": True}), "cpu") == "on"
    assert blocks.resolve(Config.load({"blocks": False}), "cuda") is None
    assert blocks.resolve(Config.load({"blocks": "auto", "compiler": "aot_eager"}), "cuda") is None
    # keys of removed features are unknown keys that say so (no near-miss suggestion)
    with pytest.raises(ConfigError, match=r"config\.cuda_graphs: unknown key \(CUDA graphs are not supported\)\. Known keys: .*blocks"):
        Config.load({"blocks": True, "cuda_graphs": True})
    with pytest.raises(ConfigError, match=r"config\.compile_workers: unknown key \(compile worker processes are not supported\)"):
        Config.load({"compile_workers": 2})
    with pytest.raises(ConfigError, match=r"config\.blocks: expected true, false or 'auto', got 'yes'"):
        Config.load({"blocks": "yes"})

    def broken(*a, **k):
        raise RuntimeError("region 3 could not be lowered")

    monkeypatch.setattr(blocks, "_compile_graph", broken)
    inputs = [torch.zeros(2, 3)]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert blocks.compile_graph(None, inputs, None, "auto", is_backward=True) is None
    assert any("backward graph is compiled whole" in str(m.message) and "region 3 could not be lowered"
               in str(m.message) for m in w), [str(m.message) for m in w]
    with pytest.raises(RuntimeError, match="region 3"):
        blocks.compile_graph(None, inputs, None, "on")


def test_driver_runs_regions_in_order_frees_values_and_takes_hundreds_of_values():
    """The generated driver (blocks.run_plan) on a plan as large as a 32-layer graph's: 600
    outer inputs, a region with 300 outputs (the first forward region hands every gathered
    parameter on), ids as literals; each value is dropped after its last reader, the argument
    list is cleared, and the outputs come back as the graph's list or tuple."""
    import gc
    import weakref

    from deepcompile.compile import blocks

    n_outer, wide = 600, 300
    seen = []

    class Box:  # a value whose death the test can see
        def __init__(self, v):
            self.v = v

    def spread(a):  # region 0: reads every outer input, writes `wide` values
        seen.append(("spread", len(a), a[-1]))
        return tuple(Box(a[i].v + a[n_outer - 1 - i].v) for i in range(wide))

    def total(a):  # region 1: reads region 0's values and two ids
        seen.append(("total", len(a), a[-2:]))
        return [Box(sum(b.v for b in a[:-2]))]

    steps = [(0, list(range(n_outer)), [7], list(range(n_outer, n_outer + wide)), list(range(1, n_outer))),
             (1, list(range(n_outer, n_outer + wide)), [11, 12], [n_outer + wide],
              list(range(n_outer, n_outer + wide)))]
    plan = blocks.Plan(steps, n_outer + wide + 1, [], [n_outer + wide, None, 0], True)
    run = blocks.run_plan(plan, [spread, total])
    args = [Box(i) for i in range(n_outer)]
    refs = [weakref.ref(a) for a in args]
    out = run(args)
    assert args == []
    assert seen == [("spread", n_outer + 1, 7), ("total", wide + 2, [11, 12])]
    assert out[0].v == wide * (n_outer - 1) and out[1] is None and out[2].v == 0
    gc.collect()
    assert [r() is not None for r in refs] == [True] + [False] * (n_outer - 1)  # input 0 is an output
    assert isinstance(blocks.run_plan(blocks.Plan(steps, n_outer + wide + 1, [], [0], False),
                                      [spread, total])([Box(i) for i in range(n_outer)]), tuple)
