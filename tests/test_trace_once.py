"""Trace once: the default plan's final compile reuses the warm-up's partitioned graphs.

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
from tests.workloads import LOCAL_BATCH, global_batch, make_model, make_optimizer

STEPS = 4
SMALL = {"n_layer": 1}  # one block: CPU Inductor's C++ compile is most of this file's time
# the default plan (no passes given): zero3 under aot_eager at step 0, step 1 profiled in place,
# from step 2 zero3 + prefetch + selective_unshard as the planner sets them, compiled by Inductor
DEFAULT_INDUCTOR = {"compiler": "inductor"}


def _train(rank: int, world: int, steps: int, config: dict, env: dict, overrides: dict, short_from=None):
    import os

    os.environ.update(env)
    import deepcompile
    from deepcompile.compat import dynamo as dynamo_compat

    model, opt = deepcompile.initialize(make_model(**overrides), make_optimizer, config)
    frames, losses, caught = [], [], []
    for s in range(steps):
        x, y = _batch(s, world, short_from)
        sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        before = dynamo_compat.dynamo_frames_compiled()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            loss = model(x[sl], y[sl])
        caught += [str(m.message) for m in w if "re-traces" in str(m.message)]
        loss.backward()
        opt.step()
        opt.zero_grad()
        frames.append(dynamo_compat.dynamo_frames_compiled() - before)
        losses.append(loss.item())
    return {"losses": losses, "frames": frames, "state": deepcompile.full_state_dict(model),
            "trace_once": model.dc_trace_once, "phases": model.dc_compile_phases, "warnings": caught,
            "notes": [n for v in model.dc_graphs if v.step == 2 and v.kind == "dynamo" for n in v.notes]}


def _batch(step: int, world: int, short_from):
    """The step's global batch; from step ``short_from`` on, shorter sequences (a new shape)."""
    x, y = global_batch(step, 0, world)
    if short_from is not None and step >= short_from:
        x, y = x[:, :12].contiguous(), y[:, :12].contiguous()
    return x, y


def _reference(world: int, steps: int, overrides: dict, short_from=None):
    """One process, unsharded: each step's batch is every rank's batch together."""
    model = make_model(**overrides)
    opt = make_optimizer(model.parameters())
    losses = []
    for s in range(steps):
        x, y = _batch(s, world, short_from)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check_parity(results, world, overrides, short_from=None):
    ref_losses, ref_state = _reference(world, STEPS, overrides, short_from)
    mean = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref_losses, dtype=mean.dtype), rtol=1e-5, atol=1e-6)
    for r in results:
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")


def test_final_compile_reuses_the_warmup_trace():
    results = run_ranks(_train, 2, STEPS, DEFAULT_INDUCTOR, {}, SMALL, timeout=240)
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
    _check_parity(results, 2, SMALL)


def test_fallback_retraces_and_says_so():
    """A new sequence length in the profiling step: the dims become dynamic, and the graphs traced
    for static shapes cannot serve them, so step 2 re-traces, with a warning and in the log and
    the record; numerics unchanged. (aot_eager keeps it fast; the fallback is the same re-trace
    for Inductor.)"""
    results = run_ranks(_train, 2, STEPS, {"compiler": "aot_eager"}, {}, SMALL, 1, timeout=180)
    for rank, r in enumerate(results):
        assert r["frames"][2] >= 1, f"the fallback must re-trace at step 2, frames {r['frames']}"
        log = r["trace_once"]
        assert len(log) == 1 and not log[0]["reused"] and "dynamic" in log[0]["why"], log
        if rank == 0:   # the warning is the job's: rank 0 prints it, once per run
            assert len(r["warnings"]) == 1 and "re-traces" in r["warnings"][0] and "dynamic" in r["warnings"][0], \
                r["warnings"]
        else:
            assert not r["warnings"], r["warnings"]
        assert "dynamo" in r["phases"][2], r["phases"]
        assert r["notes"] and all("not reused, re-traced" in n and "dynamic" in n for n in r["notes"]), r["notes"]
    _check_parity(results, 2, SMALL, 1)


def test_aot_eager_final_compile_also_reuses():
    """Without Inductor the final graphs are Python code: trace once still skips Dynamo."""
    results = run_ranks(_train, 2, STEPS, {"compiler": "aot_eager"}, {}, SMALL, timeout=180)
    for r in results:
        assert r["frames"][2] == 0 and r["trace_once"][0]["reused"], (r["frames"], r["trace_once"])
    _check_parity(results, 2, SMALL)


def test_backward_inputs_take_the_forward_strides():
    """The stride fix-up between the final forward and backward compile: a saved activation that
    Inductor lays out differently (here transposed) reaches the backward's example inputs with the
    forward's real strides; tangents and unsaved inputs are left alone; a backward placeholder
    that names no forward output is reported (the caller then re-traces)."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from deepcompile.compile import trace_once

    fw = fx.Graph()
    x = fw.placeholder("primals_1")
    a = fw.call_function(torch.ops.aten.relu.default, (x,))
    a.name = "relu"
    fw.output((a, a))  # user output, then the same node saved for backward
    bw = fx.Graph()
    saved, tangent = bw.placeholder("relu"), bw.placeholder("tangents_1")
    bw.output((bw.call_function(torch.ops.aten.mul.Tensor, (saved, tangent)),))
    mode = FakeTensorMode()
    with mode:
        inputs = [torch.empty(4, 8), torch.empty(4, 8)]
    fw_gm, bw_gm = fx.GraphModule({}, fw), fx.GraphModule({}, bw)
    out, changed, unmatched = trace_once.restride_saved(fw_gm, [(1, 4), (1, 4)], bw_gm, inputs)
    assert changed == 1 and not unmatched
    assert out[0].stride() == (1, 4) and out[0].shape == (4, 8)
    assert out[1].stride() == (8, 1)  # the tangent: not a forward output
    bw2 = fx.Graph()
    bw2.output((bw2.placeholder("renamed"),))
    assert trace_once.restride_saved(fw_gm, [(1, 4), (1, 4)], fx.GraphModule({}, bw2), inputs[:1])[2] == ["renamed"]
