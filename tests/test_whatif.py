"""What-if: editing a pass parameter re-runs the passes and the planner on a record's
graphs and predicts step time and memory, without Dynamo. One real 2-rank CPU demo run (gloo,
tiny GPT, profiled step 1, zero3 + prefetch + selective_unshard: conftest.planned_run, shared
with the widget tests)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def record(planned_run) -> Path:
    # the widget tests' run (conftest.planned_run): every what-if below sets the prefetch and
    # selective_unshard values it predicts, so the run's own values do not matter here
    return planned_run


def plan(prefetch=None, unshard=None):
    return [{"name": "zero3"}, {"name": "prefetch", "params": dict(prefetch or {})},
            {"name": "selective_unshard", "params": dict(unshard or {})}]


def n_events(w, stream, kind=None):
    return sum(e["stream"] == stream and (kind is None or e["kind"] == kind) for e in w.schedule)


def test_prefetch_and_unshard_change_the_prediction_without_dynamo(record):
    import torch._dynamo.utils as du

    from deepcompile.plan.whatif import MEMORY_CATEGORIES, predict_run

    before = {k: dict(v) for k, v in du.counters.items()}
    none = predict_run(record, plan({"budget_mb": 0, "fuse_mb": 0}, {"budget_mb": 0}))
    ahead = predict_run(record, plan({"budget_mb": 512, "fuse_mb": 0}, {"budget_mb": 0}))
    fused = predict_run(record, plan({"budget_mb": 512, "fuse_mb": 128}, {"budget_mb": 0}))
    kept = predict_run(record, plan({"budget_mb": 0, "fuse_mb": 0}, {"budget_mb": 1000}))
    assert {k: dict(v) for k, v in du.counters.items()} == before, "a what-if ran Dynamo"

    for w in (none, ahead, fused, kept):
        assert set(w.memory) == set(MEMORY_CATEGORIES)
        assert sum(v for k, v in w.memory.items() if k != "offloaded") == w.peak_bytes
        assert w.step_ms > 0 and w.seconds < 30
        assert all(e["source"] == "predicted" and e["end_ms"] >= e["start_ms"] for e in w.schedule)
        assert [v["after"] for v in w.versions if v["kind"] == "forward"] == ["prefetch", "selective_unshard"]
    # nothing prefetched, nothing kept: no gathered parameters at the peak beyond the one in use
    assert none.memory["gathered"] == 0
    # prefetch: gathers issued ahead of their use, so they are held longer (memory up where
    # gathers remain: plan.memory adds at each profiled point only what its graph still gathers
    # after it, and this profile peaks where nothing is left) and their time hides under compute
    # (step down)
    assert ahead.peak_bytes >= none.peak_bytes
    assert ahead.step_ms < none.step_ms
    # fusion: fewer, larger collectives on the allgather stream, where the record's measured link
    # says a fused gather is cheaper (prefetch asks the profile's comm model; gloo measured while
    # CI's two cores are busy has once said it is not: then nothing fuses and the count stays)
    from deepcompile.plan.whatif import load_base

    comm = load_base(record).profile.comm
    if any(n["target"] == "dc.allgather_params" for v in fused.versions for n in v["nodes"]):
        assert n_events(fused, "allgather") < n_events(ahead, "allgather")
    else:
        assert comm is not None and n_events(fused, "allgather") == n_events(ahead, "allgather")
    # selective unshard: every parameter kept gathered; backward gathers nothing again
    assert kept.memory["gathered"] > 0 and kept.peak_bytes > none.peak_bytes
    assert n_events(kept, "allgather", "backward") == 0 < n_events(none, "allgather", "backward")
    assert kept.step_ms < none.step_ms
    assert kept.params["selective_unshard"]["budget_mb"] == 1000.0


def test_auto_parameters_are_planned_and_cached(record):
    from deepcompile.plan.whatif import predict_run

    w = predict_run(record, plan({"budget_mb": "auto", "fuse_mb": "auto"}, {"budget_mb": "auto"}))
    assert w.auto == {"prefetch": ["budget_mb", "fuse_mb"], "selective_unshard": ["budget_mb"]}
    assert w.plan is not None and w.plan["chosen"]["params"]["prefetch"]["budget_mb"] == w.params["prefetch"]["budget_mb"]
    assert any(n.startswith("planner") for n in w.notes)
    # the planner's candidates are priced once per record: planning again under another limit
    # reuses them
    t = time.perf_counter()
    tight = predict_run(record, plan({"budget_mb": "auto", "fuse_mb": "auto"}, {"budget_mb": "auto"}),
                        memory_limit_gib=w.peak_bytes / 2 ** 30 * 0.999)
    assert time.perf_counter() - t < 5
    assert tight.peak_bytes <= w.peak_bytes
    # a hand-set value stays; only the rest is planned
    h = predict_run(record, plan({"budget_mb": 0, "fuse_mb": 0}, {"budget_mb": "auto"}))
    assert h.params["prefetch"]["budget_mb"] == 0.0 and h.auto == {"selective_unshard": ["budget_mb"]}
    # "auto" as a parameter's own value (prefetch.backend's default), not the planner's to decide
    b = predict_run(record, plan({"budget_mb": 0, "fuse_mb": 0, "backend": "auto"}, {"budget_mb": "auto"}))
    assert b.params["prefetch"]["backend"] == "auto" and b.auto == h.auto
    # the config's own forms of a pass list: names and PassEntry (not planned: the record's
    # config does not plan, so a left-out value is the declared default)
    from deepcompile.passes.registry import PassEntry

    e = predict_run(record, ["zero3", PassEntry(name="prefetch", params={"budget_mb": 0.0}), "selective_unshard"])
    assert e.auto == {} and e.params["prefetch"]["budget_mb"] == 0.0
    assert e.params["selective_unshard"]["budget_mb"] == 64.0  # SelectiveUnshardParams' default


@pytest.mark.parametrize("passes, path", [
    (plan({"budget_mb": -1}), "passes[1].params.budget_mb"),
    (plan({"budjet_mb": 10}), "passes[1].params.budjet_mb"),
    (plan(None, {"budget_mb": "lots"}), "passes[2].params.budget_mb"),
    (plan({"max_fused": "auto"}), "passes[1].params.max_fused"),
    ([{"name": "zero3"}, {"name": "prefetchh"}], "passes[1].name"),
])
def test_bad_parameter_names_its_path(record, passes, path):
    from deepcompile.params import ConfigError
    from deepcompile.plan.whatif import predict_run

    with pytest.raises(ConfigError) as e:
        predict_run(record, passes)
    assert str(e.value).startswith(path), str(e.value)


def test_record_without_what_it_needs(record, tmp_path):
    from deepcompile.plan.whatif import WhatIfError, predict_run

    with pytest.raises(WhatIfError, match="no 'zero3'"):
        predict_run(record, [{"name": "prefetch"}])
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(record, copy)
    (copy / "rank0" / "profile.json.gz").unlink()
    with pytest.raises(WhatIfError, match="no profile"):
        predict_run(copy, plan())


def test_a_limit_below_the_peak_replans_or_warns(record):
    """A memory limit below the predicted peak never changes nothing silently: the what-if
    re-plans under it (and says so) or warns, naming the limit and the predicted peak."""
    from deepcompile.vocab.memory import fmt_bytes
    from deepcompile.plan.whatif import predict_run

    free = predict_run(record, plan({"budget_mb": 64, "fuse_mb": 0}, {"budget_mb": 1000}))
    assert not free.warnings
    roomy = predict_run(record, plan({"budget_mb": 64, "fuse_mb": 0}, {"budget_mb": 1000}), memory_limit_gib=100.0)
    assert not roomy.warnings and roomy.limit_bytes == 100 * 2**30
    tight = predict_run(record, plan({"budget_mb": 64, "fuse_mb": 0}, {"budget_mb": 1000}), memory_limit_gib=1e-6)
    assert tight.warnings, tight.notes
    text = " ".join(tight.warnings)
    assert fmt_bytes(int(1e-6 * 2**30)) in text and "below the predicted peak" in text
    assert fmt_bytes(free.peak_bytes) in text or "re-planned" in text


def test_measured_side_is_the_one_steady_median():
    """The what-if's measured step is the median every view states (record.steps.steady_median_ms):
    the compile, profiling and re-compile steps left out, numbered as the record numbers them."""
    from types import SimpleNamespace

    from deepcompile.plan.whatif import _measured
    from deepcompile.record.steps import steady_median_ms

    steps = [{"step": 1, "time_s": 9.7}, {"step": 2, "time_s": 1.3}, {"step": 3, "time_s": 5.0},
             {"step": 4, "time_s": 0.13}, {"step": 5, "time_s": 0.12}, {"step": 6, "time_s": 0.125},
             {"step": 7, "time_s": 0.2}]
    cfg = {"profile_step": 1}
    _, out = _measured(SimpleNamespace(steps=steps, config=cfg))
    med, n = steady_median_ms(steps, cfg)
    assert out["steady"] and out["steps"] == n == 4
    assert out["step_ms"] == pytest.approx(med) == pytest.approx(127.5)


def test_a_what_if_on_another_compiler_counts_the_values_it_writes():
    """The memory model leaves out the values only a fused compile never writes: a what-if that
    switches the recorded Inductor run to an unfused compiler counts them again, and switching
    back leaves them out as the record does."""
    from deepcompile.plan.whatif import load_base, variant

    b = load_base(str(Path(__file__).resolve().parents[1] / "benchmarks/results/zero3_h200_2gpu_dc_default_record"))
    assert b.fused and b.unmaterialized and any(any(v) for v in b.unmaterialized.values())
    eager = variant(b, compiler="aot_eager")
    assert not eager.fused and eager.unmaterialized is None and eager.facts.fb_peak >= b.facts.fb_peak
    back = variant(eager, compiler="inductor")
    assert back.unmaterialized == b.unmaterialized and back.facts.fb_peak == b.facts.fb_peak


def test_a_what_if_prices_offloaded_blocks_from_the_runs_offload_options():
    """A plan that offloads blocks' activations (``offload_activations.blocks``) is priced from the
    run's recorded per-block options, as the planner priced it: the bytes are off the device at
    the peak, the step pays the copies' overhead, and the pass is not re-run on the graphs."""
    import dataclasses

    from deepcompile.plan.offload_choice import COPY_OVERHEAD, OffloadCost
    from deepcompile.plan.whatif import load_base, predict_base

    b = load_base(str(Path(__file__).resolve().parents[1] / "benchmarks/results/zero3_h200_2gpu_dc_default_record"))
    n = len(b.facts.timeline)
    nbytes = 512 * 2 ** 20
    # (the record's peak is backward's last node: the block's bytes come back only after it)
    opt = OffloadCost(0, nbytes, ready_ms=1.0, need_ms=200.0, bwd_start_ms=40.0, ready_pos=10, need_pos=n)
    b = dataclasses.replace(b, plan={"offload_options": [opt.to_dict()]})
    base = [{"name": "zero3"}, {"name": "prefetch", "params": {"budget_mb": 0.0, "fuse_mb": 0.0}},
            {"name": "selective_unshard", "params": {"budget_mb": 0.0}}]
    off = base + [{"name": "offload_activations", "params": {"blocks": "0", "h2d_gbps": 55.0}}]
    w0, w1 = predict_base(b, base), predict_base(b, off)
    assert w0.peak_bytes - nbytes <= w1.peak_bytes < w0.peak_bytes, (w0.peak_bytes, w1.peak_bytes)
    copy_ms = nbytes / 55e6
    assert w1.step_ms == pytest.approx(w0.step_ms + COPY_OVERHEAD * copy_ms, rel=1e-6, abs=1e-3)
    assert any("offload_activations: the activations of blocks [0]" in x for x in w1.notes), w1.notes
    assert not any(v.get("after") == "offload_activations" for v in w1.versions)


def test_the_what_if_of_a_plan_that_recomputes_and_offloads_state_is_the_planners():
    """The planner's plan under 48 GiB on the Llama-3-8B shape's 8-layer 8k record (one H200)
    recomputes two blocks and offloads part of the optimizer state; the what-if of that very pass
    list counts the recomputed blocks off the device before it sizes the offload, as the planner
    does, so both predict the same offloaded bytes, peak and step."""
    from deepcompile.plan.whatif import predict_run
    from tests.recorded import LLAMA3_8B_L8_8K_1GPU as rec
    from tests.recorded import plan_offline

    plan, _, _, _ = plan_offline().plan_record(rec, limit_gib=48)
    params = plan.chosen.params()
    assert plan.chosen.recompute and plan.chosen.offloaded > 0, plan.summary_line()
    entries = ([{"name": "recompute_activations", "params": params["recompute_activations"]}, {"name": "zero3"}]
               + [{"name": n, "params": p} for n, p in params.items() if n != "recompute_activations"])
    w = predict_run(rec, entries, memory_limit_gib=48)
    assert w.memory_model["offloaded"] == plan.chosen.offloaded
    assert w.peak_bytes == plan.chosen.memory.peak
    assert w.step_ms == pytest.approx(plan.chosen.step_ms, rel=1e-4)


def test_a_streamed_what_if_holds_the_runs_hand_set_chunk():
    """A what-if whose optimizer step streams the state prices the chunk the run would use: the
    run's hand-set ``optimizer_chunk_mb`` (three 64 MiB chunks' state on the device), the
    planner's 512 MiB where it was 'auto'."""
    import dataclasses

    from deepcompile.plan.whatif import load_base, predict_base

    b = load_base(str(Path(__file__).resolve().parents[1] / "benchmarks/results/zero3_h200_2gpu_dc_default_record"))
    mib = 2 ** 20
    shards = [8 * mib] * (b.facts.shard_bytes // (8 * mib))
    b = dataclasses.replace(b, facts=dataclasses.replace(b.facts, opt_groups=[shards], opt_streamable=True))
    passes = [{"name": "zero3"}, {"name": "prefetch", "params": {"budget_mb": 0.0, "fuse_mb": 0.0}},
              {"name": "selective_unshard", "params": {"budget_mb": 0.0}},
              {"name": "offload_optimizer", "params": {"step": "streamed", "limit_mb": 8000}}]
    state_per_param = b.facts.state_bytes / sum(shards)
    auto = predict_base(b, passes).memory_model["step_state"]
    hand = predict_base(dataclasses.replace(b, config={**b.config, "optimizer_chunk_mb": 64}), passes)
    assert hand.memory_model["step_state"] == pytest.approx(3 * 64 * mib * state_per_param, rel=0.01)
    assert auto == pytest.approx(3 * 512 * mib * state_per_param, rel=0.01)
