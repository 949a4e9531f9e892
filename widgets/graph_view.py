"""The graph view's model: which graph, which pass, what is expanded, searched, coloured, diffed.

Plain Python (no ipywidgets): :class:`GraphModel` holds the state and :meth:`GraphModel.render`
returns the SVG and a text summary, so tests drive "clicks" by calling methods
(:meth:`GraphModel.handle_click` is what a click on the SVG does: the front end sends the
clicked box's ``group-<key>``).

Grouping is :mod:`deepcompile.report.graph_groups`'s (``node_groups``: the module-collapsed
picture of the HTML report). This module adds:

* **expansion**: an expanded group splits by its next module-scope level, down to single nodes
  (``blocks.3`` -> ``blocks.3.attn``, ``blocks.3.mlp`` -> ``blocks.3.attn/addmm_4``); with
  graphviz the open module stays as a frame around its boxes (``level_layout.nested_svg``: one
  small graphviz layout per open module, cached by the structural signature of that module's
  level, so identical decoder layers are laid out once; a level too big for graphviz gets the
  order-based layout); without graphviz (or ``use_dot=False``) the open module's boxes replace it
  in the order-based column (``level_layout.simple_svg``);
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

The model is :class:`GraphModel` here (which graph and version, expansion, search, colour,
selection); its pieces live beside it: :mod:`~deepcompile.widgets.graph_groups` (the box each
node is drawn in, and the union of two versions for a diff), :mod:`~deepcompile.widgets.graph_render`
(the picture: layouts, colours, diff chips, the legend strip) and
:mod:`~deepcompile.widgets.graph_detail` (moved collectives, the node detail panel, the legend).
"""
from __future__ import annotations

from deepcompile.plan import estimate as E
from deepcompile.report import graph_groups as L

from .graph_detail import GraphDetailMixin
from .graph_groups import effective_scope, expanded_keys, key_chains, union_diff
from .graph_render import COLOR_MODES, GraphRenderMixin, Rendered


# --------------------------------------------------------------------------- the model
class GraphModel(GraphDetailMixin, GraphRenderMixin):
    """State of the graph view over one rank's :class:`~deepcompile.record.reader.RunRecord`."""

    def __init__(self, record, *, timings: dict | None = None, use_dot: bool | None = None):
        self.rec = record
        self.pscopes = L.param_scopes(record.graphs)
        self.use_dot = use_dot
        self.timings = timings or {}   # (graph_id, kind, node name) -> latency µs (schedule/profile)
        self._errors: dict | None = None  # (graph_id, kind, node) -> plan.accuracy's row, read when first asked
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

    def errors(self) -> dict:
        """(graph_id, kind, node) -> {"predicted_us", "measured_us", "error_us"}: the cost model's
        prediction of the record's own plan against the record's measured step
        (``plan.accuracy.node_errors``), worked out once; {} where the record has no measured step."""
        if self._errors is None:
            from deepcompile.plan.accuracy import node_errors

            try:
                rows = node_errors(self.rec)
            except Exception:   # a record that cannot be predicted: nothing to colour
                rows = []
            self._errors = {(r.graph_id, r.kind, r.node): r.to_dict() for r in rows}
        return self._errors

    def node_error_us(self, nodes: list[dict]) -> dict[str, dict]:
        """Node name -> its predicted/measured row, for the shown graph."""
        err = self.errors()
        return {n["name"]: err[k] for n in nodes if (k := (self.graph_id, self.kind, n["name"])) in err}

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
