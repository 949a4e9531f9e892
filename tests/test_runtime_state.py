"""The process's runtime state (``deepcompile.runtime.state``): one per ``initialize``.

A second ``initialize`` replaces the first model's state (its parameter registry emptied, its
optimizer unhooked), the passes compile against the new one (their context carries it), and
``destroy`` leaves no state reachable: the accessor then says to call ``deepcompile.initialize``.
Real gloo ranks.
"""
from __future__ import annotations

import torch

from tests.dist_utils import run_ranks
from tests.workloads import make_model, make_optimizer, rank_step


def _two_models(rank, world):
    import deepcompile
    from deepcompile.passes import zero3
    from deepcompile.runtime import state

    seen = []   # the runtime state each zero3 backward compile got in its pass context
    real = zero3.reduce_layout

    def spy(ctx):
        seen.append(ctx.runtime)
        return real(ctx)

    zero3.reduce_layout = spy
    try:
        cfg = {"compiler": "eager", "passes": ["zero3"]}
        a, opt_a = deepcompile.initialize(make_model(), make_optimizer, cfg)
        rt_a = a.dc_state.runtime
        out = {"a_current": state.current() is rt_a,
               "a_names": sorted(m.name for m in rt_a.params.values())}
        rank_step(a, opt_a, rank, world, 0)
        out["a_ctx"] = bool(seen) and all(r is rt_a for r in seen)
        seen.clear()

        b, opt_b = deepcompile.initialize(make_model(seed=1, n_layer=1), make_optimizer, cfg)
        rt_b = b.dc_state.runtime
        out["b_current"] = state.current() is rt_b and rt_b is not rt_a
        out["a_params_after_b"] = len(rt_a.params)
        out["a_opt_after_b"] = rt_a.optimizer_state.opt is None
        out["b_names"] = sorted(m.name for m in rt_b.params.values())
        out["b_expected"] = len(list(b.parameters()))
        out["b_loss"] = rank_step(b, opt_b, rank, world, 0)
        out["b_ctx"] = bool(seen) and all(r is rt_b for r in seen)

        deepcompile.destroy(b)
        out["active_after_destroy"] = state.active()
        out["b_params_after_destroy"] = len(rt_b.params)
        out["b_opt_after_destroy"] = rt_b.optimizer_state.opt
        try:
            state.current()
            out["error"] = None
        except RuntimeError as e:
            out["error"] = str(e)
        deepcompile.destroy(a)
        return out
    finally:
        zero3.reduce_layout = real


def test_a_second_initialize_and_destroy_leave_nothing_of_the_first_model_reachable():
    r = run_ranks(_two_models, 2, timeout=300)[0]
    assert r["a_current"] and r["a_ctx"], r
    assert r["b_current"] and r["b_ctx"], "the passes must compile against the second model's state"
    assert r["a_params_after_b"] == 0 and r["a_opt_after_b"], "the first model's registry and hooks outlived it"
    # the second model's registry holds its own parameters only (one layer against the first's several)
    assert len(r["b_names"]) == r["b_expected"] < len(r["a_names"]), (r["b_names"], r["a_names"])
    assert torch.isfinite(torch.tensor(r["b_loss"]))
    assert not r["active_after_destroy"] and r["b_params_after_destroy"] == 0 and r["b_opt_after_destroy"] is None
    assert r["error"] is not None and "deepcompile.initialize" in r["error"], r["error"]
