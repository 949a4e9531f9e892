"""GPU (1 or more): the default plan with Inductor matches the unsharded model, in the run that
plans (trace once) and in its re-run, which takes the plan from the plan cache and the graphs from
the AOTAutograd entry the first run seeded. Marked `gpu`; skips without CUDA."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")]


@pytest.mark.parametrize("blocks,accumulation", [(False, 1), ("auto", 1), ("auto", 2)],
                         ids=["whole", "blocks", "blocks-accumulation2"])
def test_rerun_from_seeded_caches_matches_unsharded(tmp_path, monkeypatch, blocks, accumulation):
    """``blocks``: config ``blocks: "auto"`` at 4 layers (the middle blocks share one region
    compile; the re-run loads the regions' driver from the same seeded entry); whole: ``blocks:
    false``, the default."""
    from tests.workloads import train_reference, train_sharded

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the ranks inherit it
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "inductor" / "triton"))
    over = {"n_layer": 4} if blocks else None
    world, steps = min(2, torch.cuda.device_count()), 10
    ref_losses, ref_state = train_reference(world, steps, accumulation, device="cuda:0", model_overrides=over)
    for run in ("planning run", "re-run"):
        cfg = {"compiler": "inductor", "default_schedule": True, "blocks": blocks}
        results = run_ranks(train_sharded, world, steps, accumulation, cfg, over, backend="nccl", timeout=600)
        mean = torch.tensor([r["losses"] for r in results]).mean(0)
        torch.testing.assert_close(mean, torch.tensor(ref_losses, dtype=mean.dtype), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{run}: {m}")
        for r in results:
            for k, v in ref_state.items():
                torch.testing.assert_close(r["state"][k], v, rtol=1e-3, atol=1e-4, msg=lambda m: f"{run} {k}: {m}")
        hits = [r["aot_cache_hits"] for r in results]
        assert hits == [[] if run == "planning run" else [0]] * world, (run, hits)
        if blocks:  # regions compiled in the planning run and shared; the re-run compiled none, loaded them
            made = [r["blocks"] for r in results]
            if run == "planning run":
                assert all(m and all(s["cached"] is True for s in m) and any(s["reused"] for s in m)
                           for m in made), made
            else:
                assert made == [[]] * world and all(r["blocks_loaded"] for r in results), (
                    made, [r["blocks_loaded"] for r in results])
