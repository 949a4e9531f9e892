"""Profile deepcompile ZeRO-3 steps on GPUs: where the step time goes and how much of the
communication overlaps compute (measured from the CUDA kernel trace, per stream).

torchrun --nproc-per-node=2 benchmarks/profile_step.py --passes zero3,prefetch [--layers 16]
Writes a gzipped chrome trace and a JSON summary (device named) to --out-dir.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


from deepcompile.profile.trace import intersection_length as overlap  # noqa: E402
from deepcompile.profile.trace import union as intervals_union  # noqa: E402


def analyse(trace: dict) -> dict:
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    comm = [e for e in kernels if "nccl" in e["name"].lower()]
    comp = [e for e in kernels if "nccl" not in e["name"].lower()]
    cu = intervals_union([(e["ts"], e["ts"] + e["dur"]) for e in comm])
    pu = intervals_union([(e["ts"], e["ts"] + e["dur"]) for e in comp])
    comm_t = sum(e - s for s, e in cu)
    comp_t = sum(e - s for s, e in pu)
    ov = overlap(cu, pu)
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) if kernels else 0
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e["name"][:80]] = by_name.get(e["name"][:80], 0.0) + e["dur"]
    streams = sorted({(e.get("tid"), "nccl" if "nccl" in e["name"].lower() else "compute") for e in kernels}, key=str)
    return {
        "kernel_span_us": span, "compute_busy_us": comp_t, "comm_busy_us": comm_t,
        "comm_overlapped_us": ov, "overlap_fraction": ov / comm_t if comm_t else None,
        "exposed_comm_us": comm_t - ov, "idle_us": span - len(intervals_union([(s, e) for s, e in cu + pu])) * 0 - sum(e - s for s, e in intervals_union(cu + pu)),
        "streams": [list(map(str, s)) for s in streams],
        "top_kernels_us": sorted(by_name.items(), key=lambda kv: -kv[1])[:20],
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--passes", default="zero3,prefetch")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out-dir", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--budget-mb", type=float, default=None)
    a = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank()
    import deepcompile
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                      num_key_value_heads=16, num_hidden_layers=a.layers, max_position_embeddings=1024,
                      tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    passes = []
    for name in a.passes.split(","):
        if name == "prefetch" and a.budget_mb is not None:
            passes.append({"name": "prefetch", "params": {"budget_mb": a.budget_mb}})
        else:
            passes.append(name)
    dc_cfg = {"compiler": "inductor", "passes": passes,
              "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}}
    model, opt = deepcompile.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), dc_cfg)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 32000, (2, 1024), generator=g).cuda()

    def step():
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad()

    times = []
    for _ in range(a.warmup):
        torch.cuda.synchronize(); t0 = time.perf_counter(); step(); torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    timed = []
    for _ in range(6):
        torch.cuda.synchronize(); t0 = time.perf_counter(); step(); torch.cuda.synchronize()
        timed.append(time.perf_counter() - t0)
    if rank == 0:
        path = os.path.join(a.out_dir, f"trace_{a.passes.replace(',', '+')}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        res = analyse(trace)
        res.update(device=torch.cuda.get_device_name(), world=dist.get_world_size(), torch=torch.__version__,
                   passes=a.passes, layers=a.layers, profiled_steps=a.steps,
                   median_step_ms=sorted(timed)[len(timed) // 2] * 1e3, warmup_ms=[t * 1e3 for t in times],
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30, runtime_stats=dict(deepcompile.runtime.ops.C.stats()))
        with gzip.open(path + ".gz", "wt") as f:
            json.dump(trace, f)
        os.remove(path)
        with open(os.path.join(a.out_dir, f"profile_{a.passes.replace(',', '+')}.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(f"passes={a.passes} median step {res['median_step_ms']:.1f} ms; per profiled step: compute busy "
              f"{res['compute_busy_us'] / a.steps / 1e3:.1f} ms, comm busy {res['comm_busy_us'] / a.steps / 1e3:.1f} ms, "
              f"overlap {100 * (res['overlap_fraction'] or 0):.0f}%, exposed comm {res['exposed_comm_us'] / a.steps / 1e3:.1f} ms, "
              f"idle {res['idle_us'] / a.steps / 1e3:.1f} ms, peak {res['peak_gib']:.2f} GiB")
        for name, us in res["top_kernels_us"][:12]:
            print(f"   {us / a.steps / 1e3:7.2f} ms  {name}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
