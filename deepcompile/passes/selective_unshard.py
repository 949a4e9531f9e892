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
        pid = _waited_pid(w)
        if pid is not None and pid in keep:
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
        for n in reversed(list(g.nodes)):  # a group's wait and collective once nothing is left of them
            if not n.users and (is_op(n, DC.wait_allgather_many.default) or is_op(n, DC.allgather_params.default)):
                g.erase_node(n)
    ctx.notes.append(f"kept gathered: {len(kept)} parameters in this graph ({len(keep)} chosen, "
                     f"budget {ctx.params.budget_mb:g} MiB), in one collective at the top")
    g.lint()
    gm.recompile()
    return gm


def _is_member(w: fx.Node) -> bool:
    """``w`` is one parameter's value out of a group's ``wait_allgather_many`` (prefetch)."""
    import operator

    return (w.op == "call_function" and w.target is operator.getitem and isinstance(w.args[0], fx.Node)
            and is_op(w.args[0], DC.wait_allgather_many.default))


def _waited_pid(w: fx.Node) -> int | None:
    """The parameter whose gathered value ``w`` is: a ``wait_allgather`` or a member of a
    ``wait_allgather_many``; None for any other node."""
    if is_op(w, DC.wait_allgather.default):
        return int(w.args[1])
    if _is_member(w):
        return int(w.args[0].args[1][w.args[1]])
    return None


def _gather_shard(w: fx.Node) -> fx.Node | None:
    """The shard a wait's parameter is gathered from, if it is a graph input (it is in the
    graphs zero3 produces: the forward's parameters, the backward's saved shards)."""
    issue, pid = (w.args[0].args[0], _waited_pid(w)) if _is_member(w) else (w.args[0], int(w.args[1]))
    if is_op(issue, DC.allgather_param.default):
        shard = issue.args[0]
    elif is_op(issue, DC.allgather_params.default):
        shard = issue.args[0][[int(p) for p in issue.args[1]].index(pid)]
    else:
        return None
    return shard if isinstance(shard, fx.Node) and shard.op == "placeholder" else None


def _detach(g: fx.Graph, w: fx.Node, pid: int) -> None:
    """Take ``pid`` out of the collective that ``w`` waits on: a single gather is erased, a
    coalesced one loses that parameter (and is erased once empty). A member of a
    ``wait_allgather_many`` leaves that wait too (the later members' indices shift down)."""
    if _is_member(w):
        many, i = w.args[0], int(w.args[1])
        ids = [int(p) for p in many.args[1]]
        del ids[i]
        many.args = (many.args[0], ids)
        many.meta["dc_params"] = ids
        if ids:
            many.meta["dc_param"] = ids[0]
        if isinstance(many.meta.get("val"), (list, tuple)):
            many.meta["val"] = [v for k, v in enumerate(many.meta["val"]) if k != i]
        for u in list(many.users):
            if u is not w and int(u.args[1]) > i:
                u.args = (many, int(u.args[1]) - 1)
        w.args = (many, -1)  # no longer an index of many; w is erased by the caller
        issue = many.args[0]
    else:
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
    # (an emptied wait_allgather_many still has its users until the caller erases them: the
    # caller erases it and its collective afterwards)
