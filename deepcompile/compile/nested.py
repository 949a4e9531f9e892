"""Trace each distinct decoder block once: a hierarchical capture.

A flat trace has Dynamo and AOTAutograd trace every layer of the model one after the other, so
the warm-up trace grows with depth (32 layers: Dynamo 8-10 s and AOTAutograd 20-32 s on an H100
host). Here each decoder block is a nested compile region: Dynamo traces every call but
installs one body for identical layers, and AOTAutograd traces, runs Inductor's joint-graph
passes on and partitions that body once. Our passes, the record and ``blocks.py`` never see the
regions: each partitioned graph is flattened back (a copy of the body at every call) before
the first pass, so they get the same flat graph, scopes and schedule as a flat trace.

How
---
1. **wrap** (``initialize``): a block is an entry of an ``nn.ModuleList`` of two or more modules
   of one class (the unit ``blocks.py`` cuts along). Each block's class is swapped for a
   subclass whose ``forward`` is ``torch.compiler.nested_compile_region(cls.forward)``, one subclass per class:
   Dynamo keys its reuse on the function object, so every layer must call the same one. The
   user's class is not modified; ``isinstance``, the class name and the module scopes read as
   before.
2. **ids**: a ZeRO-3 parameter is gathered by ``dc.unshard(shard, id)``, the id an int that a
   traced body holds as a constant: no two layers would match. A parameter inside a wrapped
   block is gathered by ``dc.unshard_block(shard, id_tensor, shape, dtype)`` instead
   (``sharding.Unshard.use_tensor_id``): the id is a 0-d CPU tensor, one more input of the body,
   carrying its value as the attribute ``_dc_pid`` (``input_ids`` reads them off the Dynamo
   graph's example inputs); the full shape and dtype are arguments, the same in every layer.
3. **flatten** (``Backend``, first thing in each forward/backward compile): the partitioned
   graph's ``invoke_subgraph`` calls are replaced by copies of their bodies
   (``inline_subgraphs``; every copied node's module scope names its own layer), then
   ``resolve_ids`` gives each ``unshard_block`` / ``shard_grad_block`` its int form back:
   the id tensor is a forward placeholder (AOTAutograd's input descriptor gives its index among
   the example inputs) or, in the backward, a value the forward saved, named after the forward
   node it was (``names``, filled while flattening the forward). A graph whose ids cannot all be
   resolved is an error naming the node, never a silently wrong gather.

The id tensors stay inputs of the compiled graphs (AOTAutograd's calling convention is fixed),
unused after the flattening, and a forward may pass some to its backward as saved values: a few
hundred 8-byte CPU tensors a step.

Measured on this CPU (torch 2.13, tiny Llama, 32 layers, no deepcompile: ``/tmp/exp/hier2.py``
style, parametrized Linear weights): Dynamo+AOTAutograd 15.6 s flat against 9.4 s nested.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from deepcompile.compat import aot as aot_compat
from deepcompile.compat import fx as fx_compat

_SUBCLASSES: dict[type, type] = {}


_SCHEMA_CACHE = None


def cache_nested_region_schemas() -> bool:
    """One schema per distinct body and operand metadata for ``invoke_subgraph`` (torch 2.11).

    ``InvokeSubgraphHOP.gen_schema`` re-traces the body (``materialize_as_graph``) at every call it
    is asked for, and 2.11 asks at every layer's call in each of AOTAutograd's passes over the
    graph (autograd's ``maybe_run_autograd``, functionalization's alias/mutation checks): 80 traces
    of the body at 16 layers, 8 of the 8.4 s of Dynamo+AOTAutograd under cProfile on this CPU, which
    made the nested trace slower than the flat one (on the H100 host: AOTAutograd 17.3 s against
    12.4). The schema is a function of the body and its operands' types and tensor metadata only
    (``HopSchemaGenerator`` records argument types and whether the body mutates each; the outputs'
    types), so it is cached on (body, identifier, that metadata); the body is held weakly. 2.13
    does not re-trace per call (measured: no such cost), and is left as it is. Returns whether the
    cache is installed."""
    global _SCHEMA_CACHE
    if _SCHEMA_CACHE is not None:
        return True
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13):
        return False
    import weakref

    try:
        from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP
    except ImportError:  # pragma: no cover
        return False
    original = InvokeSubgraphHOP.gen_schema
    cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def meta(o):
        if isinstance(o, torch.Tensor):
            return (type(o).__name__, tuple(o.shape), tuple(o.stride()), o.dtype, o.device.type,
                    o.requires_grad, o.storage_offset())
        return (type(o).__name__,)

    def gen_schema(self, subgraph, identifier, *operands):
        body = getattr(subgraph, "subgraph", subgraph)
        try:
            key = (identifier, tuple(meta(o) for o in operands))
            per_body = cache.setdefault(body, {})
        except TypeError:  # unhashable metadata (symbolic sizes) or a body weakref cannot hold
            return original(self, subgraph, identifier, *operands)
        hit = per_body.get(key)
        if hit is None:
            hit = per_body[key] = original(self, subgraph, identifier, *operands)
        return hit

    InvokeSubgraphHOP.gen_schema = gen_schema
    _SCHEMA_CACHE = cache
    return True


def _restack(stack: dict | None, depth: int, call_stack: list) -> dict | None:
    """A body node's module scope as it would read at this call: the body was traced at the first
    call (its scope names that layer), so the call's own scope replaces the first ``depth`` entries
    and that layer's path prefix in the deeper ones."""
    if not stack or depth == 0 or len(stack) < depth:
        return stack
    items = list(stack.items())
    old = items[depth - 1][1][0] if isinstance(items[depth - 1][1], (tuple, list)) else str(items[depth - 1][1])
    new = call_stack[depth - 1][1][0] if isinstance(call_stack[depth - 1][1], (tuple, list)) else str(call_stack[depth - 1][1])
    out = dict(call_stack[:depth])
    for k, v in items[depth:]:
        path, rest = (v[0], tuple(v[1:])) if isinstance(v, (tuple, list)) else (str(v), ())
        if path == old or path.startswith(old + "."):
            path = new + path[len(old):]
        out[f"{k}@{new}"] = (path, *rest)
    return out


def inline_subgraphs(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """Replace every ``invoke_subgraph`` call of a partitioned graph by a copy of its body, in place
    (nested calls too). The HOP's form (2.11 and 2.13): ``invoke_subgraph(get_attr body, identifier,
    *operands)``, a tuple whose elements its users take with ``getitem``; the body's placeholders are
    the operands in order. Each copied node keeps its meta, with its module scope rewritten to the
    call's layer (``_restack``). Returns, for every ``getitem`` removed, the node that now stands for
    it: the partitioner names a backward input after the forward node it receives (a value the
    forward saved), so the backward graph's placeholders can be matched to the forward's values."""
    import operator

    aliases: dict[str, fx.Node] = {}
    g = gm.graph
    hop = torch.ops.higher_order.invoke_subgraph
    while True:
        calls = list(g.find_nodes(op="call_function", target=hop))
        if not calls:
            break
        for call in calls:
            body_ref, operands = call.args[0], call.args[2:]
            body = getattr(gm, body_ref.target)
            phs = [n for n in body.graph.nodes if n.op == "placeholder"]
            if len(phs) != len(operands):
                raise RuntimeError(f"deepcompile: {call.name} passes {len(operands)} operands to a body "
                                   f"with {len(phs)} inputs")
            call_stack = list((call.meta.get("nn_module_stack") or call.meta.get("fwd_nn_module_stack") or {}).items())
            depth = len(call_stack)
            env: dict[fx.Node, Any] = dict(zip(phs, operands))
            outs: tuple = ()
            with g.inserting_before(call):
                for n in body.graph.nodes:
                    if n.op == "placeholder":
                        continue
                    if n.op == "output":
                        outs = tuple(fx.map_arg(n.args[0], lambda x: env[x]))
                        continue
                    if n.op == "get_attr":
                        attr = f"_dc_inlined_{body_ref.target}_{n.target}".replace(".", "_")
                        if not hasattr(gm, attr):
                            setattr(gm, attr, getattr(body, n.target))
                        new = g.get_attr(attr)
                        new.meta = dict(n.meta)
                    else:
                        new = g.node_copy(n, lambda x: env[x])
                        new.meta = dict(n.meta)
                    for key in ("nn_module_stack", "fwd_nn_module_stack"):
                        if key in new.meta:
                            new.meta[key] = _restack(new.meta[key], depth, call_stack)
                    env[n] = new
            copies = {env[n] for n in body.graph.nodes if n.op not in ("placeholder", "output")}
            for u in list(call.users):
                if u.op != "call_function" or u.target is not operator.getitem:
                    raise RuntimeError(f"deepcompile: {u.format_node()} uses {call.name} other than by getitem")
                v = outs[u.args[1]]
                name = u.name
                if isinstance(v, fx.Node):
                    aliases[name] = v
                    u.replace_all_uses_with(v, propagate_meta=False)
                elif u.users:
                    raise RuntimeError(f"deepcompile: {u.name} takes a non-tensor output ({v!r}) of {call.name}")
                g.erase_node(u)
                if isinstance(v, fx.Node) and v in copies:
                    # the copy takes the name of the getitem it replaces: the partitioner names a
                    # backward input after the forward value it receives (restride, offload plans
                    # and our ids match on it). The erased getitem's name is unique among the live
                    # nodes and stays reserved in the graph's namespace, so no new node takes it
                    # (Node._rename would pick a fresh name instead).
                    copies.discard(v)
                    v.name = name
            g.erase_node(call)
            if not body_ref.users:
                g.erase_node(body_ref)
    for name, _ in list(gm.named_children()):
        if not any(n.op == "get_attr" and n.target == name for n in g.nodes) and isinstance(getattr(gm, name), fx.GraphModule):
            delattr(gm, name)
    for k, v in list(aliases.items()):  # an alias of an alias (nested calls): the final node
        while v.name in aliases and aliases[v.name] is not v:
            v = aliases[v.name]
        aliases[k] = v
    return aliases


def block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """Every ``nn.ModuleList`` of two or more entries of one class (not containers themselves)."""
    out = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2:
            kinds = {type(c) for c in m}
            if len(kinds) == 1 and not issubclass(next(iter(kinds)), (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
                out.append(m)
    return out


def _subclass(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        # ``torch.compiler.nested_compile_region`` (public; torch 2.11 and 2.13): Dynamo traces each
        # call as an ``invoke_subgraph`` higher-order op and installs one body for every call whose
        # traced graph and inputs' metadata are the same, keyed by the function object (so one
        # wrapper per class); AOTAutograd traces and partitions each distinct body once.
        sub = type(cls.__name__, (cls,), {
            "forward": torch.compiler.nested_compile_region(cls.forward),
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "_dc_nested_of": cls})
        _SUBCLASSES[cls] = sub
    return sub


def wrap(model: nn.Module) -> int:
    """Make every block of ``model`` a nested region and give the parameters inside them tensor
    ids. Returns the number of blocks wrapped (0: no repeated blocks, nothing changed)."""
    from deepcompile.sharding import Unshard

    n = 0
    lists = block_lists(model)
    if lists:
        cache_nested_region_schemas()
    for lst in lists:
        for blk in lst:
            cls = type(blk)
            if getattr(cls, "_dc_nested_of", None) is None:
                blk.__class__ = _subclass(cls)
            for m in blk.modules():
                if isinstance(m, Unshard) and m.pid_t is None:
                    m.use_tensor_id()
            n += 1
    return n


def unwrap(model: nn.Module) -> None:
    """Undo ``wrap``: the blocks' own classes and int ids back (a flat trace)."""
    from deepcompile.sharding import Unshard

    for m in model.modules():
        orig = getattr(type(m), "_dc_nested_of", None)
        if orig is not None:
            m.__class__ = orig
        if isinstance(m, Unshard):
            m.pid_t = m.full = None


def is_wrapped(model: nn.Module) -> bool:
    return any(getattr(type(m), "_dc_nested_of", None) is not None for m in model.modules())


def input_ids(example_inputs: list) -> dict[int, int]:
    """Index among the Dynamo graph's example inputs -> parameter id, for the id tensors."""
    return {i: x._dc_pid for i, x in enumerate(example_inputs)
            if isinstance(x, torch.Tensor) and hasattr(x, "_dc_pid")}


_BLOCK_OPS = None


def _block_ops() -> dict:
    global _BLOCK_OPS
    if _BLOCK_OPS is None:
        d = torch.ops.dc
        _BLOCK_OPS = {d.unshard_block.default: d.unshard.default, d.shard_grad_block.default: d.shard_grad.default}
    return _BLOCK_OPS


def bodies(gm: fx.GraphModule) -> tuple[int, int]:
    """(region calls, distinct bodies) of a Dynamo graph: how many layers Dynamo traced as a
    nested region, and how many bodies it installed for them (one per distinct block)."""
    hop = torch.ops.higher_order.invoke_subgraph
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is hop]
    return len(calls), len({id(getattr(gm, c.args[0].target, None)) for c in calls})


def flatten(gm: fx.GraphModule, ids: dict[int, int], names: dict[str, int],
            renamed: dict[str, str] | None = None) -> int:
    """Inline the nested regions of a partitioned graph and give its gathers int ids, in place.

    ``ids``: ``input_ids`` of the Dynamo graph this graph was partitioned from; ``names``: shared
    by a graph's forward and backward (the forward's values that carry an id, by node name; the
    forward fills it, the backward reads it). ``renamed`` gets, for each forward node the inlining
    removed (a ``getitem`` of a call), the name of the node that now stands for it: the backward's
    placeholder for a saved value keeps the removed name (``trace_once.restride_saved`` reads it).
    Returns the number of calls inlined."""
    hop = torch.ops.higher_order.invoke_subgraph
    if renamed:
        _rename_saved(gm, renamed)
    calls = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is hop)
    aliases = inline_subgraphs(gm) if calls else {}

    def id_of(node: Any) -> int | None:
        if not isinstance(node, fx.Node):
            return None
        if node.op == "placeholder":
            i = aot_compat.aot_input_index(node)
            if i is not None and i in ids:
                return ids[i]
            return names.get(node.name)
        return None

    for name, v in aliases.items():
        if renamed is not None:
            renamed[name] = v.name
        pid = id_of(v)
        if pid is not None:
            names[name] = pid
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            pid = id_of(n)
            if pid is not None:
                names.setdefault(n.name, pid)
    ops = _block_ops()
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in ops:
            continue
        pid = id_of(n.args[1])
        if pid is None:
            raise RuntimeError(
                f"deepcompile: cannot tell which parameter {n.format_node()} gathers: its id tensor "
                f"{n.args[1]} is neither a graph input nor a value the forward saved. Set config "
                "trace_blocks: false to trace the model flat.")
        n.target = ops[n.target]
        n.args = (n.args[0], pid)
    gm.graph.lint()
    gm.recompile()
    return calls


def _rename_saved(gm: fx.GraphModule, renamed: dict[str, str]) -> None:
    """A backward's inputs named after forward values the flattening removed take the name of the
    forward node that stands for each: a body output that is one of its inputs (a layer's input
    saved for its backward, its shard, its id) stands for the getitem that returned it. Every
    pass that pairs a backward input with a forward value by name (offload_activations' reloads,
    the trace-once restride, our ids) then pairs them as in a flat trace. Done before the
    backward's own bodies are inlined, so none of their copies holds the name. A forward value
    the backward already receives under its own name (saved twice) is used through that input;
    the other stays, unused (the calling convention is fixed)."""
    phs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for name, p in list(phs.items()):
        target = renamed.get(name)
        if target is None or target == name:
            continue
        other = phs.get(target)
        if other is not None:
            p.replace_all_uses_with(other)
            continue
        fx_compat.rename_node(p, target)
        if p.name == target:
            phs[target] = p
