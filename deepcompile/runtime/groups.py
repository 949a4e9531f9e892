"""The process groups a job runs over: the default group (created from the launcher's
environment when none exists), the shard and replicate groups of hybrid sharding (config
``mesh.shard``), and the device the group's backend implies. ``deepcompile.initialize`` resolves
them once; the runtime's collectives run on the shard group.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def resolve_group(group, timeout_s: float = 600.0):
    """``group``, else the default process group, created from the launcher's environment
    (torchrun) when none exists yet."""
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    missing = [v for v in LAUNCHER_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(
            "deepcompile.initialize: no torch.distributed process group exists and the launcher "
            f"environment is incomplete (missing {', '.join(missing)}). Launch with torchrun "
            "(torchrun --nproc-per-node=2 train.py), or call torch.distributed.init_process_group(...) "
            "before deepcompile.initialize, or pass group=..."
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    import datetime

    # collective_timeout_s bounds every collective of the group, not only the runtime's waits
    # (NCCL's watchdog aborts on it; gloo fails the collective)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.group.WORLD


def hybrid_groups(group, shard: int | None, timeout_s: float):
    """(shard group, replicate group or None) for ``mesh.shard`` (HSDP). Ranks ``[k*S, (k+1)*S)``
    of ``group`` shard the model (a node, when torchrun numbers ranks node by node); ranks with the
    same position in their shard group replicate each other. Every rank creates every group, in the
    same order, as ``new_group`` requires."""
    import datetime

    world = dist.get_world_size(group)
    if shard is None or shard == world:
        return group, None
    if world % shard:
        raise ValueError(f"deepcompile.initialize: config mesh.shard = {shard} does not divide the world size "
                         f"{world}; use a divisor of {world} (e.g. the GPUs per node) or leave it out")
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    timeout = datetime.timedelta(seconds=timeout_s)
    shard_group = replicate_group = None
    for k in range(world // shard):
        members = ranks[k * shard:(k + 1) * shard]
        g = dist.new_group(members, timeout=timeout)
        if me in members:
            shard_group = g
    for j in range(shard):
        members = ranks[j::shard]
        g = dist.new_group(members, timeout=timeout)
        if me in members:
            replicate_group = g
    return shard_group, replicate_group


def device_for(group) -> torch.device:
    """Where the shards live: the current CUDA device under NCCL, the CPU under gloo."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
