"""The graph view's picture: layouts, box colours, diff chips, the legend strip.

:class:`GraphRenderMixin` draws the state of a :class:`~deepcompile.widgets.graph_view.GraphModel`
(its base class): graphviz's nested layout (``level_layout.nested_svg``, one small layout per
open module, cached by structure) or the order-based column without graphviz
(``level_layout.simple_svg``), then marks the boxes through their ``id="group-<key>"`` attribute
(search hits, the selected node, diff outlines), draws the diff chips (:func:`add_chips`) and puts
the moved collectives on the SVG root (``data-dc-moves``, drawn as arrows by the canvas).
:class:`Rendered` is one picture with its summary; renders are cached per state and layout.
The colours and marks shared with the inspector (``COLOR_MODES``, ``DIFF_COLORS``,
``FOLD_MARK`` ...) are defined here.
"""
from __future__ import annotations

import html
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepcompile.plan import estimate as E
from deepcompile.report import graph_groups as G
from deepcompile.report import level_layout as LL
from deepcompile.vocab.memory import fmt_bytes

from .graph_groups import collapse_keys, key_chains

if TYPE_CHECKING:
    from .graph_view import GraphModel

COLOR_MODES = ("kind", "latency", "memory", "error")
DIFF_COLORS = {"added": "#2a9d8f", "removed": "#e63946", "moved": "#457b9d"}
DIFF_SYMBOLS = {"added": "+", "removed": "−", "moved": "⇡"}   # chip symbol: colour and shape both differ
MATCH_COLOR = "#d00000"
SELECT_COLOR = "#ff00aa"
FOLD_MARK, OPEN_MARK = "▸", "▾"   # a collapsed module box (click: expand) / an expanded one (click: collapse)


# --------------------------------------------------------------------------- metrics / colours
def _ramp(x: float) -> str:
    """0..1 -> white..orange..red."""
    x = max(0.0, min(1.0, x))
    r, g, b = 255, int(255 - 175 * x), int(255 - 235 * x)
    return f"#{r:02x}{g:02x}{b:02x}"


def fmt_us(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if us >= 1000 else f"{us:.1f} µs"


RAMP_STOPS = (0.0, 0.25, 0.5, 0.75, 1.0)


def legend_html(lg: dict) -> str:
    """A legend dict (:meth:`GraphModel.legend`) as a one-line HTML strip."""
    if not lg:
        return ""
    e = html.escape
    sw = ('<span style="display:inline-block;width:11px;height:11px;border-radius:2px;vertical-align:-1px;'
          'margin:0 3px 0 8px;background:{c};border:1px solid #999"></span>')
    parts = []
    if lg.get("mode") in ("latency", "memory", "error"):
        grad = ", ".join(lg["stops"])
        parts.append(f'<b>{e(lg["title"])}</b> <span class="dc-legend-min">{e(lg["min_label"])}</span>'
                     f'<span style="display:inline-block;width:140px;height:11px;margin:0 6px;vertical-align:-1px;'
                     f'border:1px solid #999;background:linear-gradient(to right, {grad})"></span>'
                     f'<span class="dc-legend-max">{e(lg["max_label"])}</span>')
    else:
        parts.append("<b>op kind</b>" + "".join(sw.format(c=c) + e(k) for k, c in lg.get("items", [])))
    for it in lg.get("diff", []):
        parts.append(f'<span class="dc-chip dc-chip-{it["status"]}" style="display:inline-block;margin-left:8px;'
                     f'padding:0 4px;border-radius:3px;color:white;background:{it["color"]}">'
                     f'{e(it["symbol"])} {e(it["status"])}</span>')
    return ('<div class="dc-graph-legend" style="font:11px Helvetica,Arial,sans-serif;margin:2px 0 4px 0">'
            + " ".join(parts) + "</div>")


_SHAPE_TAG = re.compile(r"<(polygon|rect|path)\b([^>]*?)/?>", re.DOTALL)
_NUM = re.compile(r"-?\d+(?:\.\d+)?")


def _shape_bbox(tag_attrs: str, kind: str) -> tuple[float, float, float, float] | None:
    def attr(a):
        m = re.search(rf'\b{a}="([^"]*)"', tag_attrs)
        return m.group(1) if m else None
    if kind == "rect":
        try:
            x, y, w, h = (float(attr(a) or 0) for a in ("x", "y", "width", "height"))
        except ValueError:
            return None
        return x, y, x + w, y + h
    v = attr("points" if kind == "polygon" else "d")
    nums = [float(t) for t in _NUM.findall(v or "")]
    if len(nums) < 4:
        return None
    xs, ys = nums[0::2], nums[1::2]
    return min(xs), min(ys), max(xs), max(ys)


def add_chips(svg: str, chips: dict[str, dict[str, int]]) -> str:
    """Draw each box's diff chips (``+2`` added, ``−1`` removed, ``⇡1`` moved: a coloured badge
    each) on the top right corner of the box (over its border, clear of its title), after layout (layouts stay cached without them);
    removed-only boxes get a dashed outline."""
    for key, cnt in chips.items():
        head = f'id="{html.escape("group-" + key)}"'
        i = svg.find(head)
        if i < 0:
            continue
        m = _SHAPE_TAG.search(svg, i)
        if not m:
            continue
        bb = _shape_bbox(m.group(2), m.group(1))
        if bb is None:
            continue
        _, y1, x2, _ = bb
        items = [(st, cnt[st]) for st in ("added", "removed", "moved") if cnt.get(st)]
        widths = [6.0 * len(f"{DIFF_SYMBOLS[st]}{n}") + 6 for st, n in items]
        x = x2 - sum(widths) - 3 * len(items) - 6
        out = []
        for (st, n), w in zip(items, widths):
            dash = ' stroke-dasharray="2,1"' if st == "removed" else ""
            out.append(f'<g class="dc-chip dc-chip-{st}"><rect x="{x:.1f}" y="{y1 - 6:.1f}" width="{w:.1f}" height="11" '
                       f'rx="2" fill="{DIFF_COLORS[st]}" stroke="white"{dash}/><text x="{x + 3:.1f}" y="{y1 + 2.5:.1f}" '
                       f'font-size="8.5" fill="white" font-weight="bold">{DIFF_SYMBOLS[st]}{n}</text></g>')
            x += w + 3
        tag = m.group(0)
        if set(cnt) <= {"removed"}:
            tag = tag.replace("<" + m.group(1), "<" + m.group(1) + ' stroke-dasharray="5,3"', 1)
        svg = svg[:m.start()] + tag + "".join(out) + svg[m.end():]
    return svg


@dataclass
class Rendered:
    svg: str
    summary: str
    groups: list[str]
    matches: list[dict] = field(default_factory=list)
    diff: dict | None = None
    classes: dict[str, list[str]] = field(default_factory=dict)   # group key -> dc-* classes
    layout: str = ""                                               # "dot" or "simple"
    moves: list[dict] = field(default_factory=list)   # moved collectives, with their boxes (see GraphModel.moves)
    chips: dict[str, dict[str, int]] = field(default_factory=dict)  # box key -> {"added"|"removed"|"moved": count}
    legend: dict = field(default_factory=dict)         # GraphModel.legend() of this picture

    @property
    def html(self) -> str:
        """The legend above the picture (what the inspector's canvas shows)."""
        return legend_html(self.legend) + self.svg


def _decorate_simple(svg: str, c: G.Collapsed, fills: dict[int, str], extra_label: dict[int, str],
                     cluster_style: dict[int, tuple[list[str], str]]) -> str:
    for g in c.groups:
        gid = html.escape("group-" + g.key)
        head = f'<g class="group" id="{gid}"><rect '
        i = svg.find(head)
        if i < 0:
            continue
        j = svg.find("/>", i)
        rect = svg[i + len(head):j]
        if g.index in fills:
            rect = re.sub(r'fill="[^"]*"', f'fill="{fills[g.index]}"', rect, count=1)
        cls = "group"
        if g.index in cluster_style:
            classes, color = cluster_style[g.index]
            rect = re.sub(r'stroke="[^"]*"', f'stroke="{color}" stroke-width="3"', rect, count=1)
            cls += " " + " ".join(classes)
        new = f'<g class="{cls}" id="{gid}"><rect ' + rect
        svg = svg[:i] + new + svg[j:]
        if g.index in extra_label:  # append to the first (bold) text line of the box
            k = svg.find("</text>", i)
            svg = svg[:k] + html.escape(extra_label[g.index]) + svg[k:]
    return svg


# --------------------------------------------------------------------------- render
class GraphRenderMixin:
    """Drawing of :class:`~deepcompile.widgets.graph_view.GraphModel`: its state as a cached picture."""

    def state_key(self) -> tuple:
        return (self.graph_id, self.kind, self.version, self.compare, frozenset(self.expanded),
                self.search.lower(), self.color_by, self.selected_node)

    def render(self, layout: str | None = None) -> Rendered:
        """The current state drawn with ``layout`` ("dot", "simple" or None: graphviz unless the
        picture is too big for an interactive layout). Cached per state and layout."""
        key = self.state_key() + (layout,)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        r = self._render(layout)
        if len(self._cache) > 256:
            self._cache.clear()
        self._cache[key] = r
        return r

    def cached(self, layout: str | None = None) -> Rendered | None:
        return self._cache.get(self.state_key() + (layout,))

    def snapshot(self) -> "GraphModel":
        """A copy of the state (sharing the record and the cache), safe to render on another thread."""
        import copy

        g = copy.copy(self)
        g.expanded = set(self.expanded)
        return g

    def _use_dot(self, layout: str | None) -> bool:
        if layout == "simple":
            return False
        if layout == "dot":
            return LL.have_dot()
        return LL.have_dot() if self.use_dot is None else bool(self.use_dot and LL.have_dot())

    def _fill(self, v: float) -> str:
        """The colour of a box total on the picture's scale (``self._scale``: min and max box totals)."""
        lo, hi = self._scale
        return _ramp((v - lo) / (hi - lo) if hi > lo else 1.0)

    def _metric(self, nodes: list[dict]):
        """(per-group total of the colour metric, its formatter) or (None, None) for colour-by-kind."""
        if self.color_by == "latency":
            per = self.node_latency_us(nodes)
            return (lambda idx: sum(per.get(nodes[i]["name"], 0.0) for i in idx)), fmt_us
        if self.color_by == "error":
            err = self.node_error_us(nodes)
            return (lambda idx: sum(abs(err[nodes[i]["name"]]["error_us"]) for i in idx
                                    if nodes[i]["name"] in err)), fmt_us
        if self.color_by == "memory":
            return (lambda idx: float(sum(E.node_bytes(nodes[i]) for i in idx
                                          if nodes[i]["op"] not in ("placeholder", "get_attr", "output")))), fmt_bytes
        return None, None

    @staticmethod
    def _diff_marks(nodes: list[dict], idx, status: dict) -> tuple[list[str], str, str]:
        """(dc-* classes, outline colour, label suffix) of a box holding nodes ``idx`` in a diff."""
        cnt = Counter(status[nodes[i]["name"]] for i in idx if nodes[i]["name"] in status)
        if not cnt:
            return [], "", ""
        cls = ["dc-diff"] + [f"dc-{s}" for s in ("added", "removed", "moved") if cnt[s]]
        main = next(s for s in ("added", "removed", "moved") if cnt[s])
        marks = " ".join(f"{DIFF_SYMBOLS[s]}{cnt[s]}" for s in ("added", "removed", "moved") if cnt[s])
        return cls, DIFF_COLORS[main], f" [{marks}]"

    def _render(self, layout: str | None = None) -> Rendered:
        vs = self.versions()
        if not vs:
            return Rendered('<p class="empty">no graphs in this record</p>', "no graphs recorded", [])
        nodes, status = self._nodes_and_status()
        chains, inferred = key_chains(nodes, self.expanded, self.pscopes)
        keys = [ch[-1] for ch in chains]
        v = vs[self.version]
        hits = self.matches()
        hit_groups = {m["group"] for m in hits}
        title = f"graph {self.graph_id} · {self.kind} · " + ("input" if v.after == "input" else f"after {v.after}")
        if self.compare is not None and self.compare != self.version:
            title += f" vs {vs[self.compare].after}"
        classes: dict[str, list[str]] = {}
        lg = self._legend(nodes, status, chains)
        self._scale = (lg["min"], lg["max"]) if "min" in lg else (0.0, 0.0)
        if self._use_dot(layout):
            self._mf = self._metric(nodes)
            level = self._level(nodes, status, chains, inferred, list(range(len(nodes))), 0, None, hit_groups, classes)
            svg, used = LL.nested_svg(level, title), "dot"
        else:
            svg, used = self._draw_flat(nodes, status, keys, inferred, title, hit_groups, classes), "simple"
        chips: dict[str, dict[str, int]] = {}
        for n, k in zip(nodes, keys):
            st = status.get(n["name"])
            if st:
                chips.setdefault(k, Counter())[st] += 1
        chips = {k: dict(v) for k, v in chips.items()}
        svg = add_chips(svg, chips)
        moves = self.moves((nodes, chains)) if status else []
        if moves:   # the canvas draws them as arrows (old box -> new box); the list is on the root element
            import json

            def label(m):   # the arrow's tooltip: which parameters, issued where, first used where
                names = ", ".join(m["param_names"][:6]) + (f" +{len(m['params']) - 6}" if len(m["params"]) > 6 else "")
                uses = ", ".join(list(dict.fromkeys(m["first_use"].values()))[:6])
                return (f"{m['node']} [{names}]: {m['from'] or 'top'} → {m['to'] or 'top'}, "
                        f"{m['earlier']} nodes earlier; first used at {uses}")

            data = [{"from": m["from_key"], "to": m["to_key"], "node": m["node"], "label": label(m)} for m in moves]
            svg = svg.replace("<svg ", f'<svg data-dc-moves="{html.escape(json.dumps(data))}" ', 1)
        d = None
        n_boxes = len(set(keys))
        summary = f"{title}: {len(v.nodes)} nodes in {n_boxes} boxes"
        if self.expanded:
            summary += f" ({len({k for c in chains for k in c[:-1]})} open)"
        if status:
            sc = Counter(status.values())
            d = {"added": sc["added"], "removed": sc["removed"], "moved": sc["moved"],
                 "comm_added": G.diff(vs[self.compare].nodes, v.nodes)["comm_added"]}
            comm = ", ".join(f"{k} +{n}" for k, n in sorted(d["comm_added"].items()))
            summary += f"; diff: +{d['added']} added, −{d['removed']} removed, {d['moved']} moved" + (
                f" (comm: {comm})" if comm else "")
            if moves:
                summary += f"; {len(moves)} collective(s) issued earlier"
        if self.search:
            summary += f"; search {self.search!r}: {len(hits)} node(s) in {len(hit_groups)} box(es)"
        if self.selected_node is not None:
            where = next((k for n, k in zip(nodes, keys) if n["name"] == self.selected_node), None)
            summary += (f"; selected {self.selected_node}" + (f" (in {where})" if where else " (not in this graph)"))
        return Rendered(svg, summary, list(dict.fromkeys(keys)), hits, d, classes, used, moves, chips, lg)

    def _level(self, nodes, status, chains, inferred, idxs: list[int], depth: int, parent: str | None,
               hit_groups: set, classes: dict) -> LL.Level:
        """The boxes directly inside ``parent`` (None: the top level), open modules recursively."""
        c = collapse_keys([nodes[i] for i in idxs], [chains[i][depth] for i in idxs], [inferred[i] for i in idxs])
        metric, fmt = self._mf
        members = {g.index: [idxs[j] for j in g.node_indices] for g in c.groups}
        totals = {g.index: metric(members[g.index]) for g in c.groups if not g.is_io} if metric else {}
        boxes = []
        for g in c.groups:
            mem = members[g.index]
            rel = g.key if parent is None else g.key[len(parent) + 1:]
            single = parent is not None and g.key.startswith(parent + "/")
            is_open = g.key in self.expanded
            extra = ""
            if g.index in totals:
                extra = f" · {fmt(totals[g.index])}"
            cls, stroke, marks = self._diff_marks(nodes, mem, status)
            extra += marks
            if g.key in hit_groups:
                cls, stroke = cls + ["dc-match"], MATCH_COLOR
            if self.selected_node is not None and not is_open and any(nodes[i]["name"] == self.selected_node
                                                                      for i in mem):
                cls, stroke = cls + ["dc-selected"], SELECT_COLOR
            if cls:
                classes[g.key] = cls
            fill = G.IO_COLOR if g.is_io else G.COMPUTE_COLOR
            chips: list[tuple[str, int]] = []
            if single:
                n = nodes[mem[0]]
                ck = E.comm_kind(n)
                fill = G.comm_color(ck) if ck else (G.IO_COLOR if n["op"] in ("placeholder", "get_attr", "output")
                                                    else G.COMPUTE_COLOR)
                lines = [rel + extra, G._short(n["target"])]
                tip = f"{g.key} · {n['target']} (click: select)"
            else:
                lines = G.module_box_lines(g, rel, OPEN_MARK if is_open else FOLD_MARK, extra)
                chips = sorted(g.comm.items())
                tip = f"{g.key} ({g.n_ops} nodes) · click: {'collapse' if is_open else 'expand'}"
            if g.index in totals and not is_open:
                fill = self._fill(totals[g.index])
            child = None
            if is_open:
                child = self._level(nodes, status, chains, inferred, mem, depth + 1, g.key, hit_groups, classes)
            boxes.append(LL.Box(g.key, lines, fill, chips, child, cls, stroke or None, tip))
        io = {g.index for g in c.groups if g.is_io}
        edges = [(a, b, n) for a, b, n in c.edges if a not in io and b not in io]   # fan-in/out: box labels say it
        return LL.Level(boxes, edges)

    def prewarm(self, limit: int = 8, budget_s: float = 3.0, min_nodes: int = 8) -> int:
        """Lay out, ahead of a click, the inside of the shown top-level modules (distinct structures
        only: one decoder layer stands for all identical ones). Returns the number of graphviz runs."""
        import time

        if not self._use_dot(None):
            return 0
        t0 = time.perf_counter()
        nodes, status = self._nodes_and_status()
        leaves, _ = self.view_keys()
        self._mf = self._metric(nodes)
        runs, seen = 0, set()
        for key in leaves:
            if "/" in key or key in ("inputs", "outputs") or runs >= limit or time.perf_counter() - t0 > budget_s:
                continue
            chains, inferred = key_chains(nodes, self.expanded | {key}, self.pscopes)
            idxs = [i for i, ch in enumerate(chains) if key in ch[:-1]]
            if len(idxs) < min_nodes:
                continue
            depth = chains[idxs[0]].index(key) + 1
            lvl = self._level(nodes, status, chains, inferred, idxs, depth, key, set(), {})
            if any(b.child is not None for b in lvl.boxes):
                continue
            text = LL.level_dot(lvl, {})
            if text in seen or text in LL.LEVEL_CACHE:
                seen.add(text)
                continue
            seen.add(text)
            LL.nested_level_svg(lvl)
            runs += 1
        return runs

    def _draw_flat(self, nodes, status, keys, inferred, title, hit_groups, classes) -> str:
        """The order-based picture of all shown boxes in one column (no graphviz)."""
        c = collapse_keys(nodes, keys, inferred)
        fills: dict[int, str] = {}
        extra: dict[int, str] = {}
        style: dict[int, tuple[list[str], str]] = {}
        metric, fmt = self._metric(nodes)
        if metric:
            tot = {g.index: metric(g.node_indices) for g in c.groups}
            for g in c.groups:
                if not g.is_io:
                    fills[g.index] = self._fill(tot[g.index])
                    extra[g.index] = f" · {fmt(tot[g.index])}"
        for g in c.groups:
            cls, color, marks = self._diff_marks(nodes, g.node_indices, status)
            if cls:
                style[g.index] = (cls, color)
                extra[g.index] = extra.get(g.index, "") + marks
            cls, color = style.get(g.index, ([], ""))
            if g.key in hit_groups:
                cls, color = cls + ["dc-match"], MATCH_COLOR
            if self.selected_node is not None and any(nodes[i]["name"] == self.selected_node for i in g.node_indices):
                cls, color = cls + ["dc-selected"], SELECT_COLOR
            if cls:
                style[g.index] = (cls, color)
                classes[g.key] = cls
        svg = LL.simple_svg(c, title)
        svg = _decorate_simple(svg, c, fills, extra, style)
        return svg.replace('<svg class="graph simple"', '<svg class="graph simple dc-graph"', 1)
