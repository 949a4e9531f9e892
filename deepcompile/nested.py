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
   subclass whose ``forward`` is ``compat.nested_region(cls.forward)``, one subclass per class:
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
   (``compat.inline_subgraphs``; every copied node's module scope names its own layer), then
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

from deepcompile import compat

_SUBCLASSES: dict[type, type] = {}


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
        sub = type(cls.__name__, (cls,), {
            "forward": compat.nested_region(cls.forward),
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
        compat.cache_nested_region_schemas()
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
    placeholder for a saved value keeps the removed name (``compat.restride_saved`` reads it).
    Returns the number of calls inlined."""
    hop = torch.ops.higher_order.invoke_subgraph
    if renamed:
        _rename_saved(gm, renamed)
    calls = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is hop)
    aliases = compat.inline_subgraphs(gm) if calls else {}

    def id_of(node: Any) -> int | None:
        if not isinstance(node, fx.Node):
            return None
        if node.op == "placeholder":
            i = compat.aot_input_index(node)
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
        compat.rename_node(p, target)
        if p.name == target:
            phs[target] = p
