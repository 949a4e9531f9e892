"""CUDA graphs around the compute between runtime ops (runtime/cudagraphs.py, issue 16).

GPU tests (2 GPUs, NCCL): the same training with and without CUDA graphs gives the same losses
and parameters, the graphs are really captured and replayed (not silently run as code), and a
loss kept across steps stays valid. The CPU tests check the pool's step logic (when a replay
would overwrite memory still in use), the warm-up's moving-input classification, and that kept
parameters keep their addresses. Not tested yet: a larger output held into the next step raising
when read.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks


def _train(rank, world, steps, accumulation, graphs):
    import deepcompile
    from tests.workloads import LOCAL_BATCH, global_batch, make_model, make_optimizer

    cfg = {"compiler": "inductor", "gradient_accumulation_steps": accumulation, "cuda_graphs": bool(graphs)}
    model, opt = deepcompile.initialize(make_model(), make_optimizer, cfg)
    device = next(model.parameters()).device
    losses, kept = [], []
    for s in range(steps):
        for j in range(accumulation):
            x, y = global_batch(s, j, world, device)
            sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            loss = model(x[sl], y[sl])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            kept.append(loss)   # held across steps: must stay valid (the pool clones one-element outputs)
    pool = model.dc_backend.graph_pool
    return {"losses": losses, "kept": [float(t) for t in kept], "state": deepcompile.full_state_dict(model),
            "pool": pool.summary() if pool is not None else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_graphs_train_like_code(accumulation):
    steps = 8
    on = run_ranks(_train, 2, steps, accumulation, True, backend="nccl", timeout=600)
    off = run_ranks(_train, 2, steps, accumulation, False, backend="nccl", timeout=600)
    for r_on, r_off in zip(on, off):
        torch.testing.assert_close(torch.tensor(r_on["losses"]), torch.tensor(r_off["losses"]), rtol=1e-5, atol=1e-6)
        # the losses kept as tensors across steps read the same as .item() at their step
        assert r_on["kept"] == pytest.approx(r_on["losses"], rel=0, abs=0)
        for k, v in r_off["state"].items():
            torch.testing.assert_close(r_on["state"][k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
        p = r_on["pool"]
        assert p is not None and off[0]["pool"] is None
        assert p["captured"] > 0 and p["captured"] == p["partitions"], p
        # every step after the capture step replays every partition
        assert p["replays"] >= p["captured"] * (steps * accumulation - 5), p
        assert not p.get("moved_input") and not p["reasons"], p
    print(f"cuda graphs, accumulation {accumulation}: {on[0]['pool']}; peak {on[0]['peak_gib']:.3f} GiB "
          f"(outside the pool) vs {off[0]['peak_gib']:.3f} without graphs")


def test_pool_step_logic_cpu():
    """The cycle rules without a GPU: which mode each call gets, and a step whose order differs
    from the capture step's runs as code."""
    from deepcompile.runtime import cudagraphs as cg

    pool = cg.Pool(torch.device("cpu"))
    calls = []

    class Part:
        def __init__(self, name):
            self.name, self.last_cycle, self.graph, self.off = name, 0, None, None

    a, b, c = Part("a"), Part("b"), Part("c")
    for _ in range(cg.WARM_CYCLES):
        calls += [pool.mode(a), pool.mode(b), pool.mode(c)]
    assert calls == ["warm"] * 3 * cg.WARM_CYCLES
    assert [pool.mode(p) for p in (a, b, c)] == ["capture"] * 3
    for p in (a, b, c):
        p.graph = object()
    pool.seq = [a, b, c]

    def step(*parts):
        out = []
        for p in parts:
            m = pool.mode(p)
            pool.pos += m == "replay"   # PartitionGraph._replay advances the position
            out.append(m)
        return out

    assert step(a, b, c) == ["replay"] * 3
    # b skipped: c would write memory that b's outputs occupy in the captured step
    assert step(a, c, b) == ["replay", "eager", "eager"] and pool.broken
    assert step(a, b, c) == ["replay"] * 3 and pool.broken is None   # the next step starts clean
    # a partition run twice in one warm-up step turns the pool off
    pool2 = cg.Pool(torch.device("cpu"))
    d, e = Part("d"), Part("e")
    assert pool2.mode(d) == "warm" and pool2.mode(e) == "warm"
    assert pool2.mode(e) == "eager" and "twice" in pool2.disabled
    assert pool2.mode(d) == "eager"


def _kept_addresses(rank, world, graphs):
    import deepcompile
    from deepcompile.runtime import ops
    from tests.workloads import LOCAL_BATCH, global_batch, make_model, make_optimizer

    cfg = {"compiler": "aot_eager", "cuda_graphs": graphs,
           "passes": ["zero3", {"name": "selective_unshard", "params": {"budget_mb": 1000.0}}]}
    model, opt = deepcompile.initialize(make_model(), make_optimizer, cfg)
    losses, ptrs = [], []
    for s in range(4):
        x, y = global_batch(s, 0, world)
        sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        loss = model(x[sl], y[sl])
        ptrs.append(dict(ops.C.persistent_ptrs()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "ptrs": ptrs, "reused": int(ops.C.stats()["reused_buffers"])}


def test_kept_parameters_keep_their_addresses_for_graphs_cpu():
    """With cuda_graphs on, the kept gathered parameters are gathered into the same memory every
    step (a captured graph reads them there; on the GPU a moved buffer made every step fall back
    to code), and training is bitwise what it is with the buffers freed at each step."""
    on = run_ranks(_kept_addresses, 2, True, timeout=240)
    off = run_ranks(_kept_addresses, 2, False, timeout=240)
    for r_on, r_off in zip(on, off):
        assert r_on["losses"] == r_off["losses"]
        assert r_on["ptrs"][0] and all(p == r_on["ptrs"][0] for p in r_on["ptrs"]), r_on["ptrs"]
        assert r_on["reused"] == 3 * len(r_on["ptrs"][0]) and r_off["reused"] == 0


def test_warm_up_tells_moving_inputs_from_partition_outputs_cpu():
    """Two warm-up steps decide which inputs must be copied at each replay. An input that an
    earlier partition of the same step returned is not one of them, even though the allocator
    puts it elsewhere each step while the partitions run as code: once captured it lives in the
    pool. A large input from outside (here a fresh 20 MB tensor each step) is, and its partition
    is left uncaptured with the reason."""
    from deepcompile.runtime import cudagraphs as cg

    pool = cg.Pool(torch.device("cpu"))
    big = 5 << 20   # float32 elements: 20 MiB, over COPY_LIMIT

    def first(args):
        (x,) = args
        args.clear()
        return [torch.full((big,), float(x.sum()))]        # a fresh buffer every step

    def second(args):
        (h, w) = args
        args.clear()
        return [h[:4] * w[:4]]

    a = cg.PartitionGraph(first, pool, "a")
    b = cg.PartitionGraph(second, pool, "b")
    c = cg.PartitionGraph(second, pool, "c")
    w = torch.ones(big)                                      # same tensor every step (a kept parameter)
    for step in range(cg.WARM_CYCLES):
        x = torch.full((3,), float(step))
        (h,) = a([x])
        b([h, w])
        c([h, torch.ones(big)])                              # a fresh large input every step
    assert a.off is None and a.moving == {0}                 # the small batch input: copied
    assert b.off is None and b.moving == set() and b.from_parts == {0}
    assert c.off is not None and "input 1" in c.off and "moves between steps" in c.off


def test_gradients_and_small_graph_inputs_are_always_copied_cpu():
    """The loss's seed gradient sat at one address through both warm-up steps on the GPU and
    moved at the first replay (the capture step changes what the allocator holds), so every step
    fell back to code. Gradients handed to a backward graph and small graph inputs are copied at
    each replay whatever the warm-up saw; a graph input the partition writes into is not (its
    writes would land in the copy), nor is a large one that keeps its address."""
    from deepcompile.runtime import cudagraphs as cg

    pool = cg.Pool(torch.device("cpu"))

    def f(args):
        vals = list(args)
        args.clear()
        return [sum(float(v.sum()) for v in vals) * torch.ones(2)]

    def loss(args):
        args.clear()
        return [seed]

    # the seed gradient at the address of an earlier partition's output (the allocator reused it)
    seed, big_grad, big_in, state = torch.ones(()), torch.ones(1 << 19), torch.ones(1 << 19), torch.zeros(4)
    fw = cg.PartitionGraph(loss, pool, "fw.p0")
    p = cg.PartitionGraph(f, pool, "bw.p0", mutated=frozenset({3}), graph_inputs=frozenset({0, 1, 2, 3}),
                          tangents=frozenset({1}))
    for _ in range(cg.WARM_CYCLES):
        fw([])
        p([seed, big_grad, big_in, state])       # the same tensors every step: no address moves
    assert p.off is None and p.from_parts == {0}
    assert p.moving == {0, 1}, p.moving          # the small seed and the 2 MiB gradient; not big_in, not state
