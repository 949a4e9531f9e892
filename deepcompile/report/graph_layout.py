"""Module-collapsed views of a recorded graph (shared by the HTML report and the widgets).

A 32-layer model's backward graph has thousands of nodes; nobody reads that. Here the nodes are
grouped by their ``nn.Module`` scope cut to a depth (by default: up to the first ModuleList
index, so ``blocks.7.attn.qkv`` -> ``blocks.7``), with edges between groups, op counts per group
and the communication ops (``dc.*``) counted separately so they can be coloured.

Where a node has no scope (AOTAutograd's backward loses most of it): communication ops take the
module of the parameter they move (learnt from any version that scoped that parameter),
placeholders go to ``inputs``, the output to ``outputs``, and every other unscoped node joins a
``(top)`` group, one per contiguous run in graph order, so the picture keeps the graph's order.

Output: :func:`collapse` (data), :func:`to_dot` (graphviz text), :func:`render_svg` (graphviz
``dot`` when installed and the picture is not too big, else a simple order-based SVG layout).
"""
from __future__ import annotations

import html
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from deepcompile.record.estimate import comm_kind, inputs_of

DOT_MAX_ELEMENTS = 1500

COMM_COLORS = {
    "allgather_param": "#f4a261", "wait_allgather": "#f6bd60", "release_param": "#e9c46a",
    "reduce_grad": "#b185db", "end_backward": "#cdb4db", "unshard": "#ef476f", "shard_grad": "#ef476f",
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


# --------------------------------------------------------------------------- rendering
def _group_label_lines(g: Group, full_nodes: list[dict] | None = None) -> list[str]:
    if full_nodes is not None:  # full view: the node itself
        n = full_nodes[g.node_indices[0]]
        return [n["name"], _short(n["target"])]
    top = ", ".join(f"{k}×{v}" for k, v in g.ops.most_common(3))
    more = len(g.ops) - 3
    inf = f", {g.inferred} placed by order" if g.inferred else ""
    lines = [f"{g.key}  ({g.n_ops} nodes{inf})"]
    if g.ops:
        lines.append(top + (f", +{more} kinds" if more > 0 else ""))
    return lines


def _dq(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(c: Collapsed, title: str = "", full_nodes: list[dict] | None = None) -> str:
    """Graphviz text: one cluster per group (compute summary + one coloured node per comm kind)."""
    out = ["digraph G {", "  graph [rankdir=TB, compound=true, fontname=Helvetica, fontsize=11, "
           f"newrank=true, nodesep=0.25, ranksep=0.35, label={_dq(title)}, labelloc=t];",
           "  node [shape=box, style=\"rounded,filled\", fontname=Helvetica, fontsize=10, height=0.3];",
           "  edge [color=\"#777777\", arrowsize=0.6, fontsize=8, fontname=Helvetica];"]
    rep: dict[int, str] = {}
    for g in c.groups:
        lines = _group_label_lines(g, full_nodes)
        if full_nodes is not None:
            n = full_nodes[g.node_indices[0]]
            ck = comm_kind(n)
            color = comm_color(ck) if ck else (IO_COLOR if n["op"] in ("placeholder", "output", "get_attr")
                                               else COMPUTE_COLOR)
            nid = f"n{g.index}"
            out.append(f"  {nid} [label={_dq(chr(10).join(lines))}, fillcolor={_dq(color)}, "
                       f"id={_dq('node-' + n['name'])}, tooltip={_dq(n['target'])}];")
            rep[g.index] = nid
            continue
        out.append(f"  subgraph cluster_{g.index} {{")
        out.append(f"    label={_dq(lines[0])}; style=\"rounded\"; color=\"#88aaaa\"; fontsize=10; "
                   f"id={_dq('group-' + g.key)};")
        first = None
        if g.ops or g.is_io or not g.comm:
            nid = f"g{g.index}c"
            body = lines[1] if len(lines) > 1 else ("" if not g.is_io else f"{g.n_ops} tensors")
            out.append(f"    {nid} [label={_dq(body or g.key)}, fillcolor={_dq(IO_COLOR if g.is_io else COMPUTE_COLOR)}];")
            first = nid
        for k, (kind, cnt) in enumerate(sorted(g.comm.items())):
            nid = f"g{g.index}m{k}"
            out.append(f"    {nid} [label={_dq(f'{kind} ×{cnt}')}, fillcolor={_dq(comm_color(kind))}, "
                       "shape=box, class=\"comm\"];")
            first = first or nid
        members = ([f"g{g.index}c"] if first == f"g{g.index}c" else []) + \
            [f"g{g.index}m{k}" for k in range(len(g.comm))]
        if len(members) > 1:  # one row per module: keeps the layers stacked top to bottom
            out.append(f"    {{rank=same; {'; '.join(members)};}}")
        out.append("  }")
        rep[g.index] = first
    for a, b, cnt in c.edges:
        attrs = [] if full_nodes is not None else [f"ltail=cluster_{a}", f"lhead=cluster_{b}"]
        if cnt > 1:
            attrs.append(f"label={_dq(str(cnt))}")
        if full_nodes is None and (c.groups[a].is_io or c.groups[b].is_io):
            attrs.append('constraint=false, style=dashed, color="#bbbbbb"')  # fan-in/out: no ranking
        out.append(f"  {rep[a]} -> {rep[b]} [{', '.join(attrs)}];")
    out.append("}")
    return "\n".join(out)


def have_dot() -> bool:
    return shutil.which("dot") is not None


def _n_elements(c: Collapsed) -> int:
    return len(c.groups) + sum(len(g.comm) for g in c.groups) + len(c.edges)


def render_svg(c: Collapsed, title: str = "", full_nodes: list[dict] | None = None,
               *, use_dot: bool | None = None, timeout: float = 60.0) -> str:
    """An ``<svg>`` element (no XML prolog), via graphviz when possible, else :func:`simple_svg`."""
    if use_dot is None:
        use_dot = have_dot() and _n_elements(c) <= DOT_MAX_ELEMENTS
    if use_dot:
        try:
            r = subprocess.run(["dot", "-Tsvg"], input=to_dot(c, title, full_nodes).encode(),
                               capture_output=True, timeout=timeout, check=True)
            svg = r.stdout.decode("utf-8", errors="replace")
            i = svg.find("<svg")
            if i >= 0:
                return svg[i:].replace("<svg ", '<svg class="graph dot" ', 1)
        except (OSError, subprocess.SubprocessError):
            pass
    return simple_svg(c, title, full_nodes)


def simple_svg(c: Collapsed, title: str = "", full_nodes: list[dict] | None = None) -> str:
    """A dependency-free layout: groups as boxes top to bottom in graph order, comm ops as coloured
    chips inside them, edges as arcs on the right (wider arcs for longer jumps)."""
    e = html.escape
    W, x0, y = 460, 10, 30
    box_y: dict[int, tuple[float, float]] = {}
    parts = []
    for g in c.groups:
        lines = _group_label_lines(g, full_nodes)
        chips = sorted(g.comm.items())
        h = 16 + 14 * (len(lines) - 1) + (18 if chips else 0) + 6
        fill = IO_COLOR if g.is_io else COMPUTE_COLOR
        if full_nodes is not None:
            ck = comm_kind(full_nodes[g.node_indices[0]])
            fill = comm_color(ck) if ck else fill
        parts.append(f'<g class="group" id="{e("group-" + g.key)}"><rect x="{x0}" y="{y}" width="{W}" '
                     f'height="{h}" rx="6" fill="{fill}" stroke="#88aaaa"/>')
        for k, line in enumerate(lines):
            bold = ' font-weight="bold"' if k == 0 else ""
            parts.append(f'<text x="{x0 + 8}" y="{y + 14 + 14 * k}" font-size="{11 if k == 0 else 10}"'
                         f'{bold}>{e(line)}</text>')
        cx = x0 + 8
        for kind, cnt in chips:
            label = f"{kind} ×{cnt}"
            w = 7 * len(label) + 10
            parts.append(f'<g class="comm"><rect x="{cx}" y="{y + h - 22}" width="{w}" height="16" rx="3" '
                         f'fill="{comm_color(kind)}"/><text x="{cx + 5}" y="{y + h - 10}" font-size="10">'
                         f'{e(label)}</text></g>')
            cx += w + 6
        parts.append("</g>")
        box_y[g.index] = (y, y + h)
        y += h + 14
    arcs = []
    for a, b, cnt in c.edges:
        ya, yb = box_y[a][1] - 4, box_y[b][0] + 4
        span = abs(b - a)
        bend = x0 + W + 8 + min(200, 12 * span ** 0.7)
        arcs.append(f'<path d="M{x0 + W},{ya} C{bend},{ya} {bend},{yb} {x0 + W},{yb}" fill="none" '
                    f'stroke="#999" stroke-width="{min(3.0, 0.8 + 0.2 * cnt):.1f}" marker-end="url(#arr)"/>')
    width = x0 + W + 230
    return (f'<svg class="graph simple" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + 10}" '
            f'viewBox="0 0 {width} {y + 10}" font-family="Helvetica,Arial,sans-serif">'
            '<defs><marker id="arr" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" markerHeight="6" '
            'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#999"/></marker></defs>'
            f'<text x="{x0}" y="18" font-size="12" font-weight="bold">{e(title)}</text>'
            + "".join(arcs) + "".join(parts) + "</svg>")
