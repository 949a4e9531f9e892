"""The static HTML report: rendered from a real demo run, opened in headless Chromium."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from deepcompile.record.steps import special_steps, steady_median_ms
from deepcompile.report import html as H
from deepcompile.report import level_layout
from deepcompile.report.graph_groups import FOLD_MARK, collapse, param_scopes
from deepcompile.report.graph_section import _compile_diff, compiles
from deepcompile.report.html import render_report
from deepcompile.report.level_layout import LEVEL_CACHE, nested_svg
from deepcompile.report.module_pictures import fill_skeleton, level_skeleton, module_levels, svg_skeleton
from deepcompile.report.plotly_embed import plotly_js

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run"]


def _without_plotly_lib(text: str) -> str:
    """The page minus the inlined plotly.min.js (whose own text names URLs it never loads here)."""
    js = plotly_js()
    return text.replace(js, "") if js else text


def test_report_is_self_contained(demo_run, tmp_path):
    out = render_report(demo_run, tmp_path / "report.html")
    text = out.read_bytes().decode("utf-8")   # as written: read_text would translate the library's \r
    assert text.startswith("<!DOCTYPE html>")
    assert plotly_js() is not None and plotly_js()[:200] in text, "plotly.min.js is inlined"
    page = _without_plotly_lib(text)
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "report must not load anything remote"
    assert "<script src" not in text and "<link" not in text
    assert "cdn.plot.ly" not in page
    assert text.count('class="graph') >= 5  # every version of every graph (dynamo, fwd x2, bwd x2)
    assert "allgather_param" in text and "reduce_grad" in text
    # the hand-drawn charts are gone: the charts are plotly figures
    assert "svg class=\"timeline" not in text and "svg class=\"chart" not in text
    assert {"steps", "schedule", "memory"} <= set(re.findall(r"class='plotly-fig (\w+)'", text))
    visible = re.sub(r"data-v='[^']*'", "", page.split("<script type='application/json' id='dc-figs'>")[0])
    assert not re.search(r"\d\.?\d*e[+-]\d", visible), "no scientific notation in the page's text"


def test_report_without_plotly_says_so_and_keeps_the_tables(demo_run, tmp_path, monkeypatch):
    monkeypatch.setattr(H, "plotly_js", lambda: None)
    text = render_report(demo_run, tmp_path / "noplotly.html").read_text()
    assert "plotly is not installed" in text and "pip install plotly" in text
    assert "Plotly.newPlot" not in text and "id='dc-figs'" not in text
    assert "table class='sortable ops'" in text and "table class='numbers'" in text
    assert "table class='sortable steps'" in text


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
    """The pictures are the inspector's collapsed view (module_pictures.module_levels, laid out per
    level): module boxes with op summaries and chips, no edge-count labels, no arrows to the
    inputs/outputs boxes; every module box (at every depth) opens to a pre-rendered level."""
    from deepcompile.record.reader import read_run

    if not level_layout.have_dot():  # the order-based fallback draws other skeletons (test_fallback_layout_without_dot)
        pytest.skip("graphviz is not installed")
    out = render_report(demo_run, tmp_path / "report.html")
    text = out.read_text()
    svg, ref = _card(text, "forward", "zero3")
    assert 'id="group-blocks.0"' in svg and 'id="group-blocks.1"' in svg and 'id="group-inputs"' in svg
    # graphviz's layout writes id then class, the order-based fallback class then id
    assert re.search(r'<g (?=[^>]*\bid="group-blocks\.0")(?=[^>]*\bclass="[^"]*\bdc-openable\b)[^>]*>', svg)
    assert f"{FOLD_MARK} blocks.0 (" in svg and "allgather_param ×" in svg
    if 'class="graph dot ' in svg:   # graphviz: edges carry no count labels (pen width instead)
        assert not re.search(r'<g class="edge">(?:(?!</g>).)*<text', svg, re.S)
        assert "cluster" not in svg
    rec = read_run(demo_run)
    nodes = rec.versions(0, "forward")[-1].nodes
    top, inner = module_levels(nodes, param_scopes(rec.graphs))
    assert [b.key for b in top.boxes] == [g.key for g in collapse(nodes, None, param_scopes(rec.graphs)).groups]
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
        assert keys == [k for k in re.findall(r'id="group-([^"]*)"', nested_svg(inner[key], ""))]
        titles = levels[key][3] if len(levels[key]) > 3 else \
            [k + (" · click: open" if k in inner else "") for k in keys]
        want = level_skeleton(inner[key])
        assert (D["s"][s_idx], texts, titles, keys) == want
        again = fill_skeleton(D["s"][s_idx], texts, titles, keys)
        assert svg_skeleton(again)[1:] == want[1:]
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

    if not level_layout.have_dot():
        pytest.skip("graphviz is not installed")
    calls = []
    real = subprocess.run

    def counting(cmd, *a, **kw):
        if cmd and cmd[0] == "dot":
            calls.append(cmd)
        return real(cmd, *a, **kw)

    monkeypatch.setattr(subprocess, "run", counting)
    LEVEL_CACHE.clear()
    out = render_report(demo_run, tmp_path / "report.html", workers=2)
    assert 1 <= len(calls) <= 2
    D = _levels(out.read_text())
    n_levels = sum(len(v) for v in D["v"])
    assert len(LEVEL_CACHE) < n_levels   # distinct structures only
    calls.clear()
    render_report(demo_run, tmp_path / "again.html", workers=2)
    assert calls == []                     # everything was laid out already


def test_fallback_layout_without_dot(demo_run, tmp_path, monkeypatch):
    monkeypatch.setattr(level_layout, "have_dot", lambda: False)
    out = render_report(demo_run, tmp_path / "nodot.html")
    text = out.read_text()
    assert text.count('class="graph simple ') >= 5 and 'class="graph dot' not in text
    assert 'id="group-blocks.0"' in text and "dc-openable" in text
    D = _levels(text)
    _, ref = _card(text, "forward", "zero3")
    from deepcompile.record.reader import read_run

    rec = read_run(demo_run)
    _, inner = module_levels(rec.versions(0, "forward")[-1].nodes, param_scopes(rec.graphs))
    for key in ("blocks.0", "blocks.1", "blocks.0.attn"):   # blocks.1: drawn from blocks.0's skeleton
        s_idx, texts, rel = D["v"][ref][key][:3]
        want = level_skeleton(inner[key], use_dot=False)
        assert 'class="dc-level dc-simple"' in want[0]
        assert (D["s"][s_idx], texts, [key + r for r in rel]) == (want[0], want[1], want[3])


def test_collapse_groups_layers(demo_run):
    from deepcompile.record.reader import read_run

    rec = read_run(demo_run)
    ps = param_scopes(rec.graphs)
    fw = rec.versions(0, "forward")[-1]
    c = collapse(fw.nodes, None, ps)
    keys = [g.key for g in c.groups]
    assert "blocks.0" in keys and "blocks.1" in keys and not any(k.startswith("blocks.0.") for k in keys)
    b0 = c.groups[keys.index("blocks.0")]
    assert b0.comm["allgather_param"] > 0 and b0.comm["release_param"] == b0.comm["allgather_param"]
    assert sum(g.n_ops for g in c.groups) == len(fw.nodes)
    deeper = [g.key for g in collapse(fw.nodes, 3, ps).groups]
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


def _offline_page(browser, requests: list):
    """A page that can reach nothing but file: URLs (every other request is aborted, and the
    context is offline): what a report opened with no network sees."""
    ctx = browser.new_context(viewport={"width": 1300, "height": 900}, offline=True)

    def route(r):
        requests.append(r.request.url)
        return r.continue_() if r.request.url.startswith("file:") else r.abort()

    ctx.route("**/*", route)
    return ctx.new_page()


PLOTS_JS = """() => Array.from(document.querySelectorAll('.plotly-fig')).map(d => ({
    cls: d.className, traces: (d.data || []).length,
    bars: (d.data || []).filter(t => t.type === 'bar' && (t.x || []).length > 0).length,
    drawn: d.querySelectorAll('g.trace').length}))"""


def test_report_in_headless_chromium(demo_run, tmp_path):
    sync_playwright, exe = _browser()
    out = render_report(demo_run, tmp_path / "report.html")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=ARGS)
        try:
            requests = []
            page = _offline_page(browser, requests)
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(out.as_uri())
            page.wait_for_function("() => window.Plotly && document.querySelectorAll('.plotly-fig .main-svg').length >= 3",
                                   timeout=60_000)
            page.screenshot(path=str(tmp_path / "report.png"), full_page=False)
            assert (tmp_path / "report.png").stat().st_size > 10_000
            assert not errors, errors
            assert requests and all(u.startswith("file:") for u in requests), requests
            # the plotly timelines rendered offline, with data traces
            plots = page.evaluate(PLOTS_JS)
            by = {p_["cls"].split()[1]: p_ for p_ in plots}
            assert {"steps", "schedule", "memory"} <= set(by), plots
            assert all(p_["traces"] > 0 and p_["drawn"] > 0 for p_ in plots), plots
            assert by["schedule"]["bars"] >= 4
            sched = page.locator(".plotly-fig.schedule")
            assert sched.locator("g.trace.bars path").count() > 50
            # measured and predicted are separate panels that zoom together
            layout = page.evaluate("() => { const d = document.querySelector('.plotly-fig.schedule');"
                                   "return {y: d.layout.yaxis.title.text, y2: (d.layout.yaxis2 || {}).title, "
                                   "m: (d.layout.xaxis2 || {}).matches}; }")
            assert layout["y"] == "measured" and layout["y2"]["text"] == "predicted" and layout["m"] == "x", layout
            rng = page.evaluate("""async () => { const d = document.querySelector('.plotly-fig.schedule');
                await Plotly.relayout(d, {'xaxis.range': [1, 2]});
                return [d._fullLayout.xaxis.range, d._fullLayout.xaxis2.range]; }""")
            assert rng[0] == [1, 2] and rng[1] == [1, 2], rng
            # hover text names the node, its duration in µs or ms, and its graph
            cd = page.evaluate("() => document.querySelector('.plotly-fig.schedule').data[0].customdata[0]")
            assert re.fullmatch(r"[\d.]+ (µs|ms)", cd[1]) and cd[2].startswith("graph "), cd
            mem_axis = page.evaluate("() => document.querySelector('.plotly-fig.memory').layout.yaxis.title.text")
            assert mem_axis in ("MiB", "GiB")
            assert page.locator(".plotly-fig.schedule .annotation-text", has_text="exposed comm").count() >= 1
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
            assert all(u.startswith("file:") for u in requests), requests
        finally:
            browser.close()


# --------------------------------------------------------------------------- the figures, by hand
def _ev(node, stream, a_ms, b_ms, source="measured", kind="forward", rank=0, gid=0):
    return {"graph_id": gid, "kind": kind, "node": node, "stream": stream, "start_us": a_ms * 1e3,
            "end_us": b_ms * 1e3, "source": source, "rank": rank}


HAND = [
    _ev("mm", "compute", 0, 10), _ev("allgather_param_1", "allgather", 5, 25),
    _ev("wait_allgather_1", "compute", 10, 20),          # blocked: not compute
    _ev("mm_1", "compute", 20, 30), _ev("mm_2", "compute", 40, 50, kind="backward"),
    _ev("reduce_grad_1", "reduce", 45, 48, kind="backward"),
    # the cost model times each graph from 0: laid end to end (forward, then backward)
    _ev("mm", "compute", 0, 0.5, "predicted"), _ev("allgather_param_1", "allgather", 0, 1, "predicted"),
    _ev("wait_allgather_1", "compute", 0.5, 1, "predicted"), _ev("mm_1", "compute", 1, 4, "predicted"),
    _ev("mm_2", "compute", 0, 2, "predicted", "backward"),
]
GRAPHS = {(0, "forward"): [{"name": "allgather_param_1", "op": "call_function", "target": "dc.allgather_param",
                            "args": [{"node": "p"}, 1]},
                           {"name": "wait_allgather_1", "op": "call_function", "target": "dc.wait_allgather",
                            "args": [{"node": "allgather_param_1"}, 1]}]}


def test_step_numbers_by_hand():
    from deepcompile.report.schedule_fig import step_numbers

    n = {x["source"]: x for x in step_numbers(HAND)}
    m = n["measured"]
    assert m["step_ms"] == pytest.approx(50)
    assert m["compute_ms"] == pytest.approx(30)              # the wait is not compute
    assert m["comm_ms"] == pytest.approx(23)                 # 5..25 and 45..48
    assert m["overlap_ms"] == pytest.approx(5 + 5 + 3)       # 5..10, 20..25, 45..48
    assert m["exposed_comm_ms"] == pytest.approx(10)         # 10..20: only the gather runs
    assert m["idle_ms"] == pytest.approx(10)                 # 30..40: nothing runs
    p = n["predicted"]
    assert p["step_ms"] == pytest.approx(6)                  # forward 0..4, backward 4..6
    assert p["exposed_comm_ms"] == pytest.approx(0.5) and p["overlap_ms"] == pytest.approx(0.5)
    assert p["idle_ms"] == pytest.approx(0)


def test_host_launch_span_is_idle_not_device_work(tmp_path):
    """The cost model's 'host' event (a host-bound graph: kernels wait for their launches) spans
    the graph; the device is idle where no device stream runs, and the record accepts it (a GPU
    demo's predicted schedule carries one: the schema refused the stream once)."""
    from deepcompile.record.schema import check_schedule
    from deepcompile.report.schedule_fig import step_numbers

    evs = [_ev("mm", "compute", 0, 2, "predicted"), _ev("mm_1", "compute", 6, 8, "predicted"),
           _ev("host launches", "host", 0, 8, "predicted")]
    p = step_numbers(evs)[0]
    assert p["step_ms"] == pytest.approx(8) and p["idle_ms"] == pytest.approx(4)
    check_schedule(str(tmp_path / "schedule.json.gz"), {"events": evs})


def test_schedule_figure_lanes_never_mix_sources_and_are_in_ms():
    from deepcompile.report.schedule_fig import schedule_figure
    from deepcompile.report.style import figure_json

    evs = HAND + [dict(e, rank=1) for e in HAND]
    fig = schedule_figure(evs, graphs=GRAPHS)
    json.loads(figure_json(fig))
    bars = [t for t in fig["data"] if t["type"] == "bar"]
    axis_source: dict[str, set] = {}
    for t in bars:
        axis_source.setdefault(t["yaxis"], set()).add(t["meta"]["source"])
        assert set(t["y"]) == {f"rank {t['meta']['rank']} · {t['meta']['stream']}"}
    assert all(len(v) == 1 for v in axis_source.values()), axis_source
    assert axis_source == {"y": {"measured"}, "y2": {"predicted"}}
    lay = fig["layout"]
    assert lay["yaxis"]["title"]["text"] == "measured" and lay["yaxis2"]["title"]["text"] == "predicted"
    assert lay["xaxis2"]["matches"] == "x" and "ms" in lay["xaxis2"]["title"]["text"]
    assert lay["yaxis"]["categoryarray"][::-1] == ["rank 0 · compute", "rank 0 · allgather", "rank 0 · reduce",
                                                   "rank 1 · compute", "rank 1 · allgather", "rank 1 · reduce"]
    # x in ms: the 5..25 ms gather is base 5, width 20; hover in ms
    ag = next(t for t in bars if t["meta"] == {"source": "measured", "rank": 0, "stream": "allgather", "wait": False})
    assert ag["base"] == [5] and ag["x"] == [20] and ag["customdata"][0][:4] == [
        "allgather_param_1", "20.00 ms", "graph 0 · forward", "5.00 ms"]
    wait = next(t for t in bars if t["meta"]["wait"] and t["meta"]["source"] == "measured" and t["meta"]["rank"] == 0)
    assert wait["customdata"][0][0] == "wait_allgather_1" and wait["y"] == ["rank 0 · compute"]
    pred_bw = next(t for t in bars if t["meta"]["source"] == "predicted" and t["meta"]["rank"] == 0
                   and t["meta"]["stream"] == "compute" and not t["meta"]["wait"])
    assert sorted(pred_bw["base"]) == [0, 1, 4]              # the backward after the forward
    # every gather linked from its issue to its wait, inside its own source's panel
    links = [t for t in fig["data"] if t["type"] == "scatter"]
    assert [(t["yaxis"], t["meta"]["source"], t["meta"]["links"]) for t in links] == [
        ("y", "measured", 2), ("y2", "predicted", 2)]
    assert links[0]["x"][:2] == [5, 10] and links[0]["y"][:2] == ["rank 0 · allgather", "rank 0 · compute"]
    assert ag["customdata"][0][5] == "waited by wait_allgather_1 at 10.00 ms (blocked 10.00 ms)"   # hover cross-ref
    assert wait["customdata"][0][5] == "waits for allgather_param_1, issued at 5.00 ms"
    # the three numbers are in the panels' titles
    titles = [a["text"] for a in lay["annotations"]]
    assert "exposed comm 10.00 ms" in titles[0] and "overlap 13.00 ms" in titles[0] and "idle (host-bound) 10.00 ms" \
        in titles[0]
    # one graph only; and the what-if schedule's ms fields
    one = schedule_figure(HAND, graph=(0, "backward"))
    assert {v for t in one["data"] if t["type"] == "bar" for v in t["customdata"][0][2:3]} == {"graph 0 · backward"}
    wi = schedule_figure([{"graph_id": 0, "kind": "forward", "node": "mm", "stream": "compute",
                           "start_ms": 1.0, "end_ms": 3.5, "source": "predicted"}])
    assert wi["data"][0]["x"] == [2.5] and wi["data"][0]["meta"]["source"] == "predicted"


def test_schedule_every_panel_has_its_unit_and_device_words():
    """Each source's time axis carries ms (the measured panel too, not only the bottom one); the
    idle time is named for the device: no "GPU idle" on a CPU run."""
    from deepcompile.report.schedule_fig import device_kind, schedule_figure

    fig = schedule_figure(HAND, graphs=GRAPHS, device="cpu")
    lay = fig["layout"]
    xs = [k for k in lay if k.startswith("xaxis")]
    assert len(xs) == 2
    for k in xs:
        assert lay[k]["ticksuffix"] == " ms" and "ms" in lay[k]["title"]["text"], (k, lay[k])
    titles = " ".join(a["text"] for a in lay["annotations"])
    assert "GPU" not in titles and "idle (between operators)" in titles
    gpu = " ".join(a["text"] for a in schedule_figure(HAND, device="gpu")["layout"]["annotations"])
    assert "GPU idle (host-bound)" in gpu
    assert device_kind({"devices": []}) == "cpu" and device_kind({"devices": ["NVIDIA H200"]}) == "gpu"


def test_schedule_whatif_totals_replace_the_span():
    """A what-if panel states its prediction's own step and peak (one number with the Passes tab),
    not its bars' span."""
    from deepcompile.report.schedule_fig import schedule_figure

    evs = [{"graph_id": 0, "kind": "forward", "node": "mm", "stream": "compute", "start_ms": 1.0, "end_ms": 3.5,
            "source": "what-if (predicted)"}]
    fig = schedule_figure(evs, totals={"what-if (predicted)": {"headline": "predicted step 825.9 ms, peak 4.6 MiB",
                                                               "edit": "prefetch.budget_mb=0"}})
    t = fig["layout"]["annotations"][0]["text"]
    assert "predicted step 825.9 ms, peak 4.6 MiB" in t and "prefetch.budget_mb=0" in t and ": step 2.50" not in t


def test_steady_median_leaves_out_compile_profiling_and_recompile():
    """One median of step time: the steady steps only (the compile, profiling and re-compile
    steps of the record's own numbering are left out), as inspect and the inspector state it."""
    steps = [{"step": 1, "time_s": 9.7}, {"step": 2, "time_s": 1.3}, {"step": 3, "time_s": 5.0},
             {"step": 4, "time_s": 0.12}, {"step": 5, "time_s": 0.13}, {"step": 6, "time_s": 0.125}]
    med, n = steady_median_ms(steps, {"profile_step": 1})
    assert n == 3 and med == pytest.approx(125.0)
    assert special_steps(steps, {"profile_step": 1}) == {1: "compile", 2: "profiling", 3: "re-compile"}


def test_gather_links_without_graphs_pair_in_order():
    from deepcompile.report.schedule_fig import gather_links, normalize

    evs = normalize([_ev("allgather_params_default", "allgather", 0, 2), _ev("allgather_param_x", "allgather", 1, 3),
                     _ev("wait_allgather_many_default", "compute", 4, 5), _ev("wait_allgather_y", "compute", 6, 7)])
    lk = gather_links(evs)
    assert [(x["issue"], x["wait"]) for x in lk] == [("allgather_params_default", "wait_allgather_many_default"),
                                                     ("allgather_param_x", "wait_allgather_y")]


def test_gather_links_follow_the_kept_groups_start_to_wait():
    """The default plan's kept parameters are gathered in need-order groups: each
    gather_persistent_start is linked to the gather_persistent_wait that reads its handle, and the
    wait counts as the compute stream waiting."""
    from deepcompile.report.schedule_fig import gather_links, is_wait, normalize

    evs = normalize([_ev("gather_persistent_start", "allgather", 0, 2), _ev("gather_persistent_start_1", "allgather", 2, 4),
                     _ev("gather_persistent_wait", "compute", 3, 4), _ev("gather_persistent_wait_1", "compute", 6, 7)])
    graphs = {(0, "forward"): [{"name": "gather_persistent_start", "args": []},
                               {"name": "gather_persistent_start_1", "args": []},
                               {"name": "gather_persistent_wait", "args": [{"node": "gather_persistent_start"}, [1, 2]]},
                               {"name": "gather_persistent_wait_1", "args": [{"node": "gather_persistent_start_1"}, [3]]}]}
    lk = gather_links(evs, graphs)
    assert sorted((x["issue"], x["wait"]) for x in lk) == [("gather_persistent_start", "gather_persistent_wait"),
                                                           ("gather_persistent_start_1", "gather_persistent_wait_1")]
    assert is_wait({"node": "gather_persistent_wait_1", "op": ""})
    assert not is_wait({"node": "gather_persistent_start_1", "op": ""})


def test_memory_figure_stacks_categories_in_mib_or_gib_with_labelled_peaks():
    from deepcompile.report.memory_fig import _peaks, memory_figure
    from deepcompile.report.style import figure_json

    G = 1 << 30
    cats = ["parameter_shards", "gathered", "activations"]
    samples = [{"t_ms": t, "graph_id": 0, "kind": "forward", "node": f"n{t}",
                "by_category": {"parameter_shards": 1 * G, "gathered": g * G, "activations": a * G},
                "allocated_bytes": (1 + g + a) * G} for t, g, a in ((0.0, 0, 0), (1.5, 2, 1), (3.0, 1, 3))]
    view = {"categories": cats, "samples": samples,
            "peak": {"bytes": 5 * G, "where": "n3.0", "source": "measured"},
            "predicted": {"bytes": int(5.5 * G), "by_category": {"gathered": 2 * G}, "source": "predicted"}}
    fig = memory_figure(view)
    json.loads(figure_json(fig))
    stacked = [t for t in fig["data"] if t.get("stackgroup")]
    assert [t["meta"]["category"] for t in stacked] == cats
    assert fig["layout"]["yaxis"]["title"]["text"] == "GiB" and fig["layout"]["yaxis"]["ticksuffix"] == " GiB"
    assert stacked[2]["y"] == [0, 1, 3] and stacked[0]["x"] == [0.0, 1.5, 3.0]
    assert "ms" in fig["layout"]["xaxis"]["title"]["text"]
    peaks = {t["meta"]["peak"]: t for t in fig["data"] if "peak" in (t.get("meta") or {})}
    assert set(peaks) == {"measured", "predicted"}
    assert peaks["measured"]["x"] == [3.0] and peaks["measured"]["y"] == [5]
    assert peaks["predicted"]["y"] == [5.5, 5.5] and peaks["predicted"]["line"]["dash"] == "dash"
    texts = " ".join(a["text"] for a in fig["layout"]["annotations"])
    assert "measured peak 5.0 GiB" in texts and "predicted peak 5.5 GiB" in texts
    # record.reader.memory_view's shape: the measured timeline and peak, the plan's predicted peak
    mv = {"categories": cats, "peak": dict(view["peak"], label="measured peak (profiled step 1)"),
          "measured": {"source": "measured", "label": "measured peak (profiled step 1)", "samples": samples,
                       "peak": {"bytes": 5 * G, "t_ms": 2.5, "where": "graph 0 forward, node n3.0",
                                "by_category": {"activations": 3 * G}}},
          "predicted": {"source": "predicted", "label": "predicted peak of the chosen plan",
                        "peak": {"bytes": int(5.5 * G), "where": "backward", "by_category": {}}}}
    fig2 = memory_figure(mv)
    assert [t["meta"]["category"] for t in fig2["data"] if t.get("stackgroup")] == cats
    pk2 = {t["meta"]["peak"]: t for t in fig2["data"] if "peak" in (t.get("meta") or {})}
    assert pk2["measured"]["x"] == [2.5] and pk2["predicted"]["y"] == [5.5, 5.5]
    assert [p["source"] for p in _peaks(mv)] == ["measured", "predicted"]    # the run's peak counted once
    small = memory_figure({"samples": [{"node_index": i, "allocated_bytes": b} for i, b in enumerate((0, 3 << 20))]})
    assert small["layout"]["yaxis"]["title"]["text"] == "MiB" and small["data"][0]["y"] == [0, 3]


def test_steps_figure_keeps_the_compile_steps_off_the_scale():
    from deepcompile.report.steps_fig import steps_figure

    steps = [{"step": i, "time_s": t, "loss": 5 - i * 0.1, "mem": {"peak": 3 << 30}}
             for i, t in enumerate([4.0, 0.15, 2.6, 0.040, 0.042, 0.041], start=1)]
    special = special_steps(steps, {"profile_step": 1, "schedule": []})
    assert special == {1: "compile", 2: "profiling", 3: "re-compile"}
    fig = steps_figure(steps, special=special)
    steady = next(t for t in fig["data"] if (t.get("meta") or {}).get("steady"))
    assert steady["x"] == [4, 5, 6] and steady["y"] == pytest.approx([40, 42, 41])
    assert fig["layout"]["yaxis"]["range"][1] < 100           # set by the steady steps, not by 4 s
    marks = next(t for t in fig["data"] if "special" in (t.get("meta") or {}))
    assert marks["x"] == [1, 2, 3] and "step 1: compile · 4.000 s" in marks["text"][0]
    assert "step 2: profiling · 150.00 ms" in marks["text"][1]
    mem = next(t for t in fig["data"] if (t.get("meta") or {}).get("row") == "memory")
    assert mem["meta"]["unit"] == "GiB" and mem["y"][0] == 3
    assert special_steps(steps, None)[1] == "compile" and special_steps(steps, None).get(3) == "slow"


def test_each_graph_once_and_the_compile_diff_only_when_it_differs():
    from deepcompile.record.reader import GraphRecord

    a = [{"name": "x", "op": "placeholder", "target": "x"}, {"name": "mm", "op": "call_function", "target": "aten.mm"}]
    b = a + [{"name": "ag", "op": "call_function", "target": "dc.allgather_param"}]

    def g(after, seq, nodes):
        return GraphRecord(0, "forward", after, seq, nodes)

    same = [g("input", 0, a), g("zero3", 1, b), g("input", 2, a), g("zero3", 3, b)]
    chains = compiles(same)
    assert [[v.after for v in c] for c in chains] == [["input", "zero3"], ["input", "zero3"]]
    text = _compile_diff(chains)
    assert "compiled 2 times" in text and "gave the same graph" in text and "compile-diff" not in text
    differ = [g("input", 0, a), g("zero3", 1, b), g("input", 2, a), g("zero3", 3, a)]
    text = _compile_diff(compiles(differ))
    assert "compile 1 of 2 (zero3) → the latest: 3 → 2 nodes" in text
    assert _compile_diff(compiles(same[:2])) == ""
