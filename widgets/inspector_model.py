"""The inspector's state without widgets: the runs it knows, the one shown, and its views' models.

:class:`InspectorModel` opens a run record (one that cannot be read is kept as an error message),
links a selected node across the graph and the schedule, builds the command Run starts (the CLI
demo with the edited passes, or a script's recorded command) and summarises runs for the runs
table and the previous-vs-new comparison. The ipywidgets face,
:class:`~deepcompile.widgets.inspector.Inspector`, calls these methods; tests call them without a
browser.
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from deepcompile.record import schema as S
from deepcompile.record.reader import RecordError, load_json, read_run

from .graph_view import GraphModel
from .launcher import Job, RelaunchError, is_demo_command, relaunch_command
from .passes_view import PassesModel, new_run_dir
from .steps_view import StepsModel
from .timeline_view import MemoryModel, ScheduleModel, memory_view, peak_label, view_peak

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
