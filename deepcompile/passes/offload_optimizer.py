"""offload_optimizer: keep only as much optimizer state on the device as the memory limit allows.

How much: the planner's amount (``offload_mb``), from its memory model of the whole plan. Used
alone, the pass sizes it from the profile: the profiled forward/backward peak, minus the
optimizer state that was resident while it was measured, is what the step needs without any
state; everything above ``limit_mb - headroom_mb`` comes from the state, and only that much is
offloaded (largest state tensors first). Without a profile all of it is offloaded, which is
always safe, and the next compile after a profiling step trims it. The profile measured the
graph as it was before the plan, so its peak is wrong for a plan that recomputes or offloads
activations: that is why a planned pass takes the planner's amount.

In the graph the pass places ``dc.reload_optimizer_state`` at ``reload_points`` places spread
over each backward graph. Each carries, from the profile, how much memory the rest of backward
will still need above what is allocated at that point; at run time the op reads the allocator's
counter (exact at launch: the caching allocator is stream-ordered) and brings back as much state
as fits under the limit beside that reserve. The decision uses the memory really allocated, not
the profiled amount: the profile runs the unfused graph, whose peak was 0.6 GiB above the
Inductor graph's on the 2-GPU offload benchmark, and a plan fixed at compile time from it brought
the state back only at the very end of backward. As backward frees activations the state
returns progressively and the copies overlap the rest of backward. With a profile the forward
gets the mirror image, ``dc.release_optimizer_state`` points: the copies out start after the
step, but each device copy is freed only when the rest of the step needs its memory (and after
its own copy), so the forward does not wait for the whole copy out, and state never freed
needs no copy back. Without a profile one reload
goes just before the graph's end (no overlap, no risk). The offload itself happens after every
optimizer step (:mod:`deepcompile.runtime.optimizer_state`); the optimizer math stays on the device.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx

from deepcompile.compat import fx as fx_compat
from deepcompile.params import spec
from deepcompile.passes.alias import is_view
from deepcompile.passes.registry import OFFLINE_MEMORY, PassContext, register_pass
from deepcompile.runtime.offload import OffloadError, pinned_supported
from deepcompile.vocab.memory import fmt_bytes

DC = torch.ops.dc
NAME = "offload_optimizer"
MIB = 2 ** 20


@dataclass
class OffloadOptimizerParams:
    limit_mb: float = spec(0.0, min=0.0, max=1e9,
                           help="device memory (MiB) the step must fit in; 0 = the device's memory "
                                "(as capped by set_per_process_memory_fraction)")
    headroom_mb: float = spec(1024.0, min=0.0, max=1e9,
                              help="memory (MiB) kept free under the limit for fragmentation and the allocator's slack")
    offload_mb: float = spec(0.0, min=0.0, max=1e9,
                             help="optimizer state (MiB) to keep on the host between steps, as the planner sized it "
                                  "from its memory model (what the plan keeps gathered, prefetches, recomputes and "
                                  "offloads counted); 0: sized here from the profiled peak, which knows none of "
                                  "that; set by the planner")
    final_reload: str = spec("all", choices=("all", "fit"),
                             help="the reload at the end of each backward: 'all' brings every offloaded tensor back "
                                  "there (overlapped, but the end of backward holds the gradients: the profiled peak "
                                  "returns); 'fit' only what fits under limit - headroom, the optimizer step's pre-hook "
                                  "brings the rest once backward has freed its memory (exposed copies, within the limit)")
    step: str = spec("resident", choices=("resident", "streamed"),
                     help="the optimizer step: 'resident' brings the offloaded state back before it and offloads "
                          "after it; 'streamed' keeps all of it on the host and brings it back one param group "
                          "(optimizer_chunk_mb chunk) at a time inside the step, each group's copies beside the "
                          "others' kernels, so the step holds shards, gradients and ~3 groups of state instead "
                          "of all of it (for state larger than the room beside shards and gradients); set by "
                          "the planner")
    reload_points: int = spec(16, min=1, max=256,
                              help="with a profile: places in each backward graph where the state that fits in the "
                                   "free memory starts coming back")


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


def manager(ctx: PassContext):
    """The optimizer-state offload this pass plans: the context's runtime state's."""
    if getattr(ctx, "runtime", None) is None:
        raise RuntimeError("offload_optimizer plans the runtime's optimizer-state offload: it runs only where "
                           "the pass context carries the runtime state (a model of deepcompile.initialize)")
    return ctx.runtime.optimizer_state


def plan_bytes(ctx: PassContext, device: torch.device) -> tuple[int | None, str]:
    """How many bytes of optimizer state to offload, and why (for the record)."""
    mgr = manager(ctx)
    limit = device_limit_bytes(ctx.params, device)
    if ctx.params.step == "streamed":
        return None, "streamed optimizer step: all state on the host, each param group's back for its own step"
    if ctx.profile is None or not ctx.profile.graphs:
        return None, "no profile yet: offload all optimizer state"
    if limit is None:
        return None, "no memory limit known (CPU, limit_mb 0): offload all optimizer state"
    total = mgr.total_bytes()
    if ctx.params.offload_mb > 0:
        # the planner's amount: the profile measured the graph before the plan rewrote it
        # (recomputed blocks, offloaded activations), so only the planner knows this plan's peak.
        # Not capped by the state there is now: under gradient accumulation the plan compiles
        # before the first optimizer step creates it (choose() takes at most all of it)
        return int(ctx.params.offload_mb * MIB), "the planner's amount, from its memory model of the whole plan"
    peak = _profiled_peak(ctx.profile)
    # the profiled peak without any optimizer state on the device
    base = peak - mgr.resident_bytes()
    room = limit - int(ctx.params.headroom_mb * MIB)
    need = max(0, base + total - room)
    why = (f"profiled peak {peak / MIB:.0f} MiB with {mgr.resident_bytes() / MIB:.0f} MiB of state resident; "
           f"state {total / MIB:.0f} MiB; limit {limit / MIB:.0f} MiB - headroom {ctx.params.headroom_mb:g} MiB")
    if base > room:
        warnings.warn(
            f"offload_optimizer: even with all {total / MIB:.0f} MiB of optimizer state offloaded, forward "
            f"and backward peak at {base / MIB:.0f} MiB, above the {room / MIB:.0f} MiB available "
            f"(limit_mb={limit / MIB:.0f} minus headroom_mb={ctx.params.headroom_mb:g}); the step will "
            "likely run out of memory. Lower the micro-batch, add 'offload_activations' or "
            "'recompute_activations', or raise limit_mb.",
            stacklevel=3)
    return need, why


def reload_positions(gm: fx.GraphModule, ctx: PassContext, device: torch.device) -> list[tuple[fx.Node, int]]:
    """(node before which a reload goes, bytes the rest of backward still needs above what is
    allocated there; -1 = bring everything back), earliest first.

    With a profile: ``reload_points`` places spread evenly over the graph's nodes, each with its
    reserve (the profiled peak of every later node minus the memory allocated before it), then
    one that brings back the rest at the end. Without a profile: one reload of everything at the
    end of the graph."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    gp = ctx.profile.get(ctx.graph_id, ctx.kind) if ctx.profile is not None else None
    if gp is None or device_limit_bytes(ctx.params, device) is None or not nodes:
        # nothing known of the room: a streamed step brings the state back itself, group by group
        return [] if ctx.params.step == "streamed" else [(out, -1)]
    k = min(ctx.params.reload_points, len(nodes))
    parts = _reserves(nodes, gp.by_name(), [j * len(nodes) // k for j in range(k)], away=recomputed_away(nodes))
    # a streamed step brings back what backward could not: the end of backward takes only what fits
    everything = ctx.params.final_reload == "all" and ctx.params.step != "streamed"
    parts.append((out, -1 if everything else 0))
    return parts


def release_positions(gm: fx.GraphModule, ctx: PassContext, device: torch.device) -> list[tuple[fx.Node, int]]:
    """(node before which a release goes, bytes the rest of the step still needs above what is
    allocated there), for a forward graph with a profile and a known limit; [] otherwise (the
    state is then freed as soon as its copy starts, the safe way). The rest of the step includes the
    backward: the highest profiled peak of any backward graph bounds every forward point."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    gp = ctx.profile.get(ctx.graph_id, ctx.kind) if ctx.profile is not None else None
    if gp is None or device_limit_bytes(ctx.params, device) is None or len(nodes) < 2:
        return []
    k = min(ctx.params.reload_points, len(nodes) - 1)
    return _reserves(nodes, gp.by_name(), [1 + j * (len(nodes) - 1) // k for j in range(k)],
                     later=_profiled_peak(ctx.profile, "backward"))


def _profiled_peak(profile, kind: str | None = None) -> int:
    """The highest profiled peak over every graph (of ``kind``), the plan's own reloads left out
    (they are not what the step needs without state)."""
    return max((n.peak_bytes for (_, k), g in profile.graphs.items() if kind is None or k == kind
                for n in g.nodes if not n.name.startswith("reload_optimizer_state")), default=0)


def recomputed_away(nodes: list[fx.Node]) -> list[int]:
    """Per node of ``nodes`` (a backward graph's calls, in order): the bytes of saved activations
    that ``recompute_activations`` dropped in forward and this graph has not computed again yet.

    The profile measured the graph before that rewrite: there those values were backward inputs,
    allocated from its start to their last reader. Under the plan they are absent until their
    recomputation (the copies marked ``recompute_of`` their value; the placeholder is left
    unread), so up to there the device holds that much less than the profile says, and the
    backward's growth from a point to its later peak is that much more. Reserves from the profile
    alone bring the state back too early: with 7 of 8 blocks recomputed on 1 H200 (8B shape, 16k
    tokens, 50 GiB) the step then peaks 3 GiB over the room."""
    first: dict[str, int] = {}
    for i, n in enumerate(nodes):
        src = n.meta.get("recompute_of")
        if src is not None and src not in first:
            first[src] = i
    back = [0] * len(nodes)
    if first:
        for p in nodes[0].graph.nodes:
            if p.op == "placeholder" and not p.users and p.name in first:
                v = p.meta.get("val")
                back[first[p.name]] += fx_compat.tensor_nbytes(v) if isinstance(v, torch.Tensor) else 0
    away, acc = [], sum(back)
    for b in back:
        acc -= b
        away.append(acc)
    return away


def _reserves(nodes: list[fx.Node], prof: dict, positions: list[int], later: int = 0,
              away: list[int] | None = None) -> list[tuple[fx.Node, int]]:
    """(node i, reserve) for each position i whose previous node was profiled (where nothing is
    known of the memory allocated there, there is no place to judge from): the reserve is the
    highest profiled peak from node i on (or ``later``, a peak still to come after this graph)
    minus what node i - 1 left allocated, each less the bytes ``away`` at its node
    (:func:`recomputed_away`)."""
    away = away or [0] * len(nodes)
    suffix, m = [0] * len(nodes), later
    for i in range(len(nodes) - 1, -1, -1):
        p = prof.get(nodes[i].name)
        m = max(m, p.peak_bytes - away[i] if p is not None else 0)
        suffix[i] = m
    out = []
    for i in positions:
        before = prof.get(nodes[i - 1].name) if i > 0 else None
        if before is not None:
            out.append((nodes[i], max(0, suffix[i] - (before.mem_after_bytes - away[i - 1]))))
    return out


def anchor_before(gm: fx.GraphModule, pos: fx.Node) -> fx.Node | None:
    """A tensor produced just before ``pos`` to hang the reload on (it orders the op there)."""
    prev = pos.prev
    while prev.op != "root":
        v = prev.meta.get("val")
        if prev.op in ("call_function", "placeholder") and isinstance(v, torch.Tensor) and not is_view(prev):
            return prev
        prev = prev.prev
    return None


def _place(gm: fx.GraphModule, positions: list[tuple[fx.Node, int]], op) -> list[tuple[fx.Node, int]]:
    placed = []
    for pos, reserve in positions:
        anchor = anchor_before(gm, pos)
        if anchor is None:
            continue
        with gm.graph.inserting_before(pos):
            r = gm.graph.call_function(op, (anchor, reserve))
        r.meta["val"] = None
        placed.append((r, reserve))
    return placed


@register_pass(NAME, OffloadOptimizerParams,
               graph_only=False,                # it plans the runtime's offload (ctx.runtime.optimizer_state)
               offline=OFFLINE_MEMORY,          # its run-time decisions read the allocator, which a record lacks
               planned=("limit_mb", "offload_mb", "final_reload", "step"),
               planner_adds=True,               # added by the planner only when nothing fits without it
               plan_cacheable=False)            # sized from the optimizer state, which step 0 does not have yet
def offload_optimizer(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Offload the optimizer state that exceeds the memory limit; reload it during backward."""
    device = _device()
    if ctx.kind == "forward" or ctx.kind == "inference":
        if ctx.graph_id == 0 and ctx.kind == "forward":
            check_supported(device)
        nbytes, why = plan_bytes(ctx, device)
        mgr = manager(ctx)
        streamed = ctx.params.step == "streamed"
        mgr.plan(nbytes, streamed=streamed)
        amount = "all" if nbytes is None else f"{nbytes / MIB:.1f} MiB"
        ctx.notes.append(f"optimizer state to offload: {amount} ({why})")
        # a streamed step frees each group's device copy itself: nothing is left for the forward to free
        if ctx.kind == "forward" and nbytes != 0 and not streamed:
            placed = _place(gm, release_positions(gm, ctx, device), DC.release_optimizer_state.default)
            if placed:
                mgr.room = device_limit_bytes(ctx.params, device) - int(ctx.params.headroom_mb * MIB)
                mgr.defer = True
                ctx.notes.append(f"device copies freed as the step needs the memory, at {len(placed)} points "
                                 "of forward (each after its own copy out)")
                gm.graph.lint()
                gm.recompile()
        return gm
    limit = device_limit_bytes(ctx.params, device)
    if limit is not None:
        manager(ctx).room = limit - int(ctx.params.headroom_mb * MIB)
    placed = _place(gm, reload_positions(gm, ctx, device), DC.reload_optimizer_state.default)
    if not placed:
        ctx.notes.append("no tensor to order the reload on: the optimizer step reloads the state")
        return gm
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    where = ", ".join(f"node {calls.index(r)} ({'all' if a < 0 else f'reserve {a / MIB:.0f} MiB'})" for r, a in placed)
    ctx.notes.append(f"reload of optimizer state, as much as fits in the free memory at: {where} of {len(calls)} "
                     f"({'profile-guided' if ctx.profile is not None else 'end of backward: no profile'})")
    away = max(recomputed_away(calls), default=0)
    if away and ctx.profile is not None:
        ctx.notes.append(f"the reserves count {fmt_bytes(away)} of recomputed activations, absent from the "
                         "device until their recomputation (the profile held them from the start of backward)")
    gm.graph.lint()
    gm.recompile()
    return gm
