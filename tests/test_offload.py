"""Offload passes: optimizer state and activations go to host memory and come back, training
matches the unsharded reference, the ops sit where the schedule needs them, and bad input is
loud. On the CPU (gloo) the "device" is host memory too, so these tests check numerics, storage
lifetimes and placement; the GPU memory saving is measured by benchmarks/offload.py."""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.test_zero3_parity import STEPS, _compare
from tests.workloads import train_sharded

ACT = {"name": "offload_activations", "params": {"min_mb": 0}}


def _ops(nodes, target):
    return [i for i, n in enumerate(nodes) if n.get("target") == target]


def _check_placement(graphs):
    """Offloads after every forward reader; in backward reload before wait before first use."""
    fw = [g for g in graphs if g[1] == "forward" and g[2] == "offload_activations"]
    bw = [g for g in graphs if g[1] == "backward" and g[2] == "offload_activations"]
    assert fw and bw
    for _, _, _, nodes in fw:
        offs = _ops(nodes, "dc.offload_activation")
        assert offs, "no activation offloaded"
        for i in offs:
            t = nodes[i]["args"][0]["node"]
            # (another offload's ``after`` list only orders it; it does not read the data)
            later = [n for n in nodes[i + 1:] if t in _flat(n.get("args")) and n["op"] != "output"
                     and n.get("target") != "dc.offload_activation"]
            assert not later, f"{t} read after its offload: {[n['name'] for n in later]}"
    for _, _, _, nodes in bw:
        for i in _ops(nodes, "dc.wait_activation"):
            t = nodes[i]["args"][0]["node"]
            reload = [j for j in _ops(nodes, "dc.reload_activation") if nodes[j]["args"][0]["node"] == t]
            assert reload and reload[0] < i
            earlier = [n for n in nodes[:i] if t in _flat(n.get("args")) and n["op"] == "call_function"
                       and "activation" not in n.get("target", "")]
            assert not earlier, f"{t} used before its reload was waited for"


def _flat(a):
    """Node names among a recorded node's args."""
    if isinstance(a, (list, tuple)):
        return [y for x in a for y in _flat(x)]
    if isinstance(a, dict) and "node" in a:
        return [a["node"]]
    return []


@pytest.mark.parametrize("stage,compiler", [(3, "inductor"), (1, "aot_eager")])
def test_offload_matches_unsharded(stage, compiler):
    first = "zero3" if stage == 3 else "zero12"
    passes = [first, "prefetch", ACT, "offload_optimizer"] if stage == 3 else [first, "offload_optimizer"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = _compare(2, 2, {"compiler": compiler, "zero_stage": stage, "passes": passes})
    for r in results:
        st = r["offload_stats"]
        # optimizer state: off the device for every forward and backward after the first step
        assert r["state_total_bytes"] > 0
        assert all(b == 0 for b in r["state_bytes_between_steps"]), r["state_bytes_between_steps"]
        assert st["steps_offloaded"] == STEPS
        # brought back by the graph in the boundary backward, never by the step itself
        assert st["graph_reloads"] == STEPS - 1 and st["late_reloads"] == 0, st
        if stage == 3:
            _check_placement(r["graphs"])
            assert st["skipped"] == 0
        # everything offloaded came back, except the state sent out by the last step
        assert st["offloads"] - st["reloads"] == 2 * 25, st  # AdamW: 2 moments x 25 trainable shards


def test_offload_by_block_beside_recompute_matches_unsharded():
    """The planner's form of the two activation levers: block 0's activations offloaded to host
    (``offload_activations.blocks``), block 1's recomputed; the unsharded reference's numbers,
    and block 0's values are the only ones that move."""
    rc = {"name": "recompute_activations", "params": {"blocks": "1"}}
    off = {"name": "offload_activations", "params": {"blocks": "0", "min_mb": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = _compare(2, 1, {"compiler": "aot_eager", "passes": [rc, "zero3", "prefetch", off]})
    for r in results:
        st = r["offload_stats"]
        assert st["offloads"] > 0 and st["offloads"] % STEPS == 0 and st["skipped"] == 0, st
        assert st["drops"] > 0 and st["drops_skipped"] == 0, st
        _check_placement(r["graphs"])
        fw = [nodes for _, k, a, nodes in r["graphs"] if k == "forward" and a == "offload_activations"]
        by_name = {n["name"]: n for n in fw[0]}
        moved = [by_name[n["args"][0]["node"]] for n in fw[0] if n.get("target") == "dc.offload_activation"]
        dropped = {n["args"][0]["node"] for n in fw[0] if n.get("target") == "dc.drop_activation"}
        assert moved and not {m["name"] for m in moved} & dropped
        scopes = {m.get("scope", "") for m in moved}
        assert all(".0." in sc or sc.endswith(".0") for sc in scopes), scopes


def _offload_options(rank, world):
    import deepcompile
    from deepcompile.plan.offload_choice import offload_costs, schedule
    from tests.workloads import global_batch, make_model, make_optimizer

    model, opt = deepcompile.initialize(make_model(), make_optimizer, {"compiler": "aot_eager", "plan_cache": False})
    for step in range(3):   # the default schedule: step 1 profiles, step 2 runs the plan
        x, y = global_batch(step, 0, world)
        n = x.shape[0] // world
        model(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]).backward()
        opt.step()
        opt.zero_grad()
    b = model.dc_backend
    costs, tl = offload_costs(dict(b.compiled), b.profile, {}, 0.0)
    ms, away = schedule(tuple(costs), 1e3, tl)   # 1 MB/ms: slow enough to show in a tiny model
    return {"costs": [c.to_dict() for c in costs], "n_blocks": model.module.config.n_layer, "ms": ms,
            "away": [(w.start, w.end) for w in away], "end": len(tl.start_ms) - 1}


def test_the_planner_finds_each_blocks_offloadable_activations_in_the_profiled_graphs():
    """The planner's view of the lever (plan.offload_choice) on a real profiled run: every block
    has activations to offload, done with in forward before backward reads them, and the
    copies' windows lie inside the step."""
    r = run_ranks(_offload_options, 2, timeout=300)[0]
    costs = r["costs"]
    assert sorted(c["block"] for c in costs) == list(range(r["n_blocks"])), costs
    for c in costs:
        assert c["nbytes"] > 0
        assert c["ready_ms"] <= c["bwd_start_ms"] <= c["need_ms"], c
        assert 0 <= c["ready_pos"] < c["need_pos"] <= r["end"], c
    # earlier blocks are done with earlier and read later
    by = sorted(costs, key=lambda c: c["block"])
    assert all(a["ready_pos"] < b["ready_pos"] and a["need_pos"] > b["need_pos"] for a, b in zip(by, by[1:]))
    assert all(s <= e for s, e in r["away"]) and r["ms"] >= 0.0


def test_streamed_optimizer_step_matches_unsharded():
    """ZeRO-3 with the optimizer step streaming the state through in chunks (offload_optimizer
    step 'streamed'), with gradient accumulation: the unsharded reference's losses and weights;
    the state is off the device in every forward and backward, including the first step's, whose
    state Adam creates inside the streamed step."""
    cfg = {"compiler": "aot_eager", "optimizer_chunk_mb": 0.004,
           "passes": ["zero3", {"name": "offload_optimizer", "params": {"step": "streamed"}}]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the CPU-offload warning: the parameters live in host memory here
        results = _compare(2, 2, cfg)
    for r in results:
        st = r["offload_stats"]
        assert r["state_total_bytes"] > 0
        assert all(b == 0 for b in r["state_bytes_between_steps"]), r["state_bytes_between_steps"]
        assert st["streamed_steps"] == STEPS and st["late_reloads"] == 0, st
        # each step brought every state tensor back once, within the step (after the first, which made it)
        assert st["reloads"] == 2 * 25 * (STEPS - 1) and st["offloads"] == 2 * 25 * STEPS, st


def _adaptive(rank, world, limit_mb):
    cfg = {"compiler": "aot_eager", "profile_step": 1,
           "passes": ["zero3", {"name": "offload_optimizer", "params": {"limit_mb": limit_mb, "headroom_mb": 0}}]}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = train_sharded(rank, world, 5, 1, cfg)
    out["warnings"] = [str(x.message) for x in w if "offload_optimizer" in str(x.message)]
    return out


def test_adaptive_offload_follows_the_profile():
    """Without a profile everything is offloaded; after the profiling step, a roomy limit keeps
    all state on the device and a limit below the floor offloads all of it and says why."""
    roomy = run_ranks(_adaptive, 2, 1e6, timeout=600)[0]
    between = roomy["state_bytes_between_steps"]
    assert between[:2] == [0, 0], between             # steps 0 and 1: no profile yet
    assert between[2:] == [roomy["state_total_bytes"]] * 3, between  # re-planned from step 2
    tight = run_ranks(_adaptive, 2, 1e-3, timeout=600)
    t0 = tight[0]
    # without a profile the state leaves at once; with one the copies start after the step and
    # the forward's release points free the device copies (here all of them: nothing fits)
    assert t0["state_bytes_between_steps"][:2] == [0, 0], t0["state_bytes_between_steps"]
    assert t0["state_bytes_between_steps"][2:] == [t0["state_total_bytes"]] * 3
    assert t0["offload_stats"]["released_bytes"] == 2 * t0["state_total_bytes"]  # steps 3 and 4
    assert t0["offload_stats"]["kept_on_device_bytes"] == 0
    assert any("above the" in m and "limit_mb" in m for m in t0["warnings"]), t0["warnings"]
    from tests.workloads import train_reference

    ref, _ = train_reference(2, 5, 1)
    mean = torch.tensor([r["losses"] for r in tight]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref, dtype=mean.dtype), rtol=1e-5, atol=1e-6)


def _recompute_and_offload(rank, world):
    cfg = {"compiler": "aot_eager", "profile_step": 1,
           "passes": [{"name": "recompute_activations", "params": {"blocks": "all"}}, "zero3",
                      {"name": "offload_optimizer", "params": {"limit_mb": 1e6, "headroom_mb": 0}}]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the CPU-offload warning: the parameters live in host memory here
        return train_sharded(rank, world, 5, 1, cfg)


def test_backward_reserves_count_the_recomputed_activations_of_the_real_graph():
    """On the traced model, the backward's reload reserves count exactly the activations the
    forward dropped (each recomputed copy names its dropped value, ``recompute_of``), and training
    under recompute and optimizer-state offload matches the unsharded reference."""
    import re

    results = run_ranks(_recompute_and_offload, 2, timeout=600)
    from tests.workloads import train_reference

    ref, _ = train_reference(2, 5, 1)
    mean = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref, dtype=mean.dtype), rtol=1e-5, atol=1e-6)
    for r in results:
        dropped = [m.group(1) for _, k, after, notes in r["notes"] if k == "forward" and after == "recompute_activations"
                   for n in notes for m in [re.search(r"^recomputed in backward: .*, (.+) of saved activations dropped", n)] if m]
        counted = [m.group(1) for _, k, after, notes in r["notes"] if k == "backward" and after == "offload_optimizer"
                   for n in notes for m in [re.search(r"reserves count (.+) of recomputed", n)] if m]
        assert dropped and dropped[-1] != "0 B", r["notes"]
        assert counted and counted[-1] == dropped[-1], (dropped, counted)


# ---------------------------------------------------------------- unit level
def _manager_with_state():
    from deepcompile.runtime.optimizer_state import OptimizerStateOffload

    ps = [torch.nn.Parameter(torch.randn(n)) for n in (1000, 10, 300)]
    opt = torch.optim.AdamW(ps, lr=0.1)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    m = OptimizerStateOffload()
    m.attach(opt)
    return m, opt, ps


def test_plan_offloads_only_what_exceeds_the_limit():
    from types import SimpleNamespace

    from deepcompile.passes import offload_optimizer as P
    from deepcompile.profile.profiler import GraphProfile, NodeProfile, Profile
    m, opt, ps = _manager_with_state()
    total = m.total_bytes()
    assert total == 2 * 4 * 1310  # exp_avg and exp_avg_sq, 4 bytes each
    try:
        prof = Profile(graphs={(0, "forward"): GraphProfile(0, "forward", [
            NodeProfile("a", 1.0, 0, 50_000 + total, 0)])})
        params = P.OffloadOptimizerParams(limit_mb=(50_000 + total // 2) / 2**20, headroom_mb=0)
        ctx = SimpleNamespace(params=params, profile=prof, graph_id=0, kind="forward",
                              runtime=SimpleNamespace(optimizer_state=m))
        need, why = P.plan_bytes(ctx, torch.device("cpu"))
        assert need == total - total // 2, (need, why)
        m.plan(need)
        chosen = m.choose()
        assert sum(t.numel() * 4 for _, t in chosen) >= need
        assert [(k[2], k[3]) for k, _ in chosen] == [(0, "exp_avg"), (0, "exp_avg_sq")], "largest first"
        # the real cycle: storage freed after the step, values intact after the reload
        before = {k: t.clone() for k, t in m.state_tensors()}
        m.send_out()
        assert all(t.untyped_storage().nbytes() == 0 for _, t in chosen)
        m.bring_back()
        for k, t in m.state_tensors():
            assert torch.equal(t, before[k])
        # a checkpoint taken while state is offloaded sees the real values
        m.send_out()
        sd = opt.state_dict()
        assert torch.equal(sd["state"][0]["exp_avg"], before[("opt", 0, 0, "exp_avg")])
    finally:
        m.detach()


def test_offload_errors_are_clear():
    from deepcompile.passes import offload_optimizer as P
    from deepcompile.runtime.offload import OffloadError, pinned_supported

    with pytest.warns(UserWarning, match="saves no device memory"):
        P.check_supported(torch.device("cpu"))
    if not pinned_supported():
        with pytest.raises(OffloadError, match="pinned"):
            P.check_supported(torch.device("cuda"))
    from deepcompile.config import Config
    from deepcompile.params import ConfigError

    with pytest.raises(ConfigError, match=r"passes\[1\]\.params\.limit_mb"):
        Config.load({"passes": ["zero3", {"name": "offload_optimizer", "params": {"limit_mb": -1}}]})
    with pytest.raises(ConfigError, match=r"passes\[1\]\.params\.min_mbb"):
        Config.load({"passes": ["zero3", {"name": "offload_activations", "params": {"min_mbb": 1}}]})


def test_shared_storage_is_never_freed():
    from deepcompile.runtime.offload import CopyEngine

    e = CopyEngine()
    base = torch.arange(8.0)
    view = base[2:6]
    assert not e.offload(view, "k")           # a slice of a bigger storage
    assert torch.equal(base, torch.arange(8.0)) and e.stats["skipped"] == 1
    t = torch.arange(4.0)
    assert e.offload(t, "k") and t.untyped_storage().nbytes() == 0
    same = t.view(2, 2)                        # compiled code may hand back another tensor object
    e.wait(same, "k")
    assert torch.equal(t, torch.arange(4.0))


def _relu_chain(n: int):
    """A traced graph of ``n`` relus and its call nodes: positions for the offload points."""
    import torch.fx as fx

    def f(x):
        for _ in range(n):
            x = torch.relu(x)
        return x

    gm = fx.symbolic_trace(f)
    return gm, [m for m in gm.graph.nodes if m.op == "call_function"]


def test_state_comes_back_progressively_as_backward_frees_memory():
    """The pass spreads reload points over backward, each with the memory the rest of backward
    still needs; at run time each brings back as much state as fits in the memory really free."""
    from types import SimpleNamespace

    from deepcompile.passes import offload_optimizer as P
    from deepcompile.profile.profiler import GraphProfile, NodeProfile, Profile

    gm, calls = _relu_chain(8)
    MB = 2 ** 20
    # profiled backward: allocated memory falls 100 MiB per node from 800, each node peaks 10 above
    # it, except node 5, which peaks at 900 (a big temporary late in backward)
    peak = lambda i: 900 if i == 5 else 810 - 100 * i  # noqa: E731
    prof = Profile(graphs={(0, "backward"): GraphProfile(0, "backward", [
        NodeProfile(n.name, 1.0, (800 - 100 * i) * MB, peak(i) * MB, 0) for i, n in enumerate(calls)])})
    params = P.OffloadOptimizerParams(limit_mb=1000, headroom_mb=0, reload_points=4)
    ctx = SimpleNamespace(params=params, profile=prof, graph_id=0, kind="backward")
    parts = P.reload_positions(gm, ctx, torch.device("cpu"))
    # points at nodes 2, 4, 6 (node 0 has no measured memory before it), then everything at the end
    assert [calls.index(n) if n in calls else "out" for n, _ in parts] == [2, 4, 6, "out"], parts
    # reserve at node i: the highest later peak minus what node i-1 left allocated
    assert [r for _, r in parts] == [(900 - 700) * MB, (900 - 500) * MB, 0, -1]
    no_prof = P.reload_positions(gm, SimpleNamespace(params=params, profile=None, graph_id=0,
                                                     kind="backward"), torch.device("cpu"))
    assert len(no_prof) == 1 and no_prof[0][0].op == "output" and no_prof[0][1] == -1


def test_reload_brings_back_what_fits_in_the_free_memory():
    m, opt, ps = _manager_with_state()
    try:
        before = {id(t): t.clone() for _, t in m.state_tensors()}
        m.plan(None)
        m.send_out()
        sizes = [t.numel() * t.element_size() for _, t in m.offloaded]
        assert len(sizes) == 6 and m.resident_bytes() == 0
        used = [0]
        m.room, m.memory_now = 10_000, lambda: used[0]

        def resident():
            return [t.untyped_storage().nbytes() > 0 for _, t in m.offloaded]
        used[0] = 10_000 - sizes[0] + 1     # not even the first tensor fits beside the reserve 0
        m.reload_from_graph(0)
        assert resident() == [False] * 6
        used[0] = 10_000 - sizes[0] - sizes[1] - sizes[2] // 2   # the first two fit, in order
        m.reload_from_graph(0)
        assert resident() == [True, True] + [False] * 4
        used[0] = 0
        m.reload_from_graph(10_000)          # the rest of backward needs all the room
        assert resident() == [True, True] + [False] * 4
        m.reload_from_graph(-1)              # the end of backward: everything
        assert all(resident())
        m.bring_back()
        for _, t in m.state_tensors():
            assert torch.equal(t, before[id(t)])
    finally:
        m.detach()


def test_forward_release_points_reserve_the_backward_peak():
    """Forward release points: each reserves what the rest of the step needs, the backward's
    peak included; none on the CPU or without a profile (the state is then freed at once)."""
    from types import SimpleNamespace

    from deepcompile.passes import offload_optimizer as P
    from deepcompile.profile.profiler import GraphProfile, NodeProfile, Profile

    gm, calls = _relu_chain(5)
    MB = 2 ** 20
    fwd = [NodeProfile(n.name, 1.0, (100 + 100 * i) * MB, (110 + 100 * i) * MB, 0) for i, n in enumerate(calls)]
    bwd = [NodeProfile("b0", 1.0, 650 * MB, 800 * MB, 0), NodeProfile("reload_optimizer_state", 1.0, 0, 10 ** 6 * MB, 0)]
    prof = Profile(graphs={(0, "forward"): GraphProfile(0, "forward", fwd),
                           (0, "backward"): GraphProfile(0, "backward", bwd)})
    params = P.OffloadOptimizerParams(limit_mb=1000, headroom_mb=0, reload_points=2)
    ctx = SimpleNamespace(params=params, profile=prof, graph_id=0, kind="forward")
    parts = P.release_positions(gm, ctx, torch.device("cuda"))
    # points at nodes 1 and 3; the later peak is the backward's 800 MiB (its reload op ignored)
    assert [calls.index(n) for n, _ in parts] == [1, 3], parts
    assert [r for _, r in parts] == [(800 - 100) * MB, (800 - 300) * MB]
    ctx.params = P.OffloadOptimizerParams(limit_mb=0, headroom_mb=0, reload_points=2)
    assert P.release_positions(gm, ctx, torch.device("cpu")) == []   # no limit known on the CPU
    ctx.params = params
    ctx.profile = None
    assert P.release_positions(gm, ctx, torch.device("cuda")) == []
