"""Models of the schedule and memory views, the run's one memory peak, and their plotly figures.

* :class:`ScheduleModel`: the record's schedule events of every rank (measured and predicted,
  as recorded; the naive order-based estimate when the record has none), one timeline lane per
  (rank, stream, source); a selected node is drawn outlined.
* :class:`MemoryModel`: the memory timeline of one graph (recorded samples, plus the naive
  liveness estimate of the selected pass and the one before it), the peak marked and the
  tensors live at the peak listed; a per-operator table sortable by any column.
* :func:`memory_view`, :func:`view_peak`, :func:`peak_label`, :func:`view_figure`: the run's
  memory by category and its one peak, as every view shows them.

The Steps tab's model, :class:`~deepcompile.widgets.steps_view.StepsModel`, is in
:mod:`~deepcompile.widgets.steps_view`. Figures are built with plotly's ``graph_objects`` (no
network: the JupyterLab plotly extension renders them offline).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from deepcompile.plan import estimate as E
from deepcompile.record import schema as S
from deepcompile.record.reader import RecordError, load_json, read_run
from deepcompile.vocab.memory import fmt_bytes

STREAM_ORDER = ["compute", "allgather", "reduce", "copy"]
STREAM_COLORS = {"compute": "#4e79a7", "allgather": "#f28e2b", "reduce": "#9c6ade", "copy": "#59a14f"}


def _final_versions(rec) -> dict[tuple[int, str], Any]:
    last = {}
    for v in rec.graphs:
        if v.kind != "dynamo":
            last[(v.graph_id, v.kind)] = v
    return last


# --------------------------------------------------------------------------- schedule
class ScheduleModel:
    def __init__(self, run_dir: str | Path, rec, *, ranks: list[int] | None = None):
        self.run_dir = Path(run_dir)
        self.rec = rec
        self.events: list[dict] = []      # each with "rank"
        self.source_note = ""
        ranks = ranks if ranks is not None else list(rec.manifest["ranks"])
        recorded = False
        for r in ranks:
            sched = rec.schedule if r == rec.rank else self._schedule_of(r)
            for e in (sched or {}).get("events", []):
                self.events.append(dict(e, rank=r))
                recorded = True
        if recorded:
            srcs = sorted({e["source"] for e in self.events})
            self.source_note = "recorded schedule (" + ", ".join(srcs) + ")"
        else:
            ev, _ = E.estimate_versions([vars(v) for v in _final_versions(rec).values()])
            self.events = [dict(e, rank=rec.rank) for e in ev]
            self.source_note = "no schedule in the record: naive order-based estimate (predicted)"
        self.keys = sorted({(e["graph_id"], e["kind"]) for e in self.events},
                           key=lambda k: (k[0], k[1] != "forward"))
        self.key = self.keys[0] if self.keys else None
        self.selected_node: str | None = None
        self.whatif_events: list[dict] = []
        self.whatif_totals: dict = {}     # source -> the what-if's own step and peak (set_whatif)
        self.scope = "graph"     # "graph": the selected graph's events; "step": every graph, end to end

    def _schedule_of(self, rank: int) -> dict | None:
        p = self.run_dir / S.rank_dir_name(rank) / S.SCHEDULE
        try:
            obj = load_json(p, optional=True, root=self.run_dir)
            return None if obj is None else S.check_schedule(str(p), obj)
        except RecordError:
            return None

    def set_graph(self, graph_id: int, kind: str) -> None:
        if (graph_id, kind) not in self.keys:
            raise ValueError(f"no schedule for graph {graph_id} {kind} (have {self.keys})")
        self.key = (graph_id, kind)

    def select_node(self, name: str | None) -> None:
        self.selected_node = name

    def current(self) -> list[dict]:
        return [e for e in self.events if (e["graph_id"], e["kind"]) == self.key]

    def lanes(self) -> list[str]:
        ev = self.current()
        out = []
        for r in sorted({e["rank"] for e in ev}):
            for s in STREAM_ORDER:
                for src in ("measured", "predicted"):
                    if any(e["rank"] == r and e["stream"] == s and e["source"] == src for e in ev):
                        out.append(f"rank {r} · {s} · {src}")
        return out

    def nodes_at(self, lane: str | None = None) -> list[str]:
        return list(dict.fromkeys(e["node"] for e in self.current()))

    def graph_nodes(self) -> dict:
        """{(graph_id, kind): nodes of the final version}: links each gather's wait to its issue."""
        return {k: v.nodes for k, v in _final_versions(self.rec).items()}

    def set_whatif(self, whatif=None, label: str = "what-if", edit: str = "") -> None:
        """The what-if (a ``plan.whatif.WhatIf``, or its ``schedule`` alone) drawn in lanes of its
        own (source ``"what-if (predicted)"``): never in the measured or the recorded predicted
        lanes. With a WhatIf, the lane's step and peak are the WhatIf's own (its ``headline``: the
        number the Passes tab, the report and ``inspect`` show), not the span of its bars, and
        ``edit`` (what was changed) labels the lane. ``None`` clears the lane."""
        schedule = getattr(whatif, "schedule", whatif)
        self.whatif_events = [dict(e, rank=self.rec.rank, source=f"{label} (predicted)") for e in (schedule or [])]
        self.whatif_totals: dict = {}
        if whatif is not None and hasattr(whatif, "step_ms"):
            self.whatif_totals = {f"{label} (predicted)": {
                "step_ms": float(whatif.step_ms), "peak_bytes": int(whatif.peak_bytes),
                "headline": whatif.headline(), "edit": edit}}

    def clear_whatif(self) -> None:
        """No what-if lane (the controls are back at the recorded values, or the edit changed)."""
        self.set_whatif(None)

    def numbers(self) -> list[dict]:
        """The three numbers per source and rank over the whole step (every graph): exposed
        communication, overlap and idle (host-bound) time, with step and busy times
        (:func:`deepcompile.report.schedule_fig.step_numbers`)."""
        from deepcompile.report import schedule_fig as F

        ev = self.events + list(self.whatif_events)
        out = F.step_numbers(ev) if ev else []
        for n in out:   # the what-if's step is its prediction's (one number), the span its bars'
            t = getattr(self, "whatif_totals", {}).get(n["source"])
            if t:
                n["timeline_ms"], n["step_ms"] = n["step_ms"], t["step_ms"]
        return out

    @property
    def device(self) -> str | None:
        """``"gpu"`` or ``"cpu"``: what the run ran on (the idle column's words follow it)."""
        from deepcompile.report.schedule_fig import device_kind

        return device_kind(getattr(self.rec, "environment", None))

    def numbers_html(self) -> str:
        from deepcompile.report.schedule_fig import idle_word
        from deepcompile.report.style import fmt_ms

        rows = "".join(
            f"<tr><td>{n['source']}</td><td>{n['rank']}</td><td>{fmt_ms(n['step_ms'])}</td>"
            f"<td><b>{fmt_ms(n['exposed_comm_ms'])}</b></td><td><b>{fmt_ms(n['overlap_ms'])}</b></td>"
            f"<td><b>{fmt_ms(n['idle_ms'])}</b> ({100 * n['idle_fraction']:.0f}%)</td>"
            f"<td>{fmt_ms(n['compute_ms'])}</td><td>{fmt_ms(n['comm_ms'])}</td></tr>" for n in self.numbers())
        return ("<table class='dc-step-numbers' style='font-size:12px'><tr><th>source</th><th>rank</th>"
                "<th>step span</th><th>exposed comm</th><th>overlap</th><th>" + idle_word(self.device) + "</th>"
                "<th>compute busy</th><th>comm busy</th></tr>" + rows + "</table>")

    def figure_dict(self) -> dict:
        """The schedule of the selected graph as a plotly figure dict
        (:func:`deepcompile.report.schedule_fig.schedule_figure`: one subplot per source, a lane per
        rank and stream, ms, hover, each gather linked from issue to wait), the selected node's
        bars outlined."""
        from deepcompile.report import schedule_fig as F

        title = "schedule"
        whole = self.scope == "step" or not self.key
        if not whole:
            title = f"schedule · graph {self.key[0]} · {self.key[1]} — {self.source_note}"
        else:
            title = f"schedule · the whole step (every graph) — {self.source_note}"
        ev = self.events + list(self.whatif_events)
        fig = F.schedule_figure(ev, graphs=self.graph_nodes(), graph=None if whole else self.key,
                                selected=self.selected_node, title=title, rank=self.rec.rank,
                                totals=getattr(self, "whatif_totals", None), device=self.device)
        if not whole:   # the panel numbers are of this graph's events, not of the step
            for a in fig.get("layout", {}).get("annotations", []):
                if isinstance(a.get("text"), str):
                    a["text"] = a["text"].replace(": step ", ": this graph ")
        return fig

    def set_scope(self, scope: str) -> None:
        if scope not in ("graph", "step"):
            raise ValueError(f"schedule scope {scope!r}: 'graph' (the selected graph) or 'step' (every graph)")
        self.scope = scope

    def figure(self):
        import plotly.graph_objects as go

        return go.Figure(self.figure_dict())


def bar_node(customdata_item) -> str | None:
    """The node name of one bar's customdata (report.schedule_fig puts ``[node, duration, ...]``)."""
    c = customdata_item
    if isinstance(c, (list, tuple)) or (hasattr(c, "tolist") and not isinstance(c, str)):
        c = list(c)
        return str(c[0]) if c else None
    return None if c is None else str(c)


# --------------------------------------------------------------------------- one memory truth
def memory_view(run, rank: int = 0) -> tuple[dict | None, str | None]:
    """(view, None) from :func:`deepcompile.record.reader.memory_view` (the measured timeline by
    category and the predicted peak, each labelled): the one source of every peak shown; or
    (None, why) when the record cannot give it. ``run``: a run directory or a RunRecord."""
    try:
        from deepcompile.record.reader import memory_view as mv
    except ImportError:
        return None, ("deepcompile.record.reader.memory_view is missing in this version: no memory view (the "
                      "peak is not shown rather than a second, different number)")
    try:
        return mv(run, rank), None
    except RecordError as e:
        return None, str(e)
    except Exception as e:  # an untrusted record: a message, never a traceback in the widget
        return None, f"{getattr(run, 'path', run)}: memory view cannot be read ({type(e).__name__}: {e})"


def view_peak(view: dict | None) -> dict | None:
    """The run's one peak ``{bytes, source, label, where, by_category}`` (memory_view's ``peak``:
    measured where the run has a timeline, else the plan's prediction)."""
    pk = (view or {}).get("peak")
    if not isinstance(pk, dict) or not isinstance(pk.get("bytes"), (int, float)):
        return None
    return {"bytes": int(pk["bytes"]), "source": str(pk.get("source") or "measured"),
            "label": str(pk.get("label") or pk.get("source") or ""), "where": str(pk.get("where") or ""),
            "by_category": dict(pk.get("by_category") or {})}


def peak_label(pk: dict | None) -> str:
    """``"3.4 MiB (measured, at graph 0 backward, node x)"``: how every view prints the one peak."""
    if not pk:
        return "–"
    where = f", at {pk['where']}" if pk.get("where") else ""
    return f"{fmt_bytes(pk['bytes'])} ({pk['source']}{where})"


def figure_view(view: dict) -> dict:
    """memory_view in the shape report.memory_fig.memory_figure draws: the measured samples, the
    one peak, and the plan's predicted peak beside it (when the peak shown is the measured one)."""
    meas = view.get("measured") or {}
    out = {"categories": list(view.get("categories") or []), "samples": list(meas.get("samples") or view.get("samples") or [])}
    pk = view.get("peak")
    if isinstance(pk, dict):
        out["peak"] = dict(pk)
    pred = (view.get("predicted") or {}).get("peak")
    if isinstance(pred, dict) and (not isinstance(pk, dict) or pk.get("source") != "predicted"):
        out["predicted"] = dict(pred, source="predicted")
    return out


def view_figure(view: dict, title: str = "memory by category"):
    """The memory view's timeline (report.memory_fig.memory_figure: stacked by category, ms on x,
    node names on hover, the peak marked and labelled) as a plotly Figure."""
    import plotly.graph_objects as go

    from deepcompile.report.memory_fig import memory_figure

    return go.Figure(memory_figure(figure_view(view), title=title))


# --------------------------------------------------------------------------- memory
OP_COLUMNS = ("index", "name", "target", "module", "latency_us", "out_bytes", "mem_after_bytes")


class MemoryModel:
    def __init__(self, rec, *, pscopes: dict | None = None):
        from deepcompile.report import graph_groups as L

        self.rec = rec
        self.pscopes = pscopes if pscopes is not None else L.param_scopes(rec.graphs)
        self.keys = [k for k in sorted(_final_versions(rec), key=lambda k: (k[0], k[1] != "forward"))]
        self.key = self.keys[0] if self.keys else None
        self.version: int | None = None   # index into versions; None: the final one
        self.sort_by = "index"
        self.descending = False

    def versions(self):
        return self.rec.versions(*self.key) if self.key else []

    def set_graph(self, graph_id: int, kind: str) -> None:
        if (graph_id, kind) not in self.keys:
            raise ValueError(f"no graph {graph_id} {kind} (have {self.keys})")
        self.key = (graph_id, kind)
        self.version = None

    def set_pass(self, which: int | str | None) -> None:
        names = [v.after for v in self.versions()]
        if which is None:
            self.version = None
        elif isinstance(which, str):
            if which not in names:
                raise ValueError(f"no version after {which!r} (versions {names})")
            self.version = names.index(which)
        else:
            self.version = int(which)

    def set_sort(self, column: str, descending: bool | None = None) -> None:
        """Sort the operator table; clicking the same column again flips the direction."""
        if column not in OP_COLUMNS:
            raise ValueError(f"cannot sort by {column!r}; columns {OP_COLUMNS}")
        if descending is None:
            descending = (not self.descending) if column == self.sort_by else column not in ("index", "name", "target", "module")
        self.sort_by, self.descending = column, descending

    def _vi(self) -> int:
        vs = self.versions()
        return len(vs) - 1 if self.version is None else self.version

    def series(self) -> list[dict]:
        """[{label, source, x, y, nodes}] : recorded samples of the graph, then the estimate of the
        selected version and of the version before it."""
        out = []
        if not self.key:
            return out
        gid, kind = self.key
        vs = self.versions()
        rec_s = [s for s in (self.rec.memory or {}).get("samples", [])
                 if s.get("graph_id") == gid and s.get("kind") == kind]
        if rec_s:
            src = rec_s[0].get("source", "measured")
            xk = "node_index" if all("node_index" in s for s in rec_s) else "t_us"
            out.append({"label": f"record ({src}, after {vs[-1].after})", "source": src, "x": [s.get(xk, 0) for s in rec_s],
                        "y": [s["allocated_bytes"] for s in rec_s], "nodes": [s.get("node", "") for s in rec_s],
                        "xaxis": xk})
        vi = self._vi()
        for j in ([vi - 1] if vi > 0 else []) + [vi]:
            v = vs[j]
            _, samples = E.estimate(v.nodes, gid, kind)
            out.append({"label": f"estimate after {v.after}", "source": "predicted",
                        "x": [s["node_index"] for s in samples], "y": [s["allocated_bytes"] for s in samples],
                        "nodes": [s["node"] for s in samples], "xaxis": "node_index"})
        return out

    def peak(self) -> dict | None:
        """The peak of the selected version's estimate (or the recorded one when it is the final
        version): {value, index, node, holders: [(name, bytes)] largest tensors live there}."""
        ss = self.series()
        if not ss:
            return None
        s = ss[-1]
        if not s["y"]:
            return None
        i = max(range(len(s["y"])), key=lambda k: s["y"][k])
        nodes = self.versions()[self._vi()].nodes
        return {"value": s["y"][i], "index": s["x"][i], "node": s["nodes"][i], "series": s["label"],
                "holders": self.live_at(nodes, s["x"][i])}

    @staticmethod
    def live_at(nodes: list[dict], at: int, top: int = 8) -> list[tuple[str, int]]:
        """The largest tensors alive at node index ``at`` (defined before, used at or after it;
        gathered parameters until their release)."""
        last = {}
        for i, n in enumerate(nodes):
            for r in E.inputs_of(n):
                last[r] = i
        live = []
        for i, n in enumerate(nodes[: at + 1]):
            if n["op"] == "output":
                continue
            alive = n["op"] in ("placeholder", "get_attr") or last.get(n["name"], -1) >= at or i == at
            if alive:
                b = E.node_bytes(n)
                if b:
                    live.append((n["name"], b))
        live.sort(key=lambda t: -t[1])
        return live[:top]

    def op_rows(self, latency: dict | None = None) -> list[dict]:
        """Per-operator rows of the selected version, sorted as set by :meth:`set_sort`."""
        from deepcompile.report import graph_groups as L

        if not self.key:
            return []
        gid, kind = self.key
        v = self.versions()[self._vi()]
        prof = {}
        for g in (self.rec.profile or {}).get("graphs", []):
            if (g["graph_id"], g["kind"]) == (gid, kind):
                prof = {n["name"]: n for n in g["nodes"]}
        events, samples = E.estimate(v.nodes, gid, kind)
        est_lat = {e["node"]: e["end_us"] - e["start_us"] for e in events}
        est_mem = {s["node"]: s["allocated_bytes"] for s in samples}
        keys, _ = L.node_groups(v.nodes, None, self.pscopes)
        rows = []
        for i, (n, grp) in enumerate(zip(v.nodes, keys)):
            if n["op"] in ("placeholder", "output", "get_attr"):
                continue
            p = prof.get(n["name"])
            if p:
                lat = None if p.get("latency_ms") is None else p["latency_ms"] * 1e3
                after, src = p.get("mem_after_bytes"), "measured"
                outb = p.get("out_bytes", E.node_bytes(n))
            else:
                lat = (latency or {}).get(n["name"], est_lat.get(n["name"]))
                after, src, outb = est_mem.get(n["name"]), "predicted", E.node_bytes(n)
            rows.append({"index": i, "name": n["name"], "target": n["target"], "module": grp,
                         "latency_us": lat, "out_bytes": outb, "mem_after_bytes": after, "source": src,
                         "comm": E.comm_kind(n)})
        col = self.sort_by
        num = col not in ("name", "target", "module")
        rows.sort(key=lambda r: (r[col] is None, r[col] if r[col] is not None else (0 if num else "")),
                  reverse=False)
        if self.descending:
            none = [r for r in rows if r[col] is None]
            rows = [r for r in rows if r[col] is not None][::-1] + none
        return rows

    def table_html(self, limit: int = 400) -> str:
        import html

        rows = self.op_rows()
        arrow = "▼" if self.descending else "▲"
        head = "".join(f"<th data-col='{c}'>{c}{' ' + arrow if c == self.sort_by else ''}</th>" for c in OP_COLUMNS)
        body = []
        for r in rows[:limit]:
            cells = []
            for c in OP_COLUMNS:
                v = r[c]
                if c == "latency_us":
                    s = "" if v is None else f"{v:.1f}" + ("" if r["source"] == "measured" else "*")
                elif c in ("out_bytes", "mem_after_bytes"):
                    s = "" if v is None else fmt_bytes(v)
                else:
                    s = str(v)
                cells.append(f"<td>{html.escape(s)}</td>")
            style = " style='background:#fff3e0'" if r["comm"] else ""
            body.append(f"<tr{style}>{''.join(cells)}</tr>")
        more = f"<p>… {len(rows) - limit} more rows</p>" if len(rows) > limit else ""
        return ("<div style='max-height:360px;overflow:auto'><table class='dc-ops' style='font-size:11px;"
                "border-collapse:collapse'><thead><tr>" + head + "</tr></thead><tbody>" + "".join(body)
                + "</tbody></table></div>" + more + "<p style='font-size:11px;color:#666'>* predicted by the "
                "naive order-based estimate (no profile for this node)</p>")

    def figure(self):
        import plotly.graph_objects as go

        fig = go.Figure()
        colors = ["#4e79a7", "#bab0ac", "#f28e2b"]
        ss = self.series()
        for k, s in enumerate(ss):
            fig.add_trace(go.Scatter(x=s["x"], y=s["y"], mode="lines", name=s["label"], customdata=s["nodes"],
                                     line=dict(color=colors[k % 3], dash="solid" if s["source"] == "measured" else "dot"
                                               if k < len(ss) - 1 else "solid", width=2),
                                     hovertemplate="%{customdata}<br>%{y:,} B<extra>" + s["label"] + "</extra>"))
        pk = self.peak()
        if pk:
            fig.add_trace(go.Scatter(x=[pk["index"]], y=[pk["value"]], mode="markers+text", name="peak",
                                     marker=dict(symbol="star", size=14, color="#e15759"),
                                     text=[f"graph high point {fmt_bytes(pk['value'])} at {pk['node']}"],
                                     textposition="top center"))
        # not the run's peak (that is memory_view's, by category): this graph's own tensors only
        title = ("graph-level liveness estimate" if not self.key else
                 f"graph {self.key[0]} · {self.key[1]}: liveness estimate of its own tensors (activations and "
                 "gathered parameters; no shards, gradients or optimizer state — not the step's peak)")
        fig.update_layout(title=dict(text=title, font=dict(size=11)), height=340, margin=dict(l=10, r=10, t=40, b=40),
                          xaxis_title="node index", yaxis_title="bytes (graph estimate)",
                          legend=dict(orientation="h", y=-0.25))
        return fig


def read_rank(run_dir: str | Path, rank: int):
    return read_run(run_dir, rank)
