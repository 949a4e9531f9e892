"""The Inspector's Graph tab: its controls, clicks on the graph's boxes, and the picture.

A mixin of :class:`~deepcompile.widgets.inspector.Inspector`: it uses the inspector's ``W``
(ipywidgets), ``model``, ``_lock``, ``_muted``, ``_ui``, ``_say``, ``_set_node_box`` and
``render``. The picture is graphviz's layout when it is ready within ``layout_wait_s``, else the
order-based one at once, with graphviz's swapped in when it is ready; below it, the selected
node's detail and the collectives the diff shown moved.
"""
from __future__ import annotations

import html
import threading

from .canvas import make_canvas
from .graph_render import COLOR_MODES, FOLD_MARK, OPEN_MARK
from .graph_view import GraphModel

esc = html.escape


class GraphTabMixin:
    """The Graph tab of :class:`~deepcompile.widgets.inspector.Inspector`."""

    def _build_graph_tab(self):
        """The Graph tab's widgets (``g_*``) and their callbacks; returns the tab."""
        W = self.W
        lay = W.Layout(width="220px")
        self.g_graph = W.Dropdown(description="graph", layout=lay)
        self.g_kind = W.Dropdown(description="kind", layout=lay)
        self.g_pass = W.Dropdown(description="after pass", layout=W.Layout(width="360px"))
        self.g_diff = W.Dropdown(description="diff vs", layout=W.Layout(width="260px"))
        for w, cls in ((self.g_graph, "dc-graph-id"), (self.g_kind, "dc-graph-kind"), (self.g_pass, "dc-pass"),
                       (self.g_diff, "dc-diff-pass")):
            w.add_class(cls)
        self.g_color = W.ToggleButtons(options=list(COLOR_MODES), description="colour by")
        self.g_search = W.Text(description="search", placeholder="name, op or module", continuous_update=False)
        self.g_module = W.Dropdown(description="module", layout=W.Layout(width="300px"))
        self.g_toggle = W.Button(description="expand / collapse", tooltip="open or close the selected module box")
        self.g_collapse_all = W.Button(description="collapse all")
        self.g_module.add_class("dc-module")
        self._module_chosen = False
        self.g_module.observe(lambda ch: setattr(self, "_module_chosen", True) if not self._muted else None,
                              names="value")
        self.g_toggle.add_class("dc-expand")
        self.g_summary = W.HTML()
        # the SVG, clickable where anywidget is installed (else an HTML widget: use the dropdown)
        self.g_svg = make_canvas(layout=W.Layout(max_height="720px", overflow="auto", border="1px solid #ddd"))
        self.g_svg.add_class("dc-graph-view")
        self.clickable = hasattr(self.g_svg, "on_box_click")
        if self.clickable:
            self.g_svg.on_box_click(self._on_graph_click)
        self.g_hint = W.HTML(
            "<span style='font-size:11px;color:#666'>" + (
                f"click a box: {FOLD_MARK} expands it, {OPEN_MARK} (a frame) collapses it, a single node selects it "
                "(its schedule bars are outlined); shift-click collapses the module around a box"
                if self.clickable else "expand or collapse a module with the dropdown (install anywidget to click "
                "boxes)") + "</span>")
        self.g_matches = W.HTML()
        self.g_detail = W.HTML()     # the selected node: shape, dtype, bytes, latency, source line, move
        self.g_detail.add_class("dc-node-detail-box")
        self.g_moves = W.HTML()      # moved collectives of the diff shown: from -> to, params, first use
        self.g_moves.add_class("dc-moves")
        self._muted = False
        self.g_graph.observe(lambda ch: self._ui(lambda: self.model.set_graph(ch["new"]), full=True), names="value")
        self.g_kind.observe(lambda ch: self._ui(lambda: self.model.set_kind(ch["new"]), full=True), names="value")
        self.g_pass.observe(lambda ch: self._ui(lambda: self._set_pass(ch["new"])), names="value")
        self.g_diff.observe(lambda ch: self._ui(lambda: self.model.graph.set_diff(ch["new"])), names="value")
        self.g_color.observe(lambda ch: self._ui(lambda: self.model.graph.set_color(ch["new"])), names="value")
        self.g_search.observe(lambda ch: self._ui(lambda: self.model.graph.set_search(ch["new"])), names="value")
        self.g_toggle.on_click(lambda _: self._ui(lambda: self.model.graph.click(self.g_module.value),
                                                  views=("graph",)) if self.g_module.value else None)
        self.g_collapse_all.on_click(lambda _: self._ui(self.model.graph.collapse_all, views=("graph",)))
        graph_tab = W.VBox([W.HBox([self.g_graph, self.g_kind, self.g_pass, self.g_diff]),
                            W.HBox([self.g_color, self.g_search]),
                            W.HBox([self.g_module, self.g_toggle, self.g_collapse_all]),
                            self.g_hint, self.g_summary, self.g_moves, self.g_svg, self.g_detail, self.g_matches])
        return graph_tab

    def _on_graph_click(self, key: str, shift: bool = False) -> None:
        """A click on a box of the graph SVG (the canvas sends ``group-<key>``)."""
        if self._muted or self.model.graph is None:
            return
        with self._lock:
            try:
                action, what = self.model.click_graph(key, shift)
            except (ValueError, KeyError) as e:
                self._say(str(e), error=True)
                return
            if action == "ignored":   # a box of a picture since replaced
                return
            if action == "selected":
                self._set_node_box(what)
            self.render(views=("graph", "schedule") if action == "selected" else ("graph",))

    def _set_pass(self, v) -> None:
        self.model.graph.set_pass(v)
        if self.model.memory and (self.model.graph.graph_id, self.model.graph.kind) == self.model.memory.key:
            self.model.memory.set_pass(v)

    def _render_graph_controls(self, full: bool) -> None:
        m = self.model
        g = m.graph
        self._muted = True
        try:
            if full:
                self.g_graph.options = g.graph_ids
                self.g_graph.value = g.graph_id
                self.g_kind.options = g.kinds
                self.g_kind.value = g.kind
                # each version's compile named where a graph compiled more than once
                opts = [(label, i) for i, label in enumerate(g.version_labels)]
                self.g_pass.options = opts
                self.g_diff.options = [("(no diff)", None)] + opts
            if g.pass_names:
                self.g_pass.value = g.version
            self.g_diff.value = g.compare
            self.g_color.value = g.color_by
            # the module list: open modules (▾, choosing one collapses it) and the boxes shown
            outline = g.outline()
            keys = [k for k, _, _ in outline]
            prev = self.g_module.value
            self.g_module.options = [(("· " * d) + (OPEN_MARK + " " if is_open else "") + k, k)
                                     for k, d, is_open in outline]
            if prev in keys and self._module_chosen:
                self.g_module.value = prev
            elif prev and self._module_chosen and any(k.startswith(prev + ".") or k.startswith(prev + "/") for k in keys):
                self.g_module.value = next(k for k in keys if k.startswith(prev + ".") or k.startswith(prev + "/"))
            else:
                self.g_module.value = next((k for k, _, is_open in outline if not is_open and any(c.isdigit() for c in k)),
                                           keys[0] if keys else None)
            if m.schedule:
                opts = tuple(m.schedule.nodes_at()[:2000])
                if tuple(self.s_node.options) != opts:
                    self.s_node.options = opts
        finally:
            self._muted = False

    def _show_graph(self, g: GraphModel) -> None:
        """Show the graph: graphviz's (nested, cached per module) layout when cached or ready within
        ``layout_wait_s``; else the order-based layout at once and graphviz's swapped in when ready
        (if the state is unchanged). Then lay out the inside of the modules ahead of clicks."""
        full = g.cached(None)
        if full is None and self.lazy_layout and g._use_dot(None):
            key, snap = g.state_key(), g.snapshot()
            lk = threading.Lock()
            st: dict = {"r": None, "late": False}
            done = threading.Event()

            def work():
                try:
                    rr = snap.render(None)
                except Exception:
                    done.set()
                    return
                with lk:
                    st["r"], late = rr, st["late"]
                done.set()
                if late:
                    with self._lock:
                        if self.model.graph is g and g.state_key() == key:
                            self._graph_html(rr)

            threading.Thread(target=work, name="deepcompile-graph-layout", daemon=True).start()
            done.wait(self.layout_wait_s)
            with lk:
                full = st["r"]
                if full is None:
                    st["late"] = True
            if full is None:
                self._graph_html(g.render("simple"))
                return
        self._graph_html(full or g.render(None))
        self._prewarm(g)

    def _prewarm(self, g: GraphModel) -> None:
        pk = (id(g), g.graph_id, g.kind, g.version, g.compare, g.color_by)
        if not self.lazy_layout or pk in self._prewarmed or not g._use_dot(None):
            return
        self._prewarmed.add(pk)
        snap = g.snapshot()
        threading.Thread(target=lambda: snap.prewarm(limit=4), name="deepcompile-graph-prewarm", daemon=True).start()

    def _graph_html(self, r) -> None:
        self.g_summary.value = f"<div class='dc-graph-summary' style='font-size:12px'>{esc(r.summary)}</div>"
        self.g_svg.value = getattr(r, "html", r.svg)   # the colour scale's legend above the picture
        self.g_detail.value = self._detail_html()
        self.g_moves.value = self._moves_html(getattr(r, "moves", None) or [])
        self.g_matches.value = "" if not r.matches else (
            "<div style='font-size:11px'><b>matches</b>: " + ", ".join(
                f"{esc(x['name'])} <i>({esc(x['target'])}, {esc(x['group'])})</i>" for x in r.matches[:60])
            + (" …" if len(r.matches) > 60 else "") + "</div>")

    def _detail_html(self) -> str:
        g = self.model.graph
        if g is None or not hasattr(g, "node_detail_html"):
            return ""
        try:
            return g.node_detail_html()
        except Exception as e:  # a detail that fails says so; the picture stays
            return f"<div class='dc-node-detail empty'>node detail failed: {esc(str(e))}</div>"

    @staticmethod
    def _moves_html(moves: list[dict]) -> str:
        """The moved collectives of the diff shown, each from -> to (also inside a fused group: its
        parameters and where each is first used)."""
        if not moves:
            return ""
        rows = []
        for mv in moves[:200]:
            names = mv.get("param_names") or [str(p) for p in mv.get("params") or []]
            first = ", ".join(f"{esc(str(k))}: {esc(str(v))}" for k, v in (mv.get("first_use") or {}).items())
            rows.append(f"<tr><td>{esc(str(mv.get('node', '')))}</td><td>{esc(str(mv.get('from', '')))} → "
                        f"{esc(str(mv.get('to', '')))}</td><td>{esc(str(mv.get('earlier', '')))}</td>"
                        f"<td>{esc(', '.join(map(str, names))[:300])}</td><td>{first[:300]}</td></tr>")
        more = f"<div>… {len(moves) - 200} more</div>" if len(moves) > 200 else ""
        return (f"<details open><summary style='font-size:12px'><b>{len(moves)} collective(s) moved</b> "
                "(issued after → issued after now)</summary><table class='dc-moves-table' style='font-size:11px'>"
                "<tr><th>collective</th><th>from → to</th><th>nodes earlier</th><th>parameters</th>"
                "<th>first used at</th></tr>" + "".join(rows) + f"</table>{more}</details>")
