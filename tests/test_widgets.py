"""Unit tests of the inspector's models (no browser): state after simulated clicks, rendering,
re-run wiring (the exact command line), jobs (progress, cancel), live following, broken records."""
from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from deepcompile.record.reader import read_run
from deepcompile.vocab.memory import fmt_bytes

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rec(demo_run):
    return read_run(demo_run, 0)


# --------------------------------------------------------------------------- import path
def test_import_as_deepcompile_widgets():
    import deepcompile.widgets as w
    from deepcompile.widgets.graph_view import GraphModel

    assert w.GraphModel is GraphModel
    assert Path(sys.modules["deepcompile.widgets.graph_view"].__file__).parent == REPO / "widgets"
    assert w.Inspector.__name__ == "Inspector"


# --------------------------------------------------------------------------- graph model
def test_graph_model_clicks(rec):
    from deepcompile.widgets import GraphModel

    g = GraphModel(rec)
    assert g.kind == "forward" and g.pass_names == ["input", "zero3"] and g.version == 1
    r = g.render()
    assert "svg" in r.svg and "blocks.0" in r.groups and "blocks.0.attn" not in r.groups
    assert r.diff is None and "dc-diff" not in r.svg
    assert g.render() is r  # cached

    g.select_passes("input", "zero3")
    r = g.render()
    assert r.diff["added"] > 0 and r.diff["comm_added"]["allgather_param"] > 0
    assert "dc-added" in r.svg and "blocks.0" in r.classes and "dc-added" in r.classes["blocks.0"]

    g.click("blocks.0")                              # expand
    keys = g.render().groups
    assert "blocks.0" not in keys and "blocks.0.attn" in keys and "blocks.1" in keys
    g.click("blocks.0.attn")                         # expand one level deeper
    assert any(k.startswith("blocks.0.attn/") for k in g.render().groups)
    g.click("blocks.0")                              # collapse, with what was open inside
    assert g.expanded == set() and "blocks.0" in g.render().groups
    with pytest.raises(ValueError):
        g.expand("no.such.module")

    g.set_search("qkv")
    r = g.render()
    assert r.matches and all("qkv" in (m["scope"] + m["name"] + m["target"]).lower() for m in r.matches)
    assert "dc-match" in r.svg and "search 'qkv'" in r.summary

    for mode, unit in (("latency", "µs"), ("memory", "B")):
        g.set_color(mode)
        assert unit in g.render().svg
    with pytest.raises(ValueError):
        g.set_color("rainbow")

    g.select_node("wait_allgather_default")
    assert "dc-selected" in g.render().svg
    g.set_kind("backward")
    assert g.compare is None and g.expanded == set() and g.pass_names[-1] == "zero3"
    with pytest.raises(ValueError):
        g.set_pass("prefetch")


def test_graph_model_builtin_layout(rec):
    from deepcompile.widgets import GraphModel

    g = GraphModel(rec, use_dot=False)
    g.select_passes(0, 1)
    g.set_search("lm_head")
    svg = g.render().svg
    assert 'class="graph simple dc-graph"' in svg and "dc-added" in svg and "dc-match" in svg


def test_graph_model_handle_click_nested_svg(rec):
    """What a click on the SVG does (the front end sends the box's ``group-<key>``), and the nested
    picture it produces: an open module is a frame (``dc-expanded``) around its own boxes."""
    import re

    from deepcompile.report import level_layout as L
    from deepcompile.widgets import GraphModel

    g = GraphModel(rec)
    r = g.render()
    ids = set(re.findall(r'id="group-([^"]+)"', r.svg))
    assert set(r.groups) <= ids and r.layout == ("dot" if L.have_dot() else "simple")
    assert g.handle_click("blocks.1") == ("expanded", "blocks.1")
    r = g.render()
    if L.have_dot():   # the frame stays in the picture, its boxes drawn inside it
        assert re.search(r'<g id="group-blocks\.1" class="[^"]*dc-expanded', r.svg)
        assert "dc-nested" in r.svg
    assert {"blocks.1.attn", "blocks.1.mlp"} <= set(r.groups) and "blocks.1" not in r.groups
    assert g.view_keys()[1] == ["blocks.1"]
    assert ("blocks.1", 0, True) in g.outline() and ("blocks.1.attn", 1, False) in g.outline()
    assert g.handle_click("blocks.1.attn")[0] == "expanded"
    node_box = next(k for k in g.render().groups if k.startswith("blocks.1.attn/"))
    assert g.handle_click(node_box) == ("selected", node_box.rsplit("/", 1)[1])
    assert g.selected_node == node_box.rsplit("/", 1)[1]
    r = g.render()
    assert "dc-selected" in r.classes[node_box] and f"selected {g.selected_node}" in r.summary
    assert g.handle_click(node_box, shift=True) == ("collapsed", "blocks.1.attn")   # the module around it
    assert g.expanded == {"blocks.1"}
    assert g.handle_click("blocks.1") == ("collapsed", "blocks.1")                # a click on the frame
    assert g.expanded == set()
    assert g.handle_click("blocks.1.attn") == ("ignored", None)                   # stale picture
    assert g.handle_click("no.such") == ("ignored", None) and g.expanded == set()


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("dc_bench_inspector", REPO / "benchmarks" / "inspector.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_nested_layout_lays_out_identical_layers_once():
    """Per-module layout: the inside of a layer is laid out by graphviz once and reused for every
    identical layer (the level's graphviz text is its structural signature: no layer names)."""
    from deepcompile.report import level_layout as L
    from deepcompile.widgets import GraphModel
    from deepcompile.widgets.graph_groups import key_chains

    if not L.have_dot():
        pytest.skip("graphviz is not installed")
    rec = _bench_module().make_record(4)
    g = GraphModel(rec)
    g.set_pass("zero3")
    L.LEVEL_CACHE.clear()
    g.render()
    assert (L.LEVEL_CACHE.hits, L.LEVEL_CACHE.misses) == (0, 1)         # the top level
    g.expand("layers.1")
    r1 = g.render()
    assert L.LEVEL_CACHE.misses == 3                                    # top level again + layers.1's inside
    g.collapse_all()
    g.expand("layers.2")
    r2 = g.render()
    assert L.LEVEL_CACHE.hits >= 1 and L.LEVEL_CACHE.misses == 4        # layers.2's inside: a hit
    assert 'id="group-layers.2.self_attn"' in r2.svg and 'id="group-layers.1.self_attn"' not in r2.svg
    assert len(r1.groups) == len(r2.groups)
    # the signature of a layer's level names no layer
    g.expand("layers.2.self_attn")
    nodes = g._nodes_and_status()[0]
    chains, inferred = key_chains(nodes, g.expanded, g.pscopes)
    g._mf = (None, None)
    idxs = [i for i, c in enumerate(chains) if "layers.2" in c[:-1]]
    lvl = g._level(nodes, {}, chains, inferred, idxs, 1, "layers.2", set(), {})
    text = L.level_dot(lvl, {i: (10.0, 10.0) for i, b in enumerate(lvl.boxes) if b.child is not None})
    assert "layers" not in text and "self_attn" in text
    # prewarm: the inside of every distinct top-level module laid out ahead of a click
    g.collapse_all()
    L.LEVEL_CACHE.clear()
    assert g.prewarm() == 1                     # one graphviz run stands for all four layers
    misses = L.LEVEL_CACHE.misses
    g.expand("layers.3")
    g.render()
    assert L.LEVEL_CACHE.misses == misses + 1   # only the top level: the layer's inside was ready


def test_union_diff_marks_moved_added_removed():
    from deepcompile.widgets.graph_groups import union_diff

    n = lambda name: {"name": name, "op": "call_function", "target": "aten.add", "args": [], "scope": ""}  # noqa
    before = [n(x) for x in "abcde"]
    after = [n(x) for x in "adbcX"]          # d moved up, e removed, X added
    union, status = union_diff(before, after)
    assert status == {"d": "moved", "e": "removed", "X": "added"}
    assert [u["name"] for u in union] == list("adebcX")   # e right after d, its predecessor in `before`


# --------------------------------------------------------------------------- moved collectives, detail, legend
def _prefetch_record(budget_mb=64.0, fuse_mb=0.0):
    """An in-memory record of the tiny zero3 graph of tests/test_prefetch.py before and after prefetch."""
    from deepcompile.record.reader import GraphRecord, RunRecord
    from tests.test_prefetch import _run_prefetch

    before, after, notes, names = _run_prefetch(budget_mb, fuse_mb, with_before=True)
    graphs = [GraphRecord(0, "forward", "zero3", 0, before), GraphRecord(0, "forward", "prefetch", 1, after, notes)]
    return RunRecord(Path("."), {}, {}, 0, {}, graphs, [], None, None, None), names


@pytest.mark.parametrize("layout", ["simple", "dot"])
def test_graph_view_moved_collectives_from_to(layout):
    import html as H

    from deepcompile.report import level_layout as L
    from deepcompile.widgets import GraphModel
    from deepcompile.widgets.graph_render import DIFF_COLORS

    if layout == "dot" and not L.have_dot():
        pytest.skip("graphviz not installed")
    rec, nm = _prefetch_record()
    g = GraphModel(rec)
    g.select_passes("zero3", "prefetch")
    moves = g.moves()
    assert [(m["node"], m["params"], m["from"], m["to"]) for m in moves] == [
        (nm["issue1"], [1], nm["release0"], "s2"), (nm["issue2"], [2], nm["release1"], "s2")]
    # boxes: it left layers.0 / layers.1 (where it was issued), is issued among the inputs now,
    # and stays drawn in its parameter's module
    assert [(m["from_key"], m["to_key"], m["key"]) for m in moves] == [
        ("layers.0", "inputs", "layers.1"), ("layers.1", "inputs", "layers.2")]
    assert moves[0]["first_use"] == {1: nm["use1"]} and moves[0]["param_names"] == ["layers.1.weight"]
    r = g.render(layout)
    assert r.moves == moves and "2 collective(s) issued earlier" in r.summary
    # the front end's arrows: old box -> new box, on the picture's root element
    m = re.search(r'data-dc-moves="([^"]*)"', r.svg)
    data = json.loads(H.unescape(m.group(1)))
    assert [(d["from"], d["to"], d["node"]) for d in data] == [("layers.0", "inputs", nm["issue1"]),
                                                               ("layers.1", "inputs", nm["issue2"])]
    assert "→" in data[0]["label"]
    # a "moved" chip, not an added or removed one, on the boxes of the moved collectives
    assert r.chips == {"layers.1": {"moved": 1}, "layers.2": {"moved": 1}}
    assert r.svg.count('class="dc-chip dc-chip-moved"') == 2 and "dc-chip-added" not in r.svg
    assert f'fill="{DIFF_COLORS["moved"]}"' in r.svg and ">⇡1</text>" in r.svg
    # no diff: no arrows, no chips
    g.set_diff(None)
    r = g.render(layout)
    assert "data-dc-moves" not in r.svg and not r.chips and not r.moves


def test_graph_view_added_and_removed_chips_differ():
    from deepcompile.widgets import GraphModel
    from deepcompile.widgets.graph_render import DIFF_COLORS, DIFF_SYMBOLS

    rec, nm = _prefetch_record(64.0, 64.0)      # three gathers fused into one: 1 added, 3 removed
    g = GraphModel(rec, use_dot=False)
    g.select_passes("zero3", "prefetch")
    r = g.render()
    assert r.diff["added"] >= 1 and r.diff["removed"] >= 3
    assert set(DIFF_COLORS.values()).__len__() == 3 and len(set(DIFF_SYMBOLS.values())) == 3
    added = re.search(r'<g class="dc-chip dc-chip-added"><rect [^>]*fill="([^"]+)"[^>]*/><text[^>]*>([^<]+)</text>', r.svg)
    removed = re.search(r'<g class="dc-chip dc-chip-removed"><rect [^>]*fill="([^"]+)"([^>]*)/><text[^>]*>([^<]+)</text>',
                        r.svg)
    assert added and removed
    assert added.group(1) == DIFF_COLORS["added"] != removed.group(1) == DIFF_COLORS["removed"]
    assert added.group(2).startswith("+") and removed.group(3).startswith("−") and "stroke-dasharray" in removed.group(2)
    lg = g.legend()
    assert [(d["status"], d["symbol"], d["color"]) for d in lg["diff"]] == [
        (s, DIFF_SYMBOLS[s], DIFF_COLORS[s]) for s in ("added", "removed", "moved")]
    assert 'class="dc-chip dc-chip-removed"' in r.html and r.html.index("dc-graph-legend") < r.html.index("<svg")
    # the fused collective lists its parameters in the detail panel
    fused = next(n for n in rec.versions(0, "forward")[-1].nodes if n["target"] == "dc.allgather_params")
    d = g.node_detail(fused["name"])
    assert [p["id"] for p in d["params"]] == [0, 1, 2] and d["bytes"] == 3 * 4096
    assert d["moved"]["first_use"] == {k: nm[f"use{k}"] for k in range(3)}


def test_graph_view_node_detail_fields():
    from deepcompile.widgets import GraphModel

    rec, nm = _prefetch_record()
    g = GraphModel(rec, use_dot=False)
    g.select_passes("zero3", "prefetch")
    d = g.node_detail(nm["use1"])
    assert d["name"] == nm["use1"] and d["op"] == "call_function" and d["target"].endswith("mul")
    assert d["shape"] == [1024] and d["dtype"] == "float32" and d["bytes"] == 4096 and d["bytes_label"] == "4.0 KiB"
    assert d["scope"] == "layers.1" and d["box"] == "layers.1" and d["version"] == "prefetch"
    assert d["source"] == "model.py:11 in forward: x = x * self.w1"
    assert d["latency_source"] == "estimated" and d["latency_us"] > 0 and d["latency_label"].endswith("µs")
    assert d["moved"] is None and d["params"] == [] and d["status"] is None
    assert set(d["inputs"]) == {nm["use0"], d["inputs"][1]} and d["users"]
    mv = g.node_detail(nm["issue2"])
    assert mv["status"] == "moved" and mv["params"] == [{"id": 2, "name": "layers.2.weight"}]
    assert mv["moved"]["from"] == nm["release1"] and mv["moved"]["to"] == "s2" and mv["moved"]["earlier"] > 0
    assert mv["moved"]["first_use"] == {2: nm["use2"]} and mv["bytes"] == 4096
    html = g.node_detail_html(nm["issue2"])
    assert f"{nm['release1']} → s2" in html and "layers.2.weight" in html
    assert g.node_detail("no_such_node") is None
    # a measured latency (the record's profile / schedule) wins over the estimate
    g2 = GraphModel(rec, use_dot=False, timings={(0, "forward", nm["use1"]): 123.0})
    g2.select_passes("zero3", "prefetch")
    d2 = g2.node_detail(nm["use1"])
    assert d2["latency_us"] == 123.0 and d2["latency_source"] == "measured" and d2["latency_label"] == "123.0 µs"


def test_graph_view_colour_legend_min_max():
    from deepcompile.plan import estimate as E
    from deepcompile.widgets import GraphModel
    from deepcompile.widgets.graph_groups import key_chains

    rec, nm = _prefetch_record()
    names = [n["name"] for n in rec.versions(0, "forward")[-1].nodes]
    timings = {(0, "forward", n): 10.0 * (i + 1) for i, n in enumerate(names)}
    g = GraphModel(rec, use_dot=False, timings=timings)
    assert g.legend()["mode"] == "kind" and ("compute", "#d7e8f7") in g.legend()["items"]
    nodes = rec.versions(0, "forward")[-1].nodes
    chains, _ = key_chains(nodes, set(), g.pscopes)
    boxes: dict[str, list[dict]] = {}
    for n, c in zip(nodes, chains):
        if n["op"] not in ("placeholder", "get_attr", "output"):
            boxes.setdefault(c[-1], []).append(n)
    g.set_color("latency")
    lat = {k: sum(timings[(0, "forward", n["name"])] for n in v) for k, v in boxes.items()}
    lg = g.legend()
    assert lg["mode"] == "latency" and lg["unit"] == "µs" and lg["source"] == "measured"
    assert lg["min"] == min(lat.values()) and lg["max"] == max(lat.values())
    assert lg["min_label"] == f"{min(lat.values()):.1f} µs" and lg["max_label"] == f"{max(lat.values()):.1f} µs"
    assert lg["stops"][0] == "#ffffff" and len(lg["stops"]) == 5
    r = g.render()
    assert r.legend == lg and lg["min_label"] in r.html and lg["max_label"] in r.html
    hot = max(lat, key=lat.get)   # the box at the top of the scale has the scale's last colour
    assert re.search(rf'id="group-{re.escape(hot)}"><rect [^>]*fill="{lg["stops"][-1]}"', r.svg)
    g.set_color("memory")
    mem = {k: sum(E.node_bytes(n) for n in v) for k, v in boxes.items()}
    lg = g.legend()
    assert lg["unit"] == "bytes" and (lg["min"], lg["max"]) == (min(mem.values()), max(mem.values()))
    assert lg["max_label"] == fmt_bytes(max(mem.values()))


def test_graph_canvas_front_end_fits_zooms_and_draws_moves(tmp_path):
    """The canvas's ES module in Chromium on a static page (a stand-in for anywidget's model:
    get / on / off / send): the picture opens fitted in a viewport without scroll bars, the zoom
    buttons and ctrl+wheel zoom, a drag moves it without clicking a box, the legend sits above it,
    and every move between two boxes is a dashed arrow."""
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    from deepcompile.widgets import GraphModel
    from deepcompile.widgets import canvas as C

    rec, nm = _prefetch_record()
    g = GraphModel(rec, use_dot=False)
    g.select_passes("zero3", "prefetch")
    r = g.render()
    page = tmp_path / "canvas.html"
    page.write_text(
        f"<html><head><style>{C.CSS}</style></head><body style='width:900px'><div id='root'></div>"
        f"<script type='module'>{C.ESM.replace('export default {{ render }};', '')}\n"
        "const h = {}; window.sent = [];\n"
        "const model = {get: () => window.VALUE, on: (e, f) => { h[e] = f; }, off: () => {}, "
        "send: (m) => window.sent.push(m)};\n"
        f"window.VALUE = {json.dumps(r.html)};\n"
        "render({model, el: document.getElementById('root')}); window.ready = true;</script></body></html>")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(chromium), args=["--no-sandbox"], timeout=60_000)
        try:
            pg = b.new_page(viewport={"width": 1000, "height": 900})
            errors = []
            pg.on("pageerror", lambda e: errors.append(str(e)))
            pg.goto(page.as_uri())
            pg.wait_for_function("window.ready === true", timeout=30_000)
            arrows = pg.eval_on_selector_all(".dc-move-arrow", "es => es.map(e => e.getAttribute('data-node'))")
            assert arrows == [nm["issue1"], nm["issue2"]]
            assert "moved" in pg.inner_text(".dc-legend-holder") and pg.query_selector(".dc-viewport .dc-graph-legend") is None
            view = pg.eval_on_selector(".dc-viewport", "v => [getComputedStyle(v).overflow, v.clientHeight]")
            assert view[0] == "hidden" and 0 < view[1] <= 642
            fit = pg.inner_text(".dc-zoom-label")
            pg.click("button[title^='zoom in']")
            zoomed = pg.inner_text(".dc-zoom-label")
            assert int(zoomed[:-1]) > int(fit[:-1])
            pg.click("button[title^='fit the whole']")
            assert pg.inner_text(".dc-zoom-label") == fit
            box = pg.eval_on_selector(".dc-viewport", "v => { const r = v.getBoundingClientRect(); return [r.x, r.y]; }")
            pg.mouse.move(box[0] + 100, box[1] + 100)
            pg.keyboard.down("Control")
            pg.mouse.wheel(0, -200)
            pg.keyboard.up("Control")
            pg.wait_for_timeout(100)
            assert int(pg.inner_text(".dc-zoom-label")[:-1]) > int(fit[:-1])
            pg.mouse.down()
            pg.mouse.move(box[0] + 60, box[1] + 40, steps=5)
            pg.mouse.up()
            assert pg.evaluate("window.sent") == []            # a drag is no click
            pg.click('[id="group-layers.1"] rect')
            assert pg.evaluate("window.sent") == [{"event": "click", "key": "layers.1", "shift": False}]
            assert not errors, errors
        finally:
            b.close()


# --------------------------------------------------------------------------- schedule / memory
def test_schedule_and_memory_models(demo_run, rec):
    from deepcompile.widgets import MemoryModel, ScheduleModel

    s = ScheduleModel(demo_run, rec)
    assert s.key == (0, "forward")
    lanes = s.lanes()
    assert any(l.startswith("rank 0 · compute") for l in lanes) and any(l.startswith("rank 1 ·") for l in lanes)
    n_traces = len(s.figure().data)
    s.select_node(s.nodes_at()[3])
    sel = [t for t in s.figure().data if (t.name or "").startswith("selected: ")]
    assert len(s.figure().data) == n_traces + len(sel) and 1 <= len(sel) <= 2   # an outline per source that has it
    s.set_graph(0, "backward")
    assert any("reduce" in l for l in s.lanes())

    m = MemoryModel(rec)
    pk = m.peak()
    assert pk["value"] > 0 and pk["holders"]
    m.set_sort("out_bytes")
    rows = m.op_rows()
    vals = [r["out_bytes"] for r in rows]
    assert vals == sorted(vals, reverse=True) and len(rows) > 50
    m.set_sort("out_bytes")                          # same column again: flips
    assert [r["out_bytes"] for r in m.op_rows()] == sorted(vals)
    m.set_pass("input")
    labels = [x["label"] for x in m.series()]
    assert labels[-1] == "estimate after input"
    assert "<table class='dc-ops'" in m.table_html()
    assert len(m.figure().data) >= 2


# --------------------------------------------------------------------------- passes / re-run wiring
def test_passes_model_controls_and_command(rec, tmp_path):
    from deepcompile.widgets import PassesModel

    pm = PassesModel(rec.config)
    assert pm.passes == ["zero3"] and pm.order[0] == "zero3" and "prefetch" in pm.order
    from deepcompile.params import describe
    from deepcompile.passes import PASSES
    for p in describe(PASSES["prefetch"].params_cls):   # the rule, whatever the pass declares today
        w = pm.spec("prefetch", p.name).widget
        if p.choices:
            assert w == "dropdown"
        elif p.type in ("int", "float") and p.min is not None and p.max is not None:
            assert w == (f"{p.type}_slider" if p.max - p.min <= 1e4 else f"{p.type}_box")
    assert pm.spec("prefetch", "max_fused").widget == "int_slider"
    assert pm.spec("prefetch", "backend").choices == ("auto", "nccl", "gloo")
    mf = pm.spec("prefetch", "max_fused")
    assert (mf.min, mf.max) == (1, 1024) and mf.help
    assert pm.command(tmp_path / "r") == [   # a re-run profiles step 1: what-if works on it too
        sys.executable, "-m", "deepcompile", "demo", "--out", str(tmp_path / "r"), "--ranks", "2", "--steps", "20",
        "--passes", "zero3", "--compiler", "aot_eager", "--profile-step", "1"]
    pm.enable("prefetch")
    pm.set_value("prefetch", "budget_mb", 64.0)
    pm.set_value("prefetch", "backend", "gloo")
    pm.set_value("prefetch", "max_fused", 8)
    argv = pm.command(tmp_path / "r", steps=3, cpu=True)
    assert argv[argv.index("--passes") + 1] == "zero3,prefetch" and "--cpu" in argv
    pp = [argv[i + 1] for i, a in enumerate(argv) if a == "--pass-param"]
    assert pp == ["prefetch.budget_mb=64.0", "prefetch.max_fused=8", "prefetch.backend=gloo"]
    # the CLI accepts exactly what we generate
    from deepcompile.cli import build_config
    from deepcompile.config import Config
    cfg = build_config("aot_eager", "zero3,prefetch", pp)
    Config.load(cfg)
    assert cfg["passes"][1]["params"] == {"budget_mb": 64.0, "max_fused": 8, "backend": "gloo"}
    assert pm.validate() == []
    pm.set_value("prefetch", "max_fused", 5000)
    assert any("max_fused" in e and "maximum" in e for e in pm.validate())
    pm.reset()
    assert pm.passes == ["zero3"] and pm.spec("prefetch", "max_fused").value == mf.default
    from deepcompile.plan.whatif import WhatIfError
    with pytest.raises(WhatIfError, match="profile"):   # a record without a profile says so, no numbers
        pm.whatif(rec.path)


def test_make_control_widgets():
    pytest.importorskip("ipywidgets")
    import ipywidgets as W
    from deepcompile.widgets.passes_view import ControlSpec, make_control

    c, row = make_control(ControlSpec("prefetch", "max_fused", "int_slider", 32, 32, "most params", 1, 1024, 1))
    assert isinstance(c, W.IntSlider) and (c.min, c.max, c.value) == (1, 1024, 32) and c.tooltip == "most params"
    spec = ControlSpec("p", "mode", "dropdown", "auto", "auto", "which", choices=("auto", "gloo"))
    c, _ = make_control(spec)
    c.value = "gloo"
    assert isinstance(c, W.Dropdown) and spec.value == "gloo"
    c, _ = make_control(ControlSpec("p", "on", "toggle", False, False, "flag"))
    assert isinstance(c, W.ToggleButton)


# --------------------------------------------------------------------------- jobs
def test_job_progress_and_exit(tmp_path):
    from deepcompile.widgets import Job

    code = "import time\nfor i in range(1, 4):\n    print(f'step {i:>4}/3  loss 1.0', flush=True)\nprint('done')"
    seen = []
    job = Job([sys.executable, "-c", code], cwd=tmp_path, on_line=seen.append).start()
    assert job.wait(timeout=60) == 0
    assert job.status == "finished" and (job.step, job.total, job.progress) == (3, 3, 1.0)
    assert seen[-1] == "done"


def test_job_cancel_kills_process_group(tmp_path):
    from deepcompile.widgets import Job

    marker = tmp_path / "child.pid"
    code = ("import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"open({str(marker)!r}, 'w').write(str(p.pid))\n"
            "print('step 1/10', flush=True)\ntime.sleep(120)\n")
    job = Job([sys.executable, "-c", code], cwd=tmp_path).start()
    deadline = time.time() + 30
    while not (marker.exists() and marker.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    child = int(marker.read_text())
    t0 = time.time()
    job.cancel(grace=3)
    assert job.wait(timeout=20) is not None and job.status == "cancelled" and time.time() - t0 < 15
    import os
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        try:  # a zombie child of init is gone once reaped; check its state
            if open(f"/proc/{child}/stat").read().split()[2] == "Z":
                break
        except OSError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the job's child process survived cancel()")


# --------------------------------------------------------------------------- the widget (headless)
def test_inspector_widget_clicks(demo_run):
    pytest.importorskip("ipywidgets")
    from deepcompile.widgets import Inspector

    insp = Inspector(demo_run, follow=False)
    assert "complete" in insp.message.value and "svg" in insp.g_svg.value
    if insp.s_fig is not None:   # clickable plotly FigureWidget (anywidget installed)
        assert len(insp.s_fig.data) > 2 and "dc-schedule" in insp.s_box._dom_classes
    else:
        assert insp.s_out.outputs and "application/vnd.plotly.v1+json" in insp.s_out.outputs[0]["data"]
    assert insp.st_out.outputs and insp.m_out.outputs and "dc-ops" in insp.m_table.value
    insp.g_diff.value = 0                                  # "diff vs 0: input"
    assert "diff: +" in insp.g_summary.value and "dc-added" in insp.g_svg.value
    insp.g_module.value = "blocks.1"
    insp.g_toggle.click()
    assert insp.model.graph.expanded == {"blocks.1"} and "blocks.1.attn" in [v for _, v in insp.g_module.options]
    insp.g_module.value = "blocks.1"                       # listed as open (▾): the button collapses it
    assert dict((v, lab) for lab, v in insp.g_module.options)["blocks.1"].startswith("▾")
    insp.g_toggle.click()
    assert insp.model.graph.expanded == set()
    insp.g_module.value = "blocks.1"
    insp.g_toggle.click()
    insp.g_collapse_all.click()
    assert insp.model.graph.expanded == set()
    insp.g_kind.value = "backward"
    assert insp.model.graph.kind == "backward" and insp.model.schedule.key == (0, "backward")
    insp.s_node.value = insp.model.schedule.nodes_at()[5]
    assert "dc-selected" in insp.g_svg.value
    insp.p_predict.click()
    assert "what-if" in insp.p_whatif.value and "profile" in insp.p_whatif.value and "dc-whatif-error" in insp.p_whatif.value
    out, argv = insp.model.rerun_command()      # the record says it is the demo: the demo, edited
    assert out.name == f"{demo_run.name}-rerun1" and argv[argv.index("--steps") + 1] == "3"
    assert "--model" not in argv and argv[argv.index("--profile-step") + 1] == "1"
    insp.model.launch_model = "tests.factories:tiny_gpt"  # as Inspector.launch(model=...) sets it
    _, argv = insp.model.rerun_command()
    assert argv[argv.index("--model") + 1] == "tests.factories:tiny_gpt"
    # controls generated from the declared parameters
    row = insp.p_box.children[insp.model.passes.order.index("prefetch")]
    assert "dc-param-prefetch-max_fused" in repr(row.children[3].children[0]._dom_classes)


def test_inspector_svg_click_from_front_end(demo_run):
    """The canvas's front end sends {"event": "click", "key": <box>}: the same state as a click."""
    pytest.importorskip("anywidget")
    from deepcompile.widgets import Inspector

    insp = Inspector(demo_run, follow=False, layout_wait_s=30)
    canvas = insp.g_svg
    assert insp.clickable and "dc-graph-view" in canvas._dom_classes and "group-blocks.1" in canvas.value
    send = lambda key, shift=False: canvas._handle_custom_msg({"event": "click", "key": key, "shift": shift}, [])  # noqa
    send("blocks.1")
    assert insp.model.graph.expanded == {"blocks.1"}
    assert 'id="group-blocks.1.attn"' in canvas.value and "(1 open)" in insp.g_summary.value
    send("blocks.1.attn")
    node_box = next(k for k in insp.model.graph.view_keys()[0] if k.startswith("blocks.1.attn/"))
    name = node_box.rsplit("/", 1)[1]
    send(node_box)                                        # a node: selected in every view
    assert insp.model.graph.selected_node == name and insp.model.schedule.selected_node == name
    assert insp.s_node.value == name and "dc-selected" in canvas.value
    if insp.s_fig is not None:
        assert insp.s_fig.data[-1].name == f"selected: {name}"
    send(node_box, shift=True)                            # collapse the module around the node
    assert insp.model.graph.expanded == {"blocks.1"}
    send("blocks.1")                                      # the open frame: collapse
    assert insp.model.graph.expanded == set()
    before = canvas.value
    send("blocks.1.mlp")                                  # a box of an older picture: nothing changes
    canvas._handle_custom_msg({"event": "hover"}, [])
    assert insp.model.graph.expanded == set() and canvas.value == before


def test_inspector_schedule_bar_click_selects_graph_node(demo_run):
    """A click on a timeline bar (plotly FigureWidget's click callback) selects that node in the
    graph view; a click on the graph's node outlines its bars."""
    pytest.importorskip("anywidget")
    from deepcompile.widgets import Inspector

    insp = Inspector(demo_run, follow=False, layout_wait_s=30)
    fw = insp.s_fig
    assert fw is not None
    names = {n["name"] for n in insp.model.graph.versions()[insp.model.graph.version].nodes}
    ti, pi = next((t, i) for t, tr in enumerate(fw.data) if (tr.meta or {}).get("source") == "predicted"
                  and tr.customdata is not None
                  for i, c in enumerate(tr.customdata) if c[0] in names and c[0].startswith("wait_allgather"))
    name = fw.data[ti].customdata[pi][0]
    fw._js2py_pointsCallback = {"event_type": "plotly_click", "points": {
        "trace_indexes": [ti], "point_indexes": [pi], "xs": [0.0], "ys": [fw.data[ti].y[pi]]},
        "device_state": None, "selector": None}
    g = insp.model.graph
    assert g.selected_node == name and insp.model.schedule.selected_node == name and insp.s_node.value == name
    box = next(k for k, c in g.render().classes.items() if "dc-selected" in c)
    assert "dc-selected" in insp.g_svg.value and f"selected {name} (in {box})" in insp.g_summary.value
    assert fw.data[-1].name == f"selected: {name}" and len(fw.data[-1].x) >= 1
    n_traces, n_sel = len(fw.data), sum((t.name or "").startswith("selected: ") for t in fw.data)
    assert n_sel >= 1                                     # one outline per source (measured, predicted)
    insp.s_node.value = ""                                # clearing the selection removes the outline traces
    assert len(fw.data) == n_traces - n_sel and g.selected_node is None


@pytest.mark.parametrize("breakage", ["missing", "truncated", "newer"])
def test_inspector_broken_record_shows_message(demo_run, tmp_path, breakage):
    pytest.importorskip("ipywidgets")
    from deepcompile.widgets import Inspector

    run = tmp_path / "run"
    if breakage != "missing":
        shutil.copytree(demo_run, run)
    if breakage == "truncated":
        f = next((run / "rank0" / "graphs").glob("*forward-01*"))
        f.write_bytes(f.read_bytes()[:40])
    elif breakage == "newer":
        m = json.loads((run / "manifest.json").read_text())
        m["format_version"] = 99
        (run / "manifest.json").write_text(json.dumps(m))
    insp = Inspector(run, follow=False)
    msg = insp.message.value
    assert "cannot show this run" in msg and "Traceback" not in msg
    assert {"missing": "no such run directory", "truncated": "truncated or corrupt gzip",
            "newer": "newer than"}[breakage] in msg
    assert insp.g_svg.value == "" and insp.model.record is None


def test_inspector_follows_live_run(tmp_path):
    pytest.importorskip("ipywidgets")
    from deepcompile.record.writer import RunRecorder
    from deepcompile.widgets import Inspector

    run = tmp_path / "live"
    recs = [RunRecorder(run, r, 2, {"compiler": "eager", "passes": ["zero3"]},
                        env={"torch": "x", "python": "3", "hostname": "h", "world_size": 2, "rank": r,
                             "devices": []}) for r in range(2)]
    insp = Inspector(run, follow=False, poll_interval=0.2)
    assert insp.model.steps.live and insp.model.steps.n_steps() == 0
    for s in range(1, 4):
        for r in recs:
            r.step(s, 0.1 * s, 2.0 / s, {"allocated": 100 * s, "reserved": 200, "peak": 300})
    assert insp.poll_once() and insp.model.steps.n_steps() == 3
    assert "3 step(s)" in insp.st_note.value
    assert not insp.poll_once()                      # nothing new
    insp.follow()                                    # the thread, for real
    for r in recs:
        r.step(4, 0.4, 0.5, {"allocated": 1, "reserved": 2, "peak": 3})
        r.close()
    deadline = time.time() + 20
    while (insp.model.steps.n_steps() < 4 or insp.model.steps.status != "complete") and time.time() < deadline:
        time.sleep(0.1)
    insp.stop()
    assert insp.model.steps.n_steps() == 4 and insp.model.steps.status == "complete"


def test_inspector_start_job_streams_and_adds_run(demo_run, tmp_path):
    pytest.importorskip("ipywidgets")
    from deepcompile.widgets import Inspector

    insp = Inspector(demo_run, follow=False)
    code = "for i in range(1, 5):\n    print(f'step {i}/4', flush=True)"
    job = insp.start_job([sys.executable, "-c", code], tmp_path / "new")
    assert job.wait(timeout=60) == 0
    deadline = time.time() + 10
    while insp.p_progress.bar_style != "success" and time.time() < deadline:
        time.sleep(0.05)
    assert (insp.p_progress.value, insp.p_progress.max) == (4, 4)
    assert "step 4/4" in "".join(o.get("text", "") for o in insp.p_log.outputs)
    assert str(tmp_path / "new") in insp.run_select.options and insp.model.run_dir == demo_run
    assert "new" in insp.p_runs.value


# --------------------------------------------------------------------------- what-if, re-runs, one peak, live memory
def _find(widget, cls):
    """The widget under ``widget`` carrying the DOM class ``cls``."""
    if cls in getattr(widget, "_dom_classes", ()):
        return widget
    for c in getattr(widget, "children", ()):
        hit = _find(c, cls)
        if hit is not None:
            return hit
    return None


def _wait(cond, timeout=60.0, what="condition"):
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_whatif_on_edit_is_debounced_and_changes_the_numbers(planned_run):
    pytest.importorskip("ipywidgets")
    from deepcompile.widgets import Inspector

    insp = Inspector(planned_run, follow=False, whatif_delay_s=0.3)
    pm = insp.model.passes
    assert pm.passes == ["zero3", "prefetch", "selective_unshard"]
    base = insp.whatif_now()                        # the values the run compiled with
    assert base is not None and base.step_ms > 0 and base.peak_bytes > 0, insp.p_whatif.value
    calls = []
    orig = pm.whatif
    pm.whatif = lambda *a, **k: (calls.append(k), orig(*a, **k))[1]
    ctrl = _find(insp.widget, "dc-param-selective_unshard-budget_mb")
    assert ctrl is not None
    for v in (1.0, 0.5, 0.25, 0.0):                 # a drag: four edits within the debounce delay
        ctrl.value = v
    assert "predicting" in insp.p_wstatus.value
    _wait(lambda: insp.last_whatif is not base and not insp.p_wstatus.value, 60, "the what-if of the edit")
    assert len(calls) == 1, f"{len(calls)} predictions for one burst of edits (not debounced)"
    w = insp.last_whatif
    assert (w.step_ms, w.peak_bytes) != (base.step_ms, base.peak_bytes)   # keeping nothing gathered: other numbers
    html = insp.p_whatif.value
    assert f"{w.step_ms:.1f} ms</span> (predicted)" in html and "dc-whatif-seconds" in html
    assert w.seconds < 2.0                          # an edit re-plans the cached graphs: well under 2 s
    # the schedule tab: the what-if's lanes are its own; no subplot mixes two sources
    if insp.s_fig is not None:
        by_axis = {}
        for t in insp.s_fig.data:
            src = (t.meta or {}).get("source")
            if t.type == "bar" and src and not (t.name or "").startswith("selected: "):
                by_axis.setdefault(t.yaxis, set()).add(src)
        assert {"measured", "predicted", "what-if (predicted)"} <= set().union(*by_axis.values())
        assert all(len(s) == 1 for s in by_axis.values()), by_axis
        lay = insp.model.schedule.figure_dict()["layout"]
        assert any("ms from the start" in str((v or {}).get("title") or "") for k, v in lay.items()
                   if k.startswith("xaxis")), "the time axis is in ms"
    nums = insp.s_numbers.value
    assert "exposed comm" in nums and "overlap" in nums and "idle (between operators)" in nums
    assert "GPU" not in nums                        # a CPU run: no GPU words
    insp.s_scope.value = "step"                     # every graph end to end: the panel numbers are the step's
    assert "whole step" in insp.model.schedule.figure_dict()["layout"]["title"]["text"]


def test_one_peak_across_views(planned_run, tmp_path):
    pytest.importorskip("ipywidgets")
    from deepcompile.report.summary import summarize
    from deepcompile.vocab.memory import fmt_bytes
    from deepcompile.record.reader import memory_view
    from deepcompile.report.html import render_report
    from deepcompile.widgets import Inspector
    from deepcompile.widgets.timeline_view import peak_label, view_peak

    pk = view_peak(memory_view(planned_run, 0))
    assert pk and pk["source"] == "measured"
    label, b = peak_label(pk), fmt_bytes(pk["bytes"])
    insp = Inspector(planned_run, follow=False)
    assert label in insp.m_runpeak.value                      # Memory tab
    assert label in insp.p_runs.value                          # runs table
    insp.whatif_now()
    assert label in insp.p_whatif.value                        # Predict / what-if: "this run"
    assert b in insp.model.passes.predict(insp.model.record)
    assert f"memory peak: {b}, measured" in summarize(planned_run)   # deepcompile inspect
    report = render_report(planned_run, tmp_path / "r.html").read_text()
    assert f"peak {b}" in report                               # the report


def _schedule_texts(insp):
    lay = insp.model.schedule.figure_dict()["layout"]
    return " ".join(str(a.get("text")) for a in lay.get("annotations", []))


def test_after_pass_list_names_each_compile(planned_run):
    """A graph compiled twice (the re-compile after the profiled step) lists each version with
    its compile and the step it happened at (the record's numbering), never two identical names."""
    from deepcompile.record.reader import read_run
    from deepcompile.widgets.graph_view import GraphModel

    g = GraphModel(read_run(planned_run, 0))
    labels = g.version_labels
    assert len(labels) == len(g.pass_names) and len(set(labels)) == len(labels)
    names = [x.split(": ", 1)[1] for x in labels]
    assert len(set(names)) == len(names), labels          # each compile's versions read differently
    assert "compile 1/2, step 1" in labels[0] and "compile 2/2, step 3" in labels[-1], labels


def test_one_prediction_in_every_view(planned_run, tmp_path):
    """One edit, one predicted step and peak: the Passes tab's what-if table, its one-line
    Predict, the Schedule tab's what-if lane, the report and `deepcompile inspect` all state the
    WhatIf's own headline (the lane never its bars' span); so does the unedited plan."""
    pytest.importorskip("ipywidgets")
    from deepcompile.report.summary import summarize
    from deepcompile.plan.whatif import prediction
    from deepcompile.report.html import render_report
    from deepcompile.widgets import Inspector

    insp = Inspector(planned_run, follow=False)
    pm = insp.model.passes
    pm.set_value("selective_unshard", "budget_mb", 0.0)
    pm.set_value("prefetch", "budget_mb", 0.0)
    w = insp.whatif_now()
    assert w is not None, insp.whatif_error
    head = w.headline()
    assert f"{w.step_ms:.1f} ms" in head
    assert head in insp.p_whatif.value                                   # Passes tab: the table
    assert head in pm.predict(insp.model.record)                         # Passes tab: Predict's line
    lane = _schedule_texts(insp)
    assert head in lane, lane                                            # Schedule tab: the what-if lane
    assert "selective_unshard.budget_mb=0" in lane                       # ... labelled with its edit
    wi = [n for n in insp.model.schedule.numbers() if n["source"] == "what-if (predicted)"]
    assert wi and all(n["step_ms"] == w.step_ms for n in wi)             # ... and its numbers table
    edited = pm.whatif_passes()
    assert head in summarize(planned_run, passes=edited)                 # deepcompile inspect
    report = render_report(planned_run, tmp_path / "r.html", passes=edited).read_text()
    assert head in report                                                # the report
    # the recorded plan: the controls at the recorded values predict what the report and
    # inspect state for the run's own passes
    insp.reset_controls()
    w0 = insp.whatif_now()
    own, line = prediction(planned_run)
    assert own is not None, line
    assert w0.headline() == own.headline() and own.headline() in summarize(planned_run)
    assert own.headline() in render_report(planned_run, tmp_path / "r0.html").read_text()


def test_what_each_pass_bought_in_every_view(planned_run, tmp_path):
    """The per-pass table: a row per pass from zero3 on, each the what-if of the list up to that
    pass with the whole list's resolved values; its last row is the whole list's prediction. The
    Passes tab, the report and `deepcompile inspect` show the same rows."""
    pytest.importorskip("ipywidgets")
    from deepcompile.report.summary import summarize
    from deepcompile.plan.bought import pass_table
    from deepcompile.plan.whatif import predict_run
    from deepcompile.report.html import render_report
    from deepcompile.widgets import Inspector

    insp = Inspector(planned_run, follow=False)
    pm = insp.model.passes
    pm.set_value("selective_unshard", "budget_mb", 1000.0)   # keep every parameter gathered
    w = insp.whatif_now()
    assert w is not None, insp.whatif_error
    rows = insp.last_pass_rows
    assert [r.after for r in rows] == ["zero3", "prefetch", "selective_unshard"], rows
    assert rows[-1].step_ms == w.step_ms and rows[-1].peak_bytes == w.peak_bytes
    # a row is the what-if of its prefix, with the whole list's values
    first = predict_run(planned_run, [{"name": "zero3"}])
    assert rows[0].step_ms == first.step_ms and rows[0].peak_bytes == first.peak_bytes
    # keeping every parameter gathered costs memory and removes the gathers' exposed time
    assert rows[2].peak_bytes > rows[1].peak_bytes
    assert rows[2].exposed_comm_ms < rows[1].exposed_comm_ms, rows
    assert "dc-pass-table" in insp.p_whatif.value and "what each pass bought" in insp.p_whatif.value
    edited = pm.whatif_passes()
    assert [r.to_dict() for r in pass_table(planned_run, edited)] == [r.to_dict() for r in rows]
    text = summarize(planned_run, passes=edited)
    assert "what each pass bought" in text and f"{rows[0].step_ms:>8.1f} ms" in text, text
    report = render_report(planned_run, tmp_path / "r.html", passes=edited).read_text()
    assert "dc-pass-table" in report and f"{rows[1].step_ms:.1f} ms" in report


def test_graph_coloured_by_the_cost_models_error(planned_run, tmp_path):
    """Predicted against measured per node: plan.accuracy pairs the what-if of the run's own
    passes with the record's measured step node by node; the graph colours each box by the
    error it holds, the node detail states both times, the report lists the largest."""
    from deepcompile.plan.accuracy import node_errors
    from deepcompile.plan.whatif import prediction
    from deepcompile.record.reader import read_run
    from deepcompile.report.html import render_report
    from deepcompile.widgets.graph_view import GraphModel

    rows = node_errors(planned_run)
    assert rows, "the demo's record has a measured step and a prediction"
    assert [abs(r.error_us) for r in rows] == sorted((abs(r.error_us) for r in rows), reverse=True)
    rec = read_run(planned_run)
    w, _ = prediction(planned_run)
    r = rows[0]
    meas = sum(e["end_us"] - e["start_us"] for e in rec.schedule["events"]
               if e.get("source") == "measured" and (e["graph_id"], e["kind"], e["node"]) == (r.graph_id, r.kind, r.node))
    pred = sum(e["end_ms"] - e["start_ms"] for e in w.schedule
               if (e["graph_id"], e["kind"], e["node"]) == (r.graph_id, r.kind, r.node)) * 1e3
    assert r.measured_us == pytest.approx(meas, abs=1e-2) and r.predicted_us == pytest.approx(pred, abs=1e-2)

    g = GraphModel(rec, use_dot=False)
    g.kind, g.version = r.kind, len(g.versions()) - 1
    g.set_color("error")
    lg = g.legend()
    assert lg["mode"] == "error" and lg["compared"] > 0 and lg["max"] >= abs(r.error_us) - 1e-6, lg
    detail = g.node_detail_html(r.node)
    assert "cost model" in detail and "predicted" in detail and "measured" in detail, detail
    report = render_report(planned_run, tmp_path / "r.html").read_text()
    assert "dc-model-errors" in report and r.node in report


def test_reset_clears_the_whatif_and_a_low_limit_warns(planned_run):
    """Controls back to the recorded values: no edited prediction left in the table, no what-if
    lane left in the Schedule tab. A memory limit below the predicted peak re-plans or says, in
    a visible warning naming the limit and the peak, that it cannot."""
    pytest.importorskip("ipywidgets")
    from deepcompile.vocab.memory import fmt_bytes
    from deepcompile.widgets import Inspector

    insp = Inspector(planned_run, follow=False, whatif_delay_s=30.0)
    pm = insp.model.passes
    pm.set_value("selective_unshard", "budget_mb", 0.0)
    w = insp.whatif_now()
    assert w is not None and "dc-whatif-table" in insp.p_whatif.value
    assert "what-if (predicted)" in {e["source"] for e in insp.model.schedule.whatif_events}
    pm.reset()
    insp.render(full=True)                          # what the notebook does
    assert insp.last_whatif is None and "dc-whatif-table" not in insp.p_whatif.value
    assert not insp.model.schedule.whatif_events
    assert "what-if" not in _schedule_texts(insp)
    # a limit far below the peak (1 KiB): the what-if re-plans or warns, naming both numbers
    insp.p_limit.value = 1e-6
    w = insp.whatif_now()
    insp._whatif_timer and insp._whatif_timer.cancel()
    assert w is not None, insp.whatif_error
    assert w.warnings, "a limit below the predicted peak changed nothing and warned of nothing"
    html = insp.p_whatif.value
    assert "dc-whatif-warning" in html and fmt_bytes(w.peak_bytes) in html and fmt_bytes(int(1e-6 * 2**30)) in html


def test_run_switches_to_the_new_run_and_compares(planned_run, tmp_path):
    """Run from the Passes tab: the demo again with the edit, profiling a step; the run list
    switches to it at once; when it ends the two are compared side by side and what-if works on it."""
    pytest.importorskip("ipywidgets")
    from deepcompile.widgets import Inspector

    base = tmp_path / "base"
    shutil.copytree(planned_run, base)
    insp = Inspector(base, follow=False)
    insp.model.passes.set_value("selective_unshard", "budget_mb", 0.0)
    insp.p_steps.value = 3
    job = insp.run()
    assert job is not None, insp.p_msg.value
    new = tmp_path / "base-rerun1"
    assert insp.model.run_dir == new and insp.run_select.value == str(new) and insp.model.compare_base == base
    assert job.argv[job.argv.index("--profile-step") + 1] == "1" and "selective_unshard.budget_mb=0.0" in job.argv
    assert job.wait(timeout=600) == 0, job.tail(30)
    _wait(lambda: insp.model.record is not None and insp.model.record.path == new
          and insp.model.record.manifest["status"] == "complete", 60, "the new record")
    insp.stop()
    assert insp.model.record.profile, "a run launched from the Passes tab must record a profile"
    html = insp.p_compare.value
    assert "base (previous)" in html and "base-rerun1 (new)" in html and "step time" in html
    assert "nodes after selective_unshard" in html and html.count("(measured, at ") == 2
    assert insp.whatif_now() is not None, insp.p_whatif.value


SCRIPT = """import sys
from deepcompile.record.writer import RunRecorder
rec = RunRecorder(sys.argv[1], 0, 1, {"compiler": "eager", "passes": ["zero3"]})
for s in range(1, 4):
    rec.step(s, 0.01 * s, 1.0 / s)
    print(f"step {s}/3", flush=True)
rec.close()
"""


def test_run_relaunches_the_scripts_command_or_says_it_cannot(tmp_path):
    pytest.importorskip("ipywidgets")
    import subprocess

    from deepcompile.widgets import Inspector
    from deepcompile.widgets.launcher import RelaunchError, job_env

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = tmp_path / "run"
    subprocess.run([sys.executable, str(script), str(run)], env=job_env(), check=True, timeout=120, cwd=tmp_path)
    insp = Inspector(run, follow=False)
    out, argv = insp.model.rerun_command()
    assert argv == [sys.executable, str(script), str(tmp_path / "run-rerun1")], argv   # the script, not the demo
    job = insp.run()
    assert job is not None and "demo" not in job.argv, insp.p_msg.value
    assert insp.run_select.value == str(out)
    assert job.wait(timeout=120) == 0, job.tail(20)
    _wait(lambda: insp.model.steps.n_steps() == 3, 30, "the re-launched script's steps")
    insp.stop()
    # a record without a command: Run says so and starts nothing
    m = json.loads((run / "manifest.json").read_text())
    del m["command"]
    (run / "manifest.json").write_text(json.dumps(m))
    insp2 = Inspector(run, follow=False)
    with pytest.raises(RelaunchError, match="no launch command"):
        insp2.model.rerun_command()
    assert insp2.run() is None and insp2.job is None
    assert "no launch command" in insp2.p_msg.value and "dc-run-refused" in insp2.p_msg.value
    # one that cannot be run again (a multi-node job): its reason
    m["command"] = {"argv": [str(script), str(run)], "cwd": str(tmp_path), "executable": sys.executable,
                    "launcher": "torchrun", "world_size": 4, "env": {}, "relaunch": None,
                    "why_not": "a multi-node torchrun job (4 ranks, 2 on this node)"}
    (run / "manifest.json").write_text(json.dumps(m))
    insp3 = Inspector(run, follow=False)
    assert insp3.run() is None and "multi-node torchrun job" in insp3.p_msg.value


def test_live_steps_and_memory_appear_as_written(tmp_path):
    """Following a live run: before step 1 the note says it compiles; each step shows on its own
    within a poll or two of its line; the profiled step's memory timeline is plotted when written."""
    pytest.importorskip("ipywidgets")
    from deepcompile.vocab.memory import MEMORY_CATEGORIES
    from deepcompile.record.writer import RunRecorder
    from deepcompile.widgets import Inspector

    run = tmp_path / "live"
    env = {"torch": "x", "python": "3", "hostname": "h", "world_size": 1, "rank": 0, "devices": []}
    rec = RunRecorder(run, 0, 1, {"compiler": "eager", "passes": ["zero3"]}, env=env)
    insp = Inspector(run, follow=False, live_interval=0.1)
    insp.poll_once()
    assert "compiling" in insp.st_note.value and insp.model.steps.n_steps() == 0
    insp.follow()
    try:
        for s in range(1, 5):
            t0 = time.time()
            rec.step(s, 0.1, 1.0 / s, {"allocated": 1000 * s, "reserved": 4000, "peak": 2000 * s})
            _wait(lambda: insp.model.steps.n_steps() == s and f"{s} step(s)" in insp.st_note.value, 10,
                  f"step {s} in the view")
            assert time.time() - t0 < 5.0
        assert not insp.st_mem.outputs
        cats = {"parameter_shards": 1000, "activations": 3000}
        rec.memory_timeline({"source": "measured", "step": 1, "categories": list(MEMORY_CATEGORIES),
                             "samples": [{"t_ms": 0.0, "graph_id": 0, "kind": "forward", "node": "mm", "node_index": 1,
                                          "by_category": cats, "allocated_bytes": 4000}],
                             "peak": {"bytes": 4000, "where": "graph 0 forward, node mm", "t_ms": 0.0,
                                      "by_category": cats, "source": "measured"}})
        _wait(lambda: bool(insp.st_mem.outputs), 10, "the live memory timeline")
        spec = insp.st_mem.outputs[0]["data"]["application/vnd.plotly.v1+json"]
        assert {t.get("name") for t in spec["data"]} >= {"parameter shards", "activations"}
    finally:
        insp.stop()
        rec.close()


def test_live_schedule_follows_each_sampled_step(tmp_path):
    """A live run rewrites its schedule at each sampled step (the demo profiles a steady step now
    and then); the polling inspector reloads it (at most every reload_every_s) and the Schedule
    tab shows the newest measured timeline, not the first one it saw."""
    pytest.importorskip("ipywidgets")
    from deepcompile.record.writer import RunRecorder
    from deepcompile.widgets import Inspector

    run = tmp_path / "live"
    env = {"torch": "x", "python": "3", "hostname": "h", "world_size": 1, "rank": 0, "devices": []}
    rec = RunRecorder(run, 0, 1, {"compiler": "eager", "passes": ["zero3"]}, env=env)
    rec.graph_version({"graph_id": 0, "kind": "forward", "after": "input", "nodes": [
        {"name": "x", "op": "placeholder", "target": "x", "args": [], "scope": ""},
        {"name": "mm", "op": "call_function", "target": "aten.mm.default", "args": ["x", "x"], "scope": ""}]})

    def sample(step: int, us: float) -> None:
        rec.step(step, us / 1e6, 1.0, {"allocated": 1, "reserved": 2, "peak": 3})
        rec.schedule([{"graph_id": 0, "kind": "forward", "node": "mm", "stream": "compute", "start_us": 0,
                       "end_us": us, "source": "measured"}], replace=True)

    insp = Inspector(run, follow=False, live_interval=0.1)
    insp.reload_every_s = 0.0
    try:
        for step, us in ((1, 100.0), (2, 250.0)):
            sample(step, us)
            time.sleep(0.01)   # a new mtime even on coarse clocks
            _wait(lambda: insp.poll_once() is not None and insp.model.schedule is not None and any(
                e.get("source") == "measured" and e["end_us"] == us for e in insp.model.schedule.events),
                10, f"the schedule of step {step}")
    finally:
        rec.close()


def test_live_header_and_steps_tab_agree_at_every_poll(tmp_path):
    """The header's step count and status come from the same polled steps as the Steps tab: at
    every poll of a run being written they agree (the header never lags on a stale record)."""
    pytest.importorskip("ipywidgets")
    from deepcompile.record.writer import RunRecorder
    from deepcompile.widgets import Inspector

    run = tmp_path / "live"
    env = {"torch": "x", "python": "3", "hostname": "h", "world_size": 1, "rank": 0, "devices": []}
    rec = RunRecorder(run, 0, 1, {"compiler": "eager", "passes": ["zero3"]}, env=env)
    try:
        rec.step(1, 0.5, 1.0, {"allocated": 1000, "reserved": 4000, "peak": 2000})
        insp = Inspector(run, follow=False, live_interval=0.1)
        insp.reload_every_s = 1e9                    # the record is not re-read: only the steps are
        insp.poll_once()
        if insp.model.record is None:
            pytest.skip("this record is not readable before its first graph")
        for s in range(2, 12):
            rec.step(s, 0.1, 1.0 / s, {"allocated": 1000 * s, "reserved": 4000, "peak": 2000 * s})
            insp.poll_once()
            n = insp.model.steps.n_steps()
            assert n == s and f"{n} step(s)" in insp.st_note.value
            assert f", {n} step(s);" in insp.header_text(), (insp.header_text(), n)
            assert f", {n} step(s);" in insp.message.value        # the header shown
    finally:
        rec.close()


def test_live_steps_plot_each_steps_peak_by_category(tmp_path):
    """The live view stacks each step's peak by category (steps.jsonl's mem.by_category) as the
    steps are written, names the remainder as such, and says how the split was made; a CPU run
    (no activations) draws its resident set as a line on its own axis, not in the stack."""
    pytest.importorskip("ipywidgets")
    from deepcompile.record.writer import RunRecorder
    from deepcompile.widgets import Inspector

    run = tmp_path / "live"
    env = {"torch": "x", "python": "3", "hostname": "h", "world_size": 1, "rank": 0, "devices": []}
    rec = RunRecorder(run, 0, 1, {"compiler": "eager", "passes": ["zero3"]}, env=env)
    insp = Inspector(run, follow=False, live_interval=0.1)
    insp.poll_once()
    how = "the allocator peak split"
    for s in (1, 2):
        cats = {"parameter_shards": 1000, "gathered": 200 * s, "gradients": 300, "optimizer_state": 2000,
                "activations": 500 * s, "offloaded": 50}
        rec.step(s, 0.1, 1.0, {"allocated": 3000, "reserved": 9000, "peak": 4000 + 700 * s, "by_category": cats,
                                "split": how})
        assert insp.poll_once() and insp.model.steps.n_steps() == s
        fig = insp.model.steps.figure()
        bars = {t.name: list(t.y) for t in fig.data if t.type == "bar"}
        assert set(bars) == {"parameter shards", "gathered", "gradients", "optimizer state",
                             "activations (remainder of the peak)"}   # offloaded is host memory: not stacked
        assert len(bars["gathered"]) == s
        assert bars["gathered"][-1] / bars["parameter shards"][-1] == pytest.approx(200 * s / 1000)
        assert "memory per step by category" in fig.layout.annotations[2].text
        assert how in insp.st_note.value
    spec = insp.st_out.outputs[0]["data"]["application/vnd.plotly.v1+json"]
    assert any(t.get("type") == "bar" and t.get("meta", {}).get("category") == "activations" for t in spec["data"])
    # a CPU run: no activations, the resident set is a line
    run2 = tmp_path / "cpu"
    rec2 = RunRecorder(run2, 0, 1, {"compiler": "eager"}, env=env)
    rec2.step(1, 0.1, 1.0, {"allocated": 5 << 20, "reserved": 5 << 20, "peak": 6 << 20,
                            "by_category": {"parameter_shards": 1000, "optimizer_state": 2000}, "split": "cpu"})
    from deepcompile.widgets.steps_view import StepsModel

    sm = StepsModel(run2)
    sm.poll()
    fig = sm.figure()
    assert {t.name for t in fig.data if t.type == "bar"} == {"parameter shards", "optimizer state"}
    rss = [t for t in fig.data if t.type == "scatter" and "resident set" in (t.name or "")]
    assert rss
    # the resident set (6 MiB) is on its own axis: the categories' axis is scaled to their few KiB,
    # so the bars are not slivers under the process's memory
    bars = [t for t in fig.data if t.type == "bar"]
    assert all(t.yaxis == bars[0].yaxis for t in bars) and rss[0].yaxis != bars[0].yaxis
    assert max(sum(t.y[0] for t in bars), 0) > 1.0        # in KiB-scaled units, not a fraction of MiB
    assert "process" in fig.layout[rss[0].yaxis.replace("y", "yaxis")].title.text
    rec.close()
    rec2.close()


def test_steps_time_range_follows_the_steady_steps_past_a_stalled_one(tmp_path):
    """The step-time panel's range follows the steady steps: the compile step and a single step
    that stalled on a busy machine are above it, and the note says so (CI's browser run saw a
    1.7 s step among ~30 ms ones, and the compile step then set the scale)."""
    from deepcompile.record.writer import RunRecorder
    from deepcompile.widgets.steps_view import StepsModel

    env = {"torch": "x", "python": "3", "hostname": "h", "world_size": 1, "rank": 0, "devices": []}
    rec = RunRecorder(tmp_path / "run", 0, 1, {"compiler": "eager", "passes": ["zero3"]}, env=env)
    for s in range(1, 41):
        rec.step(s, 6.5 if s == 1 else 1.7 if s == 20 else 0.03 + 0.001 * (s % 3), 1.0, {})
    rec.close()
    sm = StepsModel(tmp_path / "run")
    sm.poll()
    fig = sm.figure()
    top = fig.layout.yaxis.range[1]
    assert 0.032 * 1e3 <= top < 0.1 * 1e3, top          # ms: over the steady steps, under the stall
    assert any("step 1 (compile): 6.5 s" in a.text and "1 slower step(s)" in a.text for a in fig.layout.annotations)
