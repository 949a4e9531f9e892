"""selective_unshard: keep the parameters whose gathering costs most per byte gathered.

A kept parameter is gathered once and stays gathered across forward, backward and further
micro-batches until the optimizer changes its shard (the runtime drops the copies at every
optimizer step). Small parameters are the usual choice: a collective's fixed cost dominates
their transfer, so keeping them resident saves the most time per byte of memory.

Runs before or after ``prefetch``: a chosen parameter that prefetch already coalesced into a
group is taken out of it (the default plan runs ``zero3, prefetch, selective_unshard``, and
before, every chosen parameter of the 16-layer Llama sat in a group and nothing was kept).

How the kept parameters are gathered (``group_mb``): in the forward (and an inference graph)
they are cut, in the order the graph first needs them, into coalesced groups of up to
``group_mb`` MiB. Every group's ``gather_persistent_start`` is issued near the graph's top (after
any transient gather that prefetch issued there for an earlier need, so the collectives, which
run one after the other on one stream, stay in need order) and its ``gather_persistent_wait``
sits just before the group's first use: the compute stream waits for that group alone, so it
starts once the first group has arrived instead of idling until all of them have (2 H200s,
953M Llama, everything kept: the one gather of 1.8 GiB at the top left the compute stream idle
for the first 6-8 ms of a 45 ms step on NVLink, and ~24 ms exposed on slow links). Memory is
the same: kept parameters stay gathered for the whole step anyway. The backward keeps one
``gather_persistent_many`` at its top: there every kept parameter is already in the runtime's
cache (one host call, nothing gathered). ``group_mb`` 0 gives that single collective, waited at
the top, in the forward too.

Only the first forward after an optimizer step gathers; every later graph (the backward, later
micro-batches under gradient accumulation) finds the parameters kept and gathers nothing.
Choices depend only on parameter sizes and the (rank-agreed) communication model, so every rank
keeps the same parameters and cuts the same groups.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from deepcompile.params import spec
from deepcompile.passes import zero3
from deepcompile.passes.registry import OFFLINE_RERUN, PassContext, register_pass
from deepcompile.passes.zero3 import _fake_like, is_op
from deepcompile.vocab.links import default_model

DC = torch.ops.dc
NAME = "selective_unshard"


# The default group: about one decoder layer of the 953M Llama in bf16 (its layers gather ~112
# MiB; the embedding is 125 MiB). Large enough that NCCL's fixed cost (53 us measured on 2
# H200s) is ~15% of a group's gather at NVLink's 441 GB/s and the host pays ~16 starts and
# waits per forward; small enough that the first group, the only one nothing hides, is short.
# The cost model on the 16-layer record (benchmarks/plan_offline.py, everything kept) predicts
# at NVLink / at 40 GB/s: one collective at the top 50.8 / 128.5 ms, 16 MiB groups 52.5 / 123.8,
# 64 MiB 48.0 / 120.3, 128 MiB 47.3 / 119.4, 256 MiB 46.9 / 119.2, 1 GiB 48.1 / 123.3 (the
# host's cost per start and wait is not measured yet: see profile.host.HOST_US).
# Another size is a pass parameter: {"name": "selective_unshard", "params": {"group_mb": ...}}.
GROUP_MB = 128.0


@dataclass
class SelectiveUnshardParams:
    budget_mb: float = spec(64.0, min=0.0, max=1e7, help="memory (MiB) of gathered parameters kept resident")
    group_mb: float = spec(GROUP_MB, min=0.0, max=1e7,
                           help="the forward gathers kept parameters in need order, in coalesced groups of up to "
                                "this many MiB, each waited just before its first use; 0: one collective, waited "
                                "at the top")


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


@register_pass(NAME, SelectiveUnshardParams, graph_only=True, offline=OFFLINE_RERUN,
               planned=("budget_mb",), absent={"budget_mb": 0.0},
               requires=(zero3.NAME,))   # it keeps the gathers zero3 inserts
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
    grouped = ctx.params.group_mb > 0 and ctx.kind != "backward"
    groups: list[list[int]] = []
    if kept:
        order = {n: i for i, n in enumerate(g.nodes)}
        first = {p: _first_use(waits[p], order) for p in kept}
        # the collectives that stay transient (a parameter not kept in them), each with where it
        # is first waited
        kept_set = set(kept)
        transient = [(n, min(order[w] for w in n.users)) for n in g.nodes
                     if (is_op(n, DC.allgather_param.default) or is_op(n, DC.allgather_params.default))
                     and n.users and any(p not in kept_set for p in _issue_pids(n))]
        for pid in kept:
            for w in waits[pid]:
                _detach(g, w, pid)
        top = next(n for n in g.nodes if n.op not in ("placeholder", "get_attr"))
        items: dict[int, fx.Node] = {}
        if grouped:
            kept.sort(key=lambda p: (order[first[p]], p))
            groups = _groups(kept, ctx, {p: waits[p][0] for p in kept}, first)
            prev = top.prev  # the last placeholder (or the root): starts go after it, in need order
            for grp in groups:
                need = order[first[grp[0]]]
                # after every transient collective needed before this group (issue order is the
                # order the link serves them in), after the previous group's start
                anchor = prev
                for issue, at in transient:
                    if at < need and issue in order and order[issue] > order.get(anchor, -1):
                        anchor = issue
                with g.inserting_after(anchor):
                    start = g.call_function(DC.gather_persistent_start.default, ([shards[p] for p in grp], grp))
                start.meta["dc_params"] = list(grp)
                start.meta["dc_param"] = grp[0]
                # its fake value (the empty handle the op returns): blocks.py passes a start to the
                # region of its wait as an input when the two sit in different decoder blocks
                start.meta["val"] = _fake_like(shards[grp[0]].meta.get("val"), (0,))
                order[start] = order.get(anchor, -1) + 0.5  # (only compared with transient issues' places)
                prev = start
                with g.inserting_before(first[grp[0]]):
                    wait = g.call_function(DC.gather_persistent_wait.default, (start, list(grp)))
                    for i, pid in enumerate(grp):
                        items[pid] = g.call_function(operator.getitem, (wait, i))
                _meta_many(wait, grp, waits, items)
        else:
            with g.inserting_before(top):
                many = g.call_function(DC.gather_persistent_many.default, ([shards[p] for p in kept], kept))
                for i, pid in enumerate(kept):
                    items[pid] = g.call_function(operator.getitem, (many, i))
            _meta_many(many, kept, waits, items)
            groups = [list(kept)]
        for pid in kept:
            for w in waits[pid]:
                for r in [u for u in w.users if is_op(u, DC.release_param.default)]:
                    g.erase_node(r)
                w.replace_all_uses_with(items[pid])
                g.erase_node(w)
        for n in reversed(list(g.nodes)):  # a group's wait and collective once nothing is left of them
            if not n.users and (is_op(n, DC.wait_allgather_many.default) or is_op(n, DC.allgather_params.default)):
                g.erase_node(n)
    how = (f"in {len(groups)} group(s) of up to {ctx.params.group_mb:g} MiB in need order, each waited before its "
           f"first use" if grouped and kept else "in one collective at the top")
    ctx.notes.append(f"kept gathered: {len(kept)} parameters in this graph ({len(keep)} chosen, "
                     f"budget {ctx.params.budget_mb:g} MiB), {how}")
    g.lint()
    gm.recompile()
    return gm


def _meta_many(op: fx.Node, pids: list[int], waits: dict[int, list[fx.Node]], items: dict[int, fx.Node]) -> None:
    """The meta of a multi-output gather (``gather_persistent_many`` / ``gather_persistent_wait``)
    and its getitems, taken from the waits they replace (shapes for the record and Inductor)."""
    op.meta["dc_params"] = list(pids)
    op.meta["dc_param"] = pids[0]
    for pid in pids:
        items[pid].meta.update({k: v for k, v in waits[pid][0].meta.items()
                                if k in ("val", "nn_module_stack", "stack_trace")})
        items[pid].meta["dc_param"] = pid
    for k in ("nn_module_stack", "stack_trace"):
        if k in waits[pids[0]][0].meta:
            op.meta.setdefault(k, waits[pids[0]][0].meta[k])
    vals = [items[p].meta.get("val") for p in pids]
    if all(v is not None for v in vals):
        op.meta["val"] = vals


def _first_use(ws: list[fx.Node], order: dict[fx.Node, int]) -> fx.Node:
    """The first node that uses a parameter's gathered value (its releases aside): the group's
    wait goes right before it. A value nothing uses (not in graphs zero3 makes): its wait."""
    users = [u for w in ws for u in w.users if not is_op(u, DC.release_param.default)]
    return min(users or ws, key=order.__getitem__)


def _issue_pids(n: fx.Node) -> list[int]:
    if is_op(n, DC.allgather_param.default):
        return [int(n.args[1])]
    return [int(p) for p in n.args[1]]


def _groups(kept: list[int], ctx: PassContext, wait: dict[int, fx.Node],
            first: dict[int, fx.Node]) -> list[list[int]]:
    """``kept`` (in need order) cut into consecutive groups of up to ``group_mb`` MiB.

    A group holds whole decoder blocks (the block of a parameter's first use, ``blocks.block_label``):
    consecutive parameters of one block are a unit, and units are packed while they fit. Cut by
    size alone, a group straddled layers by a different amount at every layer (a 112 MiB layer in
    128 MiB groups), so every block's forward waited for a different set and no two blocks were
    alike to ``blocks.py`` (32 layers: 10 forward regions compiled instead of 4). A block larger
    than ``group_mb`` starts a group of its own and is cut by size; so is a parameter larger than
    ``group_mb``."""
    from deepcompile.compile import blocks

    limit = ctx.params.group_mb * 2**20
    units: list[tuple[object, list[int]]] = []
    for pid in kept:
        lab = blocks.block_label(first[pid])
        if units and lab is not None and units[-1][0] == lab:
            units[-1][1].append(pid)
        else:
            units.append((lab, [pid]))
    out: list[list[int]] = []
    size = 0.0
    for _, pids in units:
        sizes = [_gathered_bytes(ctx, pid, wait[pid]) for pid in pids]
        total = sum(sizes)
        if out and size + total <= limit:
            out[-1].extend(pids)
            size += total
            continue
        out.append([])
        size = 0.0
        for pid, b in zip(pids, sizes):
            if out[-1] and size + b > limit:
                out.append([])
                size = 0.0
            out[-1].append(pid)
            size += b
        if total > limit:
            size = limit  # an oversized block's groups are its own: the next block starts afresh
    return out


def _gathered_bytes(ctx: PassContext, pid: int, w: fx.Node) -> float:
    """Bytes of one gathered parameter: from the registry's metadata, else the wait's value."""
    m = ctx.param_meta.get(pid)
    if m is not None:
        return float(m.chunk * ctx.world_size * torch.empty((), dtype=m.gather_dtype).element_size())
    v = w.meta.get("val")
    return float(v.numel() * v.element_size()) if isinstance(v, torch.Tensor) else 0.0


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
