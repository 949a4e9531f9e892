"""GPU test (NCCL, 1 or 2 GPUs): the cast stream changes where the casts run, not what they compute.

With config ``cast_stream`` on (the default) a gather's cast of the fp32 shards to bf16 and a
reduced bucket's cast and scale to fp32 run on a side stream, ordered by events against the
compute stream. A missing event shows as a race: a gather that reads a shard before the
optimizer wrote it, a .grad read before its cast finished, a bucket's memory reused while the
side stream still reads it. The kernels are the same either way, so the runs must agree
bitwise, with several buckets per step, kept (persistent) gathers and gradient accumulation.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")]


def _run(world: int, cast_stream: bool, accumulation: int):
    from tests.workloads import train_sharded

    cfg = {"compiler": "inductor", "default_schedule": True, "reduce_bucket_size": 20_000, "cast_stream": cast_stream,
           "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}}
    return run_ranks(train_sharded, world, 6, accumulation, cfg, backend="nccl", timeout=400)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_cast_stream_is_bitwise_the_same(accumulation):
    world = min(2, torch.cuda.device_count())
    off = _run(world, False, accumulation)
    on = _run(world, True, accumulation)
    for r in range(world):
        assert on[r]["stats"]["reduce_scatters"] > 6, on[r]["stats"]  # several buckets per step
        assert on[r]["losses"] == off[r]["losses"], (on[r]["losses"], off[r]["losses"])
        for k, v in off[r]["state"].items():
            assert torch.equal(on[r]["state"][k], v), k
    print(f"cast stream, {world} rank(s), accumulation {accumulation}: losses {on[0]['losses'][0]:.4f} -> "
          f"{on[0]['losses'][-1]:.4f} bitwise as without it; {on[0]['stats']['reduce_scatters']} reduce-scatters")
