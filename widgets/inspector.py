"""The Inspector: ipywidgets face over the plain-Python models of this package.

``Inspector(run_dir)`` shows a finished (or still running) run; ``Inspector.launch(...)`` starts
the CLI demo (or a script under torchrun) in the background and follows it. Tabs: Graph,
Schedule, Memory, Steps (live), Passes & runs (controls from the passes' declared parameters;
Run re-launches with the edited values and adds the new run beside the old one).

State lives in :class:`InspectorModel` (and the models it holds); the widget callbacks only call
model methods and re-render, so tests drive the same methods without a browser. A missing or
broken record is shown as a message (the :class:`RecordError` text), never a traceback.

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
import time
import traceback
from pathlib import Path
from typing import Any, Iterable

from deepcompile.plan import estimate as E
from deepcompile.record import schema as S
from deepcompile.record.reader import RecordError, load_json, read_run

from .canvas import have_anywidget, make_canvas
from .graph_view import COLOR_MODES, FOLD_MARK, OPEN_MARK, GraphModel
from .launcher import Job, RelaunchError, demo_command, is_demo_command, job_env, relaunch_command, script_command
from .passes_view import PassesModel, make_control, new_run_dir
from .timeline_view import (MemoryModel, ScheduleModel, StepsModel, bar_node, memory_view, peak_label, view_figure,
                            view_peak)

esc = html.escape


def _timings(rec) -> dict:
    """(graph_id, kind, node) -> latency µs: the profile's where recorded, else the schedule's."""
    out = {}
    for e in (rec.schedule or {}).get("events", []):
        out[(e["graph_id"], e["kind"], e["node"])] = e["end_us"] - e["start_us"]
    for g in (rec.profile or {}).get("graphs", []):
        for n in g["nodes"]:
            if n.get("latency_ms") is not None:
                out[(g["graph_id"], g["kind"], n["name"])] = n["latency_ms"] * 1e3
    return out


def _demo_options(argv: list[str]) -> dict:
    """--model, --batch and --cpu of a recorded demo command line (a re-run keeps them)."""
    out: dict[str, Any] = {}
    for i, a in enumerate(argv):
        if a == "--cpu":
            out["cpu"] = True
        elif a == "--model" and i + 1 < len(argv):
            out["model"] = argv[i + 1]
        elif a == "--batch" and i + 1 < len(argv) and argv[i + 1].isdigit():
            out["batch"] = int(argv[i + 1])
        elif a.startswith("--model="):
            out["model"] = a.split("=", 1)[1]
    return out


class InspectorModel:
    """Runs known to the inspector, the one shown, and the models of its views."""

    def __init__(self, run_dir: str | Path | None, rank: int = 0, *, use_dot: bool | None = None):
        self.runs: list[Path] = []
        self.rank = rank
        self.use_dot = use_dot
        self.run_dir: Path | None = None
        self.record = None
        self.error: str | None = None
        self.graph: GraphModel | None = None
        self.schedule: ScheduleModel | None = None
        self.memory: MemoryModel | None = None
        self.steps: StepsModel | None = None
        self.passes: PassesModel | None = None
        self.jobs: dict[Path, Job] = {}
        self.view: dict | None = None          # record.reader.memory_view: the one memory truth
        self.view_error: str | None = None
        self.compare_base: Path | None = None  # the run a re-run is compared with
        self.rerun_note = ""                   # what rerun_command decided (demo or the script's command)
        self.rerun_cwd: str | None = None
        if run_dir is not None:
            self.open(run_dir)

    def add_run(self, run_dir: str | Path) -> Path:
        p = Path(run_dir)
        if p not in self.runs:
            self.runs.append(p)
        return p

    def open(self, run_dir: str | Path, rank: int | None = None) -> bool:
        """Load ``run_dir``; False (and ``error`` set) when the record cannot be read."""
        self.run_dir = self.add_run(run_dir)
        if rank is not None:
            self.rank = rank
        self.steps = StepsModel(self.run_dir)
        self.steps.poll()
        try:
            rec = read_run(self.run_dir, self.rank)
        except RecordError as e:
            self.record, self.error = None, str(e)
            self.graph = self.schedule = self.memory = None
            if self.passes is None:
                self.passes = PassesModel(None)
            return False
        except Exception as e:  # never a traceback in the widget
            self.record, self.error = None, f"{self.run_dir}: cannot be read ({type(e).__name__}: {e})"
            self.graph = self.schedule = self.memory = None
            return False
        self.record, self.error = rec, None
        self.graph = GraphModel(rec, timings=_timings(rec), use_dot=self.use_dot)
        self.schedule = ScheduleModel(self.run_dir, rec)
        self.memory = MemoryModel(rec, pscopes=self.graph.pscopes)
        self.view, self.view_error = memory_view(rec, self.rank)
        self.passes = PassesModel(rec.config, plan=self._plan(self.run_dir, self.rank))
        return True

    @staticmethod
    def _plan(run_dir: Path, rank: int) -> dict | None:
        """plan.json (the planner's choice) of a rank, None where absent or unreadable."""
        p = Path(run_dir) / S.rank_dir_name(rank) / getattr(S, "PLAN", "plan.json")
        try:
            obj = load_json(p, optional=True, root=run_dir)
        except RecordError:
            return None
        return obj if isinstance(obj, dict) else None

    def peak(self) -> dict | None:
        """The run's one peak ({bytes, where, source}) from memory_view: what every view shows."""
        return view_peak(self.view)

    def reload(self) -> bool:
        return self.open(self.run_dir) if self.run_dir is not None else False

    # ------------------------------------------------------------ linking
    def select_node(self, name: str | None) -> None:
        """Select a node in every view (graph box outlined, schedule bars outlined)."""
        if self.graph:
            self.graph.select_node(name)
        if self.schedule:
            self.schedule.select_node(name)

    def click_graph(self, key: str, shift: bool = False) -> tuple[str, str | None]:
        """A click on the graph box ``group-<key>`` (sent by the front end): expand / collapse it, or
        select its node in every view (see :meth:`GraphModel.handle_click`)."""
        if self.graph is None:
            return "ignored", None
        action, what = self.graph.handle_click(key, shift)
        if action == "selected":
            self.select_node(what)
        return action, what

    def click_bar(self, node: str | None) -> None:
        """A click on a schedule bar: select its node (the graph outlines the box holding it)."""
        self.select_node(node or None)

    def set_kind(self, kind: str) -> None:
        self.set_graph(self.graph.graph_id, kind)

    def set_graph(self, graph_id: int, kind: str | None = None) -> None:
        if graph_id != self.graph.graph_id:
            self.graph.set_graph(graph_id)
        if kind is not None:
            self.graph.set_kind(kind)
        key = (self.graph.graph_id, self.graph.kind)
        if self.schedule and key in self.schedule.keys:
            self.schedule.set_graph(*key)
        if self.memory and key in self.memory.keys:
            self.memory.set_graph(*key)

    # ------------------------------------------------------------ re-runs
    def recorded_command(self, run_dir: Path | None = None):
        """How the shown run was launched: the argv of a job started here, else the record's
        command (``record.reader.run_command``); None when neither is known."""
        run_dir = Path(run_dir or self.run_dir)
        job = self.jobs.get(run_dir)
        if job is not None:
            return {"argv": job.argv, "relaunch": job.argv, "cwd": job.cwd, "launcher": "inspector"}
        try:
            from deepcompile.record.reader import run_command
        except ImportError:
            return None
        try:
            return run_command(run_dir)
        except RecordError:
            return None

    def rerun_command(self, out: str | Path | None = None, *, steps: int | None = None,
                      ranks: int | None = None, cpu: bool = True) -> tuple[Path, list[str]]:
        """(new run directory, argv) of Run. A run of the CLI demo (started here or recorded as
        one) is re-run as the demo with the edited passes and values, profiling step 1; a run
        recorded by a user's script re-launches that script's recorded command, writing to the
        new directory. RelaunchError (with the reason) when the record holds no command that can
        run again: never the built-in demo in its place. ``rerun_note`` says which it chose."""
        base = self.run_dir or Path("runs/inspector")
        out = Path(out) if out is not None else new_run_dir(base)
        if steps is None:
            steps = max(2, self.steps.n_steps()) if self.steps and self.steps.n_steps() else 20
        if ranks is None:
            ranks = int(self.record.manifest["world_size"]) if self.record else 2
        self.rerun_cwd = None
        launched_here = self.run_dir is None
        cmd = None if self.run_dir is None else self.recorded_command()
        argv_rec = list((cmd or {}).get("relaunch") or (cmd or {}).get("argv") or []) if isinstance(cmd, dict) else list(cmd or [])
        if launched_here or is_demo_command(argv_rec):
            opt = _demo_options(argv_rec)
            model = getattr(self, "launch_model", None) or opt.get("model")
            self.rerun_note = "the CLI demo with the edited passes (profiling step 1)"
            return out, self.passes.command(out, ranks=ranks, steps=steps, cpu=cpu or opt.get("cpu", False),
                                            model=model, batch=opt.get("batch"))
        if cmd is None:
            raise RelaunchError(
                f"{self.run_dir}: the record holds no launch command (written by a script before commands were "
                "recorded, or by a deepcompile without record.reader.run_command), so Run cannot start it again; "
                "run your script again yourself, with a new output directory")
        argv, cwd = relaunch_command(cmd, self.run_dir, out, ranks=ranks)
        self.rerun_cwd = cwd
        self.rerun_note = ("your script's recorded command, writing to the new directory (the pass values edited "
                           "here do not reach a script: it builds its own config)")
        return out, argv

    # ------------------------------------------------------------ comparison
    def _signature(self, run_dir: Path) -> tuple:
        """(size, mtime) of the files a run's summary reads: cached results stay until one changes."""
        rd = Path(run_dir) / S.rank_dir_name(self.rank)
        out = []
        for p in (Path(run_dir) / S.MANIFEST, rd / S.MEMORY, rd / S.PLAN, rd / S.STEPS, rd / S.GRAPHS_DIR / S.GRAPH_INDEX):
            try:
                st = p.stat()
                out.append((st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def _cached(self, run_dir: Path, what: str, fn):
        cache = self.__dict__.setdefault("_cache", {})
        key = (str(run_dir), what, self.rank)
        sig = self._signature(run_dir)
        hit = cache.get(key)
        if hit is not None and hit[0] == sig:
            return hit[1]
        val = fn()
        cache[key] = (sig, val)
        return val

    def summary_of(self, run_dir: Path) -> dict:
        """See :meth:`_summary_of`; cached until the run's files change."""
        return self._cached(Path(run_dir), "summary", lambda: self._summary_of(Path(run_dir)))

    def _summary_of(self, run_dir: Path) -> dict:
        """Step time (median of the steady steps), the one peak (memory_view, labelled) and the
        graph sizes after each pass (nodes summed over the graphs' last compile) of one run."""
        out: dict[str, Any] = {"run": Path(run_dir).name, "step_ms": None, "peak": None, "sizes": {}, "error": None}
        sm = StepsModel(run_dir)
        sm.poll()
        ss = sm.steps.get(self.rank, next(iter(sm.steps.values()), []))
        try:
            cfg = S.check_config(str(Path(run_dir) / S.CONFIG), load_json(Path(run_dir) / S.CONFIG, root=run_dir))
        except (RecordError, OSError):
            cfg = {}
        from deepcompile.record.steps import steady_median_ms

        # compile, profiling, re-compile left out: the one median (report, inspect, what-if)
        out["step_ms"] = steady_median_ms(ss, cfg)[0]
        out["steps"] = len(ss)
        try:
            rec = self.record if self.record is not None and Path(run_dir) == self.run_dir else read_run(run_dir, self.rank)
        except RecordError as e:
            out["error"] = str(e)
            return out
        view = self.view if Path(run_dir) == self.run_dir else memory_view(run_dir, self.rank)[0]
        out["peak"] = view_peak(view)
        last: dict[tuple, Any] = {}
        for v in rec.graphs:
            if v.kind != "dynamo":
                last[(v.graph_id, v.kind, v.after)] = v  # a later compile replaces an earlier one
        sizes: dict[str, int] = {}
        for (_, _, after), v in last.items():
            sizes[after] = sizes.get(after, 0) + len(v.nodes)
        out["sizes"] = sizes
        return out

    def compare(self, a: Path | None = None, b: Path | None = None) -> dict | None:
        """Side by side: the previous run (``compare_base``) and the shown one."""
        a = a or self.compare_base
        b = b or self.run_dir
        if a is None or b is None or Path(a) == Path(b):
            return None
        return {"before": self.summary_of(Path(a)), "after": self.summary_of(Path(b))}

    def compare_html(self) -> str:
        c = self.compare()
        if c is None:
            return ""
        A, B = c["before"], c["after"]
        ms = lambda v: "–" if v is None else f"{v:.1f} ms"  # noqa: E731
        rows = [("step time (median, steady steps)", ms(A["step_ms"]), ms(B["step_ms"])),
                ("peak memory", peak_label(A["peak"]), peak_label(B["peak"]))]
        for name in list(dict.fromkeys(list(A["sizes"]) + list(B["sizes"]))):
            rows.append((f"nodes after {name}", str(A["sizes"].get(name, "–")), str(B["sizes"].get(name, "–"))))
        body = "".join(f"<tr><td>{esc(k)}</td><td>{esc(x)}</td><td>{esc(y)}</td></tr>" for k, x, y in rows)
        errs = "".join(f"<div style='color:#b00020'>{esc(r['run'])}: {esc(r['error'])}</div>" for r in (A, B) if r["error"])
        return (f"<table class='dc-compare' style='font-size:12px'><tr><th></th><th>{esc(A['run'])} (previous)</th>"
                f"<th>{esc(B['run'])} (new)</th></tr>{body}</table>{errs}")

    def run_summary(self, run_dir: Path) -> dict:
        """One row of the runs table (readable even for a broken or unfinished record)."""
        row: dict[str, Any] = {"run": str(run_dir), "status": "", "passes": "", "median_step_s": None,
                               "peak_bytes": None, "steps": 0}
        job = self.jobs.get(run_dir)
        try:
            # through the reader: a shared folder may hold a FIFO or a symlink out of it
            m = S.check_manifest(str(run_dir / S.MANIFEST), load_json(run_dir / S.MANIFEST, root=run_dir))
            row["status"] = m.get("status", "")
            cfg = S.check_config(str(run_dir / S.CONFIG), load_json(run_dir / S.CONFIG, root=run_dir))
            sched = [e for e in (cfg.get("schedule") or []) if isinstance(e, dict) and e.get("passes")]
            listed = sched[-1]["passes"] if sched else cfg.get("passes", [])   # what trained last
            row["passes"] = ", ".join(
                p["name"] + (f"({', '.join(f'{k}={v}' for k, v in p.get('params', {}).items())})" if p.get("params") else "")
                if isinstance(p, dict) else str(p) for p in listed)
            sm = StepsModel(run_dir)
            sm.poll()
            from deepcompile.record.steps import steady_median_ms

            ss = sm.steps.get(self.rank, next(iter(sm.steps.values()), []))
            med = steady_median_ms(ss, cfg)[0]   # the same steady steps as the comparison and the report
            row["steps"] = sm.n_steps()
            row["median_step_s"] = None if med is None else med / 1e3
            # the run's one peak (memory_view, labelled), not the allocator's maximum over steps
            pk = self.peak() if run_dir == self.run_dir else self._cached(run_dir, "peak", lambda: view_peak(
                memory_view(run_dir, self.rank)[0]))
            row["peak"] = pk
            row["peak_bytes"] = pk["bytes"] if pk else None
        except RecordError as e:
            if not row["status"]:
                row["status"] = "no record yet" if "missing" in str(e) else "unreadable record"
            else:
                row["status"] += " (unreadable record)"
        except (OSError, ValueError, KeyError, TypeError):
            row["status"] = row["status"] or "no record yet"
        if job is not None and job.running:
            row["status"] = f"running ({job.step}/{job.total or '?'})"
        elif job is not None and job.status not in ("finished",):
            row["status"] = job.status
        return row


# --------------------------------------------------------------------------- the widget
class Inspector:
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
        # graph tab
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
        # schedule tab
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
        # memory tab
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
        # steps tab
        self.st_out = W.Output()
        self.st_out.add_class("dc-steps")
        self.st_note = W.HTML()
        self.st_mem = W.Output()               # the latest measured step's memory timeline, live
        self.st_mem.add_class("dc-live-memory")
        steps_tab = W.VBox([self.st_note, self.st_out, self.st_mem])
        # passes & runs tab
        self.p_box = W.VBox()
        self.p_steps = W.BoundedIntText(value=5, min=2, max=100000, description="steps")
        self.p_ranks = W.BoundedIntText(value=2, min=1, max=64, description="ranks")
        self.p_run = W.Button(description="Run", button_style="primary", tooltip="re-run the job with these values")
        self.p_predict = W.Button(description="Predict", tooltip="predict step time and memory of these values "
                                  "from the recorded graphs and profile (what-if: no re-compile)")
        self.p_predict.add_class("dc-predict")
        self.p_limit = W.BoundedFloatText(value=0.0, min=0.0, max=1e6, step=0.5, description="memory limit GiB",
                                          tooltip="the planner's memory limit for the what-if (0: the record's)",
                                          style={"description_width": "120px"})
        self.p_limit.add_class("dc-memory-limit")
        self.p_limit.observe(lambda ch: self.schedule_whatif(), names="value")
        self.p_whatif = W.HTML()
        self.p_whatif.add_class("dc-whatif")
        self.p_wstatus = W.HTML()
        self.p_compare = W.HTML()
        self.p_compare.add_class("dc-compare-box")
        self.p_cancel = W.Button(description="Cancel", button_style="danger", disabled=True)
        self.p_run.add_class("dc-run")
        self.p_run.on_click(lambda _: self.run())
        self.p_predict.on_click(lambda _: self._predict())
        self.p_cancel.on_click(lambda _: self.cancel())
        self.p_progress = W.IntProgress(value=0, min=0, max=1, description="progress")
        self.p_msg = W.HTML()
        self.p_cmd = W.HTML()
        self.p_log = W.Output(layout=W.Layout(max_height="240px", overflow="auto", border="1px solid #ddd"))
        self.p_runs = W.HTML()
        passes_tab = W.VBox([self.p_box, W.HBox([self.p_steps, self.p_ranks, self.p_limit]),
                             W.HBox([self.p_run, self.p_predict, self.p_cancel, self.p_progress]),
                             self.p_msg, self.p_wstatus, self.p_whatif, self.p_cmd, self.p_log,
                             W.HTML("<b>new vs previous run</b>"), self.p_compare,
                             W.HTML("<b>runs</b>"), self.p_runs])
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

    # ------------------------------------------------------------ clicks from the front end
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

    def _say(self, text: str, error: bool = False) -> None:
        color = "#b00020" if error else "#37474f"
        self.message.value = f"<div style='color:{color};font-size:13px;white-space:pre-wrap'>{esc(text)}</div>" if text else ""

    def _set_pass(self, v) -> None:
        self.model.graph.set_pass(v)
        if self.model.memory and (self.model.graph.graph_id, self.model.graph.kind) == self.model.memory.key:
            self.model.memory.set_pass(v)

    @staticmethod
    def _plot(out, fig) -> None:
        """Put a plotly figure in an Output widget (thread-safe: sets the outputs directly)."""
        import plotly.io as pio

        spec = json.loads(pio.to_json(fig, validate=False))
        out.outputs = ({"output_type": "display_data", "metadata": {},
                        "data": {"application/vnd.plotly.v1+json": spec,
                                 "text/plain": f"<plotly figure: {len(spec.get('data', []))} traces>"}},)

    # ------------------------------------------------------------ open / render
    def _index_signature(self):
        m = self.model
        if m.run_dir is None:
            return None
        try:
            st = (m.run_dir / f"rank{m.rank}" / "graphs" / "index.json").stat()
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

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
                                     f"not the step's peak): high point {E.fmt_bytes(gp['value'])} at node "
                                     f"{gp['index']} ({esc(gp['node'])}, {esc(gp['series'])}); largest tensors live "
                                     "there: " + ", ".join(f"{esc(n)} {E.fmt_bytes(b)}" for n, b in gp["holders"])
                                     + "</div>")
            self.m_table.value = m.memory.table_html()

    def _render_views(self, views: tuple[str, ...]) -> None:
        """Re-render only some views (a click in the graph or on a schedule bar)."""
        if "graph" in views:
            self._render_graph_controls(False)
            self._show_graph(self.model.graph)
        if "schedule" in views:
            self._render_schedule()

    def _render_schedule(self) -> None:
        m = self.model
        if m.schedule:
            self.s_note.value = (f"<div style='font-size:12px'>{esc(m.schedule.source_note)}; measured and "
                                 "predicted in separate lanes; the numbers are per step (every graph)"
                                 + ("; click a bar to select its node in the graph" if self.s_fig is not None else "")
                                 + "</div>")
            self.s_numbers.value = m.schedule.numbers_html()
            self._plot_schedule(m.schedule.figure())

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

    def _render_steps(self, note_only: bool = False) -> None:
        st = self.model.steps
        if st is None:
            return
        if st.error and not st.steps:
            self.st_note.value = f"<div style='font-size:12px;color:#b00020'>{esc(st.error)}</div>"
            return
        following = self._poller is not None and self._poller.is_alive() and st.live
        n = st.n_steps()
        wait = ""
        if st.live and n == 0:   # the first step compiles: say so instead of an empty plot
            job = self.model.jobs.get(st.run_dir)
            since = f" ({time.time() - job.started_at:.0f} s since start)" if job and job.started_at else ""
            wait = (f"; step 1 is compiling the graphs{since}: {self._graphs_so_far()} graph version(s) "
                    "recorded so far; steps appear as each one ends")
        how = st.split_how(self.model.rank)
        how = (f"<div class='dc-split-note' style='font-size:11px;color:#555'>memory per step, by category: "
               f"{esc(how)}</div>") if how else ""
        self.st_note.value = (f"<div class='dc-steps-note' style='font-size:12px'>{st.status}; {n} step(s)"
                              + (f"; following live, every {self._interval():g} s" if following else "") + wait
                              + "</div>" + how)
        if note_only:
            self._render_live_memory()
            return
        self._plot(self.st_out, st.figure())
        self._render_live_memory()

    def _graphs_so_far(self) -> int:
        m = self.model
        try:
            idx = load_json(m.run_dir / S.rank_dir_name(m.rank) / S.GRAPHS_DIR / S.GRAPH_INDEX, optional=True,
                            root=m.run_dir)
        except RecordError:
            return 0
        return len(idx) if isinstance(idx, list) else 0

    def _render_live_memory(self, force: bool = False) -> None:
        """The latest measured step's memory timeline by category, re-read when its file changes
        (the profiling step writes it while the job runs on)."""
        m = self.model
        st = m.steps
        if st is None:
            return
        sig = st.memory_signature(m.rank)
        if sig is None:
            if self._mem_sig is not None:
                self.st_mem.outputs = ()
            self._mem_sig = None
            return
        if sig == self._mem_sig and not force:
            return
        self._mem_sig = sig
        view = m.view if m.view is not None and not st.live else memory_view(m.run_dir, m.rank)[0]
        if view and (view.get("measured") or {}).get("samples"):
            try:
                self._plot(self.st_mem, view_figure(view, title=f"latest measured step: memory by category "
                                                                f"(peak {peak_label(view_peak(view))})"))
            except Exception:
                self.st_mem.outputs = ()

    def _whatif_key(self) -> tuple | None:
        """What a what-if predicts: the pass list with every shown value, and the memory limit."""
        pm = self.model.passes
        if pm is None:
            return None
        try:
            return (json.dumps(pm.whatif_passes(), sort_keys=True, default=str), float(self.p_limit.value or 0.0))
        except Exception:
            return None

    def clear_whatif(self) -> None:
        """No what-if shown: the table, its warning and the Schedule tab's what-if lane cleared
        (the controls changed since, e.g. back to the recorded values)."""
        self.last_whatif = None
        self._whatif_of = None
        self.p_whatif.value = ""
        self.p_wstatus.value = ""
        sc = self.model.schedule
        if sc is not None and getattr(sc, "whatif_events", None):
            sc.clear_whatif()
            try:
                self._render_schedule()
            except Exception:
                pass

    def _drop_stale_whatif(self) -> None:
        """The shown what-if, when the controls no longer hold the values it predicted, is stale:
        cleared rather than left beside values it is not of."""
        if self.last_whatif is not None and getattr(self, "_whatif_of", None) != self._whatif_key():
            self.clear_whatif()

    def reset_controls(self) -> None:
        """The Passes tab's controls back to the recorded values; the what-if of the edit cleared."""
        if self.model.passes is not None:
            self.model.passes.reset()
        self.clear_whatif()
        self.render(full=True)

    def _render_passes_tab(self, full: bool) -> None:
        pm = self.model.passes
        if pm is None:
            return
        self._drop_stale_whatif()
        if full or not self.p_box.children:
            rows = []
            for name in pm.order:
                cb = self.W.Checkbox(value=pm.enabled[name], description=f"pass {name}",
                                     tooltip=pm.registry[name].help, indent=False)
                cb.add_class(f"dc-pass-enable-{name}")
                cb.observe(lambda ch, n=name: (pm.enable(n, ch["new"]), self.schedule_whatif()), names="value")
                ctrls = [make_control(s, on_change=lambda _s: self.schedule_whatif())[1] for s in pm.specs[name]]
                help_ = self.W.HTML(f"<span style='font-size:11px;color:#666'>{esc(pm.registry[name].help)}</span>")
                rows.append(self.W.VBox([self.W.HBox([cb, help_])] + ctrls,
                                        layout=self.W.Layout(border="1px solid #eee", padding="4px")))
            self.p_box.children = rows
            if self.model.steps and self.model.steps.n_steps():
                self.p_steps.value = self.model.steps.n_steps()
            if self.model.record:
                self.p_ranks.value = int(self.model.record.manifest["world_size"])
        self.p_runs.value = self._runs_table()
        self.p_compare.value = self.model.compare_html()

    def _runs_table(self) -> str:
        rows = [self.model.run_summary(p) for p in self.model.runs]
        head = "<tr><th>run</th><th>status</th><th>passes</th><th>steps</th><th>median step</th><th>peak memory</th></tr>"
        body = []
        for r in rows:
            med = "" if r["median_step_s"] is None else f"{r['median_step_s'] * 1e3:.1f} ms"
            peak = "" if not r.get("peak") else peak_label(r["peak"])
            body.append(f"<tr><td>{esc(Path(r['run']).name)}</td><td>{esc(str(r['status']))}</td>"
                        f"<td>{esc(r['passes'])}</td><td>{r['steps']}</td><td>{med}</td><td>{peak}</td></tr>")
        body = "".join(body)
        return f"<table class='dc-runs' style='font-size:12px'>{head}{body}</table>"

    # ------------------------------------------------------------ live following
    def follow(self) -> None:
        """Poll the shown run's steps (and its record until complete) every ``poll_interval`` s,
        on a daemon thread: the kernel stays free."""
        if self._poller is not None and self._poller.is_alive():
            return
        self._stop.clear()
        self._poller = threading.Thread(target=self._poll_loop, name="deepcompile-inspector-poll", daemon=True)
        self._poller.start()

    def stop(self) -> None:
        """Stop following (the job, if any, keeps running; see :meth:`cancel`)."""
        self._stop.set()

    def _interval(self) -> float:
        """Seconds between polls: ``live_interval`` while a run is being written or a job runs."""
        st = self.model.steps
        live = (st is not None and st.live) or (self.job is not None and self.job.running)
        return self.live_interval if live else self.poll_interval

    def _poll_loop(self) -> None:
        while not self._stop.wait(self._interval()):
            try:
                self.poll_once()
            except Exception:  # keep polling; the message shows on the next render
                pass

    def poll_once(self) -> bool:
        """One polling round (what the thread does): re-read the steps and show new ones at once;
        then reload the record when it appears or completes, or (while it is written) when graphs
        were added, at most every ``reload_every_s``: a reload lays out graphs, which must not
        hold back the steps. True when something changed."""
        m = self.model
        if m.run_dir is None or m.steps is None:
            return False
        before = m.steps.status
        changed = m.steps.poll()
        if changed or m.steps.live:
            with self._lock:   # the steps first: each one shows as soon as its line is written
                self._render_steps(note_only=not changed)
                if changed:
                    self._render_header()   # the header counts from the same steps, at the same poll
                    self.p_runs.value = self._runs_table()
        isig = self._index_signature()
        new_graphs = isig is not None and isig != getattr(self, "_index_sig", None)
        finished = before != m.steps.status and m.steps.status in ("complete", "failed", "interrupted")
        due = time.time() - self._last_reload >= self.reload_every_s
        if (m.run_dir / S.MANIFEST).exists() and (finished or (isig is not None and new_graphs and due)
                                                  or (m.record is None and isig is not None and due)):
            self._index_sig = isig
            self._last_reload = time.time()
            self.open(m.run_dir)
            return True
        return changed

    # ------------------------------------------------------------ jobs
    def run(self, out: str | Path | None = None) -> Job | None:
        """Re-run the job with the passes tab's values (the demo profiles step 1, so what-if works
        on the new run; a script's run re-launches its recorded command). The run list switches
        to the new run at once, and the new run is compared with the one shown before."""
        pm = self.model.passes
        errs = pm.validate()
        if errs:
            self.p_msg.value = "<span style='color:#b00020'>" + esc("; ".join(errs)) + "</span>"
            return None
        try:
            out, argv = self.model.rerun_command(out, steps=self.p_steps.value, ranks=self.p_ranks.value)
        except RelaunchError as e:
            self.p_msg.value = f"<span class='dc-run-refused' style='color:#b00020'>Run: {esc(str(e))}</span>"
            return None
        prev = self.model.run_dir
        job = self.start_job(argv, out, cwd=self.model.rerun_cwd, env=job_env())
        self.p_msg.value += f"<br><span style='font-size:11px'>running {esc(self.model.rerun_note)}</span>"
        self.switch_to(out, compare_with=prev)
        return job

    def switch_to(self, run_dir: str | Path, *, compare_with: str | Path | None = None) -> None:
        """Show ``run_dir`` (the run list selects it; a record still being written is followed)
        and compare it with ``compare_with`` in the Passes tab."""
        run_dir = Path(run_dir)
        if compare_with is not None and Path(compare_with) != run_dir:
            self.model.compare_base = Path(compare_with)
        self._last_reload = 0.0
        self._mem_sig = None
        keep = self.model.passes     # the edited values stay while the new record is not there yet
        self.open(run_dir)
        if self.model.record is None and keep is not None:
            self.model.passes = keep
        self.follow()

    def start_job(self, argv: list[str], out: str | Path, *, cwd: str | Path | None = None, env: dict | None = None) -> Job:
        if self.job is not None and self.job.running:
            raise RuntimeError("a job is already running; cancel it first")
        out = Path(out)
        self.p_cmd.value = f"<code style='font-size:11px'>{esc(' '.join(argv))}</code>"
        self.p_log.outputs = ()
        self.p_progress.value, self.p_progress.max = 0, 1
        self.p_progress.bar_style = ""

        def on_line(line: str) -> None:
            self.p_log.append_stdout(line + "\n")
            if self.job is not None and self.job.total:
                self.p_progress.max = self.job.total
                self.p_progress.value = self.job.step

        def on_exit(job: Job) -> None:
            self.p_cancel.disabled = True
            self.p_run.disabled = False
            self.p_progress.bar_style = "success" if job.returncode == 0 else "danger"
            self.p_msg.value = f"<span>job {esc(job.status)}: {esc(str(out))}</span>"
            if self.model.run_dir == out:
                self.open(out)
            with self._lock:
                self.p_runs.value = self._runs_table()

        self.job = Job(argv, cwd=cwd, env=env, out_dir=out, on_line=on_line, on_exit=on_exit)
        self.model.jobs[out] = self.job
        self.model.add_run(out)
        self._muted = True
        try:
            self.run_select.options = [str(p) for p in self.model.runs]
            if self.model.run_dir is not None:
                self.run_select.value = str(self.model.run_dir)
        finally:
            self._muted = False
        self.p_cancel.disabled = False
        self.p_run.disabled = True
        self.p_msg.value = f"<span>job running → {esc(str(out))}</span>"
        self.job.start()
        self.p_runs.value = self._runs_table()
        return self.job

    def cancel(self) -> None:
        if self.job is not None:
            self.job.cancel()

    def wait(self, timeout: float | None = 600) -> int | None:
        """Block until the current job ends (then show its run when it is the one opened)."""
        if self.job is None:
            return None
        rc = self.job.wait(timeout)
        if rc is not None and self.model.run_dir == self.job.out_dir:
            time.sleep(0.05)
            self.open(self.job.out_dir)
        return rc

    # ------------------------------------------------------------ what-if
    def schedule_whatif(self) -> None:
        """An edit of a pass or planner parameter: predict again once the edits pause for
        ``whatif_delay_s`` (debounced; a newer edit cancels the pending prediction)."""
        if self._muted or self.model.record is None:
            return
        self._whatif_gen += 1
        gen = self._whatif_gen
        if self._whatif_timer is not None:
            self._whatif_timer.cancel()
        self.p_wstatus.value = "<span style='font-size:12px;color:#666'>what-if: predicting the edited values…</span>"
        t = threading.Timer(self.whatif_delay_s, lambda: self.whatif_now(gen))
        t.daemon = True
        self._whatif_timer = t
        t.start()

    def whatif_now(self, gen: int | None = None):
        """Predict the edited values at once (plan.whatif.predict_run on the record's traced graphs:
        no re-compile) and show it beside the measured run; also in the Schedule tab's what-if
        lanes. Returns the WhatIf, or None with the reason shown."""
        m = self.model
        self.whatif_error = None
        if m.record is None or m.passes is None:
            self.whatif_error = "no record shown" + (f" ({m.error})" if m.error else "")
            self.p_whatif.value = f"<div class='dc-whatif-error' style='color:#b00020'>what-if: {esc(self.whatif_error)}</div>"
            return None
        limit = float(self.p_limit.value) or None
        t0 = time.perf_counter()
        try:
            from deepcompile.plan.whatif import WhatIfError  # noqa: F401  (the module is there)
        except ImportError:
            self.p_whatif.value = ("<div class='dc-whatif-error' style='color:#b00020'>what-if needs "
                                   "deepcompile.plan.whatif (not in this version)</div>")
            return None
        try:
            with self._whatif_lock:
                if gen is not None and gen != self._whatif_gen:   # superseded while waiting
                    return None
                t0 = time.perf_counter()
                key = self._whatif_key()
                w = m.passes.whatif(m.run_dir, rank=m.rank, memory_limit_gib=limit)
        except Exception as e:  # ConfigError / WhatIfError name the value and the reason
            self.whatif_error = f"{type(e).__name__}: {e}"
            if gen is not None and gen != self._whatif_gen:
                return None
            self.p_wstatus.value = ""
            self.p_whatif.value = (f"<div class='dc-whatif-error' style='font-size:12px;color:#b00020'>what-if: "
                                   f"{esc(str(e))}</div>")
            return None
        took = time.perf_counter() - t0
        if gen is not None and gen != self._whatif_gen:   # a newer edit is on its way
            return None
        with self._lock:
            self.p_whatif.value = self.whatif_html(w, took)
            if m.schedule is not None:
                # the lane carries the WhatIf itself: its step and peak are the table's, and it
                # names the edit it predicts
                m.schedule.set_whatif(w, edit=m.passes.describe_edits() or "the recorded values")
                try:
                    self._render_schedule()
                except Exception:
                    pass
            # published last: whoever sees the status cleared or the new result (a person, a test on
            # another thread) sees the schedule already re-drawn, not its traces mid-replacement
            self._whatif_of = key
            self.last_whatif = w
            self.p_wstatus.value = ""
        return w

    def whatif_html(self, w, took: float | None = None) -> str:
        """Measured (this run) beside predicted (the edited values): step time and the peak, both
        labelled, memory by category, and the seconds the prediction took."""
        from deepcompile.report.figures import fmt_bytes as fb

        m = self.model
        summ = m.summary_of(m.run_dir)
        pk = m.peak()
        pred_pk = {"bytes": int(w.peak_bytes), "where": w.peak_where, "source": "predicted"}
        cats = list(dict.fromkeys(list(w.memory) + list(((m.view or {}).get("peak") or {}).get("by_category") or {})))
        meas_cat = ((m.view or {}).get("peak") or {}).get("by_category") or {}
        rows = [("step time", "–" if summ["step_ms"] is None else f"{summ['step_ms']:.1f} ms (measured median of "
                 "steady steps)",
                 f"<span class='dc-whatif-step'>{w.step_ms:.1f} ms</span> (predicted)"),
                ("peak memory", esc(peak_label(pk)), f"<span class='dc-whatif-peak'>{esc(peak_label(pred_pk))}</span>")]
        rows += [(f"&nbsp;&nbsp;{esc(c)}", fb(meas_cat[c]) if c in meas_cat else "–", fb(w.memory.get(c)))
                 for c in cats]
        body = "".join(f"<tr><td>{k}</td><td>{a}</td><td>{b}</td></tr>" for k, a, b in rows)
        secs = w.seconds if took is None else took
        # a memory limit the edit does not fit: re-planned (said so) or cannot (said so), in red
        warn = "".join(f"<div class='dc-whatif-warning' style='color:#b00020;font-weight:bold'>{esc(x)}</div>"
                       for x in (getattr(w, "warnings", None) or []))
        edit = m.passes.describe_edits() if m.passes is not None else ""
        notes = "".join(f"<li>{esc(n)}</li>" for n in (w.notes or [])[:8])
        more = f"<li>… {len(w.notes) - 8} more</li>" if len(w.notes or []) > 8 else ""
        return (f"<div style='font-size:12px'>{warn}<b>what-if</b> of <span class='dc-whatif-edit'>"
                f"{esc(edit or 'the recorded values')}</span>: <span class='dc-whatif-headline'>{esc(w.headline())}"
                "</span> (the Schedule tab's what-if lane, the report and <code>deepcompile inspect</code> give "
                "these numbers for these values)<br>passes and planner re-run on the recorded graphs, "
                f"no re-compile, took <span class='dc-whatif-seconds'>{secs:.2f} s</span>"
                f"<table class='dc-whatif-table' style='font-size:12px'><tr><th></th><th>this run</th>"
                f"<th>edited values</th></tr>{body}</table><ul style='margin:2px 0'>{notes}{more}</ul>"
                "Run measures it.</div>")

    def _predict(self) -> None:
        """The Predict button: the what-if of the shown values, now."""
        if self._whatif_timer is not None:
            self._whatif_timer.cancel()
        self._whatif_gen += 1
        self.whatif_now(self._whatif_gen)

    @classmethod
    def launch(cls, out: str | Path | None = None, *, ranks: int = 2, steps: int = 20,
               passes: Iterable[str] | None = None, pass_params: dict[str, dict] | None = None,
               script: str | Path | None = None, script_args: Iterable[str] = (), compiler: str | None = None,
               cpu: bool = False, batch: int | None = None, poll_interval: float = 1.0,
               cwd: str | Path | None = None, model: str | None = None, profile_step: int | None = 1,
               **kw) -> "Inspector":
        """Start a job in the background and return an Inspector that follows it.

        Without ``script``: the CLI demo (``python -m deepcompile demo``; GPUs when present, else
        gloo on the CPU) training ``model`` (a ``"package.module:factory"`` whose factory returns
        ``(nn.Module, make_batch)``; see ``deepcompile demo --help``) or the built-in GPT;
        ``passes=None`` runs its default plan (zero3, step 1 profiled, then the planned passes),
        a pass list runs those with step ``profile_step`` profiled (so what-if works on the
        record). With ``script``: ``torchrun --nproc-per-node=ranks script script_args`` (the
        script writes its record to ``out``, e.g. from an argument)."""
        out = Path(out) if out is not None else Path(f"runs/inspector-{time.strftime('%Y%m%d-%H%M%S')}")
        if script is None:
            argv = demo_command(out, passes=passes, pass_params=pass_params, ranks=ranks, steps=steps,
                                compiler=compiler, cpu=cpu, batch=batch, model=model,
                                profile_step=profile_step if passes is not None and steps > 1 else None)
        else:
            argv = script_command(script, ranks=ranks, args=script_args)
        self = cls(None, poll_interval=poll_interval, **kw)
        self.model.launch_model = model  # Run re-launches the same model
        self.model.run_dir = self.model.add_run(out)
        self.model.steps = StepsModel(out)
        self.model.error = f"{out}: job starting"
        self.start_job(argv, out, cwd=cwd, env=job_env())
        self.p_steps.value, self.p_ranks.value = steps, ranks
        self.render(full=True)
        self.follow()
        return self

    def export_html(self, path: str | Path) -> Path:
        """A static, self-contained HTML file of the shown run (the CLI report: graphs, schedule,
        memory, sortable tables; no controls that would not work without a kernel)."""
        from deepcompile.report.html import render_report

        if self.model.run_dir is None:
            raise RecordError("no run to export")
        return render_report(self.model.run_dir, path, rank=self.model.rank)
