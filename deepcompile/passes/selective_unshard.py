"""selective_unshard: keep the parameters whose gathering costs most per byte gathered.

A kept parameter is gathered once and stays gathered across forward, backward and further
micro-batches until the optimizer changes its shard (the runtime drops the copies at every
optimizer step). Small parameters are the usual choice: a collective's fixed cost dominates
their transfer, so keeping them resident saves the most time per byte of memory.

Runs before or after ``prefetch``: a chosen parameter that prefetch already coalesced into a
group is taken out of it (the default plan runs ``zero3, prefetch, selective_unshard``, and
before, every chosen parameter of the 16-layer Llama sat in a group and nothing was kept).

All kept parameters of a graph come from one ``gather_persistent_many`` at the graph's top: one
coalesced collective and one wait, in the first forward after an optimizer step; every later
graph finds them kept and gathers nothing. Choices depend only on parameter sizes and the
(rank-agreed) communication model, so every rank keeps the same parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from deepcompile.params import spec
from deepcompile.passes.registry import PassContext, register_pass
from deepcompile.passes.zero3 import is_op
from deepcompile.plan.cost_model import default_model

DC = torch.ops.dc


@dataclass
class SelectiveUnshardParams:
    budget_mb: float = spec(64.0, min=0.0, max=1e7, help="memory (MiB) of gathered parameters kept resident")


def choose(ctx: PassContext) -> list[int]:
    """Parameter ids to keep, cheapest memory for the most saved communication time first."""
    import torch.distributed as dist

    comm = ctx.profile.comm if (ctx.profile is not None and ctx.profile.comm is not None) else default_model(
        str(dist.get_backend()) if dist.is_initialized() else "gloo")
    sizes = {}
    for pid, m in ctx.param_meta.items():
        sizes[pid] = m.chunk * ctx.world_size * torch.empty((), dtype=m.gather_dtype).element_size()
    ranked = sorted(sizes, key=lambda p: (-comm.allgather_us(sizes[p]) / max(sizes[p], 1), p))
    budget, kept = ctx.params.budget_mb * 2**20, []
    for pid in ranked:
        if sizes[pid] <= budget:
            kept.append(pid)
            budget -= sizes[pid]
    return sorted(kept)


@register_pass("selective_unshard", SelectiveUnshardParams)
def selective_unshard(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Keep cheap-to-hold, costly-to-gather parameters gathered across micro-batches."""
    import operator

    keep = set(choose(ctx))
    g = gm.graph
    waits: dict[int, list[fx.Node]] = {}   # a parameter used twice (tied weights) has two waits
    shards: dict[int, fx.Node | None] = {}
    for w in list(g.nodes):
        if is_op(w, DC.wait_allgather.default) and int(w.args[1]) in keep:
            pid = int(w.args[1])
            waits.setdefault(pid, []).append(w)
            shards.setdefault(pid, _gather_shard(w))
    kept = [p for p in waits if shards[p] is not None]  # (a shard computed in the graph: left alone)
    if kept:
        for pid in kept:
            for w in waits[pid]:
                _detach(g, w, pid)
        top = next(n for n in g.nodes if n.op not in ("placeholder", "get_attr"))
        with g.inserting_before(top):
            many = g.call_function(DC.gather_persistent_many.default, ([shards[p] for p in kept], kept))
            many.meta["dc_params"] = kept
            many.meta["dc_param"] = kept[0]
            items = []
            for i, pid in enumerate(kept):
                item = g.call_function(operator.getitem, (many, i))
                item.meta.update({k: v for k, v in waits[pid][0].meta.items()
                                  if k in ("val", "nn_module_stack", "stack_trace")})
                item.meta["dc_param"] = pid
                items.append(item)
            vals = [it.meta.get("val") for it in items]
            if all(v is not None for v in vals):
                many.meta["val"] = vals
        for pid, item in zip(kept, items):
            for w in waits[pid]:
                for r in [u for u in w.users if is_op(u, DC.release_param.default)]:
                    g.erase_node(r)
                w.replace_all_uses_with(item)
                g.erase_node(w)
    ctx.notes.append(f"kept gathered: {len(kept)} parameters in this graph ({len(keep)} chosen, "
                     f"budget {ctx.params.budget_mb:g} MiB), in one collective at the top")
    g.lint()
    gm.recompile()
    return gm


def _gather_shard(w: fx.Node) -> fx.Node | None:
    """The shard a wait's parameter is gathered from, if it is a graph input (it is in the
    graphs zero3 produces: the forward's parameters, the backward's saved shards)."""
    issue, pid = w.args[0], int(w.args[1])
    if is_op(issue, DC.allgather_param.default):
        shard = issue.args[0]
    elif is_op(issue, DC.allgather_params.default):
        shard = issue.args[0][[int(p) for p in issue.args[1]].index(pid)]
    else:
        return None
    return shard if isinstance(shard, fx.Node) and shard.op == "placeholder" else None


def _detach(g: fx.Graph, w: fx.Node, pid: int) -> None:
    """Take ``pid`` out of the collective that ``w`` waits on: a single gather is erased, a
    coalesced one loses that parameter (and is erased once empty)."""
    issue = w.args[0]
    w.args = (None, w.args[1])  # drop the edge; w itself is erased by the caller
    if is_op(issue, DC.allgather_params.default):
        shards, pids = list(issue.args[0]), [int(p) for p in issue.args[1]]
        if pid in pids:  # (a second wait on the same group already took it out)
            i = pids.index(pid)
            del shards[i], pids[i]
        if pids:
            issue.args = (shards, pids)
            issue.meta["dc_params"] = pids
            issue.meta["dc_param"] = pids[0]
            return
    if not issue.users:
        g.erase_node(issue)
