"""GPU (NCCL, 2 GPUs): the offload passes lower device memory for real and keep the numbers.

Marked `gpu`; skips cleanly without 2 CUDA GPUs. Same Llama-style model and data for each
configuration; peak = ``torch.cuda.max_memory_allocated`` over forward+backward of the steps after
the first (optimizer state exists from the first step on), measured per rank.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks

pytestmark = [pytest.mark.gpu]
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
needs_one = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 5


def _train(rank, world, passes, extra=None):
    import deepcompile
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024)
    model, opt = deepcompile.initialize(
        LlamaForCausalLM(cfg), lambda ps: torch.optim.AdamW(ps, lr=3e-4),
        {"compiler": "inductor", "passes": passes,
         "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}, **(extra or {})})
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 32000, (4, 1024), generator=g).cuda() for _ in range(2)]
    losses, peaks, step_peaks = [], [], []
    for s in range(STEPS):
        x = batches[s % 2]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        step_peaks.append(torch.cuda.max_memory_allocated())
        opt.zero_grad()
        losses.append(out.loss.item())
    return {"losses": losses, "peak_fwd_bwd": max(peaks[1:]), "peak_step": max(step_peaks[1:]),
            "largest_shard": max(p.numel() * p.element_size() for p in model.parameters()), "manager": dict(model.dc_state.runtime.optimizer_state.stats),
            "state_bytes": model.dc_state.runtime.optimizer_state.total_bytes(),
            "engine": dict(model.dc_state.runtime.offload.stats)}


@needs_one
def test_streamed_step_keeps_the_state_off_the_step_peak():
    """The streamed optimizer step never holds all the state: its peak is the resident step's
    minus the state plus at most three chunks' share (a parameter larger than a chunk is one),
    and it trains the same."""
    oo, world = "offload_optimizer", min(2, torch.cuda.device_count())
    res = run_ranks(_train, world, ["zero3", {"name": oo, "params": {"step": "resident"}}], backend="nccl", timeout=900)
    st = run_ranks(_train, world, ["zero3", {"name": oo, "params": {"step": "streamed"}}], {"optimizer_chunk_mb": 16},
                   backend="nccl", timeout=900)
    gib = 2 ** 30
    for r in range(world):
        a, b = res[r], st[r]
        held = 3 * 2 * max(b["largest_shard"], 16 * 2 ** 20)
        print(f"rank {r}: optimizer step peak resident {a['peak_step'] / gib:.3f} GiB, streamed "
              f"{b['peak_step'] / gib:.3f} GiB (state {b['state_bytes'] / gib:.3f} GiB, at most {held / gib:.3f} held)")
        assert b["manager"]["streamed_steps"] == STEPS and a["manager"]["streamed_steps"] == 0
        assert b["peak_step"] <= a["peak_step"] - b["state_bytes"] + held
        assert b["peak_fwd_bwd"] <= a["peak_fwd_bwd"] + 2 ** 20
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-4, atol=1e-4)


@needs_two
def test_offload_lowers_peak_memory():
    base = run_ranks(_train, 2, ["zero3"], backend="nccl", timeout=900)
    opt = run_ranks(_train, 2, ["zero3", "offload_optimizer"], backend="nccl", timeout=900)
    act = run_ranks(_train, 2, ["zero3", "offload_activations"], backend="nccl", timeout=900)
    gib = 2 ** 30
    for r in range(2):
        b, o, a = base[r], opt[r], act[r]
        print(f"rank {r}: peak fwd+bwd zero3 {b['peak_fwd_bwd'] / gib:.3f} GiB, +offload_optimizer "
              f"{o['peak_fwd_bwd'] / gib:.3f} GiB (state {o['state_bytes'] / gib:.3f} GiB), "
              f"+offload_activations {a['peak_fwd_bwd'] / gib:.3f} GiB "
              f"(offloaded {a['engine']['offloaded_bytes'] / gib:.2f} GiB over the run)")
        # the whole optimizer state leaves the device for forward and backward (no profile: all of it)
        assert o["peak_fwd_bwd"] <= b["peak_fwd_bwd"] - 0.9 * o["state_bytes"]
        assert a["peak_fwd_bwd"] < b["peak_fwd_bwd"]
        torch.testing.assert_close(torch.tensor(o["losses"]), torch.tensor(b["losses"]), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-4, atol=1e-4)


@needs_one
def test_offload_by_block_lowers_the_peak_by_the_blocks_bytes_and_keeps_the_numbers():
    """``offload_activations.blocks`` (the planner's form) with a profile, so reloads are placed
    latest-deadline-first on the profiled timeline: the first four blocks' activations are off
    the device at the forward/backward peak, and training is the same."""
    off = {"name": "offload_activations", "params": {"blocks": "0,1,2,3"}}
    base = run_ranks(_train, 1, ["zero3"], {"profile_step": 1}, backend="nccl", timeout=900)[0]
    act = run_ranks(_train, 1, ["zero3", off], {"profile_step": 1}, backend="nccl", timeout=900)[0]
    gib = 2 ** 30
    e = act["engine"]
    per_step = e["offloaded_bytes"] / STEPS   # (at most: a step before the plan may offload less)
    print(f"peak fwd+bwd zero3 {base['peak_fwd_bwd'] / gib:.3f} GiB, +offload_activations blocks 0-3 "
          f"{act['peak_fwd_bwd'] / gib:.3f} GiB ({per_step / gib:.3f} GiB a step offloaded); engine {e}")
    assert e["offloads"] > 0 and e["skipped"] == 0 and e["offloads"] == e["reloads"], e
    assert act["peak_fwd_bwd"] <= base["peak_fwd_bwd"] - 0.5 * per_step
    torch.testing.assert_close(torch.tensor(act["losses"]), torch.tensor(base["losses"]), rtol=1e-4, atol=1e-4)


@needs_two
def test_profiled_offload_frees_lazily_and_keeps_the_numbers():
    # with a profile the copies out are deferred and freed by the forward's release points; a
    # 1 MiB limit makes every point free everything it can and every reload wait for the end
    base = run_ranks(_train, 2, ["zero3"], backend="nccl", timeout=900)
    cfg = ["zero3", {"name": "offload_optimizer", "params": {"limit_mb": 1, "headroom_mb": 0}}]
    lazy = run_ranks(_train, 2, cfg, {"profile_step": 1}, backend="nccl", timeout=900)
    for r in range(2):
        print(f"rank {r}: manager {lazy[r]['manager']}")
        assert lazy[r]["manager"]["released_bytes"] > 0
        torch.testing.assert_close(torch.tensor(lazy[r]["losses"]), torch.tensor(base[r]["losses"]),
                                   rtol=1e-4, atol=1e-4)


@needs_one
def test_reload_block_is_not_reused_before_its_copy_ends():
    """A reloaded tensor freed before anyone waited for its copy back (a backward that raised, a
    saved tensor autograd dropped unread): the allocator must not hand its block to new work
    while the host-to-device copy still writes it. The copy is held back by a sleep on the copy
    stream, so without ``record_stream`` the new tensor gets the block and then the old bytes."""
    from deepcompile.runtime.offload import CopyEngine

    engine, dev = CopyEngine(), torch.device("cuda", 0)
    n = 1 << 20
    t = torch.full((n,), 7.0, device=dev)
    assert engine.offload(t, "k")
    torch.cuda.synchronize()
    with torch.cuda.stream(engine._stream(dev, "h2d")):
        torch.cuda._sleep(1 << 31)  # about a second of GPU time ahead of the copy back
    engine.reload(t, "k")
    ptr = t.data_ptr()
    del t  # freed without engine.wait: the copy back is still queued
    u = torch.zeros(n, device=dev)
    reused = u.data_ptr() == ptr
    torch.cuda.synchronize()
    bad = int((u != 0).sum())
    assert bad == 0, (f"{bad} of {n} elements of a new tensor were overwritten by a late copy back "
                      f"(block reused: {reused})")
    assert not reused, "the allocator handed out the block while the copy back was still writing it"


def _checkpoint_offloaded(rank, world, path):
    import torch.distributed.checkpoint as dcp

    import deepcompile
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    model, opt = deepcompile.initialize(LlamaForCausalLM(cfg), lambda ps: torch.optim.AdamW(ps, lr=3e-4),
                                        {"compiler": "aot_eager", "passes": ["zero3", "offload_optimizer"]})
    x = torch.randint(0, 1024, (2, 128), generator=torch.Generator().manual_seed(rank)).cuda()

    def step():
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    for _ in range(2):
        step()
    mgr = model.dc_state.runtime.optimizer_state
    away = len(mgr.offloaded)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    msd, osd = deepcompile.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    grew = torch.cuda.memory_allocated() - before
    saved = {k: {n: v.to_local().cpu().clone() for n, v in d.items() if hasattr(v, "to_local")}
             for k, d in osd["state"].items()}
    kept = len(mgr.offloaded)
    after_save = step()
    msd, osd = deepcompile.get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    deepcompile.set_state_dict(model, opt, msd, osd)
    loaded = deepcompile.get_state_dict(model, opt)[1]["state"]
    same = all(torch.equal(loaded[k][n].to_local().cpu(), v) for k, d in saved.items() for n, v in d.items())
    again = step()
    deepcompile.destroy(model)
    return {"away": away, "kept": kept, "grew": grew, "same": same, "losses": (after_save, again),
            "state_bytes": sum(v.numel() * v.element_size() for d in saved.values() for v in d.values())}


@needs_one
def test_checkpoint_of_offloaded_state_reads_it_on_the_host(tmp_path):
    """DCP save of offloaded optimizer state: read from pinned host memory (the device's allocated
    memory does not grow by the state), loaded back exactly."""
    r = run_ranks(_checkpoint_offloaded, 1, str(tmp_path / "ckpt"), backend="nccl", timeout=600)[0]
    print(r)
    assert r["away"] > 0 and r["kept"] == r["away"], r
    assert r["grew"] < 0.1 * r["state_bytes"], r
    assert r["same"], r
    assert r["losses"][1] == pytest.approx(r["losses"][0], rel=1e-6), r   # the step after the load repeats the one after the save
