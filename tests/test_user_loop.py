"""What a user's ordinary training loop does on a deepcompile model, against the unsharded run.

Gradient clipping (torch's call and ours), optimizer groups chosen by ``p.dim()`` (nanoGPT's
recipe), already-wrapped models, ``load_full_state_dict`` on bad input, a model with nothing
to train, and destroying a model after another was initialised. Real gloo ranks throughout.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.workloads import LOCAL_BATCH, LR, global_batch, make_model

STEPS = 4
MAX_NORM = 0.05  # the tiny GPT's gradient norm is ~1: every step clips
DECAY = 1.0      # large, so a parameter in the wrong group moves by ~lr*DECAY*|p| = 3e-3 per step


def by_dim_optimizer(params):
    """nanoGPT's configure_optimizers: decay matrices and embeddings, not biases and norms."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": DECAY},
                              {"params": no_decay, "weight_decay": 0.0}], lr=LR)


def _reference(world: int, accumulation: int, norm_type: float):
    model = make_model()
    opt = by_dim_optimizer(p for p in model.parameters() if p.requires_grad)
    norms = []
    for s in range(STEPS):
        for j in range(accumulation):
            x, y = global_batch(s, j, world)
            (model(x, y) / accumulation).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type).item())
        opt.step()
        opt.zero_grad()
    groups = [len(g["params"]) for g in opt.param_groups]
    return norms, {k: v.detach().clone() for k, v in model.state_dict().items()}, groups


def _train_clipped(rank, world, stage, accumulation, norm_type, torch_call):
    import deepcompile

    cfg = {"zero_stage": stage, "compiler": "aot_eager", "gradient_accumulation_steps": accumulation}
    if stage == 3:
        cfg["passes"] = ["zero3"]
    model, opt = deepcompile.initialize(make_model(), by_dim_optimizer, cfg)
    norms = []
    sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    for s in range(STEPS):
        for j in range(accumulation):
            x, y = global_batch(s, j, world)
            model(x[sl], y[sl]).backward()
            if torch_call:  # the plain torch call, as nanoGPT and HF's Trainer make it
                n = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
            else:
                n = deepcompile.clip_grad_norm_(model, MAX_NORM, norm_type)
            norms.append(None if n is None else n.item())
            opt.step()
            opt.zero_grad()
    groups = [len(g["params"]) for g in opt.param_groups]
    dims = sorted(p.dim() for p in model.parameters())
    return norms, deepcompile.full_state_dict(model), groups, dims


@pytest.mark.parametrize("stage,accumulation,norm_type,torch_call", [
    (3, 2, 2.0, True), (3, 1, math.inf, False), (2, 1, 2.0, False), (1, 2, math.inf, True)])
def test_clipping_and_shape_groups_match_unsharded(stage, accumulation, norm_type, torch_call):
    world = 2
    ref_norms, ref_state, ref_groups = _reference(world, accumulation, norm_type)
    assert min(ref_norms) > 2 * MAX_NORM, "clipping never triggered: the comparison would be vacuous"
    results = run_ranks(_train_clipped, world, stage, accumulation, norm_type, torch_call, timeout=400)
    for rank, (norms, state, groups, dims) in enumerate(results):
        # one norm per optimizer step, on the micro-batch that ends the window; None before it
        stepped = [n for n in norms if n is not None]
        assert len(stepped) == STEPS and len(norms) == STEPS * accumulation, norms
        assert all(n is None for i, n in enumerate(norms) if (i + 1) % accumulation), norms
        torch.testing.assert_close(torch.tensor(stepped), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank} global norm: {m}")
        assert groups == ref_groups, f"rank {rank}: optimizer groups by p.dim() {groups} != unsharded {ref_groups}"
        assert dims == sorted(p.dim() for p in make_model().parameters())
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")
    assert results[0][0] == results[1][0], "ranks disagree on the norm"


def _reject_wrapped(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.nn.parallel import DistributedDataParallel

    import deepcompile

    def message(model):
        try:
            deepcompile.initialize(model, torch.optim.AdamW, {"compiler": "eager", "passes": ["zero3"]})
        except TypeError as e:
            return str(e)
        return None

    out = {"ddp": message(DistributedDataParallel(make_model()))}
    inner = make_model()
    inner.blocks[0] = DistributedDataParallel(inner.blocks[0])
    out["ddp_inner"] = message(inner)
    out["fsdp1"] = message(FullyShardedDataParallel(make_model(freeze_pos_emb=False), device_id=torch.device("cpu")))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m2 = make_model()
    fully_shard(m2, mesh=mesh)
    out["fsdp2"] = message(m2)
    m3 = make_model()
    m3.ln_f.weight = torch.nn.Parameter(distribute_tensor(m3.ln_f.weight.detach(), mesh, [Replicate()]))
    out["dtensor"] = message(m3)
    # nothing was touched: the plain model still initialises afterwards
    model, _ = deepcompile.initialize(make_model(), torch.optim.AdamW, {"compiler": "eager", "passes": ["zero3"]})
    out["then_ok"] = isinstance(model, deepcompile.DeepCompileModel)
    return out


def test_already_wrapped_models_are_refused_with_the_fix():
    r = run_ranks(_reject_wrapped, 2, timeout=300)[0]
    assert "DistributedDataParallel" in r["ddp"] and "model.module" in r["ddp"], r["ddp"]
    assert "blocks.0" in r["ddp_inner"], r["ddp_inner"]
    assert "FSDP1" in r["fsdp1"] and "unwrapped" in r["fsdp1"], r["fsdp1"]
    assert "FSDP2" in r["fsdp2"], r["fsdp2"]
    assert r["dtensor"] is not None and ("DTensor" in r["dtensor"] or "FSDP2" in r["dtensor"]), r["dtensor"]
    assert r["then_ok"]


def _state_dict_and_lifecycle(rank, world):
    import deepcompile
    from deepcompile.runtime import ops

    out = {}
    # no trainable parameters: refused before the module is touched, then it works once unfrozen
    frozen = make_model()
    frozen.requires_grad_(False)
    try:
        deepcompile.initialize(frozen, torch.optim.AdamW, {"compiler": "eager", "passes": ["zero3"]})
    except ValueError as e:
        out["frozen"] = str(e)
    frozen.requires_grad_(True)
    model, opt = deepcompile.initialize(frozen, torch.optim.AdamW, {"compiler": "eager", "passes": ["zero3"]})

    full = deepcompile.full_state_dict(model)
    before = {k: v.clone() for k, v in full.items()}
    keys = list(full)
    first, last = keys[0], keys[-1]

    def bad(value, key=last):
        sd = {k: v + 1.0 if v.is_floating_point() else v for k, v in full.items()}  # new values everywhere
        sd[key] = value
        try:
            deepcompile.load_full_state_dict(model, sd)
        except (TypeError, ValueError) as e:
            return str(e)
        return None

    out["meta"] = bad(torch.empty(full[last].shape, device="meta"))
    out["list"] = bad(full[last].tolist())
    out["int64"] = bad(full[last].long())
    out["shape"] = bad(full[last][:1])
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in deepcompile.full_state_dict(model).items())
    out["first_key"] = first

    # destroy(old) after a second model: the second keeps training
    model2, opt2 = deepcompile.initialize(make_model(seed=1), torch.optim.AdamW,
                                          {"compiler": "eager", "passes": ["zero3"]})
    deepcompile.destroy(model)
    sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    losses = []
    for s in range(3):
        x, y = global_batch(s, 0, world)
        loss = model2(x[sl], y[sl])
        loss.backward()
        opt2.step()
        opt2.zero_grad()
        losses.append(loss.item())
    out["after_destroy_old"] = losses
    out["params_registered"] = len(model2.dc_state.runtime.params)
    return out


def test_state_dict_validation_lifecycle_and_frozen_models():
    r = run_ranks(_state_dict_and_lifecycle, 2, timeout=300)[0]
    assert "no trainable parameters" in r["frozen"] and "requires_grad" in r["frozen"], r["frozen"]
    assert "meta tensor" in r["meta"], r["meta"]
    assert "is a list" in r["list"], r["list"]
    assert "torch.int64" in r["int64"] and "cast" in r["int64"], r["int64"]
    assert "shape" in r["shape"], r["shape"]
    assert r["unchanged"], f"a refused load wrote some values (first key {r['first_key']})"
    losses = r["after_destroy_old"]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert r["params_registered"] == len(list(make_model().parameters()))  # tied lm_head counted once
