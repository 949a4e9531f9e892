"""Predicted step time and peak of a compiled plan (``predict``), and the profiled compute split by
kind of op. Collectives are priced by the link models of ``deepcompile.vocab.links``."""
from __future__ import annotations


def predict(versions, profile=None, fused: bool = False, static: dict | None = None) -> dict:
    """Predicted step time and memory of the latest compiled graphs (a list of GraphVersion or
    record dicts), from a profile where one exists: compute ops take their measured latency,
    collectives the measured alpha-beta time, waits block compute until their collective ends,
    buffers live from allocation (a gather's from its issue) to their last use. The step adds
    the profiling step's measured ``optimizer.step()`` (its graphs' time alone left out a
    quarter of a ZeRO-3 step's AdamW on an H200). ``fused``: the graphs are compiled by
    Inductor, whose fused kernels move only what crosses them (``plan.estimate.fused_us``).
    ``static``: per-graph costs computed once (``plan.estimate.static_costs``; the what-if)."""
    from deepcompile.plan.estimate import estimate_versions

    events, samples = estimate_versions(versions, profile, fused, static)
    step_us = 0.0
    per_graph: dict = {}
    for e in events:
        k = (e["graph_id"], e["kind"])
        per_graph[k] = max(per_graph.get(k, 0.0), e["end_us"])
    optimizer_ms = resident_optimizer_ms(profile)
    step_us = sum(per_graph.values()) + optimizer_ms * 1e3
    peak = max((s["allocated_bytes"] for s in samples), default=0)
    return {"step_ms": step_us / 1e3, "peak_bytes": int(peak), "per_graph_ms": {f"{g}/{k}": v / 1e3 for (g, k), v in per_graph.items()},
            "optimizer_ms": optimizer_ms, "events": events, "samples": samples}


def resident_optimizer_ms(profile) -> float:
    """The profiled ``optimizer.step()`` as a step with its state on the device takes it: where the
    profiled step streamed the state through (``Profile.state_streamed_bytes``), less the copies
    that streaming adds (``estimate.offload_ms``), which a plan that streams adds back itself."""
    from deepcompile.plan.estimate import offload_ms

    ms = float(getattr(profile, "optimizer_ms", 0.0) or 0.0)
    streamed = int(getattr(profile, "state_streamed_bytes", 0) or 0)
    if streamed:
        ms = max(0.0, ms - offload_ms(streamed, 0.0, streamed=True))
    return ms


def profiled_ms_by_class(versions, profile) -> dict:
    """The profile's node latencies summed by kind of op (matmul, attention, communication
    waits, views, other), each node filed by its op in the graph the profile measured. The
    profile runs the graphs unfused, node by node; a compiled step fuses the "other" ops, so
    this split is what a comparison with the measured step needs to see where the time goes."""
    from deepcompile.plan.estimate import op_class, profiled_version

    out = {"matmul": 0.0, "attention": 0.0, "communication": 0.0, "view": 0.0, "other": 0.0}
    if profile is None:
        return out
    by_key: dict = {}  # (graph_id, kind) -> its versions
    for v in versions:
        d = v if isinstance(v, dict) else vars(v)
        if d["kind"] != "dynamo":
            by_key.setdefault((d["graph_id"], d["kind"]), []).append(d)
    for key, gp in profile.graphs.items():
        measured = profiled_version(gp, by_key.get(key, []))
        target = {n["name"]: str(n.get("target", "")) for n in (measured or {"nodes": []})["nodes"]}
        for n in gp.nodes:
            out[op_class(target.get(n.name, ""))] += n.latency_ms
    return {k: round(v, 3) for k, v in out.items()}
