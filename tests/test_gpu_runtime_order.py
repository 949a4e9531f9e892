"""GPU test (NCCL, 1 GPU): the gradient scale tensor outlives the side-stream casts that read it.

A reduced bucket is cast to its shards' dtype and scaled on the cast stream (``mul_out`` with a
one-element scale tensor of that dtype). Within one backward the shards' dtype can alternate
between buckets (fp32 and bf16 shards), and each change replaces that scale tensor while the
side stream, which is joined only at ``end_backward``, may not have run the previous bucket's
cast yet. Without telling the caching allocator, the replaced tensor's block goes back to the
compute stream's pool at once, and the next small allocation there can overwrite it while the
side stream still reads it: silently wrong gradients.

Here the compute stream is held back (``torch.cuda._sleep``) so every side-stream cast of a step
is queued behind it; buckets alternate fp32 and bf16 shards (each change replaces the scale
tensor); after every reduce, small NaN-filled tensors are allocated on the compute stream (they
take a freed block if one is there) and the bucket's casts are large enough to be running while
those fills land. Every shard's .grad must equal the reference (the gradient cast to the shard's
dtype, times a power-of-two scale: exact in either dtype), for scales that change every step.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")]

ROWS, COLS = 4096, 4096  # 16M elements a bucket: a side-stream cast that takes a while


def _alternating_dtypes(rank, world, steps):
    import torch.distributed as dist

    from deepcompile.runtime import ops

    C = ops.ensure_registered()
    # every gradient its own bucket (bucket of 1 element), one reduce in flight: each add_grad
    # completes the previous bucket, whose cast and scale go to the side stream there
    C.init(dist.group.WORLD, 1, 1, 120_000)
    C.set_reduce_dtype(torch.float32)
    dev = torch.device("cuda", torch.cuda.current_device())
    dtypes = [torch.float32, torch.bfloat16] * 3
    shards = []
    for i, dt in enumerate(dtypes):
        shard = torch.zeros(ROWS // world, COLS, dtype=dt, device=dev)
        C.register_param(i, f"p{i}", shard, [ROWS, COLS], dt)
        shards.append(shard)
    gen = torch.Generator(device=dev).manual_seed(0)
    bad = []
    try:
        for step in range(steps):
            scale = [0.5, 0.25, 0.125][step % 3]  # changes every step: the tensor is replaced
            C.set_grad_scale(scale)
            for s in shards:
                s.grad = None
            grads = [torch.randn(ROWS, COLS, device=dev, generator=gen) for _ in shards]
            want = [(g * world).to(dt) * scale for g, dt in zip(grads, dtypes)]  # world ranks, same grads
            torch.cuda.synchronize()
            torch.cuda._sleep(100_000_000)  # the compute stream busy: side-stream casts queue behind it
            keep = []
            for i, g in enumerate(grads):
                torch.ops.dc.reduce_grad.default(g, i)
                # small allocations on the compute stream, written at once: one takes a block the
                # allocator thinks free
                keep += [torch.full((1,), float("nan"), device=dev) for _ in range(64)]
            torch.ops.dc.end_backward.default([shards[0]], 0)
            del grads
            torch.cuda.synchronize()
            for i, (s, w) in enumerate(zip(shards, want)):
                if s.grad is None or not torch.equal(s.grad, w):
                    n_nan = int(torch.isnan(s.grad.float()).sum()) if s.grad is not None else -1
                    bad.append((step, i, str(dtypes[i]), n_nan))
            del keep, want
        return bad
    finally:
        C.cleanup()


def test_scale_tensor_replaced_while_side_stream_reads_it():
    """Gradients equal the reference with the cast stream on, scale and shard dtype changing while
    side-stream casts are in flight."""
    res = run_ranks(_alternating_dtypes, 1, 12, backend="nccl", timeout=400)
    assert res[0] == [], f"wrong gradients (step, parameter, dtype, NaN count): {res[0][:10]}"
