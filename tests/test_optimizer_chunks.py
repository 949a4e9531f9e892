"""optimizer.step() in chunk groups (deepcompile.runtime.optim_chunks, config optimizer_chunk_mb).

- Numerics: the chunked step equals the unchunked one bit for bit (foreach, single-tensor and fused
  AdamW, two user groups, an LR scheduler), and on 2 gloo ranks (ZeRO-3, the tiny GPT) over several
  steps, parameters and optimizer state alike.
- The user's view: ``param_groups`` and ``state_dict()`` (and deepcompile's DCP state dict) are the
  same objects and shapes as without chunks; an LR the user sets between steps reaches every chunk;
  ``load_state_dict`` (which replaces the group dicts) is followed.
- Offloaded optimizer state (runtime.optimizer_state) keyed alike inside and outside the step.
- The planner's memory model: chunks lower the predicted optimizer peak by the scaling share of the
  temporaries only; ``choose`` chunks under a limit the whole-group step exceeds, not otherwise, and a
  hand-set size is kept.
"""
from __future__ import annotations

import math

import pytest
import torch

from deepcompile.plan import planner as P
from deepcompile.vocab.links import CommModel
from deepcompile.plan.memory import GIB, MIB, MemoryFacts, optimizer_peak, plan_memory
from deepcompile.runtime import optim_chunks as OC
from tests.dist_utils import run_ranks


def test_split_cuts_in_parameter_order():
    assert OC.split([4, 4, 4, 4], 8) == [(0, 2), (2, 4)]
    assert OC.split([4, 4, 4, 4], 0) == [(0, 4)]
    assert OC.split([10, 1, 1], 4) == [(0, 1), (1, 3)]     # a parameter larger than a chunk is a chunk
    assert OC.largest_chunk([[4, 4, 4, 4], [3]], 8) == 8
    assert OC.count_chunks([[4, 4, 4, 4], [3]], 8) == 3


# ------------------------------------------------------------------------------------ one process
SIZES = [1000, 300, 5000, 20, 7000, 100] * 3


def _train(chunk_bytes: int, steps: int = 4, lr_at: dict | None = None, **opt_kw):
    torch.manual_seed(0)
    qs = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    opt = torch.optim.AdamW([{"params": qs[:10]}, {"params": qs[10:], "lr": 1e-2}], lr=1e-3, weight_decay=0.1,
                            **opt_kw)
    seen = []   # the chunk view's learning rates, from inside the step
    opt.register_step_pre_hook(lambda o, *_: seen.append([g["lr"] for g in o.param_groups]))
    ch = OC.OptimizerChunks(opt, chunk_bytes) if chunk_bytes else None
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for i in range(steps):
        for q in qs:
            q.grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(100 * i + q.numel()))
        if lr_at and i in lr_at:
            opt.param_groups[0]["lr"] = lr_at[i]   # the user, between steps
        opt.step()
        sched.step()
    return qs, opt, ch, seen


@pytest.mark.parametrize("kw", [{"foreach": True}, {"foreach": False}, {"fused": True}],
                         ids=["foreach", "single_tensor", "fused"])
def test_chunked_step_is_bitwise_the_unchunked_one(kw):
    a, oa, _, _ = _train(0, **kw)
    b, ob, ch, seen = _train(8000, **kw)
    assert ch.last_chunks > 2 and len(seen[-1]) == ch.last_chunks
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and len(ob.param_groups) == 2
    for k in sa["state"]:
        for n in sa["state"][k]:
            assert torch.equal(sa["state"][k][n], sb["state"][k][n]), (k, n)


def test_user_lr_and_load_state_dict_reach_every_chunk():
    _, opt, ch, seen = _train(8000, steps=3, lr_at={2: 0.125})
    first_group = len(OC.split([s * 4 for s in SIZES[:10]], 8000))
    # step 2: the scheduler's own value (1e-3 * 0.5**2) replaced by the user's in every chunk of group 0
    assert seen[2][:first_group] == [0.125] * first_group and first_group > 1
    assert seen[2][first_group:] == [1e-2 * 0.25] * (len(seen[2]) - first_group)
    assert [g["lr"] for g in opt.param_groups] == [0.0625, 1e-2 * 0.125]   # the scheduler's step after it
    # load_state_dict builds new group dicts: the chunks follow them
    sd = opt.state_dict()
    sd["param_groups"][1]["lr"] = 7.0
    opt.load_state_dict(sd)
    seen.clear()
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    assert seen[0][first_group:] == [7.0] * (len(seen[0]) - first_group)
    assert len(opt.param_groups) == 2 and not hasattr(opt, "dc_user_param_groups")


def test_step_failure_restores_the_user_groups():
    qs = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    opt = torch.optim.AdamW(qs, lr=1e-3, foreach=True)
    OC.OptimizerChunks(opt, 8000)
    groups = opt.param_groups

    def boom(*_):
        raise RuntimeError("boom")
    opt.register_step_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert opt.param_groups is groups and len(groups) == 1


def test_offloaded_state_keys_agree_inside_and_outside_the_step():
    from deepcompile.runtime.optimizer_state import OptimizerStateOffload

    qs = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    opt = torch.optim.AdamW(qs, lr=1e-3, foreach=True)
    OC.OptimizerChunks(opt, 8000)
    m = OptimizerStateOffload()
    m.attach(opt)
    try:
        m.plan(None)   # everything, sent out by the post-step hook: inside the chunk view
        for q in qs:
            q.grad = torch.ones_like(q)
        opt.step()
        assert m.offloaded and all(k[1] == 0 for k, _ in m.offloaded)   # the user's one group
        keys = [k for k, _ in m.offloaded]
        assert keys == [k for k, _ in m.state_tensors()]               # the same keys outside the step
        sd = opt.state_dict()                                           # its pre-hook brings them back
        assert not m.offloaded and torch.isfinite(sd["state"][0]["exp_avg_sq"]).all()
        opt.step()   # and the next step offloads and steps again
    finally:
        m.detach()


@pytest.mark.parametrize("kw", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_streamed_step_is_bitwise_the_resident_one_and_holds_three_chunks(kw):
    """A streamed step (all state on the host, each chunk's brought in for its own step and sent
    out after) updates exactly as the plain step, from the step that creates the state on; at any
    point of the step at most three chunks' state is on the device, and none between steps."""
    from deepcompile.runtime.optimizer_state import OptimizerStateOffload

    a, oa, _, _ = _train(0, **kw)
    torch.manual_seed(0)
    qs = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    opt = torch.optim.AdamW([{"params": qs[:10]}, {"params": qs[10:], "lr": 1e-2}], lr=1e-3, weight_decay=0.1, **kw)
    ch = OC.OptimizerChunks(opt, 8000)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    m = OptimizerStateOffload()
    m.attach(opt)
    m.plan(None, streamed=True)
    resident, between = [], []

    def on_device() -> int:
        return sum(t.untyped_storage().nbytes() for st in opt.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor) and t.numel() > 1)
    enter = m._enter
    m._enter = lambda k, groups: (enter(k, groups), resident.append(on_device()))
    try:
        for i in range(4):
            for q in qs:
                q.grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(100 * i + q.numel()))
            opt.step()
            sched.step()
            between.append(on_device())
        chunk_state = 2 * max(sum(c) for g in OC.group_sizes(opt) for c in
                              [g[x:y] for x, y in OC.split(g, 8000)])
        assert ch.last_chunks > 4 and m.stats["streamed_steps"] == 4
        total = sum(2 * q.numel() * q.element_size() for q in qs)   # AdamW's two moments
        assert between == [0, 0, 0, 0] and 0 < max(resident) <= 3 * chunk_state, (max(resident), chunk_state)
        assert max(resident) < total / 2
        assert len(opt.param_groups) == 2 and type(opt.param_groups) is list
        assert all(torch.equal(x, y) for x, y in zip(a, qs))
        sa, sb = oa.state_dict(), opt.state_dict()   # its pre-hook brings the state back
        for k in sa["state"]:
            for n in sa["state"][k]:
                assert torch.equal(sa["state"][k][n], sb["state"][k][n]), (k, n)
    finally:
        m.detach()


def test_install_and_config():
    from deepcompile import Config, ConfigError

    assert Config.load({}).optimizer_chunk_mb == "auto"
    assert Config.load({"optimizer_chunk_mb": 256}).optimizer_chunk_mb == 256.0
    with pytest.raises(ConfigError, match=r"config.optimizer_chunk_mb: expected 'auto' or a number"):
        Config.load({"optimizer_chunk_mb": "big"})
    with pytest.raises(ConfigError, match=r"config.optimizer_chunk_mb: -1.0 is below the minimum"):
        Config.load({"optimizer_chunk_mb": -1})
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert OC.install(torch.optim.LBFGS(p), "auto") is None                # not per-group: left alone
    with pytest.raises(TypeError, match="LBFGS is not one of torch's per-group optimizers"):
        OC.install(torch.optim.LBFGS(p), 64)
    assert OC.install(torch.optim.AdamW(p), 0) is None
    assert OC.install(torch.optim.AdamW(p), "auto").chunk_bytes == 0       # off until the planner says
    assert OC.temp_factor(torch.optim.AdamW(p, foreach=True)) == 1.0
    assert OC.temp_factor(torch.optim.Adam(p, foreach=True, weight_decay=0.1)) == 2.0
    assert OC.temp_factor(torch.optim.AdamW(p, fused=True)) == 0.0
    assert OC.temp_factor(torch.optim.AdamW(p, foreach=False)) == 0.0
    assert OC.temp_factor(torch.optim.SGD(p, lr=0.1, foreach=True)) == 0.0


def test_fused_kernel_choice():
    """optimizer_fused: 'auto' gives torch's fused kernel only to groups that left the kernel to
    torch and whose parameters it takes (CUDA floats); true names the group that cannot and the
    fix; a bad value names its key."""
    from deepcompile import Config, ConfigError
    from deepcompile.runtime import optim_fused as OF

    assert Config.load({}).optimizer_fused == "auto"
    with pytest.raises(ConfigError, match=r"config.optimizer_fused: expected true, false or 'auto', got 'yes'"):
        Config.load({"optimizer_fused": "yes"})
    p = [torch.nn.Parameter(torch.zeros(2))]
    cpu = torch.optim.AdamW(p)
    assert OF.install(cpu, "auto") == [] and cpu.param_groups[0]["fused"] is None   # CPU shards: torch's choice
    with pytest.raises(ValueError, match=r"param group 0 cannot use torch's fused kernel: a parameter on cpu"):
        OF.install(cpu, True)
    with pytest.raises(ValueError, match=r"LBFGS has no fused kernel"):
        OF.install(torch.optim.LBFGS(p), True)
    # through initialize: the error names the key path and the fix (not a NameError)
    import torch.distributed as dist

    import deepcompile
    from tests.workloads import make_model

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=r"config.optimizer_fused: true, but param group 0 cannot use torch's "
                                              r"fused kernel: a parameter on cpu.*set optimizer_fused to 'auto'"):
            deepcompile.initialize(make_model(), lambda ps: torch.optim.AdamW(ps), {"optimizer_fused": True})
    finally:
        dist.destroy_process_group()
    mine = torch.optim.AdamW(p, foreach=False)
    assert OF.install(mine, False) == [] and OF.why_not(mine, mine.param_groups[0]) is not None
    if torch.cuda.is_available():
        q = [torch.nn.Parameter(torch.zeros(2, device="cuda"))]
        a, b = torch.optim.AdamW(q), torch.optim.AdamW(q, foreach=True)
        assert OF.install(a, "auto") == [0] and a.param_groups[0]["fused"] is True
        assert OF.install(b, "auto") == [] and b.param_groups[0]["fused"] is None   # the user chose foreach


# ------------------------------------------------------------------------------------ 2 gloo ranks
def _ranks(rank: int, world: int):
    import deepcompile
    from deepcompile.checkpoint import get_state_dict, set_state_dict
    from tests.workloads import make_model, rank_step

    out = {}
    streamed = ["zero3", {"name": "offload_optimizer", "params": {"step": "streamed"}}]
    # 0.004 MiB: ~1000 floats, every GPT block split in several chunks
    for passes, chunks in ((["zero3"], (0, 0.004)), (["zero3", "offload_optimizer"], (0, 0.004)), (streamed, (0.004,))):
        for chunk in chunks:
            model, opt = deepcompile.initialize(
                make_model(), lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, foreach=True),
                {"compiler": "aot_eager", "passes": passes, "optimizer_chunk_mb": chunk})
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            losses = []
            for s in range(4):
                losses.append(rank_step(model, opt, rank, world, s))
                sched.step()
                if s == 2:   # DCP's state dict round trip (what dcp.load + set_state_dict does), mid-run
                    msd, osd = get_state_dict(model, opt)
                    set_state_dict(model, opt, msd, osd)
            ch = model.dc_state.optim_chunks
            mgr = model.dc_state.runtime.optimizer_state
            away = len(mgr.offloaded)
            _, osd = get_state_dict(model, opt)   # offloaded state is read on the host, left there
            key = "streamed" if passes is streamed else len(passes)
            out[(key, chunk)] = {
                "losses": losses, "chunks": ch.last_chunks if ch else len(opt.param_groups),
                "offloaded_steps": model.dc_state.runtime.optimizer_state.stats["steps_offloaded"],
                "streamed_steps": model.dc_state.runtime.optimizer_state.stats["streamed_steps"],
                "offloaded_before_after_save": (away, len(mgr.offloaded)),
                "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                "osd_groups": osd["param_groups"],
                "osd_state": {k: {n: _local(v) for n, v in d.items()} for k, d in osd["state"].items()},
                "params": [p.detach().clone() for p in model.parameters()]}
            deepcompile.destroy(model)
    return out


def _local(v):
    """A plain tensor of this rank's values (DCP's state dict holds DTensors: not for the parent)."""
    if not isinstance(v, torch.Tensor):
        return v
    return (v.to_local() if hasattr(v, "to_local") else v).detach().clone()


def test_zero3_two_ranks_match_unchunked_bitwise():
    """ZeRO-3 and ZeRO-3 with offloaded optimizer state, each chunked and not, and with the state
    streamed through the chunked step; LR scheduler and a DCP state-dict round trip on the way:
    the same losses, parameters and state, bit for bit."""
    for r in run_ranks(_ranks, 2, timeout=240):
        for n in (1, 2, "streamed"):
            a, b = r[(1 if n == "streamed" else n, 0)], r[(n, 0.004)]   # streamed: against plain ZeRO-3
            assert a["chunks"] == 1 and b["chunks"] > 4
            if n == "streamed":   # the round trip's state dict took a streamed step's state back from the host
                assert b["streamed_steps"] == 4 and a["offloaded_steps"] == 0
            else:
                assert (a["offloaded_steps"] > 0) == (b["offloaded_steps"] > 0) == (n == 2)
            if n != 1:   # the checkpoint read the offloaded state where it was, on the host
                before, after = b["offloaded_before_after_save"]
                assert before > 0 and after == before, b["offloaded_before_after_save"]
            assert a["losses"] == b["losses"]
            assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
            assert a["groups"] == b["groups"] and a["osd_groups"] == b["osd_groups"]
            assert a["osd_state"].keys() == b["osd_state"].keys()
            for k in a["osd_state"]:
                for nm, v in a["osd_state"][k].items():
                    w = b["osd_state"][k][nm]
                    assert (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w), (n, k, nm)


def _planned(rank: int, world: int):
    """The default plan (profile at step 1, plan at step 2) with a limit that only the whole-group
    optimizer step exceeds. A CPU profile measures no step peak, so the profiled one is set here:
    the limit L has room for every keep/prefetch choice, the step peaks a quarter group above it."""
    import deepcompile
    from deepcompile.plan.memory import facts_from_profile
    from deepcompile.plan.planner import ALLOCATOR_SLACK
    from tests.workloads import make_model, rank_step

    model, opt = deepcompile.initialize(
        make_model(), lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, foreach=True),
        {"compiler": "aot_eager", "device_memory_gib": 1000.0})
    ch = model.dc_state.optim_chunks
    chunks, losses = [], []
    for s in range(4):
        losses.append(rank_step(model, opt, rank, world, s))
        chunks.append(ch.last_chunks)
        if s == 1:   # the profile is agreed now; the plan is made in step 2's forward
            b = model.dc_backend
            f = facts_from_profile(b.profile, b.param_meta, b.world_size, model.dc_state.runtime.optimizer_state.total_bytes())
            group = sum(OC.group_sizes(opt)[0])
            limit = f.fb_peak + f.gathered_total + 64 * MIB
            b.profile.optimizer_peak_bytes = limit + ALLOCATOR_SLACK + group // 4
            model.dc_config.memory_limit_gib = limit / GIB
    plan = model.dc_plan
    deepcompile.destroy(model)
    return {"chunks": chunks, "losses": losses, "chunk_mb": plan["chosen"]["optimizer_chunk_mb"],
            "group_mb": group / MIB, "summary": plan["summary"], "offload": "offload_optimizer" in plan["chosen"]["params"]}


def test_default_plan_chunks_the_step_when_only_the_step_exceeds_the_limit():
    rs = run_ranks(_planned, 2, timeout=240)
    for r in rs:
        assert r["chunk_mb"] == pytest.approx(r["group_mb"] / 2, abs=1e-3), r["summary"]
        assert r["chunks"][:2] == [1, 1] and r["chunks"][2] == r["chunks"][3] >= 2   # profiled whole, then chunked
        assert not r["offload"] and "optimizer.step in chunks of" in r["summary"]
        assert all(math.isfinite(v) for v in r["losses"])
    assert rs[0]["chunk_mb"] == rs[1]["chunk_mb"]


# ------------------------------------------------------------------------------------ the planner
# 8 GiB model state as the 953M Llama's on 2 H200s in shape: shards 1.78, gradients 1.78, AdamW
# state 3.55, one group of 147 parameters; the step measured 9.065 GiB (foreach temporaries 1.78 +
# 0.18 of other live buffers); forward/backward 8.5 GiB
GROUP = [int(1.776 * GIB / 147)] * 147
FACTS = MemoryFacts(fb_peak=int(8.5 * GIB), optimizer_peak=int(9.065 * GIB), shard_bytes=sum(GROUP),
                    grad_bytes=sum(GROUP), state_bytes=2 * sum(GROUP), gathered={i: 64 * MIB for i in range(8)},
                    opt_groups=[GROUP], opt_temp_factor=1.0)
COMM = CommModel(alpha_us=50.0, bytes_per_us=20e3, copy_bytes_per_us=2e6)


def _choose(limit_gib: float, hand=None, facts=FACTS):
    mem = P.DeviceMemory(capacity=141 * GIB, available=141 * GIB, limit=int(limit_gib * GIB), source="test")
    kept = lambda mb: min(8, int(mb * MIB // (64 * MIB))) * 64 * MIB  # noqa: E731
    timer = lambda c: P.analytic_step_ms(c, facts, COMM, compute_ms=20.0, optimizer_ms=10.0)  # noqa: E731
    return P.choose(facts, mem, kept, timer, hand or {}, "analytic")


def test_memory_model_lowers_the_optimizer_peak_with_chunks():
    known = FACTS.shard_bytes + FACTS.grad_bytes + FACTS.state_bytes
    assert optimizer_peak(FACTS, None) == optimizer_peak(FACTS, 0.0) == FACTS.optimizer_peak
    other = FACTS.optimizer_peak - known - sum(GROUP)        # the part that does not scale (0.18 GiB)
    for mb in (1024.0, 256.0, 64.0):
        chunk = OC.largest_chunk([GROUP], int(mb * MIB))
        assert abs(optimizer_peak(FACTS, mb) - (known + other + chunk)) <= 1, mb
    assert plan_memory(FACTS, 0, 0, chunk_mb=256.0).optimizer_peak < FACTS.optimizer_peak - GIB
    # nothing known to scale (fused / foreach=False / unknown optimizer): no predicted gain
    from dataclasses import replace

    assert optimizer_peak(replace(FACTS, opt_temp_factor=0.0), 64.0) == FACTS.optimizer_peak
    # profiled already in chunks of 256 MiB: the measured temporaries are a chunk's, scaled from there
    prof256 = replace(FACTS, optimizer_peak=optimizer_peak(FACTS, 256.0), opt_profiled_chunk=256 * MIB)
    assert abs(optimizer_peak(prof256, 0.0) - FACTS.optimizer_peak) <= 2
    assert P.chunk_ms(FACTS, 256.0) == pytest.approx(P.CHUNK_HOST_MS * (len(OC.split(GROUP, 256 * MIB)) - 1))


def test_planner_chunks_only_under_a_limit_the_whole_group_step_exceeds():
    roomy = _choose(20.0)
    assert roomy.chosen.chunk_mb == 0.0 and roomy.chosen.offload_limit_mb is None
    fits = _choose(9.07)   # FSDP2's peak: the whole-group step (9.065) fits, no chunks, no host cost
    assert fits.chosen.chunk_mb == 0.0
    levels = P.chunk_levels(FACTS)
    assert levels[0] == pytest.approx(sum(GROUP) / MIB / 2, abs=1e-3) and len(levels) == 6
    tight = _choose(8.8)   # below the whole-group step: the largest chunk that fits (a half), nothing offloaded
    assert tight.chosen.chunk_mb == levels[0] and tight.chosen.offload_limit_mb is None
    assert tight.chosen.memory.optimizer_peak <= 8.8 * GIB < FACTS.optimizer_peak
    assert f"optimizer.step in chunks of {levels[0]:g} MiB" in tight.summary_line() and "chunks" in tight.why
    assert tight.chosen.summary()["optimizer_chunk_mb"] == levels[0]
    tighter = _choose(7.6)  # smaller chunks (an eighth), and forward/backward offloads state
    assert tighter.chosen.chunk_mb == levels[2] and tighter.chosen.offload_limit_mb is not None
    hand = _choose(20.0, {"optimizer": {"chunk_mb": 64.0}})   # by hand: kept, priced with its host cost
    assert hand.chosen.chunk_mb == 64.0
    with pytest.raises(P.PlanError, match=rf"optimizer step alone peaks at 7.\d\d GiB in chunks of {levels[-1]:g} MiB"):
        _choose(7.0)


# the 8B Llama on 2 ranks in shape: fp32 shards and gradients 14.96 GiB each, AdamW state 29.92 GiB
# in 290 parameters, the fused step (no temporaries that scale); forward/backward 68 GiB with it all
GROUP8 = [int(14.96 * GIB / 290)] * 290
FACTS8 = MemoryFacts(fb_peak=int(68 * GIB), optimizer_peak=4 * sum(GROUP8) + int(0.2 * GIB), shard_bytes=sum(GROUP8),
                     grad_bytes=sum(GROUP8), state_bytes=2 * sum(GROUP8), gathered={i: 448 * MIB for i in range(64)},
                     opt_groups=[GROUP8], opt_temp_factor=0.0, opt_streamable=True)


def test_planner_streams_the_step_only_where_the_resident_step_cannot_fit():
    from dataclasses import replace

    from deepcompile.plan.memory import STREAM_CHUNK_MB, streamed_optimizer_peak

    held = 3 * 2 * OC.largest_chunk([GROUP8], int(STREAM_CHUNK_MB * MIB))   # equal chunks: any three
    assert abs(streamed_optimizer_peak(FACTS8, STREAM_CHUNK_MB) - (FACTS8.optimizer_peak - FACTS8.state_bytes + held)) <= 1
    # the largest parameters at the two ends of the order (embedding, output projection): the step holds
    # one of them beside two 512 MiB chunks of the small ones, not three of them
    g = [GIB] + [64 * MIB] * 100 + [GIB]
    ends = replace(FACTS8, opt_groups=[g], shard_bytes=sum(g), grad_bytes=sum(g), state_bytes=2 * sum(g),
                   optimizer_peak=4 * sum(g))
    assert streamed_optimizer_peak(ends, STREAM_CHUNK_MB) == 2 * sum(g) + 2 * (GIB + 2 * 512 * MIB)
    roomy = _choose(75.0, facts=FACTS8)     # everything fits on the device: nothing offloaded
    assert roomy.chosen.offload_limit_mb is None and not roomy.chosen.streamed
    tight = _choose(40.0, facts=FACTS8)     # below shards + gradients + state (59.9): the step streams
    c = tight.chosen
    assert c.streamed and c.offloaded == FACTS8.state_bytes and c.chunk_mb == STREAM_CHUNK_MB
    assert c.memory.peak <= 40 * GIB and c.memory.optimizer_peak < 34 * GIB
    # backward's reload points bring state back early up to the room under the limit (40 - 1 GiB
    # headroom): the predicted peak is that room, and the state there is what came back
    assert c.memory.fb_peak == c.memory.peak == 39 * GIB
    before = FACTS8.fb_peak - FACTS8.state_bytes + c.kept + c.memory.gathered_prefetch   # nothing reloaded
    assert c.memory.optimizer_state == 39 * GIB - before > 0
    assert c.memory.offloaded + c.memory.optimizer_state == FACTS8.state_bytes
    # where the step is the peak: three chunks' state on the device, the rest on the host
    at_step = replace(c.memory, fb_peak=0, peak=c.memory.optimizer_peak)
    cats, where = at_step.by_category()
    assert where == "optimizer step" and cats["optimizer_state"] == c.memory.step_state == 6 * 9 * GROUP8[0]
    assert cats["offloaded"] == FACTS8.state_bytes - cats["optimizer_state"] and sum(
        v for k, v in cats.items() if k != "offloaded") == at_step.peak
    p = c.params()["offload_optimizer"]
    assert p["step"] == "streamed" and p["final_reload"] == "fit" and p["limit_mb"] == 40 * 1024
    assert "streams it through in chunks of 512 MiB" in tight.summary_line() and "streams the state" in tight.why
    # the streamed copies are priced: a whole direction of the state over the host link
    from deepcompile.vocab.links import HOST_BYTES_PER_US

    assert c.step_ms >= FACTS8.state_bytes / HOST_BYTES_PER_US / 1e3
    with pytest.raises(P.PlanError, match=r"streamed through the step in chunks of 512 MiB.*GiB missing"):
        _choose(30.0, facts=FACTS8)         # not even shards + gradients
    # an optimizer runtime.optim_chunks cannot cut cannot stream: the resident step's floor stands
    with pytest.raises(P.PlanError, match=r"which offloading cannot take off the step.*optimizer_chunk_mb 'auto' lets "
                                          r"the step stream its state from the host"):
        _choose(40.0, facts=replace(FACTS8, opt_streamable=False))


def test_lr_scheduler_wraps_the_accumulating_and_chunked_step():
    """torch's LRScheduler re-wraps ``optimizer.step`` through ``step.__func__``: deepcompile's
    accumulation wrapper (runtime.accumulation.wrap_for_accumulation) and the chunker must both be bound methods."""
    from deepcompile.runtime.accumulation import wrap_for_accumulation

    q = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([q], lr=1.0, foreach=True)
    OC.OptimizerChunks(opt, 8)
    opt = wrap_for_accumulation(opt, 2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)   # raised AttributeError before
    for _ in range(4):
        q.grad = torch.ones_like(q)
        opt.step()
    assert opt.state[q]["step"].item() == 2 and opt._opt_called   # every 2nd call steps; the scheduler saw it
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5


def test_the_floor_counts_a_streamed_step():
    """``memory_limit_gib`` under shards + gradients + all of AdamW's state is refused only where the
    step cannot stream the state (chunking off); with it the floor keeps the largest parameter's.
    The same numbers decide whether the steps before the plan stream the state (warmup_streams)."""
    from deepcompile.plan.device_memory import check_floor, step_bytes, warmup_streams
    from deepcompile.plan.pricing import PlanError

    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(8)])   # 8 x 1 MiB
    sb = step_bytes(model, 1, lambda ps: torch.optim.AdamW(ps))
    assert (sb.kind, sb.shard, sb.trainable, sb.largest, sb.resident_step) == ("AdamW", 8 * MIB, 8 * MIB, MIB, 32 * MIB)
    limit = 24 * MIB / GIB      # shards 8 + gradients 8 + state 16 MiB resident; 8 + 8 + 2 streamed
    check_floor(limit, sb, 1, streamable=True)
    assert warmup_streams(limit, sb, True) and not warmup_streams(32 * MIB / GIB, sb, True)
    assert not warmup_streams(limit, sb, False) and not warmup_streams(None, sb, True)
    with pytest.raises(PlanError, match=r"2.0 MiB of AdamW state per rank \(the largest parameter's"):
        check_floor(17 * MIB / GIB, sb, 1, streamable=True)
    with pytest.raises(PlanError, match=r"16.0 MiB of AdamW state.*optimizer_chunk_mb 'auto' \(or a size\) lets the step"):
        check_floor(limit, sb, 1, streamable=False)

    class MyAdamW(torch.optim.AdamW):   # a user's subclass holds AdamW's two moments too
        pass
    with pytest.raises(PlanError, match=r"16.0 MiB of AdamW state"):
        check_floor(limit, step_bytes(model, 1, lambda ps: MyAdamW(ps)), 1, streamable=False)
    assert step_bytes(model, 1, lambda ps: torch.optim.SGD(ps, lr=0.1)) is None   # no moments: no floor
    check_floor(limit, None, 1, streamable=False)



def _warmup(rank: int, world: int):
    """ZeRO-3 with and without a limit the resident optimizer step passes by a quarter of AdamW's
    state (no planner: on the CPU the tiny model's forward and backward, which count the
    gathered parameters and activations in host memory, would not fit such a limit either)."""
    import deepcompile
    from deepcompile.plan.device_memory import step_bytes
    from tests.workloads import make_model, rank_step

    adamw = lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, foreach=True)  # noqa: E731
    big = {"n_embd": 128, "n_layer": 4}   # 3.2 MB of state per rank: a limit above the config's 1 MiB minimum
    sb = step_bytes(make_model(**big), world, adamw)
    out = {}
    for name, limit in (("roomy", None), ("tight", (sb.resident_step - sb.trainable // 2) / GIB)):
        model, opt = deepcompile.initialize(make_model(**big), adamw, {
            "compiler": "aot_eager", "passes": ["zero3"], "memory_limit_gib": limit,
            "optimizer_chunk_mb": 0.25})   # (the default 512 MiB would be one chunk of this model)
        mgr = model.dc_state.runtime.optimizer_state
        losses, held = [], []
        for s in range(4):
            losses.append(rank_step(model, opt, rank, world, s))
            held.append((mgr.streamed, mgr.total_bytes() - mgr.offloaded_bytes()))
        out[name] = {"losses": losses, "held": held, "state": mgr.total_bytes(), "limit": limit,
                     "warmup_stream_mb": model.dc_state.warmup_stream_mb, "resident_step": sb.resident_step,
                     "streamed_steps": mgr.stats["streamed_steps"],
                     "params": [p.detach().clone() for p in model.parameters()]}
        deepcompile.destroy(model)
    return out


def test_a_limit_the_resident_step_passes_streams_the_state_from_the_first_step():
    """Adam creates all of its state in the first step, before any plan: under a limit that
    shards + gradients + all of the state pass, every step streams the state through, the first
    included, and trains bitwise as the roomy run (2 gloo ranks). Held on the device, the 8B
    Llama's state on 2 ranks under 40 GiB takes the steps before the plan to 67 GiB."""
    for r in run_ranks(_warmup, 2, timeout=240):
        roomy, tight = r["roomy"], r["tight"]
        assert roomy["warmup_stream_mb"] is None and roomy["streamed_steps"] == 0
        assert all(not s for s, _ in roomy["held"])
        assert 0.001 < tight["limit"] and tight["resident_step"] > tight["limit"] * GIB
        assert tight["warmup_stream_mb"] == 0.25 and tight["streamed_steps"] == 4
        assert tight["held"] == [(True, 0)] * 4 and tight["state"] > 0, tight["held"]
        assert tight["losses"] == roomy["losses"]
        assert all(torch.equal(a, b) for a, b in zip(tight["params"], roomy["params"]))


def test_facts_of_a_profile_that_streamed_the_state_are_the_resident_ones():
    """A profiled step that kept the state on the host (Profile.state_streamed_bytes) measured
    forward/backward without it and a streamed optimizer step: the memory facts add the state
    back to every forward/backward peak and put all of it in place of the streamed chunks' share
    in the step's, and the optimizer's time leaves out the copies a streamed plan adds itself."""
    from deepcompile.plan.cost_model import resident_optimizer_ms
    from deepcompile.plan.estimate import offload_ms
    from deepcompile.plan.memory import facts_from_profile, streamed_state_held
    from deepcompile.profile.profiler import GraphProfile, NodeProfile, Profile

    state, shard = 4 * GIB, 2 * GIB
    groups = [[shard // 8] * 8]

    def profile(streamed: int, opt_peak: int, opt_ms: float) -> Profile:
        nodes = [NodeProfile("mm", 1.0, 5 * GIB, 6 * GIB, 0, "aten.mm.default")]
        return Profile(graphs={(0, "forward"): GraphProfile(0, "forward", nodes)}, hardware="NVIDIA H200",
                       optimizer_ms=opt_ms, optimizer_peak_bytes=opt_peak, state_streamed_bytes=streamed)

    kw = dict(opt_groups=groups, opt_temp_factor=0.0, opt_profiled_chunk=shard // 8, opt_streamable=True)
    plain = facts_from_profile(profile(0, 2 * shard + state, 10.0), {}, 2, state, grad_bytes=shard, **kw)
    held = streamed_state_held(plain, (shard // 8) / MIB)
    assert held == 3 * state // 8
    streamed = facts_from_profile(profile(state, 2 * shard + held, 10.0 + offload_ms(state, 0.0, True)), {}, 2,
                                  state, grad_bytes=shard, **kw)
    assert plain.fb_peak == 6 * GIB and streamed.fb_peak == 6 * GIB + state
    assert [p for _, p, _ in streamed.timeline] == [6 * GIB + state]
    assert streamed.optimizer_peak == plain.optimizer_peak == 2 * shard + state
    assert resident_optimizer_ms(profile(state, 0, 10.0 + offload_ms(state, 0.0, True))) == pytest.approx(10.0)
    assert resident_optimizer_ms(profile(0, 0, 10.0)) == 10.0
