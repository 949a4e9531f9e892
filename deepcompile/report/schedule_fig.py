"""The schedule of one step as a plotly figure dict (``{"data": [...], "layout": {...}}``), and
the numbers read off the same events.

deepcompile does not import plotly: :func:`schedule_figure` builds the JSON that plotly.js draws
(the static report hands it to ``Plotly.newPlot``, the notebook widget to
``plotly.graph_objects.Figure``). It is a Perfetto-like schedule: one lane per rank and stream,
measured and predicted never in one lane (each source has its own subplot, its own y axis, the
two x axes zoom together), time in ms, hover with node name, duration and graph, every gather
linked from its issue to its wait (:func:`gather_links`).

The events are first put on one time base per source and rank (:func:`normalize`);
:func:`step_numbers` gives the three numbers that matter per step: exposed communication,
overlap, and idle (host-bound) time. The graph-order helpers here (:func:`_exec_order`,
:func:`_graph_key`, :func:`_src_index`) also order the memory figure's samples and peaks.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Iterable

from deepcompile.profile.trace import intersection_length, union
from deepcompile.report.style import fmt_ms, fmt_us

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
