"""One memory truth: the profiled step's measured timeline by category, the plan's predicted
categories, one labelled peak everywhere, the demo's default plan, and the record's command.

One real run: ``python -m deepcompile demo`` with its defaults (the default ZeRO-3 plan: zero3,
step 1 profiled, then zero3 + prefetch + selective_unshard planned) on 2 gloo ranks, the tiny GPT.
"""
from __future__ import annotations

import gzip
import json
import re
import sys

import pytest

from deepcompile.record import schema as S
from deepcompile.record.reader import RecordError, memory_view, read_run, run_command
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def planned_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("memtruth") / "run"
    r = run_cli("demo", "--ranks", "2", "--steps", "3", "--cpu", "--model", "tests.factories:tiny_gpt",
                "--out", str(out), timeout=600)
    assert r.returncode == 0, f"STDOUT:\n{r.stdout}\nSTDERR:\n{r.stderr}"
    return out, r.stdout


def test_demo_default_runs_every_planned_pass(planned_run):
    run, stdout = planned_run
    assert "step 1 profiled and planned" in stdout.splitlines()[0]
    rec = read_run(run)
    assert rec.profile is not None
    for kind in ("forward", "backward"):
        afters = [v.after for v in rec.versions(0, kind)]
        # the warm-up compile (zero3), then the planned one: every pass of the default plan
        assert afters[-4:] == ["input", "zero3", "prefetch", "selective_unshard"], afters
    assert (run / "rank0" / S.PLAN).exists()


def test_categories_sum_to_allocated_at_every_sample(planned_run):
    run, _ = planned_run
    for rank in (0, 1):
        v = memory_view(run, rank)
        m = v["measured"]
        assert m is not None and m["source"] == "measured" and m["step"] == 1
        samples = m["samples"]
        assert v["categories"] == list(S.MEMORY_CATEGORIES)
        assert {s["kind"] for s in samples} == {"forward", "backward", "optimizer"}
        assert samples[-1]["node"] == "optimizer.step"
        ts = [s["t_ms"] for s in samples]
        assert ts == sorted(ts) and ts[-1] > 0
        for s in samples:
            assert set(s["by_category"]) == set(S.MEMORY_CATEGORIES)
            assert sum(s["by_category"][k] for k in S.DEVICE_CATEGORIES) == s["allocated_bytes"], s
        # the gradients appear at the end of backward, the gathered parameters come and go
        assert any(s["by_category"]["gradients"] > 0 for s in samples if s["kind"] == "backward")
        assert len({s["by_category"]["gathered"] for s in samples}) > 2
        assert all(s["by_category"]["activations"] >= 0 for s in samples)
        # the peak is the largest sample, split the same way
        top = max(samples, key=lambda s: s["peak_bytes"])
        assert m["peak"]["bytes"] == top["peak_bytes"] == v["peak"]["bytes"]
        assert sum(m["peak"]["by_category"][k] for k in S.DEVICE_CATEGORIES) == m["peak"]["bytes"]


def test_shards_category_is_the_real_shard_bytes(planned_run):
    """Every rank's shard of every parameter, row-aligned (sharding.shard_layout), float32."""
    from deepcompile.sharding import shard_layout
    from tests.workloads import make_model

    run, _ = planned_run
    model = make_model()
    # tied parameters are one parameter (named_parameters dedups them, as sharding does)
    want = sum(shard_layout(tuple(p.shape), 2)[0] * p.element_size() for _, p in model.named_parameters())
    for rank in (0, 1):
        samples = memory_view(run, rank)["measured"]["samples"]
        assert {s["by_category"]["parameter_shards"] for s in samples} == {want}
        # the optimizer state: AdamW's two moments of every trainable shard (pos_emb is frozen), from step 0 on
        state = 2 * sum(shard_layout(tuple(p.shape), 2)[0] * p.element_size()
                        for _, p in model.named_parameters() if p.requires_grad)
        assert {s["by_category"]["optimizer_state"] for s in samples} == {state}


def test_inspect_prints_the_measured_peak_of_memory_view(planned_run):
    run, _ = planned_run
    v = memory_view(run, 0)
    r = run_cli("inspect", str(run), timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("memory peak: "))
    assert int(re.search(r"\((\d+) bytes\)", line).group(1)) == v["peak"]["bytes"]
    assert v["peak"]["source"] == "measured" and v["peak"]["label"] in line and v["peak"]["where"] in line
    assert "parameter_shards" in line and "optimizer_state" in line
    # the other numbers are there, labelled: the plan's prediction and the per-step process memory
    assert "predicted peak of the chosen plan" in r.stdout
    assert "process memory, steps.jsonl: the process's resident set per step (CPU" in r.stdout
    # the report's file holds the same peak (memory.json.gz is what every view reads)
    mem = json.loads(gzip.decompress((run / "rank0" / S.MEMORY).read_bytes()))
    assert mem["peak"]["bytes"] == v["peak"]["bytes"]


def test_predicted_categories_from_the_plan(planned_run):
    run, _ = planned_run
    p = memory_view(run, 0)["predicted"]
    assert p is not None and p["source"] == "predicted" and p["where"] in ("forward/backward", "optimizer step")
    assert set(p["by_category"]) == set(S.MEMORY_CATEGORIES)
    assert sum(p["by_category"][k] for k in S.DEVICE_CATEGORIES) == p["peak"]["bytes"]
    plan = json.loads((run / "rank0" / S.PLAN).read_text())
    assert p["peak"]["bytes"] == plan["chosen"]["peak_bytes"]
    assert p["by_category"]["gathered"] == plan["chosen"]["kept_bytes"] + plan["chosen"]["memory"]["gathered_prefetch"]
    m = memory_view(run, 0)["measured"]
    assert p["by_category"]["parameter_shards"] == m["peak"]["by_category"]["parameter_shards"]


def test_the_record_keeps_its_command(planned_run):
    run, _ = planned_run
    c = run_command(run)
    assert c is not None and c["launcher"] == "deepcompile demo" and c["world_size"] == 2
    assert c["relaunch"][:4] == [sys.executable, "-m", "deepcompile", "demo"]
    assert "tests.factories:tiny_gpt" in c["relaunch"] and c["cwd"]
    assert run_command(read_run(run)) == c


def test_launch_command_of_a_script(monkeypatch):
    from deepcompile.record.writer import launch_command

    monkeypatch.setattr(sys, "argv", ["train.py", "--lr", "1e-3"])
    for k in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    c = launch_command(1)
    assert c["launcher"] == "none" and c["relaunch"] == [sys.executable, "train.py", "--lr", "1e-3"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    c = launch_command()
    assert c["launcher"] == "torchrun" and c["env"]["LOCAL_WORLD_SIZE"] == "2"
    assert c["relaunch"] == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "train.py",
                             "--lr", "1e-3"]
    monkeypatch.setenv("WORLD_SIZE", "4")   # two nodes: cannot be started again from here
    c = launch_command()
    assert c["relaunch"] is None and "multi-node" in c["why_not"]
    S.check_command("m", c, "command")


def test_schema_refuses_bad_categories(planned_run, tmp_path):
    import shutil

    run, _ = planned_run
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    f = bad / "rank0" / S.MEMORY
    mem = json.loads(gzip.decompress(f.read_bytes()))
    mem["samples"][3]["by_category"]["sideways"] = 1
    f.write_bytes(gzip.compress(json.dumps(mem).encode()))
    with pytest.raises(RecordError, match=r"samples\[3\]\.by_category.*sideways"):
        read_run(bad)
    del mem["samples"][3]["by_category"]["sideways"]
    mem["peak"]["by_category"]["gathered"] = -5
    f.write_bytes(gzip.compress(json.dumps(mem).encode()))
    with pytest.raises(RecordError, match=r"peak\.by_category\.gathered: bytes cannot be negative"):
        read_run(bad)
    mem["peak"]["by_category"]["gathered"] = 10 ** 30   # past int64: the report's arithmetic overflows
    f.write_bytes(gzip.compress(json.dumps(mem).encode()))
    with pytest.raises(RecordError, match=r"peak\.by_category\.gathered: .*out of range"):
        read_run(bad)
    mem["peak"]["by_category"]["gathered"] = 0
    mem["samples"][0]["t_ms"] = float("nan")   # an axis of NaN ticks
    f.write_bytes(gzip.compress(json.dumps(mem).encode()))
    with pytest.raises(RecordError, match=r"samples\[0\]\.t_ms: expected a finite number"):
        read_run(bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["command"]["relaunch"] = ["python", 3]
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(RecordError, match=r"command\.relaunch\[1\]: expected a string"):
        run_command(bad)


def test_a_record_without_a_timeline_has_no_measured_peak(tmp_path):
    """A run without a profiling step or a plan (the naive estimate's samples: activations
    only) has no peak to show: never the estimate's number, and never the steps' process memory."""
    from deepcompile.record.writer import RunRecorder

    with RunRecorder(tmp_path / "r", 0, 1, {"compiler": "eager"}) as rec:
        rec.step(1, 0.1, 1.0, {"allocated": 5, "reserved": 5, "peak": 7})
        rec.memory([{"node_index": 0, "allocated_bytes": 3, "source": "predicted"}])
    v = memory_view(tmp_path / "r", 0)
    assert v["measured"] is None and v["predicted"] is None and v["peak"] is None
    assert v["process"]["by_rank"] == {0: 7}
    r = run_cli("inspect", str(tmp_path / "r"), timeout=120)
    assert r.returncode == 0 and "memory peak: none recorded" in r.stdout, r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.device_count() >= 2, reason="needs 2 CUDA GPUs")
def test_gpu_timeline_is_the_allocator(tmp_path):
    """On 2 GPUs (NCCL, Inductor): the timeline's totals are the allocator's (the known categories
    never exceed it), and the profiled step's steps.jsonl peak is the timeline's peak."""
    run = tmp_path / "run"
    r = run_cli("demo", "--ranks", "2", "--steps", "4", "--model", "tests.factories:tiny_gpt", "--out", str(run),
                timeout=600)
    assert r.returncode == 0, f"STDOUT:\n{r.stdout}\nSTDERR:\n{r.stderr}"
    for rank in (0, 1):
        v = memory_view(run, rank)
        m = v["measured"]
        assert m["device"] == "cuda allocator" and v["peak"]["source"] == "measured"
        for s in m["samples"]:
            assert sum(s["by_category"][k] for k in S.DEVICE_CATEGORIES) == s["allocated_bytes"]
            assert s["peak_bytes"] >= s["allocated_bytes"]
        assert any(s["by_category"]["activations"] > 0 for s in m["samples"])
        # the runtime's reduce buckets are gradients: they appear at the backward's first reduce
        # (no .grad exists yet in the profiled step), not in the allocator's rest
        bwd = [s for s in m["samples"] if s["kind"] == "backward"]
        first = next(i for i, s in enumerate(bwd) if s["node"].startswith("reduce_grad"))
        assert bwd[first - 1]["by_category"]["gradients"] == 0 < bwd[first]["by_category"]["gradients"]
        steps = read_run(run, rank).steps
        assert steps[1]["mem"]["peak"] == m["peak"]["bytes"]   # step 2 of the demo is the profiled one
        # every step's peak split by category, from step 1 on: on GPU the categories sum to the peak
        for s in steps:
            cats = s["mem"]["by_category"]
            assert set(cats) == set(S.MEMORY_CATEGORIES) and "allocator peak" in s["mem"]["split"]
            known = sum(v for k, v in cats.items() if k not in ("activations", "offloaded"))
            assert cats["activations"] == max(0, s["mem"]["peak"] - known)
            assert cats["gathered"] > 0 and cats["gradients"] > 0
        # the host model's calibration is in the profile (the micro-benchmark of the profiling step)
        prof = read_run(run, rank).profile
        assert all(g["host"]["dispatch_us"] > 0 and g["host"]["python_us"] > 0 for g in prof["graphs"])
        assert {"end_backward", "release_param"} <= set(prof["graphs"][0]["host"]["ops_us"])   # measured dc ops
        assert v["trained"]["bytes"] == steps[-1]["mem"]["peak"] and "error_vs_trained" in v["predicted"]
    out = run_cli("inspect", str(run), timeout=120).stdout
    assert "allocator's high-water mark per step (GPU" in out and "cuda allocator" in out


# --------------------------------------------------------------------------- the runtime's gradient memory
def _profiled_timeline(rank: int, world: int, bucket: int):
    """One rank: ZeRO-3 (eager), step 1 profiled, a reduce bucket of ``bucket`` elements; the
    profiled step's timeline and the runtime's gradient storages between reduce_grads."""
    import torch

    import deepcompile
    from deepcompile.runtime import ops
    from tests.workloads import LOCAL_BATCH, global_batch, make_model, make_optimizer

    model, opt = deepcompile.initialize(make_model(), make_optimizer,
                                        {"zero_stage": 3, "compiler": "eager", "passes": ["zero3"],
                                         "profile_step": 1, "reduce_bucket_size": bucket, "plan": False})
    sizes = {pid: m.chunk * world * 4 for pid, m in model.dc_backend.param_meta.items()}   # fp32, padded
    for s in range(2):
        x, y = global_batch(s, 0, world)
        sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        model(x[sl], y[sl]).backward()
        opt.step()
        opt.zero_grad()
    peaks = ops.C.take_step_peaks()
    return {"memory": model.dc_profile.memory, "sizes": sizes, "peaks": tuple(peaks),
            "held_after": int(ops.C.reduce_held_bytes()), "torch": torch.__version__}


@pytest.mark.parametrize("bucket", [1 << 30, 1])
def test_reduce_buckets_are_gradients_not_activations(bucket):
    """The gradients the runtime holds (buckets filling, reduce-scatters in flight) are filed
    under "gradients" in the measured timeline, once: the bug class was the allocator's rest
    (GPU) taking them as "activations". With one bucket for everything (2**30 elements) the
    gradients grow with every reduce_grad of the backward until end_backward; with a bucket of
    one element each is reduced at once and at most the in-flight reduces are held."""
    from tests.dist_utils import run_ranks

    res = run_ranks(_profiled_timeline, 2, bucket, timeout=240)
    for r in res:
        samples = r["memory"]["samples"]
        bwd = [s for s in samples if s["kind"] == "backward"]
        reduce_at = [i for i, s in enumerate(bwd) if s["node"].startswith("reduce_grad")]
        assert reduce_at, [s["node"] for s in bwd][:40]
        first = reduce_at[0]
        before, at = bwd[first - 1]["by_category"], bwd[first]["by_category"]
        # no .grad exists yet in this step (zero_grad set them to None): what appears is the bucket
        assert before["gradients"] == 0, before
        assert at["gradients"] > 0, at
        assert at["gradients"] >= min(r["sizes"].values())
        if bucket > 1:
            # one bucket holds every gradient until end_backward: never less than the last point
            g = [bwd[i]["by_category"]["gradients"] for i in reduce_at]
            assert g == sorted(g) and g[-1] >= sum(sorted(r["sizes"].values())[:len(reduce_at) // 2])
        for s in samples:
            assert sum(s["by_category"][k] for k in S.DEVICE_CATEGORIES) == s["allocated_bytes"]
        assert r["held_after"] == 0   # nothing held between steps


# --------------------------------------------------------------------------- live memory per step, by category
def _recorded_steps(rank: int, world: int, run: str):
    """One rank of a plain loop (ZeRO-3, eager, no profiling step) writing steps.jsonl with
    RunRecorder.step(step, time, loss): the writer splits each step's peak by category."""
    import time

    import deepcompile
    from deepcompile.profile import memory_split
    from deepcompile.record.writer import RunRecorder
    from deepcompile.sharding import shard_layout
    from tests.workloads import LOCAL_BATCH, global_batch, make_model, make_optimizer

    model, opt = deepcompile.initialize(make_model(), make_optimizer,
                                        {"zero_stage": 3, "compiler": "eager", "passes": ["zero3"]})
    rec = RunRecorder(run, rank, world, model.dc_config)
    for s in range(3):
        x, y = global_batch(s, 0, world)
        sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        loss = model(x[sl], y[sl])
        loss.backward()
        opt.step()
        opt.zero_grad()
        rec.step(s + 1, 0.1, float(loss))
    rec.close()
    # the split's cost per step (a step's worth of runtime counters, read and reset)
    ts = []
    for _ in range(50):
        t0 = time.perf_counter()
        memory_split.step_split({"peak": 0})
        ts.append(time.perf_counter() - t0)
    # the GPU formula on this rank's categories: activations are the allocator peak's remainder
    gpu = memory_split.current_sources().step_split.split(1 << 30, cuda=True)
    full = make_model()
    shards = sum(shard_layout(tuple(p.shape), world)[0] * p.element_size() for _, p in full.named_parameters())
    return {"median_us": sorted(ts)[len(ts) // 2] * 1e6, "gpu": gpu, "shards": shards}


def test_every_step_is_split_by_category_as_it_is_written(tmp_path):
    """steps.jsonl carries each step's memory by category from the first step on, cheaply: the
    exact categories (shards, optimizer state) and the runtime's high-water marks (gathered, the
    reduce buckets), no activations on the CPU (no allocator peak without the profiler, said so);
    on a GPU the activations are the allocator peak's remainder."""
    from deepcompile.record.reader import read_all_steps
    from tests.dist_utils import run_ranks

    run = tmp_path / "run"
    res = run_ranks(_recorded_steps, 2, str(run), timeout=240)
    rec = read_run(run)
    by_rank = read_all_steps(run, rec.manifest)
    for rank, r in enumerate(res):
        steps = by_rank[rank]
        assert [s["step"] for s in steps] == [1, 2, 3]
        for s in steps:
            cats = s["mem"]["by_category"]
            assert set(cats) == set(S.MEMORY_CATEGORIES) - {"activations"}, cats   # CPU: not measured
            assert "activations are not measured on the CPU" in s["mem"]["split"]
            assert cats["parameter_shards"] == r["shards"]
            assert cats["gathered"] > 0 and cats["gradients"] > 0 and cats["offloaded"] == 0
        # AdamW's state exists from the first step's end on, constant after
        assert steps[0]["mem"]["by_category"]["optimizer_state"] > 0
        assert len({s["mem"]["by_category"]["optimizer_state"] for s in steps}) == 1
        gpu = r["gpu"]
        known = sum(v for k, v in gpu.items() if k not in ("activations", "offloaded"))
        assert gpu["activations"] == (1 << 30) - known
        assert r["median_us"] < 500, r["median_us"]   # microseconds (a loaded 2-core CI machine)
