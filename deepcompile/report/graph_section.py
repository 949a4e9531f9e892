"""The report's Graphs section: every graph id and kind once, with the versions of its latest
compile (an earlier compile's graph is described only where it differs: :func:`compiles`,
:func:`_compile_diff`), the graph before and after each pass, collapsed by module scope as the
inspector's collapsed view draws it (one box per module with op counts and communication chips,
edge counts as pen width, no arrows to the inputs/outputs boxes; graphviz ``dot`` per level when
installed, else the order-based layout), with what each pass changed.

Every module box opens on a click (the report's inline script, no kernel): the level inside it,
pre-rendered, shows below the picture and its module boxes open further. The levels are stored
once per distinct structure (a skeleton: identical decoder layers share one) plus each level's
strings, and graphviz lays out each distinct level once, all of them in at most ``workers``
processes (:func:`_graph_pictures`).
"""
from __future__ import annotations

import html
import json
from collections import defaultdict

from deepcompile.record.reader import RunRecord
from deepcompile.report import level_layout
from deepcompile.report.graph_groups import COMM_COLORS, COMPUTE_COLOR, FOLD_MARK, IO_COLOR, diff, param_scopes
from deepcompile.report.level_layout import nested_svg
from deepcompile.report.module_pictures import level_skeleton, module_levels, prelayout
from deepcompile.report.style import fmt_us

esc = html.escape


def _legend() -> str:
    items = [("compute ops", COMPUTE_COLOR), ("inputs/outputs", IO_COLOR)] + \
        [(k, v) for k, v in COMM_COLORS.items()]
    return "<div class='legend'>" + "".join(
        f"<span><i style='background:{c}'></i>{esc(k)}</span>" for k, c in items) + "</div>"


GRAPH_HINT = "click: open"


def _graph_pictures(jobs: list, pscopes: dict, depth: int | None,
                    workers: int) -> tuple[list[str], list[int], str]:
    """(the collapsed picture of every job's version, the index of its levels in the script, the
    ``<script>`` with the levels inside every module box).

    A version equal to an earlier one (a recompile that gave the same graph) shares its levels and
    picture. Every level of every distinct version is built first, then graphviz lays out the
    distinct ones in ``workers`` processes (:func:`module_pictures.prelayout`), then each is drawn
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
            distinct.append((v.nodes, module_levels(v.nodes, pscopes, depth, hint=GRAPH_HINT)))
        refs.append(k)
    dot = level_layout.have_dot()   # read through its module: one switch for every picture
    if dot:
        prelayout((lv for _, (top, inner) in distinct for lv in (top, *inner.values())), workers)
    pictures, drawn = [], {}
    for (gid, kind, _, v, _), k in zip(jobs, refs):
        title = f"graph {gid} · {kind} · {'input' if v.after == 'input' else 'after ' + v.after}"
        svg = drawn.get((k, title))
        if svg is None:
            svg = drawn[(k, title)] = nested_svg(distinct[k][1][0], title, use_dot=dot)
            if 'class="dc-level dc-simple"' in svg[:2000]:   # too big for graphviz, or no graphviz
                svg = drawn[(k, title)] = svg.replace('class="graph dot ', 'class="graph simple ', 1)
        pictures.append(svg)
    skeletons: dict[str, int] = {}
    sig_cache: dict = {}
    per_version = []
    for _, (_, inner) in distinct:
        d = {}
        for key, lv in inner.items():
            skel, texts, titles, keys = level_skeleton(lv, use_dot=dot, cache=sig_cache)
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


def compiles(versions: list) -> list[list]:
    """The versions of one (graph_id, kind) split per compile: each compile starts at ``input``."""
    out: list[list] = []
    for v in versions:
        if v.after == "input" or not out:
            out.append([])
        out[-1].append(v)
    return out


def _compile_diff(chains: list[list]) -> str:
    """A line per earlier compile whose final graph differs from the latest one's; nothing when
    every compile gave the same graph."""
    if len(chains) < 2:
        return ""
    last = chains[-1][-1]
    lines = []
    for k, ch in enumerate(chains[:-1], start=1):
        v = ch[-1]
        passes = " → ".join(x.after for x in ch[1:]) or "no passes"
        if v.nodes == last.nodes:
            continue
        df = diff(v.nodes, last.nodes)
        comm = ", ".join(f"{c} +{n}" for c, n in sorted(df["comm_added"].items()))
        lines.append(f"<div class='diff compile-diff'>compile {k} of {len(chains)} ({esc(passes)}) → the latest: "
                     f"{df['before']} → {df['after']} nodes, +{df['added']} / −{df['removed']}"
                     f"{'; comm: ' + esc(comm) if comm else ''}</div>")
    same = len(chains) - 1 - len(lines)
    head = (f"<div class='note'>compiled {len(chains)} times; shown: the latest compile"
            + (f" ({same} earlier compile(s) gave the same graph)" if same else "") + "</div>")
    return head + "".join(lines)


def _section_graphs(rec: RunRecord, depth: int | None, workers: int) -> str:
    pscopes = param_scopes(rec.graphs)
    jobs, chains_of = [], {}
    for gid in rec.graph_ids:
        for kind in rec.kinds(gid):
            chains = compiles(rec.versions(gid, kind))
            chains_of[(gid, kind)] = chains
            vs = chains[-1]      # each graph once: the latest compile's passes
            for i, v in enumerate(vs):
                jobs.append((gid, kind, i, v, vs[i - 1] if i else None))
    svgs, refs, levels_script = _graph_pictures(jobs, pscopes, depth, workers)
    out = ["<section id='graphs'><h2>Graphs</h2>",
           "<p class='note'>Each graph once, with the passes of its latest compile (an earlier compile is "
           "described only where its graph differs). Each picture is the graph collapsed by module scope (one box "
           "per module, to the first ModuleList index, with its op counts; communication ops as coloured chips; a "
           "thicker arrow carries more tensors; the inputs and outputs boxes are drawn without their arrows). "
           "Backward nodes without a scope are placed with the layer they follow in graph order. Click a "
           f"{FOLD_MARK} box to open it: the boxes inside it (sub-modules and single nodes) show below the picture, "
           "where a module opens further; click it again or <i>close</i> to fold it.</p>", _legend()]
    by: dict[tuple[int, str], list] = defaultdict(list)
    for ref, job, svg in zip(refs, jobs, svgs):
        by[(job[0], job[1])].append((ref, job, svg))
    for (gid, kind), items in by.items():
        out.append(f"<h3 id='graph-{gid}-{kind}'>graph {gid} · {esc(kind)}</h3>"
                   + _compile_diff(chains_of[(gid, kind)]) + "<div class='versions'>")
        for ref, (_, _, i, v, prev), svg in items:
            head = "input" if v.after == "input" else f"after {esc(v.after)}"
            d = ""
            if prev is not None:
                df = diff(prev.nodes, v.nodes)
                comm = ", ".join(f"{k} +{n}" for k, n in sorted(df["comm_added"].items()))
                d = (f"<div class='diff'>{df['before']} → {df['after']} nodes: +{df['added']} / "
                     f"−{df['removed']}{'; comm: ' + esc(comm) if comm else ''}; {fmt_us(v.seconds * 1e6)}</div>")
            notes = "".join(f"<div class='note'>{esc(n)}</div>" for n in v.notes)
            out.append(f"<div class='version' data-graph='{gid}' data-kind='{esc(kind)}' data-after='{esc(v.after)}' "
                       f"data-levels='{ref}'><h4>{head} ({len(v.nodes)} nodes)</h4>{d}{notes}{svg}"
                       "<div class='dc-panels'></div></div>")
        out.append("</div>")
    if not jobs:
        out.append("<p class='empty'>no graphs recorded</p>")
    out.append(levels_script + "</section>")
    return "".join(out)
