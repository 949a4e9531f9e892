"""Every module's level of a graph, pre-rendered for the static report.

The static report draws the inspector's collapsed view (the top level of
:func:`~deepcompile.report.level_layout.nested_svg`) and, for every module box, the level inside it,
pre-rendered so that a click can show it without a kernel (:func:`module_levels`). Identical
decoder layers have identical levels (the same graphviz text, so one layout, made ahead in a few
``dot`` processes by :func:`prelayout`); their pictures differ only in their strings, so a picture
is stored once as a *skeleton* (:func:`svg_skeleton`, :func:`level_skeleton`: every text, tooltip
and box id emptied) plus each instance's strings (:func:`fill_skeleton` puts them back).
"""
from __future__ import annotations

import html
import re
import subprocess
from collections import Counter
from typing import Iterable

from deepcompile.plan.estimate import comm_kind, inputs_of
from deepcompile.report import level_layout
from deepcompile.report.graph_groups import (COMPUTE_COLOR, IO_COLOR, Group, _short, comm_color, module_box_lines,
                                             scope_chains)
from deepcompile.report.level_layout import (LEVEL_CACHE, LEVEL_DOT_MAX_BOXES, LEVEL_DOT_MAX_ELEMENTS, Box, Level,
                                             _box_texts, _clean_level_svg, _run_dot, level_dot, nested_svg)


def module_levels(nodes: list[dict], pscopes: dict | None = None, depth: int | None = None, *,
                  hint: str = "click: open") -> tuple[Level, dict[str, Level]]:
    """The collapsed top level of a graph (the inspector's collapsed view: one box per module with
    its op summary and communication chips, edge counts as pen width, no edges to the
    inputs/outputs boxes) and, for every module box at any depth, the level inside it (its
    sub-modules and its own nodes, one box each), keyed by the box's key. Module boxes carry the
    ``dc-openable`` class, :data:`FOLD_MARK` and the tooltip ``<key> · <hint>``; a node's box
    (``<module>/<node name>``: name and short target) has its key as its tooltip."""
    chains, inferred = scope_chains(nodes, pscopes, depth)
    kinds = [comm_kind(n) for n in nodes]
    shorts = [_short(n["target"]) for n in nodes]
    at = {n["name"]: i for i, n in enumerate(nodes)}
    ins = [[at[r] for r in inputs_of(n) if r in at] for n in nodes]
    inner: dict[str, Level] = {}

    def build(idxs: list[int], d: int, parent: str | None) -> Level:
        groups: dict[str, Group] = {}
        gof: dict[int, int] = {}
        for i in idxs:   # Group.node_indices: indices into ``nodes``
            k = chains[i][d]
            g = groups.get(k)
            if g is None:
                g = groups[k] = Group(k, len(groups))
            g.node_indices.append(i)
            g.inferred += inferred[i] and "/" not in k
            gof[i] = g.index
            if kinds[i] is not None:
                g.comm[kinds[i]] += 1
            elif nodes[i]["op"] not in ("placeholder", "get_attr", "output"):
                g.ops[shorts[i]] += 1
        counts: Counter = Counter()
        for i in idxs:
            dst = gof[i]
            for j in ins[i]:
                src = gof.get(j)
                if src is not None and src != dst:
                    counts[(src, dst)] += 1
        boxes = []
        for g in groups.values():
            mem = g.node_indices
            rel = g.key if parent is None else g.key[len(parent) + 1:]
            if len(chains[mem[0]]) == d + 1:   # one node's own box
                n, ck = nodes[mem[0]], kinds[mem[0]]
                fill = comm_color(ck) if ck else (IO_COLOR if n["op"] in ("placeholder", "get_attr", "output")
                                                  else COMPUTE_COLOR)
                boxes.append(Box(g.key, [rel, shorts[mem[0]]], fill, [], None, [], None, g.key))
                continue
            lines = module_box_lines(g, rel)
            boxes.append(Box(g.key, lines, IO_COLOR if g.is_io else COMPUTE_COLOR, sorted(g.comm.items()), None,
                             ["dc-openable"], None, f"{g.key} · {hint}"))
            inner[g.key] = build(mem, d + 1, g.key)
        io = {g.index for g in groups.values() if g.is_io}
        return Level(boxes, [(a, b, n) for (a, b), n in counts.items() if a not in io and b not in io])

    return build(list(range(len(nodes))), 0, None), inner


def _dot_sized(level: Level) -> bool:
    """Whether :func:`nested_level_svg` gives ``level`` to graphviz (when installed)."""
    return len(level.boxes) <= LEVEL_DOT_MAX_BOXES and len(level.boxes) + len(level.edges) <= LEVEL_DOT_MAX_ELEMENTS


def _flat_text(level: Level) -> str:
    """``level_dot(level, {})`` of a flat level, kept on the level (levels built for a static
    picture are not changed after they are built)."""
    t = level.__dict__.get("_dc_text")
    if t is None:
        t = level.__dict__["_dc_text"] = level_dot(level, {})
    return t


def prelayout(levels: Iterable[Level], workers: int = 1, timeout: float = 600.0) -> int:
    """Lay out with graphviz, ahead of :func:`nested_level_svg`, every flat level (no open box
    inside) that it would give to graphviz and that :data:`LEVEL_CACHE` does not hold: the distinct
    texts only, all of them in at most ``workers`` ``dot`` processes (many graphs in one input:
    graphviz starts once, not once per level). Returns the number of layouts made."""
    if not level_layout.have_dot():   # read through its module: one switch for every picture
        return 0
    texts, seen = [], set()
    for lv in levels:
        if any(b.child is not None for b in lv.boxes) or not _dot_sized(lv):
            continue
        t = _flat_text(lv)
        if t not in seen and t not in LEVEL_CACHE:
            seen.add(t)
            texts.append(t)
    if not texts:
        return 0
    n = max(1, min(workers, len(texts)))
    chunks: list[list[str]] = [[] for _ in range(n)]
    load = [0] * n
    for t in sorted(texts, key=len, reverse=True):   # about equal work per process
        k = load.index(min(load))
        chunks[k].append(t)
        load[k] += len(t)

    def run(chunk: list[str]) -> int:
        docs: list[str] = []
        try:
            r = subprocess.run(["dot", "-Tsvg"], input="\n".join(chunk).encode(), capture_output=True,
                               timeout=timeout, check=True)
            docs = [d + "</svg>" for d in r.stdout.decode("utf-8", errors="replace").split("</svg>")[:-1]]
        except (OSError, subprocess.SubprocessError):
            pass
        if len(docs) != len(chunk):   # one graph failed: lay them out one by one
            return sum(_run_dot(t) is not None for t in chunk)
        made = 0
        for t, d in zip(chunk, docs):
            svg = _clean_level_svg(d)
            if svg is not None:
                LEVEL_CACHE.put(t, svg)
                made += 1
        return made

    if n == 1:
        return run(chunks[0])
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as ex:
        return sum(ex.map(run, chunks))


_SKELETON = re.compile(r'(<text\b[^>]*>)(.*?)</text>|<title>(.*?)</title>| id="group-([^"]*)"', re.S)


def svg_skeleton(svg: str) -> tuple[str, list[str], list[str], list[str]]:
    """``(skeleton, texts, tooltips, box keys)``: ``svg`` with every ``<text>`` and ``<title>``
    emptied and every box's ``id="group-<key>"`` replaced by ``data-g=""``, and the strings taken
    out, in document order. :func:`fill_skeleton` (or the report's script) puts them back."""
    texts: list[str] = []
    titles: list[str] = []
    keys: list[str] = []

    def sub(m: re.Match) -> str:
        if m.group(1) is not None:
            texts.append(html.unescape(m.group(2)))
            return m.group(1) + "</text>"
        if m.group(3) is not None:
            titles.append(html.unescape(m.group(3)))
            return "<title></title>"
        keys.append(html.unescape(m.group(4)))
        return ' data-g=""'

    return _SKELETON.sub(sub, svg), texts, titles, keys


def fill_skeleton(skeleton: str, texts: list[str], titles: list[str], keys: list[str]) -> str:
    """The inverse of :func:`svg_skeleton` (strings escaped as HTML text)."""
    it_t, it_h, it_k = iter(texts), iter(titles), iter(keys)
    e = lambda s: html.escape(s, quote=False)  # noqa: E731
    out = re.sub(r"(<text\b[^>]*>)</text>", lambda m: m.group(1) + e(next(it_t)) + "</text>", skeleton)
    out = out.replace("<title></title>", "\0")
    out = re.sub("\0", lambda m: f"<title>{e(next(it_h))}</title>", out)
    return re.sub(' data-g=""', lambda m: f' id="group-{html.escape(next(it_k))}"', out)


def level_skeleton(level: Level, *, use_dot: bool = True, cls: str = "graph dc-graph dc-level-picture",
                   cache: dict | None = None) -> tuple[str, list[str], list[str], list[str]]:
    """:func:`svg_skeleton` of the picture of a flat ``level`` (:func:`nested_svg` without a title),
    the skeleton without whitespace between elements and without graphviz's per-text font.

    With ``cache`` (a dict kept by the caller), a level whose picture is known to look like one
    drawn before is not drawn again: the skeleton of the first serves every later one and the
    strings come from the boxes themselves. graphviz's picture depends only on the level's text
    (labels with digits as zeros; texts are centred after layout) and the boxes' colours and
    classes; the order-based picture (:func:`_simple_level`) only on the boxes' numbers of lines,
    chip label lengths, colours and classes, and the edges. The first picture of a kind is checked
    against its boxes before it is reused."""
    sig, simple = None, False
    if cache is not None and all(b.child is None for b in level.boxes):
        style = tuple((b.fill, b.stroke, tuple(b.classes)) for b in level.boxes)
        if use_dot and _dot_sized(level):
            text = _flat_text(level)
            if text in LEVEL_CACHE:   # graphviz's layout (so graphviz is installed)
                sig = ("dot", text, cls, style)
        else:                         # nested_level_svg draws it with the order-based layout
            simple = True
            sig = ("simple", cls, style, tuple(level.edges),
                   tuple((sum(1 for ln in b.lines if ln), tuple(len(f"{k} ×{n}") for k, n in b.chips))
                         for b in level.boxes))
        hit = cache.get(sig) if sig is not None else None
        if hit is not None:
            skel, order = hit
            bs = [level.boxes[i] for i in order]
            return (skel, [""] + [t for b in bs for t in _box_texts(b)], [b.tooltip or b.key for b in bs],
                    [b.key for b in bs])
    svg = nested_svg(level, "", use_dot=use_dot, cls=cls)
    skel, texts, titles, keys = svg_skeleton(svg)
    # smaller: no whitespace between elements (every text is out) and no per-text font (the
    # outer element's font-family is Helvetica too)
    skel = re.sub(r">\s+<", "><", skel).replace(' font-family="Helvetica,sans-Serif"', "")
    if sig is not None and ('class="dc-level dc-simple"' in svg) == simple:   # drawn the way the key says
        pos = {b.key: i for i, b in enumerate(level.boxes)}
        order = [pos.get(k, -1) for k in keys]
        if -1 not in order and len(set(order)) == len(level.boxes) == len(order):
            bs = [level.boxes[i] for i in order]
            if texts == [""] + [t for b in bs for t in _box_texts(b)] and titles == [b.tooltip or b.key for b in bs]:
                cache[sig] = (skel, order)
    return skel, texts, titles, keys
