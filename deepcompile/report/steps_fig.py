"""The run's steps as a plotly figure dict (:func:`steps_figure`): step times per rank, loss and
each step's peak memory, the compile and profiling steps marked as annotations above a y range
that the steady-state steps set (one 2 s compile step does not flatten 40 ms steps into a line at
the bottom).
"""
from __future__ import annotations

from typing import Any

from deepcompile.record.steps import special_steps
from deepcompile.report.style import _fin, byte_unit, fmt_ms


def _int_dtick(n: int) -> int:
    """A tick step of 1, 2 or 5 times a power of ten giving at most ~12 integer ticks over n steps."""
    k = 1
    while True:
        for m in (1, 2, 5):
            if n / (k * m) <= 12:
                return k * m
        k *= 10


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
