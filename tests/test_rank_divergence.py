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
