"""Communication micro-benchmarks of the profiling step: allgather (the shard group's gathers and
reduce-scatters) and all-reduce (hybrid sharding's replicate group) timed by message size on the
real process group, fitted to the alpha-beta :class:`~deepcompile.vocab.links.CommModel` the cost
model prices collectives with.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from deepcompile.compat import c10d as c10d_compat
from deepcompile.vocab.links import CommModel


def benchmark_comm(group=None, device=None, sizes=None, reps: int | None = None) -> CommModel:
    """Time allgather by output size on the real process group; fit latency + bytes/bandwidth."""
    world = dist.get_world_size(group)

    def run(nbytes, device):
        n = max(world, nbytes // 2 // world * world)
        out = torch.empty(n, dtype=torch.bfloat16, device=device)
        inp = torch.ones(n // world, dtype=torch.bfloat16, device=device)
        return float(out.numel() * out.element_size()), lambda: c10d_compat.all_gather_single(out, inp, group)

    return _fit_collective(run, device, sizes, reps)


def benchmark_allreduce(group, device=None, sizes=None, reps: int | None = None) -> CommModel:
    """Time ``all_reduce`` by buffer size on ``group`` (hybrid sharding's replicate group: the
    gradient all-reduce across replicas); fit latency + bytes/bandwidth, bytes being the reduced
    buffer's. Measured apart from the shard group's gathers because across nodes the two links
    differ by an order of magnitude (NVLink within a node, the network between)."""
    def run(nbytes, device):
        # the reduce dtype of the runtime's default (fp32 gradients)
        buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        return float(buf.numel() * buf.element_size()), lambda: dist.all_reduce(buf, group=group)

    return _fit_collective(run, device, sizes, reps)


# On the CPU a rank computes on the cores gloo's threads also need, and a collective called after
# compute costs what back-to-back calls do not: the thread that sends must be woken and scheduled
# beside the peer's compute, and the ranks arrive apart. 2 gloo ranks on 2 cores, 16 KiB gathers:
# 0.27 ms each back to back, 0.55-1.2 ms each after 150-250 us of matmuls (the demo's steady step
# of 45 gathers spent 0.8-1.2 ms a gather). So each timed call comes after GAP_US of compute, as
# in a step, and the mean over CPU_REPS calls is kept.
GAP_US = 200.0
CPU_REPS = 8


def _compute_gap():
    """A callable that computes for about ``GAP_US`` on this rank's threads (a small matmul
    repeated; the count is measured here, so every rank of one machine does about as much)."""
    a = torch.randn(64, 64)
    for _ in range(20):
        a @ a
    t0 = time.perf_counter()
    for _ in range(200):
        a @ a
    per_us = max((time.perf_counter() - t0) * 1e6 / 200, 1e-3)
    n = max(1, int(GAP_US / per_us))

    def gap():
        for _ in range(n):
            a @ a
    return gap


def _fit_collective(run, device, sizes, reps: int | None) -> CommModel:
    """Time ``run(nbytes, device)``'s collective at each size (after a warm-up, ``reps`` calls:
    the median of 3 on a GPU; on the CPU the mean of ``CPU_REPS``, each after a compute gap) and
    fit ``alpha + bytes / bandwidth`` by least squares."""
    device = device or torch.device("cpu")
    cpu = device.type != "cuda"
    reps = reps or (CPU_REPS if cpu else 3)
    if sizes is None:
        # on the CPU from 1 KiB: a small model's parameters are kilobytes, and gloo's per-call
        # cost there is what its gathers pay
        top, low = (4 << 20, 10) if cpu else (64 << 20, 16)
        sizes = [1 << k for k in range(low, top.bit_length())]
    xs, ys = [], []
    gap = _compute_gap() if cpu else None
    for nbytes in sizes:
        x, fn = run(nbytes, device)
        times = []
        for r in range(reps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            if gap is not None:
                gap()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r:
                times.append((time.perf_counter() - t0) * 1e6)
        xs.append(x)
        # CPU: the mean, a step pays every call's wait (a tenth of them wait a scheduler tick)
        ys.append(sum(times) / len(times) if cpu else sorted(times)[len(times) // 2])
        del fn
    if device.type == "cuda" and xs:
        # its buffers (up to 64 MiB) are no part of the training step's memory: the allocator's
        # peak starts again without them (the step's peak is read after this, steps.jsonl)
        torch.cuda.reset_peak_memory_stats()
    # least squares y = alpha + x / beta; on the CPU weighted by 1/y^2 (relative error): sizes
    # span three orders of magnitude, and unweighted the largest set alpha (gloo on 2 cores: 1.3 ms
    # fitted against 0.1-0.2 ms measured for the demo's gathers)
    w = [1.0 / (y * y) if cpu and y > 0 else 1.0 for y in ys]
    sw = sum(w)
    mx, my = sum(wi * x for wi, x in zip(w, xs)) / sw, sum(wi * y for wi, y in zip(w, ys)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs)) or 1.0
    slope = max(sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / sxx, 1e-12)
    alpha = max(my - slope * mx, 0.0)
    copy_bw = 5e3 if cpu else 2e6
    return CommModel(alpha_us=alpha, bytes_per_us=1.0 / slope, copy_bytes_per_us=copy_bw)
