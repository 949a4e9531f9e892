"""How much slower the GPU runs compute-bound kernels in a busy step than the profiling step times them.

The profiling step parks the GPU in a spin kernel and then times each node as it comes
(``profiler._GpuLead``): a matmul there starts at the clock the light spin left, the boost clock.
A training step runs its heavy matmuls back to back, and under its power limit the GPU lowers the
clock within tens of milliseconds. On one H200 a 16384x4096 @ 4096x14336 bf16 matmul took 2.40
ms for its first twenty runs after a spin and 2.81-2.88 ms from the fiftieth on (+17%); the same
matmul measured 2.67 ms (median) inside a compiled 8B-shape step at 16k tokens, whose matmuls the
profile priced 21% under the trace.

:func:`measure` runs the profile's heaviest matmul the way the profiler timed it (after a spin)
and then back to back for ``SUSTAIN_MS``, with tensors that fit under the profiled step's own
peak; the ratio of the two is what ``agree`` scales every matmul and attention latency by
(``apply``). A host-bound step keeps its kernels apart, but the
cost model gives such a step the host's pace, which the ratio does not touch.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from deepcompile.vocab.ops import op_class

SUSTAIN_MS = 200.0     # long enough for the power limit to set the clock (50 ms did on an H200)
MAX_BYTES = 512 << 20  # the matmul's inputs and output, beside what the step holds between steps
MAX_RATIO = 1.5        # a larger ratio is a disturbed measurement, not a clock


def heaviest_matmul(compiled: dict, measured: dict, max_bytes: int = MAX_BYTES) -> tuple[fx.Node, float] | None:
    """(node, profiled ms) of the slowest matmul over the profiled graphs (``compiled``:
    (gid, kind) -> GraphModule, ``measured``: the same keys -> node records) whose inputs and
    output fit ``max_bytes`` and are all known (fake tensors in the node's meta)."""
    best = None
    for key, gm in compiled.items():
        lat = {r.name: r.latency_ms for r in measured.get(key, [])}
        for n in gm.graph.nodes:
            if n.op != "call_function" or op_class(str(n.target)) != "matmul" or n.name not in lat:
                continue
            if any(isinstance(a, (list, tuple)) for a in list(n.args) + list(n.kwargs.values())):
                continue
            vals = [a.meta.get("val") for a in list(n.args) + list(n.kwargs.values()) if isinstance(a, fx.Node)]
            vals.append(n.meta.get("val"))
            if not all(isinstance(v, torch.Tensor) and all(isinstance(d, int) for d in v.shape) for v in vals):
                continue
            if sum(v.numel() * v.element_size() for v in vals) > max_bytes:
                continue
            if best is None or lat[n.name] > best[1]:
                best = (n, lat[n.name])
    return best


def measure(compiled: dict, measured: dict, device: torch.device) -> dict | None:
    """{"ratio", "node", "burst_ms", "sustained_ms"} of the heaviest matmul (CUDA only; None
    elsewhere or without one): its median time over the first runs after a spin, as the
    profiler timed it, against the median of the second half of ``SUSTAIN_MS`` of runs back
    to back."""
    if device.type != "cuda":
        return None
    # under the profiled step's own peak: the measurement must not raise the run's. It runs after
    # the profiling step's optimizer.step(), beside all the state (1 H200, 8-layer Llama: that
    # window's peak 2.32 -> 2.62 GiB, under the step's forward/backward peak of 2.82 GiB)
    peak = max((r.peak_bytes for recs in measured.values() for r in recs), default=0)
    room = min(MAX_BYTES, peak - torch.cuda.memory_allocated(device) - (64 << 20))
    found = heaviest_matmul(compiled, measured, room) if room > 0 else None
    if found is None:
        return None
    try:
        return _measure(found[0], device)
    except (RuntimeError, TypeError) as e:   # an input it cannot make (a dtype randn lacks), no memory
        import logging

        logging.getLogger("deepcompile").info("profiler: the sustained-clock measurement of %s failed (%s); "
                                              "latencies are used as profiled", found[0].name, e)
        return None


def _measure(node: fx.Node, device: torch.device) -> dict:
    from deepcompile.profile.profiler import _GpuLead

    def real(a):
        if not isinstance(a, fx.Node):
            return a
        v = a.meta["val"]
        return torch.randn(v.shape, dtype=v.dtype, device=device) if v.is_floating_point() else \
            torch.zeros(v.shape, dtype=v.dtype, device=device)

    args = [real(a) for a in node.args]
    kwargs = {k: real(v) for k, v in node.kwargs.items()}
    run = lambda: node.target(*args, **kwargs)  # noqa: E731
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    run()
    t1.record()
    t1.synchronize()
    n = max(20, min(400, math.ceil(SUSTAIN_MS / max(t0.elapsed_time(t1), 1e-3))))
    _GpuLead.spin()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        run()
        ev[i + 1].record()
    torch.cuda.synchronize()
    ms = [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]
    burst = sorted(ms[:3])[1]
    sustained = sorted(ms[n // 2:])[(n - n // 2) // 2]
    return {"ratio": round(min(MAX_RATIO, max(1.0, sustained / max(burst, 1e-6))), 4), "node": node.name,
            "burst_ms": round(burst, 4), "sustained_ms": round(sustained, 4)}


def apply(profile) -> int:
    """Scale the profile's matmul and attention latencies by its agreed ``sustained`` ratio;
    returns how many nodes it scaled."""
    ratio = float((getattr(profile, "sustained", None) or {}).get("ratio") or 1.0)
    if ratio == 1.0:
        return 0
    k = 0
    for g in profile.graphs.values():
        for n in g.nodes:
            if op_class(n.op) in ("matmul", "attention"):
                n.latency_ms *= ratio
                k += 1
    return k
