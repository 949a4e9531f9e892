"""SVG pictures of a module-collapsed graph: :func:`simple_svg` (a :class:`Collapsed` graph as the
order-based column, no graphviz) and the nested per-module layout: a :class:`Level` of
:class:`Box` es (a module, a single node, or an open module holding the level inside it), each
level laid out by graphviz ``dot`` when installed (:func:`level_dot`, cached by its text in
:data:`LEVEL_CACHE`), else by the order-based layout, and drawn whole by :func:`nested_svg`.
"""
from __future__ import annotations

import html
import re
import shutil
import subprocess
import threading as _threading
from collections import OrderedDict as _OrderedDict
from dataclasses import dataclass, field

from deepcompile.plan.estimate import comm_kind
from deepcompile.report.graph_groups import COMPUTE_COLOR, IO_COLOR, Collapsed, Group, _short, comm_color


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


# graphviz's cost is not the number of nodes but edge labels (each a virtual node) and long
# constraint-free edges: a 39-box graph with 169 labelled edges took ~2 s in clusters, ~0.05 s as
# plain boxes with the counts drawn as pen width. So the interactive view lays out one *level* at a
# time (the boxes directly inside one module, an expanded module being one big box whose size is
# its own level's), each a small graph; each level's graphviz text is its structural signature
# (relative names, digits in labels replaced by 0, sizes of nested boxes, edges; colours and
# highlights are applied afterwards), and layouts are cached by that text, so identical decoder
# layers are laid out once. A level too big for graphviz gets the order-based layout instead.
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
