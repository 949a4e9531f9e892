"""offload_activations: large saved-for-backward tensors wait for backward in host memory.

Forward: each chosen activation (an output of the forward graph that backward reads, at least
``min_mb``) gets ``dc.offload_activation`` right after its last forward use, its own or a view's:
the copy to pinned host memory starts there and the device storage is freed when it ends.
Backward: ``dc.reload_activation`` starts the copy back ahead of the first use, early enough that
the measured compute in between covers the transfer (``lookahead_nodes`` nodes ahead without a
profile), and ``dc.wait_activation`` makes compute wait for it at the first use.

Which ones: the saved activations the decoder blocks ``blocks`` produce (the planner's choice,
``plan/offload_choice.py``), or, without ``blocks``, the earliest-produced first (backward needs
them last, so their reload has the most time) until what stays on the device is at most
``keep_mb``. A value ``recompute_activations`` drops is never chosen: it has no bytes to copy.
Tensors that share storage with another output, a view, or a graph input are never chosen:
freeing their storage would destroy the others (the runtime checks the storage again before freeing it). Sharing is decided by
storages (``passes/alias.py``), not by schemas alone: ``_unsafe_view(mm)`` shares ``mm``'s storage
without an alias annotation, and the offload goes after the last read of *every* node over the
storage, so a freed storage is never read.

Values the runtime owns (gathered and persistent parameters) are never chosen: the runtime keeps
those buffers and reads or frees them itself. A multi-output runtime op (``wait_allgather_many``,
``gather_persistent_many``, ``gather_persistent_wait``) hands its items out through ``getitem``,
whose target is not a ``dc`` op, so a value is judged by its source (through getitems and views)
and by storage (any storage a ``dc`` op's output or item lives in), and the offload asserts it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from deepcompile.compat import aot as aot_compat
from deepcompile.compat import fx as fx_compat
from deepcompile.params import spec
from deepcompile.passes.registry import OFFLINE_RERUN, PassContext, register_pass
from deepcompile.passes.alias import alias_closure, is_view, storage_keys
from deepcompile.passes.block_list import node_block, parse_blocks
from deepcompile.vocab.links import HOST_ONE_WAY_BYTES_PER_US

DC = torch.ops.dc
NAME = "offload_activations"
MIB = 2 ** 20

# The forward run leaves {forward node name: activation id} in ``ctx.handoff[NAME]`` for the same
# graph's backward run (AOTAutograd names backward's saved-tensor inputs after the forward nodes
# that produced them).


@dataclass
class OffloadActivationsParams:
    min_mb: float = spec(1.0, min=0.0, max=1e9, help="only saved activations at least this large (MiB) are offloaded")
    keep_mb: float = spec(0.0, min=0.0, max=1e9,
                          help="saved-activation memory (MiB) that stays on the device; the earliest-produced rest is offloaded")
    # the rate the planner prices these copies at: a lower one starts every reload earlier than
    # needed, and the reloaded bytes are back on the device at the backward's peak
    h2d_gbps: float = spec(HOST_ONE_WAY_BYTES_PER_US / 1e3, min=0.1, max=10000.0,
                           help="host-to-device bandwidth (GB/s) assumed when timing reloads against the profile "
                                "(default: pinned copies one way on an H200)")
    lookahead_nodes: int = spec(8, min=0, max=100000,
                                help="without a profile: how many backward nodes ahead of its first use a reload starts")
    blocks: str = spec("", help="decoder blocks (their index in the model's block list) whose saved activations are "
                                "offloaded: comma-separated indices or 'all'; '' offloads by keep_mb instead")

    def validate(self, path: str) -> None:
        parse_blocks(self.blocks, f"{path}.blocks")


def _nbytes(n: fx.Node) -> int:
    # by size hints: with dynamic shapes the fake value's sizes are SymInts, and comparing one
    # with a budget here would guard on it (or raise) after tracing is done
    v = n.meta.get("val")
    return fx_compat.tensor_nbytes(v) if isinstance(v, torch.Tensor) else 0


def owns_storage(v: torch.Tensor) -> bool:
    """What the runtime can free (``CopyEngine.offloadable``), judged on the fake value: dense,
    at offset 0, filling its whole storage. By size hints (symbolic sizes add no guards here)."""
    try:
        h = fx_compat.size_hint
        expected = 1
        for size, stride in reversed(list(zip(v.shape, v.stride()))):
            if h(size, 1) != 1 and h(stride, -1) != expected:
                return False
            expected *= h(size, 1)
        return (h(v.storage_offset(), -1) == 0
                and h(v.untyped_storage().nbytes(), -1) == fx_compat.tensor_nbytes(v))
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return True  # unknown: the runtime checks again before freeing


def storage_group(g: fx.Graph, n: fx.Node) -> list[fx.Node]:
    """Every node whose value lives in ``n``'s storage: its alias closure, and any other node
    whose fake value shares the storage (found by storage, whatever the path between them)."""
    group = alias_closure(n)
    keys = set(storage_keys(n) or ())
    for a in group:
        keys |= set(storage_keys(a) or ())
    if keys:
        members = set(group)
        group += [m for m in g.nodes if m not in members and m.op != "output"
                  and (storage_keys(m) or frozenset()) & keys]
    return group


def value_group(g: fx.Graph, n: fx.Node) -> list[fx.Node]:
    """``storage_group`` of a saved value, without the other blocks' nodes where ``n`` is a
    block's: blocks traced once (``compile/nested.py``) share fake storages with each other's
    nodes although their real tensors never do (the runtime checks the real storage again)."""
    b = node_block(n)
    if b is None:
        return storage_group(g, n)
    mine = set(alias_closure(n))
    return [m for m in storage_group(g, n) if m in mine or node_block(m) == b]


def _storage_key(k, o: fx.Node):
    """A storage as ``eligible`` counts its outputs: per block (see ``value_group``)."""
    return (k, node_block(o))


def _root(n: fx.Node) -> fx.Node:
    while is_view(n) and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def runtime_source(n: fx.Node) -> fx.Node | None:
    """The ``dc`` op whose output ``n`` is, through getitems and views; None if none."""
    seen = set()
    while isinstance(n, fx.Node) and n not in seen:
        seen.add(n)
        if n.op != "call_function":
            return None
        if getattr(n.target, "namespace", None) == "dc":
            return n
        if n.target is operator.getitem or is_view(n):
            n = n.args[0] if n.args else None
            continue
        return None
    return None


def runtime_storages(g: fx.Graph) -> set:
    """Storages of every ``dc`` op's output and of its getitem items (the runtime's buffers)."""
    keys: set = set()
    for n in g.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "dc":
            keys |= set(storage_keys(n) or ())
            for u in n.users:
                if u.target is operator.getitem:
                    keys |= set(storage_keys(u) or ())
    return keys


def eligible(gm: fx.GraphModule, min_mb: float) -> list[fx.Node] | None:
    """The saved activations of a forward graph this pass may offload, in graph order (see the
    module doc); None when saved values cannot be told from user outputs."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    start = aot_compat.saved_outputs_start(gm)
    if start is None:
        return None
    dropped = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is DC.drop_activation.default:
            dropped |= {_storage_key(k, n.args[0]) for k in storage_keys(n.args[0]) or ()}
    # how many outputs (user outputs included) each storage backs, by storage where known
    storage_outputs: dict = {}
    for o in outs:
        if isinstance(o, fx.Node):
            for k in (storage_keys(o) or {("root", _root(o))}):
                storage_outputs[_storage_key(k, o)] = storage_outputs.get(_storage_key(k, o), 0) + 1
    inputs = set()
    for p in gm.graph.nodes:
        if p.op in ("placeholder", "get_attr"):
            inputs |= set(storage_keys(p) or ())
    runtime = runtime_storages(gm.graph)
    chosen, seen = [], set()
    for o in outs[start:]:
        if not isinstance(o, fx.Node) or o in seen:
            continue
        seen.add(o)
        v = o.meta.get("val")
        keys = storage_keys(o)
        if (o.op != "call_function" or is_view(o) or not isinstance(v, torch.Tensor)
                or _nbytes(o) < min_mb * MIB):
            continue
        if keys and {_storage_key(k, o) for k in keys} & dropped:
            continue  # recompute_activations frees it: backward computes it again
        if keys is None:  # no fake value: fall back to the view chain
            if storage_outputs.get(_storage_key(("root", o), o), 0) != 1:
                continue
        elif len(keys) != 1 or storage_outputs.get(_storage_key(next(iter(keys)), o), 0) != 1 or keys & inputs:
            continue  # another output or a graph input lives in the same storage
        if runtime_source(o) is not None or (keys and keys & runtime):
            continue  # gathered and persistent parameters (items of multi-output ops too) belong to the runtime
        if not owns_storage(v):
            continue  # the runtime would refuse to free it (strided, or part of a bigger storage)
        chosen.append(o)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    chosen.sort(key=order.__getitem__)
    return chosen


def by_block(nodes: list[fx.Node]) -> dict[int, list[fx.Node]]:
    """``nodes`` by the decoder block that produced them (those outside any block left out)."""
    out: dict[int, list[fx.Node]] = {}
    for n in nodes:
        b = node_block(n)
        if b is not None:
            out.setdefault(b, []).append(n)
    return out


def candidates(gm: fx.GraphModule, ctx: PassContext) -> tuple[list[fx.Node], str]:
    chosen = eligible(gm, ctx.params.min_mb)
    if chosen is None:
        return [], "cannot tell saved activations from user outputs: nothing offloaded"
    if ctx.params.blocks.strip():
        wanted = parse_blocks(ctx.params.blocks)
        picked = [n for b, ns in sorted(by_block(chosen).items()) if wanted == "all" or b in wanted for n in ns]
        return picked, (f"{len(picked)} of {len(chosen)} saved activations >= {ctx.params.min_mb:g} MiB "
                        f"(blocks {ctx.params.blocks})")
    keep = ctx.params.keep_mb * MIB
    total = sum(_nbytes(n) for n in chosen)
    picked = []
    for n in chosen:  # earliest first, until what is left on the device fits keep_mb
        if total <= keep:
            break
        picked.append(n)
        total -= _nbytes(n)
    return picked, f"{len(picked)} of {len(chosen)} saved activations >= {ctx.params.min_mb:g} MiB"


def _readers(users: list[fx.Node]) -> list[fx.Node]:
    """Tensor outputs of ``users`` (through getitem for multi-output ops)."""
    out = []
    for u in users:
        v = u.meta.get("val")
        if isinstance(v, torch.Tensor):
            out.append(u)
        elif isinstance(v, (list, tuple)):
            out.extend(g for g in u.users if isinstance(g.meta.get("val"), torch.Tensor))
    return out


def last_reader(closure: list[fx.Node], order: dict, skip) -> tuple[fx.Node, list[fx.Node]]:
    """(the node after which a storage's last forward reader is done, the readers' tensor outputs
    for the op's ``after``) for the nodes ``closure`` over one storage; ops of target ``skip``
    (the freeing op itself, placed for another value) do not read it."""
    users = [u for a in closure for u in a.users if u.op != "output" and u not in closure and u.target is not skip]
    readers = _readers(users)
    return max(users + closure + readers, key=order.__getitem__), readers


def offload_forward(gm: fx.GraphModule, ctx: PassContext) -> None:
    picked, why = candidates(gm, ctx)
    plan, nbytes = offload_nodes(gm, picked, ctx)
    ctx.handoff[NAME] = plan
    ctx.notes.append(f"offloaded: {why}, {nbytes / MIB:.1f} MiB")


def offload_nodes(gm: fx.GraphModule, picked: list[fx.Node], ctx: PassContext) -> tuple[dict[str, int], int]:
    """Insert ``dc.offload_activation`` after the last forward use of each of ``picked``;
    returns the plan (node name -> activation id) and the bytes offloaded."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    runtime = runtime_storages(g)
    plan, nbytes = {}, 0
    for aid, n in enumerate(picked):
        src = runtime_source(n)
        if src is not None or set(storage_keys(n) or ()) & runtime:
            where = f"an output of {src.name}" if src is not None else "its storage is a dc op's output"
            raise AssertionError(
                f"offload_activations: {n.name} is a buffer the runtime keeps ({where}); freeing it "
                "would free the runtime's gathered parameter")
        last, readers = last_reader(value_group(g, n), order, DC.offload_activation.default)
        with g.inserting_after(last):
            op = g.call_function(DC.offload_activation.default, (n, readers, aid))
        op.meta["val"] = None
        plan[n.name] = aid
        nbytes += _nbytes(n)
    return plan, nbytes


def reload_starts(need_ms: list[float], copy_ms: list[float]) -> list[float]:
    """When each reload starts (ms) so that it ends by its reader's start ``need_ms``, the reloads
    sharing one copy stream: latest deadline first, each as late as it can start and still end
    before its reader once the later ones are done. (``plan.offload_choice`` prices the same
    placement.)"""
    out = [0.0] * len(need_ms)
    free_by = float("inf")   # the copy stream must be free of this reload by then (the next one starts)
    for k in sorted(range(len(need_ms)), key=lambda k: -need_ms[k]):
        out[k] = min(need_ms[k], free_by) - copy_ms[k]
        free_by = out[k]
    return out


def _reload_points(nodes: list[fx.Node], firsts: list[int], sizes: list[int], ctx: PassContext) -> list[int]:
    """Per reload (its first use's index in ``nodes`` and its bytes), the index in ``nodes``
    before which it starts. With a profile, by :func:`reload_starts` on the profiled node times:
    a reload placed only by its own copy time would queue behind the one before it and make
    compute wait."""
    gp = ctx.profile.get(ctx.graph_id, ctx.kind) if ctx.profile is not None else None
    if gp is None:
        return [max(0, f - ctx.params.lookahead_nodes) for f in firsts]
    lat = gp.by_name()
    starts_ms, t = [], 0.0
    for n in nodes:
        starts_ms.append(t)
        p = lat.get(n.name)
        t += p.latency_ms if p is not None else 0.0
    starts_ms.append(t)
    bytes_per_ms = ctx.params.h2d_gbps * 1e6
    starts = reload_starts([starts_ms[f] for f in firsts], [b / bytes_per_ms for b in sizes])
    out = []
    for f, start in zip(firsts, starts):
        i = f
        while i > 0 and starts_ms[i] > start:
            i -= 1
        out.append(i)
    return out


def reload_backward(gm: fx.GraphModule, ctx: PassContext) -> None:
    g = gm.graph
    plan = ctx.handoff.get(NAME, {})
    placeholders = {n.name: n for n in g.nodes if n.op == "placeholder"}
    nodes = [n for n in g.nodes if n.op == "call_function"]
    index = {n: i for i, n in enumerate(nodes)}
    out = next(n for n in g.nodes if n.op == "output")
    found = []  # (placeholder, activation id, index of its first use)
    for name, aid in plan.items():
        p = placeholders.get(name)
        if p is None:
            continue
        users = [u for a in alias_closure(p) for u in a.users if u.op == "call_function" and u is not a]
        first = min((index[u] for u in users if u in index), default=len(nodes))
        found.append((p, aid, first))
    starts = _reload_points(nodes, [f for _, _, f in found], [_nbytes(p) for p, _, _ in found], ctx)
    for (p, aid, first), start in zip(found, starts):
        at_first = nodes[first] if first < len(nodes) else out
        with g.inserting_before(at_first):
            w = g.call_function(DC.wait_activation.default, (p, aid))
        w.meta["val"] = None
        before = nodes[start] if start < first else w
        with g.inserting_before(before):
            r = g.call_function(DC.reload_activation.default, (p, aid))
        r.meta["val"] = None
    ctx.notes.append(f"reloads: {len(found)} of {len(plan)} offloaded activations "
                     f"({'profile-guided' if ctx.profile is not None else f'{ctx.params.lookahead_nodes} nodes ahead'})")


@register_pass(NAME, OffloadActivationsParams, graph_only=False, offline=OFFLINE_RERUN,
               planned=("blocks", "h2d_gbps"),
               planner_adds=True)   # added by the planner where offloading blocks beats recomputing them
def offload_activations(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Offload large saved activations to host memory between their forward and backward uses."""
    if ctx.kind == "forward":
        offload_forward(gm, ctx)
    elif ctx.kind == "backward":
        reload_backward(gm, ctx)
    else:
        return gm
    gm.graph.lint()
    gm.recompile()
    return gm
