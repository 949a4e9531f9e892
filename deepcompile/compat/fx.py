"""torch.fx shims: node and graph internals, storage identity, size hints. Checked against torch
2.11 (GPU machines) and 2.13 (CI) unless a function says otherwise."""
from __future__ import annotations

import torch
import torch.fx as fx


def mark_side_effect(op) -> None:
    """Keep a side-effect-only op through dead-code elimination: ``torch.fx.node.has_side_effect`` for
    FX's (and 2.13 Inductor's ``is_impure``); Inductor checks the mutated argument in its schema."""
    fn = getattr(torch.fx.node, "has_side_effect", None)
    if fn is not None:
        fn(op)


def rename_node(n: fx.Node, name: str) -> None:
    """Give ``n`` the name ``name``, or ``name`` with a suffix if its graph has used it
    (``Node._rename``: the namespace's next free name for the candidate)."""
    n._rename(name)


def op_schema(target):
    """The schema of an aten/custom op overload (``torch._ops.OpOverload._schema``), or None for
    anything else (``operator.getitem``, Python callables)."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return target._schema


def storage_key(t: torch.Tensor) -> int | None:
    """An identity for ``t``'s storage (fake views share their base's) or None: the StorageImpl's
    address ``UntypedStorage._cdata``, which torch's own ``StorageWeakRef`` keys on."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def size_hint(x, fallback: int = 0) -> int:
    """A concrete int for a possibly symbolic size: its traced example value, without adding a
    guard; for budgets and costs, never for control flow that must hold for every size.
    ``optimization_hint`` in 2.13, ``hint_int`` in 2.11; both read ``SymNode.hint`` first."""
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
    """``gm`` as a ``_LazyGraphModule`` (Inductor's class) over the same graph, generating code when
    run, not at each ``recompile()`` of the eager GraphModules AOTAutograd hands us (seconds of a
    32-layer CPU compile). It becomes the graph's ``owning_module``: the caller uses it from then on.
    ``meta`` and ``shape_env``, which ``__init__`` resets, are carried over. 2.11 checked by source."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if isinstance(gm, _LazyGraphModule):
        return gm
    out = _LazyGraphModule(gm, gm.graph)
    out.meta.update(getattr(gm, "meta", {}))
    if getattr(gm, "shape_env", None) is not None:
        out.shape_env = gm.shape_env
    return out


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A lazy (``lazy_graph``) deep copy of a partitioned graph, nodes' meta and fake values included."""
    import copy

    src = lazy_graph(gm)
    try:
        return copy.deepcopy(src)
    finally:
        if src is not gm:  # the wrapper took the graph; the original stays its owner
            gm.graph.owning_module = gm


def fast_graph_copy(src: fx.Graph) -> fx.Graph:
    """A copy of ``src`` (meta shallow-copied) for the what-if's re-plans, one per candidate plan.
    2.13's ``create_node`` pytree-walks every argument for raw SymInts: two thirds of a
    ``graph_copy``. This does what ``create_node`` does after that (name, ``_insert``, the
    ``find_nodes`` table, ``_len``; as in 2.11), or ``graph_copy`` for another layout."""
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
