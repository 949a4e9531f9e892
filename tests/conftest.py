"""Shared fixtures: one real 2-rank CPU demo run for the record, report and CLI tests."""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# one OpenMP thread per process unless the caller says otherwise, as torchrun sets for several ranks
# on one host: the suite runs 2 ranks (and 2 pytest workers) on 2 cores, and torch's default of one
# thread per core would put 4-8 spinning OpenMP threads on them (about 10% slower, measured). Set
# before anything imports torch, and so before the fork server starts (tests/dist_utils.py)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# deepcompile's plan cache (deepcompile/plan/cache.py, on by default) would let a default-plan run
# reuse the plan an earlier test (or an earlier pytest run) stored, and skip the warm-up and the
# profiling step that test is about: the suite never touches the user's cache, and each test gets
# its own (the autouse fixture below); ranks are spawned with this environment
os.environ["DEEPCOMPILE_PLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="dc_plans_session_")
atexit.register(shutil.rmtree, os.environ["DEEPCOMPILE_PLAN_CACHE_DIR"], True)


@pytest.fixture(autouse=True)
def _own_plan_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DEEPCOMPILE_PLAN_CACHE_DIR", str(tmp_path_factory.mktemp("plans")))


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, "-m", "deepcompile", *args], cwd=cwd or REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def shared_demo(tmp_path_factory, name: str, *args: str, timeout: float = 300) -> Path:
    """``python -m deepcompile demo *args --out DIR`` once per test session, not once per xdist
    worker: the first worker to ask runs it under a file lock in the workers' common temporary
    directory, the others wait for it and read the same record (the fixtures that use this only
    read their record; a test that edits one edits a copy). A demo that fails leaves no marker, so
    each worker that asks runs it again and reports its own failure."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent          # pytest-of-USER/pytest-N, above each worker's popen-gwK
    root = base / f"shared-{name}"
    root.mkdir(exist_ok=True)
    out, done = root / "run", root / "done"
    with FileLock(str(root / "lock"), timeout=timeout + 600):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)   # a failed attempt's partial record
            r = run_cli("demo", *args, "--out", str(out), timeout=timeout)
            assert r.returncode == 0, f"demo failed ({r.returncode}):\nSTDOUT:\n{r.stdout}\nSTDERR:\n{r.stderr}"
            done.write_text(r.stdout)
    return out


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Path:
    """``python -m deepcompile demo --ranks 2 --steps 3 --passes zero3`` on CPU (gloo), once per
    session: zero3 only, no profiling step (the demo's default plan is tested in test_memory_truth)."""
    out = shared_demo(tmp_path_factory, "demo", "--ranks", "2", "--steps", "3", "--cpu", "--passes", "zero3")
    lines = (out.parent / "done").read_text().strip().splitlines()
    assert lines[-1] == f"report: {out / 'report.html'}", lines
    assert sum(ln.startswith("step ") for ln in lines) == 3, lines
    return out


@pytest.fixture(scope="session")
def planned_run(tmp_path_factory) -> Path:
    """A CPU demo whose record holds a profile (step 1 profiled) and a prefetch with a visible
    effect (a 64 MiB budget, no fusion): zero3, prefetch and selective_unshard over 4 steps. Once
    per session, for the what-if and the widget tests."""
    return shared_demo(tmp_path_factory, "planned", "--ranks", "2", "--steps", "4", "--cpu",
                       "--passes", "zero3,prefetch,selective_unshard", "--profile-step", "1",
                       "--pass-param", "prefetch.budget_mb=64", "--pass-param", "prefetch.fuse_mb=0",
                       timeout=600)
