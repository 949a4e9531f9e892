"""Hybrid sharding (config ``mesh.shard``): 4 gloo ranks as 2 replicas x 2 shards must train like
the unsharded reference (tolerance: tests/test_zero3_parity.py's), each rank holding half of every
parameter (not a quarter), with gathers and reduce-scatters in the shard group and the gradient
all-reduce across replicas. A shard size that does not divide the world is refused by name."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.workloads import make_model, train_reference, train_sharded

STEPS = 4


def _check(results, ref_losses, ref_state):
    mean = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref_losses, dtype=mean.dtype), rtol=1e-5, atol=1e-6)
    for r in results:
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("stage", [3, 2])
def test_hsdp_2x2_matches_the_unsharded_reference(stage):
    ref_losses, ref_state = train_reference(4, STEPS, 1)
    cfg = {"compiler": "aot_eager", "zero_stage": stage, "mesh": {"shard": 2}}
    if stage != 3:
        cfg["passes"] = ["zero12"]
    results = run_ranks(train_sharded, 4, STEPS, 1, cfg, timeout=600)
    _check(results, ref_losses, ref_state)
    # sharded over 2 ranks: every shard holds ceil(d0 / 2) rows of its parameter
    full = make_model()
    seen, want = set(), 0
    for p in full.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            want += -(-p.shape[0] // 2) * (p[0].numel() if p.dim() else 1) if p.dim() else 1
    assert all(r["shard_numel"] == want for r in results), ([r["shard_numel"] for r in results], want)


def _bad_shard(rank, world):
    import deepcompile

    with pytest.raises(ValueError, match="mesh.shard = 3 does not divide the world size 4"):
        deepcompile.initialize(make_model(), torch.optim.AdamW, {"compiler": "aot_eager", "mesh": {"shard": 3}})


def test_shard_size_must_divide_the_world():
    run_ranks(_bad_shard, 4, timeout=300)
