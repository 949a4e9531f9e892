"""The static HTML report: rendered from a real demo run, opened in headless Chromium."""
from __future__ import annotations

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


def test_fallback_layout_without_dot(demo_run, tmp_path, monkeypatch):
    monkeypatch.setattr(L, "have_dot", lambda: False)
    out = render_report(demo_run, tmp_path / "nodot.html")
    text = out.read_text()
    assert text.count('class="graph simple"') >= 5 and 'class="graph dot"' not in text


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
            page.locator("#schedule").scroll_into_view_if_needed()
            page.screenshot(path=str(tmp_path / "schedule.png"))
        finally:
            browser.close()
