"""The graph view's model: which graph, which pass, what is expanded, searched, coloured, diffed.

Plain Python (no ipywidgets): :class:`GraphModel` holds the state and :meth:`GraphModel.render`
returns the SVG and a text summary, so tests drive "clicks" by calling methods
(:meth:`GraphModel.handle_click` is what a click on the SVG does: the front end sends the
clicked box's ``group-<key>``).

Grouping is :mod:`deepcompile.report.graph_layout`'s (``node_groups``: the module-collapsed
picture of the HTML report). This module adds:

* **expansion**: an expanded group splits by its next module-scope level, down to single nodes
  (``blocks.3`` -> ``blocks.3.attn``, ``blocks.3.mlp`` -> ``blocks.3.attn/addmm_4``); with
  graphviz the open module stays as a frame around its boxes (``graph_layout.nested_svg``: one
  small graphviz layout per open module, cached by the structural signature of that module's
  level, so identical decoder layers are laid out once; a level too big for graphviz gets the
  order-based layout); without graphviz (or ``use_dot=False``) the open module's boxes replace it
  in the order-based column (``graph_layout.simple_svg``);
* **diff**: the union of two versions (removed nodes kept at their old place, so positions stay
  stable), groups marked ``dc-added`` / ``dc-removed`` / ``dc-moved`` with counts in their label;
  "moved" = a node in both versions that is off the longest common order (prefetch hoisting);
* **search** (name, op target or module scope; groups holding a hit marked ``dc-match``),
  **colour** by op kind (the report's colours), latency or memory (totals on the boxes), and a
  **selected** node (linked with the schedule view), applied to the boxes after layout through
  the ``id="group-<key>"`` attribute every box carries (so a new colour or selection reuses the
  cached layouts).

Also: **moved collectives** (:meth:`GraphModel.moves`: what the prefetch pass recorded on each
collective it moved, ``"moved"`` on the record's node, drawn *from -> to*: the SVG root carries
``data-dc-moves``, the canvas draws an arrow from the box the collective left to the box it is
issued in now; a ``⇡`` chip marks the box), **diff chips** (added ``+`` green, removed ``−`` red
and dashed, moved ``⇡`` blue: colour and symbol, badges drawn on the laid-out boxes), a **node
detail** (:meth:`GraphModel.node_detail`: shape, dtype, bytes, latency, source line, module
scope, parameters, move) and a **legend** (:meth:`GraphModel.legend`: the colour scale's min and
max in units, or the colours of the op kinds); :attr:`Rendered.html` is the legend above the SVG.

SVG renders are cached per (version, state), so switching back and forth is free.
"""
from __future__ import annotations

import bisect
import html
import re
from collections import Counter
from dataclasses import dataclass, field

from deepcompile.plan import estimate as E
from deepcompile.report import graph_layout as L

COLOR_MODES = ("kind", "latency", "memory")
DIFF_COLORS = {"added": "#2a9d8f", "removed": "#e63946", "moved": "#457b9d"}
DIFF_SYMBOLS = {"added": "+", "removed": "−", "moved": "⇡"}   # chip symbol: colour and shape both differ
MATCH_COLOR = "#d00000"
SELECT_COLOR = "#ff00aa"
FOLD_MARK, OPEN_MARK = "▸", "▾"   # a collapsed module box (click: expand) / an expanded one (click: collapse)


# --------------------------------------------------------------------------- grouping
effective_scope = L.effective_scope  # one rule for where a node belongs, shared with the report


def key_chains(nodes: list[dict], expanded: set[str], pscopes: dict,
               depth: int | None = None) -> tuple[list[list[str]], list[bool]]:
    """Per node, the chain of group keys from its top-level box down to the box that shows it
    (``["blocks.3", "blocks.3.attn", "blocks.3.attn/addmm_4"]`` with ``blocks.3`` and
    ``blocks.3.attn`` expanded); every key but the last is an expanded (open) module."""
    keys, inferred = L.node_groups(nodes, depth, pscopes)
    if not expanded:
        return [[k] for k in keys], inferred
    out = []
    for n, k in zip(nodes, keys):
        chain = [k]
        key = k
        s = effective_scope(n, pscopes)
        for _ in range(64):
            if key not in expanded:
                break
            if s.startswith(key + "."):
                rest = s[len(key) + 1:].split(".")
                key = f"{key}.{rest[0]}"
            else:
                key = f"{key}/{n['name']}"
                chain.append(key)
                break
            chain.append(key)
        out.append(chain)
    return out, inferred


def expanded_keys(nodes: list[dict], expanded: set[str], pscopes: dict,
                  depth: int | None = None) -> tuple[list[str], list[bool]]:
    """Group keys with the groups in ``expanded`` opened one scope level (or to nodes)."""
    chains, inferred = key_chains(nodes, expanded, pscopes, depth)
    return [c[-1] for c in chains], inferred


def collapse_keys(nodes: list[dict], keys: list[str], inferred: list[bool]) -> L.Collapsed:
    """``graph_layout.Collapsed`` for explicit group keys (same fields as ``collapse``)."""
    groups: dict[str, L.Group] = {}
    for i, (n, k) in enumerate(zip(nodes, keys)):
        g = groups.get(k)
        if g is None:
            g = groups[k] = L.Group(k, len(groups))
        g.node_indices.append(i)
        g.inferred += bool(inferred[i]) and "/" not in k
        c = E.comm_kind(n)
        if c is not None:
            g.comm[c] += 1
        elif n["op"] not in ("placeholder", "get_attr", "output"):
            t = n["target"].split(".")
            g.ops[t[1] if len(t) > 1 and t[0] in ("aten", "prims", "dc") else n["target"]] += 1
    gi = {n["name"]: groups[k].index for n, k in zip(nodes, keys)}
    edges: Counter = Counter()
    for n, k in zip(nodes, keys):
        dst = groups[k].index
        for r in E.inputs_of(n):
            src = gi.get(r)
            if src is not None and src != dst:
                edges[(src, dst)] += 1
    return L.Collapsed(list(groups.values()), [(a, b, c) for (a, b), c in edges.items()], len(nodes))


# --------------------------------------------------------------------------- diff
def _lis_members(seq: list[int]) -> set[int]:
    """Indices (into ``seq``) of one longest increasing subsequence."""
    tails: list[int] = []
    tails_i: list[int] = []
    prev = [-1] * len(seq)
    for i, v in enumerate(seq):
        j = bisect.bisect_left(tails, v)
        if j == len(tails):
            tails.append(v)
            tails_i.append(i)
        else:
            tails[j] = v
            tails_i[j] = i
        prev[i] = tails_i[j - 1] if j else -1
    out, i = set(), (tails_i[-1] if tails_i else -1)
    while i >= 0:
        out.add(i)
        i = prev[i]
    return out


def union_diff(before: list[dict], after: list[dict]) -> tuple[list[dict], dict[str, str]]:
    """(union node list in a stable order, node name -> "added" | "removed" | "moved").

    Removed nodes are placed right after the node that preceded them in ``before`` so that the
    picture of ``after`` keeps its layout and the removals show where they were."""
    bnames = {n["name"]: i for i, n in enumerate(before)}
    anames = {n["name"] for n in after}
    status: dict[str, str] = {}
    common = [n["name"] for n in after if n["name"] in bnames]
    keep = _lis_members([bnames[c] for c in common])
    for i, c in enumerate(common):
        if i not in keep:
            status[c] = "moved"
    for n in after:
        if n["name"] not in bnames:
            status[n["name"]] = "added"
    # removed nodes: insert after their nearest surviving predecessor in `before`
    follow: dict[str | None, list[dict]] = {}
    last_kept: str | None = None
    for n in before:
        if n["name"] in anames:
            last_kept = n["name"]
        else:
            status[n["name"]] = "removed"
            follow.setdefault(last_kept, []).append(n)
    union = list(follow.get(None, []))
    for n in after:
        union.append(n)
        union.extend(follow.get(n["name"], []))
    return union, status


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
    if lg.get("mode") in ("latency", "memory"):
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


def _decorate_simple(svg: str, c: L.Collapsed, fills: dict[int, str], extra_label: dict[int, str],
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


# --------------------------------------------------------------------------- the model
class GraphModel:
    """State of the graph view over one rank's :class:`~deepcompile.record.reader.RunRecord`."""

    def __init__(self, record, *, timings: dict | None = None, use_dot: bool | None = None):
        self.rec = record
        self.pscopes = L.param_scopes(record.graphs)
        self.use_dot = use_dot
        self.timings = timings or {}   # (graph_id, kind, node name) -> latency µs (schedule/profile)
        self.graph_id: int | None = record.graph_ids[0] if record.graph_ids else None
        self.kind: str | None = None
        self.version = 0               # index into versions(graph_id, kind)
        self.compare: int | None = None  # index of the version to diff against (None: no diff)
        self.expanded: set[str] = set()
        self.search = ""
        self.color_by = "kind"
        self.selected_node: str | None = None
        self._cache: dict[tuple, Rendered] = {}
        self._mf = (None, None)
        self._scale = (0.0, 0.0)       # min, max box totals of the colour metric in the current picture
        self._pnames = None
        self._pick_default_kind()

    # ------------------------------------------------------------ options
    @property
    def graph_ids(self) -> list[int]:
        return self.rec.graph_ids

    @property
    def kinds(self) -> list[str]:
        return self.rec.kinds(self.graph_id) if self.graph_id is not None else []

    def versions(self):
        if self.graph_id is None or self.kind is None:
            return []
        return self.rec.versions(self.graph_id, self.kind)

    @property
    def pass_names(self) -> list[str]:
        """Labels of the versions of the current graph: ``input``, then one per pass."""
        return [v.after for v in self.versions()]

    @property
    def version_labels(self) -> list[str]:
        """One label per version for the "after pass" list: its index and pass, and, where the
        graph was compiled more than once (a re-compile after the profiled step, a scheduled
        one), which compile it belongs to and at which step (the record's step numbers)."""
        vs = self.versions()
        compile_of, c = [], -1
        for v in vs:
            if v.after == "input" or c < 0:
                c += 1
            compile_of.append(c)
        n = c + 1
        if n <= 1:
            return [f"{i}: {v.after}" for i, v in enumerate(vs)]
        try:
            from deepcompile.record.steps import special_steps

            again = sorted(k for k, why in special_steps(self.rec.steps, self.rec.config).items() if "re-compile" in why)
        except Exception:
            again = []
        first = min((x["step"] for x in self.rec.steps if isinstance(x.get("step"), int)), default=None)
        steps = {0: f"step {first}"} if first is not None else {}
        steps.update({k + 1: f"step {s}" for k, s in enumerate(again)})

        def tag(k):
            at = steps.get(k)
            return f"compile {k + 1}/{n}" + (f", {at}" if at else "")
        return [f"{i}: {v.after} · {tag(compile_of[i])}" for i, v in enumerate(vs)]

    def _pick_default_kind(self) -> None:
        ks = self.kinds
        self.kind = "forward" if "forward" in ks else (ks[0] if ks else None)
        self.version = max(0, len(self.versions()) - 1)
        self.compare = None
        self.expanded.clear()

    # ------------------------------------------------------------ "clicks"
    def set_graph(self, graph_id: int) -> None:
        if graph_id not in self.graph_ids:
            raise ValueError(f"graph {graph_id} is not in this record (graphs {self.graph_ids})")
        self.graph_id = graph_id
        self._pick_default_kind()

    def set_kind(self, kind: str) -> None:
        if kind not in self.kinds:
            raise ValueError(f"graph {self.graph_id} has no {kind!r} graph (kinds {self.kinds})")
        self.kind = kind
        self.version = max(0, len(self.versions()) - 1)
        self.compare = None
        self.expanded.clear()

    def _index(self, which: int | str) -> int:
        names = self.pass_names
        if isinstance(which, str):
            if which not in names:
                raise ValueError(f"no version after {which!r} (versions {names})")
            return names.index(which)
        if not 0 <= which < len(names):
            raise ValueError(f"version {which} out of range (0..{len(names) - 1})")
        return which

    def set_pass(self, which: int | str) -> None:
        self.version = self._index(which)

    def set_diff(self, which: int | str | None) -> None:
        """Diff the shown version against another one (``None``: no diff)."""
        self.compare = None if which is None else self._index(which)

    def select_passes(self, a: int | str, b: int | str) -> None:
        """Show ``b`` diffed against ``a`` (what the passes between them changed)."""
        self.set_pass(b)
        self.set_diff(a)

    def click(self, key: str) -> None:
        """A click on a group: expand it, or collapse it (and what is open inside) when open."""
        if key in self.expanded or any(k.startswith(key + ".") or k.startswith(key + "/") for k in self.expanded):
            self.collapse(key)
        else:
            self.expand(key)

    def handle_click(self, key: str, shift: bool = False) -> tuple[str, str | None]:
        """A click on the box ``group-<key>`` of the rendered SVG (what the front end sends back).

        A collapsed module box expands; an expanded (open) box collapses; a single-node box
        (``<module>/<node>``) selects that node; with shift (or alt) the innermost open module
        around the box collapses. Returns ``(action, key or node)``; a box the current picture
        does not have (a click on a stale picture) is ``("ignored", None)``."""
        key = str(key or "")
        leaves, frames = self.view_keys()
        if key not in leaves and key not in frames:
            return "ignored", None
        if shift:
            around = [k for k in self.expanded if key.startswith(k + ".") or key.startswith(k + "/") or k == key]
            if not around:
                return "ignored", None
            k = max(around, key=len) if key not in self.expanded else key
            self.collapse(k)
            return "collapsed", k
        if key in frames:
            self.collapse(key)
            return "collapsed", key
        if "/" in key:   # a box of one node
            name = key.rsplit("/", 1)[1]
            self.select_node(name)
            return "selected", name
        self.expand(key)
        return "expanded", key

    def view_keys(self) -> tuple[list[str], list[str]]:
        """(boxes shown, in graph order; expanded modules shown as frames around their boxes)."""
        nodes, _ = self._nodes_and_status()
        chains, _ = key_chains(nodes, self.expanded, self.pscopes)
        leaves = list(dict.fromkeys(c[-1] for c in chains))
        frames = list(dict.fromkeys(k for c in chains for k in c[:-1]))
        return leaves, frames

    def outline(self) -> list[tuple[str, int, bool]]:
        """Every box of the picture in display order: ``(key, depth, is_open)``."""
        nodes, _ = self._nodes_and_status()
        chains, _ = key_chains(nodes, self.expanded, self.pscopes)
        out: dict[str, tuple[str, int, bool]] = {}
        for c in chains:
            for d, k in enumerate(c):
                if k not in out:
                    out[k] = (k, d, d < len(c) - 1)
        return list(out.values())

    def expand(self, key: str) -> None:
        if key not in self.group_keys():
            raise ValueError(f"no group {key!r} in the current view")
        self.expanded.add(key)

    def collapse(self, key: str) -> None:
        self.expanded = {k for k in self.expanded if not (k == key or k.startswith(key + ".")
                                                          or k.startswith(key + "/"))}

    def collapse_all(self) -> None:
        self.expanded.clear()

    def set_search(self, text: str) -> None:
        self.search = (text or "").strip()

    def set_color(self, mode: str) -> None:
        if mode not in COLOR_MODES:
            raise ValueError(f"colour mode {mode!r} is not one of {COLOR_MODES}")
        self.color_by = mode

    def select_node(self, name: str | None) -> None:
        self.selected_node = name

    # ------------------------------------------------------------ derived data
    def _nodes_and_status(self) -> tuple[list[dict], dict[str, str]]:
        vs = self.versions()
        if not vs:
            return [], {}
        cur = vs[self.version].nodes
        if self.compare is None or self.compare == self.version:
            return cur, {}
        union, status = union_diff(vs[self.compare].nodes, cur)
        before = {n["name"]: n.get("moved") for n in vs[self.compare].nodes}
        for n in cur:   # a collective the pass moved (a fused one is new, but it moved all the same)
            m = n.get("moved")
            if m and m.get("earlier", 0) > 0 and before.get(n["name"]) != m:
                status[n["name"]] = "moved"
        return union, status

    # ------------------------------------------------------------ moves, detail, legend
    def param_names(self) -> dict[int, str]:
        """Parameter id -> its name (from the scope the record gives its gather nodes)."""
        if getattr(self, "_pnames", None) is None:
            out: dict[int, str] = {}
            for v in self.rec.graphs:
                for n in v.nodes:
                    if "param" in n and n.get("scope") and E.comm_kind(n) in ("allgather_param", "wait_allgather"):
                        out.setdefault(int(n["param"]), L._PARAM_SUFFIX.sub("", n["scope"]))
            self._pnames = out
        return self._pnames

    def moves(self, _shown: tuple | None = None) -> list[dict]:
        """The collectives the shown version issues earlier than before (the prefetch pass's
        ``"moved"`` record), in graph order: ``{"node", "target", "params", "param_names", "from",
        "to", "first_use": {id: node}, "earlier", "bytes", "from_key", "to_key", "key"}``:
        ``from_key`` / ``to_key``: the boxes of the current picture holding the node it was issued
        after and the one it is issued after now (boxes group by module, not by position, so the
        collective's own box, ``key``, is its parameters' module wherever it is issued)."""
        if _shown is None:
            nodes, _ = self._nodes_and_status()
            chains, _ = key_chains(nodes, self.expanded, self.pscopes)
        else:   # (nodes, chains) the render already has
            nodes, chains = _shown
        where = {n["name"]: c[-1] for n, c in zip(nodes, chains)}
        vs = self.versions()
        cur = {n["name"] for n in vs[self.version].nodes} if vs else set()
        names = self.param_names()
        out = []
        for n in nodes:
            m = n.get("moved")
            if not m or n["name"] not in cur or m.get("earlier", 0) <= 0:
                continue
            pids = [int(p) for p in m.get("params", [])]
            out.append({"node": n["name"], "target": n["target"], "params": pids,
                        "param_names": [names.get(p, str(p)) for p in pids],
                        "from": m.get("from"), "to": m.get("to"),
                        "first_use": {int(k): v for k, v in m.get("first_use", {}).items()},
                        "earlier": int(m.get("earlier", 0)), "bytes": int(m.get("bytes", 0)),
                        "from_key": where.get(m.get("from") or "", "inputs"),
                        "to_key": where.get(m.get("to") or "", "inputs"), "key": where[n["name"]]})
        return out

    def node_detail(self, name: str) -> dict | None:
        """What the detail panel shows for node ``name`` of the current picture (None: not in it):
        ``name, op, target, version, status`` (diff: added/removed/moved or None), ``shape,
        dtype, bytes, bytes_label, latency_us, latency_label, latency_source`` ("measured": the
        record's profile or schedule; "estimated": the cost model), ``scope`` (module), ``box``
        (its box in the picture), ``source`` (user source line or None), ``params``
        (``[{"id", "name"}]``), ``moved`` (the move record with ``first_use`` keyed by int id, or
        None), ``inputs`` and ``users`` (node names)."""
        nodes, status = self._nodes_and_status()
        idx = next((i for i, n in enumerate(nodes) if n["name"] == name), None)
        if idx is None:
            return None
        n = nodes[idx]
        chains, _ = key_chains(nodes, self.expanded, self.pscopes)
        t = self.timings.get((self.graph_id, self.kind, name))
        source = "measured"
        if t is None:
            source = "estimated"
            key = (self.graph_id, self.kind, self.version, self.compare)
            if getattr(self, "_lat", (None,))[0] != key:
                self._lat = (key, self.node_latency_us(nodes))
            t = self._lat[1].get(name) if n["op"] not in ("placeholder", "get_attr", "output") else None
        pids: list[int] = []
        m = n.get("moved")
        if m and m.get("params"):
            pids = [int(p) for p in m["params"]]
        elif n.get("params"):
            pids = [int(p) for p in n["params"]]
        elif "param" in n:
            pids = [int(n["param"])]
        names = self.param_names()
        moved = None
        if m:
            moved = dict(m, first_use={int(k): v for k, v in m.get("first_use", {}).items()})
        b = int(m["bytes"]) if m and m.get("bytes") else E.node_bytes(n)   # a collective: the bytes it gathers
        vs = self.versions()
        return {"name": name, "op": n["op"], "target": n["target"], "version": vs[self.version].after,
                "status": status.get(name), "shape": n.get("shape"), "dtype": n.get("dtype"),
                "bytes": b, "bytes_label": E.fmt_bytes(b),
                "latency_us": t, "latency_label": fmt_us(t) if t is not None else "—",
                "latency_source": source if t is not None else None,
                "scope": effective_scope(n, self.pscopes), "box": chains[idx][-1], "source": n.get("source"),
                "params": [{"id": p, "name": names.get(p, str(p))} for p in pids], "moved": moved,
                "inputs": E.inputs_of(n), "users": [u["name"] for u in nodes if name in E.inputs_of(u)]}

    def node_detail_html(self, name: str | None = None) -> str:
        """:meth:`node_detail` of ``name`` (default: the selected node) as a small HTML table."""
        name = self.selected_node if name is None else name
        d = self.node_detail(name) if name else None
        if d is None:
            return '<div class="dc-node-detail empty">no node selected</div>' if not name else (
                f'<div class="dc-node-detail empty">{html.escape(name)} is not in this graph version</div>')
        e = html.escape
        rows = [("node", f"{d['name']} · {d['target']}" + (f" · <b>{d['status']}</b>" if d["status"] else "")),
                ("shape", f"{d['shape']} {d['dtype'] or ''}"), ("output", d["bytes_label"]),
                ("latency", d["latency_label"] + (f" ({d['latency_source']})" if d["latency_source"] else "")),
                ("module", d["scope"] or "—"), ("source", d["source"] or "—")]
        if d["params"]:
            rows.append(("params", ", ".join(f"{p['id']} {p['name']}" for p in d["params"])))
        m = d["moved"]
        if m:
            fu = ", ".join(f"{p}: {u}" for p, u in m["first_use"].items())
            rows.append(("moved", (f"{m.get('from') or 'top'} → {m.get('to') or 'top'}, {m.get('earlier', 0)} nodes earlier"
                                   if m.get("earlier", 0) > 0 else f"not moved (issued after {m.get('to') or 'top'})")
                         + f"; first used at {fu}"))
        body = "".join(f'<tr><th style="text-align:left;padding-right:8px">{e(k)}</th><td>'
                       f'{v if k == "node" else e(str(v))}</td></tr>' for k, v in rows)
        return f'<table class="dc-node-detail" style="font:12px Helvetica,Arial,sans-serif">{body}</table>'

    def _box_totals(self, nodes: list[dict], chains: list[list[str]]) -> dict[str, float]:
        """Colour metric total per box shown (leaf boxes, not inputs/outputs), or {} for "kind"."""
        metric, _ = self._metric(nodes)
        if metric is None:
            return {}
        members: dict[str, list[int]] = {}
        for i, c in enumerate(chains):
            if nodes[i]["op"] not in ("placeholder", "get_attr", "output"):
                members.setdefault(c[-1], []).append(i)
        return {k: metric(idx) for k, idx in members.items()}

    def legend(self) -> dict:
        """The colour scale of the current picture. Latency / memory: ``{"mode", "title", "unit",
        "min", "max", "min_label", "max_label", "stops"}`` (box totals; ``min``/``max`` in µs or
        bytes; ``stops``: the colours from min to max; latency ``"source"``: measured or
        estimated). Kind: ``{"mode": "kind", "items": [(label, colour)]}``. With a diff, ``"diff"``:
        the chips, ``[{"status", "symbol", "color", "count"}]``."""
        nodes, status = self._nodes_and_status()
        chains, _ = key_chains(nodes, self.expanded, self.pscopes)
        return self._legend(nodes, status, chains)

    def _legend(self, nodes, status, chains) -> dict:
        lg: dict
        if self.color_by in ("latency", "memory"):
            tot = self._box_totals(nodes, chains)
            lo, hi = (min(tot.values()), max(tot.values())) if tot else (0.0, 0.0)
            fmt = fmt_us if self.color_by == "latency" else E.fmt_bytes
            lg = {"mode": self.color_by, "unit": "µs" if self.color_by == "latency" else "bytes",
                  "title": "latency per box" if self.color_by == "latency" else "output bytes per box",
                  "min": lo, "max": hi, "min_label": fmt(lo), "max_label": fmt(hi),
                  "stops": [_ramp(x) for x in RAMP_STOPS]}
            if self.color_by == "latency":
                have = sum(1 for n in nodes if (self.graph_id, self.kind, n["name"]) in self.timings)
                lg["source"] = "measured" if have >= len(nodes) // 2 and have else "estimated"
                lg["title"] += f" ({lg['source']})"
        else:
            kinds = sorted({c for n in nodes if (c := E.comm_kind(n))})
            lg = {"mode": "kind", "items": [("compute", L.COMPUTE_COLOR), ("inputs/outputs", L.IO_COLOR)]
                  + [(k, L.comm_color(k)) for k in kinds]}
        if status:
            cnt = Counter(status.values())
            lg["diff"] = [{"status": st, "symbol": DIFF_SYMBOLS[st], "color": DIFF_COLORS[st], "count": cnt[st]}
                          for st in ("added", "removed", "moved")]
        return lg

    def group_keys(self) -> list[str]:
        nodes, _ = self._nodes_and_status()
        keys, _ = expanded_keys(nodes, self.expanded, self.pscopes)
        return list(dict.fromkeys(keys))

    def matches(self) -> list[dict]:
        """Nodes of the shown version matching the search text (name, op target or scope)."""
        q = self.search.lower()
        if not q:
            return []
        nodes, _ = self._nodes_and_status()
        keys, _ = expanded_keys(nodes, self.expanded, self.pscopes)
        out = []
        for n, k in zip(nodes, keys):
            scope = effective_scope(n, self.pscopes)
            if q in n["name"].lower() or q in n["target"].lower() or q in scope.lower():
                out.append({"name": n["name"], "target": n["target"], "scope": scope, "group": k})
        return out

    def node_latency_us(self, nodes: list[dict]) -> dict[str, float]:
        """Latency per node: the record's (profile or schedule) where present, else the naive estimate."""
        out = {}
        for n in nodes:
            t = self.timings.get((self.graph_id, self.kind, n["name"]))
            if t is not None:
                out[n["name"]] = t
        if len(out) < len(nodes) // 2:
            events, _ = E.estimate(nodes, self.graph_id or 0, self.kind or "forward")
            for e in events:
                out.setdefault(e["node"], e["end_us"] - e["start_us"])
        return out

    # ------------------------------------------------------------ render
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
            return L.have_dot()
        return L.have_dot() if self.use_dot is None else bool(self.use_dot and L.have_dot())

    def _fill(self, v: float) -> str:
        """The colour of a box total on the picture's scale (``self._scale``: min and max box totals)."""
        lo, hi = self._scale
        return _ramp((v - lo) / (hi - lo) if hi > lo else 1.0)

    def _metric(self, nodes: list[dict]):
        """(per-group total of the colour metric, its formatter) or (None, None) for colour-by-kind."""
        if self.color_by == "latency":
            per = self.node_latency_us(nodes)
            return (lambda idx: sum(per.get(nodes[i]["name"], 0.0) for i in idx)), fmt_us
        if self.color_by == "memory":
            return (lambda idx: float(sum(E.node_bytes(nodes[i]) for i in idx
                                          if nodes[i]["op"] not in ("placeholder", "get_attr", "output")))), E.fmt_bytes
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
            svg, used = L.nested_svg(level, title), "dot"
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
                 "comm_added": L.diff(vs[self.compare].nodes, v.nodes)["comm_added"]}
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
               hit_groups: set, classes: dict) -> L.Level:
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
            fill = L.IO_COLOR if g.is_io else L.COMPUTE_COLOR
            chips: list[tuple[str, int]] = []
            if single:
                n = nodes[mem[0]]
                ck = E.comm_kind(n)
                fill = L.comm_color(ck) if ck else (L.IO_COLOR if n["op"] in ("placeholder", "get_attr", "output")
                                                    else L.COMPUTE_COLOR)
                lines = [rel + extra, L._short(n["target"])]
                tip = f"{g.key} · {n['target']} (click: select)"
            else:
                lines = L.module_box_lines(g, rel, OPEN_MARK if is_open else FOLD_MARK, extra)
                chips = sorted(g.comm.items())
                tip = f"{g.key} ({g.n_ops} nodes) · click: {'collapse' if is_open else 'expand'}"
            if g.index in totals and not is_open:
                fill = self._fill(totals[g.index])
            child = None
            if is_open:
                child = self._level(nodes, status, chains, inferred, mem, depth + 1, g.key, hit_groups, classes)
            boxes.append(L.Box(g.key, lines, fill, chips, child, cls, stroke or None, tip))
        io = {g.index for g in c.groups if g.is_io}
        edges = [(a, b, n) for a, b, n in c.edges if a not in io and b not in io]   # fan-in/out: box labels say it
        return L.Level(boxes, edges)

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
            text = L.level_dot(lvl, {})
            if text in seen or text in L.LEVEL_CACHE:
                seen.add(text)
                continue
            seen.add(text)
            L.nested_level_svg(lvl)
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
        svg = L.simple_svg(c, title)
        svg = _decorate_simple(svg, c, fills, extra, style)
        return svg.replace('<svg class="graph simple"', '<svg class="graph simple dc-graph"', 1)
