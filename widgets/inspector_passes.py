"""The Inspector's Passes & runs tab: pass controls, the what-if of an edit, runs and comparison.

A mixin of :class:`~deepcompile.widgets.inspector.Inspector`: it uses the inspector's ``W``
(ipywidgets), ``model``, ``_lock``, ``_muted``, ``render``, ``_render_schedule``, ``run`` and
``cancel``. The controls come from the passes' declared parameters
(:class:`~deepcompile.widgets.passes_view.PassesModel`); an edit predicts step time and memory
again once the edits pause for ``whatif_delay_s`` (``plan.whatif`` on the record's traced graphs,
no re-compile), shown beside the measured run and in the Schedule tab's what-if lanes.
"""
from __future__ import annotations

import html
import json
import threading
import time
from pathlib import Path

from .passes_view import make_control
from .timeline_view import peak_label

esc = html.escape


class PassesTabMixin:
    """The Passes & runs tab and the what-if of :class:`~deepcompile.widgets.inspector.Inspector`."""

    def _build_passes_tab(self):
        """The Passes & runs tab's widgets (``p_*``) and their callbacks; returns the tab."""
        W = self.W
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
        return passes_tab

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
        self.last_pass_rows = []
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
                rows = self._pass_rows(limit)
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
            self.p_whatif.value = self.whatif_html(w, took, rows)
            self.last_pass_rows = rows
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

    def _pass_rows(self, limit: float | None) -> list:
        """What each pass of the edited values bought (``plan.bought.pass_table``); [] where the
        record cannot say (the what-if above already showed why)."""
        from deepcompile.plan.bought import pass_table

        m = self.model
        try:
            return pass_table(m.run_dir, m.passes.whatif_passes(), rank=m.rank, memory_limit_gib=limit)
        except Exception:   # the what-if of the whole list is the one that reports errors
            return []

    def whatif_html(self, w, took: float | None = None, pass_rows: list | None = None) -> str:
        """Measured (this run) beside predicted (the edited values): step time and the peak, both
        labelled, memory by category, the seconds the prediction took, and what each pass bought."""
        from deepcompile.vocab.memory import fmt_bytes as fb

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
                f"<th>edited values</th></tr>{body}</table>{self._pass_rows_html(pass_rows or [])}"
                f"<ul style='margin:2px 0'>{notes}{more}</ul>Run measures it.</div>")

    @staticmethod
    def _pass_rows_html(rows: list) -> str:
        """The per-pass table: the prediction after each pass, each row one pass more."""
        from deepcompile.vocab.memory import fmt_bytes as fb

        if not rows:
            return ""
        body, prev = [], None
        for r in rows:
            ds = "" if prev is None else f"{r.step_ms - prev.step_ms:+.1f} ms"
            body.append(f"<tr><td>{esc(r.after)}</td><td>{r.step_ms:.1f} ms</td><td>{r.exposed_comm_ms:.1f} ms</td>"
                        f"<td>{fb(r.peak_bytes)}</td><td>{ds}</td></tr>")
            prev = r
        return ("<b>what each pass bought</b> (predicted, each row one pass more)"
                "<table class='dc-pass-table' style='font-size:12px'><tr><th>after</th><th>step</th>"
                "<th>exposed comm</th><th>peak</th><th>step change</th></tr>" + "".join(body) + "</table>")

    def _predict(self) -> None:
        """The Predict button: the what-if of the shown values, now."""
        if self._whatif_timer is not None:
            self._whatif_timer.cancel()
        self._whatif_gen += 1
        self.whatif_now(self._whatif_gen)
