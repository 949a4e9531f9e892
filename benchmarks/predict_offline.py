#!/usr/bin/env python
"""The cost model, re-run offline on a deepcompile system's graphs and profile, next to what the
GPU measured: the step time (a benchmark's result JSON) and, where a trace exists, the GPU's own
busy time per kind of kernel (``BENCH_TRACE``).

    BENCH_GRAPHS=DIR torchrun ... benchmarks/zero3.py --systems dc_default   # a run record in DIR/dc_default
    python benchmarks/predict_offline.py benchmarks/results/zero3_h200_2gpu_dc_default_record \
        --result benchmarks/results/zero3_h200_2gpu_graphs.json \
        --trace benchmarks/results/zero3_h200_2gpu_dc_default_trace_rank0.json.gz --trace-steps 3

Needs no GPU: the prediction reads only the recorded graphs and the agreed profile. A step
that is longer than the GPU's busy time is host-bound (the GPU waits for kernel launches), which
a model of the GPU's timeline does not see.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from deepcompile.plan.cost_model import predict  # noqa: E402
from deepcompile.profile.agree import drop_stalls  # noqa: E402
from deepcompile.profile.profiler import Profile  # noqa: E402
from deepcompile.plan.estimate import comm_kind, op_class  # noqa: E402
from deepcompile.record.reader import read_run  # noqa: E402


def kernel_class(name: str) -> str:
    """A CUDA kernel's kind, by name (attention first: cuDNN's SDPA kernels also say sm90)."""
    low = name.lower()
    if "nccl" in low:
        return "communication"
    if any(k in low for k in ("flash", "fmha", "sdpa", "attention", "compute_dot_do_o", "convert_dq")):
        return "attention"
    if any(k in low for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90")):
        return "matmul"
    if "multi_tensor" in low or "foreach" in low:
        return "optimizer"
    return "other"  # Inductor's fused kernels, copies, casts, memsets


def _gpu_ops(path: str):
    """The trace's GPU operations (kernels, copies, memsets) with their kind (:func:`kernel_class`)."""
    from benchmarks.trace_streams import load

    for e in load(path):
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            yield kernel_class(e["name"]), e


def traced_ms(path: str, steps: int) -> dict:
    out: collections.Counter = collections.Counter()
    for kind, e in _gpu_ops(path):
        out[kind] += e["dur"] / 1e3 / steps
    busy = sum(v for k, v in out.items() if k != "communication")
    return {**{k: round(v, 2) for k, v in out.items()}, "busy_without_communication": round(busy, 2)}


def top_other_kernels(path: str, steps: int, n: int) -> list[dict]:
    """The ``n`` kernels of kind "other" (Inductor's fused kernels, copies, casts) with the most
    GPU time per step: what the fused cost model (``plan.estimate.fused_us``) is compared against
    when its "other" class is off."""
    ms: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for kind, e in _gpu_ops(path):
        if kind == "other":
            ms[e["name"]] += e["dur"] / 1e3 / steps
            count[e["name"]] += 1
    return [{"kernel": k[:120], "ms": round(v, 3), "launches": count[k] / steps} for k, v in ms.most_common(n)]


def predicted_by_class(p: dict, versions: list[dict]) -> dict:
    target = {}
    for v in versions:
        target.update({(v["graph_id"], v["kind"], n["name"]): n for n in v["nodes"]})
    out: collections.Counter = collections.Counter()
    for e in p["events"]:
        if e["stream"] != "compute":
            continue
        n = target.get((e["graph_id"], e["kind"], e["node"]), {})
        c = "communication" if comm_kind(n) else op_class(n.get("target", ""))
        out[c] += (e["end_us"] - e["start_us"]) / 1e3
    out["optimizer"] = p["optimizer_ms"]
    # what the compute stream's kernels leave of the predicted step: waiting for the host to
    # launch them (the cost model's host floor on GPU profiles) and for collectives it did not
    # file under a compute-stream event
    idle = p["step_ms"] - sum(out.values())
    if idle > 0.005 * p["step_ms"]:
        out["idle"] = idle
    return {k: round(v, 2) for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", help="a run record with a profile (BENCH_GRAPHS writes DIR/<system>)")
    ap.add_argument("--result", help="the benchmark JSON of the same run (the measured step)")
    ap.add_argument("--system", default="dc_default")
    ap.add_argument("--trace", help="a BENCH_TRACE Chrome trace of the same code (rank 0)")
    ap.add_argument("--trace-steps", type=int, default=3, help="steps the trace holds")
    ap.add_argument("--top", type=int, default=0, help="with --trace: list the N 'other' kernels with the most GPU time")
    a = ap.parse_args(argv)
    rec = read_run(a.record)
    if not rec.profile:
        print(f"{a.record}: no profile in this record (the system ran no profiling step)", file=sys.stderr)
        return 2
    prof = Profile.from_records(rec.profile)
    drop_stalls(prof)  # records made by a profiler that kept stalls still carry them
    versions = [vars(g) for g in rec.graphs]
    out = {}
    for fused in (True, False):
        p = predict(versions, prof, fused=fused)
        out["fused" if fused else "unfused"] = {"step_ms": round(p["step_ms"], 2), "per_graph_ms": p["per_graph_ms"],
                                                "by_class_ms": predicted_by_class(p, versions)}
    if a.result:
        with open(a.result) as f:
            e = json.load(f)["systems"][a.system]
        out["measured_step_ms"] = round(e["median_step_s"] * 1e3, 2)
        out["error_fused"] = round(out["fused"]["step_ms"] / out["measured_step_ms"] - 1, 3)
    if a.trace:
        out["traced_gpu_ms_per_step"] = traced_ms(a.trace, a.trace_steps)
        if a.top:
            out["top_other_kernels"] = top_other_kernels(a.trace, a.trace_steps, a.top)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
