"""A real browser: JupyterLab (headless, random port, no token) + Debian's Chromium through
Playwright. Notebook 01 is run from the Run menu; then the Inspector's graph SVG and the plotly
schedule must be in the DOM, and a diff highlight must appear after choosing two passes."""
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


@pytest.mark.timeout(480)
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
            # kernel idle, then Run > Run All Cells (retried once if no cell started)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", state="attached",
                                   timeout=120_000)
            def accept_dialogs():  # e.g. "Select Kernel" when the session is slow to attach
                for _ in range(3):
                    d = page.locator(".jp-Dialog .jp-mod-accept")
                    if not d.count():
                        return
                    d.first.click()
                    page.wait_for_timeout(1000)

            # the launch cell (second code cell) must start; Run All is retried if it did not
            started = ("() => { const p = document.querySelectorAll('.jp-CodeCell .jp-InputPrompt');"
                       " return p.length > 1 && /\\[(\\*|\\d+)\\]/.test(p[1].textContent); }")
            for attempt in range(3):
                accept_dialogs()
                page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
                page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
                try:
                    page.wait_for_function(started, timeout=30_000)
                    break
                except Exception:
                    page.keyboard.press("Escape")
                    if attempt == 2:
                        raise
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
            # back to the graph tab; no diff yet, then choose "diff vs 0: input"
            page.locator(f"{insp} .lm-TabBar-tab", has_text="Graph").first.click()
            assert page.locator(f"{insp} .dc-graph-view .dc-diff").count() == 0
            page.locator(f"{insp} .dc-diff-pass select").select_option(label="0: input")
            page.wait_for_selector(f"{insp} .dc-graph-view svg .dc-diff.dc-added", timeout=60_000)
            assert "diff: +" in page.locator(f"{insp} .dc-graph-summary").inner_text()
            page.locator(f"{insp} .dc-graph-view").scroll_into_view_if_needed()
            page.screenshot(path=str(tmp_path / "inspector.png"))
            assert (tmp_path / "inspector.png").stat().st_size > 20_000
        except BaseException:
            if page is not None:  # evidence for the failure report
                page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
                (tmp_path / "failure.html").write_text(page.content())
            raise
        finally:
            browser.close()
