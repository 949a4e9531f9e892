"""The Inspector: ipywidgets face over the plain-Python models of this package.

``Inspector(run_dir)`` shows a finished (or still running) run; ``Inspector.launch(...)`` starts
the CLI demo (or a script under torchrun) in the background and follows it. Tabs: Graph,
Schedule, Memory, Steps (live), Passes & runs (controls from the passes' declared parameters;
Run re-launches with the edited values and adds the new run beside the old one).

State lives in :class:`~deepcompile.widgets.inspector_model.InspectorModel` (and the models it
holds); the widget callbacks only call model methods and re-render, so tests drive the same
methods without a browser. A missing or broken record is shown as a message (the
:class:`RecordError` text), never a traceback.

This module holds the frame: the run and rank selectors, the message line, the tabs, opening a
run and rendering. Each tab's widgets and callbacks are a mixin of their own:
:mod:`~deepcompile.widgets.inspector_graph` (Graph), :mod:`~deepcompile.widgets.inspector_timeline`
(Schedule, Memory), :mod:`~deepcompile.widgets.inspector_live` (Steps, live polling),
:mod:`~deepcompile.widgets.inspector_passes` (Passes & runs, what-if) and
:mod:`~deepcompile.widgets.inspector_jobs` (starting and re-running jobs).

Clicks come back from the browser through two widgets (both anywidget-based, their JavaScript
shipped inside the Python packages, so no network is needed in JupyterLab or VS Code): the
graph's :mod:`~deepcompile.widgets.canvas` (a click on a box: expand, collapse or select, see
:meth:`InspectorModel.click_graph`) and plotly's ``FigureWidget`` for the schedule (a click on a
bar selects its node: :meth:`InspectorModel.click_bar`). Without anywidget the graph is a plain
HTML widget driven by the module dropdown and the schedule a static plotly figure.
"""
from __future__ import annotations

import html
import json
import threading
import traceback
from pathlib import Path

from deepcompile.record.reader import RecordError

from .inspector_graph import GraphTabMixin
from .inspector_jobs import JobsMixin
from .inspector_live import LiveStepsMixin
from .inspector_model import InspectorModel
from .inspector_passes import PassesTabMixin
from .inspector_timeline import TimelineTabsMixin
from .launcher import Job

esc = html.escape


# --------------------------------------------------------------------------- the widget
class Inspector(GraphTabMixin, TimelineTabsMixin, LiveStepsMixin, PassesTabMixin, JobsMixin):
    """Browse a run record in a notebook. ``Inspector(run_dir)``; ``Inspector.launch(...)``."""

    def __init__(self, run_dir: str | Path | None = None, rank: int = 0, *, poll_interval: float = 1.0,
                 follow: bool = True, use_dot: bool | None = None, lazy_layout: bool = True,
                 layout_wait_s: float = 0.5, live_interval: float = 0.5, whatif_delay_s: float = 0.4):
        import ipywidgets as W

        # graph: graphviz's layout when it is ready within layout_wait_s, else the order-based one
        # at once and graphviz's swapped in when ready
        self.lazy_layout = lazy_layout
        self.layout_wait_s = layout_wait_s
        self._prewarmed: set = set()

        self.W = W
        self.model = InspectorModel(None, rank, use_dot=use_dot)
        self.poll_interval = poll_interval
        # while a run is live the steps file is polled this often (a step appears within it);
        # the record (graphs, layout) is re-read at most every reload_every_s meanwhile
        self.live_interval = min(live_interval, poll_interval)
        self.reload_every_s = 5.0
        self._last_reload = 0.0
        self._mem_sig = None
        # what-if: an edit waits whatif_delay_s for the next one (a slider drag is one prediction)
        self.whatif_delay_s = whatif_delay_s
        self._whatif_timer: threading.Timer | None = None
        self._whatif_gen = 0
        self.last_whatif = None
        self.last_pass_rows: list = []          # plan.bought rows of last_whatif's values
        self._whatif_of: tuple | None = None    # the values and limit last_whatif predicted
        self.whatif_error: str | None = None   # why the last what-if gave no numbers
        # one what-if at a time: an edit's timer and a direct call (Predict, a notebook cell) would
        # otherwise re-plan the same cached graphs in two threads
        self._whatif_lock = threading.Lock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._lock = threading.RLock()
        self.job: Job | None = None
        self._build()
        if run_dir is not None:
            self.open(run_dir)
        if follow:
            self.follow()

    # ------------------------------------------------------------ construction
    def _build(self) -> None:
        W = self.W
        self.message = W.HTML()
        self.message.add_class("dc-message")
        self.run_select = W.Dropdown(description="run", options=[], layout=W.Layout(width="520px"))
        self.rank_select = W.Dropdown(description="rank", options=[0], layout=W.Layout(width="160px"))
        self.run_select.observe(lambda ch: self._on_run(ch["new"]), names="value")
        self.rank_select.observe(lambda ch: self._on_rank(ch["new"]), names="value")
        graph_tab = self._build_graph_tab()
        schedule_tab = self._build_schedule_tab()
        memory_tab = self._build_memory_tab()
        steps_tab = self._build_steps_tab()
        passes_tab = self._build_passes_tab()
        self.tabs = W.Tab(children=[graph_tab, schedule_tab, memory_tab, steps_tab, passes_tab])
        for i, t in enumerate(("Graph", "Schedule", "Memory", "Steps", "Passes & runs")):
            self.tabs.set_title(i, t)
        self.widget = W.VBox([W.HBox([self.run_select, self.rank_select]), self.message, self.tabs])
        self.widget.add_class("dc-inspector")

    # ------------------------------------------------------------ display
    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def _repr_mimebundle_(self, **kw):
        return self.widget._repr_mimebundle_(**kw)

    # ------------------------------------------------------------ helpers
    def _ui(self, fn, full: bool = False, views: tuple[str, ...] | None = None) -> None:
        """Run a model change from a widget event, then re-render (only ``views`` when given: "graph",
        "schedule"); errors become a message."""
        if self._muted or self.model.graph is None:
            return
        try:
            fn()
        except (ValueError, KeyError) as e:
            self._say(str(e), error=True)
            return
        self.render(full=full, views=views)

    def _say(self, text: str, error: bool = False) -> None:
        color = "#b00020" if error else "#37474f"
        self.message.value = f"<div style='color:{color};font-size:13px;white-space:pre-wrap'>{esc(text)}</div>" if text else ""

    @staticmethod
    def _plot(out, fig) -> None:
        """Put a plotly figure in an Output widget (thread-safe: sets the outputs directly)."""
        import plotly.io as pio

        spec = json.loads(pio.to_json(fig, validate=False))
        out.outputs = ({"output_type": "display_data", "metadata": {},
                        "data": {"application/vnd.plotly.v1+json": spec,
                                 "text/plain": f"<plotly figure: {len(spec.get('data', []))} traces>"}},)

    # ------------------------------------------------------------ open / render
    def open(self, run_dir: str | Path, rank: int | None = None) -> bool:
        with self._lock:
            ok = self.model.open(run_dir, rank)
            if ok:   # the poller reloads only when graphs are added after this
                self._index_sig = self._index_signature()
            self._muted = True
            try:
                self.run_select.options = [str(p) for p in self.model.runs]
                self.run_select.value = str(self.model.run_dir)
                ranks = self.model.record.manifest["ranks"] if self.model.record else [self.model.rank]
                self.rank_select.options = list(ranks)
                self.rank_select.value = self.model.rank
            finally:
                self._muted = False
            self.render(full=True)
            return ok

    def _on_run(self, value) -> None:
        if not self._muted and value and Path(value) != self.model.run_dir:
            self.open(value)

    def _on_rank(self, value) -> None:
        if not self._muted and value is not None and value != self.model.rank:
            self.open(self.model.run_dir, value)

    def render(self, full: bool = False, views: tuple[str, ...] | None = None) -> None:
        with self._lock:
            try:
                if views is not None and self.model.record is not None and not full:
                    self._render_views(views)
                    return
                self._render(full)
            except Exception as e:  # a view that fails says so; the others stay usable
                self._say(f"rendering failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}", error=True)

    def _render(self, full: bool) -> None:
        m = self.model
        self._render_passes_tab(full)
        self._render_steps()
        if m.record is None:
            waiting = self.job is not None and self.job.running
            self._say(("waiting for the run record… " if waiting else "cannot show this run: ") + (m.error or ""),
                      error=not waiting)
            for w in (self.g_svg, self.g_summary, self.m_table, self.m_peak, self.g_matches, self.m_runpeak,
                      self.s_numbers):
                w.value = ""
            self.m_view.outputs = ()
            self.s_out.outputs = ()
            if self.s_fig is not None and self.s_fig.data:
                self.s_fig.data = ()
                self._s_sig = None
            self.m_out.outputs = ()
            return
        self._render_header()
        self._render_graph_controls(full)
        self._show_graph(m.graph)
        self._render_schedule()
        self._render_memory()

    def header_text(self) -> str | None:
        """The run's one-line header. Its status and step count come from the Steps tab's own
        source (the polled steps.jsonl, :class:`StepsModel`), so the two agree at every poll;
        the record (graphs, environment) only for what does not change while a run writes steps."""
        m = self.model
        rec = m.record
        if rec is None:
            return None
        st = m.steps
        status = st.status if st is not None and st.status not in ("", "unknown") else rec.manifest["status"]
        n = st.n_steps() if st is not None else len(rec.steps)
        return (f"{rec.path}: {status}, {rec.manifest['world_size']} rank(s), {len(rec.graph_ids)} graph(s), "
                f"{n} step(s); torch {rec.environment['torch']} on {rec.environment['hostname']}")

    def _render_header(self) -> None:
        text = self.header_text()
        if text is not None:
            self._say(text)

    def _render_views(self, views: tuple[str, ...]) -> None:
        """Re-render only some views (a click in the graph or on a schedule bar)."""
        if "graph" in views:
            self._render_graph_controls(False)
            self._show_graph(self.model.graph)
        if "schedule" in views:
            self._render_schedule()

    def export_html(self, path: str | Path) -> Path:
        """A static, self-contained HTML file of the shown run (the CLI report: graphs, schedule,
        memory, sortable tables; no controls that would not work without a kernel)."""
        from deepcompile.report.html import render_report

        if self.model.run_dir is None:
            raise RecordError("no run to export")
        return render_report(self.model.run_dir, path, rank=self.model.rank)
