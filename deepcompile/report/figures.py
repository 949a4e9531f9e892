"""Plotly figures of a run, as plain figure dicts (``{"data": [...], "layout": {...}}``).

deepcompile does not import plotly: these functions build the JSON that plotly.js draws. The
static report (:mod:`deepcompile.report.html`) hands them to ``Plotly.newPlot`` with the
plotly.min.js of the installed plotly package inlined (no network); the notebook widget passes
the same dicts to ``plotly.graph_objects.Figure``.

* :func:`schedule_figure`: a Perfetto-like schedule of one step: one lane per rank and stream,
  measured and predicted never in one lane (each source has its own subplot, its own y axis,
  the two x axes zoom together), time in ms, hover with node name, duration and graph, every
  gather linked from its issue to its wait; with it :func:`step_numbers`, the three numbers that
  matter per step: exposed communication, overlap, and idle (host-bound) time.
* :func:`memory_figure`: memory by category over time, stacked, the peak marked and labelled
  measured or predicted, in MiB or GiB with the axis saying which.
* :func:`steps_figure`: step times (and loss), the compile and profiling steps marked as
  annotations above a y range that the steady-state steps set (one 2 s compile step does not
  flatten 40 ms steps into a line at the bottom).

Times are formatted by :func:`fmt_us` (µs below a millisecond, ms above, never scientific).
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from typing import Any, Iterable

from deepcompile.profile.trace import intersection_length, union
from deepcompile.record.steps import special_steps

STREAM_ORDER = ("compute", "allgather", "reduce", "copy")
STREAM_COLORS = {"compute": "#4e79a7", "allgather": "#f28e2b", "reduce": "#9c6ade", "copy": "#59a14f"}
WAIT_COLOR = "#e15759"          # compute stream blocked on a collective
SOURCE_ORDER = ("measured", "predicted")
SOURCE_TITLES = {"measured": "measured (profiled step)", "predicted": "predicted (cost model)"}
KIND_ORDER = {"forward": 0, "inference": 0, "backward": 1}
COMM_STREAMS = ("allgather", "reduce")

# an asynchronous gather and its wait: prefetch's (allgather_params / wait_allgather_many) and the
# kept parameters' need-order groups (gather_persistent_start / _wait); gather_persistent[_many]
# waits inside itself: nothing to link
_ISSUE = re.compile(r"^(dc::)?(allgather_params?|gather_persistent_start)(_|$|\.)")
_WAIT = re.compile(r"^(dc::)?(wait_allgather(_many)?|gather_persistent_wait)(_|$|\.)")
_ANY_WAIT = re.compile(r"^(dc::)?(wait_|gather_persistent_wait)")

CATEGORY_COLORS = {"parameter_shards": "#4e79a7", "gathered": "#f28e2b", "gradients": "#9c6ade",
                   "optimizer_state": "#59a14f", "activations": "#e15759", "offloaded": "#bab0ac"}
_EXTRA_COLORS = ["#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#86bcb6"]


# --------------------------------------------------------------------------- formatting
def fmt_us(us: float | None) -> str:
    """A duration or time given in µs, as a person reads it: ``850.0 µs``, ``12.34 ms``, ``2.500 s``."""
    if us is None or not isinstance(us, (int, float)) or not math.isfinite(us):
        return "–"
    a = abs(us)
    if a == 0:
        return "0 µs"
    if a < 10:
        return f"{us:.2f} µs"
    if a < 1000:
        return f"{us:.1f} µs"
    if a < 1e6:
        return f"{us / 1e3:.2f} ms"
    return f"{us / 1e6:.3f} s"


def fmt_ms(ms: float | None) -> str:
    return fmt_us(None if ms is None else ms * 1e3)


_BIN = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: float | None) -> str:
    if n is None or not isinstance(n, (int, float)) or not math.isfinite(n):
        return "–"
    if abs(n) < 1024:
        return f"{int(n)} B"
    k = min(int(math.log(abs(n), 1024)), 4)
    return f"{n / 1024 ** k:.1f} {_BIN[k]}"


def byte_unit(max_bytes: float) -> tuple[str, float]:
    """(unit name, divisor) for an axis whose largest value is ``max_bytes``: MiB below 2 GiB, else GiB."""
    return ("GiB", float(1 << 30)) if max_bytes >= 2 * (1 << 30) else ("MiB", float(1 << 20))


def figure_json(fig: dict) -> str:
    """``fig`` as JSON that ``JSON.parse`` accepts (NaN/inf become null) and that is safe inside a
    ``<script>`` element (no ``</``)."""
    def clean(o):
        if isinstance(o, float) and not math.isfinite(o):
            return None
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o
    return json.dumps(clean(fig), separators=(",", ":"), ensure_ascii=False).replace("</", "<\\/")


# --------------------------------------------------------------------------- events
def _times_us(e: dict) -> tuple[float, float]:
    if "start_us" in e:
        return float(e["start_us"]), float(e["end_us"])
    return float(e["start_ms"]) * 1e3, float(e["end_ms"]) * 1e3   # plan.whatif's schedule


def _names(e: dict) -> tuple[str, str]:
    return str(e.get("node", "")), str(e.get("op") or "")


def is_wait(e: dict) -> bool:
    """A wait on a collective (the compute stream blocked), by its node or operator name."""
    n, op = _names(e)
    return bool(_ANY_WAIT.match(n) or _ANY_WAIT.match(op))


def _is_gather_issue(e: dict) -> bool:
    n, op = _names(e)
    return bool(_ISSUE.match(n) or _ISSUE.match(op))


def _is_gather_wait(e: dict) -> bool:
    n, op = _names(e)
    return bool(_WAIT.match(n) or _WAIT.match(op))


def _graph_key(e: dict) -> tuple[int, str]:
    g = e.get("graph_id", 0)
    return (g if isinstance(g, int) and not isinstance(g, bool) else -1), str(e.get("kind", ""))


def _exec_order(keys: Iterable[tuple[int, str]]) -> list[tuple[int, str]]:
    """Graphs in the order a step runs them: forwards by id, then backwards in reverse."""
    return sorted(set(keys), key=lambda k: (KIND_ORDER.get(k[1], 2), k[0] if KIND_ORDER.get(k[1]) != 1 else -k[0]))


def normalize(events: Iterable[dict], *, rank: int = 0) -> list[dict]:
    """Events as the figures use them: ``t0``/``t1`` in µs, ``rank`` and ``source`` set.

    A source whose graphs overlap in time (the cost model times each graph from 0) gets its
    graphs laid end to end in execution order, so its lanes read as one step; one whose graphs
    are already disjoint (a measured step) keeps its times. Each (source, rank) starts at 0."""
    out = []
    for e in events:
        t0, t1 = _times_us(e)
        d = dict(e, t0=t0, t1=max(t1, t0), rank=int(e.get("rank", rank)), source=str(e.get("source", "predicted")))
        out.append(d)
    by: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for e in out:
        by[(e["source"], e["rank"])].append(e)
    for es in by.values():
        spans: dict[tuple[int, str], list[float]] = {}
        for e in es:
            s = spans.setdefault(_graph_key(e), [e["t0"], e["t1"]])
            s[0], s[1] = min(s[0], e["t0"]), max(s[1], e["t1"])
        order = _exec_order(spans)
        ivs = sorted(spans.values())
        overlapping = any(b[0] < a[1] for a, b in zip(ivs, ivs[1:]))
        shift: dict[tuple[int, str], float] = {}
        if overlapping:
            at = 0.0
            for k in order:
                shift[k] = at - spans[k][0]
                at += spans[k][1] - spans[k][0]
        else:
            base = min(s[0] for s in spans.values())
            shift = {k: -base for k in spans}
        for e in es:
            d = shift[_graph_key(e)]
            e["t0"] += d
            e["t1"] += d
    return out


def device_kind(env: dict | None) -> str | None:
    """``"gpu"`` or ``"cpu"``: what the run's environment (``environment.json``) ran on; None unknown."""
    if not isinstance(env, dict):
        return None
    return "gpu" if env.get("devices") else "cpu"


def idle_word(device: str | None) -> str:
    """The name of the time no stream is busy, in words that fit the device: on a GPU the device
    waits for the host; on a CPU it is time between the host's operators."""
    if device == "gpu":
        return "GPU idle (host-bound)"
    if device == "cpu":
        return "idle (between operators)"
    return "idle (host-bound)"


def step_numbers(events: Iterable[dict], *, normalized: bool = False) -> list[dict]:
    """Per (source, rank), over one step: ``step_ms`` (first start to last end), ``compute_ms``
    (compute stream busy, waits excluded), ``comm_ms`` (allgather/reduce streams busy),
    ``overlap_ms`` (communication while compute runs), ``exposed_comm_ms`` (communication while
    compute does not: ``comm_ms - overlap_ms``), ``idle_ms`` (no stream busy: the device waits
    for the host; on a CPU record, time between the host's operators), and ``idle_fraction``.

    Intervals are merged first (:func:`deepcompile.profile.trace.union`), so nested host
    operators and concurrent kernels count once."""
    evs = list(events) if normalized else normalize(events)
    by: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for e in evs:
        by[(e["source"], e["rank"])].append(e)
    out = []
    for (src, r), es in sorted(by.items(), key=lambda kv: (_src_index(kv[0][0]), kv[0][1])):
        comp = union([(e["t0"], e["t1"]) for e in es if e["stream"] == "compute" and not is_wait(e)])
        comm = union([(e["t0"], e["t1"]) for e in es if e["stream"] in COMM_STREAMS])
        # the device's streams only: a "host" event (the cost model's launch time) is what the
        # device waits for, not device work
        busy = union([(e["t0"], e["t1"]) for e in es
                      if e["stream"] != "host" and not (e["stream"] == "compute" and is_wait(e))])
        span = max(e["t1"] for e in es) - min(e["t0"] for e in es)
        comm_t = sum(b - a for a, b in comm)
        ov = intersection_length(comm, comp)
        idle = max(0.0, span - sum(b - a for a, b in busy))
        out.append({"source": src, "rank": r, "step_ms": span / 1e3,
                    "compute_ms": sum(b - a for a, b in comp) / 1e3, "comm_ms": comm_t / 1e3,
                    "overlap_ms": ov / 1e3, "exposed_comm_ms": (comm_t - ov) / 1e3, "idle_ms": idle / 1e3,
                    "idle_fraction": idle / span if span > 0 else 0.0})
    return out


def _src_index(s: str) -> int:
    return SOURCE_ORDER.index(s) if s in SOURCE_ORDER else len(SOURCE_ORDER)


def _refs(a: Any) -> list[str]:
    if isinstance(a, dict):
        return [a["node"]] if isinstance(a.get("node"), str) else [x for v in a.values() for x in _refs(v)]
    if isinstance(a, (list, tuple)):
        return [x for v in a for x in _refs(v)]
    return []


def gather_links(events: list[dict], graphs: dict | None = None) -> list[dict]:
    """Each gather's issue and wait, per (source, rank, graph): ``{source, rank, graph_id, kind,
    issue, wait, issue_t, wait_t, wait_end, issue_lane, wait_lane}`` (times in µs of the
    normalized events). With ``graphs`` ({(graph_id, kind): nodes}) a wait is matched to the
    gather its node reads; without, the k-th wait to the k-th issue (waits come in issue order).
    Events are merged per node name (a host op and its nested operators are one span)."""
    by: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for e in events:
        if not (_is_gather_issue(e) or _is_gather_wait(e)):
            continue
        k = (e["source"], e["rank"], e.get("graph_id", 0), e.get("kind", ""))
        d = by[k].get(e["node"])
        comm_lane = e["stream"] in COMM_STREAMS
        if d is None:
            by[k][e["node"]] = dict(e, wait=_is_gather_wait(e))
        else:   # merge: the span of all, the lane of the collective if any
            d["t0"], d["t1"] = min(d["t0"], e["t0"]), max(d["t1"], e["t1"])
            if comm_lane and d["stream"] not in COMM_STREAMS:
                d["stream"] = e["stream"]
    out = []
    for (src, r, gid, kind), nodes in by.items():
        issues = sorted((d for d in nodes.values() if not d["wait"]), key=lambda d: d["t0"])
        waits = sorted((d for d in nodes.values() if d["wait"]), key=lambda d: d["t0"])
        pairs = []
        gnodes = (graphs or {}).get((gid, kind))
        if gnodes:
            reads = {n["name"]: _refs(n.get("args")) for n in gnodes if isinstance(n, dict) and "name" in n}
            for w in waits:
                src_names = [x for x in reads.get(w["node"], []) if x in nodes and not nodes[x]["wait"]]
                if src_names:
                    pairs.append((nodes[src_names[0]], w))
        else:
            pairs = list(zip(issues, waits))
        for i, w in pairs:
            out.append({"source": src, "rank": r, "graph_id": gid, "kind": kind, "issue": i["node"],
                        "wait": w["node"], "issue_t": i["t0"], "issue_end": i["t1"], "wait_t": w["t0"],
                        "wait_end": w["t1"], "issue_lane": _lane(i), "wait_lane": _lane(w)})
    return out


def _lane(e: dict) -> str:
    return f"rank {e['rank']} · {e['stream']}"


# --------------------------------------------------------------------------- schedule
def schedule_figure(events: Iterable[dict], *, graphs: dict | None = None, graph: tuple[int, str] | None = None,
                    selected: str | None = None, title: str | None = None, links: bool = True,
                    rank: int = 0, totals: dict | None = None, device: str | None = None) -> dict:
    """A Perfetto-like schedule of ``events`` (the record's ``{graph_id, kind, node, stream,
    start_us, end_us, source}``, optionally ``rank``; or what-if's ``start_ms``/``end_ms``).

    One subplot per source (measured above predicted), one lane per rank and stream inside it:
    a source's bars never share a lane with another's. x is ms from the start of the step (the
    x axes zoom together); hover names the node, its duration, start and graph; a wait on the
    compute stream is red. ``graphs`` ({(graph_id, kind): nodes}) links each wait to the gather
    its node reads (else by order); ``graph`` keeps one graph's events; ``selected`` outlines a
    node's bars. Each subplot's title carries :func:`step_numbers` for its ranks; ``totals``
    ({source: {"headline", "edit"}}, a what-if's) puts that prediction's own step and peak in its
    subplot's title instead of the span of its bars (a step is more than one graph's timeline:
    accumulation, the optimizer, the host), so the lane and the Passes tab say one number."""
    evs = normalize(events, rank=rank)
    if graph is not None:
        evs = [e for e in evs if _graph_key(e) == (int(graph[0]), str(graph[1]))]
    sources = sorted({e["source"] for e in evs}, key=_src_index)
    if not evs:
        return {"data": [], "layout": {"title": {"text": (title or "schedule") + ": no events"},
                                       "height": 160, "xaxis": {"visible": False}, "yaxis": {"visible": False}}}
    numbers = {(n["source"], n["rank"]): n for n in step_numbers(evs, normalized=True)}
    lanes_of: dict[str, list[str]] = {}
    for src in sources:
        es = [e for e in evs if e["source"] == src]
        ls = []
        for r in sorted({e["rank"] for e in es}):
            for s in STREAM_ORDER + tuple(sorted({e["stream"] for e in es} - set(STREAM_ORDER))):
                if any(e["rank"] == r and e["stream"] == s for e in es):
                    ls.append(f"rank {r} · {s}")
        lanes_of[src] = ls
    # vertical layout: each source's subplot as tall as its lanes, a gap for its title
    # a gap above each panel for its title (and, below the first, the tick labels of the one above)
    lane_px, top_px, bottom_px = 30, 40, 50
    gaps = [24] + [58] * (len(sources) - 1)
    total = sum(len(v) for v in lanes_of.values()) * lane_px + sum(gaps)
    height = top_px + bottom_px + total
    data: list[dict] = []
    layout: dict[str, Any] = {
        "barmode": "overlay", "height": height, "hovermode": "closest", "dragmode": "zoom",
        "margin": {"l": 110, "r": 20, "t": top_px, "b": bottom_px},
        "legend": {"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0, "font": {"size": 11}},
        "annotations": [], "shapes": []}
    if title:
        layout["title"] = {"text": title, "font": {"size": 13}, "x": 0.01}
        layout["margin"]["t"] = top_px + 24
        layout["height"] = height + 24
    y_top = 1.0
    seen_legend: set[str] = set()
    for i, src in enumerate(sources):
        ax = "" if i == 0 else str(i + 1)
        xname, yname = "x" + ax, "y" + ax
        lanes = lanes_of[src]
        h = (len(lanes) * lane_px) / total
        g = gaps[i] / total
        dom = [max(0.0, y_top - g - h), y_top - g]
        y_top = dom[0]
        # every panel's time axis carries its unit (the panels zoom together, each is read alone)
        layout["xaxis" + ax] = {"anchor": yname, "title": ({"text": "ms from the start of the step"} if i == len(sources) - 1
                                                           else {"text": "ms", "standoff": 2, "font": {"size": 10}}),
                                "exponentformat": "none", "ticksuffix": " ms",
                                "showgrid": True, "gridcolor": "#eee", "zeroline": False, "hoverformat": ".3f"}
        if i:
            layout["xaxis" + ax]["matches"] = "x"
        layout["yaxis" + ax] = {"domain": dom, "anchor": xname, "type": "category", "categoryorder": "array",
                                "categoryarray": list(reversed(lanes)), "autorange": True, "fixedrange": True,
                                "title": {"text": src, "font": {"size": 11}}}
        nums = [numbers[(src, r)] for r in sorted({e["rank"] for e in evs if e["source"] == src})]
        tot = (totals or {}).get(src)
        if tot:
            text = (f"<b>{SOURCE_TITLES.get(src, src)}</b>" + (f" of {tot['edit']}" if tot.get("edit") else "")
                    + f": {tot['headline']}  |  " + "  |  ".join(
                        f"rank {n['rank']} timeline: span {fmt_ms(n['step_ms'])} · exposed comm "
                        f"{fmt_ms(n['exposed_comm_ms'])} · overlap {fmt_ms(n['overlap_ms'])}" for n in nums[:4]))
        else:
            text = f"<b>{SOURCE_TITLES.get(src, src)}</b>  " + "  |  ".join(
                f"rank {n['rank']}: step {fmt_ms(n['step_ms'])} · exposed comm {fmt_ms(n['exposed_comm_ms'])} · "
                f"overlap {fmt_ms(n['overlap_ms'])} · {idle_word(device)} {fmt_ms(n['idle_ms'])}"
                for n in nums[:4])
        if len(nums) > 4:
            text += f"  |  … {len(nums) - 4} more rank(s)"
        layout["annotations"].append({"text": text, "xref": "paper", "yref": "paper", "x": 0, "y": dom[1],
                                      "xanchor": "left", "yanchor": "bottom", "showarrow": False,
                                      "font": {"size": 11}, "align": "left"})
        lk = gather_links([e for e in evs if e["source"] == src], graphs) if links else []
        xref: dict[tuple, str] = {}     # the hover cross-reference of a gather's issue and its wait
        for x in lk:
            k = (x["rank"], x["graph_id"], x["kind"])
            xref[k + (x["issue"],)] = (f"waited by {x['wait']} at {fmt_us(x['wait_t'])} "
                                       f"(blocked {fmt_us(x['wait_end'] - x['wait_t'])})")
            xref[k + (x["wait"],)] = f"waits for {x['issue']}, issued at {fmt_us(x['issue_t'])}"
        if links and not lk and any(_is_gather_issue(e) for e in evs if e["source"] == src):
            unlinked = "no wait in this record (on GPU a wait is a stream dependency, not a kernel)"
        else:
            unlinked = ""
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for e in evs:
            if e["source"] == src:
                wait = e["stream"] == "compute" and is_wait(e)
                groups[(e["rank"], e["stream"], wait)].append(e)
        for (r, s, wait), es in sorted(groups.items(), key=lambda kv: (kv[0][0], _stream_index(kv[0][1]), kv[0][2])):
            es.sort(key=lambda e: e["t0"])
            label = "compute blocked (wait)" if wait else s
            data.append({
                "type": "bar", "orientation": "h", "xaxis": xname, "yaxis": yname,
                "name": label, "legendgroup": label, "showlegend": label not in seen_legend,
                "base": [e["t0"] / 1e3 for e in es], "x": [max(e["t1"] - e["t0"], 0.05) / 1e3 for e in es],
                "y": [f"rank {r} · {s}"] * len(es), "width": 0.8,
                "marker": {"color": WAIT_COLOR if wait else STREAM_COLORS.get(s, "#888"),
                           "opacity": 1.0 if src == "measured" else 0.75, "line": {"width": 0}},
                "customdata": [[e["node"], fmt_us(e["t1"] - e["t0"]), f"graph {e.get('graph_id', 0)} · {e.get('kind', '')}",
                                fmt_us(e["t0"]), (e.get("op") or e.get("kernel") or ""),
                                xref.get((e["rank"], e.get("graph_id", 0), e.get("kind", ""), e["node"]))
                                or (unlinked if _is_gather_issue(e) else "")] for e in es],
                "hovertemplate": "<b>%{customdata[0]}</b> %{customdata[4]}<br>%{customdata[1]} at %{customdata[3]}"
                                 "<br>%{customdata[2]}<br>%{customdata[5]}<extra>" + f"{src} · rank {r} · {s}" + "</extra>",
                "meta": {"source": src, "rank": r, "stream": s, "wait": wait}})
            seen_legend.add(label)
        if lk:
            xs, ys, txt = [], [], []
            for x in lk:
                t = (f"{x['issue']} → {x['wait']}<br>issued at {fmt_us(x['issue_t'])}, waited at "
                     f"{fmt_us(x['wait_t'])} (blocked {fmt_us(x['wait_end'] - x['wait_t'])})")
                xs += [x["issue_t"] / 1e3, x["wait_t"] / 1e3, None]
                ys += [x["issue_lane"], x["wait_lane"], None]
                txt += [t, t, ""]
            data.append({"type": "scatter", "mode": "lines+markers", "xaxis": xname, "yaxis": yname,
                         "x": xs, "y": ys, "text": txt, "hoverinfo": "text", "name": "gather: issue → wait",
                         "legendgroup": "links", "showlegend": "links" not in seen_legend,
                         "line": {"color": "rgba(40,40,40,0.45)", "width": 1, "dash": "dot"},
                         "marker": {"size": 4, "color": "rgba(40,40,40,0.6)"},
                         "meta": {"source": src, "links": len(lk)}})
            seen_legend.add("links")
        if selected:
            sel = [e for e in evs if e["source"] == src and e["node"] == selected]
            if sel:
                data.append({"type": "bar", "orientation": "h", "xaxis": xname, "yaxis": yname,
                             "base": [e["t0"] / 1e3 for e in sel], "x": [max(e["t1"] - e["t0"], 0.05) / 1e3 for e in sel],
                             "y": [_lane(e) for e in sel], "width": 0.9, "name": f"selected: {selected}",
                             "showlegend": "selected" not in seen_legend, "legendgroup": "selected",
                             "marker": {"color": "rgba(0,0,0,0)", "line": {"color": "#ff00aa", "width": 3}},
                             "hovertemplate": selected + "<extra>selected</extra>",
                             "meta": {"source": src, "selected": selected}})
                seen_legend.add("selected")
    layout["meta"] = {"numbers": list(numbers.values()), "lanes": lanes_of}
    return {"data": data, "layout": layout}


def _stream_index(s: str) -> int:
    return STREAM_ORDER.index(s) if s in STREAM_ORDER else len(STREAM_ORDER)


# --------------------------------------------------------------------------- memory
def _sample_total(s: dict) -> float:
    bc = s.get("by_category")
    if isinstance(bc, dict) and bc:
        return float(sum(v for v in bc.values() if isinstance(v, (int, float))))
    return float(s.get("allocated_bytes") or 0)


def _peaks(view: dict) -> list[dict]:
    """Every peak ``view`` carries, each ``{bytes, source, label?, where?, by_category?}``, measured
    first: ``record.reader.memory_view``'s ``measured.peak`` and ``predicted.peak`` (its ``peak``,
    the run's one peak, is one of those two), or a flat view's ``peak`` / ``predicted`` / ``peaks``."""
    out: list[dict] = []

    def add(p: Any, source: str, label: str | None = None) -> None:
        if isinstance(p, dict) and _fin(p.get("bytes")):
            d = dict(p, source=str(p.get("source") or source))
            if label and "label" not in d:
                d["label"] = label
            if not any(q["source"] == d["source"] and q["bytes"] == d["bytes"] for q in out):
                out.append(d)

    for key in ("measured", "predicted"):
        part = view.get(key)
        if isinstance(part, dict) and isinstance(part.get("peak"), dict):
            add(part["peak"], key, part.get("label"))
    add(view.get("peak"), "measured")
    if isinstance(view.get("predicted"), dict) and "peak" not in view["predicted"]:
        add(view["predicted"], "predicted")
    add(view.get("predicted_peak"), "predicted")
    for p in view.get("peaks") or []:
        add(p, "predicted")
    out.sort(key=lambda p: _src_index(p["source"]))
    return out


def memory_samples(view: dict) -> list[dict]:
    """The timeline's samples: ``memory_view``'s measured ones, else a flat view's ``samples``."""
    m = view.get("measured")
    if isinstance(m, dict) and m.get("samples"):
        return [dict(s, source=s.get("source", "measured")) for s in m["samples"] if isinstance(s, dict)]
    return [s for s in view.get("samples") or [] if isinstance(s, dict)]


def memory_x(samples: list[dict]) -> tuple[list[float], str]:
    """x of each sample and the axis title: ms (``t_ms``, or ``t_us``) when every sample has a
    time, else a running node index across the graphs in execution order."""
    if samples and all("t_ms" in s for s in samples):
        return [float(s["t_ms"]) for s in samples], "ms from the start of the step"
    if samples and all("t_us" in s for s in samples):
        return [float(s["t_us"]) / 1e3 for s in samples], "ms from the start of the step"
    return list(range(len(samples))), "node (in execution order)"


def memory_figure(view: dict, *, title: str | None = None) -> dict:
    """Memory over one step, stacked by category (``record.reader.memory_view``'s
    ``{categories, samples: [{t_ms, graph_id, kind, node, by_category, allocated_bytes}], peak}``);
    samples without ``by_category`` are one ``allocated`` band. The measured peak is a labelled
    marker, a predicted peak a dashed line with its categories on hover; the y axis is in MiB or
    GiB and says which."""
    samples = memory_samples(view)
    if samples and not any("t_ms" in s or "t_us" in s for s in samples):
        order = {k: i for i, k in enumerate(_exec_order(_graph_key(s) for s in samples))}
        samples.sort(key=lambda s: (order.get(_graph_key(s), 0), s.get("node_index", 0)))
    elif samples:
        samples.sort(key=lambda s: s.get("t_ms", s.get("t_us", 0)))
    xs, xtitle = memory_x(samples)
    cats = list(view.get("categories") or [])
    have_cat = any(isinstance(s.get("by_category"), dict) for s in samples)
    if have_cat:
        for s in samples:
            for c in (s.get("by_category") or {}):
                if c not in cats:
                    cats.append(c)
    else:
        cats = ["allocated"]
    peaks = _peaks(view)
    top = max([_sample_total(s) for s in samples] + [float(p["bytes"]) for p in peaks] + [1.0])
    unit, div = byte_unit(top)
    src = sorted({str(s.get("source", "measured")) for s in samples}) or ["–"]
    data: list[dict] = []
    for i, c in enumerate(cats):
        ys = [((s.get("by_category") or {}).get(c, 0) if have_cat else s.get("allocated_bytes", 0)) / div
              for s in samples]
        color = CATEGORY_COLORS.get(c, _EXTRA_COLORS[i % len(_EXTRA_COLORS)])
        data.append({"type": "scatter", "mode": "lines", "x": xs, "y": ys, "name": c.replace("_", " "),
                     "stackgroup": "memory", "line": {"width": 0.6, "color": color}, "fillcolor": color,
                     "customdata": [[s.get("node", ""), f"graph {s.get('graph_id', '')} · {s.get('kind', '')}",
                                     fmt_bytes(y * div), fmt_bytes(_sample_total(s))] for s, y in zip(samples, ys)],
                     "hovertemplate": "<b>%{customdata[0]}</b> (%{customdata[1]})<br>" + c.replace("_", " ")
                                      + ": %{customdata[2]} of %{customdata[3]}<extra>" + "/".join(src) + "</extra>",
                     "meta": {"category": c, "source": "/".join(src)}})
    if have_cat and any("allocated_bytes" in s for s in samples):
        data.append({"type": "scatter", "mode": "lines", "x": xs, "y": [s.get("allocated_bytes", 0) / div for s in samples],
                     "name": "allocated (allocator)", "line": {"color": "#333", "width": 1, "dash": "dot"},
                     "hovertemplate": "allocated %{y:.1f} " + unit + "<extra></extra>", "meta": {"total": True}})
    annotations, shapes = [], []
    x_lo, x_hi = (min(xs), max(xs)) if xs else (0, 1)
    for p in peaks:
        label = f"{p['source']} peak {fmt_bytes(p['bytes'])}"
        bc = p.get("by_category") or {}
        detail = "<br>".join(f"{k.replace('_', ' ')}: {fmt_bytes(v)}" for k, v in bc.items() if v)
        where = p.get("where")
        where_s = where if isinstance(where, str) else (where or {}).get("node", "") if isinstance(where, dict) else ""
        t_peak = p.get("t_ms") if _fin(p.get("t_ms")) else (where or {}).get("t_ms") if isinstance(where, dict) else None
        if p["source"] == "measured" and samples:
            k = None
            if _fin(t_peak) and xtitle.startswith("ms"):
                k = min(range(len(samples)), key=lambda j: abs(xs[j] - float(t_peak)))
            elif where_s:
                k = next((j for j, s in enumerate(samples) if s.get("node") == where_s), None)
            if k is None:
                k = max(range(len(samples)), key=lambda j: _sample_total(samples[j]))
            x = float(t_peak) if _fin(t_peak) and xtitle.startswith("ms") else xs[k]
            where_s = where_s or str(samples[k].get("node", ""))
            data.append({"type": "scatter", "mode": "markers", "x": [x], "y": [p["bytes"] / div], "name": label,
                         "marker": {"symbol": "triangle-down", "size": 12, "color": "#d62728"},
                         "text": [f"<b>{label}</b> at {where_s}<br>{detail}"], "hovertemplate": "%{text}<extra></extra>",
                         "meta": {"peak": p["source"], "bytes": p["bytes"]}})
            annotations.append({"x": x, "y": p["bytes"] / div, "text": f"{label} ({where_s})" if where_s else label,
                                "showarrow": True, "arrowhead": 0, "ax": 0, "ay": -28, "font": {"size": 11, "color": "#d62728"}})
        else:
            data.append({"type": "scatter", "mode": "lines", "x": [x_lo, x_hi], "y": [p["bytes"] / div] * 2,
                         "name": label, "line": {"color": "#1f77b4", "width": 1.5, "dash": "dash"},
                         "text": [f"<b>{label}</b><br>{detail}"] * 2, "hovertemplate": "%{text}<extra></extra>",
                         "meta": {"peak": p["source"], "bytes": p["bytes"]}})
            annotations.append({"x": x_hi, "y": p["bytes"] / div, "xanchor": "right", "yanchor": "bottom",
                                "text": label, "showarrow": False, "font": {"size": 11, "color": "#1f77b4"}})
    head = title or "memory"
    layout = {"title": {"text": f"{head} — {'/'.join(src)}", "font": {"size": 13}, "x": 0.01}, "height": 360,
              "margin": {"l": 70, "r": 20, "t": 40, "b": 45}, "hovermode": "closest",
              "xaxis": {"title": {"text": xtitle}, "exponentformat": "none", "zeroline": False},
              "yaxis": {"title": {"text": unit}, "exponentformat": "none", "rangemode": "tozero",
                        "ticksuffix": f" {unit}", "hoverformat": ".1f"},
              "legend": {"orientation": "h", "y": -0.22, "font": {"size": 11}},
              "annotations": annotations, "shapes": shapes, "meta": {"unit": unit, "peaks": peaks}}
    if not samples:
        layout["title"]["text"] = f"{head}: no memory timeline"
    return {"data": data, "layout": layout}


# --------------------------------------------------------------------------- steps
def _int_dtick(n: int) -> int:
    """A tick step of 1, 2 or 5 times a power of ten giving at most ~12 integer ticks over n steps."""
    k = 1
    while True:
        for m in (1, 2, 5):
            if n / (k * m) <= 12:
                return k * m
        k *= 10


def _fin(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


RANK_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"]


def steps_figure(steps: list[dict] | dict[int, list[dict]], *, special: dict[int, str] | None = None,
                 config: dict | None = None, memory: bool = True) -> dict:
    """Step time (ms) per rank, loss, and each step's peak memory, one row each (x axes zoom
    together). The y range of the time row is set by the steady-state steps; the compile,
    profiling and re-compile steps (``special``, default :func:`special_steps`) are marked above
    it, each with its real time written out, so they neither flatten the chart nor vanish."""
    by_rank = steps if isinstance(steps, dict) else {0: list(steps)}
    by_rank = {r: [s for s in ss if isinstance(s, dict) and "step" in s] for r, ss in sorted(by_rank.items())}
    ref = next((ss for ss in by_rank.values() if ss), [])
    special = special if special is not None else special_steps(ref, config)
    has_loss = any(_fin(s.get("loss")) for ss in by_rank.values() for s in ss)
    peaks_b = [((s.get("mem") or {}).get("peak")) for ss in by_rank.values() for s in ss]
    has_mem = memory and any(_fin(v) and v > 0 for v in peaks_b)
    rows = ["time"] + (["loss"] if has_loss else []) + (["memory"] if has_mem else [])
    gap = 0.08
    h = (1 - gap * (len(rows) - 1)) / len(rows)
    layout: dict[str, Any] = {"height": 190 * len(rows) + 60, "margin": {"l": 75, "r": 20, "t": 30, "b": 40},
                              "hovermode": "x unified", "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom"},
                              "annotations": [], "shapes": []}
    data: list[dict] = []
    steady_max = 0.0
    for i, row in enumerate(rows):
        ax = "" if i == 0 else str(i + 1)
        top = 1 - i * (h + gap)
        layout["xaxis" + ax] = {"anchor": "y" + ax, "matches": "x" if i else None, "exponentformat": "none",
                                "showticklabels": i == len(rows) - 1, "title": {"text": "step"} if i == len(rows) - 1 else None,
                                "tickformat": "d", "dtick": _int_dtick(len(ref))}
        layout["yaxis" + ax] = {"domain": [max(0.0, top - h), top], "anchor": "x" + ax, "exponentformat": "none",
                                "rangemode": "tozero"}
    for j, (r, ss) in enumerate(by_rank.items()):
        color = RANK_COLORS[j % len(RANK_COLORS)]
        st = [s for s in ss if s["step"] not in special]
        times = [s["time_s"] * 1e3 if _fin(s.get("time_s")) else None for s in st]
        steady_max = max([steady_max] + [t for t in times if t is not None])
        data.append({"type": "scatter", "mode": "lines+markers", "x": [s["step"] for s in st], "y": times,
                     "name": f"rank {r} step time", "line": {"color": color, "width": 1.5}, "marker": {"size": 4},
                     "xaxis": "x", "yaxis": "y", "hovertemplate": "%{y:.1f} ms<extra>rank " + str(r) + "</extra>",
                     "meta": {"row": "time", "rank": r, "steady": True}})
        if has_loss and (j == 0 or len(by_rank) <= 8):
            k = rows.index("loss")
            ax = str(k + 1)
            data.append({"type": "scatter", "mode": "lines", "x": [s["step"] for s in ss],
                         "y": [s.get("loss") if _fin(s.get("loss")) else None for s in ss], "name": f"rank {r} loss",
                         "line": {"color": color, "width": 1.2}, "xaxis": "x" + ax, "yaxis": "y" + ax,
                         "showlegend": False, "hovertemplate": "loss %{y:.4f}<extra>rank " + str(r) + "</extra>",
                         "meta": {"row": "loss", "rank": r}})
        if has_mem:
            vals = [((s.get("mem") or {}).get("peak")) for s in ss]
            k = rows.index("memory")
            ax = str(k + 1)
            unit, div = byte_unit(max([v for v in peaks_b if _fin(v)] + [1]))
            data.append({"type": "scatter", "mode": "lines", "x": [s["step"] for s in ss],
                         "y": [v / div if _fin(v) else None for v in vals], "name": f"rank {r} peak",
                         "line": {"color": color, "width": 1.2, "dash": "dot"}, "xaxis": "x" + ax, "yaxis": "y" + ax,
                         "showlegend": False, "hovertemplate": "%{y:.1f} " + unit + "<extra>rank " + str(r) + "</extra>",
                         "meta": {"row": "memory", "rank": r, "unit": unit}})
            layout["yaxis" + ax]["title"] = {"text": f"peak ({unit})"}
            layout["yaxis" + ax]["ticksuffix"] = f" {unit}"
    layout["yaxis"]["title"] = {"text": "step time (ms)"}
    if has_loss:
        k = str(rows.index("loss") + 1)
        layout["yaxis" + k]["title"] = {"text": "loss"}
        layout["yaxis" + k]["rangemode"] = "normal"
    marked = [s for s in ref if s["step"] in special]
    if steady_max > 0:
        ceiling = steady_max * 1.35
        layout["yaxis"]["range"] = [0, ceiling]
        ys = [min(s["time_s"] * 1e3, ceiling * 0.97) if _fin(s.get("time_s")) else ceiling * 0.97 for s in marked]
    else:
        ys = [s["time_s"] * 1e3 if _fin(s.get("time_s")) else None for s in marked]
    if marked:
        txt = [f"step {s['step']}: {special[s['step']]} · {fmt_ms(s['time_s'] * 1e3) if _fin(s.get('time_s')) else '–'}"
               for s in marked]
        data.append({"type": "scatter", "mode": "markers", "x": [s["step"] for s in marked], "y": ys,
                     "name": "compile / profiling steps (off the scale)" if steady_max > 0 else "compile / profiling steps",
                     "marker": {"symbol": "triangle-up", "size": 11, "color": "#888"}, "text": txt,
                     "hovertemplate": "%{text}<extra></extra>", "xaxis": "x", "yaxis": "y",
                     "meta": {"row": "time", "special": {str(s['step']): special[s['step']] for s in marked}}})
        for s, y, t in zip(marked, ys, txt):
            layout["annotations"].append({"x": s["step"], "y": y, "xref": "x", "yref": "y", "text": t,
                                          "showarrow": True, "arrowhead": 0, "ax": 0, "ay": 22 if y else -20,
                                          "font": {"size": 10, "color": "#555"}, "bgcolor": "rgba(255,255,255,0.8)"})
    layout["meta"] = {"special": {str(k): v for k, v in special.items()}, "rows": rows}
    return {"data": data, "layout": layout}
