"""The plan cache (deepcompile.plan.cache): a re-run of the same job reuses the first run's
agreed profile and plan, compiles the planned passes at step 0 and skips the profiling step and the
planner; it makes the same decisions and trains to the same losses, bitwise (CPU, aot_eager: the
planned passes move gathers and keep parameters gathered, which changes no value). A changed
config misses; ranks that disagree (one rank's file gone) both miss without hanging; a corrupt
file misses with a warning.

2 gloo ranks, the tiny GPT, aot_eager (the default plan's shape without CPU Inductor's C++ compile).
"""
from __future__ import annotations

import glob
import os

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.workloads import make_model, make_optimizer, rank_step

STEPS = 4
BASE = {"compiler": "aot_eager", "memory_limit_gib": 8.0}   # a fixed limit: the CPU's free memory moves


def _run(rank: int, world: int, cache_dir, extra: dict, record_dir=None, n_layer=None, env=None):
    """One rank's run. ``env``: variables set in the rank before deepcompile starts (as the
    rank's own environment: the plan cache reads them at use). Set here rather than in the
    parent's environment so the rank stays a fork of the fork server (tests/dist_utils.py), not
    a spawned interpreter that imports torch again."""
    import warnings

    if env:
        os.environ.update(env)

    import deepcompile
    from deepcompile.compat import dynamo as dynamo_compat
    from deepcompile.record.writer import RunRecorder

    cfg = {**BASE, "plan_cache": cache_dir, **extra}
    model, opt = deepcompile.initialize(make_model(**({"n_layer": n_layer} if n_layer else {})), make_optimizer, cfg)
    rec = RunRecorder(record_dir, rank, world, model.dc_config) if record_dir else None
    losses, frames, caught = [], [], []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for s in range(STEPS):
            before = dynamo_compat.dynamo_frames_compiled()
            losses.append(rank_step(model, opt, rank, world, s))
            frames.append(dynamo_compat.dynamo_frames_compiled() - before)
            if rec is not None:
                rec.step(s + 1, 0.1, losses[-1])
    if rec is not None:   # the record gets the stored profile and plan, as a planned run's
        rec.model(model)
        rec.close()
    caught = [str(m.message) for m in w if "plan cache" in str(m.message)]
    plan = model.dc_plan or {}
    pc = model.dc_backend.plan_cache
    out = {"losses": losses, "frames": frames, "warnings": caught, "phases": model.dc_compile_phases,
           "cache": plan.get("cache"), "chosen": (plan.get("chosen") or {}).get("params"),
           "runner_up": (plan.get("runner_up") or {}).get("params"), "why": plan.get("why", ""),
           "passes": plan.get("passes"), "key": pc.key if pc else None, "path": pc.path if pc else None,
           "cache_warnings": pc.warnings if pc else [], "plan": plan,
           "profiled_graphs": sorted(model.dc_profile.graphs) if model.dc_profile else [],
           "step0_passes": sorted({v.after for v in model.dc_graphs if v.step == 0 and v.kind != "dynamo"}),
           "step0_nodes": [(v.graph_id, v.kind, v.after, len(v.nodes)) for v in model.dc_graphs
                           if v.step == 0 and v.kind != "dynamo"],
           "step0_notes": [v.notes for v in model.dc_graphs if v.step == 0 and v.kind != "dynamo"],
           "aot_seed": dict(model.dc_backend.aot_seed_log), "aot_hits": list(model.dc_backend.aot_cache_hits),
           "blocks": list(model.dc_state.runtime.block_compiles),
           "blocks_loaded": list(model.dc_state.runtime.blocks_loaded)}
    deepcompile.destroy(model)
    return out


def _run_with_compile_pool(rank: int, world: int, *args):
    """``_run`` with Inductor's kernel compile pool of 2 processes (read at use, unlike the
    environment variable, which Inductor reads at import: the rank stays a fork of the server)."""
    import torch._inductor.config as iconfig

    iconfig.compile_threads = 2
    return _run(rank, world, *args)


def _files(d):
    return sorted(glob.glob(os.path.join(d, "plan-*.json")))


def test_rerun_hits_and_trains_the_same(tmp_path, monkeypatch):
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    d = str(tmp_path / "plans")
    first = run_ranks(_run, 2, d, {}, timeout=180)
    files = _files(d)
    assert len(files) == 2 and all(f.endswith(("r0of2.json", "r1of2.json")) for f in files), files
    for rank, r in enumerate(first):
        assert r["cache"]["hit"] is False and r["cache"]["stored"].format(rank=rank) in files, r["cache"]
        assert r["phases"][1].get("profiling", 0) > 0 and r["phases"][2].get("planner", 0) > 0, r["phases"]
    again = run_ranks(_run, 2, d, {}, str(tmp_path / "record"), timeout=180)
    for rank, (a, b) in enumerate(zip(first, again)):
        c = b["cache"]
        assert c["hit"] is True and c["file"].format(rank=rank) in files and c["key"] == a["key"], c
        # the same decision, its "why" kept, and the same losses bit for bit
        assert b["chosen"] == a["chosen"] and b["runner_up"] == a["runner_up"] and b["passes"] == a["passes"]
        assert b["why"].startswith("from the plan cache") and a["why"] in b["why"]
        assert b["losses"] == a["losses"], (a["losses"], b["losses"])
        assert b["profiled_graphs"] == a["profiled_graphs"] and b["profiled_graphs"]
        # no profiling step, no planner run, no re-compile: one Dynamo trace at step 0, planned there
        assert not any("profiling" in p for p in b["phases"].values()), b["phases"]
        assert set(b["phases"]) == {0}, b["phases"]
        assert b["frames"][0] >= 1 and b["frames"][1:] == [0] * (STEPS - 1), b["frames"]
        assert {"prefetch", "selective_unshard"} <= set(b["step0_passes"]), b["step0_passes"]
        assert not b["warnings"], b["warnings"]
    from deepcompile.record.reader import read_plan, read_run

    recorded = read_plan(tmp_path / "record", 1)
    assert recorded["cache"]["hit"] is True and recorded["chosen"]["params"] == first[1]["chosen"]
    assert recorded["why"].startswith("from the plan cache") and recorded["cache"]["file"].startswith(d)
    assert read_run(tmp_path / "record", 1, load_graphs=False).profile["graphs"], "the stored profile, recorded"
    for run in (first, again):   # the plan (its cache entry included) is the same on every rank
        p0, p1 = (dict(r["plan"]) for r in run)
        assert p0.pop("seconds") >= 0 and p1.pop("seconds") >= 0 and p0 == p1

    # a changed config (the memory limit) is another key: a miss, stored beside the first
    changed = run_ranks(_run, 2, d, {"memory_limit_gib": 6.0}, timeout=180)
    for a, c in zip(first, changed):
        assert c["cache"]["hit"] is False and c["key"] != a["key"], c["cache"]
        assert c["phases"][1].get("profiling", 0) > 0
    assert len(_files(d)) == 4
    # another world size is another key (and another file name): one rank alone misses
    (solo,) = run_ranks(_run, 1, d, {}, timeout=180)
    assert solo["cache"]["hit"] is False and solo["key"] not in (first[0]["key"], changed[0]["key"]), solo["cache"]

    # one rank's file lost: the ranks disagree, both plan afresh (and say why), nothing hangs
    os.unlink(first[1]["path"])
    split = run_ranks(_run, 2, d, {}, timeout=180)
    for r in split:
        assert r["cache"]["hit"] is False and "rank 1: no stored plan" in r["cache"]["why"], r["cache"]
        assert r["phases"][1].get("profiling", 0) > 0
    # (the warning, as the record keeps it: warnings.catch_warnings in the rank missed it once, 1 run in 3)
    assert any("not every rank has the stored plan" in w for w in split[0]["cache_warnings"]), split
    assert [r["losses"] for r in split] == [r["losses"] for r in first]

    # a half-written file: ignored with a warning, a miss on every rank, then stored again whole
    path = first[0]["path"]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    torn = run_ranks(_run, 2, d, {}, timeout=180)
    assert any("ignoring" in w and path in w for w in torn[0]["cache_warnings"]), torn[0]["cache_warnings"]
    for r in torn:
        assert r["cache"]["hit"] is False and r["cache"]["stored"], r["cache"]
    assert [r["losses"] for r in torn] == [r["losses"] for r in first]

    # NCCL's transport settings are the links a plan was priced on: a run with NCCL_P2P_DISABLE=1
    # (NVLink traffic through host memory) must plan again, not reuse the plan of a run over
    # NVLink (gloo ignores the variable; the key must not), and NCCL's logging changes no plan
    from deepcompile.plan.cache import link_settings

    nccl = {"NCCL_P2P_DISABLE": "1", "NCCL_DEBUG": "INFO"}
    with monkeypatch.context() as m:
        for k, v in nccl.items():
            m.setenv(k, v)
        assert link_settings() == {"NCCL_P2P_DISABLE": "1"}
    slow = run_ranks(_run, 2, d, {}, None, None, nccl, timeout=180)
    for a, b in zip(first, slow):
        assert b["cache"]["hit"] is False and b["key"] != a["key"], b["cache"]


def test_key_follows_the_graph_and_config():
    """The parts that make the key: a graph's code and its inputs' shapes move the digest; the
    config key validates."""
    import torch.fx as fx

    from deepcompile.config import Config
    from deepcompile.params import ConfigError
    from deepcompile.plan.cache import graph_digest

    def f(x):
        return torch.relu(x) * 2

    def g(x):
        return torch.relu(x) * 3

    gf, gg = fx.symbolic_trace(f), fx.symbolic_trace(g)
    a = graph_digest(gf, [torch.zeros(2, 3)])
    assert a == graph_digest(fx.symbolic_trace(f), [torch.ones(2, 3)])   # values do not matter
    assert a != graph_digest(gf, [torch.zeros(4, 3)])                    # shapes do
    assert a != graph_digest(gf, [torch.zeros(2, 3, dtype=torch.float64)])
    assert a != graph_digest(gg, [torch.zeros(2, 3)])                    # the code does
    assert Config.load({}).plan_cache is True
    assert Config.load({"plan_cache": False}).plan_cache is False
    with pytest.raises(ConfigError, match=r"config.plan_cache: expected true, false or a directory path"):
        Config.load({"plan_cache": 3})
    with pytest.raises(ConfigError, match=r"config.plan_cache"):
        Config.load({"plan_cache": ""})


def test_off_switch(tmp_path):
    d = str(tmp_path / "plans")
    r = run_ranks(_run, 1, False, {}, timeout=180)   # one rank: the switch is read per process
    assert all(x["key"] is None and x["cache"] is None for x in r)
    assert not os.path.exists(d)


def test_key_ignores_the_ranks_device_index():
    """Each rank runs on its own GPU, and Dynamo writes a created tensor's device into the graph's
    code: the key must not differ by rank (on 2 H200s every warm re-run missed for this)."""
    import torch.fx as fx

    from deepcompile.plan.cache import graph_digest

    def graph(index):
        g = fx.Graph()
        x = g.placeholder("x")
        ones = g.call_function(torch.ones, (2,), {"device": torch.device("cuda", index)})
        g.output(g.call_function(torch.add, (x, ones)))
        return fx.GraphModule(torch.nn.Module(), g)

    assert "index=1" in graph(1).code
    assert graph_digest(graph(0), [torch.zeros(2)]) == graph_digest(graph(1), [torch.zeros(2)])
    assert graph_digest(graph(0), [torch.zeros(2)]) != graph_digest(graph(0), [torch.zeros(3)])


def test_prune_keeps_the_newest_entries_and_clears_crashed_writes(tmp_path):
    """The cache directory does not grow without bound: beyond ``keep`` files the least recently
    written plans go, the one just written stays whatever its age, and so do other files."""
    import os
    import time

    from deepcompile.plan import cache

    now = time.time()
    for i in range(6):
        f = tmp_path / f"plan-k{i}-r0of2.json"
        f.write_text("{}")
        os.utime(f, (now - 100 + i, now - 100 + i))          # k0 oldest ... k5 newest
    old_tmp, new_tmp, other = tmp_path / ".plan-a.tmp", tmp_path / ".plan-b.tmp", tmp_path / "notes.txt"
    for f in (old_tmp, new_tmp, other):
        f.write_text("x")
    os.utime(old_tmp, (now - 2 * cache.STALE_TMP_S, now - 2 * cache.STALE_TMP_S))
    mine = str(tmp_path / "plan-k0-r0of2.json")
    gone = cache.prune(str(tmp_path), keep=4, protect=(mine,))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".plan-b.tmp", "notes.txt", "plan-k0-r0of2.json", "plan-k3-r0of2.json",
                    "plan-k4-r0of2.json", "plan-k5-r0of2.json"], left
    assert len(gone) == 3
    assert cache.prune(str(tmp_path / "missing")) == []


@pytest.fixture(scope="module")
def inductor_dir(tmp_path_factory):
    """Inductor's caches for this module's tests (per test worker): the tests read and seed
    AOTAutograd's cache there, and its kernels compile once for all of them."""
    return tmp_path_factory.mktemp("inductor")


def _aot_entries(d) -> set:
    return set(map(str, d.glob("aotautograd/*/*")))


def test_rerun_takes_inductor_graphs_from_the_aot_cache(tmp_path, monkeypatch, inductor_dir):
    """Warm compile: with a plan-cache hit the planned passes are fixed before step
    0's compile, so AOTAutograd's cache is turned on for it (config aot_cache), keyed by the plan.
    The run that plans seeds that entry from its trace-once compile (its warm-up compile computed
    the re-run's key; the final Inductor graphs fill it), so already the first re-run takes its
    graphs from AOTAutograd's cache: no passes run, the record shows the planning run's final
    graph versions, and it trains as the planning run did (bitwise as every later re-run).
    1 gloo rank, Inductor on the CPU (the cache stores Inductor's graphs only)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_dir))  # the ranks inherit it
    d = str(tmp_path / "plans")
    ind = {"compiler": "inductor"}
    before = _aot_entries(inductor_dir)
    first, second, third = (run_ranks(_run, 1, d, ind, timeout=300)[0] for _ in range(3))
    assert first["cache"]["hit"] is False and second["cache"]["hit"] and third["cache"]["hit"]
    assert first["key"] == second["key"] == third["key"]
    assert first["aot_seed"].get("saved") == 1, first["aot_seed"]
    assert _aot_entries(inductor_dir) - before, "no AOTAutograd entry on disk"
    for run in (second, third):
        assert run["aot_hits"] == [0], run["aot_hits"]
        assert "passes" not in run["phases"][0], run["phases"]
        assert all("from AOTAutograd's cache" in " ".join(n) for n in run["step0_notes"])
    # the graph versions the planning run's final compile made, kept beside the cache and shown again
    assert {"zero3", "prefetch", "selective_unshard"} <= set(second["step0_passes"]), second["step0_passes"]
    assert third["step0_passes"] == second["step0_passes"]
    assert third["step0_nodes"] == second["step0_nodes"]
    assert third["losses"] == second["losses"], (second["losses"], third["losses"])
    # the planning run's warm-up steps ran the traced graphs as Python code, not Inductor's
    # kernels: the same values up to the last bits
    assert torch.allclose(torch.tensor(second["losses"]), torch.tensor(first["losses"]), rtol=1e-5, atol=0), (
        first["losses"], second["losses"])


def test_rerun_of_a_blocks_plan_takes_its_driver_from_the_aot_cache(tmp_path, monkeypatch, inductor_dir):
    """Blocks (config ``blocks``) compile each graph as regions run by a driver of ours. The
    driver is made an entry of Inductor's FX graph cache (block_regions.blocks_cached_driver), so the
    planning run seeds AOTAutograd's cache with it as with a whole Inductor graph, and the re-run
    loads the driver and its regions' code from there: no trace, no passes, no compile, and the
    same training as the planning run. 1 gloo rank, 4 layers (the middle blocks are identical)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_dir))
    d = str(tmp_path / "plans")
    ind = {"compiler": "inductor", "blocks": True}
    # a kernel compile pool: the regions' deferred kernel wait
    first, second = (run_ranks(_run_with_compile_pool, 1, d, ind, None, 4, timeout=300)[0] for _ in range(2))
    assert first["cache"]["hit"] is False and second["cache"]["hit"]
    made = first["blocks"]
    assert made and all(s["cached"] is True and s["reused"] >= 1 for s in made), made
    # the planning run's re-compile waited for the forward's and the backward's kernels together,
    # after both were lowered (Backend.retarget), not each graph for its own (and it trained)
    assert all(s["kernel_waits_deferred"] == 0 for s in made), made
    assert first["aot_seed"].get("saved") == 1, first["aot_seed"]
    assert second["aot_hits"] == [0], second["aot_hits"]
    assert second["blocks"] == [], second["blocks"]            # nothing compiled in the re-run
    assert sorted(second["blocks_loaded"]) == sorted(s["regions"] for s in made), (second["blocks_loaded"], made)
    assert "passes" not in second["phases"][0], second["phases"]
    assert torch.allclose(torch.tensor(second["losses"]), torch.tensor(first["losses"]), rtol=1e-5, atol=0), (
        first["losses"], second["losses"])


def test_plan_with_runtime_state_is_not_seeded(tmp_path, monkeypatch, inductor_dir):
    """A plan with a pass that sets runtime state while it compiles (offload_activations) must not
    come from AOTAutograd's cache, which skips the passes: the planning run seeds nothing (its
    re-run then compiles the plan with its passes: _aot_cache_salt is None for such a plan)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_dir))
    before = _aot_entries(inductor_dir)
    d = str(tmp_path / "plans")
    cfg = {"compiler": "inductor", "warmup_compiler": "aot_eager", "passes": ["zero3"], "profile_step": 1,
           "plan": True, "schedule": [{"step": 2, "passes": [
               "zero3", "prefetch", "selective_unshard", {"name": "offload_activations", "params": {"min_mb": 0}}]}]}
    first = run_ranks(_run, 1, d, cfg, timeout=300)[0]
    assert first["cache"]["stored"], first["cache"]
    assert first["aot_seed"].get("saved") == 0 and "offload_activations" in first["aot_seed"]["why"], first["aot_seed"]
    assert _aot_entries(inductor_dir) == before, "an AOTAutograd entry was stored"
