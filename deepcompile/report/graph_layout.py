"""Module-collapsed views of a recorded graph (shared by the HTML report and the widgets).

A 32-layer model's backward graph has thousands of nodes; nobody reads that. Here the nodes are
grouped by their ``nn.Module`` scope cut to a depth (by default: up to the first ModuleList
index, so ``blocks.7.attn.qkv`` -> ``blocks.7``), with edges between groups, op counts per group
and the communication ops (``dc.*``) counted separately so they can be coloured.

Where a node has no scope (AOTAutograd's backward loses most of it): communication ops take the
module of the parameter they move (learnt from any version that scoped that parameter),
placeholders go to ``inputs``, the output to ``outputs``, and every other unscoped node joins a
``(top)`` group, one per contiguous run in graph order, so the picture keeps the graph's order.

Output: :func:`collapse` (data); the per-module pictures that the inspector and the HTML report
draw, one small graphviz layout per level cached by its structure (:func:`nested_svg`,
:func:`module_levels`, :func:`prelayout`, :func:`level_skeleton`, below); :func:`simple_svg` (the
order-based column without graphviz).
"""
from __future__ import annotations

import html
import re
import shutil
import subprocess
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


def have_dot() -> bool:
    return shutil.which("dot") is not None


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


# --------------------------------------------------------------------------- nested (per-module) layout
# graphviz's cost is not the number of nodes but edge labels (each a virtual node) and long
# constraint-free edges: a 39-box graph with 169 labelled edges took ~2 s in clusters, ~0.05 s as
# plain boxes with the counts drawn as pen width. So the interactive view lays out one *level* at a
# time (the boxes directly inside one module, an expanded module being one big box whose size is
# its own level's), each a small graph; each level's graphviz text is its structural signature
# (relative names, digits in labels replaced by 0, sizes of nested boxes, edges; colours and
# highlights are applied afterwards), and layouts are cached by that text, so identical decoder
# layers are laid out once. A level too big for graphviz gets the order-based layout instead.
import threading as _threading
from collections import OrderedDict as _OrderedDict

LEVEL_DOT_MAX_BOXES = 160        # boxes of one level laid out by graphviz; more: order-based
LEVEL_DOT_MAX_ELEMENTS = 480     # boxes + edges of one level
FRAME_HEADER = 20.0              # pt above a nested level inside an expanded box
FRAME_PAD = 8.0
FRAME_FILL = "#fbfcfe"
_DIGITS = re.compile(r"\d+")
_BARE_NAME = re.compile(r"[A-Za-z_]*[A-Za-z]")   # an identifier with no _N suffix (no digits at all)


@dataclass
class Box:
    """One box of a :class:`Level`: a module (collapsed), a single node, or an expanded module
    (``child``: the level inside it). Label ``lines``: the first is the title; ``chips``: the
    communication kinds with counts. Colours and highlights are applied after layout."""
    key: str
    lines: list[str]
    fill: str = COMPUTE_COLOR
    chips: list[tuple[str, int]] = field(default_factory=list)
    child: "Level | None" = None
    classes: list[str] = field(default_factory=list)
    stroke: str | None = None
    tooltip: str = ""


@dataclass
class Level:
    boxes: list[Box]
    edges: list[tuple[int, int, int]]      # (box index, box index, number of data edges)


class LayoutCache:
    """graphviz SVG output per level text (LRU); counts hits and misses."""

    def __init__(self, size: int = 512):
        self.size = size
        self._d: _OrderedDict[str, str] = _OrderedDict()
        self._lock = _threading.Lock()
        self.hits = self.misses = 0

    def get(self, text: str) -> str | None:
        with self._lock:
            v = self._d.get(text)
            if v is not None:
                self._d.move_to_end(text)
                self.hits += 1
            else:
                self.misses += 1
            return v

    def put(self, text: str, svg: str) -> None:
        with self._lock:
            self._d[text] = svg
            self._d.move_to_end(text)
            while len(self._d) > self.size:
                self._d.popitem(last=False)

    def __contains__(self, text: str) -> bool:
        return text in self._d

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._d)


LEVEL_CACHE = LayoutCache()


def _canon(s: str, title: bool = False) -> str:
    """Layout text: every run of digits as at least three zeros (``add_7``, ``add_31`` and ``add_250``
    lay out alike: the text is put back, centred, after layout). A box title that is a bare node
    name (FX names an op's first node ``getitem``, the next ``getitem_1``) lays out as the suffixed
    form, so a layer holding a graph's first node of a kind still shares its siblings' picture (the
    nested trace's flattening puts the first ``getitem`` inside layer 0)."""
    if title and _BARE_NAME.fullmatch(s):
        s += "_0"
    return _DIGITS.sub(lambda m: "0" * max(3, len(m.group(0))), s)


def _h(s: str) -> str:  # text inside a graphviz HTML label
    return html.escape(s, quote=False)


def _box_texts(b: Box) -> list[str]:
    """The label strings of a box in the order graphviz writes their <text> elements."""
    if b.child is not None:
        return [b.lines[0]]
    return [ln for ln in b.lines if ln] + [f"{k} ×{n}" for k, n in b.chips]


def _html_label(b: Box) -> str:
    span = max(1, len(b.chips))
    rows = []
    for k, ln in enumerate(b.lines):
        if not ln:
            continue
        t = _h(_canon(ln, title=k == 0))
        t = f"<B>{t}</B>" if k == 0 else f'<FONT POINT-SIZE="9">{t}</FONT>'
        rows.append(f'<TR><TD COLSPAN="{span}">{t}</TD></TR>')
    if b.chips:
        rows.append("<TR>" + "".join(f'<TD BGCOLOR="{comm_color(k)}"><FONT POINT-SIZE="9">{_h(_canon(f"{k} ×{n}"))}'
                                     "</FONT></TD>" for k, n in b.chips) + "</TR>")
    return '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="2" CELLPADDING="1">' + "".join(rows) + "</TABLE>>"


def _frame_size(b: Box, cw: float, ch: float) -> tuple[float, float]:
    return max(cw + 2 * FRAME_PAD, 6.4 * len(b.lines[0]) + 24), ch + FRAME_HEADER + FRAME_PAD


def level_dot(level: Level, sizes: dict[int, tuple[float, float]]) -> str:
    """The graphviz text of one level, relative and digit-free: its structural signature."""
    out = ["digraph L {",
           "  graph [rankdir=TB, fontname=Helvetica, nodesep=0.25, ranksep=0.3, searchsize=30, mclimit=0.5];",
           '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10, margin="0.05,0.02", '
           f'color="#88aaaa", fillcolor="{COMPUTE_COLOR}"];',
           '  edge [color="#777777", arrowsize=0.6];']
    for i, b in enumerate(level.boxes):
        if b.child is not None:
            w, h = sizes[i]
            out.append(f'  b{i} [id="dcb{i}", shape=box, style="dashed,filled", fillcolor="{FRAME_FILL}", fixedsize=true, '
                       f"width={w / 72:.4f}, height={h / 72:.4f}, labelloc=t, label={_dq(_canon(b.lines[0]))}];")
        else:
            out.append(f"  b{i} [id=\"dcb{i}\", label={_html_label(b)}];")
    for a, c, n in level.edges:
        out.append(f"  b{a} -> b{c} [penwidth={min(3.0, 0.8 + 0.3 * n ** 0.5):.1f}];")
    out.append("}")
    return "\n".join(out)


def _run_dot(text: str, timeout: float = 60.0) -> str | None:
    hit = LEVEL_CACHE.get(text)
    if hit is not None:
        return hit
    try:
        r = subprocess.run(["dot", "-Tsvg"], input=text.encode(), capture_output=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    svg = _clean_level_svg(r.stdout.decode("utf-8", errors="replace"))
    if svg is None:
        return None
    LEVEL_CACHE.put(text, svg)
    return svg


def _clean_level_svg(svg: str) -> str | None:
    """graphviz's SVG of one level without prolog, comments, graphviz ids and edge titles."""
    i = svg.find("<svg")
    if i < 0:
        return None
    svg = svg[i:]
    svg = re.sub(r' id="(?:graph\d+|edge\d+|a_edge\d+|node\d+)"', "", svg)
    svg = re.sub(r"<title>b\d+&#45;&gt;b\d+</title>\n?", "", svg)
    svg = re.sub(r"<!--.*?-->\n?", "", svg, flags=re.S)
    return svg.replace("<title>L</title>", "", 1)


_TEXT = re.compile(r"(<text\b[^>]*>)(.*?)(</text>)", re.S)
_SHAPE = re.compile(r"<(?:path|polygon|ellipse|rect)\b[^>]*>")


def _svg_text(s: str) -> str:  # how graphviz writes a string in SVG text
    return html.escape(s, quote=False).replace("-", "&#45;")


_ELEM = re.compile(r"<(path|polygon)\b([^>]*)>|(<text\b[^>]*>)(.*?)</text>", re.S)


def _put_texts(node: str, texts: list[str]) -> str | None:
    """Put the real label strings into a node laid out with canonical ones, each centred on its
    table cell (a coloured chip) or on the box: browsers' fonts differ from graphviz's metrics."""
    if len(_TEXT.findall(node)) != len(texts):
        return None
    out, pos, it = [], 0, iter(texts)
    box_cx = cell_cx = None
    for m in _ELEM.finditer(node):
        if m.group(1):
            attr = re.search(r'(?:points|d)="([^"]+)"', m.group(2))
            nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", attr.group(1))] if attr else []
            if len(nums) >= 4:
                xs = nums[0::2]
                cx = (min(xs) + max(xs)) / 2
                if box_cx is None:
                    box_cx = cx
                else:
                    cell_cx = cx
            continue
        cx = cell_cx if cell_cx is not None else box_cx
        cell_cx = None
        tag = m.group(3)
        if cx is not None:
            tag = re.sub(r'text-anchor="[^"]*"', 'text-anchor="middle"', tag, count=1)
            tag = re.sub(r' x="[^"]*"', f' x="{cx:.2f}"', tag, count=1)
        out.append(node[pos:m.start()] + tag + _svg_text(next(it)) + "</text>")
        pos = m.end()
    out.append(node[pos:])
    return "".join(out)


def _decorate_shape(seg: str, b: Box) -> str:
    m = _SHAPE.search(seg)
    if not m:
        return seg
    tag = m.group(0)
    if b.child is None and b.fill:
        tag = re.sub(r'fill="[^"]*"', f'fill="{b.fill}"', tag, count=1)
    if b.stroke:
        tag = re.sub(r'stroke="[^"]*"', f'stroke="{b.stroke}" stroke-width="3"', tag, count=1)
    return seg[:m.start()] + tag + seg[m.end():]


def _dot_level(level: Level, children: dict[int, tuple[str, float, float]]) -> tuple[str, float, float] | None:
    sizes = {i: _frame_size(level.boxes[i], cw, ch) for i, (_, cw, ch) in children.items()}
    raw = _run_dot(level_dot(level, sizes))
    if raw is None:
        return None
    m = re.match(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"', raw)
    if not m:
        return None
    w, h = float(m.group(1)), float(m.group(2))
    parts = re.split(r'<g id="dcb(\d+)" class="node">', raw)
    out = [parts[0]]
    for k in range(1, len(parts), 2):
        i, seg = int(parts[k]), parts[k + 1]
        b = level.boxes[i]
        end = seg.find("</g>") + 4
        node, rest = seg[:end], seg[end:]
        node = re.sub(r"<title>[^<]*</title>", f"<title>{html.escape(b.tooltip or b.key)}</title>", node, count=1)
        node = _put_texts(node, _box_texts(b))
        if node is None:
            return None   # graphviz split a label differently: the caller falls back to the order-based layout
        node = _decorate_shape(node, b)
        nested = ""
        if i in children:
            csvg, cw, ch = children[i]
            pm = re.search(r'points="([^"]+)"', node)
            pts = [float(v) for v in re.findall(r"-?[\d.]+", pm.group(1))] if pm else []
            if len(pts) < 4:
                return None
            xs, ys = pts[0::2], pts[1::2]
            x = min(xs) + (max(xs) - min(xs) - cw) / 2
            y = min(ys) + FRAME_HEADER
            node = re.sub(r'(<text\b[^>]*?) y="[^"]*"', lambda mm: f'{mm.group(1)} y="{min(ys) + 14:.2f}"', node, count=1)
            nested = csvg.replace("<svg ", f'<svg x="{x:.2f}" y="{y:.2f}" ', 1)
        cls = " ".join(["node", "dc-box"] + (["dc-expanded"] if b.child is not None else []) + b.classes)
        out.append(f'<g id="group-{html.escape(b.key)}" class="{cls}">' + node + nested)
        out.append(rest)
    svg = "".join(out)
    svg = re.sub(r'^<svg width="[\d.]+pt" height="[\d.]+pt"', f'<svg class="dc-level" width="{w:.2f}" height="{h:.2f}"', svg)
    svg = svg.replace('<polygon fill="white" stroke="transparent"', '<polygon fill="none" stroke="none"', 1)
    svg = svg.replace('<polygon fill="white" stroke="none"', '<polygon fill="none" stroke="none"', 1)
    return svg, w, h


def _simple_level(level: Level, kids: dict[int, tuple[str, float, float]] | None = None,
                  use_dot: bool = False) -> tuple[str, float, float]:
    """The order-based layout of one level (boxes top to bottom in graph order, edges as arcs on
    the right), with expanded boxes holding their nested level."""
    e = html.escape
    x0, y = 4.0, 4.0
    if kids is None:
        kids = {i: nested_level_svg(b.child, use_dot) for i, b in enumerate(level.boxes) if b.child is not None}
    W = 380.0
    for i, b in enumerate(level.boxes):
        if b.child is not None:
            W = max(W, kids[i][1] + 2 * FRAME_PAD)
    parts, box_y = [], {}
    for i, b in enumerate(level.boxes):
        cls = " ".join(["group", "dc-box"] + (["dc-expanded"] if b.child is not None else []) + b.classes)
        stroke = f'stroke="{b.stroke}" stroke-width="3"' if b.stroke else 'stroke="#88aaaa"'
        if b.child is not None:
            csvg, cw, ch = kids[i]
            h = ch + FRAME_HEADER + FRAME_PAD
            parts.append(f'<g class="{cls}" id="{e("group-" + b.key)}"><title>{e(b.tooltip or b.key)}</title>'
                         f'<rect x="{x0}" y="{y}" width="{W}" height="{h}" rx="4" fill="{FRAME_FILL}" {stroke} '
                         f'stroke-dasharray="5,2"/><text x="{x0 + W / 2}" y="{y + 14}" font-size="10" '
                         f'text-anchor="middle">{e(b.lines[0])}</text></g>')
            parts.append(csvg.replace("<svg ", f'<svg x="{x0 + (W - cw) / 2:.2f}" y="{y + FRAME_HEADER:.2f}" ', 1))
        else:
            lines = [ln for ln in b.lines if ln]
            h = 16 + 14 * (len(lines) - 1) + (18 if b.chips else 0) + 6
            parts.append(f'<g class="{cls}" id="{e("group-" + b.key)}"><title>{e(b.tooltip or b.key)}</title>'
                         f'<rect x="{x0}" y="{y}" width="{W}" height="{h}" rx="6" fill="{b.fill}" {stroke}/>')
            for k, line in enumerate(lines):
                bold = ' font-weight="bold"' if k == 0 else ""
                parts.append(f'<text x="{x0 + 8}" y="{y + 14 + 14 * k}" font-size="{10 if k == 0 else 9}"{bold}>'
                             f"{e(line)}</text>")
            cx = x0 + 8
            for kind, cnt in b.chips:
                label = f"{kind} ×{cnt}"
                w = 6 * len(label) + 10
                parts.append(f'<rect x="{cx}" y="{y + h - 22}" width="{w}" height="16" rx="3" fill="{comm_color(kind)}"/>'
                             f'<text x="{cx + 5}" y="{y + h - 10}" font-size="9">{e(label)}</text>')
                cx += w + 6
            parts.append("</g>")
        box_y[i] = (y, y + h)
        y += h + 10
    arcs = []
    for a, b, cnt in level.edges:
        ya, yb = box_y[a][1] - 4, box_y[b][0] + 4
        bend = x0 + W + 8 + min(160, 12 * abs(b - a) ** 0.7)
        arcs.append(f'<path d="M{x0 + W},{ya} C{bend},{ya} {bend},{yb} {x0 + W},{yb}" fill="none" stroke="#999" '
                    f'stroke-width="{min(3.0, 0.8 + 0.3 * cnt ** 0.5):.1f}" marker-end="url(#dcarr)"/>')
    width = x0 + W + (170 if level.edges else 8)
    height = y
    svg = (f'<svg class="dc-level dc-simple" width="{width:.2f}" height="{height:.2f}" viewBox="0 0 {width:.2f} '
           f'{height:.2f}" font-family="Helvetica,Arial,sans-serif">' + "".join(arcs) + "".join(parts) + "</svg>")
    return svg, width, height


def nested_level_svg(level: Level, use_dot: bool = True) -> tuple[str, float, float]:
    """``(svg element, width, height)`` of ``level`` with its expanded boxes' levels inside."""
    children = {i: nested_level_svg(b.child, use_dot) for i, b in enumerate(level.boxes) if b.child is not None}
    small = len(level.boxes) <= LEVEL_DOT_MAX_BOXES and len(level.boxes) + len(level.edges) <= LEVEL_DOT_MAX_ELEMENTS
    if use_dot and small and have_dot():
        r = _dot_level(level, children)
        if r is not None:
            return r
    return _simple_level(level, children)


def nested_svg(level: Level, title: str = "", *, use_dot: bool = True, cls: str | None = None) -> str:
    """The whole picture: ``level`` (the top level) under a title line, sized in pt like graphviz's
    own output. Boxes carry ``id="group-<key>"`` and the ``dc-box`` class (``dc-expanded`` for open
    modules), so a front end can map clicks back to group keys. ``cls``: the outer element's class
    (default ``graph dot dc-graph dc-nested``)."""
    svg, w, h = nested_level_svg(level, use_dot)
    top = 22.0
    W, H = max(w, 7.0 * len(title) + 8), h + top
    defs = ('<defs><marker id="dcarr" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" markerHeight="6" '
            'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#999"/></marker></defs>')
    cls = "graph dot dc-graph dc-nested" if cls is None else cls
    return (f'<svg class="{html.escape(cls)}" xmlns="http://www.w3.org/2000/svg" '
            f'xmlns:xlink="http://www.w3.org/1999/xlink" width="{W:.0f}pt" height="{H:.0f}pt" viewBox="0 0 {W:.2f} {H:.2f}" '
            f'font-family="Helvetica,Arial,sans-serif">{defs}<rect width="100%" height="100%" fill="white"/>'
            f'<text x="4" y="15" font-size="12" font-weight="bold">{html.escape(title)}</text>'
            + svg.replace("<svg ", f'<svg x="0" y="{top}" ', 1) + "</svg>")


# --------------------------------------------------------------------------- every module's level (static pictures)
# The static report draws the inspector's collapsed view (the top level of :func:`nested_svg`) and,
# for every module box, the level inside it, pre-rendered so that a click can show it without a
# kernel. Identical decoder layers have identical levels (the same graphviz text, so one layout);
# their pictures differ only in their strings, so a picture is stored once as a *skeleton*
# (:func:`svg_skeleton`: every text, tooltip and box id emptied) plus each instance's strings.
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


def module_levels(nodes: list[dict], pscopes: dict | None = None, depth: int | None = None, *,
                  hint: str = "click: open") -> tuple[Level, dict[str, Level]]:
    """The collapsed top level of a graph (the inspector's collapsed view: one box per module with
    its op summary and communication chips, edge counts as pen width, no edges to the
    inputs/outputs boxes) and, for every module box at any depth, the level inside it (its
    sub-modules and its own nodes, one box each), keyed by the box's key. Module boxes carry the
    ``dc-openable`` class, :data:`FOLD_MARK` and the tooltip ``<key> · <hint>``; a node's box
    (``<module>/<node name>``: name and short target) has its key as its tooltip."""
    chains, inferred = scope_chains(nodes, pscopes, depth)
    kinds = [comm_kind(n) for n in nodes]
    shorts = [_short(n["target"]) for n in nodes]
    at = {n["name"]: i for i, n in enumerate(nodes)}
    ins = [[at[r] for r in inputs_of(n) if r in at] for n in nodes]
    inner: dict[str, Level] = {}

    def build(idxs: list[int], d: int, parent: str | None) -> Level:
        groups: dict[str, Group] = {}
        gof: dict[int, int] = {}
        for i in idxs:   # Group.node_indices: indices into ``nodes``
            k = chains[i][d]
            g = groups.get(k)
            if g is None:
                g = groups[k] = Group(k, len(groups))
            g.node_indices.append(i)
            g.inferred += inferred[i] and "/" not in k
            gof[i] = g.index
            if kinds[i] is not None:
                g.comm[kinds[i]] += 1
            elif nodes[i]["op"] not in ("placeholder", "get_attr", "output"):
                g.ops[shorts[i]] += 1
        counts: Counter = Counter()
        for i in idxs:
            dst = gof[i]
            for j in ins[i]:
                src = gof.get(j)
                if src is not None and src != dst:
                    counts[(src, dst)] += 1
        boxes = []
        for g in groups.values():
            mem = g.node_indices
            rel = g.key if parent is None else g.key[len(parent) + 1:]
            if len(chains[mem[0]]) == d + 1:   # one node's own box
                n, ck = nodes[mem[0]], kinds[mem[0]]
                fill = comm_color(ck) if ck else (IO_COLOR if n["op"] in ("placeholder", "get_attr", "output")
                                                  else COMPUTE_COLOR)
                boxes.append(Box(g.key, [rel, shorts[mem[0]]], fill, [], None, [], None, g.key))
                continue
            lines = module_box_lines(g, rel)
            boxes.append(Box(g.key, lines, IO_COLOR if g.is_io else COMPUTE_COLOR, sorted(g.comm.items()), None,
                             ["dc-openable"], None, f"{g.key} · {hint}"))
            inner[g.key] = build(mem, d + 1, g.key)
        io = {g.index for g in groups.values() if g.is_io}
        return Level(boxes, [(a, b, n) for (a, b), n in counts.items() if a not in io and b not in io])

    return build(list(range(len(nodes))), 0, None), inner


def _dot_sized(level: Level) -> bool:
    """Whether :func:`nested_level_svg` gives ``level`` to graphviz (when installed)."""
    return len(level.boxes) <= LEVEL_DOT_MAX_BOXES and len(level.boxes) + len(level.edges) <= LEVEL_DOT_MAX_ELEMENTS


def _flat_text(level: Level) -> str:
    """``level_dot(level, {})`` of a flat level, kept on the level (levels built for a static
    picture are not changed after they are built)."""
    t = level.__dict__.get("_dc_text")
    if t is None:
        t = level.__dict__["_dc_text"] = level_dot(level, {})
    return t


def prelayout(levels: Iterable[Level], workers: int = 1, timeout: float = 600.0) -> int:
    """Lay out with graphviz, ahead of :func:`nested_level_svg`, every flat level (no open box
    inside) that it would give to graphviz and that :data:`LEVEL_CACHE` does not hold: the distinct
    texts only, all of them in at most ``workers`` ``dot`` processes (many graphs in one input:
    graphviz starts once, not once per level). Returns the number of layouts made."""
    if not have_dot():
        return 0
    texts, seen = [], set()
    for lv in levels:
        if any(b.child is not None for b in lv.boxes) or not _dot_sized(lv):
            continue
        t = _flat_text(lv)
        if t not in seen and t not in LEVEL_CACHE:
            seen.add(t)
            texts.append(t)
    if not texts:
        return 0
    n = max(1, min(workers, len(texts)))
    chunks: list[list[str]] = [[] for _ in range(n)]
    load = [0] * n
    for t in sorted(texts, key=len, reverse=True):   # about equal work per process
        k = load.index(min(load))
        chunks[k].append(t)
        load[k] += len(t)

    def run(chunk: list[str]) -> int:
        docs: list[str] = []
        try:
            r = subprocess.run(["dot", "-Tsvg"], input="\n".join(chunk).encode(), capture_output=True,
                               timeout=timeout, check=True)
            docs = [d + "</svg>" for d in r.stdout.decode("utf-8", errors="replace").split("</svg>")[:-1]]
        except (OSError, subprocess.SubprocessError):
            pass
        if len(docs) != len(chunk):   # one graph failed: lay them out one by one
            return sum(_run_dot(t) is not None for t in chunk)
        made = 0
        for t, d in zip(chunk, docs):
            svg = _clean_level_svg(d)
            if svg is not None:
                LEVEL_CACHE.put(t, svg)
                made += 1
        return made

    if n == 1:
        return run(chunks[0])
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as ex:
        return sum(ex.map(run, chunks))


_SKELETON = re.compile(r'(<text\b[^>]*>)(.*?)</text>|<title>(.*?)</title>| id="group-([^"]*)"', re.S)


def svg_skeleton(svg: str) -> tuple[str, list[str], list[str], list[str]]:
    """``(skeleton, texts, tooltips, box keys)``: ``svg`` with every ``<text>`` and ``<title>``
    emptied and every box's ``id="group-<key>"`` replaced by ``data-g=""``, and the strings taken
    out, in document order. :func:`fill_skeleton` (or the report's script) puts them back."""
    texts: list[str] = []
    titles: list[str] = []
    keys: list[str] = []

    def sub(m: re.Match) -> str:
        if m.group(1) is not None:
            texts.append(html.unescape(m.group(2)))
            return m.group(1) + "</text>"
        if m.group(3) is not None:
            titles.append(html.unescape(m.group(3)))
            return "<title></title>"
        keys.append(html.unescape(m.group(4)))
        return ' data-g=""'

    return _SKELETON.sub(sub, svg), texts, titles, keys


def fill_skeleton(skeleton: str, texts: list[str], titles: list[str], keys: list[str]) -> str:
    """The inverse of :func:`svg_skeleton` (strings escaped as HTML text)."""
    it_t, it_h, it_k = iter(texts), iter(titles), iter(keys)
    e = lambda s: html.escape(s, quote=False)  # noqa: E731
    out = re.sub(r"(<text\b[^>]*>)</text>", lambda m: m.group(1) + e(next(it_t)) + "</text>", skeleton)
    out = out.replace("<title></title>", "\0")
    out = re.sub("\0", lambda m: f"<title>{e(next(it_h))}</title>", out)
    return re.sub(' data-g=""', lambda m: f' id="group-{html.escape(next(it_k))}"', out)


def level_skeleton(level: Level, *, use_dot: bool = True, cls: str = "graph dc-graph dc-level-picture",
                   cache: dict | None = None) -> tuple[str, list[str], list[str], list[str]]:
    """:func:`svg_skeleton` of the picture of a flat ``level`` (:func:`nested_svg` without a title),
    the skeleton without whitespace between elements and without graphviz's per-text font.

    With ``cache`` (a dict kept by the caller), a level whose picture is known to look like one
    drawn before is not drawn again: the skeleton of the first serves every later one and the
    strings come from the boxes themselves. graphviz's picture depends only on the level's text
    (labels with digits as zeros; texts are centred after layout) and the boxes' colours and
    classes; the order-based picture (:func:`_simple_level`) only on the boxes' numbers of lines,
    chip label lengths, colours and classes, and the edges. The first picture of a kind is checked
    against its boxes before it is reused."""
    sig, simple = None, False
    if cache is not None and all(b.child is None for b in level.boxes):
        style = tuple((b.fill, b.stroke, tuple(b.classes)) for b in level.boxes)
        if use_dot and _dot_sized(level):
            text = _flat_text(level)
            if text in LEVEL_CACHE:   # graphviz's layout (so graphviz is installed)
                sig = ("dot", text, cls, style)
        else:                         # nested_level_svg draws it with the order-based layout
            simple = True
            sig = ("simple", cls, style, tuple(level.edges),
                   tuple((sum(1 for ln in b.lines if ln), tuple(len(f"{k} ×{n}") for k, n in b.chips))
                         for b in level.boxes))
        hit = cache.get(sig) if sig is not None else None
        if hit is not None:
            skel, order = hit
            bs = [level.boxes[i] for i in order]
            return (skel, [""] + [t for b in bs for t in _box_texts(b)], [b.tooltip or b.key for b in bs],
                    [b.key for b in bs])
    svg = nested_svg(level, "", use_dot=use_dot, cls=cls)
    skel, texts, titles, keys = svg_skeleton(svg)
    # smaller: no whitespace between elements (every text is out) and no per-text font (the
    # outer element's font-family is Helvetica too)
    skel = re.sub(r">\s+<", "><", skel).replace(' font-family="Helvetica,sans-Serif"', "")
    if sig is not None and ('class="dc-level dc-simple"' in svg) == simple:   # drawn the way the key says
        pos = {b.key: i for i, b in enumerate(level.boxes)}
        order = [pos.get(k, -1) for k in keys]
        if -1 not in order and len(set(order)) == len(level.boxes) == len(order):
            bs = [level.boxes[i] for i in order]
            if texts == [""] + [t for b in bs for t in _box_texts(b)] and titles == [b.tooltip or b.key for b in bs]:
                cache[sig] = (skel, order)
    return skel, texts, titles, keys
