"""Where a step's time goes, from a Chrome trace written by ``BENCH_TRACE`` (or any
``torch.profiler`` export): per GPU stream, what it runs and how busy it is, an occupancy strip
per stream, the longest host-side waits, and the GPU time per step by kernel kind (attention,
matmul, each collective, the optimizer, casts, Inductor's fused kernels).

    python benchmarks/trace_streams.py /path/dc_offload_rank0.json.gz [--bin-ms 5] [--steps 3]

Streams are labelled by what they mostly run: ``compute`` (kernels), ``nccl`` (collectives),
``d2h`` / ``h2d`` (memcpys). In the strips ``#`` is a bin more than half busy, ``.`` partly busy,
a blank idle. A compute strip with holes while another stream is busy is the picture of
communication or copies that did not overlap. This is how the offload benchmark's stalls were
found (the forward waiting for the whole copy out of the optimizer state).
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import math

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        d = json.load(f)
    return [e for e in d.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def label(events: list[dict]) -> str:
    names = collections.Counter(e["name"] for e in events)
    top = names.most_common(1)[0][0]
    if "DtoH" in top:
        return "d2h"
    if "HtoD" in top:
        return "h2d"
    if "nccl" in top.lower():
        return "nccl"
    return "compute"


def analyse(events: list[dict], bin_ms: float = 5.0) -> dict:
    """Per stream: label, count, busy ms, first/last ms, occupancy per bin (0..1); host waits."""
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    if not gpu:
        return {"streams": {}, "span_ms": 0.0, "waits": []}
    t0 = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    width = bin_ms * 1e3
    nb = max(1, math.ceil((end - t0) / width))
    by_stream: dict = collections.defaultdict(list)
    for e in gpu:
        by_stream[e["tid"]].append(e)
    streams = {}
    for tid, es in by_stream.items():
        occ = [0.0] * nb
        for e in es:
            a, b = e["ts"] - t0, e["ts"] - t0 + e["dur"]
            while a < b:
                j = int(a // width)
                nxt = min(b, (j + 1) * width)
                occ[j] += nxt - a
                a = nxt
        streams[tid] = {"label": label(es), "count": len(es), "busy_ms": sum(e["dur"] for e in es) / 1e3,
                        "first_ms": (min(e["ts"] for e in es) - t0) / 1e3,
                        "last_ms": (max(e["ts"] + e["dur"] for e in es) - t0) / 1e3,
                        "occupancy": [min(1.0, x / width) for x in occ]}
    waits = sorted((e for e in events if e.get("cat") == "cuda_runtime"
                    and ("Synchronize" in e["name"] or "EventSynchronize" in e["name"])),
                   key=lambda e: -e["dur"])[:5]
    return {"streams": streams, "span_ms": (end - t0) / 1e3,
            "waits": [{"name": e["name"], "at_ms": (e["ts"] - t0) / 1e3, "ms": e["dur"] / 1e3} for e in waits]}


# What a GPU kernel is, from its name: the first pattern that matches names the kind.
KINDS = (
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("all-gather", ("allgather",)),
    ("reduce-scatter", ("reducescatter",)),
    ("all-reduce", ("allreduce",)),
    ("matmul", ("nvjet", "gemm", "cutlass", "sm90_xmma", "wgmma")),
    ("optimizer", ("multi_tensor_apply",)),
    ("copy/cast", ("copy_kernel", "memcpy", "memset")),
    ("fused (Inductor)", ("triton_",)),
)


def kinds(events: list[dict], steps: int) -> list[tuple[str, int, float]]:
    """GPU time per kernel kind, per step: (kind, launches per step, ms per step), largest first."""
    out: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") not in GPU_CATS:
            continue
        name = e["name"].lower().replace("_", "")
        kind = next((k for k, pats in KINDS if any(p.replace("_", "") in name for p in pats)), "other")
        out[kind][0] += 1
        out[kind][1] += e["dur"] / 1e3
    return sorted(((k, round(n / steps), ms / steps) for k, (n, ms) in out.items()), key=lambda r: -r[2])


def strip(occupancy: list[float]) -> str:
    return "".join(" " if x < 0.1 else ("." if x < 0.5 else "#") for x in occupancy)


def report(res: dict, bin_ms: float) -> str:
    lines = [f"span {res['span_ms']:.1f} ms, bins of {bin_ms:g} ms"]
    order = sorted(res["streams"].items(), key=lambda kv: ["compute", "nccl", "d2h", "h2d"].index(kv[1]["label"]))
    for tid, s in order:
        lines.append(f"{s['label']:8s} stream {tid}: {s['count']} ops, busy {s['busy_ms']:.1f} ms "
                     f"({s['first_ms']:.1f} to {s['last_ms']:.1f} ms)")
    for tid, s in order:
        lines.append(f"{s['label'][:7]:7s} |{strip(s['occupancy'])}|")
    for w in res["waits"]:
        lines.append(f"host waits in {w['name']} at {w['at_ms']:.1f} ms for {w['ms']:.1f} ms")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--bin-ms", type=float, default=5.0)
    ap.add_argument("--steps", type=int, default=3, help="steps in the trace (BENCH_TRACE records 3): "
                    "the kernel table is per step")
    a = ap.parse_args(argv)
    events = load(a.trace)
    print(report(analyse(events, a.bin_ms), a.bin_ms))
    print(f"\nGPU time per step by kernel kind (all streams; communication overlaps compute):")
    for kind, n, ms in kinds(events, a.steps):
        print(f"  {kind:18s} {ms:8.1f} ms  {n:6d} kernels")


if __name__ == "__main__":
    main()
