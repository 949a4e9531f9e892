"""A forward that differs by rank fails on every rank within seconds, naming the parameters.

DeepSpeed's own unit-test model: rank 0 runs an extra ``Linear``, rank 1 does not. The ranks'
compiled graphs gather (ZeRO-3) or keep whole and reduce (ZeRO-1) different parameters; run as
they are, rank 0 would wait for a gather rank 1 never issues until ``collective_timeout_s``.
The compiled graphs' collective sequences are compared when they are compiled
(``runtime/graphcheck.py``): both ranks must fail well before that timeout, with a message that
names the extra layer's parameters and the fix. Real gloo ranks.
"""
from __future__ import annotations

import time

import pytest
import torch

from tests.dist_utils import run_ranks

TIMEOUT_S = 120.0  # collective_timeout_s: the failure must come long before it


class RankDependent(torch.nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.rank = rank
        self.first = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.last = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = self.first(x)
        if self.rank == 0:
            h = self.extra(torch.relu(h))
        return self.last(h)


def _train(rank, world, stage):
    import deepcompile

    cfg = {"zero_stage": stage, "compiler": "aot_eager", "collective_timeout_s": TIMEOUT_S}
    if stage == 3:
        cfg["passes"] = ["zero3"]
    model, opt = deepcompile.initialize(RankDependent(rank), lambda ps: torch.optim.SGD(ps, lr=0.1), cfg)
    t0 = time.monotonic()
    try:
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001 - the failure is the result
        return {"error": f"{type(e).__name__}: {e}", "after_s": time.monotonic() - t0, "at": time.time()}
    return {"error": None, "after_s": time.monotonic() - t0, "at": time.time()}


@pytest.mark.parametrize("stage", [3, 1])
def test_rank_dependent_forward_fails_fast_on_every_rank(stage):
    results = run_ranks(_train, 2, stage, timeout=400)
    for rank, r in enumerate(results):
        err = r["error"]
        assert err is not None, f"rank {rank} trained a rank-dependent forward without an error"
        assert "different collective sequences" in err, f"rank {rank}: {err[:2000]}"
        assert "'extra.weight'" in err and "'extra.bias'" in err, f"rank {rank} names no parameter: {err[:2000]}"
        assert "rank 0 also uses" in err, err[:2000]
        assert "leave the module" in err and "every parameter on every rank" in err, err[:2000]
        # the compile itself takes seconds under load; the wait for the other rank must not
        # come near the collective timeout
        assert r["after_s"] < TIMEOUT_S / 2, f"rank {rank} failed only after {r['after_s']:.1f} s: {err[:500]}"
    gap = abs(results[0]["at"] - results[1]["at"])
    assert gap < 20, f"the ranks failed {gap:.1f} s apart"


class _CountingStore:
    """The store the check uses, counting its calls."""

    def __init__(self, store):
        self.inner, self.calls = store, {}

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def counted(*a, **k):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*a, **k)
        return counted


def _train_same(rank, world):
    import deepcompile

    model, opt = deepcompile.initialize(RankDependent(0), lambda ps: torch.optim.SGD(ps, lr=0.1),
                                        {"compiler": "aot_eager", "passes": ["zero3"]})
    check = model.dc_backend.graph_check
    check.store = _CountingStore(check.store)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        model(torch.randn(4, 8, generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()
    return check.checked, check.store.calls, sorted(model.dc_backend.compiled)


def test_same_forward_passes_with_one_exchange_per_compiled_graph():
    for checked, calls, compiled in run_ranks(_train_same, 2, timeout=300):
        assert compiled == [(0, "backward"), (0, "forward")], compiled
        assert checked == len(compiled), (checked, compiled)
        # per compiled graph: the abort key's check, one post, one check of the others' posts,
        # and one read of them when they are there; nothing per step
        assert calls.get("set", 0) == checked, calls
        assert calls.get("multi_get", 0) <= checked and calls.get("check", 0) <= 3 * checked, calls
