#!/usr/bin/env python
"""optimizer.step() in chunk groups (deepcompile.runtime.optim_chunks): peak memory, GPU time and
host time of torch's AdamW over one rank's flat fp32 shards of the benchmark's Llama (953M at 16
layers, sharded over --world ranks), for several chunk sizes; and the planner's predicted step
peak (deepcompile.plan.memory.optimizer_peak, scaled from the whole-group measurement) beside the
measured one. One process, one device, no communication: the optimizer step is local in ZeRO-3.

    python benchmarks/optim_chunks.py --device cuda [--world 2] [--layers 16] \
        [--chunks 0,2048,1024,512,256,128,64] [--steps 20] [--out benchmarks/results/optim_chunks_h100.json]
    python benchmarks/optim_chunks.py --device cpu --hidden 64 --inter 176 --vocab 128   # host cost only

Per chunk size: ``peak_gib`` (the allocator's peak during the steps, CUDA), ``temp_gib`` (peak minus
shards + gradients + state), ``predicted_peak_gib``, ``gpu_ms`` (CUDA events around step()),
``host_ms`` (until step() returns, before any synchronize) and ``chunks`` (groups stepped).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from deepcompile.plan.memory import GIB, MIB, MemoryFacts, optimizer_peak  # noqa: E402
from deepcompile.runtime import optim_chunks as OC  # noqa: E402


def llama_shapes(layers: int, hidden: int, inter: int, vocab: int) -> list[int]:
    """Parameter sizes (elements) of benchmarks/zero3.py's Llama in parameter order (untied
    embeddings, 16 heads = 16 KV heads: q, k, v, o square)."""
    per_layer = [hidden * hidden] * 4 + [inter * hidden] * 3 + [hidden, hidden]
    return [vocab * hidden] + per_layer * layers + [hidden, vocab * hidden]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--world", type=int, default=2, help="ranks the shards are cut for (ceil(numel / world) each)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunks", default="0,2048,1024,512,256,128,64", help="chunk sizes, MiB (0: whole group)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--foreach", choices=("default", "true", "false", "fused"), default="default")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device(a.device)
    sizes = [-(-n // a.world) for n in llama_shapes(a.layers, a.hidden, a.inter, a.vocab)]
    shards = [torch.nn.Parameter(torch.zeros(n, device=dev)) for n in sizes]
    g = torch.Generator(device=dev).manual_seed(0)
    for s in shards:
        s.grad = torch.randn(s.shape, device=dev, generator=g)
    kw = {"default": {}, "true": {"foreach": True}, "false": {"foreach": False}, "fused": {"fused": True}}[a.foreach]
    opt = torch.optim.AdamW(shards, lr=1e-4, **kw)
    ch = OC.OptimizerChunks(opt, 0)
    opt.step()  # the state exists from here
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    nbytes = sum(s.numel() * 4 for s in shards)
    known = 4 * nbytes  # shards + gradients + AdamW's two moments
    rows, facts = [], None
    for mb in [float(x) for x in a.chunks.split(",")]:
        ch.set_chunk_mb(mb)
        for _ in range(2):
            opt.step()
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        gpu, host = [], []
        for _ in range(a.steps):
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            t0 = time.perf_counter()
            opt.step()
            host.append((time.perf_counter() - t0) * 1e3)
            if cuda:
                e1.record()
                e1.synchronize()
                gpu.append(e0.elapsed_time(e1))
        peak = int(torch.cuda.max_memory_allocated()) if cuda else 0
        if facts is None and mb == 0 and peak:
            facts = MemoryFacts(fb_peak=0, optimizer_peak=peak, shard_bytes=nbytes, grad_bytes=nbytes,
                                state_bytes=2 * nbytes, opt_groups=OC.group_sizes(opt), opt_temp_factor=OC.temp_factor(opt))
        row = {"chunk_mb": mb, "chunks": ch.last_chunks, "largest_chunk_mib": round(OC.largest_chunk(OC.group_sizes(opt), int(mb * MIB)) / MIB, 1),
               "host_ms": round(statistics.median(host), 3), "gpu_ms": round(statistics.median(gpu), 3) if gpu else None,
               "peak_gib": round(peak / GIB, 3) if peak else None, "temp_gib": round((peak - known) / GIB, 3) if peak else None,
               "predicted_peak_gib": round(optimizer_peak(facts, mb) / GIB, 3) if facts else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "args": vars(a),
           "params": len(sizes), "shard_gib": round(nbytes / GIB, 3), "temp_factor": OC.temp_factor(opt), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    base = rows[0]
    for r in rows[1:]:
        extra = r["chunks"] - base["chunks"]
        if extra > 0:
            print(f"chunk {r['chunk_mb']:g} MiB: +{(r['host_ms'] - base['host_ms']) / extra:.3f} ms host per extra chunk"
                  + (f", peak {base['peak_gib']} -> {r['peak_gib']} GiB (predicted {r['predicted_peak_gib']})"
                     if r["peak_gib"] else ""))


if __name__ == "__main__":
    main()
