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


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Path:
    """``python -m deepcompile demo --ranks 2 --steps 3 --passes zero3`` on CPU (gloo), once per
    session: zero3 only, no profiling step (the demo's default plan is tested in test_memory_truth)."""
    out = tmp_path_factory.mktemp("demo") / "run"
    r = run_cli("demo", "--ranks", "2", "--steps", "3", "--cpu", "--passes", "zero3", "--out", str(out))
    assert r.returncode == 0, f"demo failed ({r.returncode}):\nSTDOUT:\n{r.stdout}\nSTDERR:\n{r.stderr}"
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == f"report: {out / 'report.html'}", r.stdout
    assert sum(ln.startswith("step ") for ln in lines) == 3, r.stdout
    return out
