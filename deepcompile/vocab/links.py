"""The link models collectives are priced with: an alpha-beta line per collective (latency +
bytes / bandwidth), with defaults per backend until a measured profile replaces them, and the
second link of hybrid sharding. The profiler fits them, the passes and the planner price
collectives with them, the record stores them. Also the host link the offload passes copy over."""
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
    across replicas, measured on the replicate group by ``profile.comm_bench.benchmark_allreduce``.

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


# pinned host <-> device, both ranks of a host copying at once, both directions at once (2 H200s:
# 37.9 GB/s each; benchmarks/results/copy_bw_h200_2gpu.json)
HOST_BYTES_PER_US = 38e3
# ... one direction at a time (55.2 GB/s each, same file): activation offload copies out in the
# forward and back in the backward
HOST_ONE_WAY_BYTES_PER_US = 55e3
