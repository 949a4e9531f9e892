"""Diagnostic: what is still allocated right after ``loss.backward()`` returns (GPU).

The profiled memory timeline of the 953M Llama shows about 2 GiB of "activations" (the
allocator's remainder) alive at the end of the backward, as much as the forward saved. This runs
the default plan for a few steps, then takes ``torch.cuda.memory._snapshot()`` right after a
backward of the final compile and prints the live blocks grouped by their allocation site.

    torchrun --nproc-per-node=2 benchmarks/diag_after_backward.py --layers 4
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zero3  # noqa: E402  (the benchmark's model and process-group setup)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=14)
    a = ap.parse_args()
    args = zero3.parse_args(["--layers", str(a.layers), "--systems", "dc_default"])
    rank, world, dev = zero3.init_dist(args)
    base, _, _ = zero3.build_base_model(args)
    model, opt, ac, _ = zero3.build_dc("dc_default", base, args, dev)
    x = torch.randint(0, 32000, (args.micro_batch, args.seq), device=dev)
    for s in range(a.steps):
        last = s == a.steps - 1
        if last:  # from before the forward: what the forward allocates and the backward leaves
            torch.cuda.synchronize()
            torch.cuda.memory._record_memory_history(max_entries=200000)
        G = 2 ** 30
        torch.cuda.synchronize()
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = model(input_ids=x, labels=x)
        torch.cuda.synchronize()
        a1, p1 = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out.loss.backward()
        torch.cuda.synchronize()
        a2, p2 = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        if rank == 0:
            print(f"step {s}: allocated before {a0 / G:.2f}, after forward {a1 / G:.2f} (peak {p1 / G:.2f}), "
                  f"after backward {a2 / G:.2f} (peak {p2 / G:.2f}) GiB", flush=True)
        if last:
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not last:
            del out
    if rank == 0:
        sites = collections.Counter()
        total = 0
        for seg in snap["segments"]:
            for b in seg["blocks"]:
                if b["state"] != "active_allocated":
                    continue
                total += b["size"]
                frames = b.get("frames") or []
                py = [f for f in frames if f["filename"].endswith(".py")]
                key = " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in py[:4])
                sites[key or "(no python frames)"] += b["size"]
        print(f"live after backward: {total / 2**30:.3f} GiB; allocated {torch.cuda.memory_allocated() / 2**30:.3f}")
        for k, v in sites.most_common(a.top):
            print(f"{v / 2**30:8.3f} GiB  {k}")
        print("output object:", type(out).__name__, {k: type(v).__name__ for k, v in out.items()})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
