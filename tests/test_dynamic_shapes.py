"""Per-rank dynamic padding (each rank pads its batch to its own longest sequence, as Hugging
Face's DataCollatorWithPadding does) under the default ZeRO-3 plan, on 2 gloo ranks.

The failure it guards against: the profiling step's ``agree`` stops with "ranks profiled
different graphs" when rank 0 saw one length twice and ran its static graph while rank 1 had
recompiled a symbolic one. The ranks therefore agree on which input dims vary before the profiling step and every re-compile, compile
the same symbolic graph, and reuse it for every later length."""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.workloads import MODEL, make_model, make_optimizer

# Sequence length per step (rank 0 repeats its length across steps 0 and 1: the old crash);
# from step 2 (after the warm-up) each rank sees 6 lengths it has not compiled for.
LENS = [[16, 16, 20, 12, 24, 28, 14, 18],
        [12, 20, 16, 24, 10, 22, 26, 30]]
STEPS = len(LENS[0])
LAYERS = {"n_layer": 1}  # compile time dominates this test; one block has every op of two


def padded_batch(step: int, rank: int):
    """Two sequences padded to this rank's length: the second is 3 tokens shorter (pad token 0,
    label -100, which cross_entropy ignores)."""
    L = LENS[rank][step]
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, MODEL.vocab_size, (2, L), generator=g)
    y = (x * 7 + 3) % MODEL.vocab_size
    x[1, L - 3:] = 0
    y[1, L - 3:] = -100
    return x, y


def reference(world: int, device="cpu"):
    """Unsharded: the sharded step's gradient is the mean over ranks of each rank's own loss."""
    model = make_model(**LAYERS).to(device)
    opt = make_optimizer(model.parameters())
    losses = []
    for s in range(STEPS):
        per_rank = [model(*(t.to(device) for t in padded_batch(s, r))) for r in range(world)]
        loss = sum(per_rank) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append([x.item() for x in per_rank])
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _train(rank, world, config):
    import deepcompile

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = deepcompile.initialize(make_model(**LAYERS), make_optimizer, config)
        device = next(model.parameters()).device
        losses = []
        for s in range(STEPS):
            loss = model(*(t.to(device) for t in padded_batch(s, rank)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        state = deepcompile.full_state_dict(model)
    prof = model.dc_profile
    import json

    json.dumps([v.nodes for v in model.dc_graphs])  # symbolic sizes must reach the run record as JSON
    return {"losses": losses, "state": state,
            "compiles": [(v.step, v.graph_id) for v in model.dc_graphs if v.kind == "dynamo"],
            "passes": sorted({(v.step, v.after) for v in model.dc_graphs}),
            "profiled": sorted(prof.graphs) if prof is not None else None,
            "dynamic": model.dc_state.dynamic.dynamic,
            "warnings": [str(w.message) for w in caught if "different graphs" in str(w.message)]}


def _check(results, ref_losses, ref_state, tol):
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor([x[rank] for x in ref_losses]),
                                   rtol=tol, atol=tol / 10)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, rtol=tol * 10, atol=1e-4, msg=lambda m: f"{k}: {m}")
        # the default plan really ran: profile at step 1, prefetch/selective_unshard from step 2
        assert (2, "prefetch") in r["passes"] and (2, "selective_unshard") in r["passes"], r["passes"]
        # both ranks profiled the same (symbolic) graphs: nothing was dropped
        assert r["profiled"] == [(0, "backward"), (0, "forward")], r["profiled"]
        assert not r["warnings"], r["warnings"]
        assert r["dynamic"] == {(("arg", 0), 2): {1}, (("arg", 1), 2): {1}}, r["dynamic"]
        # one Dynamo compile per pass list: step 0 (static: nothing agreed yet), the profiling
        # step (symbolic), step 2's final graphs (symbolic), and none for the 6 new lengths after
        by_step: dict = {}
        for step, _ in r["compiles"]:
            by_step[step] = by_step.get(step, 0) + 1
        assert by_step.get(2) == 1, f"rank {rank} compiled {by_step.get(2)} graphs from step 2 on: {r['compiles']}"
        assert sum(by_step.values()) <= 3, r["compiles"]
    assert results[0]["losses"] != results[1]["losses"]


def test_dynamic_padding_default_plan_matches_reference_and_compiles_once():
    ref_losses, ref_state = reference(2)
    _check(run_ranks(_train, 2, {"compiler": "aot_eager"}, timeout=600), ref_losses, ref_state, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_dynamic_padding_default_plan_nccl_inductor():
    """The real default: aot_eager warm-up, then Inductor compiles the symbolic graphs once."""
    ref_losses, ref_state = reference(2, device="cuda:0")
    _check(run_ranks(_train, 2, {}, backend="nccl", timeout=900), ref_losses, ref_state, 1e-4)


def _agree_differing(rank, world):
    """Rank 1 profiled an extra graph and a different version of graph 0's backward."""
    from deepcompile.profile.agree import agree
    from deepcompile.profile.profiler import GraphProfile, NodeProfile, Profile

    def g(gid, kind, names, lat):
        return GraphProfile(gid, kind, [NodeProfile(n, lat, 100, 200, 10) for n in names])
    graphs = {(0, "forward"): g(0, "forward", ["mm", "relu"], 1.0 + rank)}
    if rank == 0:
        graphs[(0, "backward")] = g(0, "backward", ["mm_1", "add"], 1.0)
    else:
        graphs[(0, "backward")] = g(0, "backward", ["sym_size_int", "mm_1", "add"], 1.0)
        graphs[(1, "forward")] = g(1, "forward", ["mm", "relu"], 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = agree(Profile(graphs=graphs, optimizer_ms=float(rank)))
    return (sorted(p.graphs), [n.latency_ms for n in p.graphs[(0, "forward")].nodes], p.optimizer_ms,
            [str(w.message) for w in caught])


def test_agree_drops_graphs_ranks_profiled_differently():
    """No crash: graphs whose structure differs across ranks leave the profile on every rank (a
    warning names them); the rest is agreed as before (latencies by the minimum, the rest by the
    maximum)."""
    a, b = run_ranks(_agree_differing, 2, timeout=120)
    assert a[:3] == b[:3] == ([(0, "forward")], [1.0, 1.0], 1.0), (a, b)
    assert any("(0, 'backward')" in w and "(1, 'forward')" in w for w in a[3]), a[3]
