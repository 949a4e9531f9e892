"""The memory a plan must fit in: the device's capacity and free memory, agreed by every rank.

Every rank must plan from the same figures, or ranks compile different collectives and the job
hangs: :func:`agree_memory` takes one all-reduce MIN of every rank's capacity, free memory and
limit (:func:`local_memory` measures this rank's).
"""
from __future__ import annotations

from dataclasses import dataclass

from deepcompile.plan.memory import GIB
from deepcompile.profile.host import resident_bytes

DEFAULT_LIMIT_FRACTION = 0.9


@dataclass
class DeviceMemory:
    """The memory the plan must fit in, identical on every rank (bytes)."""
    capacity: int        # the device's total memory (smallest over ranks)
    available: int       # free memory plus this process's own allocator cache (smallest over ranks)
    limit: int           # what the plan must fit in: min(user limit or 90% of capacity, available)
    source: str          # where the limit came from


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def local_memory(device, device_memory_gib: float | None = None) -> tuple[int, int]:
    """(capacity, available) bytes of this rank's device. CUDA: total memory and free memory
    plus what this process's caching allocator already holds (reusable by the step). CPU (gloo):
    ``device_memory_gib`` if configured, else MemTotal; available: MemAvailable plus this
    process's resident set."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cap = int(device_memory_gib * GIB) if device_memory_gib else int(total)
        return cap, min(cap, int(free) + int(torch.cuda.memory_reserved(device)))
    total = _meminfo("MemTotal") or 0
    cap = int(device_memory_gib * GIB) if device_memory_gib else total
    avail = _meminfo("MemAvailable")
    if avail is None:
        return cap, cap
    return cap, min(cap, avail + resident_bytes())


def agree_memory(local: tuple[int, int], limit_gib: float | None, group=None, device=None) -> DeviceMemory:
    """One all-reduce MIN over every rank's (capacity, available, limit): the plan is decided
    from the same figures everywhere (free memory jitters between ranks; a rank that planned
    from its own would compile other collectives and hang the job)."""
    import torch
    import torch.distributed as dist

    cap, avail = int(local[0]), int(local[1])
    lim = float(limit_gib) * GIB if limit_gib else DEFAULT_LIMIT_FRACTION * cap
    vals = [float(cap), float(avail), float(lim)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        if device is None:
            dev = "cuda" if "nccl" in str(dist.get_backend(group)).lower() else "cpu"
            device = torch.device(dev, torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")
        t = torch.tensor(vals, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        vals = t.cpu().tolist()
    cap, avail, lim = int(vals[0]), int(vals[1]), int(vals[2])
    source = (f"memory_limit_gib {float(limit_gib):g}" if limit_gib
              else f"{DEFAULT_LIMIT_FRACTION:.0%} of the device's {cap / GIB:.1f} GiB")
    if avail < lim:
        source += f", lowered to the {avail / GIB:.2f} GiB free on the fullest rank"
        lim = avail
    return DeviceMemory(capacity=cap, available=avail, limit=lim, source=source)


# optimizers whose state is two tensors the size of each parameter (Adam's moments)
TWO_MOMENTS = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax")


@dataclass
class StepBytes:
    """What the optimizer step holds on the device whatever the plan, per rank (bytes)."""
    kind: str          # the optimizer's torch class (Adam family), whose state is two moments per parameter
    shard: int         # this rank's parameter shards (1/world of each parameter)
    trainable: int     # their trainable part: the gradients, and half of the state
    largest: int       # the largest trainable shard: the state one streamed chunk holds at least

    @property
    def resident_step(self) -> int:
        """Shards + gradients + all of the state: the step's bytes with the state on the device."""
        return self.shard + 3 * self.trainable


def step_bytes(model, world: int, make_optimizer) -> StepBytes | None:
    """:class:`StepBytes` of ``model`` sharded over ``world`` ranks with ``make_optimizer``'s
    optimizer (its kind from a one-element probe); None for an optimizer whose state is not the
    Adam family's two moments (nothing is known of its size). Same numbers on every rank."""
    import torch

    from deepcompile.runtime.optim_chunks import torch_kind

    probe = make_optimizer([torch.nn.Parameter(torch.zeros(1))])
    kind = torch_kind(probe, TWO_MOMENTS)   # a user's subclass of AdamW keeps AdamW's state
    if kind is None:
        return None
    seen, shard, trainable, largest = set(), 0, 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        b = -(-p.numel() // world) * p.element_size()
        shard += b
        if p.requires_grad:
            trainable += b
            largest = max(largest, b)
    return StepBytes(kind, shard, trainable, largest)


def warmup_streams(limit_gib: float | None, sb: StepBytes | None, streamable: bool) -> bool:
    """Whether the steps before the plan must stream the optimizer state through the step
    (``runtime.optimizer_state``, ``plan(None, streamed=True)``): the state held on the device
    beside the shards and gradients would pass ``memory_limit_gib``. The plan comes after the
    profiling step, and Adam creates all of its state in the first step: held on the device, the
    8B Llama's on 2 ranks under a 40 GiB limit takes those steps to 67 GiB."""
    return bool(limit_gib) and sb is not None and streamable and sb.resident_step > int(limit_gib * GIB)


def check_floor(limit_gib: float | None, sb: StepBytes | None, world: int, streamable: bool = True) -> None:
    """Refuse a ``memory_limit_gib`` under what the optimizer step needs on the device whatever the
    plan (``sb``, :func:`step_bytes`): this rank's parameter shards, their gradients and, for
    the Adam family, its two moments per trainable shard that the step reads on the device: all of
    them, or with ``streamable`` (the step can stream the state through in chunks,
    runtime.optimizer_state) those of the largest parameter, which one chunk holds whatever the
    chunk size. Checked in ``initialize`` before the model is touched. Same numbers on every rank
    (equal shards, the config's limit): every rank raises alike."""
    if not limit_gib or sb is None:
        return
    from deepcompile.plan.pricing import PlanError
    from deepcompile.vocab.memory import fmt_bytes

    shard, trainable, kind = sb.shard, sb.trainable, sb.kind
    state = 2 * (sb.largest if streamable else trainable)
    floor = shard + trainable + state
    limit = int(limit_gib * GIB)
    if floor > limit:
        raise PlanError(
            f"deepcompile: memory_limit_gib {limit_gib:g} is below what the optimizer step needs on the device "
            f"whatever the plan: {fmt_bytes(shard)} of parameter shards, {fmt_bytes(trainable)} of gradients and "
            f"{fmt_bytes(state)} of {kind} state per rank"
            + (" (the largest parameter's: the step can stream the rest through)" if streamable else "")
            + f" ({fmt_bytes(floor)} in all, "
            f"{(floor - limit) / GIB:.2f} GiB missing). To fit: raise memory_limit_gib or spread the model over "
            f"more ranks (each holds 1/{world} of shards, gradients and state now)"
            + ("" if streamable else "; optimizer_chunk_mb 'auto' (or a size) lets the step stream the state from "
                                     "the host, leaving only the largest parameter's on the device") + ".")
