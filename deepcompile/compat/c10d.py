"""torch.distributed shims: the rendezvous store, the all-gather's name, FSDP and DTensor checks.
Checked against torch 2.11 (GPU machines) and 2.13 (CI) unless a function says otherwise.
Distributed classes are imported lazily: a torch build without distributed has none."""
from __future__ import annotations

import torch


def default_store():
    """The default process group's c10d (rendezvous) store, or None: the collective sequence check
    (``runtime/seqcheck.py``) posts its per-rank counts there, a channel apart from the model's
    collectives. ``distributed_c10d._get_default_store()`` is private."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``dist.all_gather_single`` where torch has it (2.13's ``all_gather_into_tensor`` warns at
    every call that it is deprecated), else ``all_gather_into_tensor`` (2.11's only name)."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def fsdp_wrapper_kind(m) -> str | None:
    """'FSDP1 (FullyShardedDataParallel)' / 'FSDP2 (fully_shard)' if ``m`` is such a wrapper, which
    ``initialize`` refuses (public classes; ``torch.distributed.fsdp.FSDPModule`` is FSDP2's mixin)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return None
    if isinstance(m, FullyShardedDataParallel):
        return "FSDP1 (FullyShardedDataParallel)"
    fsdp2 = getattr(torch.distributed.fsdp, "FSDPModule", None)
    if fsdp2 is not None and isinstance(m, fsdp2):
        return "FSDP2 (fully_shard)"
    return None


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (public), which ``initialize`` refuses."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)
