"""The package as installed, and what a user sees of it: the wheel holds every module, the Jupyter
layer and the native runtime's sources; the runtime is built once per machine and says so once;
the profiler's start and stop print nothing.

The full check (the wheel in a fresh environment, the demo run from outside the checkout) is in
``.ci/run``; these are the parts that fit the suite.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")   # Python 3.11+

REPO = Path(__file__).resolve().parents[1]


def _setuptools_config() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _tree_packages() -> dict[str, Path]:
    """{package name: folder} for every folder with an ``__init__.py`` that the wheel must hold."""
    out = {}
    for root, name in ((REPO / "deepcompile", "deepcompile"), (REPO / "widgets", "deepcompile.widgets"),
                       (REPO / "csrc", "deepcompile._csrc")):
        for init in root.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(root).parts
            out[".".join((name, *rel))] = init.parent
    return out


def test_pyproject_lists_every_package():
    cfg = _setuptools_config()
    listed = set(cfg["packages"])
    assert set(_tree_packages()) <= listed, f"missing from pyproject.toml's packages: {set(_tree_packages()) - listed}"
    assert cfg["package-dir"]["deepcompile.widgets"] == "widgets"
    assert cfg["package-dir"]["deepcompile._csrc"] == "csrc"
    # a folder deepcompile/widgets/ (even one holding only __pycache__) would be found first, as an
    # empty namespace package, and hide the mapped widgets/
    assert not (REPO / "deepcompile" / "widgets").exists(), "remove deepcompile/widgets/: it hides widgets/"


def test_wheel_holds_everything(tmp_path):
    """Built from a copy of the tree (a stale build/ folder in the checkout must not fill gaps)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("deepcompile", "widgets", "csrc"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp_path / "dist").glob("deepcompile-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    want = set()
    for pkg, folder in _tree_packages().items():
        prefix = pkg.replace(".", "/")
        kinds = (".py", ".cpp", ".h") if pkg == "deepcompile._csrc" else (".py",)
        want |= {f"{prefix}/{f.name}" for f in folder.iterdir() if f.is_file() and f.suffix in kinds}
    assert "deepcompile/widgets/inspector.py" in want and "deepcompile/_csrc/runtime.cpp" in want
    assert not want - names, f"missing from the wheel: {sorted(want - names)}"
    assert not any(n.startswith(("widgets/", "csrc/")) for n in names), "top-level folders leaked into the wheel"


def test_runtime_sources_come_from_the_package():
    import deepcompile._csrc
    from deepcompile.runtime import build

    assert {s.name for s in build._source_files()} >= set(build.SOURCES)
    assert Path(deepcompile._csrc.__file__).parent == REPO / "csrc"   # the editable install maps csrc/


# --------------------------------------------------------------------------- one build, one line
_FAKE_BUILD = r"""
import sys, time
import deepcompile.runtime.build as b

def fake_build(key_dir, build_dir):   # stands in for the compile: slow, then a finished build
    print("deepcompile: building the native runtime (fake)", file=sys.stderr, flush=True)
    time.sleep(2.0)
    (build_dir / "deepcompile_C.so").write_bytes(b"")
    (build_dir / "complete").write_text("deepcompile_C.so\n")
    return "built"

b._build = fake_build
b._import_built = lambda so: "imported " + so.name
print(b._load())
"""


def test_runtime_builds_once_per_machine(tmp_path):
    """Two processes (the ranks of a job) find no build at once: one builds and prints the line,
    the other waits for it and loads its module."""
    env = {**os.environ, "DEEPCOMPILE_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", _FAKE_BUILD], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err
        outs.append((out.strip().splitlines()[-1], err))
    assert sorted(o for o, _ in outs) == ["built", "imported deepcompile_C.so"], outs
    assert sum(e.count("building the native runtime") for _, e in outs) == 1, outs


def test_a_finished_build_is_loaded_without_a_lock(tmp_path, monkeypatch):
    from deepcompile.runtime import build

    monkeypatch.setenv("DEEPCOMPILE_CACHE", str(tmp_path / "cache"))
    build_dir = build._cache_dir(build.cache_key()) / "build"
    build_dir.mkdir(parents=True)
    (build_dir / "deepcompile_C.so").write_bytes(b"")
    (build_dir / "complete").write_text("deepcompile_C.so\n")
    monkeypatch.setattr(build, "_build", lambda *a: pytest.fail("rebuilt a finished build"))
    monkeypatch.setattr(build, "_import_built", lambda so: so)
    assert build._load() == build_dir / "deepcompile_C.so"
    assert not (build_dir.parent / "build.lock").exists()


# --------------------------------------------------------------------------- the profiler is quiet
def test_profiler_prints_no_usdt_lines(capfd, monkeypatch):
    """kineto's 'USDT: ... profiler_start' / 'profiler_stop' lines are dropped; the step's own
    output to stderr is kept."""
    import torch

    from deepcompile.profile import trace

    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)

    def step():
        os.write(2, b"the step's own line\n")
        torch.ones(8).add_(1)

    trace.measure_step(step)
    err = capfd.readouterr().err
    assert "the step's own line" in err
    assert "USDT" not in err and "profiler_start" not in err and "profiler_stop" not in err, err


def test_marker_filter_keeps_everything_else(capfd, monkeypatch):
    from deepcompile.profile import trace

    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    with trace._without_kineto_markers():
        os.write(2, b"kineto error: something real\n"
                    b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
                    b"last line, no newline")
    assert capfd.readouterr().err == "kineto error: something real\nlast line, no newline"
