"""offload_optimizer: keep only as much optimizer state on the device as the memory limit allows.

Adaptive, from the profile: the profiled forward/backward peak, minus the optimizer state that
was resident while it was measured, is what the step needs without any state; everything above
``limit_mb - headroom_mb`` comes from the state, and only that much is offloaded (largest state
tensors first). Without a profile all of it is offloaded, which is always safe, and the next
compile after a profiling step trims it.

In the graph the pass places ``dc.reload_optimizer_state`` in each backward graph, in
``reload_steps`` parts: part k (the first k/K of the offloaded bytes) starts at the earliest node
from which the profiled memory plus that much returning state stays under the limit. As backward
frees activations the state comes back progressively, and the copies overlap the rest of backward
instead of stalling the optimizer step. Without a profile one reload goes just before the graph's
end (no overlap, no risk). The offload itself happens after every
optimizer step (:mod:`deepcompile.runtime.optimizer_state`); the optimizer math stays on the device.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx

from deepcompile.params import spec
from deepcompile.passes.registry import PassContext, register_pass
from deepcompile.passes.zero3 import is_view
from deepcompile.runtime import optimizer_state
from deepcompile.runtime.offload import OffloadError, pinned_supported

DC = torch.ops.dc
MIB = 2 ** 20


@dataclass
class OffloadOptimizerParams:
    limit_mb: float = spec(0.0, min=0.0, max=1e9,
                           help="device memory (MiB) the step must fit in; 0 = the device's memory "
                                "(as capped by set_per_process_memory_fraction)")
    headroom_mb: float = spec(1024.0, min=0.0, max=1e9,
                              help="memory (MiB) kept free under the limit for fragmentation and the allocator's slack")
    reload_steps: int = spec(4, min=1, max=64,
                             help="with a profile: bring the state back in this many parts, each as early as the memory allows")


def device_limit_bytes(params: OffloadOptimizerParams, device: torch.device) -> int | None:
    """The limit in bytes; None where no limit is known (CPU with limit_mb 0)."""
    if params.limit_mb > 0:
        return int(params.limit_mb * MIB)
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    frac = 1.0
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get is not None:
        try:
            frac = float(get(device))
        except RuntimeError:  # pragma: no cover
            pass
    return int(total * frac)


def _device() -> torch.device:
    """Where the shards live: CUDA under NCCL, the CPU under gloo (as ``api._device_for``)."""
    import torch.distributed as dist

    if dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_supported(device: torch.device) -> None:
    """Loud about what cannot work: no pinned memory where there is a GPU to save memory on."""
    if device.type == "cuda":
        if not pinned_supported():
            raise OffloadError(
                "offload_optimizer: this machine cannot allocate pinned (page-locked) host memory, "
                "which asynchronous offload needs; remove 'offload_optimizer' from the passes or fix "
                "the host's lockable-memory limit (ulimit -l)")
    else:
        warnings.warn(
            "offload_optimizer: the parameters live in host memory (gloo on the CPU), so offloading "
            "saves no device memory; the state is still moved to separate host buffers and back "
            "(useful to test the path, not to save memory)", stacklevel=3)


def plan_bytes(ctx: PassContext, device: torch.device) -> tuple[int | None, str]:
    """How many bytes of optimizer state to offload, and why (for the record)."""
    mgr = optimizer_state.MANAGER
    limit = device_limit_bytes(ctx.params, device)
    if ctx.profile is None or not ctx.profile.graphs:
        return None, "no profile yet: offload all optimizer state"
    if limit is None:
        return None, "no memory limit known (CPU, limit_mb 0): offload all optimizer state"
    # (the previous plan's own reloads are not part of what the step needs without state)
    peak = max((n.peak_bytes for g in ctx.profile.graphs.values() for n in g.nodes
                if not n.name.startswith("reload_optimizer_state")), default=0)
    base = peak - mgr.resident_bytes()   # the profiled peak without any optimizer state on the device
    total = mgr.total_bytes()
    room = limit - int(ctx.params.headroom_mb * MIB)
    need = max(0, base + total - room)
    why = (f"profiled peak {peak / MIB:.0f} MiB with {mgr.resident_bytes() / MIB:.0f} MiB of state resident; "
           f"state {total / MIB:.0f} MiB; limit {limit / MIB:.0f} MiB - headroom {ctx.params.headroom_mb:g} MiB")
    if base > room:
        warnings.warn(
            f"offload_optimizer: even with all {total / MIB:.0f} MiB of optimizer state offloaded, forward "
            f"and backward peak at {base / MIB:.0f} MiB, above the {room / MIB:.0f} MiB available "
            f"(limit_mb={limit / MIB:.0f} minus headroom_mb={ctx.params.headroom_mb:g}); the step will "
            "likely run out of memory. Lower the micro-batch, add 'offload_activations', or raise limit_mb.",
            stacklevel=3)
    return need, why


def reload_positions(gm: fx.GraphModule, ctx: PassContext, nbytes: int | None, device: torch.device
                     ) -> list[tuple[fx.Node, int]]:
    """(node before which a reload goes, bytes it brings back by then; -1 = all), earliest first.

    Part k of K returns the first k/K of the offloaded bytes at the earliest node from which every
    later node's profiled peak plus those bytes stays under the limit. Without a profile: one
    reload of everything at the end of the graph."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    gp = ctx.profile.get(ctx.graph_id, ctx.kind) if ctx.profile is not None else None
    limit = device_limit_bytes(ctx.params, device)
    if gp is None or limit is None or not nodes:
        return [(out, -1)]
    mgr = optimizer_state.MANAGER
    back = mgr.total_bytes() if nbytes is None else min(nbytes, mgr.total_bytes())
    room = limit - int(ctx.params.headroom_mb * MIB)
    peaks = gp.by_name()
    # suffix maximum of the profiled peaks: what any node from i on needs
    suffix, m = [0] * (len(nodes) + 1), 0
    for i in range(len(nodes) - 1, -1, -1):
        p = peaks.get(nodes[i].name)
        m = max(m, p.peak_bytes if p is not None else 0)
        suffix[i] = m
    parts, k_total = [], ctx.params.reload_steps
    for k in range(1, k_total + 1):
        amount = back * k // k_total
        i = next((i for i in range(len(nodes) + 1) if suffix[i] + amount <= room), len(nodes))
        parts.append((nodes[i] if i < len(nodes) else out, -1 if k == k_total else amount))
    merged: list[tuple[fx.Node, int]] = []
    for node, amount in parts:  # one op per position, carrying the largest amount due there
        if merged and merged[-1][0] is node:
            merged[-1] = (node, amount if amount < 0 or merged[-1][1] < 0 else max(amount, merged[-1][1]))
        else:
            merged.append((node, amount))
    return merged


def anchor_before(gm: fx.GraphModule, pos: fx.Node) -> fx.Node | None:
    """A tensor produced just before ``pos`` to hang the reload on (it orders the op there)."""
    prev = pos.prev
    while prev.op != "root":
        v = prev.meta.get("val")
        if prev.op in ("call_function", "placeholder") and isinstance(v, torch.Tensor) and not is_view(prev):
            return prev
        prev = prev.prev
    return None


@register_pass("offload_optimizer", OffloadOptimizerParams)
def offload_optimizer(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Offload the optimizer state that exceeds the memory limit; reload it during backward."""
    device = _device()
    if ctx.kind == "forward" or ctx.kind == "inference":
        if ctx.graph_id == 0 and ctx.kind == "forward":
            check_supported(device)
        nbytes, why = plan_bytes(ctx, device)
        optimizer_state.MANAGER.plan(nbytes)
        amount = "all" if nbytes is None else f"{nbytes / MIB:.1f} MiB"
        ctx.notes.append(f"optimizer state to offload: {amount} ({why})")
        return gm
    nbytes = optimizer_state.MANAGER.target
    placed = []
    for pos, amount in reload_positions(gm, ctx, nbytes, device):
        anchor = anchor_before(gm, pos)
        if anchor is None:
            continue
        with gm.graph.inserting_before(pos):
            r = gm.graph.call_function(DC.reload_optimizer_state.default, (anchor, amount))
        r.meta["val"] = None
        placed.append((r, amount))
    if not placed:
        ctx.notes.append("no tensor to order the reload on: the optimizer step reloads the state")
        return gm
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    where = ", ".join(f"{'all' if a < 0 else f'{a / MIB:.0f} MiB'} at node {calls.index(r)}" for r, a in placed)
    ctx.notes.append(f"reload of optimizer state: {where} of {len(calls)} "
                     f"({'profile-guided' if ctx.profile is not None else 'end of backward: no profile'})")
    gm.graph.lint()
    gm.recompile()
    return gm
