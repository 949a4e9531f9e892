"""A real browser: JupyterLab (headless, random port, no token) + Debian's Chromium through
Playwright. Notebook 01 is run from the Run menu; then the Inspector's graph SVG and the plotly
schedule must be in the DOM; a click on a schedule bar must select its node in the graph; a diff
highlight must appear after choosing two passes; a click on a module box in the SVG must expand
it (its inner boxes appear in the DOM); the diff against zero3 lists prefetch's moved collectives
from -> to; editing a parameter in the Passes tab changes the what-if's predicted numbers (no
re-compile); the run's one peak is the same number in the Memory tab, the what-if table, the
exported report and ``deepcompile inspect``; and a screenshot of every tab is saved (paths printed)."""
from __future__ import annotations

import os
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
            for path in shots:
                print(f"screenshot: {path}")
        except BaseException:
            if page is not None:  # evidence for the failure report
                page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
                (tmp_path / "failure.html").write_text(page.content())
            raise
        finally:
            browser.close()
