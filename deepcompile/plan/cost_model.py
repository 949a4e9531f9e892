"""Predicted costs. For now the communication model only: an alpha-beta line per collective
(latency + bytes / bandwidth), with defaults per backend until a measured profile replaces them.
Under hybrid sharding a second line (``ReplicateLink``) prices the gradient all-reduce across
replicas at the replicate group's own measured link.

The fusion decision compares n separate collectives against one coalesced collective.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommModel:
    alpha_us: float          # fixed cost of one collective
    bytes_per_us: float      # effective allgather bandwidth (bytes of output per microsecond)
    copy_bytes_per_us: float  # device memory copy bandwidth (pack + unpack)

    def allgather_us(self, out_bytes: float) -> float:
        return self.alpha_us + out_bytes / self.bytes_per_us

    def fused_allgather_us(self, out_bytes: list[float], world: int) -> float:
        # a coalesced collective: one launch, each parameter in its own buffer (no copies)
        return self.allgather_us(sum(out_bytes))

    def fusion_saves(self, out_bytes: list[float], world: int) -> bool:
        separate = sum(self.allgather_us(b) for b in out_bytes)
        return self.fused_allgather_us(out_bytes, world) < separate


@dataclass(frozen=True)
class ReplicateLink:
    """The second link of hybrid sharding (config ``mesh.shard``, HSDP): the gradient all-reduce
    across replicas, measured on the replicate group by ``profile.profiler.benchmark_allreduce``.

    ``comm`` is the alpha-beta line of one ``all_reduce`` of a buffer of ``x`` bytes on that group
    (its ``bytes_per_us``: bytes reduced per microsecond, not the gathers' output bytes). The
    runtime reduce-scatters a bucket in the shard group of ``shard_world`` ranks and then
    all-reduces this rank's ``1 / shard_world`` of it across the replicas, as a second pipeline
    stage (csrc/runtime.cpp ``complete_oldest``): the estimate puts it on a stream of its own.
    Across nodes this link is the slow one (the gathers stay on the node's NVLink)."""
    comm: CommModel
    shard_world: int

    def allreduce_us(self, bucket_bytes: float) -> float:
        """The all-reduce after a reduce-scatter of a bucket of ``bucket_bytes`` (full gradients)."""
        return self.comm.allgather_us(bucket_bytes / max(1, self.shard_world))

    def to_dict(self) -> dict:
        return {**self.comm.__dict__, "shard_world": self.shard_world}

    @classmethod
    def from_dict(cls, d: dict) -> "ReplicateLink":
        return cls(CommModel(float(d["alpha_us"]), float(d["bytes_per_us"]), float(d["copy_bytes_per_us"])),
                   int(d["shard_world"]))


DEFAULTS = {
    # NVLink-class GPUs: ~15 us per NCCL launch, ~150 GB/s allgather bus, ~2 TB/s copies
    "nccl": CommModel(alpha_us=15.0, bytes_per_us=150e3, copy_bytes_per_us=2e6),
    # gloo over loopback TCP on CPU: large per-call cost, modest bandwidth
    "gloo": CommModel(alpha_us=150.0, bytes_per_us=1e3, copy_bytes_per_us=5e3),
}


def default_model(backend: str) -> CommModel:
    return DEFAULTS["nccl" if "nccl" in backend else "gloo"]


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
    optimizer_ms = float(getattr(profile, "optimizer_ms", 0.0) or 0.0)
    step_us = sum(per_graph.values()) + optimizer_ms * 1e3
    peak = max((s["allocated_bytes"] for s in samples), default=0)
    return {"step_ms": step_us / 1e3, "peak_bytes": int(peak), "per_graph_ms": {f"{g}/{k}": v / 1e3 for (g, k), v in per_graph.items()},
            "optimizer_ms": optimizer_ms, "events": events, "samples": samples}


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
