"""zero3: lower the sharding boundary into communication.

Before this pass a graph uses ``dc.unshard(shard, id)`` wherever a parameter's full value is
needed and (backward) ``dc.shard_grad(grad, id)`` wherever a full gradient becomes the shard's
gradient. After it:

* one ``allgather_param`` + ``wait_allgather`` per parameter per graph, just before its first use
  (a parameter used twice, or tied to another module, is gathered once);
* ``release_param`` right after the last use of the gathered value or of any view of it;
* backward: ``reduce_grad`` (bucketed reduce-scatter, accumulated into ``shard.grad`` by the
  runtime) where the gradient is ready, the graph's gradient output for that shard becomes
  ``None``, and ``end_backward`` closes the graph once every reduce has been issued.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from deepcompile import compat
from deepcompile.passes.alias import alias_closure  # storage-based; see alias.py
from deepcompile.passes.registry import PassContext, register_pass

DC = torch.ops.dc


def is_op(node: fx.Node, op) -> bool:
    return node.op == "call_function" and node.target is op


def _fake_like(val, shape, dtype=None):
    if val is None:
        return None
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return val.new_empty(shape, dtype=dtype or val.dtype)
    with mode:
        return val.new_empty(shape, dtype=dtype or val.dtype)


def lower_gathers(gm: fx.GraphModule, ctx: PassContext) -> dict[int, fx.Node]:
    """Replace ``unshard`` nodes by allgather/wait/release; returns id -> wait node."""
    g = gm.graph
    groups: dict[int, list[fx.Node]] = {}
    for n in g.nodes:
        if is_op(n, DC.unshard.default):
            groups.setdefault(int(n.args[1]), []).append(n)
    waits: dict[int, fx.Node] = {}
    for pid, nodes in groups.items():
        order = {n: i for i, n in enumerate(g.nodes)}
        users = [u for n in nodes for u in n.users]
        anchor = min(users, key=order.__getitem__) if users else nodes[0]
        shard = nodes[0].args[0]
        with g.inserting_before(anchor):
            h = g.call_function(DC.allgather_param.default, (shard, pid))
            w = g.call_function(DC.wait_allgather.default, (h, pid))
        h.meta["val"] = _fake_like(shard.meta.get("val"), (0,))
        w.meta["val"] = nodes[0].meta.get("val")
        for k in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if k in nodes[0].meta:
                h.meta[k] = w.meta[k] = nodes[0].meta[k]
        w.meta["dc_param"] = h.meta["dc_param"] = pid
        # each merged node's own views (their fake values alias that node's storage, not w's)
        views = [v for n in nodes for v in alias_closure(n)[1:]]
        for n in nodes:
            n.replace_all_uses_with(w)
            g.erase_node(n)
        waits[pid] = w
        _insert_release(g, w, pid, ctx, views)
    return waits


def _insert_release(g: fx.Graph, w: fx.Node, pid: int, ctx: PassContext,
                    views: list[fx.Node] = ()) -> None:
    aliases = list(dict.fromkeys(alias_closure(w) + [a for v in views for a in alias_closure(v)]))
    users = {u for a in aliases for u in a.users} | set(aliases[1:])
    if any(u.op == "output" for u in users):
        name = ctx.param_meta[pid].name if pid in ctx.param_meta else pid
        ctx.notes.append(f"{name}: gathered value leaves the {ctx.kind} graph; not released here")
        return
    order = {n: i for i, n in enumerate(g.nodes)}
    last = max(users, key=order.__getitem__) if users else w
    with g.inserting_after(last):
        r = g.call_function(DC.release_param.default, (w, pid))
    r.meta["val"] = None
    r.meta["dc_param"] = pid


def lower_grad_reduce(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Replace ``shard_grad`` by bucketed ``reduce_grad``; gradient outputs become None."""
    g = gm.graph
    sgs = [n for n in g.nodes if is_op(n, DC.shard_grad.default)]
    if not sgs:
        return 0
    reduced: list[fx.Node] = []
    for n in sgs:
        grad, pid = n.args[0], int(n.args[1])
        with g.inserting_before(n):
            r = g.call_function(DC.reduce_grad.default, (grad, pid))
        r.meta["val"] = None
        r.meta["dc_param"] = pid
        reduced.append(grad)
    # Everything computed only from shard_grad results (e.g. the sum for a tied weight) is the
    # shard's gradient, which the runtime now writes to `.grad` itself.
    derived = set(sgs)
    for n in g.nodes:
        if n.op == "call_function" and n not in derived:
            ins = n.all_input_nodes
            if ins and all(i in derived for i in ins):
                derived.add(n)
    out = next(n for n in g.nodes if n.op == "output")
    for n in derived:
        bad = [u for u in n.users if u not in derived and u is not out]
        if bad:
            raise RuntimeError(f"deepcompile zero3: the gradient of a sharded parameter feeds {bad[0]}; "
                               "only returning it is supported")

    outs = out.args[0]
    cleared = [i for i, a in enumerate(outs) if isinstance(a, fx.Node) and a in derived]
    out.args = (type(outs)(None if i in cleared else a for i, a in enumerate(outs)),)
    compat.forget_outputs(out, cleared)
    with g.inserting_before(out):
        e = g.call_function(DC.end_backward.default, (list(dict.fromkeys(reduced)), ctx.graph_id))
    e.meta["val"] = None
    g.eliminate_dead_code()
    return len(sgs)


@register_pass("zero3", help="insert allgather/release before and after parameter uses, reduce-scatter gradients")
def zero3(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    waits = lower_gathers(gm, ctx)
    n_red = lower_grad_reduce(gm, ctx) if ctx.kind == "backward" else 0
    ctx.notes.append(f"gathers: {len(waits)}, reduces: {n_red}")
    gm.graph.lint()
    gm.recompile()
    return gm
