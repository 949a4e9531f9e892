"""torch.distributed shims: the rendezvous store, the all-gather's name, FSDP and DTensor checks
(torch 2.11 on the GPU machines, 2.13 here; each function names what it relies on)."""
from __future__ import annotations

import torch


def default_store():
    """The c10d store of the default process group (the rendezvous store), or None.

    The collective sequence check (``runtime/seqcheck.py``) posts one count per rank per step
    there: a channel of its own, so it cannot be matched against the model's collectives.
    ``torch.distributed.distributed_c10d._get_default_store`` is private; it exists, with this
    name and no arguments, in 2.11 and 2.13 (checked), and has since 1.x.
    """
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``dist.all_gather_single`` where torch has it (2.13: ``all_gather_into_tensor`` warns that it
    is deprecated at every call), ``all_gather_into_tensor`` before (2.11 has only that name)."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def fsdp_wrapper_kind(m) -> str | None:
    """'FSDP1 (FullyShardedDataParallel)' / 'FSDP2 (fully_shard)' if ``m`` is such a wrapper.

    Public classes in 2.11 and 2.13 (``torch.distributed.fsdp.FSDPModule`` is FSDP2's mixin);
    looked up lazily since a torch build without distributed has neither.
    """
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
    """Whether ``t`` is a DTensor (``torch.distributed.tensor.DTensor``, public in 2.11 and 2.13),
    looked up lazily since a torch build without distributed has none."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)
