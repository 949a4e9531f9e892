"""Recompute: chosen blocks' saved activations are freed after forward and computed again in
backward, training matches the unsharded reference, the freed bytes are real, and every read
of a dropped value in backward reads its recomputed copy."""
from __future__ import annotations

import warnings

import pytest

from deepcompile.passes import recompute_activations as rc
from tests.test_zero3_parity import STEPS, _compare

RC_ALL = {"name": "recompute_activations", "params": {"blocks": "all"}}


def _nodes(graphs, kind, after):
    return [nodes for _, k, a, nodes in graphs if k == kind and a == after]


def _check_backward(graphs):
    """After recompute, no backward node reads a dropped value's placeholder; the recipes'
    nodes are there; one gather per shard."""
    fw = _nodes(graphs, "forward", "recompute_activations")
    bw = _nodes(graphs, "backward", "recompute_activations")
    assert fw and bw
    for f, b in zip(fw, bw):
        dropped = {n["args"][0]["node"] for n in f if n.get("target") == "dc.drop_activation"}
        assert dropped, "nothing dropped"
        placeholders = {n["name"] for n in b if n["op"] == "placeholder"}
        readers = [n["name"] for n in b if n["op"] == "call_function"
                   and any(isinstance(a, dict) and a.get("node") in dropped & placeholders for a in n.get("args", []))]
        assert not readers, f"backward still reads dropped values: {readers}"
        gathers = [tuple(map(str, n["args"])) for n in b if n.get("target") == "dc.unshard"]
        assert len(gathers) == len(set(gathers)), "a shard is gathered twice in backward"
        # the record names the forward node each copy runs again (the cost model prices it by it)
        by_name = {n["name"]: n for n in f}
        copies = [n for n in b if n.get("recompute_of")]
        assert copies and all(by_name[n["recompute_of"]]["target"] == n["target"] for n in copies)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_recompute_matches_unsharded(compiler):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = _compare(2, 1, {"compiler": compiler, "passes": [RC_ALL, "zero3", "prefetch"]})
    for r in results:
        st = r["offload_stats"]
        # every step's forward freed the same storages, and nothing refused a drop
        assert st["drops"] > 0 and st["drops"] % STEPS == 0 and st["drops_skipped"] == 0, st
        assert st["dropped_bytes"] > 0
        _check_backward(r["graphs"])


def test_parse_blocks_names_the_bad_entry():
    assert rc.parse_blocks("") == set()
    assert rc.parse_blocks(" 0, 3 ,5") == {0, 3, 5}
    assert rc.parse_blocks("all") == "all"
    with pytest.raises(ValueError, match=r"'x' is not a block index"):
        rc.parse_blocks("0,x")


def test_recompute_must_come_before_zero3():
    from deepcompile.config import Config
    from deepcompile.params import ConfigError

    Config.load({"passes": [RC_ALL, "zero3"]})
    with pytest.raises(ConfigError, match="'recompute_activations' must come before 'zero3'"):
        Config.load({"passes": ["zero3", RC_ALL]})


# A model whose activations outweigh its parameters (sequence 256: each block's attention scores
# are 2 MiB), so that a limit under its profiled peak can only be met by recomputing
LONG = dict(block_size=256, n_layer=4)
SEQ = 256
LIMIT_GIB = 0.012   # the plan without recomputation peaks at ~16.4 MiB on 2 ranks


def _long_batch(step: int, world: int):
    import torch

    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 128, (world * 2, SEQ), generator=g)
    return x, (x * 7 + 3) % 128


def _planned_long(rank, world, limit_gib):
    import deepcompile
    from tests.workloads import make_model, make_optimizer

    cfg = {"compiler": "aot_eager", "plan_cache": False, "memory_limit_gib": limit_gib}
    model, opt = deepcompile.initialize(make_model(**LONG), make_optimizer, cfg)
    losses = []
    for s in range(4):
        x, y = _long_batch(s, world)
        sl = slice(rank * 2, (rank + 1) * 2)
        loss = model(x[sl], y[sl])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "plan": model.dc_plan, "stats": dict(model.dc_state.runtime.offload.stats),
            "passes": [(e.name, dict(e.params)) for e in model.dc_backend.passes]}


def test_the_planner_recomputes_to_fit_and_training_matches_the_reference():
    import torch

    from deepcompile.plan.planner import ALLOCATOR_SLACK
    from tests.dist_utils import run_ranks
    from tests.workloads import make_model, make_optimizer

    results = run_ranks(_planned_long, 2, LIMIT_GIB, timeout=600)
    r = results[0]
    chosen = r["plan"]["chosen"]
    assert chosen["recomputed_blocks"], r["plan"]["summary"]
    assert chosen["peak_bytes"] <= r["plan"]["limit_bytes"] + ALLOCATOR_SLACK
    assert r["passes"][0][0] == "recompute_activations"
    assert results[1]["passes"] == r["passes"], "ranks planned differently"
    # the runtime freed what the planner counted on, in each of the 2 steps after the plan (steps 2, 3)
    assert r["stats"]["drops"] > 0 and r["stats"]["drops_skipped"] == 0
    assert r["stats"]["dropped_bytes"] == 2 * chosen["recomputed_bytes"]
    # the unsharded reference on the whole batch
    model, ref = make_model(**LONG), []
    opt = make_optimizer(model.parameters())
    for s in range(4):
        x, y = _long_batch(s, 2)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    mean = torch.tensor([res["losses"] for res in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref), rtol=1e-5, atol=1e-6)


def test_a_bad_block_list_is_refused_at_load_naming_its_key():
    from deepcompile.config import Config
    from deepcompile.params import ConfigError

    with pytest.raises(ConfigError, match=r"passes\[0\]\.params\.blocks: '1-3' is not a block index"):
        Config.load({"passes": [{"name": "recompute_activations", "params": {"blocks": "1-3"}}, "zero3"]})


def _checkpointed_blocks(rank, world, steps):
    """The default plan on a model whose blocks run under torch's own activation checkpointing."""
    import deepcompile
    from torch.utils.checkpoint import checkpoint

    from tests.workloads import make_model, make_optimizer, rank_step

    model = make_model()
    for blk in model.blocks:
        blk.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(blk.forward)
    model, opt = deepcompile.initialize(model, make_optimizer, {"compiler": "aot_eager", "plan_cache": False})
    losses = [rank_step(model, opt, rank, world, s) for s in range(steps)]
    return {"losses": losses, "state": deepcompile.full_state_dict(model), "plan": model.dc_plan}


def test_a_models_own_activation_checkpointing_trains_like_the_reference_under_the_default_plan():
    import torch

    from tests.dist_utils import run_ranks
    from tests.workloads import train_reference

    steps = 4
    ref_losses, ref_state = train_reference(2, steps, 1)
    results = run_ranks(_checkpointed_blocks, 2, steps, timeout=600)
    mean = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref_losses, dtype=mean.dtype), rtol=1e-5, atol=1e-6)
    for k, v in ref_state.items():
        torch.testing.assert_close(results[0]["state"][k], v, rtol=1e-4, atol=1e-4)
    # planned from a profile of the checkpointed graphs: nothing of theirs left to drop
    plan = results[0]["plan"]
    assert plan is not None and not plan["chosen"]["recomputed_blocks"]


def _two_models_interleaved(rank, world):
    """Model A recomputes every block, model B none; B's forward compiles between A's forward and
    A's backward (AOTAutograd compiles a backward at its first call), in one process."""
    import deepcompile
    import torch
    from tests.workloads import LOCAL_BATCH, global_batch, make_model, make_optimizer

    cfg = {"compiler": "aot_eager", "plan_cache": False}
    a, _ = deepcompile.initialize(make_model(), make_optimizer, {**cfg, "passes": [RC_ALL, "zero3"]})
    b, _ = deepcompile.initialize(make_model(), make_optimizer,
                                  {**cfg, "passes": [{"name": "recompute_activations", "params": {"blocks": ""}}, "zero3"]})
    x, y = global_batch(0, 0, world)
    sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    la = a(x[sl], y[sl])
    lb = b(x[sl], y[sl])
    la.backward()
    lb.backward()
    notes = [n for v in a.dc_graphs if v.kind == "backward" and v.after == "recompute_activations" for n in v.notes]
    out = {"notes": notes, "finite": bool(torch.isfinite(la).item())}
    deepcompile.destroy(b)
    deepcompile.destroy(a)
    return out


def test_forward_to_backward_handoff_belongs_to_its_model():
    """A pass's forward leaves its recipes for its own model's backward: another model compiled in
    between (or a what-if pricing plans beside a training run) does not replace them."""
    from tests.dist_utils import run_ranks

    for r in run_ranks(_two_models_interleaved, 2, timeout=300):
        assert r["finite"]
        assert r["notes"] and all("recipes: 0 of" not in n for n in r["notes"]), r["notes"]
        assert any(n.startswith("recipes: ") for n in r["notes"]), r["notes"]


def test_the_cost_model_prices_a_recomputed_node_at_its_forward_latency():
    """A node recompute_activations copied into backward runs what its forward node ran: the
    estimate takes the forward's profiled latency for it (``recompute_of``), also where the
    backward's profile has a node of the same name and target that is another op."""
    from deepcompile.plan.cost_model import predict
    from deepcompile.profile.profiler import GraphProfile, NodeProfile, Profile

    def node(name, args=(), **kw):
        return {"name": name, "op": "call_function", "target": "aten.mm", "args": [{"node": a} for a in args],
                "shape": [4096, 4096], "dtype": "bfloat16", "scope": "", **kw}

    x = {"name": "x", "op": "placeholder", "target": "x", "args": [], "shape": [4096, 4096], "dtype": "bfloat16",
         "scope": ""}
    fwd = {"graph_id": 0, "kind": "forward", "after": "zero3", "nodes": [x, node("mm", ["x"])]}
    bwd_profiled = {"graph_id": 0, "kind": "backward", "after": "zero3", "nodes": [x, node("mm_1", ["x"])]}
    # recompute_activations copied the forward's mm in as mm_1 (the backward's own matmul became mm_2)
    bwd = {"graph_id": 0, "kind": "backward", "after": "recompute_activations",
           "nodes": [x, node("mm_1", ["x"], recompute_of="mm"), node("mm_2", ["mm_1"])]}
    prof = Profile(graphs={(0, "forward"): GraphProfile(0, "forward", [NodeProfile("mm", 5.0, 0, 0, 0, "aten.mm.default")]),
                           (0, "backward"): GraphProfile(0, "backward", [NodeProfile("mm_1", 1.0, 0, 0, 0, "aten.mm.default")])},
                   hardware="NVIDIA H200")
    per = predict([fwd, bwd_profiled, bwd], prof)["per_graph_ms"]
    assert per["0/forward"] == pytest.approx(5.0, abs=0.1)
    bwd["nodes"][1].pop("recompute_of")   # by name alone the copy takes the profiled mm_1's 1 ms
    by_name = predict([fwd, bwd_profiled, bwd], prof)["per_graph_ms"]
    assert per["0/backward"] - by_name["0/backward"] == pytest.approx(5.0 - 1.0, abs=0.01), (per, by_name)
