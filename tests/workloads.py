"""Training runs shared by the CPU and GPU tests: the same model, data and optimizer, sharded
across ranks by deepcompile or unsharded in one process (the reference)."""
from __future__ import annotations

import torch

from deepcompile.models import GPT, GPTConfig

MODEL = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32)
LOCAL_BATCH = 2
SEQ = 16
LR = 3e-3


def make_model(seed: int = 0, **overrides) -> GPT:
    from dataclasses import replace

    torch.manual_seed(seed)
    return GPT(replace(MODEL, **overrides))


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def global_batch(step: int, micro: int, world: int, device="cpu"):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randint(0, MODEL.vocab_size, (world * LOCAL_BATCH, SEQ), generator=g)
    y = (x * 7 + 3) % MODEL.vocab_size
    return x.to(device), y.to(device)


def rank_step(model, opt, rank: int, world: int, step: int, micro: int = 0) -> float:
    """One plain-loop step of ``rank`` on its slice of the global batch; returns the loss."""
    x, y = global_batch(step, micro, world, next(model.parameters()).device)
    sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    loss = model(x[sl], y[sl])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def train_reference(world: int, steps: int, accumulation: int, device="cpu", model_overrides: dict | None = None):
    """One process, no sharding: each micro-batch is the concatenation of every rank's."""
    model = make_model(**(model_overrides or {})).to(device)
    opt = make_optimizer(model.parameters())
    losses = []
    for s in range(steps):
        for j in range(accumulation):
            x, y = global_batch(s, j, world, device)
            loss = model(x, y)
            (loss / accumulation).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def live_gathered_settled(timeout_s: float = 2.0) -> list[int]:
    """Gathered buffers still alive. gloo's worker thread drops its reference to a finished
    collective's output a moment after waking the waiter, so give it that moment."""
    import time

    from deepcompile.runtime import ops

    deadline = time.monotonic() + timeout_s
    live = list(ops.C.live_gathered())
    while live and time.monotonic() < deadline:
        time.sleep(0.01)
        live = list(ops.C.live_gathered())
    return live


def train_sharded(rank: int, world: int, steps: int, accumulation: int, config: dict,
                  model_overrides: dict | None = None):
    """One rank of a deepcompile run: plain loop, step()/zero_grad() after every micro-batch."""
    import deepcompile
    from deepcompile.runtime import ops

    cfg = dict(config)
    if not cfg.pop("default_schedule", False):
        # the tests of one pass list pin it (the default ZeRO-3 config profiles and re-compiles)
        cfg.setdefault("passes", ["zero3"])
    cfg["gradient_accumulation_steps"] = accumulation
    model, opt = deepcompile.initialize(make_model(**(model_overrides or {})), make_optimizer, cfg)
    # what gradient memory exists when the optimizer steps: only the shards' .grad may remain
    at_step = []
    opt.register_step_pre_hook(lambda *_: at_step.append(
        (int(ops.C.local_grad_bytes()),
         sum(p.grad.numel() for p in model.parameters() if p.grad is not None),
         sum(p.numel() for p in model.parameters() if p.requires_grad))))
    device = next(model.parameters()).device
    losses, live_after_fwd, live_after_bwd = [], [], []
    state_bytes_between_steps = []  # optimizer-state storage the device holds during fwd/bwd
    for s in range(steps):
        for j in range(accumulation):
            x, y = global_batch(s, j, world, device)
            sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            loss = model(x[sl], y[sl])
            live_after_fwd.append(live_gathered_settled())
            loss.backward()
            live_after_bwd.append(live_gathered_settled())
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            state_bytes_between_steps.append(sum(
                v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.numel() > 1))
    full = deepcompile.full_state_dict(model)
    rt = model.dc_state.runtime
    shard_numel = sum(p.numel() for p in model.parameters())
    return {
        "losses": losses,
        "state": full,
        "blocks": list(rt.block_compiles),
        "blocks_loaded": list(rt.blocks_loaded),
        "shard_numel": shard_numel,
        "live_after_fwd": live_after_fwd,
        "live_after_bwd": live_after_bwd,
        "stats": dict(ops.C.stats()),
        "state_bytes_between_steps": state_bytes_between_steps,
        "state_total_bytes": rt.optimizer_state.total_bytes(),
        "offload_stats": {**rt.offload.stats, **rt.optimizer_state.stats},
        "grads_at_step": at_step,
        "n_params": len(model.dc_state.runtime.params),
        "optim_fused": list(model.dc_state.optim_fused),
        "graphs": [(v.graph_id, v.kind, v.after, v.nodes) for v in model.dc_graphs],
        "versions": [(v.step, v.after) for v in model.dc_graphs],
        "notes": [(v.graph_id, v.kind, v.after, list(v.notes)) for v in model.dc_graphs],
        "aot_cache_hits": list(model.dc_backend.aot_cache_hits),
    }
