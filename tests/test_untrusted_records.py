"""A shared run folder is untrusted input: reading it (``read_run``, ``inspect``, ``report``, the
inspector) never leaves the folder, never hangs, never costs gigabytes, and turns every wrong
field into one ``RecordError`` line; a diverged run (NaN/inf losses) still gets its report.

Every hostile folder is a copy of the session's real demo record (``demo_run``), corrupted."""
from __future__ import annotations

import copy
import dataclasses
import gzip
import json
import os
import shutil
import stat
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from deepcompile.record.reader import Limits, RecordError, read_run
from tests.conftest import run_cli


@pytest.fixture
def run(demo_run, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(demo_run, dst)
    return dst


def _graph_file(run: Path, pattern: str = "*forward-01*") -> Path:
    return sorted((run / "rank0" / "graphs").glob(pattern))[0]


def _err(run: Path, rank: int = 0, **kw) -> str:
    with pytest.raises(RecordError) as ei:
        read_run(run, rank, **kw)
    msg = str(ei.value)
    assert "\n" not in msg.strip(), msg
    return msg


def _edit_json(path: Path, fn) -> None:
    obj = json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())
    obj = fn(obj)
    raw = json.dumps(obj).encode()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


def _set_index_file(run: Path, name: str) -> None:
    def fn(idx):
        idx[1]["file"] = name
        return idx
    _edit_json(run / "rank0" / "graphs" / "index.json", fn)


def _cli_refuses(run: Path, capsys, *needles: str) -> None:
    """``inspect`` and ``report`` exit 2 with one line on stderr naming the problem (the CLI's
    own ``main``, in this process: a subprocess would cost a torch import per call; one test
    below runs the real ``python -m deepcompile``)."""
    from deepcompile.cli import main

    for args in (["inspect", str(run)], ["report", str(run), "-o", str(run.parent / "r.html")]):
        capsys.readouterr()
        rc = main(args)
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (args, err)
        assert lines[0].startswith(f"deepcompile {args[0]}: error: ")
        for n in needles:
            assert n in lines[0], (n, lines[0])


# --------------------------------------------------------------------------- leaving the folder
@pytest.mark.parametrize("name", ["../../manifest.json", "../index.json", "/etc/passwd", "sub/g.json.gz", "..",
                                  "", "a\\b.json.gz"])
def test_graph_file_names_that_leave_the_folder(run, name):
    _set_index_file(run, name)
    msg = _err(run)
    assert "[1].file" in msg and "not a plain file name" in msg and "index.json" in msg


def test_graph_file_name_outside_refused_by_cli_and_widget(run, capsys):
    _set_index_file(run, "../../../../../../etc/passwd")
    _cli_refuses(run, capsys, "[1].file", "not a plain file name")
    from deepcompile.widgets.inspector_model import InspectorModel

    m = InspectorModel(run, use_dot=False)
    assert m.record is None and "not a plain file name" in m.error


def test_symlinks_that_leave_the_folder(run, tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    g = _graph_file(run)
    # a perfectly valid graph file, only outside: the reader must not follow the link to it
    shutil.copy(g, outside / g.name)
    g.unlink()
    g.symlink_to(outside / g.name)
    msg = _err(run)
    assert str(g) in msg and "symlink" in msg and "outside the run directory" in msg
    _cli_refuses(run, capsys, "outside the run directory")

    g.unlink()
    shutil.copy(outside / g.name, g)
    cfg = run / "config.json"
    shutil.copy(cfg, outside / "config.json")
    cfg.unlink()
    cfg.symlink_to(outside / "config.json")
    assert "outside the run directory" in _err(run)
    cfg.unlink()
    shutil.copy(outside / "config.json", cfg)

    # a whole rank directory linked out of the folder
    shutil.move(str(run / "rank1"), str(outside / "rank1"))
    (run / "rank1").symlink_to(outside / "rank1")
    assert "outside the run directory" in _err(run, 1)


def test_symlink_inside_the_folder_is_fine(run):
    """Links that stay inside the folder are only a layout choice."""
    s = run / "rank1" / "steps.jsonl"
    s.unlink()
    s.symlink_to(Path("..") / "rank0" / "steps.jsonl")
    assert [x["step"] for x in read_run(run, 1).steps] == [1, 2, 3]


def test_symlinked_run_dir_itself_is_fine(run, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(run)
    assert read_run(link).graph_ids == [0]


# --------------------------------------------------------------------------- never hang
class _Unblocker:
    """Should a read block on the FIFO after all, open its write end after ``after`` s: the
    test then fails on its assertion instead of hanging."""

    def __init__(self, fifo: Path, after: float = 20.0):
        self.fifo, self.fired = fifo, False
        self.t = threading.Timer(after, self._fire)
        self.t.daemon = True

    def _fire(self):
        self.fired = True
        try:
            fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.t.cancel()


@pytest.mark.parametrize("rel", ["manifest.json", "config.json", "rank0/steps.jsonl", "rank0/schedule.json.gz",
                                 "GRAPH"])
def test_fifo_refused_before_opening(run, rel):
    p = _graph_file(run) if rel == "GRAPH" else run / rel
    p.unlink()
    os.mkfifo(p)
    t0 = time.monotonic()
    with _Unblocker(p) as u:
        msg = _err(run)
    assert not u.fired and time.monotonic() - t0 < 10
    assert str(p) in msg and "FIFO" in msg


def test_fifo_refused_by_cli_and_widget(run, capsys):
    p = run / "rank0" / "steps.jsonl"
    p.unlink()
    os.mkfifo(p)
    from deepcompile.widgets.inspector_model import InspectorModel

    with _Unblocker(p) as u:
        _cli_refuses(run, capsys, "FIFO")
        m = InspectorModel(run, use_dot=False)
        row = m.run_summary(run)
    assert not u.fired and m.record is None and "FIFO" in m.error
    assert row["status"] == "complete"  # the manifest is fine; the steps are not counted


def test_device_file_refused(run):
    p = run / "rank0" / "steps.jsonl"
    p.unlink()
    try:
        os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 5))   # /dev/zero: reading it never ends
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot create a device node here ({e})")
    msg = _err(run)
    assert "character device" in msg and "not a regular file" in msg


# --------------------------------------------------------------------------- size limits
def _gzip_bomb() -> bytes:
    """~1 MiB of gzip that inflates to 1 GiB of JSON whitespace (64 members of 16 MiB each: as
    hostile as one member, and built in a fraction of a second)."""
    member = gzip.compress(b" " * (16 << 20), compresslevel=9, mtime=0)
    return gzip.compress(b"[", mtime=0) + member * 64 + gzip.compress(b"]", mtime=0)


def _peak_mib(fn) -> float:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak / 2 ** 20


def test_gzip_bomb_is_capped(run, capsys):
    bomb = _gzip_bomb()
    assert 0.9 < len(bomb) / 2 ** 20 < 1.2
    for target in (_graph_file(run), run / "rank0" / "schedule.json.gz"):
        saved = target.read_bytes()
        target.write_bytes(bomb)
        t0 = time.monotonic()
        box = {}
        peak = _peak_mib(lambda: box.setdefault("msg", _err(run)))
        assert time.monotonic() - t0 < 30
        assert str(target) in box["msg"] and "inflates to more than 64 MiB" in box["msg"], box["msg"]
        assert peak < 300, f"reading a 1 MiB gzip bomb peaked at {peak:.0f} MiB"
        target.write_bytes(saved)
    _graph_file(run).write_bytes(bomb)
    _cli_refuses(run, capsys, "inflates to more than")


def test_dense_json_is_refused_before_parsing(run):
    """30 MiB of ``{},`` is under the file limit but would be 10 M Python dicts (~0.4 GB)."""
    g = _graph_file(run)
    g.write_bytes(gzip.compress(b"[" + b"{}," * (10 << 20) + b"{}]", compresslevel=1))
    box = {}
    peak = _peak_mib(lambda: box.setdefault("msg", _err(run)))
    assert "JSON values" in box["msg"] and "DEEPCOMPILE_RECORD_MAX_TOTAL_MB" in box["msg"]
    assert peak < 150, peak


def test_oversized_file_refused_from_its_size(run):
    s = run / "rank0" / "steps.jsonl"
    with open(s, "r+b") as f:
        f.truncate(65 << 20)   # sparse: costs no disk, and must cost no reading either
    t0 = time.monotonic()
    msg = _err(run)
    assert time.monotonic() - t0 < 5 and "larger than the 64 MiB limit" in msg and "MAX_FILE_MB" in msg


def test_limits_are_configurable(run, monkeypatch):
    assert read_run(run).graph_ids == [0]
    msg = _err(run, limits=Limits(max_file_bytes=4096))
    assert "limit for one record file" in msg
    monkeypatch.setenv("DEEPCOMPILE_RECORD_MAX_FILE_MB", "0.004")
    assert "limit for one record file" in _err(run)
    monkeypatch.setenv("DEEPCOMPILE_RECORD_MAX_FILE_MB", "64")
    monkeypatch.setenv("DEEPCOMPILE_RECORD_MAX_TOTAL_MB", "0.05")
    assert "in all" in _err(run)
    monkeypatch.setenv("DEEPCOMPILE_RECORD_MAX_TOTAL_MB", "lots")
    assert "expected a number of MiB" in _err(run)


# --------------------------------------------------------------------------- wrong-typed fields
def _node(run, i, key, value):
    def fn(g):
        g["nodes"][i][key] = value
        return g
    _edit_json(_graph_file(run), fn)


def _first(key, value):
    def fn(obj):
        items = obj[next(k for k in ("events", "samples") if k in obj)]
        items[0][key] = value
        return obj
    return fn


WRONG = {
    "config.passes: 5": ("config.json", lambda c: {**c, "passes": 5}, "passes: expected a list"),
    "config.passes: null": ("config.json", lambda c: {**c, "passes": None}, "passes: expected a list"),
    "config pass without name": ("config.json", lambda c: {**c, "passes": [{"params": {}}]}, "passes[0].name: missing"),
    "config pass params a list": ("config.json", lambda c: {**c, "passes": [{"name": "zero3", "params": [1]}]},
                                  "passes[0].params"),
    "config.schedule: {}": ("config.json", lambda c: {**c, "schedule": {}}, "schedule: expected a list"),
    "config is a list": ("config.json", lambda c: [c], "expected a JSON object"),
    "manifest.ranks: ['0']": ("manifest.json", lambda m: {**m, "ranks": ["0", 1]}, "ranks[0]"),
    "manifest rank out of range": ("manifest.json", lambda m: {**m, "ranks": [0, 7]}, "ranks[1]"),
    "manifest world_size huge": ("manifest.json", lambda m: {**m, "world_size": 10 ** 30}, "out of range"),
    "environment.devices: [1]": ("rank0/environment.json", lambda e: {**e, "devices": [1]}, "devices[0]"),
    "schedule start NaN": ("rank0/schedule.json.gz", _first("start_us", float("nan")), "finite"),
    "schedule end inf": ("rank0/schedule.json.gz", _first("end_us", float("inf")), "finite"),
    "schedule node a list": ("rank0/schedule.json.gz", _first("node", ["x"]), "events[0].node"),
    "memory node a list": ("rank0/memory.json.gz", _first("node", [1]), "samples[0].node"),
    "memory bytes 10**400": ("rank0/memory.json.gz", _first("allocated_bytes", 10 ** 400), "out of range"),
}


@pytest.mark.parametrize("case", sorted(WRONG))
def test_wrong_typed_fields(run, case):
    rel, fn, needle = WRONG[case]
    _edit_json(run / rel, fn)
    msg = _err(run)
    assert str(run / rel) in msg and needle in msg, msg


@pytest.mark.parametrize("key,value,needle", [
    ("shape", "abc", "nodes[3].shape"), ("shape", [[1, "x"], [-2]], "nodes[3].shape[1][0]"),
    ("dtype", ["float32"], "nodes[3].dtype"), ("param", "p1", "nodes[3].param"),
    ("args", [{"node": [1]}], "nodes[3].args[0].node"), ("kwargs", [], "nodes[3].kwargs"),
    ("args", [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]], "nested more than"),
    ("name", 5, "nodes[3].name")])
def test_wrong_typed_node_fields(run, key, value, needle):
    _node(run, 3, key, value)
    assert needle in _err(run)


def test_wrong_steps_fields(run):
    s = run / "rank0" / "steps.jsonl"
    good = s.read_text()
    lines = [json.loads(ln) for ln in good.splitlines()]
    for bad, needle in (({"mem": {"peak": None}}, "line 2.mem.peak"), ({"step": 2 ** 80}, "line 2.step"),
                        ({"loss": "low"}, "line 2.loss"), ({"mem": [1]}, "line 2.mem")):
        ls = copy.deepcopy(lines)
        ls[1].update(bad)
        s.write_text("".join(json.dumps(x) + "\n" for x in ls))
        assert needle in _err(run)
    s.write_text(good.replace('"step": 2', '"step": ' + "9" * 5000, 1))   # past Python's int-parsing limit
    assert "line 2" in _err(run)


def _write_profile(run: Path, comm) -> None:
    (run / "rank0" / "profile.json.gz").unlink(missing_ok=True)
    fw = read_run(run).versions(0, "forward")[-1]
    g = {"graph_id": 0, "kind": "forward", "hardware": "cpu", "comm": comm, "optimizer_ms": 1.0,
         "nodes": [{"name": n["name"], "latency_ms": 0.01, "mem_after_bytes": 64, "peak_bytes": 64, "out_bytes": 64}
                   for n in fw.nodes]}
    (run / "rank0" / "profile.json.gz").write_bytes(gzip.compress(json.dumps({"graphs": [g]}).encode()))


def test_recorded_comm_model_is_checked_before_the_widget_predicts(run):
    """The inspector's Predict button rebuilds ``CommModel(**comm)`` from the record: the schema
    holds exactly its fields, so a hand-edited comm is a RecordError, not a TypeError on a click."""
    from deepcompile.vocab.links import CommModel
    from deepcompile.record import schema as S
    from deepcompile.widgets.passes_view import PassesModel

    assert S.COMM_FIELDS == tuple(f.name for f in dataclasses.fields(CommModel))
    good = {"alpha_us": 20.0, "bytes_per_us": 1000.0, "copy_bytes_per_us": 5000.0}
    _write_profile(run, good)
    rec = read_run(run)
    assert "predicted from the recorded profile (cpu)" in PassesModel(rec.config).predict(rec)
    for bad, needle in (({**good, "extra": 1}, "comm: expected the keys"), ({**good, "bytes_per_us": 0}, "positive"),
                        ({**good, "alpha_us": "fast"}, "comm.alpha_us"), ([1], "comm: expected an object")):
        _write_profile(run, bad)
        assert needle in _err(run)


def test_config_passes_5_through_cli_and_widget(run):
    """The issue's example: ``config.passes: 5`` was a TypeError in ``inspect`` and in the widget."""
    _edit_json(run / "config.json", lambda c: {**c, "passes": 5})
    r = run_cli("inspect", str(run), timeout=120)   # the real command line, once
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"deepcompile inspect: error: {run / 'config.json'}: passes: "
                                                 "expected a list of pass names or {name, params} objects, got 5")
    from deepcompile.widgets.inspector_model import InspectorModel

    m = InspectorModel(run, use_dot=False)
    assert m.record is None and "passes: expected a list" in m.error and "TypeError" not in m.error
    assert m.run_summary(run)["status"] == "complete (unreadable record)"
    pytest.importorskip("ipywidgets")
    from deepcompile.widgets import Inspector

    insp = Inspector(run, follow=False)
    assert "cannot show this run" in insp.message.value and "passes: expected a list" in insp.message.value


def test_widget_ignores_a_recorded_pass_value_of_the_wrong_type(run):
    """A value the schema cannot judge (the pass's declaration can) must not reach a control."""
    from deepcompile.widgets.passes_view import PassesModel

    pm = PassesModel({"passes": ["zero3", {"name": "prefetch", "params": {"budget_mb": "lots", "max_fused": 8}}]})
    assert pm.spec("prefetch", "budget_mb").value == pm.spec("prefetch", "budget_mb").default
    assert pm.spec("prefetch", "max_fused").value == 8
    assert any("budget_mb" in e for e in pm.ignored)


def _load_any(path: Path):
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if path.suffix == ".jsonl":
        return [json.loads(ln) for ln in raw.decode().splitlines() if ln.strip()]
    return json.loads(raw)


def _save_any(path: Path, obj) -> None:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(x) + "\n" for x in obj))
        return
    raw = json.dumps(obj).encode()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


def test_mutated_fields_give_record_error_or_a_working_report(run, tmp_path):
    """A sweep: one field at a time of every file gets a value of another type (or goes); reading
    either refuses it with a RecordError, or ``inspect``, the report and the inspector's models
    all work: no other exception. (Found: a null graph_id in a memory sample broke the sort.)"""
    from deepcompile.report.summary import summarize
    from deepcompile.report import level_layout as L
    from deepcompile.report.html import render_report
    from deepcompile.widgets.inspector_model import InspectorModel

    values = [5, "x", None, [], {}, {"node": 5}, float("nan"), 2 ** 70, "DEL"]
    env_keys = ["torch", "python", "hostname", "devices", "world_size", "rank"]   # the rest is shown as text
    # the config keys that a reader uses by name (schema.check_config, the report's and the what-if's
    # special steps and limits, the inspector's passes); the rest only appear in the report's Config
    # section as JSON, which one of them ("blocks") stands for
    config_keys = ["zero_stage", "compiler", "warmup_compiler", "profile_step", "gradient_accumulation_steps",
                   "reduce_bucket_size", "max_inflight_reduces", "auto_schedule", "mixed_precision", "passes",
                   "schedule", "plan", "memory_limit_gib", "blocks"]
    targets = [("manifest.json", None, None), ("config.json", None, config_keys),
               ("rank0/environment.json", None, env_keys), ("rank0/graphs/index.json", 1, None),
               (str(_graph_file(run).relative_to(run)), ("nodes", 3), None),
               ("rank0/schedule.json.gz", ("events", 0), None), ("rank0/memory.json.gz", ("samples", 0), None),
               ("rank0/steps.jsonl", 1, None), ("rank1/steps.jsonl", 0, ["mem", "loss"])]

    def at(obj, where):
        return obj if where is None else obj[where] if isinstance(where, int) else obj[where[0]][where[1]]

    real_dot = L.have_dot
    L.have_dot = lambda: False   # the order-based layout: the sweep renders ~100 reports
    tried = accepted = 0
    try:
        for rel, where, keys in targets:
            path = run / rel
            saved = path.read_bytes()
            obj = _load_any(path)
            for key in keys or list(at(obj, where)):
                for v in values:
                    mutated = copy.deepcopy(obj)
                    if v == "DEL":
                        del at(mutated, where)[key]
                    else:
                        at(mutated, where)[key] = v
                    _save_any(path, mutated)
                    tried += 1
                    try:
                        read_run(run)
                    except RecordError:
                        continue
                    accepted += 1
                    try:
                        summarize(run)
                        render_report(run, tmp_path / "sweep.html", workers=1)
                        m = InspectorModel(run, use_dot=False)
                        assert m.error is None, m.error
                        m.graph.render(), m.memory.table_html(), m.run_summary(run)
                    except RecordError:
                        pass   # another rank's steps, read by the report and inspect
                    except Exception as e:
                        raise AssertionError(f"{rel} {where} {key}={v!r}: {type(e).__name__}: {e}") from e
            path.write_bytes(saved)
    finally:
        L.have_dot = real_dot
    assert tried > 400 and 20 < accepted < tried, (tried, accepted)


# --------------------------------------------------------------------------- diverged runs
def test_report_of_a_diverged_run_renders_with_a_note(run, tmp_path):
    from deepcompile.report.summary import summarize
    from deepcompile.report.html import render_report

    for r in (0, 1):
        s = run / f"rank{r}" / "steps.jsonl"
        lines = [json.loads(ln) for ln in s.read_text().splitlines()]
        lines[1]["loss"], lines[2]["loss"], lines[2]["time_s"] = float("inf"), float("nan"), float("nan")
        s.write_text("".join(json.dumps(x) + "\n" for x in lines))   # json writes Infinity / NaN
    assert "Infinity" in s.read_text()
    rec = read_run(run)
    assert rec.steps[1]["loss"] == float("inf")
    assert "loss: first" in summarize(run)
    html = render_report(run, tmp_path / "r.html").read_text()
    assert "The run diverged:" in html and "from step 2" in html
    assert "2 point(s) NaN/inf: gaps" in html and "1 point(s) NaN/inf: gaps" in html
    assert "data-v='NaN'" in html and "data-v='Infinity'" in html
    r = run_cli("report", str(run), "-o", str(tmp_path / "cli.html"))
    assert r.returncode == 0, r.stderr


def test_charts_never_overflow_or_loop():
    """The report's plotly figures take NaN, inf and huge values: JSON that JSON.parse reads
    (non-finite values become null: gaps), no overflow, no endless loop."""
    from deepcompile.report.memory_fig import memory_figure
    from deepcompile.report.schedule_fig import schedule_figure
    from deepcompile.report.steps_fig import steps_figure
    from deepcompile.report.style import figure_json, fmt_us

    t0 = time.monotonic()
    steps = [{"step": i, "time_s": t, "loss": v, "mem": {"peak": m}}
             for i, (t, v, m) in enumerate([(0.1, float("inf"), 2 ** 70), (float("nan"), 2.0, 0),
                                            (1e308, float("nan"), 5), (0.2, -1e308, -1)], start=1)]
    fig = steps_figure(steps, config={})
    mem = memory_figure({"samples": [{"t_ms": x, "allocated_bytes": b} for x, b in
                                     ((0, 2 ** 62), (1e17, 0), (1e17 + 1, 5))]})
    sched = schedule_figure([{"graph_id": 0, "kind": "forward", "node": "a", "stream": "compute", "source": "measured",
                              "start_us": s, "end_us": e} for s, e in ((0, 1e300), (1e17, 1e17 + 1))])
    for f in (fig, mem, sched):
        text = figure_json(f)
        assert "NaN" not in text and "Infinity" not in text
        json.loads(text)
    assert time.monotonic() - t0 < 5
    for v in (float("nan"), float("inf"), 1e300, -1e-320, 0):
        assert "e+" not in fmt_us(v) and "e-" not in fmt_us(v)


def test_diverging_demo_ends_with_a_report(tmp_path):
    """A run whose loss goes inf then NaN trains to the end and still prints its report last
    (before: the report died with an OverflowError after training)."""
    out = tmp_path / "div"
    r = run_cli("demo", "--model", "tests.factories:diverging_gpt", "--ranks", "1", "--steps", "2", "--cpu",
                "--out", str(out), timeout=400)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "loss inf" in r.stdout and "loss nan" in r.stdout
    assert lines[-1] == f"report: {out / 'report.html'}"
    html = (out / "report.html").read_text()
    assert "The run diverged:" in html and "from step 1" in html
