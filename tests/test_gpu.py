"""GPU tests (NCCL, 2 GPUs). Marked `gpu`; they skip cleanly without CUDA."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def test_parity_nccl():
    from tests.workloads import train_reference, train_sharded

    steps = 10
    ref_losses, ref_state = train_reference(2, steps, 1, device="cuda:0")
    results = run_ranks(train_sharded, 2, steps, 1, {"compiler": "inductor"}, backend="nccl", timeout=600)
    mean = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref_losses, dtype=mean.dtype), rtol=1e-4, atol=1e-5)
    worst = 0.0
    for r in results:
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-3, atol=1e-4, msg=lambda m: f"{k}: {m}")
            worst = max(worst, (r["state"][k].float() - v.float()).abs().max().item())
        # No live-buffer check here: with Inductor on CUDA, the memory of a released gathered
        # parameter is legitimately reused by Inductor for later buffers (seen: 11 small
        # parameters' storages kept as reused activations; memory after forward was lower than
        # with aot_eager). The aot_eager CPU tests check buffer lifetimes exactly.
    print(f"nccl parity: losses {mean[0]:.4f} -> {mean[-1]:.4f} (ref {ref_losses[-1]:.4f}), max |param diff| {worst:.2e}")


def _llama(rank, world, steps):
    import time

    import deepcompile
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    model, opt = deepcompile.initialize(
        model, lambda ps: torch.optim.AdamW(ps, lr=3e-4),
        {"compiler": "inductor", "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}})
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 32000, (4, 256), generator=g).cuda() for _ in range(2)]
    losses, times = [], []
    for s in range(steps):
        x = batches[s % 2]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(out.loss.item())
    return {"losses": losses, "times": times, "params": n_params,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "shard_numel": sum(p.numel() for p in model.parameters())}


def test_llama_100m_trains():
    pytest.importorskip("transformers")
    steps = 20
    results = run_ranks(_llama, 2, steps, backend="nccl", timeout=900)
    r = results[0]
    print(f"llama {r['params']/1e6:.1f}M params, shard {r['shard_numel']/1e6:.1f}M/rank; "
          f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}; first step {r['times'][0]:.1f}s "
          f"(compile), median step {sorted(r['times'][5:])[len(r['times'][5:])//2]*1e3:.1f} ms; "
          f"peak {r['peak_gib']:.2f} GiB")
    print("losses:", " ".join(f"{x:.3f}" for x in r["losses"]))
    assert r["losses"][-1] < r["losses"][0] - 1.0
    assert r["shard_numel"] < r["params"] / 2 + 1e6
