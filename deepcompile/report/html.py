"""The static HTML report: one self-contained file (inline CSS and JS; no network).

``render_report(run_dir, out_file)`` reads the record (validated: a broken record raises
:class:`~deepcompile.record.schema.RecordError` before anything is written) and writes:

* the run: status, environment, config;
* steps: step time, loss and per-step memory per rank (:func:`steps_fig.steps_figure`: the
  compile and profiling steps marked, not setting the scale), a sortable table, the run's peak;
* every graph id and kind once, with the versions of its latest compile, the graph before and
  after each pass collapsed by module scope, every module box opening on a click
  (:mod:`deepcompile.report.graph_section`, whose script is part of :data:`JS`);
* the schedule of one step for every rank (:func:`schedule_fig.schedule_figure`: measured and
  predicted in separate panels, ms, gathers linked issue to wait) with its exposed
  communication, overlap and idle time; the memory timeline stacked by category
  (:func:`memory_fig.memory_figure`, from ``record.reader.memory_view``: the run's one peak);
* per-operator latency and memory tables, sortable by clicking a column header.

The charts are plotly figures drawn by the plotly.min.js of the installed plotly package,
inlined (:func:`plotly_embed.plotly_js`): the file opens offline. Without plotly the page says so
and keeps its tables and graph pictures.
"""
from __future__ import annotations

import datetime as _dt
import html
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from deepcompile.plan import estimate as E
from deepcompile.profile import trace
from deepcompile.record import schema as S
from deepcompile.record.reader import RecordError, RunRecord, load_json, read_all_steps, read_run
from deepcompile.record.steps import special_steps
from deepcompile.report.graph_groups import comm_color, node_groups, param_scopes
from deepcompile.report.graph_section import _section_graphs
from deepcompile.report.memory_fig import _peaks, memory_figure, memory_samples
from deepcompile.report.plotly_embed import NO_PLOTLY, PLOT_JS, _Figures, plotly_js
from deepcompile.report.schedule_fig import device_kind, idle_word, schedule_figure, step_numbers
from deepcompile.report.steps_fig import steps_figure
from deepcompile.report.style import fmt_ms, fmt_us
from deepcompile.vocab.memory import fmt_bytes

esc = html.escape

CSS = """
body{font-family:Helvetica,Arial,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:12px 20px}header h1{margin:0;font-size:20px}
header .sub{color:#b0bec5;font-size:13px;margin-top:4px}
nav{position:sticky;top:0;background:#eceff1;padding:6px 20px;border-bottom:1px solid #cfd8dc;z-index:5}
nav a{margin-right:14px;color:#37474f;text-decoration:none;font-size:14px}
section{padding:8px 20px 16px}h2{border-bottom:2px solid #cfd8dc;padding-bottom:4px}
h3{margin:14px 0 6px}table{border-collapse:collapse;font-size:12px;margin:6px 0}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#eceff1}table.sortable th{cursor:pointer;user-select:none}
table.sortable th.asc::after{content:" \\25B2"}table.sortable th.desc::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.versions{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}
.version{background:#fff;border:1px solid #cfd8dc;border-radius:6px;padding:8px;max-width:100%;overflow:auto}
.version h4{margin:0 0 4px;font-size:13px}.diff{font-size:12px;color:#555;margin-bottom:4px}
.note{font-size:12px;color:#555}.pill{display:inline-block;border-radius:3px;padding:0 5px;margin-right:4px;font-size:11px}
.legend span{display:inline-block;margin-right:10px;font-size:12px}.legend i{display:inline-block;width:10px;height:10px;margin-right:3px}
.scroll{max-height:480px;overflow:auto;display:inline-block}
.chart{background:#fff;border:1px solid #cfd8dc;border-radius:6px;margin:4px 8px 4px 0}
pre{background:#fff;border:1px solid #ddd;padding:8px;font-size:12px;max-height:300px;overflow:auto}
.empty{color:#888;font-style:italic}
g.dc-openable{cursor:pointer}
g.dc-openable:hover>path:first-of-type,g.dc-openable:hover>rect:first-of-type{stroke-width:2.5}
g.dc-open>path:first-of-type,g.dc-open>rect:first-of-type{stroke:#ff00aa;stroke-width:3}
.dc-panel{border-top:1px dashed #88aaaa;margin-top:6px;padding-top:4px}
.dc-ph{font-size:12px;margin-bottom:2px}.dc-ph button{font-size:11px;margin-left:6px;cursor:pointer}
"""

JS = """
document.querySelectorAll('table.sortable').forEach(function(t){
  t.querySelectorAll('th').forEach(function(th,i){th.addEventListener('click',function(){
    var asc=!th.classList.contains('asc');t.querySelectorAll('th').forEach(function(h){h.classList.remove('asc','desc')});
    th.classList.add(asc?'asc':'desc');var tb=t.tBodies[0];var rows=Array.prototype.slice.call(tb.rows);
    rows.sort(function(a,b){var x=a.cells[i],y=b.cells[i];var u=x.dataset.v,v=y.dataset.v;
      var r=(u!==undefined&&v!==undefined)?(parseFloat(u)-parseFloat(v)):x.textContent.localeCompare(y.textContent);
      return asc?r:-r});rows.forEach(function(r){tb.appendChild(r)});});});});
(function(){  // module boxes: a click shows the pre-rendered level inside the module below the picture
  var src=document.getElementById('dc-levels');if(!src)return;var D=null;
  function data(){return D||(D=JSON.parse(src.textContent));}
  function mark(g,on){g.classList.toggle('dc-open',on);var t=g.querySelector('text');
    if(t)t.textContent=t.textContent.replace(on?'\u25b8':'\u25be',on?'\u25be':'\u25b8');}
  function picture(lv,key){var div=document.createElement('div'),i;div.innerHTML=data().s[lv[0]];
    var ts=div.querySelectorAll('text');for(i=0;i<ts.length;i++)ts[i].textContent=lv[1][i];
    var gs=div.querySelectorAll('[data-g]');for(i=0;i<gs.length;i++){var g=gs[i],k=key+lv[2][i];
      g.removeAttribute('data-g');g.id='group-'+k;var t=g.querySelector('title');
      if(t)t.textContent=lv[3]?lv[3][i]:k+(g.classList.contains('dc-openable')?' \u00b7 '+data().hint:'');}
    return div.firstElementChild;}
  function shut(card,depth){card.querySelectorAll('.dc-panel').forEach(function(p){
    if(+p.dataset.depth>=depth){if(p.opener)mark(p.opener,false);p.remove();}});}
  document.querySelectorAll('.version[data-levels]').forEach(function(card){
    var panels=card.querySelector('.dc-panels');
    card.addEventListener('click',function(ev){
      var c=ev.target.closest('.dc-close');if(c){shut(card,+c.dataset.depth);return;}
      var g=ev.target.closest('g.dc-openable');if(!g||!g.id)return;
      var key=g.id.slice(6),host=g.closest('.dc-panel'),depth=host?+host.dataset.depth:0;
      var lv=data().v[+card.dataset.levels][key];if(!lv)return;
      var was=g.classList.contains('dc-open');shut(card,depth+1);if(was)return;
      mark(g,true);var p=document.createElement('div');p.className='dc-panel';p.dataset.depth=depth+1;p.opener=g;
      p.innerHTML='<div class="dc-ph"><b></b><button type="button" class="dc-close" data-depth="'+(depth+1)+'">close</button></div>';
      p.querySelector('b').textContent=key;p.appendChild(picture(lv,key));panels.appendChild(p);
      if(p.scrollIntoView)p.scrollIntoView({block:'nearest'});});});
})();
"""


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# --------------------------------------------------------------------------- sections
def _kv_table(d: dict) -> str:
    rows = "".join(f"<tr><th>{esc(str(k))}</th><td>{esc(str(v))}</td></tr>" for k, v in d.items())
    return f"<table>{rows}</table>"


def _section_run(rec: RunRecord) -> str:
    m = rec.manifest
    return ("<section id='run'><h2>Run</h2>"
            + _kv_table({"directory": str(rec.path), "status": m["status"], "created": m.get("created", ""),
                         "world size": m["world_size"], "format version": m["format_version"],
                         "tool": m.get("tool", "")})
            + "<h3>Environment (rank %d)</h3>" % rec.rank + _kv_table(rec.environment)
            + "<h3>Config</h3><pre>" + esc(json.dumps(rec.config, indent=1)) + "</pre></section>")


def _nan_note(n: int, what: str) -> str:
    return f"<p class='note gap-note'>{what}: {n} point(s) NaN/inf: gaps in the chart.</p>" if n else ""


def _section_steps(rec: RunRecord, all_steps: dict[int, list[dict]], figs: _Figures, view: dict) -> str:
    out = ["<section id='steps'><h2>Steps</h2>"]
    st = rec.steps
    if not st:
        out.append("<p class='empty'>no steps recorded (yet)</p></section>")
        return "".join(out)
    bad_loss = [s["step"] for s in st if s.get("loss") is not None and not _finite(s["loss"])]
    bad_time = [s["step"] for s in st if not _finite(s["time_s"])]
    if bad_loss:
        out.append(f"<p class='note diverged'><b>The run diverged:</b> the loss is NaN or infinite at "
                   f"{len(bad_loss)} of {len(st)} step(s), from step {bad_loss[0]}; those steps are gaps "
                   "in the loss chart.</p>")
    if bad_time:
        out.append(f"<p class='note'>{len(bad_time)} step time(s) are NaN or infinite (from step {bad_time[0]}); "
                   "they are gaps in the step-time chart.</p>")
    out.append(_nan_note(len(bad_loss), "loss") + _nan_note(len(bad_time), "step time"))
    special = special_steps(st, rec.config)
    if special:
        out.append("<p class='note'>Not steady-state steps (marked above the step-time chart, whose scale the "
                   "other steps set): " + ", ".join(f"step {k}: {esc(v)}" for k, v in sorted(special.items()))
                   + ".</p>")
    out.append(figs.add(steps_figure({r: ss for r, ss in all_steps.items() if ss} or {rec.rank: st},
                                       special=special), "steps"))
    rows = []
    for s in st:
        mem = s.get("mem") or {}
        loss = s.get("loss")
        t = s["time_s"]
        rows.append(f"<tr><td class=num data-v='{s['step']}'>{s['step']}</td>"
                    f"<td class=num data-v='{_js_num(loss)}'>{'' if loss is None else f'{loss:.4f}'}</td>"
                    f"<td class=num data-v='{_js_num(t)}'>{fmt_us(t * 1e6) if _finite(t) else esc(str(t))}"
                    f"{' (' + esc(special[s['step']]) + ')' if s['step'] in special else ''}</td>"
                    + "".join(f"<td class=num data-v='{_js_num(mem.get(k, 0))}'>{fmt_bytes(mem.get(k, 0))}</td>"
                              for k in ("allocated", "reserved", "peak")) + "</tr>")
    out.append("<div class='scroll'><table class='sortable steps'><thead><tr><th>step</th><th>loss</th><th>time</th>"
               "<th>allocated</th><th>reserved</th><th>allocator peak</th></tr></thead><tbody>"
               + "".join(rows) + "</tbody></table></div>")
    proc = (view.get("process") or {}).get("label")
    if proc:
        out.append(f"<p class='note'>The per-step memory columns (and the chart's bottom row) are {esc(proc)}; "
                   "not the training state's peak, which is:</p>")
    out.append(_peak_line(view) + "</section>")
    return "".join(out)


def _js_num(v: Any) -> str:
    """A number as the sort script's ``parseFloat`` reads it (Python writes ``nan``/``inf``)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "NaN"
    if isinstance(v, float) and math.isinf(v):
        return "Infinity" if v > 0 else "-Infinity"
    return str(v)


def _final_versions(rec: RunRecord) -> dict[tuple[int, str], Any]:
    last = {}
    for v in rec.graphs:
        if v.kind != "dynamo":
            last[(v.graph_id, v.kind)] = v
    return last


def _all_rank_events(rec: RunRecord) -> tuple[list[dict], list[str]]:
    """The schedule events of every rank in the record (each with its ``rank``), and a note per
    rank whose schedule file could not be read (the report still renders)."""
    events = [dict(e, rank=rec.rank) for e in (rec.schedule or {}).get("events", [])]
    notes = []
    for r in rec.manifest["ranks"]:
        if r == rec.rank:
            continue
        p = rec.path / S.rank_dir_name(r) / S.SCHEDULE
        try:
            obj = load_json(p, optional=True, root=rec.path)
            if obj is not None:
                events += [dict(e, rank=r) for e in S.check_schedule(str(p), obj)["events"]]
        except RecordError as e:
            notes.append(f"rank {r}'s schedule is left out: {e}")
    return events, notes


def _section_prediction(rec: RunRecord, passes: list | None) -> str:
    """The cost model's step and peak for the run's passes, from the one prediction engine
    (``plan.whatif.prediction``: the numbers ``inspect`` and the inspector show)."""
    run_dir, rank = rec.path, rec.rank
    try:
        from deepcompile.plan.whatif import prediction
    except ImportError as e:
        return f"<section id='prediction'><h2>Prediction</h2><p class='empty'>{esc(str(e))}</p></section>"
    w, line = prediction(run_dir, rank, passes)
    warn = "".join(f"<p class='note warning'>{esc(x)}</p>" for x in (w.warnings if w else []))
    return (f"<section id='prediction'><h2>Prediction</h2><p class='dc-prediction'>{esc(line)}</p>{warn}"
            + (_pass_table_html(run_dir, rank, passes) if w is not None else "")
            + (_model_errors_html(rec) if w is not None and passes is None else "") +
            "<p class='note'>One prediction engine behind every view: the inspector's Passes tab, its Schedule "
            "what-if lane and <code>deepcompile inspect</code> give these numbers for the same passes.</p></section>")


def _pass_table_html(run_dir, rank: int, passes: list | None) -> str:
    """What each pass bought (``plan.bought.pass_table``): the prediction after each pass, and
    what it changed against the row above."""
    from deepcompile.plan.bought import pass_table

    rows = pass_table(run_dir, passes, rank=rank)
    out = ["<table class='dc-pass-table'><tr><th>after</th><th>step</th><th>exposed communication</th><th>peak</th>"
           "<th>step change</th><th>peak change</th></tr>"]
    prev = None
    for r in rows:
        ds = "" if prev is None else f"{r.step_ms - prev.step_ms:+.1f} ms"
        dp = "" if prev is None else ("+" if r.peak_bytes >= prev.peak_bytes else "-") + fmt_bytes(abs(r.peak_bytes - prev.peak_bytes))
        out.append(f"<tr><td>{esc(r.after)}</td><td class=num>{r.step_ms:.1f} ms</td><td class=num>{r.exposed_comm_ms:.1f} ms</td>"
                   f"<td class=num>{fmt_bytes(r.peak_bytes)}</td><td class=num>{ds}</td><td class=num>{dp}</td></tr>")
        prev = r
    out.append("</table><p class='note'>What each pass bought: the prediction of the pass list up to each pass, with "
               "the parameters the whole list resolved to; exposed communication is collective time the compute "
               "stream waits for.</p>")
    return "".join(out)


def _model_errors_html(rec: RunRecord, top: int = 10) -> str:
    """The nodes the cost model prices most wrong against the record's measured step
    (``plan.accuracy.node_errors``); the inspector's graph colours every node by it."""
    from deepcompile.plan.accuracy import node_errors

    rows = node_errors(rec)
    if not rows:
        return ""
    body = "".join(f"<tr><td>{r.graph_id} {esc(r.kind)}</td><td>{esc(r.node)}</td><td>{esc(r.stream)}</td>"
                   f"<td class=num>{fmt_us(r.predicted_us)}</td><td class=num>{fmt_us(r.measured_us)}</td>"
                   f"<td class=num>{r.error_us / 1e3:+.2f} ms</td></tr>" for r in rows[:top])
    return ("<h3>Where the cost model is wrong</h3><table class='dc-model-errors'><tr><th>graph</th><th>node</th>"
            "<th>stream</th><th>predicted</th><th>measured</th><th>measured − predicted</th></tr>" + body +
            f"</table><p class='note'>The {min(top, len(rows))} largest of {len(rows)} nodes compared: the "
            "prediction of the run's own passes against its measured step, node by node (the inspector's graph, "
            "coloured by <i>error</i>, shows every node).</p>")


def _section_schedule(rec: RunRecord, events: list[dict], source: str, figs: _Figures, notes: list[str]) -> str:
    out = ["<section id='schedule'><h2>Schedule</h2>",
           f"<p class='note'>Source: {esc(source)}. One lane per rank and stream; measured and predicted bars are in "
           "separate panels, never in one lane. x is ms from the start of the step (the panels zoom together: drag "
           "to zoom, double-click to reset); hover a bar for its node, duration and graph; red on the compute "
           "stream: waiting for a collective; dotted lines link each gather's issue to its wait. Measured on CPU, "
           "the lanes are host operators (a wait is the time the host blocked).</p>"]
    out += [f"<p class='note'>{esc(n)}</p>" for n in notes]
    if not events:
        out.append("<p class='empty'>no schedule recorded</p></section>")
        return "".join(out)
    graphs = trace.final_graphs(rec.graphs)
    device = device_kind(rec.environment)
    out.append(figs.add(schedule_figure(events, graphs=graphs, rank=rec.rank, device=device), "schedule"))
    nums = step_numbers(events)
    out.append("<h3>Per step</h3><table class='numbers'><thead><tr><th>source</th><th>rank</th><th>step</th>"
               "<th>compute busy</th><th>communication busy</th><th>overlap</th><th>exposed communication</th>"
               f"<th>{esc(idle_word(device))}</th></tr></thead><tbody>"
               + "".join(f"<tr><td>{esc(n['source'])}</td><td class=num>{n['rank']}</td>"
                         + "".join(f"<td class=num data-v='{n[k]}'>{fmt_ms(n[k])}</td>" for k in
                                   ("step_ms", "compute_ms", "comm_ms", "overlap_ms", "exposed_comm_ms", "idle_ms"))
                         + "</tr>" for n in nums)
               + "</tbody></table><p class='note'>Exposed communication: a collective runs while no compute "
               "does (the step waits for it). Overlap: communication hidden under compute. Idle: no stream busy, "
               "the device waiting for the host (between the host's operators on a CPU record). Waits are not "
               "counted as compute.</p>")
    out.append("</section>")
    return "".join(out)


def memory_view_of(rec: RunRecord) -> dict:
    """``record.reader.memory_view`` of the run (its one peak, measured or predicted), plus the
    timeline to draw where it has no measured one: the record's older samples (the naive
    per-graph estimate) or, without any, the liveness estimate of the final graphs, labelled
    predicted. ``note`` says which."""
    from deepcompile.record.reader import memory_view

    try:
        view = dict(memory_view(rec, rec.rank))
    except RecordError as e:   # a plan.json that fails its schema: the rest of the report stands
        view = {"categories": [], "measured": None, "predicted": None, "peak": None, "error": str(e)}
    view["rank"] = rec.rank
    if memory_samples(view):
        view["note"] = (view.get("measured") or {}).get("label") or "the record's memory timeline"
        return view
    samples = [s for s in (rec.memory or {}).get("samples") or [] if isinstance(s, dict)]
    note = "no measured timeline; the record's samples: the naive per-graph estimate (activations only)"
    if not samples:
        _, samples = E.estimate_versions([vars(v) for v in _final_versions(rec).values()])
        note = "no timeline in the record: liveness over the final graphs (activations only)"
    view["samples"] = [dict(s, source="predicted") for s in samples]
    view["note"] = note + ", predicted"
    return view


def _peak_line(view: dict) -> str:
    """The run's one peak (``memory_view``'s ``peak``), labelled measured or predicted; the other
    source's peak beside it where the run has both."""
    p = view.get("peak")
    if not p:
        why = f" ({view['error']})" if view.get("error") else ""
        return f"<p class='peak'>Peak memory: none recorded (no profiling step and no plan){esc(why)}.</p>"
    cats = ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(v)}" for k, v in (p.get("by_category") or {}).items() if v)
    out = (f"<p class='peak'>The run's peak {fmt_bytes(p['bytes'])} — {esc(str(p.get('label') or p['source']))}"
           + (f", at {esc(str(p['where']))}" if p.get("where") else "") + (f" [{esc(cats)}]" if cats else "") + "</p>")
    other = [q for q in _peaks(view) if q["source"] != p["source"]]
    for q in other:
        out += (f"<p class='note'>{esc(q['source'])} peak {fmt_bytes(q['bytes'])}"
                + (f" ({esc(str(q['label']))})" if q.get("label") else "") + "</p>")
    return out


def _section_memory(view: dict, figs: _Figures) -> str:
    samples = memory_samples(view)
    out = ["<section id='memory'><h2>Memory timeline</h2>",
           f"<p class='note'>Source: {esc(view.get('note') or 'the record')}. "
           "Stacked by category; "
           "hover for the node and the bytes of each category; the peak is marked and labelled measured or "
           "predicted.</p>", _peak_line(view)]
    if not samples:
        out.append("<p class='empty'>no memory timeline recorded</p></section>")
        return "".join(out)
    out.append(figs.add(memory_figure(view, title=f"memory of one step, rank {view.get('rank', 0)}"), "memory"))
    out.append("</section>")
    return "".join(out)


def _section_ops(rec: RunRecord, events: list[dict], samples: list[dict], pscopes: dict) -> str:
    out = ["<section id='ops'><h2>Operators</h2>",
           "<p class='note'>Per node of the final version of each graph. Latency and memory are measured "
           "where the record has a profile, else predicted (*). Click a column to sort.</p>"]
    prof = {}
    for g in (rec.profile or {}).get("graphs", []):
        prof[(g["graph_id"], g["kind"])] = ({n["name"]: n for n in g["nodes"]}, g.get("hardware"))
    g0 = ((rec.profile or {}).get("graphs") or [{}])[0]
    cal = E.host_calibration(SimpleNamespace(hardware=g0.get("hardware"), host=g0.get("host")))
    if cal is not None:   # the cost model's host time per op (GPU profiles), as calibrated to this host
        out.append(f"<p class='note host-model'>host model: {esc(cal['note'])}"
                   + (f"; this host's micro-benchmark {cal['bench'].get('dispatch_us')} us a launch, "
                      f"{cal['bench'].get('python_us')} us of wrapper Python" if cal["bench"] else "") + ".</p>")
    lat = {(e["graph_id"], e["kind"], e["node"]): e["end_us"] - e["start_us"] for e in events
           if e.get("rank", rec.rank) == rec.rank}
    mem = {(s.get("graph_id"), s.get("kind"), s.get("node")): s["allocated_bytes"] for s in samples
           if "allocated_bytes" in s}
    for (gid, kind), v in sorted(_final_versions(rec).items(), key=lambda kv: (kv[0][0], kv[0][1] != "forward")):
        p, hw = prof.get((gid, kind), ({}, None))
        keys, _ = node_groups(v.nodes, None, pscopes)
        rows = []
        for i, (n, grp) in enumerate(zip(v.nodes, keys)):
            if n["op"] in ("placeholder", "output", "get_attr"):
                continue
            pn = p.get(n["name"])
            if pn:
                latency = pn.get("latency_ms")
                lat_s = "" if latency is None else fmt_ms(latency)
                after = pn.get("mem_after_bytes")
                peak, outb = pn.get("peak_bytes"), pn.get("out_bytes", E.node_bytes(n))
            else:
                us = lat.get((gid, kind, n["name"]))
                latency = None if us is None else us / 1e3
                lat_s = "" if latency is None else fmt_ms(latency) + "*"
                after, peak, outb = mem.get((gid, kind, n["name"])), None, E.node_bytes(n)
            comm = E.comm_kind(n)
            style = f" style='background:{comm_color(comm)}'" if comm else ""
            rows.append(
                f"<tr><td class=num data-v='{i}'>{i}</td><td{style}>{esc(n['name'])}</td><td>{esc(n['target'])}</td>"
                f"<td>{esc(grp)}</td><td>{esc(json.dumps(n.get('shape')))}</td>"
                f"<td class=num data-v='{latency if latency is not None else -1}'>{lat_s}</td>"
                f"<td class=num data-v='{outb or 0}'>{fmt_bytes(outb or 0)}</td>"
                f"<td class=num data-v='{after if after is not None else -1}'>{'' if after is None else fmt_bytes(after)}</td>"
                f"<td class=num data-v='{peak if peak is not None else -1}'>{'' if peak is None else fmt_bytes(peak)}</td></tr>")
        src = f"measured on {esc(json.dumps(hw))}" if p else "predicted (*)"
        out.append(f"<h3>graph {gid} · {esc(kind)} · after {esc(v.after)} — {src}</h3>"
                   "<div class='scroll'><table class='sortable ops'><thead><tr><th>#</th><th>node</th><th>target</th>"
                   "<th>module</th><th>shape</th><th>latency</th><th>output</th><th>mem after</th>"
                   "<th>peak</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table></div>")
    out.append("</section>")
    return "".join(out)


def render_report(run_dir: str | os.PathLike, out_file: str | os.PathLike | None = None, *, rank: int = 0,
                  depth: int | None = None, workers: int | None = None, passes: list | None = None) -> Path:
    """Write the report of ``run_dir`` to ``out_file`` (default ``RUN_DIR/report.html``); returns its path.
    ``passes``: the pass list whose prediction the report states (default: the run's own)."""
    rec = read_run(run_dir, rank)
    all_steps = read_all_steps(run_dir, rec.manifest)
    out = Path(out_file) if out_file is not None else Path(run_dir) / "report.html"
    pscopes = param_scopes(rec.graphs)
    js = plotly_js()
    figs = _Figures(js is not None)
    events, ev_notes = _all_rank_events(rec)
    if events:
        srcs = sorted({e["source"] for e in events})
        ev_src = "the record's schedule (" + ", ".join(srcs) + ")"
    else:
        events, _ = E.estimate_versions([vars(v) for v in _final_versions(rec).values()])
        events = [dict(e, rank=rec.rank) for e in events]
        ev_src = "predicted by the naive order-based estimate (no schedule in the record)"
    view = memory_view_of(rec)
    title = f"deepcompile run {Path(run_dir).resolve().name}"
    body = [
        f"<header><h1>{esc(title)}</h1><div class='sub'>{rec.manifest['world_size']} rank(s) · "
        f"{len(rec.graph_ids)} graph(s) · {len(rec.steps)} step(s) · status {esc(rec.manifest['status'])} · "
        f"rendered {_dt.datetime.now().isoformat(timespec='seconds')}</div></header>",
        "<nav><a href='#run'>Run</a><a href='#steps'>Steps</a><a href='#graphs'>Graphs</a>"
        "<a href='#schedule'>Schedule</a><a href='#prediction'>Prediction</a><a href='#memory'>Memory</a><a href='#ops'>Operators</a></nav>",
        "" if js is not None else f"<p class='note no-plotly-banner'>{NO_PLOTLY}</p>",
        _section_run(rec), _section_steps(rec, all_steps, figs, view),
        _section_graphs(rec, depth, workers or min(8, os.cpu_count() or 1)),
        _section_schedule(rec, events, ev_src, figs, ev_notes), _section_prediction(rec, passes),
        _section_memory(view, figs),
        _section_ops(rec, events, memory_samples(view), pscopes)]
    lib = f"<script>{js}</script>" if (js is not None and figs.items) else ""
    doc = ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
           f"<title>{esc(title)}</title><style>{CSS}</style>{lib}</head><body>"
           + "".join(body) + figs.script() + f"<script>{JS}{PLOT_JS if figs.items else ''}</script></body></html>")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_text(doc, encoding="utf-8")
    os.replace(tmp, out)
    return out
