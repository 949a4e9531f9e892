"""torch.fx shims: node and graph internals, storage identity, size hints (torch 2.11 on the GPU
machines, 2.13 here; each function names what it relies on)."""
from __future__ import annotations

import torch
import torch.fx as fx


def mark_side_effect(op) -> None:
    """Keep a side-effect-only op through FX dead-code elimination.

    Our side-effect ops also declare a mutated argument in their schema, which is what Inductor
    (2.11 and 2.13) checks; ``torch.fx.node.has_side_effect`` covers FX's own DCE and, in 2.13,
    Inductor's ``is_impure`` too.
    """
    fn = getattr(torch.fx.node, "has_side_effect", None)
    if fn is not None:
        fn(op)


def rename_node(n: fx.Node, name: str) -> None:
    """Give ``n`` the name ``name`` if its graph has not used it (``Node._rename``, 2.11 and 2.13:
    the namespace's next free name for the candidate, so a used name gets a suffix instead)."""
    n._rename(name)


def op_schema(target):
    """The schema of an aten/custom op overload (``torch._ops.OpOverload._schema``, 2.11 and
    2.13), or None for anything else (``operator.getitem``, Python callables)."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return target._schema


def storage_key(t: torch.Tensor) -> int | None:
    """An identity for ``t``'s storage, equal for every tensor over the same storage (fake
    tensors included: a fake view shares its base's fake storage, ``_unsafe_view`` too).
    ``UntypedStorage._cdata`` is the StorageImpl's address, what torch's own ``StorageWeakRef``
    keys on (torch.multiprocessing.reductions, 2.11 and 2.13). None for tensors without one."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def size_hint(x, fallback: int = 0) -> int:
    """A concrete int for a size that may be symbolic (dynamic shapes): the example value it was
    traced with, without adding a guard. For budgets and costs only, never for control flow
    that must hold for every size. ``optimization_hint`` is 2.13's name; 2.11 has
    ``hint_int``; both read ``SymNode.hint`` (``_hint``) first."""
    if isinstance(x, int):
        return int(x)
    if isinstance(x, torch.SymInt):
        from torch.fx.experimental import symbolic_shapes as ss

        fn = getattr(ss, "optimization_hint", None) or getattr(ss, "hint_int", None)
        try:
            if fn is not None:
                return int(fn(x, fallback=fallback))
            h = x.node.hint
            return int(h) if h is not None else fallback
        except Exception:  # noqa: BLE001 - an unbacked size: no hint exists
            return fallback
    try:
        return int(x)
    except (TypeError, ValueError):
        return fallback


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of a (possibly fake, possibly symbolic-shaped) tensor, by size hints (``size_hint``)."""
    n = 1
    for s in t.shape:
        n *= size_hint(s, 1)
    return n * t.element_size()


def lazy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as a ``_LazyGraphModule`` over the same graph: its Python code is generated when it
    is first run or its ``code`` read, not at every ``recompile()``.

    AOTAutograd hands the compiler eager GraphModules, so every pass's ``recompile()``, the
    flatten of block regions and each deep copy of a kept graph generated the whole graph's
    code, most of it never run (seconds of a 32-layer CPU compile). Inductor uses the same class
    for its own graphs. The wrapper takes the graph (``owning_module`` moves to it, so get_attr
    targets resolve against it); the caller uses the
    returned module from then on. ``meta`` and ``shape_env`` are carried over (``__init__``
    resets them). Checked on 2.13 and in 2.11's source: ``_LazyGraphModule(root, graph)`` and
    its deepcopy (``_deepcopy_init``) are the same."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if isinstance(gm, _LazyGraphModule):
        return gm
    out = _LazyGraphModule(gm, gm.graph)
    out.meta.update(getattr(gm, "meta", {}))
    if getattr(gm, "shape_env", None) is not None:
        out.shape_env = gm.shape_env
    return out


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A deep copy of a partitioned graph (its nodes' meta, fake values included), lazy: its code
    is generated only if the copy is run (``lazy_graph``)."""
    import copy

    src = lazy_graph(gm)
    try:
        return copy.deepcopy(src)
    finally:
        if src is not gm:  # the wrapper took the graph; the original stays its owner
            gm.graph.owning_module = gm


def fast_graph_copy(src: fx.Graph) -> fx.Graph:
    """A copy of ``src`` (nodes, names, meta shallow-copied) for the what-if's re-plans
    (``plan.whatif``), which copy a record's rebuilt graphs once per candidate plan.

    ``Graph.graph_copy`` goes through ``create_node``, which since torch 2.13 walks every
    argument with pytree to warn about raw SymInts: two thirds of a copy's time, for graphs
    rebuilt from JSON that hold none. This builds each ``Node`` and does what ``create_node``
    does after its checks (name, ``_insert``, the ``find_nodes`` table, ``_len``), checked on
    torch 2.13 (the same steps are in 2.11's ``create_node``). Any other layout of those
    internals falls back to ``graph_copy``."""
    try:
        out = fx.Graph()
        ns, table = out._graph_namespace, out._find_nodes_lookup_table
        env: dict = {}
        get = env.__getitem__
        for n in src.nodes:
            if n.op == "output":
                out.output(fx.node.map_arg(n.args[0], get), n.type)
                continue
            name = ns.create_name(n.name, None)
            m = fx.Node(out, name, n.op, n.target, fx.node.map_arg(n.args, get), fx.node.map_arg(n.kwargs, get),
                        n.type)
            ns.associate_name_with_obj(name, m)
            out._insert(m)
            table.insert(m)
            out._len += 1
            m.meta.update(n.meta)  # (Node.__init__ made it; assigning goes through Node.__setattr__)
            env[n] = m
        if len(out.nodes) != len(src.nodes):
            raise AttributeError("node count")
        return out
    except (AttributeError, TypeError):
        out = fx.Graph()
        out.output(out.graph_copy(src, {}))
        return out
