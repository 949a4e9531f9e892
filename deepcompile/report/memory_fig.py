"""The memory timeline of one step as a plotly figure dict: memory by category over time,
stacked, the peak marked and labelled measured or predicted, in MiB or GiB with the axis saying
which (:func:`memory_figure`); with the readers of a memory view it draws from (its samples, their
x axis, its peaks).
"""
from __future__ import annotations

from typing import Any

from deepcompile.report.schedule_fig import _exec_order, _graph_key, _src_index
from deepcompile.report.style import _EXTRA_COLORS, CATEGORY_COLORS, _fin, byte_unit
from deepcompile.vocab.memory import fmt_bytes


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
