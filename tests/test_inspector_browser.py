"""A real browser: JupyterLab (headless, random port, no token) + Debian's Chromium through
Playwright. Notebook 01 is run from the Run menu; then the Inspector's graph SVG and the plotly
schedule must be in the DOM; a click on a schedule bar must select its node in the graph; a diff
highlight must appear after choosing two passes; a click on a module box in the SVG must expand
it (its inner boxes appear in the DOM); the diff against zero3 lists prefetch's moved collectives
from -> to; editing a parameter in the Passes tab changes the what-if's predicted numbers (no
re-compile); the run's one peak is the same number in the Memory tab, the what-if table, the
exported report and ``deepcompile inspect``; the what-if shows what each pass bought (a row per
pass, with numbers); and a screenshot of every tab is saved (paths printed).

Then, in the same browser: the Graph tab coloured by the cost model's error per node (predicted
against measured, ``plan.accuracy.node_errors``) colours the boxes on the legend's scale; and two
runs started with the Passes tab's Run button, each followed live in the Steps tab (at several
polls the header's step count and the Steps tab's agree; once ended, the step-time panel's range
follows the steady steps, the compile step above it). The first edit moves the plan to fused
gathers (prefetch budget 0, fuse 128 MiB) and re-measures it with more steps; the second edit,
``selective_unshard.budget_mb=0`` on that run (what the fused gathers do in the backward: gather
again instead of keeping; the edit benchmarks/whatif_cpu.py measured -13.5% off on the CPU), is
predicted by the what-if from the first run's record and then Run: the new run's measured median
step must be within 20% of that prediction (predicted, measured and the error are printed). The
machine is shared: the CPU the job, the kernel, Chromium and other processes use during each run's
steps is measured (/proc) and printed; an edit's run during which other processes used the machine
unlike during the base run's is measured again (four runs at most) where the base run was quiet
enough for the bound to count, and the 20% bound is asserted only where other processes used at
most QUIET_OTHERS cores (a timing on a shared machine measures the neighbours)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--no-first-run"]


# the centre (page coordinates) and node of the widest bar of rank 0's predicted compute lane
# (report.schedule_fig's traces: meta {source, rank, stream, wait}; customdata [node, ...] per bar)
BAR_JS = """(gd) => {
  const ti = gd.data.findIndex(t => t.type === 'bar' && t.meta && t.meta.source === 'predicted'
                                    && t.meta.stream === 'compute' && !t.meta.wait && t.meta.rank === 0);
  if (ti < 0) return null;
  const el = [...gd.querySelectorAll('.barlayer .trace')].find(
      e => e.__data__ && e.__data__[0] && e.__data__[0].trace && e.__data__[0].trace.index === ti);
  const pts = el ? el.querySelectorAll('.point') : [];
  let best = null, bi = -1;
  pts.forEach((p, i) => { const r = p.getBoundingClientRect();
                          if (r.width > 0 && (!best || r.width > best.width)) { best = r; bi = i; } });
  if (!best) return null;
  pts[bi].scrollIntoView({block: 'center'});       // a tall figure: the predicted panel may be below the fold
  best = pts[bi].getBoundingClientRect();
  const c = gd.data[ti].customdata[bi];
  return {x: best.x + best.width / 2, y: best.y + best.height / 2, name: String(Array.isArray(c) ? c[0] : c)};
}"""
TABS = ("Graph", "Schedule", "Memory", "Steps", "Passes & runs")

# the cells of an HTML table's body rows (header row left out), trimmed
TABLE_JS = "t => [...t.querySelectorAll('tr')].slice(1).map(r => [...r.cells].map(c => c.textContent.trim()))"
# the fill of each box the graph SVG draws (its first shape), by box key
FILLS_JS = """(svg) => Object.fromEntries([...svg.querySelectorAll("[id^='group-']")].map(g => {
  const s = g.querySelector('polygon, rect, path');
  return [g.id.slice(6), s ? (s.getAttribute('fill') || '').toLowerCase() : ''];
}))"""
# one snapshot of the header line and the Steps tab's note (both read in the same JS turn)
LIVE_JS = """(insp) => {
  const h = document.querySelector(insp + ' .dc-message'), n = document.querySelector(insp + ' .dc-steps-note');
  return [h ? h.textContent : '', n ? n.textContent : ''];
}"""
HEADER_RE = re.compile(r"^(.*): (\w+), \d+ rank\(s\), \d+ graph\(s\), (\d+) step\(s\); torch")
NOTE_RE = re.compile(r"^(\w+); (\d+) step\(s\)")
RUN_STEPS = 300      # steps of each run started from the Passes tab: a median of ~300 steady steps


def _cpu_sample() -> tuple[float, float, dict[int, tuple[float, str]]]:
    """(wall s, CPU s the machine was busy, {pid: (CPU s, what)}) of this process and its descendants,
    ``what`` one of "job" (the demo and its ranks), "kernel", "chromium", "test" (JupyterLab, pytest,
    Playwright): the CPU each part of this test uses, apart from other processes'. A process's CPU
    counts its reaped children's (cutime, cstime), so one that ends between two samples is still
    counted, in its parent."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    busy = (sum(v) - v[3] - v[4]) / tick                  # all but idle and iowait
    procs = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            procs[int(d)] = (int(rest[1]), sum(int(x) for x in rest[11:15]) / tick)   # ppid, u+s+cu+cs
    ours, todo = {}, [(os.getpid(), "test")]
    while todo:
        pid, what = todo.pop()
        if pid in procs and pid not in ours:
            if what == "test":
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cl = f.read()
                except OSError:
                    cl = b""
                what = ("job" if b"\0deepcompile\0demo\0" in cl else "kernel" if b"ipykernel" in cl
                        else "chromium" if b"chrom" in cl else "test")
            elif what == "kernel":   # the kernel's children: the job, or a layout's dot
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        what = "job" if b"\0deepcompile\0demo\0" in f.read() else "kernel"
                except OSError:
                    pass
            ours[pid] = (procs[pid][1], what)
            todo += [(c, what) for c, (pp, _) in procs.items() if pp == pid]
    return time.monotonic(), busy, ours


def _cores(samples) -> dict[str, float] | None:
    """Cores kept busy over a run's :func:`_cpu_sample` samples by the demo job, the kernel, Chromium,
    the rest of this test and other processes. Only intervals over which the job's processes stayed
    the same count (a job that ends is reaped, with all its CPU, by the kernel); None without one."""
    dt, busy, parts = 0.0, 0.0, {"job": 0.0, "kernel": 0.0, "chromium": 0.0, "test": 0.0}
    for a, b in zip(samples, samples[1:]):
        ja, jb = ({p for p, (_, w) in x[2].items() if w == "job"} for x in (a, b))
        if not ja or ja != jb:
            continue
        dt += b[0] - a[0]
        busy += b[1] - a[1]
        for w in parts:
            parts[w] += sum(c for c, x in b[2].values() if x == w) - sum(c for c, x in a[2].values() if x == w)
    if dt <= 0:
        return None
    out = {w: v / dt for w, v in parts.items()}
    out["others"] = max(0.0, busy - sum(parts.values())) / dt
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    pytest.importorskip("jupyterlab")
    pytest.importorskip("ipywidgets")
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(REPO / "notebooks" / "01_quickstart.ipynb", root / "01_quickstart.ipynb")
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["DC_NOTEBOOK_WORKDIR"] = str(tmp_path / "work")
    env["JUPYTER_CONFIG_DIR"] = str(tmp_path / "jcfg")        # no user config leaks in
    env["JUPYTERLAB_SETTINGS_DIR"] = str(tmp_path / "jsettings")
    env["JUPYTERLAB_WORKSPACES_DIR"] = str(tmp_path / "jws")
    env.setdefault("OMP_NUM_THREADS", "1")
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         "--allow-root", "--IdentityProvider.token=", "--ServerApp.password=",
         "--LabApp.extension_manager=readonly", "--ServerApp.disable_check_xsrf=True",
         f"--ServerApp.root_dir={root}", "--LabApp.news_url=None", "--LabApp.check_for_updates_class="
         "jupyterlab.NeverCheckForUpdate", "--ServerApp.open_browser=False"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                log.flush()
                pytest.fail("JupyterLab did not start:\n" + (tmp_path / "jupyterlab.log").read_text()[-3000:])
            time.sleep(0.5)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


@pytest.mark.timeout(900)
def test_notebook_01_in_jupyterlab(jupyterlab, tmp_path):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, timeout=60_000)
        page = None
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.set_default_timeout(60_000)
            page.goto(f"{jupyterlab}/lab/tree/01_quickstart.ipynb", timeout=90_000)
            page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=90_000)
            # kernel idle and settled (JupyterLab may swap the session's first kernel just after opening)
            idle = ".jp-Notebook-ExecutionIndicator[data-status='idle']"
            page.wait_for_selector(idle, state="attached", timeout=120_000)
            page.wait_for_timeout(1500)
            page.wait_for_selector(idle, state="attached", timeout=120_000)

            def accept_dialogs():  # e.g. "Select Kernel" when the session is slow to attach
                for _ in range(3):
                    d = page.locator(".jp-Dialog .jp-mod-accept")
                    if not d.count():
                        return
                    d.first.click()
                    page.wait_for_timeout(1000)

            def run_all():
                page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
                page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

            # Run > Run All Cells. A dialog (kernel selection) that comes up before any cell started
            # is accepted and Run All issued again: nothing ran yet, so a new kernel loses nothing.
            # Once a cell has started no dialog is touched (a new kernel would kill the job).
            started = ("() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]"
                       ".some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))")
            accept_dialogs()
            run_all()
            issued, deadline = time.time(), time.time() + 120
            while not page.evaluate(started):
                assert time.time() < deadline, "Run All Cells did not start the notebook"
                if page.locator(".jp-Dialog .jp-mod-accept").count() or time.time() - issued > 30:
                    if page.locator(".jp-Dialog").count():
                        accept_dialogs()
                    else:
                        page.keyboard.press("Escape")   # a menu left open
                    page.wait_for_selector(idle, state="attached", timeout=120_000)
                    if not page.evaluate(started):
                        run_all()
                        issued = time.time()
                    continue
                page.wait_for_timeout(300)
            insp = ".dc-inspector"
            # the last cell prints the exported report's path: the whole notebook ran
            page.wait_for_selector(".jp-OutputArea-output:has-text('quickstart.html')", timeout=300_000)
            page.wait_for_selector(f"{insp} .dc-graph-view svg.dc-graph", timeout=300_000)
            svg_box = page.locator(f"{insp} .dc-graph-view svg.dc-graph").first.bounding_box()
            assert svg_box and svg_box["height"] > 100
            # schedule tab: a plotly timeline
            page.locator(f"{insp} .lm-TabBar-tab", has_text="Schedule").first.click()
            page.wait_for_selector(f"{insp} .dc-schedule .js-plotly-plot", timeout=60_000)
            assert page.locator(f"{insp} .dc-schedule .js-plotly-plot .barlayer .point").count() > 20
            # a click on a bar of the predicted compute lane (its bars are graph nodes) selects the node
            bar = page.locator(f"{insp} .dc-schedule .js-plotly-plot").first.evaluate(BAR_JS)
            assert bar, "no bar of the predicted compute lane found"
            page.mouse.move(bar["x"], bar["y"])
            page.wait_for_timeout(300)
            page.mouse.click(bar["x"], bar["y"])
            page.wait_for_function(
                "(s) => [...document.querySelectorAll(s)].some(e => e.textContent.includes('selected: '))",
                arg=f"{insp} .dc-schedule .legendtext", timeout=60_000)     # the outline trace's legend entry
            # back to the graph tab: the node's box is outlined, the summary names it
            page.locator(f"{insp} .lm-TabBar-tab", has_text="Graph").first.click()
            page.wait_for_selector(f"{insp} .dc-graph-view svg .dc-selected", timeout=60_000)
            assert f"selected {bar['name']}" in page.locator(f"{insp} .dc-graph-summary").inner_text()
            # no diff yet, then choose "diff vs 0: input"
            assert page.locator(f"{insp} .dc-graph-view .dc-diff").count() == 0
            page.locator(f"{insp} .dc-diff-pass select").select_option(index=1)   # "0: input" (its compile named)
            page.wait_for_selector(f"{insp} .dc-graph-view svg .dc-diff.dc-added", timeout=60_000)
            assert "diff: +" in page.locator(f"{insp} .dc-graph-summary").inner_text()
            # a click on a module box in the SVG expands it: its inner boxes appear
            boxes = f"{insp} .dc-graph-view svg [id^='group-']"
            n_before = page.locator(boxes).count()
            page.locator(f"{insp} .dc-graph-view svg [id='group-blocks.1']").first.click()
            page.wait_for_selector(f"{insp} .dc-graph-view svg [id^='group-blocks.1.']", state="attached",
                                   timeout=60_000)
            assert page.locator(boxes).count() > n_before
            assert "(1 open)" in page.locator(f"{insp} .dc-graph-summary").inner_text()
            page.locator(f"{insp} .dc-graph-view").scroll_into_view_if_needed()
            page.screenshot(path=str(tmp_path / "inspector.png"))
            assert (tmp_path / "inspector.png").stat().st_size > 20_000

            # the moved-collective view: the version after prefetch, diffed against zero3 (of the same,
            # latest compile), lists prefetch's moves from -> to (selective_unshard after it keeps
            # everything gathered in this tiny model, so the final version has no moves to show)
            labels = [t.strip() for t in page.locator(f"{insp} .dc-pass select option").evaluate_all(
                "els => els.map(e => e.value)")]   # the text has &nbsp; where the value has a space
            def after(label):  # "4: prefetch · compile 2/2, step 3" -> "prefetch"
                return label.split(": ", 1)[1].split(" · ")[0]

            after_pf = [t for t in labels if after(t) == "prefetch"][-1]
            before_pf = [t for t in labels if after(t) == "zero3" and int(t.split(":")[0]) < int(after_pf.split(":")[0])][-1]
            page.locator(f"{insp} .dc-pass select").select_option(value=after_pf)
            page.wait_for_timeout(1000)
            page.locator(f"{insp} .dc-diff-pass select").select_option(value=before_pf)
            page.wait_for_selector(f"{insp} .dc-moves .dc-moves-table", timeout=60_000)
            moves = page.locator(f"{insp} .dc-moves").inner_text()
            assert "collective(s) moved" in moves and "→" in moves, moves[:500]
            page.wait_for_selector(f"{insp} .dc-graph-view svg[data-dc-moves]", state="attached", timeout=60_000)
            assert page.locator(f"{insp} .dc-graph-view .dc-chip-moved").count() > 0

            # what-if: an edit in the Passes tab changes the predicted numbers, without a run
            page.locator(f"{insp} .lm-TabBar-tab", has_text="Passes & runs").first.click()
            page.locator(f"{insp} .dc-predict").first.click()
            page.wait_for_selector(f"{insp} .dc-whatif .dc-whatif-step", timeout=120_000)
            before = page.locator(f"{insp} .dc-whatif-table").inner_text()
            box = page.locator(f"{insp} .dc-param-selective_unshard-budget_mb input").first
            box.fill("0")
            box.press("Enter")
            page.wait_for_function(
                "([s, b]) => { const t = document.querySelector(s); return t && t.innerText !== b; }",
                arg=[f"{insp} .dc-whatif-table", before], timeout=120_000)
            after = page.locator(f"{insp} .dc-whatif-table").inner_text()
            step_b = page.locator(f"{insp} .dc-whatif-step").inner_text()
            assert after != before and step_b.endswith("ms"), (before, after)
            secs = float(page.locator(f"{insp} .dc-whatif-seconds").inner_text().split()[0])
            assert secs < 2.0, f"an edit's what-if took {secs} s"

            # what each pass bought (plan/bought.py pass_table), under the what-if: a row per pass of
            # the edited list, numbers in every column; its last row is the whole list's prediction
            pt = page.locator(f"{insp} .dc-whatif .dc-pass-table").first
            pt.wait_for(state="visible", timeout=60_000)
            cells = pt.evaluate(TABLE_JS)
            assert [r[0] for r in cells] == ["zero3", "prefetch", "selective_unshard"], cells
            for i, (_, step, exposed, peak_b, change) in enumerate(cells):
                assert re.fullmatch(r"\d+\.\d ms", step) and re.fullmatch(r"\d+\.\d ms", exposed), cells
                assert re.fullmatch(r"\d+(\.\d)? (B|KiB|MiB|GiB)", peak_b), cells
                assert (change == "") if i == 0 else re.fullmatch(r"[+-]\d+\.\d ms", change), cells
            assert cells[-1][1] == step_b, (cells, step_b)
            print("what each pass bought (selective_unshard.budget_mb=0 on the notebook's run): "
                  + "; ".join(f"after {r[0]}: step {r[1]}, exposed comm {r[2]}, peak {r[3]}"
                              + (f" ({r[4]})" if r[4] else "") for r in cells))

            # one peak across views: Memory tab == what-if's "this run" == report == deepcompile inspect
            this_run_peak = [ln for ln in after.splitlines() if ln.startswith("peak memory")][0]
            page.locator(f"{insp} .lm-TabBar-tab", has_text="Memory").first.click()
            page.wait_for_selector(f"{insp} .dc-peak .dc-peak-value", timeout=60_000)
            peak = page.locator(f"{insp} .dc-peak .dc-peak-value").inner_text().strip()
            assert "(measured" in peak and peak in this_run_peak, (peak, this_run_peak)
            from deepcompile.report.summary import summarize

            run_dir = tmp_path / "work" / "quickstart"   # DC_NOTEBOOK_WORKDIR of the fixture
            nbytes = peak.split(" (")[0]
            assert f"memory peak: {nbytes}, measured" in summarize(run_dir)
            assert f"peak {nbytes}" in (run_dir.parent / "quickstart.html").read_text()

            # a screenshot of every tab, saved beside the test's other files
            shots = []
            for i, tab in enumerate(TABS):
                page.locator(f"{insp} .lm-TabBar-tab", has_text=tab).first.click()
                page.wait_for_timeout(1500)
                # the tab bar at the top of the notebook's viewport: the picture shows the tab itself
                page.locator(f"{insp} .lm-TabBar").first.evaluate("e => e.scrollIntoView({block: 'start'})")
                page.wait_for_timeout(300)
                path = tmp_path / f"tab-{i}-{tab.split()[0].lower()}.png"
                page.screenshot(path=str(path), full_page=True)
                assert path.stat().st_size > 20_000, path
                shots.append(path)

            def tab(name):
                page.locator(f"{insp} .lm-TabBar-tab", has_text=name).first.click()
                page.wait_for_timeout(300)

            def shot(name, at=".lm-TabBar"):
                """A screenshot with ``at`` (in the inspector) at the top of the notebook's viewport."""
                page.locator(f"{insp} {at}").first.evaluate("e => e.scrollIntoView({block: 'start'})")
                page.wait_for_timeout(300)
                path = tmp_path / name
                page.screenshot(path=str(path), full_page=True)
                shots.append(path)

            # ---- the graph coloured by the cost model's error per node (predicted vs measured)
            tab("Graph")
            page.locator(f"{insp} .dc-diff-pass select").select_option(index=0)        # (no diff)
            page.wait_for_timeout(500)
            page.locator(f"{insp} .dc-pass select").select_option(value=labels[-1])    # the graph as it ran
            page.wait_for_function("(s) => !document.querySelector(s)", arg=f"{insp} .dc-graph-view .dc-diff",
                                   timeout=60_000)
            kind_fills = page.locator(f"{insp} .dc-graph-view svg.dc-graph").first.evaluate(FILLS_JS)
            page.locator(f"{insp} .widget-toggle-button", has_text=re.compile(r"^\s*error\s*$")).first.click()
            page.wait_for_selector(f"{insp} .dc-graph-view .dc-graph-legend:has-text('cost model error per box')",
                                   timeout=60_000)
            legend = page.locator(f"{insp} .dc-graph-view .dc-graph-legend").first.inner_text()
            n_cmp = re.search(r"\((\d+) nodes compared\)", legend)
            assert n_cmp and int(n_cmp.group(1)) > 0, legend
            top = page.locator(f"{insp} .dc-graph-view .dc-graph-legend span[style*='linear-gradient']").first \
                .evaluate("e => getComputedStyle(e).backgroundImage")   # the scale's stops, white .. red
            stops = ["#%02x%02x%02x" % tuple(map(int, c)) for c in
                     re.findall(r"rgb\((\d+), (\d+), (\d+)\)", top)]
            assert len(stops) >= 2 and stops[0] == "#ffffff", top
            # the boxes take the scale's colours: the largest error the top stop, the others between
            ramp = re.compile(r"#ff[0-9a-f]{4}")
            fills = {}
            deadline = time.time() + 60
            while time.time() < deadline:     # the order-based picture first, graphviz's swapped in
                fills = page.locator(f"{insp} .dc-graph-view svg.dc-graph").first.evaluate(FILLS_JS)
                if stops[-1] in fills.values():
                    break
                page.wait_for_timeout(500)
            on_scale = {k: f for k, f in fills.items() if ramp.fullmatch(f) and f != "#ffffff"}
            assert stops[-1] in fills.values() and len(set(on_scale.values())) >= 2, (stops, fills)
            assert any(kind_fills.get(k) != f for k, f in on_scale.items()), (kind_fills, fills)
            worst = [k for k, f in fills.items() if f == stops[-1]]
            print(f"colour by error: {n_cmp.group(1)} nodes compared, scale "
                  f"{page.locator(f'{insp} .dc-legend-min').first.inner_text()} .. "
                  f"{page.locator(f'{insp} .dc-legend-max').first.inner_text()}, {len(on_scale)} of {len(fills)} "
                  f"boxes coloured, largest error in {worst}")
            shot("graph-error.png")

            # ---- runs from the Passes tab, each followed live
            def set_param(cls, value):
                box = page.locator(f"{insp} .dc-param-{cls} input").first
                box.fill(str(value))
                box.press("Enter")

            def set_steps(n):
                box = page.locator(f"{insp} .widget-inline-hbox").filter(
                    has=page.locator("label", has_text=re.compile(r"^steps$"))).locator("input").first
                box.fill(str(n))
                box.press("Enter")

            def whatif_of(edit):
                """(predicted step ms, the what-if's text) once the what-if of ``edit`` is shown."""
                page.wait_for_function(
                    "([s, e]) => { const x = document.querySelector(s + ' .dc-whatif-edit');"
                    " return x && x.textContent === e && document.querySelector(s + ' .dc-whatif-step'); }",
                    arg=[f"{insp} .dc-whatif", edit], timeout=180_000)
                txt = page.locator(f"{insp} .dc-whatif").first.inner_text()
                return float(page.locator(f"{insp} .dc-whatif-step").first.inner_text().split()[0]), txt

            def runs_table():
                return {r[0]: r[1] for r in page.locator(f"{insp} .dc-runs").first.evaluate(TABLE_JS)}

            def show_run(name):
                """Choose a run in the run list; its record opens (header: complete)."""
                page.locator(f"{insp} .widget-dropdown").filter(
                    has=page.locator("label", has_text=re.compile(r"^run$"))).locator("select").first \
                    .select_option(value=str(run_dir.parent / name))
                page.wait_for_function("([s, p]) => { const h = document.querySelector(s);"
                                       " return h && h.textContent.startsWith(p + ': complete'); }",
                                       arg=[f"{insp} .dc-message", str(run_dir.parent / name)], timeout=120_000)

            CMD_JS = ("(s) => [...document.querySelectorAll(s)].map(c => c.textContent)"
                      ".filter(t => t.includes(' demo --out ')).join('\\n')")

            def run_and_follow(timeout=420):
                """Click Run; in the Steps tab read the header's and the Steps tab's step count at polls
                while the run writes steps; wait for the job to end. Returns the new run's name."""
                before = page.evaluate(CMD_JS, f"{insp} code")
                page.locator(f"{insp} .dc-run").first.click()
                page.wait_for_function(     # the command shown: a new run directory, the edited step count
                    "([s, b, n]) => { const t = [...document.querySelectorAll(s)].map(c => c.textContent)"
                    ".filter(t => t.includes(' demo --out ')).join('\\n'); return t && t !== b"
                    " && new RegExp('--steps ' + n + '( |$)').test(t); }",
                    arg=[f"{insp} code", before, RUN_STEPS], timeout=60_000)
                name = Path(re.search(r" --out (\S+)", page.evaluate(CMD_JS, f"{insp} code")).group(1)).name
                tab("Steps")
                agreed, transient = [], 0
                cpu = []            # CPU samples while the run's steady steps are written
                deadline = time.time() + timeout
                while True:
                    status = runs_table().get(name, "")
                    if not status.startswith("running") and status not in ("", "no record yet"):
                        break
                    assert time.time() < deadline, f"{name} did not end within {timeout} s ({status})"
                    head, note = page.evaluate(LIVE_JS, insp)
                    h, n = HEADER_RE.match(head.strip()), NOTE_RE.match(note.strip())
                    if h and n and h.group(1).endswith("/" + name) and h.group(2) == n.group(1) == "running":
                        if int(n.group(2)) >= 5:     # past the compile
                            cpu.append(_cpu_sample())
                        if h.group(3) == n.group(2):
                            if int(n.group(2)) > 0:
                                agreed.append(int(n.group(2)))
                        else:
                            # one poll's header and note are two widget messages: a read may fall
                            # between them; the next reads must agree again
                            transient += 1
                            for _ in range(30):
                                page.wait_for_timeout(100)
                                head, note = page.evaluate(LIVE_JS, insp)
                                h, n = HEADER_RE.match(head.strip()), NOTE_RE.match(note.strip())
                                if not (h and n) or h.group(3) == n.group(2):
                                    break
                            else:
                                pytest.fail(f"header and Steps tab disagree for 3 s: {head!r} vs {note!r}")
                    page.wait_for_timeout(250)
                assert status == "complete", (status, page.locator(f"{insp} .dc-runs").first.inner_text())
                print(f"live {name}: header == Steps tab at polls with step counts {sorted(set(agreed))} "
                      f"({len(agreed)} reads, {transient} read(s) between one poll's two messages)")
                assert len(set(agreed)) >= 3, f"{name}: fewer than 3 polls seen while running: {agreed}"
                cores[name] = _cores(cpu)
                # the ended run: opened again, both say complete with every step
                page.wait_for_function(
                    "([s, name, n]) => { const h = document.querySelector(s + ' .dc-message'),"
                    " t = document.querySelector(s + ' .dc-steps-note'); return h && t"
                    " && h.textContent.includes('/' + name + ': complete') && h.textContent.includes(n + ' step(s)')"
                    " && t.textContent.startsWith('complete; ' + n + ' step(s)'); }",
                    arg=[insp, name, RUN_STEPS], timeout=120_000)
                # its step-time panel follows the steady steps: the compile step (seconds) is above
                # the range and annotated, not the scale that flattens ~30 ms steps to the axis
                fig = page.wait_for_function(
                    "([s, t]) => { const gd = document.querySelector(s); const l = gd && gd._fullLayout;"
                    " return l && l.title && l.title.text.includes(t)"
                    " && {range: l.yaxis.range, notes: (l.annotations || []).map(a => a.text)}; }",
                    arg=[f"{insp} .dc-steps .js-plotly-plot", f"complete · {RUN_STEPS} step(s)"],
                    timeout=60_000).json_value()
                first = max(s["time_s"] for r in (0, 1)
                            for s in read_run(run_dir.parent / name, r).steps if s["step"] == 1) * 1e3
                assert fig["range"][1] < first / 2 and any("(compile)" in t for t in fig["notes"]), (fig, first)
                return name

            def compare_row(name):
                """(previous run's, new run's) measured median step in ms from the Passes tab's comparison."""
                tab("Passes & runs")
                page.wait_for_function(
                    "([s, name]) => { const t = document.querySelector(s); if (!t) return false;"
                    " const th = [...t.querySelectorAll('th')].map(e => e.textContent);"
                    " const r = [...t.querySelectorAll('tr')].find(r => r.cells[0].textContent.startsWith('step time'));"
                    " return th.some(x => x === name + ' (new)') && r && / ms$/.test(r.cells[2].textContent); }",
                    arg=[f"{insp} .dc-compare", name], timeout=120_000)
                row = [r for r in page.locator(f"{insp} .dc-compare").first.evaluate(TABLE_JS)
                       if r[0].startswith("step time")][0]
                return [None if x == "–" else float(x.split()[0]) for x in row[1:3]]

            from deepcompile.record.reader import read_run
            from deepcompile.record.steps import steady_median_ms

            def record_median(name):
                rec = read_run(run_dir.parent / name)
                return steady_median_ms(rec.steps, rec.config)

            # Two runs: the fused plan (prefetch budget 0, fuse 128 MiB, selective_unshard at its 64 MiB)
            # measured with RUN_STEPS steps, the base of the prediction; then selective_unshard.budget_mb=0
            # predicted on it and Run. The machine is shared: an edit's run during which other processes
            # (not this test's) kept OTHERS_APART cores more or less busy than during the base's ran on
            # another machine, in effect: it is measured again (at most MAX_RUNS runs in all).
            OTHERS_APART, MAX_RUNS = 0.3, 4
            # the 20% bound is asserted only where other processes used at most this many cores
            # during both runs: a timing on a shared machine (CI's parallel workers) measures the
            # neighbours. On 2 cores, beside this test's own JupyterLab and Chromium, 0.33 cores of
            # other processes already moved the edit's median by a quarter (+26.4%)
            QUIET_OTHERS = 0.15

            def fmt_cores(c):
                return "? cores" if c is None else ", ".join(f"{k} {v:.2f}" for k, v in c.items()) + " cores"

            cores: dict = {}     # run -> cores the job, this test's parts and other processes used in its steps
            base = None          # (name, measured median ms) of the fused plan's run
            runs, result = 0, None
            tab("Passes & runs")
            # the fused plan, edited from the notebook's values
            set_param("selective_unshard-budget_mb", 64)
            set_param("prefetch-budget_mb", 0)
            set_param("prefetch-fuse_mb", 128)
            set_steps(RUN_STEPS)
            pred1, _ = whatif_of("prefetch.budget_mb=0, prefetch.fuse_mb=128")
            name = run_and_follow()
            runs += 1
            _, meas1 = compare_row(name)
            med, n_steady = record_median(name)
            assert abs(med - meas1) <= 0.051, (med, meas1)    # the table's median is the record's
            print(f"run {name} (fused gathers): predicted {pred1:.1f} ms from the notebook's 5-step run, measured "
                  f"{meas1:.1f} ms ({pred1 / meas1 - 1:+.1%}; not asserted: that base has 2 steady steps); "
                  f"busy during its steps: {fmt_cores(cores[name])}")
            base = (name, meas1)
            last, alike = None, True
            while result is None:
                if runs >= MAX_RUNS:   # the neighbours never settled: the last run, its bound not asserted
                    result, alike = last, False
                    break
                if not page.locator(f"{insp} .dc-message").first.text_content().startswith(
                        str(run_dir.parent / base[0]) + ": complete"):
                    show_run(base[0])
                tab("Passes & runs")
                page.wait_for_selector(f"{insp} .dc-param-selective_unshard-budget_mb input", timeout=60_000)
                set_param("selective_unshard-budget_mb", 0)
                pred2, wtxt = whatif_of("selective_unshard.budget_mb=0")
                # calibrated on the base: the what-if's record is the run shown, at its measured median
                cal = re.search(r"its own plan measured ([\d.]+) ms a step", wtxt)
                assert cal and abs(float(cal.group(1)) - base[1]) <= 0.051, (wtxt, base)
                shot("whatif-edit.png", at=".dc-whatif")
                set_steps(RUN_STEPS)
                name = run_and_follow()
                runs += 1
                shot("steps-edit.png")
                prev, meas2 = compare_row(name)
                assert prev == base[1], (prev, base)
                med, n_steady = record_median(name)
                assert abs(med - meas2) <= 0.051, (med, meas2)
                print(f"run {name} (selective_unshard.budget_mb=0): busy during its steps: {fmt_cores(cores[name])}")
                a, b = cores[name], cores[base[0]]
                # measured again only where another run could lead to the 20% bound: once other
                # processes kept more than QUIET_OTHERS cores busy during the base's steps, the bound
                # is not asserted whatever the edit's next run measures (nor any other assertion of
                # a run, each already made on this one)
                if (a is not None and b is not None and abs(a["others"] - b["others"]) > OTHERS_APART
                        and b["others"] <= QUIET_OTHERS):
                    print(f"{name}: other processes used the machine unlike during {base[0]}: measured again")
                    last = (name, pred2, meas2, n_steady)
                    continue
                result = (name, pred2, meas2, n_steady)
            name, pred2, meas2, n_steady = result
            err = pred2 / meas2 - 1
            print(f"what-if vs measured ({name}: selective_unshard.budget_mb=0 on {base[0]}, {runs} runs): "
                  f"predicted {pred2:.1f} ms, measured {meas2:.1f} ms (median of {n_steady} steady steps), "
                  f"error {err:+.1%}")
            shot("compare-edit.png", at=".dc-compare")
            # a timing, asserted only where it measures the model: on a machine other processes
            # leave alone (CI runs the suite in parallel beside this test; there the accuracy is
            # benchmarks/whatif_cpu.py's, run alone)
            shared = max(cores[name]["others"], cores[base[0]]["others"]) if cores[name] and cores[base[0]] else None
            if not alike or (shared is not None and shared > QUIET_OTHERS):
                used = "?" if shared is None else f"{shared:.2f}"
                print(f"the 20% bound not asserted: other processes used {used} cores during the runs (more than "
                      f"{QUIET_OTHERS}, or unlike between them: a shared machine times the neighbours, not the model)")
            else:
                assert abs(err) <= 0.20, f"predicted {pred2:.1f} ms, measured {meas2:.1f} ms: {err:+.1%}"
            for path in shots:
                print(f"screenshot: {path}")
        except BaseException:
            if page is not None:  # evidence for the failure report
                page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
                (tmp_path / "failure.html").write_text(page.content())
            raise
        finally:
            browser.close()
