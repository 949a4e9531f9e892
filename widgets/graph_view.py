"""The graph view's model: which graph, which pass, what is expanded, searched, coloured, diffed.

Plain Python (no ipywidgets): :class:`GraphModel` holds the state and :meth:`GraphModel.render`
returns the SVG and a text summary, so tests drive "clicks" by calling methods.

Layout and drawing are :mod:`deepcompile.report.graph_layout`'s (``node_groups``, ``to_dot``,
``render_svg``, the same module-collapsed picture as the HTML report). This module only adds:

* **expansion**: an expanded group splits by its next module-scope level, down to single nodes
  (``blocks.3`` -> ``blocks.3.attn``, ``blocks.3.mlp`` -> ``blocks.3.attn/addmm_4``);
* **diff**: the union of two versions (removed nodes kept at their old place, so positions stay
  stable), groups marked ``dc-added`` / ``dc-removed`` / ``dc-moved`` with counts in their label;
  "moved" = a node in both versions that is off the longest common order (prefetch hoisting);
* **search** (name, op target or module scope; groups holding a hit marked ``dc-match``),
  **colour** by op kind (the report's colours), latency or memory (totals on collapsed boxes),
  and a **selected** node (linked with the schedule view), all by post-processing the DOT text
  (or the built-in SVG) through the ``id="group-<key>"`` attribute both layouts write.

SVG renders are cached per (version, state), so switching back and forth is free.
"""
from __future__ import annotations

import bisect
import html
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from deepcompile.record import estimate as E
from deepcompile.report import graph_layout as L

COLOR_MODES = ("kind", "latency", "memory")
DIFF_COLORS = {"added": "#2a9d8f", "removed": "#e63946", "moved": "#457b9d"}
MATCH_COLOR = "#d00000"
SELECT_COLOR = "#ff00aa"
# graphviz lays out clusters super-linearly: ~100 ms for 40 module boxes, ~1 s for 100 (benchmarks/
# inspector.py). Past this many boxes the interactive view uses the order-based layout instead.
DOT_MAX_GROUPS = 64


# --------------------------------------------------------------------------- grouping
def effective_scope(n: dict, pscopes: dict) -> str:
    """The module scope a node belongs to (as ``graph_layout.node_groups`` resolves it)."""
    scope = n.get("scope") or ""
    if scope in pscopes and isinstance(pscopes[scope], str):
        return pscopes[scope]
    if E.comm_kind(n) is not None and "param" in n:
        return L.param_module_scope(scope) if scope else pscopes.get(n["param"], "")
    return scope


def expanded_keys(nodes: list[dict], expanded: set[str], pscopes: dict,
                  depth: int | None = None) -> tuple[list[str], list[bool]]:
    """Group keys with the groups in ``expanded`` opened one scope level (or to nodes)."""
    keys, inferred = L.node_groups(nodes, depth, pscopes)
    if not expanded:
        return keys, inferred
    out = []
    for n, k in zip(nodes, keys):
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
                break
        out.append(key)
    return out, inferred


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


@dataclass
class Rendered:
    svg: str
    summary: str
    groups: list[str]
    matches: list[dict] = field(default_factory=list)
    diff: dict | None = None
    classes: dict[str, list[str]] = field(default_factory=dict)   # group key -> dc-* classes
    layout: str = ""                                               # "dot" or "simple"


def _decorate_dot(dot: str, c: L.Collapsed, fills: dict[int, str], extra_label: dict[int, str],
                  cluster_style: dict[int, tuple[list[str], str]]) -> str:
    out = []
    cur = None
    for line in dot.split("\n"):
        m = re.match(r"  subgraph cluster_(\d+) \{", line)
        if m:
            cur = int(m.group(1))
            out.append(line)
            continue
        if cur is not None and line.startswith("    label="):
            g = cur
            if g in extra_label:
                line = re.sub(r'label="((?:[^"\\]|\\.)*)"',
                              lambda mm: f'label="{mm.group(1)}{extra_label[g]}"', line, count=1)
            if g in cluster_style:
                classes, color = cluster_style[g]
                line = line.replace('color="#88aaaa";', f'color="{color}"; penwidth=3;')
            out.append(line)
            continue
        m = re.match(r"    g(\d+)c \[", line)
        if m and int(m.group(1)) in fills:
            line = re.sub(r'fillcolor="[^"]*"', f'fillcolor="{fills[int(m.group(1))]}"', line, count=1)
        m = re.match(r"  n(\d+) \[", line)  # full (one node per group) layout
        if m:
            g = int(m.group(1))
            if g in fills:
                line = re.sub(r'fillcolor="[^"]*"', f'fillcolor="{fills[g]}"', line, count=1)
            if g in cluster_style:
                classes, color = cluster_style[g]
                line = line.replace("[label=", f'[color="{color}", penwidth=3, class="{" ".join(classes)}", label=', 1)
        if line == "  }":
            cur = None
        out.append(line)
    return "\n".join(out)


def _classes_into_svg(svg: str, c: L.Collapsed, style: dict[int, tuple[list[str], str]]) -> str:
    """graphviz 2.43 drops ``class`` on clusters: add the dc-* classes to the SVG groups by id."""
    for g in c.groups:
        if g.index not in style:
            continue
        gid = html.escape("group-" + g.key, quote=False).replace("-", "&#45;")
        extra = " ".join(style[g.index][0])
        svg = re.sub(r'(<g id="' + re.escape(gid) + r'" class=")([^"]*)"', lambda m: f'{m.group(1)}{m.group(2)} {extra}"',
                     svg, count=1)
    return svg


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
        return union_diff(vs[self.compare].nodes, cur)

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

    def _render(self, layout: str | None = None) -> Rendered:
        vs = self.versions()
        if not vs:
            return Rendered('<p class="empty">no graphs in this record</p>', "no graphs recorded", [])
        nodes, status = self._nodes_and_status()
        keys, inferred = expanded_keys(nodes, self.expanded, self.pscopes)
        c = collapse_keys(nodes, keys, inferred)
        v = vs[self.version]
        fills: dict[int, str] = {}
        extra: dict[int, str] = {}
        style: dict[int, tuple[list[str], str]] = {}
        classes: dict[str, list[str]] = {}
        # colour by latency / memory (totals on the boxes)
        if self.color_by in ("latency", "memory"):
            if self.color_by == "latency":
                per = self.node_latency_us(nodes)
                tot = {g.index: sum(per.get(nodes[i]["name"], 0.0) for i in g.node_indices) for g in c.groups}
                fmt = fmt_us
            else:
                tot = {g.index: float(sum(E.node_bytes(nodes[i]) for i in g.node_indices
                                          if nodes[i]["op"] not in ("placeholder", "get_attr", "output")))
                       for g in c.groups}
                fmt = E.fmt_bytes
            top = max(tot.values(), default=0.0) or 1.0
            for g in c.groups:
                if not g.is_io:
                    fills[g.index] = _ramp(tot[g.index] / top)
                    extra[g.index] = f" · {fmt(tot[g.index])}"
        # diff marks
        counts: dict[int, Counter] = {}
        for g in c.groups:
            cnt = Counter(status[nodes[i]["name"]] for i in g.node_indices if nodes[i]["name"] in status)
            if cnt:
                counts[g.index] = cnt
                cls = [f"dc-{s}" for s in ("added", "removed", "moved") if cnt[s]]
                main = next(s for s in ("added", "removed", "moved") if cnt[s])
                style[g.index] = (["dc-diff"] + cls, DIFF_COLORS[main])
                marks = " ".join(f"{'+' if s == 'added' else '−' if s == 'removed' else '↕'}{cnt[s]}"
                                 for s in ("added", "removed", "moved") if cnt[s])
                extra[g.index] = extra.get(g.index, "") + f" [{marks}]"
        # search and selection
        hits = self.matches()
        hit_groups = {m["group"] for m in hits}
        for g in c.groups:
            cls, color = style.get(g.index, ([], ""))
            if g.key in hit_groups:
                cls, color = cls + ["dc-match"], MATCH_COLOR
            if self.selected_node is not None and any(nodes[i]["name"] == self.selected_node for i in g.node_indices):
                cls, color = cls + ["dc-selected"], SELECT_COLOR
            if cls:
                style[g.index] = (cls, color)
                classes[g.key] = cls
        title = f"graph {self.graph_id} · {self.kind} · " + ("input" if v.after == "input" else f"after {v.after}")
        if self.compare is not None and self.compare != self.version:
            title += f" vs {vs[self.compare].after}"
        svg, used = self._draw(c, title, fills, extra, style, layout)
        d = None
        summary = f"{title}: {len(v.nodes)} nodes in {len(c.groups)} boxes"
        if status:
            sc = Counter(status.values())
            d = {"added": sc["added"], "removed": sc["removed"], "moved": sc["moved"],
                 "comm_added": L.diff(vs[self.compare].nodes, v.nodes)["comm_added"]}
            comm = ", ".join(f"{k} +{n}" for k, n in sorted(d["comm_added"].items()))
            summary += f"; diff: +{d['added']} added, −{d['removed']} removed, {d['moved']} moved" + (
                f" (comm: {comm})" if comm else "")
        if self.search:
            summary += f"; search {self.search!r}: {len(hits)} node(s) in {len(hit_groups)} box(es)"
        return Rendered(svg, summary, list(dict.fromkeys(keys)), hits, d, classes, used)

    def _draw(self, c: L.Collapsed, title: str, fills, extra, style, layout: str | None = None) -> tuple[str, str]:
        use_dot = self.use_dot if layout is None else (layout == "dot" and L.have_dot())
        if use_dot is None:
            use_dot = (L.have_dot() and L._n_elements(c) <= L.DOT_MAX_ELEMENTS
                       and len(c.groups) <= DOT_MAX_GROUPS)
        if use_dot:
            import subprocess

            dot = _decorate_dot(L.to_dot(c, title), c, fills, extra, style)
            try:
                r = subprocess.run(["dot", "-Tsvg"], input=dot.encode(), capture_output=True,
                                   timeout=60, check=True)
                svg = r.stdout.decode("utf-8", errors="replace")
                i = svg.find("<svg")
                if i >= 0:
                    svg = svg[i:].replace("<svg ", '<svg class="graph dot dc-graph" ', 1)
                    return _classes_into_svg(svg, c, style), "dot"
            except (OSError, subprocess.SubprocessError):
                pass
        svg = L.simple_svg(c, title)
        svg = _decorate_simple(svg, c, fills, extra, style)
        return svg.replace('<svg class="graph simple"', '<svg class="graph simple dc-graph"', 1), "simple"
