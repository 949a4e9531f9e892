"""zero3: lower the sharding boundary into communication.

Before this pass a graph uses ``dc.unshard(shard, id)`` wherever a parameter's full value is
needed and (backward) ``dc.shard_grad(grad, id)`` wherever a full gradient becomes the shard's
gradient. After it:

* one ``allgather_param`` + ``wait_allgather`` per parameter per graph, just before its first use
  (a parameter used twice, or tied to another module, is gathered once);
* ``release_param`` right after the last use of the gathered value or of any view of it;
* backward: ``reduce_grads`` (bucketed reduce-scatter, accumulated into ``shard.grad`` by the
  runtime) once per reduce bucket, where the runtime would flush it (``group_reduces``; a
  gradient that must be copied, or one the grouping cannot place, gets its own ``reduce_grad``
  where it is ready), the graph's gradient output for that shard becomes ``None``, and
  ``end_backward`` closes the graph once every reduce has been issued.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from deepcompile.compat import aot as aot_compat
from deepcompile.passes.alias import alias_closure  # storage-based; see alias.py
from deepcompile.passes.registry import OFFLINE_BASE, PassContext, register_pass

DC = torch.ops.dc
NAME = "zero3"


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
    # node -> position, taken once (not once per parameter: quadratic in the graph's size, a
    # second of a 32-layer compile). Every node compared below (an unshard's users, a wait's
    # views and their users) was in the graph before the loop, and the nodes the loop inserts
    # never reorder those, so their relative order is the graph's at every iteration.
    order = {n: i for i, n in enumerate(g.nodes)}
    for pid, nodes in groups.items():
        users = [u for n in nodes for u in n.users]
        if any(u not in order for u in users):  # (never seen; the positions of now, to be safe)
            order = {n: i for i, n in enumerate(g.nodes)}
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
        _insert_release(g, w, pid, ctx, views, order)
    return waits


def _insert_release(g: fx.Graph, w: fx.Node, pid: int, ctx: PassContext,
                    views: list[fx.Node] = (), order: dict | None = None) -> None:
    aliases = list(dict.fromkeys(alias_closure(w) + [a for v in views for a in alias_closure(v)]))
    users = {u for a in aliases for u in a.users} | set(aliases[1:])
    if any(u.op == "output" for u in users):
        name = ctx.param_meta[pid].name if pid in ctx.param_meta else pid
        ctx.notes.append(f"{name}: gathered value leaves the {ctx.kind} graph; not released here")
        return
    if order is None or any(u not in order for u in users):  # a node the caller's positions lack
        order = {n: i for i, n in enumerate(g.nodes)}
    last = max(users, key=order.__getitem__) if users else w
    with g.inserting_after(last):
        r = g.call_function(DC.release_param.default, (w, pid))
    r.meta["val"] = None
    r.meta["dc_param"] = pid


def reduce_layout(ctx: PassContext):
    """The runtime's bucket layout the grouping replays: the context's (tests, offline what-if),
    else the one the context's runtime state was initialised with, else the config defaults."""
    from deepcompile.runtime.state import ReduceLayout

    rt = getattr(ctx, "runtime", None)
    lay = getattr(ctx, "reduce_layout", None) or (rt.reduce_layout if rt is not None else None)
    if lay is None:
        from deepcompile.passes.registry import DEFAULT_REDUCE_BUCKET

        lay = ReduceLayout(DEFAULT_REDUCE_BUCKET, None)
    return lay


def _dense(val: torch.Tensor) -> bool:
    """Contiguous by the traced value (a parameter's gradient has static sizes; a symbolic one
    counts as not known to be, without adding a guard)."""
    if any(isinstance(x, torch.SymInt) for x in (*val.shape, *val.stride())):
        return False
    return bool(val.is_contiguous())


def plan_reduce_calls(items: list[tuple[int, int, bool]], bucket_elems: int) -> list[list[int]]:
    """Group gradients into runtime calls, one per bucket flush.

    ``items``: per gradient in graph order, ``(param id, elements in the bucket (chunk x world),
    must_call_now)``. Replays ``Runtime::add_grad``: a gradient whose parameter is already in the
    open bucket is summed into its entry; otherwise, if the open bucket is not empty and would
    overflow, it is flushed first (the arrival of this gradient flushes it), then the gradient
    joins it and a bucket that reaches ``bucket_elems`` is flushed at once. Each group ends with
    the gradient whose arrival flushes a bucket, so handing the group over at that gradient's
    point issues every reduce-scatter exactly when one call per gradient would have; the rest
    goes in one last group. Conservative cuts (a call earlier than needed, never later): a
    gradient that ``must_call_now`` (the runtime copies it: the original could be freed at once)
    ends its group, and a parameter's second gradient starts a new one (one id per call)."""
    groups: list[list[int]] = []
    pending: list[int] = []
    pending_ids: set[int] = set()
    open_ids: set[int] = set()
    filled = 0
    for i, (pid, elems, now) in enumerate(items):
        if pid in pending_ids:
            groups.append(pending)
            pending, pending_ids = [], set()
        pending.append(i)
        pending_ids.add(pid)
        flushed = False
        if pid not in open_ids:
            if open_ids and filled + elems > bucket_elems:
                open_ids, filled, flushed = set(), 0, True
            open_ids.add(pid)
            filled += elems
            if filled >= bucket_elems:
                open_ids, filled, flushed = set(), 0, True
        if flushed or now:
            groups.append(pending)
            pending, pending_ids = [], set()
    if pending:
        groups.append(pending)
    return groups


def group_reduces(sgs: list[fx.Node], ctx: PassContext) -> list[list[fx.Node]]:
    """The ``shard_grad`` nodes (graph order) grouped into one runtime call per reduce bucket
    (``plan_reduce_calls``: a call per gradient would be the backward's largest host cost).
    One group per gradient where the grouping cannot replay the runtime: a parameter without
    metadata, or the runtime copying every gradient (``ReduceLayout.copies_each``).

    Block regions (blocks.py) need every layer's calls alike, and where a bucket flushes moves
    from layer to layer: there a call ends at each block boundary instead of at each flush, so a
    bucket that fills inside a block is handed over at that block's last gradient (at most one
    block's backward later; the runtime flushes it inside the call) instead of one call per
    gradient, a host cost of the step."""
    from deepcompile.compile import blocks

    lay = reduce_layout(ctx)
    world = max(1, int(ctx.world_size))
    if lay.copies_each or any(int(n.args[1]) not in ctx.param_meta for n in sgs):
        return [[n] for n in sgs]
    by_block = lay.by_block
    items = []
    for n in sgs:
        m = ctx.param_meta[int(n.args[1])]
        val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        # what padded_flat copies: zero padding, a cast to the reduce dtype, a strided gradient
        copied = (m.numel != m.chunk * world or not isinstance(val, torch.Tensor)
                  or (lay.reduce_dtype is not None and val.dtype != lay.reduce_dtype)
                  or not _dense(val))
        items.append((m.id, m.chunk * world, copied))
    if by_block:  # no cut at flushes (a huge bucket never flushes in the replay), one at blocks
        groups = plan_reduce_calls(items, 1 << 62)
        return blocks.cut_at_blocks([[sgs[i] for i in grp] for grp in groups])
    return [[sgs[i] for i in grp] for grp in plan_reduce_calls(items, int(lay.bucket_elems))]


def lower_grad_reduce(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Replace ``shard_grad`` by bucketed ``reduce_grads`` (one call per bucket, see
    ``group_reduces``); gradient outputs become None."""
    g = gm.graph
    sgs = [n for n in g.nodes if is_op(n, DC.shard_grad.default)]
    if not sgs:
        return 0
    reduced: list[fx.Node] = []
    for group in group_reduces(sgs, ctx):
        n = group[-1]  # where its last gradient is ready: where a per-gradient reduce_grad would be
        grads, pids = [m.args[0] for m in group], [int(m.args[1]) for m in group]
        with g.inserting_before(n):
            if len(group) == 1:
                r = g.call_function(DC.reduce_grad.default, (grads[0], pids[0]))
            else:
                r = g.call_function(DC.reduce_grads.default, (grads, pids))
                r.meta["dc_params"] = pids
        r.meta["val"] = None
        r.meta["dc_param"] = pids[0]
        reduced.extend(grads)
        last_grads = grads
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
    aot_compat.forget_outputs(out, cleared)
    # end_backward's argument only orders it after the last reduce (the runtime ignores it). It
    # names the last call's gradients, not all of them: an op argument is a use, and Inductor (or
    # the interpreter) keeps every value alive until its last use, so listing every gradient held
    # all of the backward's unsharded gradients (1.78 GiB of bf16 on the 953M Llama) until the
    # backward ended, on top of the reduced shards. Each reduce call runs in graph order, so
    # following the last one follows them all.
    with g.inserting_before(out):
        e = g.call_function(DC.end_backward.default, (list(dict.fromkeys(last_grads)), ctx.graph_id))
    e.meta["val"] = None
    g.eliminate_dead_code()
    return len(sgs)


@register_pass(NAME, help="insert allgather/release before and after parameter uses, reduce-scatter gradients",
               lowers=(3,), graph_only=True,
               # the record keeps its output graphs; the what-if re-runs the passes after it on them
               offline=OFFLINE_BASE)
def zero3(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    waits = lower_gathers(gm, ctx)
    n_red = lower_grad_reduce(gm, ctx) if ctx.kind == "backward" else 0
    ctx.notes.append(f"gathers: {len(waits)}, reduces: {n_red}")
    gm.graph.lint()
    gm.recompile()
    return gm
