"""A recorded graph grouped by module scope (shared by the HTML report and the widgets).

A 32-layer model's backward graph has thousands of nodes; nobody reads that. Here the nodes are
grouped by their ``nn.Module`` scope cut to a depth (by default: up to the first ModuleList
index, so ``blocks.7.attn.qkv`` -> ``blocks.7``), with edges between groups, op counts per group
and the communication ops (``dc.*``) counted separately so they can be coloured.

Where a node has no scope (AOTAutograd's backward loses most of it): communication ops take the
module of the parameter they move (learnt from any version that scoped that parameter),
placeholders go to ``inputs``, the output to ``outputs``, and every other unscoped node joins a
``(top)`` group, one per contiguous run in graph order, so the picture keeps the graph's order.

Output: :func:`collapse` (groups with op counts and the edges between them), :func:`node_groups`
and :func:`scope_chains` (the group, and every enclosing module, of each node), :func:`diff` (what
a pass changed), :func:`module_box_lines` (a collapsed module's box text) and the colours of
compute, input/output and communication boxes. The pictures are drawn by
:mod:`deepcompile.report.level_layout` and :mod:`deepcompile.report.module_pictures`.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from deepcompile.plan.estimate import comm_kind, inputs_of

COMM_COLORS = {
    "allgather_param": "#f4a261", "allgather_params": "#f4a261", "wait_allgather": "#f6bd60",
    "wait_allgather_many": "#f6bd60", "release_param": "#e9c46a",
    "reduce_grad": "#b185db", "reduce_grads": "#b185db", "end_backward": "#cdb4db", "unshard": "#ef476f", "shard_grad": "#ef476f",
}
COMPUTE_COLOR = "#d7e8f7"
IO_COLOR = "#eeeeee"


def comm_color(kind: str) -> str:
    return COMM_COLORS.get(kind, "#ef476f")


_PARAM_SUFFIX = re.compile(r"\.\d+$")


def param_module_scope(scope: str) -> str:
    """``blocks.0.attn.qkv.weight.0`` (the scope of a parametrized parameter) -> ``blocks.0.attn.qkv``."""
    s = _PARAM_SUFFIX.sub("", scope)
    return s.rsplit(".", 1)[0] if "." in s else ""


def group_key(scope: str, depth: int | None = None) -> str:
    """The group of a scope: its first ``depth`` components, or (``depth=None``) everything up to
    and including the first numeric component (a ModuleList index), else the first component."""
    if not scope:
        return ""
    parts = scope.split(".")
    if depth is None:
        for i, p in enumerate(parts):
            if p.isdigit():
                return ".".join(parts[: i + 1])
        return parts[0]
    return ".".join(parts[: max(1, depth)])


def param_scopes(versions: Iterable[Any]) -> dict:
    """Parameter id -> module scope, from every communication node that carried a scope; also
    raw parametrization scope (``ln_f.weight.0``, str key) -> module scope (``ln_f``), so the
    Dynamo graph's parametrization nodes group with their module."""
    out: dict = {}
    for v in versions:
        nodes = v["nodes"] if isinstance(v, dict) else v.nodes
        for n in nodes:
            if "param" in n and n.get("scope"):
                ms = param_module_scope(n["scope"])
                out.setdefault(n["param"], ms)
                out.setdefault(n["scope"], ms)
    return out


def node_groups(nodes: list[dict], depth: int | None = None,
                pscopes: dict | None = None) -> tuple[list[str], list[bool]]:
    """The group key of every node, and whether it was inferred (see the module docstring).

    Unscoped compute nodes join the last repeated module seen (``blocks.3``: AOTAutograd's
    backward keeps scopes on few nodes, so a layer's gradient math lands in its layer), or a
    ``(top)`` group per contiguous run when the last scoped group was not a repeated module.
    """
    pscopes = pscopes or {}
    keys: list[str] = []
    inferred: list[bool] = []
    run = 0
    current = None   # the group unscoped nodes currently join
    for n in nodes:
        op, scope = n["op"], n.get("scope") or ""
        c = comm_kind(n)
        if scope in pscopes and isinstance(pscopes[scope], str):
            scope = pscopes[scope]
        elif c is not None and "param" in n:
            scope = param_module_scope(scope) if scope else pscopes.get(n["param"], "")
        guess = False
        if op in ("placeholder", "get_attr"):
            key = "inputs"
        elif op == "output":
            key = "outputs"
        elif scope:
            key = group_key(scope, depth)
            repeated = any(p.isdigit() for p in key.split("."))
            if c is None or repeated:
                current = key if repeated else None
        else:
            guess = True
            if current is None:
                run += 1
                current = f"(top){'' if run == 1 else ' #' + str(run)}"
            key = current
        keys.append(key)
        inferred.append(guess and not key.startswith("(top)"))
    return keys, inferred


@dataclass
class Group:
    key: str
    index: int
    node_indices: list[int] = field(default_factory=list)
    ops: Counter = field(default_factory=Counter)      # compute op target -> count
    comm: Counter = field(default_factory=Counter)     # dc op kind -> count
    inferred: int = 0                                  # unscoped nodes placed here by position

    @property
    def n_ops(self) -> int:
        return len(self.node_indices)

    @property
    def is_io(self) -> bool:
        return self.key in ("inputs", "outputs")


@dataclass
class Collapsed:
    groups: list[Group]
    edges: list[tuple[int, int, int]]   # (src group index, dst group index, number of data edges)
    n_nodes: int


def _short(target: str) -> str:
    t = target.split(".")
    return t[1] if len(t) > 1 and t[0] in ("aten", "prims", "dc") else target


def collapse(nodes: list[dict], depth: int | None = None, pscopes: dict | None = None,
             *, full: bool = False) -> Collapsed:
    """Group ``nodes`` (a serialized graph) by module scope; ``full=True``: one group per node."""
    if full:
        keys, inferred = [n["name"] for n in nodes], [False] * len(nodes)
    else:
        keys, inferred = node_groups(nodes, depth, pscopes)
    groups: dict[str, Group] = {}
    for i, (n, k) in enumerate(zip(nodes, keys)):
        g = groups.get(k)
        if g is None:
            g = groups[k] = Group(k, len(groups))
        g.node_indices.append(i)
        g.inferred += inferred[i]
        c = comm_kind(n)
        if c is not None:
            g.comm[c] += 1
        elif n["op"] not in ("placeholder", "get_attr", "output"):
            g.ops[_short(n["target"])] += 1
    gi = {n["name"]: groups[k].index for n, k in zip(nodes, keys)}
    edges: Counter = Counter()
    for n, k in zip(nodes, keys):
        dst = groups[k].index
        for r in inputs_of(n):
            src = gi.get(r)
            if src is not None and src != dst:
                edges[(src, dst)] += 1
    return Collapsed(list(groups.values()), [(a, b, c) for (a, b), c in edges.items()], len(nodes))


def diff(before: list[dict], after: list[dict]) -> dict:
    """What a pass changed: added/removed node names and the comm ops added, by kind."""
    b = {n["name"] for n in before}
    a = {n["name"] for n in after}
    added = [n for n in after if n["name"] not in b]
    comm = Counter(c for n in added if (c := comm_kind(n)) is not None)
    return {"added": len(added), "removed": len(b - a), "comm_added": dict(comm),
            "before": len(before), "after": len(after)}


FOLD_MARK = "▸"   # a module box that opens (the inspector's mark for a collapsed module)


def module_box_lines(g: "Group", rel: str, mark: str = FOLD_MARK, extra: str = "") -> list[str]:
    """The text of a collapsed module's box: name and size, then its three commonest ops (or,
    for the inputs/outputs box, its tensor count). Shared by the report and the inspector."""
    inf = f", {g.inferred} placed by order" if g.inferred else ""
    lines = [f"{mark} {rel} ({g.n_ops} nodes{inf}){extra}"]
    if g.is_io:
        lines.append(f"{g.n_ops} tensors")
    elif g.ops:
        more = len(g.ops) - 3
        lines.append(", ".join(f"{k}×{v}" for k, v in g.ops.most_common(3))
                     + (f", +{more} kinds" if more > 0 else ""))
    return lines


def effective_scope(n: dict, pscopes: dict) -> str:
    """The module scope a node belongs to (as :func:`node_groups` resolves it)."""
    scope = n.get("scope") or ""
    if scope in pscopes and isinstance(pscopes[scope], str):
        return pscopes[scope]
    if comm_kind(n) is not None and "param" in n:
        return param_module_scope(scope) if scope else pscopes.get(n["param"], "")
    return scope


def scope_chains(nodes: list[dict], pscopes: dict | None = None,
                 depth: int | None = None) -> tuple[list[list[str]], list[bool]]:
    """Per node, the keys of the boxes around it with every module opened, from its top-level box
    (:func:`node_groups`) down its module scope to its own box ``<module>/<node name>``
    (``["blocks.3", "blocks.3.attn", "blocks.3.attn/addmm_4"]``); and whether it was placed by order."""
    pscopes = pscopes or {}
    keys, inferred = node_groups(nodes, depth, pscopes)
    out = []
    for n, key in zip(nodes, keys):
        s = effective_scope(n, pscopes)
        chain = [key]
        for _ in range(64):
            if not s.startswith(key + "."):
                break
            key = f"{key}.{s[len(key) + 1:].split('.')[0]}"
            chain.append(key)
        chain.append(f"{key}/{n['name']}")
        out.append(chain)
    return out, inferred
