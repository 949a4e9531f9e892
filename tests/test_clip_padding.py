"""Gradient clipping when a rank holds only padding rows of a parameter.

A parameter with fewer rows than ranks (a bias of size 1, a ``Linear(16, 1)`` weight) leaves
rank 1 of 2 with zero real rows: its slice of the gradient is empty. The infinity norm of an
empty tensor is undefined in torch, so that slice must be left out of the rank's partial norm
rather than passed to ``get_total_norm``. Real gloo ranks, torch's call and deepcompile's, norms
inf and 2, against the unsharded model's norm and clipped update.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.dist_utils import run_ranks

STEPS = 3
MAX_NORM = 0.01  # far below the tiny model's gradient norm: every step clips
LR = 0.1
BATCH = 4


def _model():
    torch.manual_seed(0)
    # the last layer's weight (1, 16) and bias (1,) have one row: rank 1 of 2 holds only padding
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _batch(step: int, world: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(world * BATCH, 8, generator=g), torch.randn(world * BATCH, 1, generator=g)


def _reference(world: int, norm_type: float):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for s in range(STEPS):
        x, y = _batch(s, world)
        torch.nn.functional.mse_loss(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type).item())
        opt.step()
        opt.zero_grad()
    return norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank, world, stage, norm_type, torch_call):
    import deepcompile

    cfg = {"zero_stage": stage, "compiler": "aot_eager"}
    if stage == 3:
        cfg["passes"] = ["zero3"]
    model, opt = deepcompile.initialize(_model(), lambda ps: torch.optim.SGD(ps, lr=LR), cfg)
    norms = []
    sl = slice(rank * BATCH, (rank + 1) * BATCH)
    for s in range(STEPS):
        x, y = _batch(s, world)
        # mean over the global batch: each rank's loss is its share, the reduced gradient the mean
        (torch.nn.functional.mse_loss(model(x[sl]), y[sl])).backward()
        if torch_call:
            n = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
        else:
            n = deepcompile.clip_grad_norm_(model, MAX_NORM, norm_type)
        norms.append(n.item())
        opt.step()
        opt.zero_grad()
    return norms, deepcompile.full_state_dict(model)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("norm_type,torch_call", [(math.inf, True), (math.inf, False), (2.0, True)])
def test_clip_with_padding_only_rank(stage, norm_type, torch_call):
    world = 2
    ref_norms, ref_state = _reference(world, norm_type)
    assert min(ref_norms) > 2 * MAX_NORM, "clipping never triggered: the comparison would be vacuous"
    results = run_ranks(_train, world, stage, norm_type, torch_call, timeout=300)
    for rank, (norms, state) in enumerate(results):
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank} global norm: {m}")
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {k} after clipped steps: {m}")
    assert results[0][0] == results[1][0], "ranks disagree on the norm"
