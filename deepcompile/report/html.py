"""The static HTML report: one self-contained file (inline SVG, CSS and JS; no network).

``render_report(run_dir, out_file)`` reads the record (validated: a broken record raises
:class:`~deepcompile.record.schema.RecordError` before anything is written) and writes:

* the run: status, environment, config;
* steps: loss and step time charts, per-rank memory;
* every graph id and kind, the graph before and after each pass, collapsed by module scope as
  the inspector's collapsed view draws it (``graph_layout.module_levels``: one box per module with
  op counts and communication chips, edge counts as pen width, no arrows to the inputs/outputs
  boxes; graphviz ``dot`` per level when installed, else the order-based layout), with what each
  pass changed. Every module box opens on a click (a few lines of inline script, no kernel): the
  level inside it, pre-rendered, shows below the picture and its module boxes open further. The
  levels are stored once per distinct structure (a skeleton: identical decoder layers share one)
  plus each level's strings, and graphviz lays out each distinct level once, all of them in at
  most ``workers`` processes;
* the schedule as one timeline per stream, the memory timeline as a line chart (measured where
  the record has them, else the naive prediction of ``deepcompile.plan.estimate``);
* per-operator latency and memory tables, sortable by clicking a column header.
"""
from __future__ import annotations

import datetime as _dt
import html
import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from deepcompile.plan import estimate as E
from deepcompile.record.reader import RunRecord, read_all_steps, read_run
from deepcompile.report import graph_layout as L

esc = html.escape
STREAM_ORDER = ["compute", "allgather", "reduce", "copy"]
STREAM_COLORS = {"compute": "#4e79a7", "allgather": "#f28e2b", "reduce": "#9c6ade", "copy": "#59a14f"}

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


# --------------------------------------------------------------------------- small SVG charts
def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values from ``lo`` to ``hi``: at most ~n of them, whatever the numbers (a range
    far below the float resolution of its values, or one that overflows, gets its ends)."""
    if not (_finite(lo) and _finite(hi)):
        return []
    try:
        span = float(hi) - float(lo)
        if span <= 0 or not math.isfinite(span):
            return [lo] if span <= 0 else [lo, hi]
        step = 10.0 ** math.floor(math.log10(span / n))
        for m in (1, 2, 5, 10):
            if span / (step * m) <= n:
                step *= m
                break
        if step <= 0:
            return [lo]
        k0 = math.ceil(lo / step)
        out: list[float] = []
        for k in range(k0, k0 + 2 * n + 2):   # bounded: a step below the values' resolution stops too
            t = k * step
            if t > hi + abs(step) * 1e-9 or (out and t <= out[-1]):
                break
            out.append(t)
        return out or [lo]
    except (OverflowError, ValueError, ZeroDivisionError):
        return [lo, hi]


def _num(v: float) -> str:
    return f"{v:.4g}"


def _scale(lo: float, hi: float, a: float, b: float):
    """x -> position in [a, b]; halves first so that ``hi - lo`` cannot overflow to inf."""
    lo2, span2 = lo / 2, (hi / 2 - lo / 2) or 0.5
    return lambda x: a + (x / 2 - lo2) / span2 * (b - a)


def line_chart(series: list[tuple[str, list[float], list[float], str]], *, title: str, xlabel: str,
               ylabel: str, yfmt=_num, width: int = 560, height: int = 240, cls: str = "") -> str:
    """Lines of ``(label, xs, ys, color)``. A y of None, NaN or ±inf (a diverged loss) is a gap
    in its line, and the chart says how many points were not finite."""
    pts_all = [(x, y) for s in series for x, y in zip(s[1], s[2]) if _finite(x) and _finite(y)]
    bad = sum(1 for s in series for x, y in zip(s[1], s[2]) if y is not None and not (_finite(x) and _finite(y)))
    note = (f'<text class="gap-note" x="{width - 12}" y="14" text-anchor="end" fill="#c62828">{bad} point(s) '
            "NaN/inf: gaps</text>") if bad else ""
    if not pts_all:
        extra = f" ({bad} NaN/inf value(s))" if bad else ""
        return f'<p class="empty">{esc(title)}: no data{extra}</p>'
    xs_all, ys_all = [p[0] for p in pts_all], [p[1] for p in pts_all]
    x0, x1 = min(xs_all), max(xs_all)
    y0, y1 = min(0.0, min(ys_all)), max(ys_all)
    x1 = x1 if x1 > x0 else x0 + 1
    y1 = y1 if y1 > y0 else y0 + 1
    L_, R, T, B = 70, 12, 24, 36
    pw, ph = width - L_ - R, height - T - B
    sx = _scale(x0, x1, L_, L_ + pw)
    sy = _scale(y0, y1, T + ph, T)
    out = [f'<svg class="chart {cls}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="Helvetica,Arial,sans-serif" font-size="10">',
           f'<text x="{L_}" y="14" font-size="12" font-weight="bold">{esc(title)}</text>', note]
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{L_}" x2="{L_ + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#eee"/>'
                   f'<text x="{L_ - 4}" y="{sy(t) + 3:.1f}" text-anchor="end">{esc(yfmt(t))}</text>')
    for t in _ticks(x0, x1, 8):
        out.append(f'<text x="{sx(t):.1f}" y="{T + ph + 14}" text-anchor="middle">{esc(_num(t))}</text>')
    out.append(f'<rect x="{L_}" y="{T}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    out.append(f'<text x="{L_ + pw / 2}" y="{height - 4}" text-anchor="middle">{esc(xlabel)}</text>')
    out.append(f'<text transform="translate(12,{T + ph / 2}) rotate(-90)" text-anchor="middle">{esc(ylabel)}</text>')
    lx = L_ + 8
    for label, xs, ys, color in series:
        runs: list[list[str]] = [[]]     # one polyline per stretch of finite points
        for x, y in zip(xs, ys):
            if _finite(x) and _finite(y):
                runs[-1].append(f"{sx(x):.1f},{sy(y):.1f}")
            elif runs[-1]:
                runs.append([])
        for pts in runs:
            if len(pts) == 1:   # a lone finite point between gaps: a dot, or it would not show
                cx, cy = pts[0].split(",")
                out.append(f'<circle class="series" cx="{cx}" cy="{cy}" r="2" fill="{color}"><title>{esc(label)}'
                           "</title></circle>")
            elif pts:
                out.append(f'<polyline class="series" points="{" ".join(pts)}" fill="none" stroke="{color}" '
                           f'stroke-width="1.6"><title>{esc(label)}</title></polyline>')
        if len(series) > 1:
            out.append(f'<rect x="{lx}" y="{T + 4}" width="10" height="3" fill="{color}"/>'
                       f'<text x="{lx + 13}" y="{T + 9}">{esc(label)}</text>')
            lx += 20 + 6 * len(label)
    out.append("</svg>")
    return "".join(out)


def timeline(events: list[dict], *, title: str, width: int = 1100) -> str:
    """One lane per stream; a rectangle per op with its name and times as a tooltip."""
    if not events:
        return f'<p class="empty">{esc(title)}: no events</p>'
    streams = [s for s in STREAM_ORDER if any(e["stream"] == s for e in events)]
    t0 = min(e["start_us"] for e in events)
    t1 = max(e["end_us"] for e in events)
    span = max(t1 - t0, 1e-9)
    L_, lane, T = 80, 26, 24
    pw = width - L_ - 12
    h = T + lane * len(streams) + 30
    sx = lambda t: L_ + (t - t0) / span * pw  # noqa: E731
    out = [f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
           f'font-family="Helvetica,Arial,sans-serif" font-size="10">',
           f'<text x="{L_}" y="14" font-size="12" font-weight="bold">{esc(title)}</text>']
    for i, s in enumerate(streams):
        y = T + i * lane
        out.append(f'<rect x="{L_}" y="{y}" width="{pw}" height="{lane - 4}" fill="#f4f6f7"/>'
                   f'<text x="{L_ - 6}" y="{y + lane / 2 + 1}" text-anchor="end">{esc(s)}</text>')
    for e in events:
        y = T + streams.index(e["stream"]) * lane
        x = sx(e["start_us"])
        w = max(0.6, sx(e["end_us"]) - x)
        color = STREAM_COLORS.get(e["stream"], "#888")
        if e["stream"] == "compute" and e["node"].startswith("wait_"):
            color = "#e15759"
        out.append(f'<rect class="ev" x="{x:.2f}" y="{y + 1}" width="{w:.2f}" height="{lane - 6}" '
                   f'fill="{color}" stroke="#fff" stroke-width="0.3"><title>{esc(e["node"])} '
                   f'[{e["stream"]}] {e["start_us"]:.1f}–{e["end_us"]:.1f} µs ({e["source"]})</title></rect>')
    for t in _ticks(t0, t1, 10):
        out.append(f'<text x="{sx(t):.1f}" y="{h - 16}" text-anchor="middle">{_num(t - t0)}</text>')
    out.append(f'<text x="{L_ + pw / 2}" y="{h - 3}" text-anchor="middle">µs</text></svg>')
    return "".join(out)


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


def _section_steps(rec: RunRecord, all_steps: dict[int, list[dict]]) -> str:
    out = ["<section id='steps'><h2>Steps</h2>"]
    st = rec.steps
    if not st:
        out.append("<p class='empty'>no steps recorded (yet)</p></section>")
        return "".join(out)
    xs = [s["step"] for s in st]
    bad_loss = [s["step"] for s in st if s.get("loss") is not None and not _finite(s["loss"])]
    bad_time = [s["step"] for s in st if not _finite(s["time_s"])]
    if bad_loss:
        out.append(f"<p class='note diverged'><b>The run diverged:</b> the loss is NaN or infinite at "
                   f"{len(bad_loss)} of {len(st)} step(s), from step {bad_loss[0]}; those steps are gaps "
                   "in the loss chart.</p>")
    if bad_time:
        out.append(f"<p class='note'>{len(bad_time)} step time(s) are NaN or infinite (from step {bad_time[0]}); "
                   "they are gaps in the step-time chart.</p>")
    out.append(line_chart([("loss", xs, [s.get("loss") for s in st], "#4e79a7")], title="loss (rank 0)",
                          xlabel="step", ylabel="loss", cls="loss"))
    out.append(line_chart([("time", xs, [s["time_s"] for s in st], "#e15759")], title="step time",
                          xlabel="step", ylabel="seconds", cls="steptime"))
    colors = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"]
    mem_series = [(f"rank {r} peak", [s["step"] for s in ss], [(s.get("mem") or {}).get("peak") for s in ss],
                   colors[i % len(colors)]) for i, (r, ss) in enumerate(sorted(all_steps.items())) if ss]
    out.append(line_chart(mem_series, title="peak memory per rank", xlabel="step", ylabel="bytes",
                          yfmt=E.fmt_bytes, cls="mem-steps"))
    rows = []
    for s in st:
        mem = s.get("mem") or {}
        loss = s.get("loss")
        rows.append(f"<tr><td class=num data-v='{s['step']}'>{s['step']}</td>"
                    f"<td class=num data-v='{_js_num(loss)}'>{'' if loss is None else f'{loss:.4f}'}</td>"
                    f"<td class=num data-v='{_js_num(s['time_s'])}'>{s['time_s']:.3f}</td>"
                    + "".join(f"<td class=num data-v='{mem.get(k, 0)}'>{E.fmt_bytes(mem.get(k, 0))}</td>"
                              for k in ("allocated", "reserved", "peak")) + "</tr>")
    out.append("<div class='scroll'><table class='sortable'><thead><tr><th>step</th><th>loss</th><th>time (s)</th>"
               "<th>allocated</th><th>reserved</th><th>peak</th></tr></thead><tbody>"
               + "".join(rows) + "</tbody></table></div>")
    peaks = {r: max(((s.get("mem") or {}).get("peak", 0) for s in ss), default=0) for r, ss in all_steps.items()}
    out.append("<p>Peak memory: " + ", ".join(f"rank {r}: {E.fmt_bytes(p)}" for r, p in sorted(peaks.items()))
               + "</p></section>")
    return "".join(out)


def _js_num(v: Any) -> str:
    """A number as the sort script's ``parseFloat`` reads it (Python writes ``nan``/``inf``)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "NaN"
    if isinstance(v, float) and math.isinf(v):
        return "Infinity" if v > 0 else "-Infinity"
    return str(v)


def _legend() -> str:
    items = [("compute ops", L.COMPUTE_COLOR), ("inputs/outputs", L.IO_COLOR)] + \
        [(k, v) for k, v in L.COMM_COLORS.items()]
    return "<div class='legend'>" + "".join(
        f"<span><i style='background:{c}'></i>{esc(k)}</span>" for k, c in items) + "</div>"


GRAPH_HINT = "click: open"


def _graph_pictures(jobs: list, pscopes: dict, depth: int | None,
                    workers: int) -> tuple[list[str], list[int], str]:
    """(the collapsed picture of every job's version, the index of its levels in the script, the
    ``<script>`` with the levels inside every module box).

    A version equal to an earlier one (a recompile that gave the same graph) shares its levels and
    picture. Every level of every distinct version is built first, then graphviz lays out the
    distinct ones in ``workers`` processes (:func:`graph_layout.prelayout`), then each is drawn
    from that cache; an inner level is stored as an index into a table of skeletons (identical
    layers share one) plus its strings: texts in document order and box keys relative to the
    opened box (its tooltips, ``<key>`` or ``<key> · click: open``, are rebuilt by the script)."""
    distinct: list[tuple[list, tuple]] = []     # (nodes, (top level, inner levels))
    refs = []
    for (_, _, _, v, _) in jobs:
        k = next((k for k, (nodes, _) in enumerate(distinct) if len(nodes) == len(v.nodes) and nodes == v.nodes),
                 None)
        if k is None:
            k = len(distinct)
            distinct.append((v.nodes, L.module_levels(v.nodes, pscopes, depth, hint=GRAPH_HINT)))
        refs.append(k)
    dot = L.have_dot()
    if dot:
        L.prelayout((lv for _, (top, inner) in distinct for lv in (top, *inner.values())), workers)
    pictures, drawn = [], {}
    for (gid, kind, _, v, _), k in zip(jobs, refs):
        title = f"graph {gid} · {kind} · {'input' if v.after == 'input' else 'after ' + v.after}"
        svg = drawn.get((k, title))
        if svg is None:
            svg = drawn[(k, title)] = L.nested_svg(distinct[k][1][0], title, use_dot=dot)
            if 'class="dc-level dc-simple"' in svg[:2000]:   # too big for graphviz, or no graphviz
                svg = drawn[(k, title)] = svg.replace('class="graph dot ', 'class="graph simple ', 1)
        pictures.append(svg)
    skeletons: dict[str, int] = {}
    sig_cache: dict = {}
    per_version = []
    for _, (_, inner) in distinct:
        d = {}
        for key, lv in inner.items():
            skel, texts, titles, keys = L.level_skeleton(lv, use_dot=dot, cache=sig_cache)
            entry = [skeletons.setdefault(skel, len(skeletons)), texts, [k[len(key):] for k in keys]]
            at = {b.key: b for b in lv.boxes}
            if titles != [k + (f" · {GRAPH_HINT}" if k in at and "dc-openable" in at[k].classes else "")
                          for k in keys]:
                entry.append(titles)   # not the usual tooltips: keep them
            d[key] = entry
        per_version.append(d)
    blob = json.dumps({"s": list(skeletons), "v": per_version, "hint": GRAPH_HINT}, ensure_ascii=False,
                      separators=(",", ":"))
    return pictures, refs, ("<script type='application/json' id='dc-levels'>" + blob.replace("<", "\\u003c")
                            + "</script>")


def _section_graphs(rec: RunRecord, depth: int | None, workers: int) -> str:
    pscopes = L.param_scopes(rec.graphs)
    jobs = []
    for gid in rec.graph_ids:
        for kind in rec.kinds(gid):
            vs = rec.versions(gid, kind)
            for i, v in enumerate(vs):
                jobs.append((gid, kind, i, v, vs[i - 1] if i else None))
    svgs, refs, levels_script = _graph_pictures(jobs, pscopes, depth, workers)
    out = ["<section id='graphs'><h2>Graphs</h2>",
           "<p class='note'>Each graph collapsed by module scope (one box per module, to the first "
           "ModuleList index, with its op counts; communication ops as coloured chips; a thicker arrow "
           "carries more tensors; the inputs and outputs boxes are drawn without their arrows). Backward "
           f"nodes without a scope are placed with the layer they follow in graph order. Click a {L.FOLD_MARK} "
           "box to open it: the boxes inside it (sub-modules and single nodes) show below the picture, "
           "where a module opens further; click it again or <i>close</i> to fold it.</p>", _legend()]
    by: dict[tuple[int, str], list] = defaultdict(list)
    for ref, job, svg in zip(refs, jobs, svgs):
        by[(job[0], job[1])].append((ref, job, svg))
    for (gid, kind), items in by.items():
        out.append(f"<h3 id='graph-{gid}-{kind}'>graph {gid} · {esc(kind)}</h3><div class='versions'>")
        for ref, (_, _, i, v, prev), svg in items:
            head = "input" if v.after == "input" else f"after {esc(v.after)}"
            d = ""
            if prev is not None:
                df = L.diff(prev.nodes, v.nodes)
                comm = ", ".join(f"{k} +{n}" for k, n in sorted(df["comm_added"].items()))
                d = (f"<div class='diff'>{df['before']} → {df['after']} nodes: +{df['added']} / "
                     f"−{df['removed']}{'; comm: ' + esc(comm) if comm else ''}; {v.seconds * 1e3:.1f} ms</div>")
            notes = "".join(f"<div class='note'>{esc(n)}</div>" for n in v.notes)
            out.append(f"<div class='version' data-graph='{gid}' data-kind='{esc(kind)}' data-after='{esc(v.after)}' "
                       f"data-levels='{ref}'><h4>{head} ({len(v.nodes)} nodes)</h4>{d}{notes}{svg}"
                       "<div class='dc-panels'></div></div>")
        out.append("</div>")
    if not jobs:
        out.append("<p class='empty'>no graphs recorded</p>")
    out.append(levels_script + "</section>")
    return "".join(out)


def _final_versions(rec: RunRecord) -> dict[tuple[int, str], Any]:
    last = {}
    for v in rec.graphs:
        if v.kind != "dynamo":
            last[(v.graph_id, v.kind)] = v
    return last


def _section_schedule(rec: RunRecord, events: list[dict], source: str) -> str:
    out = ["<section id='schedule'><h2>Schedule</h2>",
           f"<p class='note'>Source: {esc(source)}. One lane per stream; hover an op for its name and times; "
           "red on the compute stream: waiting for a gather.</p>",
           "<div class='legend'>" + "".join(f"<span><i style='background:{c}'></i>{s}</span>"
                                            for s, c in STREAM_COLORS.items()) + "</div>"]
    by: dict[tuple[int, str], list] = defaultdict(list)
    for e in events:
        by[(e["graph_id"], e["kind"])].append(e)
    for (gid, kind), evs in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] != "forward")):
        srcs = sorted({e["source"] for e in evs})
        out.append(timeline(evs, title=f"graph {gid} · {kind} ({'/'.join(srcs)})"))
    if not events:
        out.append("<p class='empty'>no schedule recorded</p>")
    out.append("</section>")
    return "".join(out)


def _section_memory(samples: list[dict], source: str) -> str:
    out = ["<section id='memory'><h2>Memory timeline</h2>", f"<p class='note'>Source: {esc(source)}.</p>"]
    by: dict[Any, list] = defaultdict(list)
    for s in samples:
        by[(s.get("graph_id", -1), s.get("kind", ""))].append(s)
    for (gid, kind), ss in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] != "forward")):
        xkey = "node_index" if all("node_index" in s for s in ss) else "t_us"
        xs = [s.get(xkey, 0) for s in ss]
        series = [("allocated", xs, [s["allocated_bytes"] for s in ss], "#4e79a7")]
        if any("reserved_bytes" in s for s in ss):
            series.append(("reserved/peak", xs, [s.get("reserved_bytes") for s in ss], "#f28e2b"))
        name = f"graph {gid} · {kind}" if gid != -1 else "run"
        out.append(line_chart(series, title=name, xlabel="node index" if xkey == "node_index" else "µs",
                              ylabel="bytes", yfmt=E.fmt_bytes, width=720, cls="memory"))
    if not samples:
        out.append("<p class='empty'>no memory timeline recorded</p>")
    out.append("</section>")
    return "".join(out)


def _section_ops(rec: RunRecord, events: list[dict], samples: list[dict], pscopes: dict) -> str:
    out = ["<section id='ops'><h2>Operators</h2>",
           "<p class='note'>Per node of the final version of each graph. Latency and memory are measured "
           "where the record has a profile, else predicted. Click a column to sort.</p>"]
    prof = {}
    for g in (rec.profile or {}).get("graphs", []):
        prof[(g["graph_id"], g["kind"])] = ({n["name"]: n for n in g["nodes"]}, g.get("hardware"))
    lat = {(e["graph_id"], e["kind"], e["node"]): e["end_us"] - e["start_us"] for e in events}
    mem = {(s.get("graph_id"), s.get("kind"), s.get("node")): s["allocated_bytes"] for s in samples}
    for (gid, kind), v in sorted(_final_versions(rec).items(), key=lambda kv: (kv[0][0], kv[0][1] != "forward")):
        p, hw = prof.get((gid, kind), ({}, None))
        keys, _ = L.node_groups(v.nodes, None, pscopes)
        rows = []
        for i, (n, grp) in enumerate(zip(v.nodes, keys)):
            if n["op"] in ("placeholder", "output", "get_attr"):
                continue
            pn = p.get(n["name"])
            if pn:
                latency = pn.get("latency_ms")
                lat_s = "" if latency is None else f"{latency:.4f}"
                after = pn.get("mem_after_bytes")
                peak, outb = pn.get("peak_bytes"), pn.get("out_bytes", E.node_bytes(n))
            else:
                us = lat.get((gid, kind, n["name"]))
                latency = None if us is None else us / 1e3
                lat_s = "" if latency is None else f"{latency:.4f}*"
                after, peak, outb = mem.get((gid, kind, n["name"])), None, E.node_bytes(n)
            comm = E.comm_kind(n)
            style = f" style='background:{L.comm_color(comm)}'" if comm else ""
            rows.append(
                f"<tr><td class=num data-v='{i}'>{i}</td><td{style}>{esc(n['name'])}</td><td>{esc(n['target'])}</td>"
                f"<td>{esc(grp)}</td><td>{esc(json.dumps(n.get('shape')))}</td>"
                f"<td class=num data-v='{latency if latency is not None else -1}'>{lat_s}</td>"
                f"<td class=num data-v='{outb or 0}'>{E.fmt_bytes(outb or 0)}</td>"
                f"<td class=num data-v='{after if after is not None else -1}'>{'' if after is None else E.fmt_bytes(after)}</td>"
                f"<td class=num data-v='{peak if peak is not None else -1}'>{'' if peak is None else E.fmt_bytes(peak)}</td></tr>")
        src = f"measured on {esc(json.dumps(hw))}" if p else "predicted (*)"
        out.append(f"<h3>graph {gid} · {esc(kind)} · after {esc(v.after)} — {src}</h3>"
                   "<div class='scroll'><table class='sortable ops'><thead><tr><th>#</th><th>node</th><th>target</th>"
                   "<th>module</th><th>shape</th><th>latency (ms)</th><th>output</th><th>mem after</th>"
                   "<th>peak</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table></div>")
    out.append("</section>")
    return "".join(out)


def render_report(run_dir: str | os.PathLike, out_file: str | os.PathLike | None = None, *, rank: int = 0,
                  depth: int | None = None, workers: int | None = None) -> Path:
    """Write the report of ``run_dir`` to ``out_file`` (default ``RUN_DIR/report.html``); returns its path."""
    rec = read_run(run_dir, rank)
    all_steps = read_all_steps(run_dir, rec.manifest)
    out = Path(out_file) if out_file is not None else Path(run_dir) / "report.html"
    pscopes = L.param_scopes(rec.graphs)
    # measured where recorded, else the naive prediction from the final graphs
    if rec.schedule and rec.schedule["events"]:
        events, ev_src = rec.schedule["events"], "recorded"
    else:
        events, _ = E.estimate_versions([vars(v) for v in _final_versions(rec).values()])
        ev_src = "predicted by the naive order-based estimate (no schedule in the record)"
    if rec.memory and rec.memory["samples"]:
        samples, mem_src = rec.memory["samples"], "recorded"
    else:
        _, samples = E.estimate_versions([vars(v) for v in _final_versions(rec).values()])
        mem_src = "predicted by liveness over the final graphs (no memory timeline in the record)"
    title = f"deepcompile run {Path(run_dir).resolve().name}"
    body = [
        f"<header><h1>{esc(title)}</h1><div class='sub'>{rec.manifest['world_size']} rank(s) · "
        f"{len(rec.graph_ids)} graph(s) · {len(rec.steps)} step(s) · status {esc(rec.manifest['status'])} · "
        f"rendered {_dt.datetime.now().isoformat(timespec='seconds')}</div></header>",
        "<nav><a href='#run'>Run</a><a href='#steps'>Steps</a><a href='#graphs'>Graphs</a>"
        "<a href='#schedule'>Schedule</a><a href='#memory'>Memory</a><a href='#ops'>Operators</a></nav>",
        _section_run(rec), _section_steps(rec, all_steps),
        _section_graphs(rec, depth, workers or min(8, os.cpu_count() or 1)),
        _section_schedule(rec, events, ev_src), _section_memory(samples, mem_src),
        _section_ops(rec, events, samples, pscopes)]
    doc = ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
           f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
           + "".join(body) + f"<script>{JS}</script></body></html>")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_text(doc, encoding="utf-8")
    os.replace(tmp, out)
    return out
