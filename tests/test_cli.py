"""The command line: inspect, report, and one-line errors with exit code 2."""
from __future__ import annotations

import json

from tests.conftest import run_cli


def test_inspect_mentions_graphs_and_passes(demo_run):
    r = run_cli("inspect", str(demo_run), timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "graph 0 forward" in out and "graph 0 backward" in out and "graph 0 dynamo" in out
    assert "-> zero3" in out and "comm added: allgather_param" in out and "reduce_grad" in out
    assert "steps: 3" in out and "loss: first" in out
    # no profiling step and no plan: no peak to show, said so; the per-step process memory labelled as such
    assert "memory peak: none recorded" in out
    assert "process memory, steps.jsonl:" in out and "rank 0 " in out and "rank 1 " in out
    assert "command: " in out and "-m deepcompile demo" in out


def test_report_command(demo_run, tmp_path):
    out = tmp_path / "r.html"
    r = run_cli("report", str(demo_run), "-o", str(out), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out) and out.stat().st_size > 10_000


def test_bad_dir_exits_2_with_one_line(tmp_path):
    for cmd in ("inspect", "report"):
        r = run_cli(cmd, str(tmp_path / "missing"), timeout=120)
        assert r.returncode == 2
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "no such run directory" in lines[0] and "Traceback" not in r.stderr


def test_broken_record_exits_2(demo_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(demo_run, run)
    m = json.loads((run / "manifest.json").read_text())
    m["format_version"] = 99
    (run / "manifest.json").write_text(json.dumps(m))
    r = run_cli("inspect", str(run), timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "manifest.json" in r.stderr and "newer" in r.stderr


def test_bad_pass_param_exits_2(tmp_path):
    r = run_cli("demo", "--steps", "1", "--out", str(tmp_path / "x"), "--pass-param", "nosuch.k=1", timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "nosuch" in r.stderr
    r = run_cli("demo", "--steps", "1", "--out", str(tmp_path / "x"), "--passes", "zero3,nope", timeout=120)
    assert r.returncode == 2 and "unknown pass" in r.stderr and "Traceback" not in r.stderr


def test_demo_trains_a_user_model_factory(tmp_path):
    """``--model package.module:factory``: the user's model and batches, recorded like the GPT."""
    out = tmp_path / "run"
    r = run_cli("demo", "--ranks", "2", "--steps", "2", "--cpu", "--model", "tests.factories:tiny_gpt",
                "--out", str(out), timeout=600)
    assert r.returncode == 0, f"STDOUT:\n{r.stdout}\nSTDERR:\n{r.stderr}"
    from deepcompile.record.reader import read_run

    rec = read_run(out)
    assert rec.graph_ids and rec.versions(rec.graph_ids[0], "forward")
    assert len(rec.steps) == 2 and all(s["loss"] > 0 for s in rec.steps)
    # the user's model, not the built-in GPT: its 26 parameters (tests.workloads.MODEL) were gathered
    fw = rec.versions(rec.graph_ids[0], "forward")[-1]
    gathered = {n.get("param") for n in fw.nodes if n.get("target") == "dc.wait_allgather"}
    assert len(gathered) == 26, sorted(gathered)
    assert not list(out.glob("rank*/fault.txt"))   # ranks that ended well keep no (empty) fault stack file


def test_a_rank_killed_by_a_signal_shows_its_python_stack(tmp_path):
    """A segfault in a rank (native code) leaves no exception: the demo names the rank and the
    signal, fails the record, and prints the rank's Python stack where it died."""
    out = tmp_path / "run"
    r = run_cli("demo", "--ranks", "2", "--steps", "3", "--cpu", "--passes", "zero3", "--model",
                "tests.factories:crashing_gpt", "--out", str(out), timeout=600)
    assert r.returncode == 1, f"STDOUT:\n{r.stdout}\nSTDERR:\n{r.stderr}"
    assert "rank 1 died (signal SIGSEGV)" in r.stderr, r.stderr
    assert "crash_in_rank1_step2" in r.stderr and "fault.txt" in r.stderr, r.stderr
    assert json.loads((out / "manifest.json").read_text())["status"] == "failed"
    assert not (out / "rank0" / "fault.txt").exists()   # a rank stopped by the launcher: no empty file left


def test_bad_model_factory_exits_2(tmp_path):
    for spec, words in [("nocolon", "expected 'package.module:function'"),
                        ("no_such_pkg_xyz:f", "cannot import"),
                        ("tests.factories:nope", "no callable 'nope'")]:
        r = run_cli("demo", "--steps", "1", "--cpu", "--model", spec, "--out", str(tmp_path / "x"), timeout=120)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (spec, r.stderr)


def test_timeline_samples_stay_within_their_budget():
    """The demo profiles a steady step now and then for a live view: the first after the warm
    steady steps, then as rarely as keeps the samples within 2% of the run, and the last step."""
    from deepcompile.cli import TimelineSamples
    from deepcompile.config import Config

    cfg = Config.load({"compiler": "aot_eager"})   # the default plan: re-compiled at step 2
    steps, steady_ms, sample_ms = 1000, 10.0, 25.0
    ts = TimelineSamples(cfg, steps)
    first = ts.first_steady
    assert first == max(e.step for e in cfg.schedule) + 2
    sampled = []
    for s in range(1, steps + 1):
        due = ts.due(s)
        ts.done(s, (sample_ms if due else steady_ms) / 1e3, due)
        if due:
            sampled.append(s)
    assert sampled[0] == first + TimelineSamples.WARM and sampled[-1] == steps
    gaps = {b - a for a, b in zip(sampled, sampled[1:-1])}
    assert gaps == {75}, gaps          # (25 - 10) / 10 = 1.5 steps a sample, within 2%: every 75
    extra = (len(sampled) - 1) * (sample_ms - steady_ms)
    assert extra / (steps * steady_ms) <= 0.025
    # without a schedule the final graphs run from step 2
    assert TimelineSamples(Config.load({"compiler": "aot_eager", "passes": ["zero3"]}), 10).first_steady == 2
