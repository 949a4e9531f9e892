"""Trace once (issue 18): the default plan's final compile reuses the warm-up's partitioned graphs.

Steps 0-1 run the warm-up graphs (Python code); at step 2 the planned passes and Inductor run on
copies of the graphs the warm-up traced, and the callables AOTAutograd holds are re-pointed: Dynamo
compiles no frame at step 2. The sharded run still matches the unsharded reference across the
switch (same tolerances as test_zero3_parity: fp32, summation order differs, Inductor fuses). Where
trace once cannot apply, the model re-traces and says so (a warning and ``dc_trace_once``).

CPU Inductor (C++ codegen, cached in /tmp/torchinductor_<user> between runs): 2 gloo ranks, 4 steps.
"""
from __future__ import annotations

import warnings

import torch

from tests.dist_utils import run_ranks
from tests.workloads import LOCAL_BATCH, make_model, make_optimizer, global_batch, train_reference

STEPS = 4
# The default plan's shape (aot_eager warm-up, a profiling step, Inductor from step 2) with the
# final pass list pinned: on CPU Inductor (torch 2.13) the planner's selective_unshard choice
# (dc.gather_persistent_many, a multi-output op) fails to lower, with or without trace once.
INDUCTOR_PLAN = {"compiler": "inductor", "warmup_compiler": "aot_eager", "passes": ["zero3"], "profile_step": 1,
                 "schedule": [{"step": 2, "passes": ["zero3", {"name": "prefetch", "params": {"budget_mb": 1.0}}]}]}


def _train(rank: int, world: int, steps: int, config: dict, env: dict):
    import os

    os.environ.update(env)
    import deepcompile
    from deepcompile import compat

    model, opt = deepcompile.initialize(make_model(), make_optimizer, config)
    frames, losses, caught = [], [], []
    for s in range(steps):
        x, y = global_batch(s, 0, world)
        sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        before = compat.dynamo_frames_compiled()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            loss = model(x[sl], y[sl])
        caught += [str(m.message) for m in w if "re-traces" in str(m.message)]
        loss.backward()
        opt.step()
        opt.zero_grad()
        frames.append(compat.dynamo_frames_compiled() - before)
        losses.append(loss.item())
    return {"losses": losses, "frames": frames, "state": deepcompile.full_state_dict(model),
            "trace_once": model.dc_trace_once, "phases": model.dc_compile_phases, "warnings": caught,
            "notes": [n for v in model.dc_graphs if v.step == 2 and v.kind == "dynamo" for n in v.notes]}


def _check_parity(results, world):
    ref_losses, ref_state = train_reference(world, STEPS, 1)
    mean = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref_losses, dtype=mean.dtype), rtol=1e-5, atol=1e-6)
    for r in results:
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")


def test_final_compile_reuses_the_warmup_trace():
    results = run_ranks(_train, 2, STEPS, INDUCTOR_PLAN, {}, timeout=240)
    for r in results:
        assert r["frames"][0] >= 1, "step 0 must trace (the counter would not see Dynamo otherwise)"
        assert r["frames"][2] == 0, f"Dynamo compiled {r['frames'][2]} frame(s) at the final compile"
        assert r["frames"][1:] == [0] * (STEPS - 1), r["frames"]
        log = r["trace_once"]
        assert len(log) == 1 and log[0]["reused"] and log[0]["step"] == 2, log
        assert log[0]["graphs"] >= 2, log  # at least one forward and its backward re-compiled
        assert not r["warnings"], r["warnings"]
        assert any("trace once" in n for n in r["notes"]), "the record must say the trace was reused"
        ph = r["phases"]
        assert ph[0].get("dynamo", 0) > 0 and ph[0].get("aot_autograd", 0) > 0, ph
        assert ph[2].get("inductor", 0) > 0 and ph[2].get("passes", 0) > 0, ph
        assert "dynamo" not in ph[2] and "aot_autograd" not in ph[2], ph
        assert ph[1].get("profiling", 0) > 0, ph
    _check_parity(results, 2)


def test_fallback_retraces_and_says_so():
    """DEEPCOMPILE_TRACE_ONCE=0: the re-trace of before, loudly; numerics the same. aot_eager keeps
    the fallback fast; the mechanism (reset, new torch.compile) is the same for Inductor."""
    results = run_ranks(_train, 2, STEPS, {"compiler": "aot_eager"}, {"DEEPCOMPILE_TRACE_ONCE": "0"},
                        timeout=180)
    for r in results:
        assert r["frames"][2] >= 1, f"the fallback must re-trace at step 2, frames {r['frames']}"
        log = r["trace_once"]
        assert len(log) == 1 and not log[0]["reused"] and "DEEPCOMPILE_TRACE_ONCE=0" in log[0]["why"], log
        assert r["warnings"] and "re-traces" in r["warnings"][0], r["warnings"]
        assert "dynamo" in r["phases"][2], r["phases"]
    _check_parity(results, 2)


def test_aot_eager_final_compile_also_reuses():
    """Without Inductor the final graphs are Python code: trace once still skips Dynamo."""
    results = run_ranks(_train, 2, STEPS, {"compiler": "aot_eager"}, {}, timeout=180)
    for r in results:
        assert r["frames"][2] == 0 and r["trace_once"][0]["reused"], (r["frames"], r["trace_once"])
    _check_parity(results, 2)
