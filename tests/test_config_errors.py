"""Bad configuration is a one-line ConfigError naming the key, never a raw Python error or a
silently accepted value: NaN/inf and out-of-range numbers in every declared parameter, config
files that are directories, FIFOs or binary, pass entries without a name, bad demo options. And
the native runtime's build cache is keyed by content, so checkouts share it without clobbering."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import typing
from pathlib import Path

import pytest

from deepcompile import Config, ConfigError
from deepcompile.passes import PASSES

REPO = Path(__file__).resolve().parents[1]


def _numeric_fields(cls, path: str, seen=None):
    """(path, field, int|float) of every numeric spec in a dataclass tree."""
    seen = seen if seen is not None else set()
    if cls in seen:
        return
    seen.add(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        args = [a for a in typing.get_args(t) if a is not type(None)]
        inner = args[0] if len(args) == 1 and typing.get_origin(t) is not list else t
        for a in typing.get_args(t) if typing.get_origin(t) is list else ():
            if dataclasses.is_dataclass(a):
                yield from _numeric_fields(a, f"{path}.{f.name}[0]", seen)
        if dataclasses.is_dataclass(inner):
            yield from _numeric_fields(inner, f"{path}.{f.name}", seen)
        elif inner in (int, float) and not f.metadata.get("choices"):
            yield f"{path}.{f.name}", f, inner


CONFIG_NUMERIC = list(_numeric_fields(Config, "config"))
PASS_NUMERIC = [(name, f, t) for name, p in sorted(PASSES.items())
                for _, f, t in _numeric_fields(p.params_cls, name)]


def test_every_numeric_parameter_declares_both_bounds():
    """A missing max let reduce_bucket_size=2**63 reach pybind as a TypeError: every int and
    float, in the config and in every pass, says how large it may be."""
    assert CONFIG_NUMERIC and PASS_NUMERIC
    missing = [p for p, f, _ in CONFIG_NUMERIC if f.metadata.get("min") is None or f.metadata.get("max") is None]
    missing += [f"{n}.{f.name}" for n, f, _ in PASS_NUMERIC
                if f.metadata.get("min") is None or f.metadata.get("max") is None]
    assert not missing, f"declare min= and max= for {missing}"


def _pass_cfg(name: str, key: str, value) -> dict:
    first = [] if name == "zero3" else ["zero3"]
    return {"passes": first + [{"name": name, "params": {key: value}}]}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_nan_and_inf_are_rejected_in_every_float(bad):
    """NaN passed every bound (all comparisons are False): budget_mb=nan meant "no limit"."""
    floats = [(n, f) for n, f, t in PASS_NUMERIC if t is float]
    assert any(n == "prefetch" and f.name == "budget_mb" for n, f in floats)
    for name, f in floats:
        with pytest.raises(ConfigError, match=rf"passes\[\d\]\.params\.{f.name}: expected a finite number"):
            Config.load(_pass_cfg(name, f.name, bad))
    for path, f, t in CONFIG_NUMERIC:
        if t is float and path.count(".") == 1:
            with pytest.raises(ConfigError, match=rf"{path}: expected a finite number"):
                Config.load({f.name: bad})


def test_out_of_range_numbers():
    with pytest.raises(ConfigError, match=r"config.reduce_bucket_size: 9223372036854775808 is above the maximum"):
        Config.load({"reduce_bucket_size": 2 ** 63})
    assert Config.load({"reduce_bucket_size": 2 ** 40}).reduce_bucket_size == 2 ** 40
    with pytest.raises(ConfigError, match=r"config.schedule\[0\].step: .* above the maximum"):
        Config.load({"schedule": [{"step": 2 ** 70, "passes": ["zero3"]}]})
    with pytest.raises(ConfigError, match=r"budget_mb: an integer of \d+ bits is out of range"):
        Config.load(_pass_cfg("prefetch", "budget_mb", 10 ** 400))   # float(10**400) overflows
    with pytest.raises(ConfigError, match=r"max_fused: .* above the maximum"):
        Config.load(_pass_cfg("prefetch", "max_fused", 2 ** 64))


# --------------------------------------------------------------------------- config files
@pytest.mark.parametrize("kind", ["directory", "binary", "latin-1", "fifo", "missing", "deep", "long int", "list"])
def test_config_file_errors(tmp_path, kind):
    p = tmp_path / "cfg.json"
    needle = {"directory": "is a directory", "binary": "not UTF-8 text", "latin-1": "not UTF-8 text",
              "fifo": "not a regular file", "missing": "does not exist", "deep": "not a valid config",
              "long int": "not a valid config", "list": "config: expected a mapping"}[kind]
    if kind == "directory":
        p.mkdir()
    elif kind == "binary":
        p.write_bytes(Path(sys.executable).read_bytes()[:4096])
    elif kind == "latin-1":
        p.write_bytes('{"compiler": "caf\u00e9"}'.encode("latin-1"))
    elif kind == "fifo":
        os.mkfifo(p)   # open() would block until a writer appears: refused from stat first
    elif kind == "deep":
        p.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "long int":
        p.write_text('{"reduce_bucket_size": ' + "9" * 5000 + "}")
    elif kind == "list":
        p.write_text('[{"zero_stage": 3}]')
    box: dict = {}

    def load():
        try:
            Config.load(str(p))
        except BaseException as e:   # noqa: BLE001 - the assertion below names it
            box["e"] = e

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), f"Config.load hung on a {kind} config path"
    e = box.get("e")
    assert isinstance(e, ConfigError), repr(e)
    assert needle in str(e) and (kind == "list" or str(p) in str(e)), str(e)


def test_utf8_bom_config_loads(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_bytes(b'\xef\xbb\xbf{"compiler": "eager"}')
    assert Config.load(p).compiler == "eager"


# --------------------------------------------------------------------------- pass entries
@pytest.mark.parametrize("cfg,needle", [
    ({"passes": [{"params": {}}]}, r"config.passes\[0\].name: missing"),
    ({"passes": ["zero3", {"params": {"budget_mb": 1}}]}, r"config.passes\[1\].name: missing"),
    ({"passes": ["zero3", 5]}, r"config.passes\[1\]: a pass is a name or"),
    ({"passes": ["zero3", ["prefetch"]]}, r"config.passes\[1\]: a pass is a name or"),
    ({"schedule": [{"passes": ["zero3"]}]}, r"config.schedule\[0\].step: missing"),
    ({"schedule": [{"step": 2, "passes": ["zero3", {}]}]}, r"config.schedule\[0\].passes\[1\].name: missing"),
    ({"passes": ["zero3", {"name": "prefetch", "params": {"budget_mb": "lots"}}]}, r"budget_mb: expected a number"),
])
def test_pass_entry_errors(cfg, needle):
    with pytest.raises(ConfigError, match=needle):
        Config.load(cfg)


# --------------------------------------------------------------------------- demo options
def _demo(capsys, *args: str) -> str:
    from deepcompile.cli import main

    capsys.readouterr()
    rc = main(["demo", "--cpu", "--steps", "1", *args])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_demo_option_errors(capsys, tmp_path):
    """Checked before any rank starts (unchecked, ``--batch 0`` would train on empty batches: NaN loss, exit 0)."""
    assert "--batch 0: need at least 1" in _demo(capsys, "--batch", "0", "--out", str(tmp_path / "a"))
    assert "--batch -3: need at least 1" in _demo(capsys, "--batch", "-3", "--out", str(tmp_path / "b"))
    f = tmp_path / "file"
    f.write_text("x")
    assert f"--out {f}: is a file, not a directory" in _demo(capsys, "--out", str(f))
    assert f"--out {f / 'sub'}: cannot create the run directory" in _demo(capsys, "--out", str(f / "sub"))
    msg = _demo(capsys, "--passes", "zero3,prefetch", "--pass-param", "prefetch.budget_mb=NaN",
                "--out", str(tmp_path / "c"))
    assert "passes[1].params.budget_mb: expected a finite number, got nan" in msg
    assert not any((tmp_path / d).exists() for d in ("a", "b", "c"))


# --------------------------------------------------------------------------- the runtime build cache
def _checkout_copy(dst: Path) -> Path:
    import shutil

    shutil.copytree(REPO / "deepcompile", dst / "deepcompile", ignore=shutil.ignore_patterns("__pycache__"))
    # laid out as installed: the runtime's sources are the package deepcompile._csrc
    shutil.copytree(REPO / "csrc", dst / "deepcompile" / "_csrc", ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _key_of(checkout: Path) -> str:
    r = subprocess.run([sys.executable, "-c", "import deepcompile.runtime.build as b; print(b.cache_key())"],
                       cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_build_cache_key_is_content_only(tmp_path):
    from deepcompile.runtime import build

    a = _checkout_copy(tmp_path / "a")
    b = _checkout_copy(tmp_path / "elsewhere" / "b")
    assert _key_of(a) == _key_of(b) == build.cache_key()
    with open(b / "deepcompile" / "_csrc" / "runtime.cpp", "a") as f:
        f.write("\n// another version\n")
    assert _key_of(b) != _key_of(a)


def test_source_copy_is_placed_once_under_concurrency(tmp_path):
    """Eight builders place the sources at once: one copy wins, all see identical sources."""
    from deepcompile.runtime import build

    key_dir = tmp_path / "runtime-k"
    key_dir.mkdir()
    out, errs = [], []

    def place():
        try:
            out.append(build._place_sources(key_dir))
        except Exception as e:   # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=place) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errs and len(out) == 8 and len(set(out)) == 1
    src = out[0]
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in build._source_files())
    assert all((src / p.name).read_bytes() == p.read_bytes() for p in build._source_files())
    assert [p.name for p in key_dir.iterdir()] == ["src"]   # no temporary copies left behind
    (src / "runtime.cpp").write_text("// edited by hand")
    with pytest.raises(build.BuildError, match="differ from"):
        build._place_sources(key_dir)


def test_two_checkouts_share_one_build(tmp_path):
    """The second checkout loads the first one's build: same directory, no rebuild, and the
    build files name no checkout (before, each rewrote build.ninja with its own source paths)."""
    from deepcompile.runtime import build

    def load(checkout: Path):
        code = ("import deepcompile.runtime.build as b, os; m = b.load(); "
                "print(m.__file__); print(os.stat(m.__file__).st_mtime_ns)")
        r = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(checkout)}, timeout=900)
        assert r.returncode == 0, r.stderr
        so, mtime = r.stdout.strip().splitlines()[-2:]
        return so, int(mtime), r.stderr

    so_a, mt_a, _ = load(REPO)   # builds here only when no test has built it yet
    so_b, mt_b, err_b = load(_checkout_copy(tmp_path / "other"))
    assert so_a == so_b and mt_a == mt_b and "building the native runtime" not in err_b
    ninja = (Path(so_a).parent / "build.ninja").read_text()
    assert str(REPO) not in ninja and str(tmp_path) not in ninja
    assert str(Path(so_a).parent.parent / "src") in ninja and build.cache_key() in so_a
