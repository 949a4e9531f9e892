"""Causal attention restored: ``scaled_dot_product_attention(attn_mask=<the causal mask>)``
becomes ``scaled_dot_product_attention(attn_mask=None, is_causal=True)``.

Why
---
When Dynamo captures a whole Hugging Face model, the library's mask code sees that it is being
traced and builds the causal mask as a tensor (``arange`` comparisons into a ``[b, 1, L, S]``
bool or float mask) instead of passing ``None``. Every attention call then gets
``attn_mask=<that tensor>, is_causal=False``: SDPA runs full (not causal-skipping) attention and
reads the mask, about three times the work of causal flash attention in the backward (cuDNN at
seq 8192 on an H200). A model compiled one decoder layer at a time never sees this: its mask is
built eagerly, as ``None``.

What
----
This rewrite runs on each graph Dynamo captures, before AOTAutograd (``Backend._compile``; on by
default, ``config.causal_mask: false`` turns it off). For every SDPA call with a mask:

1. the mask's ancestors must depend on no graph input tensor: only constants, ``arange``-style
   factories and static sizes (a symbolic size comes from an input and fails this), with no
   random or uninitialized factory and no in-place write to any of them or their views;
2. that subgraph is evaluated once (per distinct mask node, and per distinct set of operands at
   the calls of a nested region's body) on the CPU, devices rewritten to the CPU;
3. the value must equal the causal mask for ``L == S``, broadcast over batch and heads: bool
   True exactly on and below the diagonal, or float 0 there and ``-inf`` / ``finfo.min`` above.

Only then is the call rewritten; the mask nodes left without users are removed. The math is the
same (a row's masked scores get weight exactly 0 either way), so no numerics change. Padding
masks (built from an ``attention_mask`` input), sliding windows, ``L != S`` and dynamic shapes
are left as they are.

Nested regions (``deepcompile/compile/nested.py``): a decoder layer traced as an ``invoke_subgraph``
body receives the mask as a placeholder. The body's call is rewritten when at every call site of
that body the operand feeding the mask is such a constant causal mask; the now unused
placeholder and its operand at every call site are dropped.

Why not a registered pass: the passes in ``PASSES`` run on AOTAutograd's forward and backward
graphs, where attention is already split into an aten forward and backward op pair; the mask has
to be dropped before that split, on the Dynamo graph, so this is a fixed rewrite with one switch.
"""
from __future__ import annotations

import operator
import time
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

_SDPA = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention}
# SDPA's parameters by position
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# factories whose value is not a function of their arguments: never folded
_UNFOLDABLE = ("rand", "bernoulli", "normal", "uniform", "dropout", "multinomial", "poisson", "exponential",
               "cauchy", "geometric", "empty", "seed")
_INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                      operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


class _NotConstant(Exception):
    pass


def _name(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _mutates(node: fx.Node) -> bool:
    """Whether ``node`` may write into its first argument (an in-place method or operator, ``out=``,
    ``inplace=True``)."""
    if node.op not in ("call_function", "call_method"):
        return False
    if node.target in _INPLACE_OPERATORS or "out" in node.kwargs or node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_function" and getattr(node.target, "__module__", None) == "_operator":
        return False  # operator.and_, or_, not_: no writes (the in-place ones are listed above)
    name = _name(node.target)
    return (name.endswith("_") and not name.startswith("__")) or name in (
        "__setitem__", "__iadd__", "__iand__", "__ior__", "__isub__", "__imul__")


def _static(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return all(isinstance(d, int) for d in v.shape)
    if isinstance(v, (list, tuple)):
        return all(_static(x) for x in v)
    return not isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node it reads, in graph order."""
    seen, stack = {node}, [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _storages(node: fx.Node) -> set[int]:
    from deepcompile.compat import fx as fx_compat

    v = _value(node)
    vals = v if isinstance(v, (list, tuple)) else [v]
    return {k for t in vals if isinstance(t, torch.Tensor) for k in [fx_compat.storage_key(t)] if k is not None}


def _check_foldable(graph: fx.Graph, nodes: list[fx.Node], leaves_ok: set[fx.Node]) -> None:
    """Raise _NotConstant unless ``nodes`` (an ancestor set) can be evaluated at compile time:
    no graph input except the allowed ``leaves_ok`` placeholders, no random factory, static
    shapes, and nothing in the graph writes into any of them or a view of them."""
    members = set(nodes)
    keys: set[int] = set()
    for n in nodes:
        if n.op == "placeholder":
            if n not in leaves_ok:
                raise _NotConstant(f"depends on the graph input {n.name}")
            continue
        if n.op not in ("call_function", "call_method"):
            raise _NotConstant(f"depends on {n.op} {n.name}")
        if any(w in _name(n.target).lower() for w in _UNFOLDABLE):
            raise _NotConstant(f"{n.name} ({_name(n.target)}) is not a function of its arguments")
        if not _static(_value(n)):
            raise _NotConstant(f"{n.name} has a symbolic size")
        keys |= _storages(n)
    for n in graph.nodes:
        if not _mutates(n):
            continue
        dst = n.kwargs["out"] if isinstance(n.kwargs.get("out"), fx.Node) else (n.args[0] if n.args else None)
        if not isinstance(dst, fx.Node):
            continue
        if dst in members or (keys & _storages(dst)) or (not _storages(dst) and members & set(_ancestors(dst))):
            raise _NotConstant(f"{n.name} ({_name(n.target)}) writes into it in place")


def _cpu(x: Any, method: str | None = None) -> Any:
    if isinstance(x, torch.device):
        return torch.device("cpu")
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu(a, method) for a in x)
    if isinstance(x, dict):
        return {k: ("cpu" if k == "device" and x[k] is not None else _cpu(v, method)) for k, v in x.items()}
    if method == "to" and isinstance(x, str):
        try:
            torch.device(x)
            return "cpu"
        except (RuntimeError, ValueError):
            return x
    return x


def _evaluate(nodes: list[fx.Node], env: dict[fx.Node, Any]) -> Any:
    """The value of the last of ``nodes`` (in graph order), on the CPU; ``env`` gives the leaves."""
    env = dict(env)
    with torch.no_grad():
        for n in nodes:
            if n in env:
                continue
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
            if n.op == "call_method":
                if n.target in ("cuda", "xpu", "mps"):
                    env[n] = args[0]
                    continue
                args, kwargs = _cpu(args, n.target), _cpu(kwargs, n.target)
                env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
            else:
                env[n] = n.target(*_cpu(args), **_cpu(kwargs))
    return env[nodes[-1]]


def _causal_ok(mask: Any, q: Any, k: Any) -> str | None:
    """None when ``mask`` is the causal mask for query ``q`` and key ``k`` (fake or real values),
    else why not."""
    if not isinstance(mask, torch.Tensor) or not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return "not a tensor"
    if not (_static(q) and _static(k) and _static(mask)):
        return "symbolic sizes"
    L, S = q.shape[-2], k.shape[-2]
    if L != S:
        return f"query length {L} != key length {S}"
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (L, S) or mask.dim() > q.dim():
        return f"mask shape {tuple(mask.shape)} is not [..., {L}, {S}]"
    for m, d in zip(reversed(mask.shape[:-2]), reversed(q.shape[:-2])):
        if m not in (1, d):
            return f"mask shape {tuple(mask.shape)} does not broadcast to {tuple(q.shape[:-2])}"
    tril = torch.ones(L, S, dtype=torch.bool).tril_().expand(mask.shape)
    if mask.dtype == torch.bool:
        ok = torch.equal(mask, tril)
    elif mask.dtype.is_floating_point:
        masked = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
        ok = bool(torch.where(tril, mask == 0, masked).all())
    else:
        return f"mask dtype {mask.dtype}"
    return None if ok else "not the causal mask"


def _sdpa_params(node: fx.Node) -> dict:
    p = dict(zip(_SDPA_ARGS, node.args))
    p.update(node.kwargs)
    return p


def _set_causal(node: fx.Node) -> None:
    p = _sdpa_params(node)
    p["attn_mask"], p["is_causal"] = None, True
    node.args = tuple(p.pop(k) for k in _SDPA_ARGS[:3])
    node.kwargs = p


def _drop_dead(graph: fx.Graph, candidates: set[fx.Node]) -> int:
    n = 0
    for node in reversed(list(graph.nodes)):
        if node in candidates and node.op != "placeholder" and not node.users and not node.is_impure():
            graph.erase_node(node)
            n += 1
    return n


class _Folder:
    """Compile-time values of constant subgraphs, each evaluated at most once."""

    def __init__(self):
        self.values: dict[Any, Any] = {}
        self.evaluated = 0
        self.seconds = 0.0
        self.verdicts: dict[tuple, str | None] = {}

    def causal(self, v: Any, q: Any, k: Any) -> str | None:
        """_causal_ok, once per mask value and query/key shapes (layers share one mask)."""
        key = (id(v), *(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in (q, k)))
        if key not in self.verdicts:
            t0 = time.perf_counter()
            self.verdicts[key] = _causal_ok(v, q, k)
            self.seconds += time.perf_counter() - t0
        return self.verdicts[key]

    def outer(self, graph: fx.Graph, node: fx.Node) -> Any:
        """The value of ``node`` of a top-level graph (no input may feed it)."""
        key = (node,)
        if key not in self.values:
            try:
                nodes = _ancestors(node)
                _check_foldable(graph, nodes, set())
                self.values[key] = self._run(nodes, {})
            except _NotConstant as e:
                self.values[key] = e
        v = self.values[key]
        if isinstance(v, _NotConstant):
            raise v
        return v

    def _run(self, nodes, env):
        t0 = time.perf_counter()
        try:
            return _evaluate(nodes, env)
        except Exception as e:  # noqa: BLE001 - anything it cannot run on the CPU stays as it is
            raise _NotConstant(f"could not be evaluated at compile time ({type(e).__name__}: {e})") from e
        finally:
            self.evaluated += 1
            self.seconds += time.perf_counter() - t0


def _describe(v: Any) -> str:
    return f"[{','.join(map(str, v.shape))}] {str(v.dtype).replace('torch.', '')}" if isinstance(v, torch.Tensor) else "?"


def _masked_sdpa_calls(graph: fx.Graph):
    """(node, its parameters, its mask node) of every SDPA call given a mask node and not causal."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        p = _sdpa_params(node)
        mask = p.get("attn_mask")
        if isinstance(mask, fx.Node) and not p.get("is_causal"):
            yield node, p, mask


def restore_causal_sdpa(gm: fx.GraphModule) -> list[str]:
    """Rewrite, in place, every SDPA call of ``gm`` (and of the nested-region bodies it calls) whose
    mask is a compile-time constant causal mask into ``attn_mask=None, is_causal=True``; returns
    notes for the record (what was rewritten, what was not and why). ``gm`` is recompiled when
    anything changed."""
    folder = _Folder()
    notes: list[str] = []
    done, kept = [], []
    outer_dead: set[fx.Node] = set()

    for node, p, mask in _masked_sdpa_calls(gm.graph):
        try:
            v = folder.outer(gm.graph, mask)
            why = folder.causal(v, _value(p["query"]), _value(p["key"]))
        except _NotConstant as e:
            why = str(e)
        if why:
            kept.append(f"{node.name}: {why}")
            continue
        _set_causal(node)
        outer_dead.update(_ancestors(mask))
        done.append((1, _describe(v)))

    done_b, kept_b = _rewrite_bodies(gm, folder, outer_dead)
    done += done_b
    kept += kept_b
    removed = _drop_dead(gm.graph, outer_dead)
    if done:
        shapes = sorted({s for _, s in done})
        notes.append(f"causal_mask: {sum(c for c, _ in done)} scaled_dot_product_attention call(s) given is_causal=True in place of "
                     f"a constant causal mask {', '.join(shapes)} ({folder.evaluated} evaluation(s) and "
                     f"{len(folder.verdicts)} check(s) in {folder.seconds:.3f} s; {removed} mask node(s) removed)")
        gm.graph.lint()
        gm.recompile()
    if kept:
        notes.append(f"causal_mask: {len(kept)} masked call(s) left as they are: " + "; ".join(kept[:4])
                     + (f"; ... {len(kept) - 4} more" if len(kept) > 4 else ""))
    return notes


def _rewrite_bodies(gm: fx.GraphModule, folder: _Folder, outer_dead: set[fx.Node]):
    """The SDPA calls inside ``invoke_subgraph`` bodies whose mask comes from a body placeholder fed,
    at every call site, by a constant causal mask of the outer graph."""
    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    if hop is None:
        return [], []
    sites: dict[int, tuple[fx.GraphModule, list[fx.Node]]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is hop and n.args and isinstance(n.args[0], fx.Node) \
                and n.args[0].op == "get_attr":
            body = getattr(gm, n.args[0].target, None)
            if isinstance(body, fx.GraphModule):
                sites.setdefault(id(body), (body, []))[1].append(n)
    done, kept = [], []
    for body, calls in sites.values():
        places = [n for n in body.graph.nodes if n.op == "placeholder"]
        changed = False
        dead: set[fx.Node] = set()
        for node, p, mask in _masked_sdpa_calls(body.graph):
            why, v = None, None
            try:
                nodes = _ancestors(mask)
                leaves = [n for n in nodes if n.op == "placeholder"]
                _check_foldable(body.graph, nodes, set(leaves))
                idx = [places.index(x) for x in leaves]
                for call in calls:
                    operands = call.args[2:]
                    outer = [operands[i] for i in idx]
                    if not all(isinstance(o, fx.Node) for o in outer):
                        raise _NotConstant("a call passes a non-tensor operand")
                    key = (mask, *outer)
                    if key not in folder.values:
                        try:
                            env = {x: folder.outer(gm.graph, o) for x, o in zip(leaves, outer)}
                            folder.values[key] = folder._run(nodes, env)
                        except _NotConstant as e:
                            folder.values[key] = e
                    v = folder.values[key]
                    if isinstance(v, _NotConstant):
                        raise v
                    why = folder.causal(v, _value(p["query"]), _value(p["key"]))
                    if why:
                        break
            except _NotConstant as e:
                why = str(e)
            if why:
                kept.append(f"{node.name} in {calls[0].args[0].target}: {why}")
                continue
            _set_causal(node)
            dead.update(_ancestors(mask))
            changed = True
            done.append((len(calls), _describe(v)))
        if not changed:
            continue
        _drop_dead(body.graph, dead)
        # placeholders the rewrite left unused: dropped from the body and from every call
        unused = [i for i, x in enumerate(places) if x in dead and not x.users]
        for i in reversed(unused):
            body.graph.erase_node(places[i])
            for call in calls:
                ops = list(call.args[2:])
                gone = ops.pop(i)
                call.args = (*call.args[:2], *ops)
                if isinstance(gone, fx.Node):
                    outer_dead.update(_ancestors(gone))
        body.graph.lint()
        body.recompile()
    return done, kept
