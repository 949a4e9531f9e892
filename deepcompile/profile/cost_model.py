"""Predicted costs. For now the communication model only: an alpha-beta line per collective
(latency + bytes / bandwidth), with defaults per backend until a measured profile replaces them.

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


DEFAULTS = {
    # NVLink-class GPUs: ~15 us per NCCL launch, ~150 GB/s allgather bus, ~2 TB/s copies
    "nccl": CommModel(alpha_us=15.0, bytes_per_us=150e3, copy_bytes_per_us=2e6),
    # gloo over loopback TCP on CPU: large per-call cost, modest bandwidth
    "gloo": CommModel(alpha_us=150.0, bytes_per_us=1e3, copy_bytes_per_us=5e3),
}


def default_model(backend: str) -> CommModel:
    return DEFAULTS["nccl" if "nccl" in backend else "gloo"]
