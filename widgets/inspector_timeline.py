"""The Inspector's Schedule and Memory tabs: their widgets, clicks on schedule bars, rendering.

A mixin of :class:`~deepcompile.widgets.inspector.Inspector`: it uses the inspector's ``W``
(ipywidgets), ``model``, ``_lock``, ``_muted``, ``_ui``, ``_plot`` and ``render``. The schedule
is a plotly ``FigureWidget`` whose bars select their node when clicked (where anywidget is
installed; else a static figure in an Output). The Memory tab shows the run's one peak and its
memory by category (memory_view), then the selected graph's own liveness estimate and its
operator table.
"""
from __future__ import annotations

import html

from deepcompile.plan import estimate as E
from deepcompile.vocab.memory import fmt_bytes

from .canvas import have_anywidget
from .timeline_view import bar_node, peak_label, view_figure

esc = html.escape


class TimelineTabsMixin:
    """The Schedule and Memory tabs of :class:`~deepcompile.widgets.inspector.Inspector`."""

    def _build_schedule_tab(self):
        """The Schedule tab's widgets (``s_*``) and their callbacks; returns the tab."""
        W = self.W
        self.s_node = W.Combobox(description="select node", placeholder="node name", ensure_option=False,
                                 continuous_update=False)
        self.s_node.observe(lambda ch: self._ui(lambda: self.model.select_node(ch["new"] or None),
                                                views=("graph", "schedule")), names="value")
        self.s_out = W.Output()
        self.s_out.add_class("dc-schedule")
        self.s_fig = self._figure_widget()        # clickable bars (plotly FigureWidget), else s_out
        self._s_sig = None
        if self.s_fig is not None:
            self.s_box = W.VBox([self.s_fig])
            self.s_box.add_class("dc-schedule")
        self.s_note = W.HTML()
        self.s_numbers = W.HTML()
        self.s_numbers.add_class("dc-step-numbers")
        self.s_scope = W.ToggleButtons(options=[("this graph", "graph"), ("whole step", "step")], value="graph",
                                       description="show")
        self.s_scope.add_class("dc-schedule-scope")
        self.s_scope.observe(lambda ch: self._ui(lambda: self.model.schedule.set_scope(ch["new"]),
                                                 views=("schedule",)), names="value")
        schedule_tab = W.VBox([self.s_note, self.s_numbers, W.HBox([self.s_scope, self.s_node]),
                               self.s_box if self.s_fig is not None else self.s_out])
        return schedule_tab

    def _build_memory_tab(self):
        """The Memory tab's widgets (``m_*``) and their callbacks; returns the tab."""
        W = self.W
        self.m_sort = W.Dropdown(description="sort by", options=["index", "name", "target", "module", "latency_us",
                                                                 "out_bytes", "mem_after_bytes"])
        self.m_desc = W.ToggleButton(description="descending", value=False)
        self.m_sort.observe(lambda ch: self._ui(lambda: self.model.memory.set_sort(ch["new"], self.m_desc.value)),
                            names="value")
        self.m_desc.observe(lambda ch: self._ui(lambda: self.model.memory.set_sort(self.m_sort.value, ch["new"])),
                            names="value")
        self.m_out = W.Output()
        self.m_out.add_class("dc-memory")
        self.m_view = W.Output()              # the run's memory by category (memory_view)
        self.m_view.add_class("dc-memory-view")
        self.m_runpeak = W.HTML()              # the run's one peak, labelled measured/predicted
        self.m_runpeak.add_class("dc-peak")
        self.m_peak = W.HTML()
        self.m_table = W.HTML()
        memory_tab = W.VBox([self.m_runpeak, self.m_view, self.m_out, self.m_peak,
                             W.HBox([self.m_sort, self.m_desc]), self.m_table])
        return memory_tab

    def _on_bar_click(self, trace, points, _state=None) -> None:
        """plotly calls this for every trace on a click; the one holding the point has indices."""
        inds = list(getattr(points, "point_inds", []) or [])
        if not inds or self.model.graph is None:
            return
        data = trace.customdata
        if data is None or inds[0] >= len(data):
            return
        name = bar_node(data[inds[0]])
        if not name:
            return
        with self._lock:
            self.model.click_bar(name)
            self._set_node_box(name)
            self.render(views=("graph", "schedule"))

    def _set_node_box(self, name: str | None) -> None:
        self._muted = True
        try:
            self.s_node.value = name or ""
        finally:
            self._muted = False

    @staticmethod
    def _figure_widget():
        if not have_anywidget():
            return None
        try:
            import plotly.graph_objects as go

            return go.FigureWidget()
        except Exception:  # plotly without widget support: the static figure in an Output
            return None

    def _plot_schedule(self, fig) -> None:
        """The schedule into the FigureWidget: traces replaced when the lanes change, else only the
        selection outline; every trace's clicks select the node."""
        fw = self.s_fig
        if fw is None:
            self._plot(self.s_out, fig)
            return
        new = list(fig.data)
        sel = [t for t in new if (t.name or "").startswith("selected: ")]
        base = [t for t in new if not (t.name or "").startswith("selected: ")]
        sc = self.model.schedule
        sig = (id(sc), sc.key if sc else None, getattr(sc, "scope", None), id(getattr(sc, "whatif_events", None)),
               len(base), tuple(t.name for t in base))
        with fw.batch_update():
            if sig != self._s_sig:
                fw.data = ()
                fw.add_traces(base + sel)
                fw.layout = fig.layout
                self._s_sig = sig
                for t in fw.data:
                    t.on_click(self._on_bar_click)
            else:   # same lanes: only the selection outline (one trace per source) changes
                old_sel = [t for t in fw.data if (t.name or "").startswith("selected: ")]
                if len(old_sel) != len(sel):
                    if old_sel:
                        fw.data = [t for t in fw.data if not (t.name or "").startswith("selected: ")]
                    if sel:
                        fw.add_traces(sel)
                        for t in fw.data[-len(sel):]:
                            t.on_click(self._on_bar_click)
                else:
                    for o, n in zip(old_sel, sel):
                        o.update(base=n.base, x=n.x, y=n.y, name=n.name, xaxis=n.xaxis, yaxis=n.yaxis,
                                 hovertemplate=n.hovertemplate, meta=n.meta, showlegend=n.showlegend)
                fw.layout.title = fig.layout.title

    def _render_schedule(self) -> None:
        m = self.model
        if m.schedule:
            self.s_note.value = (f"<div style='font-size:12px'>{esc(m.schedule.source_note)}; measured and "
                                 "predicted in separate lanes; the numbers are per step (every graph)"
                                 + ("; click a bar to select its node in the graph" if self.s_fig is not None else "")
                                 + "</div>")
            self.s_numbers.value = m.schedule.numbers_html()
            self._plot_schedule(m.schedule.figure())

    def _render_memory(self) -> None:
        """The run's one peak and its memory by category (memory_view), then the selected graph's
        own liveness estimate (labelled as such: it is not the step's peak) and its operators."""
        m = self.model
        pk = m.peak()
        if pk:
            self.m_runpeak.value = (f"<div style='font-size:13px'><b>peak of this run</b> "
                                    f"<span class='dc-peak-value'>{esc(peak_label(pk))}</span> "
                                    "<span style='color:#666;font-size:11px'>(the same number in the report, "
                                    "`deepcompile inspect` and Predict)</span></div>")
        else:
            self.m_runpeak.value = ("<div style='font-size:12px;color:#666'>no memory timeline in this record"
                                    + (f": {esc(m.view_error)}" if m.view_error else "") + "</div>")
        if m.view:
            try:
                self._plot(self.m_view, view_figure(m.view, title="memory by category"))
            except Exception as e:  # a figure that fails says so; the rest stays
                self.m_view.outputs = ()
                self.m_runpeak.value += f"<div style='color:#b00020'>memory figure failed: {esc(str(e))}</div>"
        else:
            self.m_view.outputs = ()
        if m.memory:
            self._plot(self.m_out, m.memory.figure())
            gp = m.memory.peak()
            if gp:
                self.m_peak.value = (f"<div style='font-size:12px'>graph-level estimate (this graph's own tensors, "
                                     f"not the step's peak): high point {fmt_bytes(gp['value'])} at node "
                                     f"{gp['index']} ({esc(gp['node'])}, {esc(gp['series'])}); largest tensors live "
                                     "there: " + ", ".join(f"{esc(n)} {fmt_bytes(b)}" for n, b in gp["holders"])
                                     + "</div>")
            self.m_table.value = m.memory.table_html()
