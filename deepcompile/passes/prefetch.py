"""prefetch: issue each allgather as early as the memory budget allows, fusing small ones.

Runs after ``zero3``. Gathers are considered in the order their values are first needed. Consecutive gathers are coalesced into one ``allgather_params`` collective (one NCCL group, each
parameter in its own buffer) up to ``fuse_mb`` while the cost model says it is cheaper. Then each
collective's issue point moves back, past the waits of earlier gathers, as long as the bytes
gathered ahead of need stay within ``budget_mb``: the collective then runs while the compute
before it does (on GPU on NCCL's stream; on CPU on gloo's thread).

Every collective it leaves (fused or single) carries ``meta["dc_moved"]``, what the record
(``"moved"`` on the node), the notes and the graph view's diff show as *from -> to*::

    {"from": node it was issued after before this pass (None: the top of the graph),
     "to": node it is issued after now (None: the top),
     "params": [parameter ids it gathers], "first_use": {id: first node computing with it},
     "earlier": nodes between its new and its old place (0: not moved), "bytes": bytes gathered}

"from" and "to" name nodes that survive the pass (never another gather's issue, which moves
or disappears into a fused one), so both exist in the graphs before and after it.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.fx as fx

from deepcompile.params import spec
from deepcompile.passes import zero3
from deepcompile.passes.registry import OFFLINE_RERUN, PassContext, register_pass
from deepcompile.passes.zero3 import is_op
from deepcompile.vocab.links import default_model

DC = torch.ops.dc
NAME = "prefetch"


@dataclass
class PrefetchParams:
    budget_mb: float = spec(512.0, min=0.0, max=1e7,
                            help="gathered memory (MiB) allowed to be in flight ahead of its first use")
    fuse_mb: float = spec(128.0, min=0.0, max=1e6,
                          help="consecutive gathers are coalesced into one collective of up to this many MiB (0: never)")
    max_fused: int = spec(64, min=1, max=1024, help="most parameters in one coalesced collective")
    cover: float = spec(0.0, min=0.0, max=100.0,
                        help="with a profile and > 0: hoist only until measured compute covers this multiple of the "
                             "predicted collective time (less memory held); 0: as far as budget_mb allows")
    backend: str = spec("auto", choices=("auto", "nccl", "gloo"),
                        help="which default communication model to use when no profile exists")


@dataclass
class _Gather:
    issue: fx.Node        # allgather_param / allgather_params
    waits: list[fx.Node]
    pids: list[int]
    bytes: float
    origin: fx.Node | None = None   # the node its (first member's) issue followed in the input graph


def _param_bytes(ctx: PassContext, pid: int) -> float:
    m = ctx.param_meta[pid]
    return float(m.chunk * ctx.world_size * torch.empty((), dtype=m.gather_dtype).element_size())


def _collect(g: fx.Graph, ctx: PassContext) -> list[_Gather]:
    out = []
    for n in g.nodes:
        if is_op(n, DC.wait_allgather.default):
            issue = n.args[0]
            if is_op(issue, DC.allgather_param.default):
                pid = int(n.args[1])
                prev = issue.prev
                out.append(_Gather(issue, [n], [pid], _param_bytes(ctx, pid),
                                   None if prev.op == "root" else prev))
    return out


def _fuse(g: fx.Graph, gathers: list[_Gather], ctx: PassContext) -> list[_Gather]:
    p = ctx.params
    model = ctx.profile.comm if (ctx.profile is not None and ctx.profile.comm is not None) else default_model(_backend(ctx))
    limit = p.fuse_mb * 2**20
    fused: list[_Gather] = []
    run: list[_Gather] = []

    def close_run():
        if len(run) >= 2 and model.fusion_saves([x.bytes for x in run], ctx.world_size):
            first_wait = run[0].waits[0]
            with g.inserting_before(first_wait):
                shards = [x.issue.args[0] for x in run]
                pids = [x.pids[0] for x in run]
                h = g.call_function(DC.allgather_params.default, (shards, pids))
            h.meta["val"] = run[0].issue.meta.get("val")
            h.meta["dc_param"] = pids[0]
            h.meta["dc_params"] = pids
            for x in run:
                x.waits[0].replace_input_with(x.issue, h)
                g.erase_node(x.issue)
            many = _wait_once(g, h, [x.waits[0] for x in run], pids)
            # the group's old place is its first member's: the others reach it by fusing
            fused.append(_Gather(h, [many], pids, sum(x.bytes for x in run), run[0].origin))
        else:
            fused.extend(run)
        run.clear()

    for x in gathers:
        if run and (sum(r.bytes for r in run) + x.bytes > limit or len(run) >= p.max_fused):
            close_run()
        run.append(x)
    close_run()
    return fused


def _wait_once(g: fx.Graph, h: fx.Node, waits: list[fx.Node], pids: list[int]) -> fx.Node:
    """One ``wait_allgather_many`` for a coalesced group, where its first member is first needed.

    All members of one coalesced collective finish together, so waiting for all of them at the
    first member's use costs no time, and the host makes one dispatcher call and one wait
    instead of one per parameter (213 waits per step on the 16-layer Llama otherwise). Each
    member's value is a ``getitem`` at the same place; releases stay per parameter.
    """
    import operator

    with g.inserting_before(waits[0]):
        many = g.call_function(DC.wait_allgather_many.default, (h, list(pids)))
        items = [g.call_function(operator.getitem, (many, i)) for i in range(len(pids))]
    many.meta["dc_param"] = pids[0]
    many.meta["dc_params"] = list(pids)
    for k in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if k in waits[0].meta:
            many.meta[k] = waits[0].meta[k]
    vals = [w.meta.get("val") for w in waits]
    if all(v is not None for v in vals):
        many.meta["val"] = vals
    for w, item, pid in zip(waits, items, pids):
        item.meta.update({k: v for k, v in w.meta.items() if k != "dc_params"})
        item.meta["dc_param"] = pid
        w.replace_all_uses_with(item)
        g.erase_node(w)
    return many


def _backend(ctx: PassContext) -> str:
    if ctx.params.backend != "auto":
        return ctx.params.backend
    import torch.distributed as dist

    return str(dist.get_backend()) if dist.is_initialized() else "gloo"


def _hoist(g: fx.Graph, gathers: list[_Gather], ctx: PassContext) -> int:
    """Move each collective's issue point back past earlier waits.

    As far as the budget allows. With a profile and ``cover > 0``: only as far as needed for the
    measured compute between issue and wait to cover ``cover`` times the collective's predicted
    time, still within the budget.

    Why the budget and not the profile decides by default: the profile times the graph node
    by node before Inductor has fused it, so its compute is slower than the compiled step's
    (on 2 H200s its nodes summed to 257 ms against a measured 76 ms step), and "covered" was
    reached about one collective ahead; the compiled step then waited on its gathers (the
    default plan ran 75.8 ms against 61.7 ms for budget-only prefetch, same run). The
    collectives also queue on one stream, so a gather starts only after every earlier one:
    covering its own time is not enough when the queue is long.
    """
    budget = ctx.params.budget_mb * 2**20
    gp = ctx.profile.get(ctx.graph_id, ctx.kind) if ctx.profile is not None else None
    comm = ctx.profile.comm if ctx.profile is not None else None
    lat = ({n.name: n.latency_ms * 1e3 for n in gp.nodes}
           if (gp is not None and comm is not None and ctx.params.cover > 0) else None)
    moved = 0
    # Everything below is linear in the graph (the planner runs this pass on every candidate's
    # copy of the graph; with a budget that holds the whole model every gather goes to the top,
    # and walking the graph per gather was 3.7 of a 32-layer planner's 16 s): the bytes ahead
    # and the compute covered are differences of prefix sums, and "which comes first" reads
    # positions kept up to date as issues move (_Positions).
    ahead_cum = [0]
    for x in gathers:
        ahead_cum.append(ahead_cum[-1] + int(x.bytes))
    at = _Positions(g)
    if lat is not None:
        # the loop moves only issue nodes (dc ops, which the sum skips); every other node keeps
        # its place, so a prefix sum over the order of now stays right for the whole loop
        # (before[n]: compute strictly before n; upto[n]: through n)
        before, upto, acc = {}, {}, 0.0
        for n in g.nodes:
            before[n] = acc
            if n.op == "call_function" and not str(n.target).startswith("dc."):
                acc += lat.get(n.name, 0.0)
            upto[n] = acc
    top = next(n for n in g.nodes if n.op != "placeholder").prev  # the last placeholder (or the root)
    for i, x in enumerate(gathers):
        # the earliest j whose gathers j..i fit in the budget together (i itself always counts)
        j_min = min(bisect.bisect_left(ahead_cum, ahead_cum[i + 1] - budget, 0, i + 1), i)
        j = j_min
        if lat is not None:
            need = comm.allgather_us(x.bytes) * ctx.params.cover
            end = before[x.waits[0]]
            for cand in range(i, j_min - 1, -1):
                covered = end - (upto[gathers[cand - 1].waits[0]] if cand > 0 else 0.0)
                if covered >= need:
                    j = cand
                    break
        elif j == i and not (i == 0 and x.bytes <= budget):
            # (the first collective goes to the top when the budget holds it: the ones hoisted
            # there after it then queue behind it, not ahead of it)
            continue
        if any(inp.op != "placeholder" for inp in x.issue.all_input_nodes):
            continue  # a shard computed inside the graph: keep it where its input exists
        anchor = gathers[j - 1].waits[0] if j > 0 else top
        if not at.before(anchor, x.issue):
            continue  # already above its anchor (an earlier pass placed it): leave it
        # Never ahead of the previous collective: collectives run in issue order on one stream
        # (NCCL) or thread (gloo), so one needed later but issued first delays the one needed
        # sooner. Issues stay in need order (by induction), so the previous one is the last.
        prev_issue = gathers[i - 1].issue if i > 0 else None
        if prev_issue is not None and at.before(anchor, prev_issue) and at.before(prev_issue, x.issue):
            anchor = prev_issue
        if anchor.next is x.issue:
            continue
        at.move_after(x.issue, anchor)
        moved += 1
    return moved


class _Positions:
    """Every node's place in the graph as a number, kept right while nodes move: a moved node
    takes a number between its new neighbours' (big integers, spaced 2**64 apart at first; when
    a gap is used up, all are numbered again)."""

    GAP = 1 << 64

    def __init__(self, g: fx.Graph):
        self.g = g
        self._number()

    def _number(self) -> None:
        self.pos = {n: (k + 1) * self.GAP for k, n in enumerate(self.g.nodes)}

    def before(self, a: fx.Node, b: fx.Node) -> bool:
        """a comes before b (the graph's root, ``a.op == "root"``, before everything)."""
        return (0 if a.op == "root" else self.pos[a]) < self.pos[b]

    def move_after(self, node: fx.Node, anchor: fx.Node) -> None:
        anchor.append(node)
        lo = 0 if anchor.op == "root" else self.pos[anchor]
        nxt = node.next
        hi = self.pos[nxt] if nxt.op != "root" else lo + 2 * self.GAP
        if hi - lo < 2:
            self._number()
        else:
            self.pos[node] = (lo + hi) // 2


def _is_issue(n: fx.Node) -> bool:
    return is_op(n, DC.allgather_param.default) or is_op(n, DC.allgather_params.default)


def _values(x: _Gather) -> dict[int, fx.Node]:
    """Parameter id -> the node whose value is that gathered parameter (its wait or getitem)."""
    w = x.waits[0]
    if is_op(w, DC.wait_allgather.default):
        return {x.pids[0]: w}
    items = {u.args[1]: u for u in w.users if u.op == "call_function" and len(u.args) == 2
             and isinstance(u.args[1], int)}
    return {pid: items.get(i, w) for i, pid in enumerate(x.pids)}


def _annotate(g: fx.Graph, gathers: list[_Gather], order0: list[fx.Node]) -> list[dict]:
    """``meta["dc_moved"]`` on every collective (see the module docstring); returns them in
    issue order."""
    alive = set(g.nodes)
    pos0 = {n: i for i, n in enumerate(order0)}
    order = list(g.nodes)
    pos = {n: i for i, n in enumerate(order)}

    def surviving(n: fx.Node | None) -> fx.Node | None:
        # the nearest node at or before n (input order) that is still there and is no issue
        k = pos0[n] if n is not None else -1
        while k >= 0 and (order0[k] not in alive or _is_issue(order0[k])):
            k -= 1
        return order0[k] if k >= 0 else None

    out = []
    for x in sorted(gathers, key=lambda x: pos[x.issue]):
        src = surviving(x.origin)
        dst = x.issue.prev
        while dst.op != "root" and _is_issue(dst):
            dst = dst.prev
        dst = None if dst.op == "root" else dst
        first = {}
        for pid, v in _values(x).items():
            users = [u for u in v.users if not str(u.target).startswith("dc.")]
            first[pid] = min(users, key=pos.__getitem__).name if users else v.name
        earlier = pos[src] - pos[x.issue] if src is not None and pos[src] > pos[x.issue] else 0
        info = {"from": src.name if src is not None else None, "to": dst.name if dst is not None else None,
                "params": list(x.pids), "first_use": first, "earlier": int(earlier), "bytes": int(x.bytes)}
        x.issue.meta["dc_moved"] = info
        out.append(info)
    return out


def _group_note(info: dict, ctx: PassContext) -> str:
    """One line per collective: which parameters, issued where, first used where."""
    from deepcompile.vocab.memory import fmt_bytes

    pids = info["params"]
    names = [ctx.param_meta[p].name if p in ctx.param_meta else str(p) for p in pids]
    what = (f"param {pids[0]} ({names[0]})" if len(pids) == 1 else
            f"{len(pids)} params fused {pids} ({', '.join(names)})")
    def where(n):
        return n if n is not None else "the top"
    if info["earlier"] > 0:
        moved = f"moved {where(info['from'])} -> {where(info['to'])}, {info['earlier']} nodes earlier"
    else:
        moved = f"not moved (issued after {where(info['to'])})"
    uses = sorted(set(info["first_use"].values()), key=list(info["first_use"].values()).index)
    return f"{what}, {fmt_bytes(info['bytes'])}: {moved}; first used at {', '.join(uses)}"


MAX_GROUP_NOTES = 64   # a 32-layer graph has hundreds of gathers: the notes name the first ones


@register_pass(NAME, PrefetchParams, graph_only=True, offline=OFFLINE_RERUN,
               planned=("budget_mb", "fuse_mb"), absent={"budget_mb": 0.0, "fuse_mb": 0.0},
               requires=(zero3.NAME,))   # it moves and fuses the gathers zero3 inserts
def prefetch(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Move allgathers earlier within a memory budget and fuse small ones."""
    g = gm.graph
    order0 = list(g.nodes)
    gathers = _collect(g, ctx)
    before = len(gathers)
    if ctx.params.fuse_mb > 0:
        gathers = _fuse(g, gathers, ctx)
    _hoist(g, gathers, ctx)
    infos = _annotate(g, gathers, order0)
    moved = sum(1 for d in infos if d["earlier"] > 0)
    ctx.notes.append(f"collectives: {before} -> {len(gathers)}; issued earlier: {moved}; "
                     f"budget {ctx.params.budget_mb:g} MiB, fuse {ctx.params.fuse_mb:g} MiB")
    ctx.notes.extend(_group_note(d, ctx) for d in infos[:MAX_GROUP_NOTES])
    if len(infos) > MAX_GROUP_NOTES:
        ctx.notes.append(f"... {len(infos) - MAX_GROUP_NOTES} more collectives (the graph's nodes carry each one's move)")
    g.lint()
    gm.recompile()
    return gm
