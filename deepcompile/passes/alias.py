"""Alias analysis on FX graphs: which nodes share storage with which.

Passes free memory by hand (``release_param`` frees a gathered parameter, ``offload_activation``
frees a saved activation's storage), so they must know every node that can still read that
storage. Schema alias annotations are not enough: ``aten._unsafe_view`` returns a tensor over its
input's storage but its schema has no ``(a)`` annotation (so autograd treats it as a fresh
tensor), and ``operator.getitem`` of a multi-output view op (``split``, ``chunk``, ``unbind``) is
not an op overload at all. Freeing ``mm`` while ``_unsafe_view(mm)`` was still read later
segfaulted a Hugging Face Llama under ``aot_eager``.

So the analysis compares *storages*: AOTAutograd and Dynamo leave a fake tensor in
``node.meta["val"]`` whose storage is shared exactly where the real one will be (fake view
kernels alias the fake storage, ``_unsafe_view`` included). Two nodes alias iff their values share
a storage. Where a node has no fake value (nodes inserted by passes, hand-built graphs) the
analysis falls back to the schema's alias annotations plus a list of ops known to share
storage without saying so, and treats getitem of an aliasing multi-output op as a view.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from deepcompile.compat import fx as fx_compat

# Ops whose output shares its input's storage although their schema has no alias annotation:
# `aten::_unsafe_view` (a view that autograd treats as a fresh tensor; AOTAutograd emits it for
# the reshape after a matmul). Named here so the check holds without fake values too.
_UNANNOTATED_ALIASING = {"aten::_unsafe_view"}


def storage_keys(node) -> frozenset[int] | None:
    """Identities of the storages ``node``'s value lives in; None when unknown (no fake value).
    An empty set: a value that is not a tensor (or holds none)."""
    if not isinstance(node, fx.Node):
        return frozenset()
    if "val" not in node.meta:
        return None
    v = node.meta["val"]
    vals = v if isinstance(v, (list, tuple)) else [v]
    keys = set()
    for t in vals:
        if isinstance(t, torch.Tensor):
            k = fx_compat.storage_key(t)
            if k is None:
                return None
            keys.add(k)
        elif t is not None and not isinstance(t, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            return None
    return frozenset(keys)


def _schema_aliases(target) -> bool:
    schema = fx_compat.op_schema(target)
    if schema is None:
        return False
    return schema.name in _UNANNOTATED_ALIASING or any(r.alias_info is not None for r in schema.returns)


def _schema_view(node: fx.Node) -> bool:
    """Fallback when fake values are missing: annotated or known aliasing ops, and getitem of one."""
    if node.target is operator.getitem:
        src = node.args[0] if node.args else None
        return isinstance(src, fx.Node) and src.op == "call_function" and _schema_aliases(src.target)
    return _schema_aliases(node.target)


def is_view(node: fx.Node) -> bool:
    """Whether ``node``'s value can share storage with one of its tensor inputs: their fake
    values share a storage, or the op is one that may alias (schema annotation, known list).
    Either is enough: erring towards "view" only keeps a storage alive longer."""
    if node.op != "call_function":
        return False
    if _schema_view(node):
        return True
    if node.target is operator.getitem:
        # an item of a multi-output op is the op's own value: a view only if the op's outputs
        # alias its inputs (split, chunk, unbind), not for fresh outputs (attention, layer norm)
        src = node.args[0] if node.args else None
        return isinstance(src, fx.Node) and is_view(src)
    mine = storage_keys(node)
    return bool(mine) and any(mine & k for k in map(storage_keys, node.all_input_nodes) if k)


def alias_closure(node: fx.Node) -> list[fx.Node]:
    """``node`` and every later node whose value shares its storage (views, views of views,
    getitems of split views...): the storage lives as long as any of them is read.

    A user joins when its fake value shares a storage with the closure, or when it is an
    aliasing op (by schema) applied to a member: a pass that merged two nodes into one (zero3
    gathers a tied parameter once) leaves users whose fake values point at the other node's
    storage, and the schema still says they alias."""
    keys = set(storage_keys(node) or ())
    seen, stack = [node], [node]
    members = {node}
    while stack:
        for u in stack.pop().users:
            if u in members or u.op != "call_function":
                continue
            uk = storage_keys(u)
            if (uk and uk & keys) or (_schema_view(u) and u.args and u.args[0] in members):
                members.add(u)
                seen.append(u)
                stack.append(u)
                keys |= uk or set()
    return seen

