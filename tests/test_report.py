"""The static HTML report: rendered from a real demo run, opened in headless Chromium."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from deepcompile.report import graph_layout as L
from deepcompile.report.html import render_report

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run"]


def test_report_is_self_contained(demo_run, tmp_path):
    out = render_report(demo_run, tmp_path / "report.html")
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text), "report must not load anything remote"
    assert "<script src" not in text and "<link" not in text
    assert text.count('class="graph') >= 5  # every version of every graph (dynamo, fwd x2, bwd x2)
    assert "allgather_param" in text and "reduce_grad" in text


def _levels(text: str) -> dict:
    m = re.search(r"<script type='application/json' id='dc-levels'>(.*?)</script>", text, re.S)
    assert m, "the report carries the levels inside its module boxes"
    return json.loads(m.group(1))


def _card(text: str, kind: str, after: str) -> tuple[str, int]:
    """(the picture of one version card, its index into the levels)."""
    m = re.search(rf"<div class='version' data-graph='0' data-kind='{kind}' data-after='{after}' "
                  rf"data-levels='(\d+)'>(.*?)<div class='dc-panels'>", text, re.S)
    assert m, (kind, after)
    return m.group(2), int(m.group(1))


def test_report_draws_the_inspectors_collapsed_view(demo_run, tmp_path):
    """The pictures are the inspector's collapsed view (graph_layout.module_levels, laid out per
    level): module boxes with op summaries and chips, no edge-count labels, no arrows to the
    inputs/outputs boxes; every module box (at every depth) opens to a pre-rendered level."""
    from deepcompile.record.reader import read_run

    if not L.have_dot():  # the order-based fallback draws other skeletons (test_fallback_layout_without_dot)
        pytest.skip("graphviz is not installed")
    out = render_report(demo_run, tmp_path / "report.html")
    text = out.read_text()
    svg, ref = _card(text, "forward", "zero3")
    assert 'id="group-blocks.0"' in svg and 'id="group-blocks.1"' in svg and 'id="group-inputs"' in svg
    # graphviz's layout writes id then class, the order-based fallback class then id
    assert re.search(r'<g (?=[^>]*\bid="group-blocks\.0")(?=[^>]*\bclass="[^"]*\bdc-openable\b)[^>]*>', svg)
    assert f"{L.FOLD_MARK} blocks.0 (" in svg and "allgather_param ×" in svg
    if 'class="graph dot ' in svg:   # graphviz: edges carry no count labels (pen width instead)
        assert not re.search(r'<g class="edge">(?:(?!</g>).)*<text', svg, re.S)
        assert "cluster" not in svg
    rec = read_run(demo_run)
    nodes = rec.versions(0, "forward")[-1].nodes
    top, inner = L.module_levels(nodes, L.param_scopes(rec.graphs))
    assert [b.key for b in top.boxes] == [g.key for g in L.collapse(nodes, None, L.param_scopes(rec.graphs)).groups]
    io = {i for i, b in enumerate(top.boxes) if b.key in ("inputs", "outputs")}
    assert top.edges and not any(a in io or b in io for a, b, _ in top.edges)

    D = _levels(text)
    levels = D["v"][ref]
    assert set(levels) == set(inner)            # every module box of this version, at every depth
    for b in top.boxes:
        assert b.key in levels
    # a level put back together from its skeleton and strings is the level's own picture
    for key in ("blocks.0", "blocks.1", "blocks.0.attn", "inputs"):   # blocks.1: drawn from blocks.0
        s_idx, texts, rel = levels[key][:3]
        keys = [key + r for r in rel]
        assert keys == [k for k in re.findall(r'id="group-([^"]*)"', L.nested_svg(inner[key], ""))]
        titles = levels[key][3] if len(levels[key]) > 3 else \
            [k + (" · click: open" if k in inner else "") for k in keys]
        want = L.level_skeleton(inner[key])
        assert (D["s"][s_idx], texts, titles, keys) == want
        again = L.fill_skeleton(D["s"][s_idx], texts, titles, keys)
        assert L.svg_skeleton(again)[1:] == want[1:]
    # every module box inside a level opens too (no dead boxes); node boxes do not claim to
    for key, (s_idx, _, rel, *_) in levels.items():
        skel = D["s"][s_idx]
        classes = re.findall(r'<g data-g="" class="([^"]*)"', skel)
        assert len(classes) == len(rel)
        for r, c in zip(rel, classes):
            assert ("dc-openable" in c) == ((key + r) in levels), (key, r)
    # identical layers share one picture skeleton
    assert levels["blocks.0"][0] == levels["blocks.1"][0]
    assert len(D["s"]) < sum(len(v) for v in D["v"])


def test_report_starts_graphviz_at_most_once_per_worker(demo_run, tmp_path, monkeypatch):
    """The bound on the report's layout work, stated structurally (no timing): all levels of all
    versions are laid out by at most ``workers`` graphviz processes, one per distinct level text."""
    import subprocess

    if not L.have_dot():
        pytest.skip("graphviz is not installed")
    calls = []
    real = subprocess.run

    def counting(cmd, *a, **kw):
        if cmd and cmd[0] == "dot":
            calls.append(cmd)
        return real(cmd, *a, **kw)

    monkeypatch.setattr(L.subprocess, "run", counting)
    L.LEVEL_CACHE.clear()
    out = render_report(demo_run, tmp_path / "report.html", workers=2)
    assert 1 <= len(calls) <= 2
    D = _levels(out.read_text())
    n_levels = sum(len(v) for v in D["v"])
    assert len(L.LEVEL_CACHE) < n_levels   # distinct structures only
    calls.clear()
    render_report(demo_run, tmp_path / "again.html", workers=2)
    assert calls == []                     # everything was laid out already


def test_fallback_layout_without_dot(demo_run, tmp_path, monkeypatch):
    monkeypatch.setattr(L, "have_dot", lambda: False)
    out = render_report(demo_run, tmp_path / "nodot.html")
    text = out.read_text()
    assert text.count('class="graph simple ') >= 5 and 'class="graph dot' not in text
    assert 'id="group-blocks.0"' in text and "dc-openable" in text
    D = _levels(text)
    _, ref = _card(text, "forward", "zero3")
    from deepcompile.record.reader import read_run

    rec = read_run(demo_run)
    _, inner = L.module_levels(rec.versions(0, "forward")[-1].nodes, L.param_scopes(rec.graphs))
    for key in ("blocks.0", "blocks.1", "blocks.0.attn"):   # blocks.1: drawn from blocks.0's skeleton
        s_idx, texts, rel = D["v"][ref][key][:3]
        want = L.level_skeleton(inner[key], use_dot=False)
        assert 'class="dc-level dc-simple"' in want[0]
        assert (D["s"][s_idx], texts, [key + r for r in rel]) == (want[0], want[1], want[3])


def test_collapse_groups_layers(demo_run):
    from deepcompile.record.reader import read_run

    rec = read_run(demo_run)
    ps = L.param_scopes(rec.graphs)
    fw = rec.versions(0, "forward")[-1]
    c = L.collapse(fw.nodes, None, ps)
    keys = [g.key for g in c.groups]
    assert "blocks.0" in keys and "blocks.1" in keys and not any(k.startswith("blocks.0.") for k in keys)
    b0 = c.groups[keys.index("blocks.0")]
    assert b0.comm["allgather_param"] > 0 and b0.comm["release_param"] == b0.comm["allgather_param"]
    assert sum(g.n_ops for g in c.groups) == len(fw.nodes)
    deeper = [g.key for g in L.collapse(fw.nodes, 3, ps).groups]
    assert "blocks.0.attn" in deeper


def _browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright)")
    exe = shutil.which("chromium") or (CHROMIUM if Path(CHROMIUM).exists() else None)
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    return sync_playwright, exe


def test_report_in_headless_chromium(demo_run, tmp_path):
    sync_playwright, exe = _browser()
    out = render_report(demo_run, tmp_path / "report.html")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            requests = []
            page.on("request", lambda r: requests.append(r.url))
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(out.as_uri())
            page.screenshot(path=str(tmp_path / "report.png"), full_page=False)
            assert (tmp_path / "report.png").stat().st_size > 10_000
            assert not errors, errors
            assert all(u.startswith("file:") for u in requests), requests
            assert page.locator("svg.graph").count() >= 5
            fw = page.locator(".version[data-kind='forward'][data-after='zero3'] svg.graph")
            assert fw.count() == 1 and fw.first.bounding_box()["height"] > 100
            assert page.locator("svg.timeline").count() >= 2  # forward and backward schedules
            assert page.locator("svg.timeline rect.ev").count() > 50
            assert page.locator("svg.chart.memory polyline.series").count() >= 2
            assert page.locator("svg.chart.loss polyline.series").count() == 1
            # sortable operator table: clicking "latency" sorts descending on the second click
            table = page.locator("table.ops").first
            th = table.locator("th", has_text="latency")
            th.click()
            th.click()
            vals = [float(v) for v in table.locator("tbody tr td:nth-child(6)").evaluate_all(
                "cells => cells.map(c => c.dataset.v)")]
            assert vals == sorted(vals, reverse=True) and len(vals) > 10
            # a module box opens (the level inside it below the picture), and opens further
            card = page.locator(".version[data-kind='forward'][data-after='zero3']")
            card.locator("[id='group-blocks.0']").first.click()
            panels = card.locator(".dc-panel")
            assert panels.count() == 1
            inner = panels.first.locator("[id='group-blocks.0.attn']")
            assert inner.count() == 1 and "dc-openable" in inner.get_attribute("class")
            assert inner.locator("title").text_content() == "blocks.0.attn · click: open"
            assert inner.locator("text").first.text_content().startswith("▸ attn (")
            assert card.locator("g.dc-open").count() == 1
            inner.click()
            assert panels.count() == 2
            assert panels.nth(1).locator("g.dc-box").count() > 3
            assert inner.locator("text").first.text_content().startswith("▾ attn (")
            inner.click()                                   # a second click folds it again
            assert panels.count() == 1
            panels.first.locator(".dc-close").click()
            assert panels.count() == 0 and card.locator("g.dc-open").count() == 0
            assert not errors, errors
            page.locator("#schedule").scroll_into_view_if_needed()
            page.screenshot(path=str(tmp_path / "schedule.png"))
        finally:
            browser.close()
