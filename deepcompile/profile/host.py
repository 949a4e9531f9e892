"""The host's speed, measured at the profiling step: what calibrates the host model to the machine.

A compiled step on a GPU is host-bound when the host needs longer to launch its ops than the
GPU to run them (the 953M Llama's default plan on 2 H200s: 70% of the step). The cost model
charges each op the host time ``HOST_US`` gives its kind, measured on one host.
Another host (another CPU, clock, Python build, or load) launches at another pace, so at the
profiling step (GPU only: on the CPU an op's measured latency already includes its launch) this
module times a fixed micro-benchmark of the two things a compiled step's host time is made of:

- ``dispatch_us``: one tiny aten op on the device through the dispatcher with an ``out=``
  buffer (``torch.add``, 1 element): the per-op launch path every extern kernel, custom
  ``dc`` op and eager op takes (Python binding, dispatcher, caching allocator, CUDA launch);
- ``python_us``: a fixed piece of pure Python shaped like the generated wrapper's code (local
  reads, tuple unpacking, a call, ``del``): the "node" share of ``HOST_US``.

Each is the median of ``REPS`` rounds of ``N`` iterations (a few ms in all, no device sync
inside a round: the GPU runs each add in ~2 us, faster than the host launches it, so the launch
queue never fills). ``plan.estimate.host_model`` divides them by the same micro-benchmark's
values on the host ``HOST_US`` was measured on (``plan.estimate.HOST_REF``) and scales
``HOST_US`` by the ratios ("node" by ``python_us``, every launch by ``dispatch_us``). The
profile records the measurement (``Profile.host``, agreed across ranks: the slowest rank's, so
every rank plans alike); the what-if and the report read it from the record.

Run ``python -m deepcompile.profile.host`` on a GPU host to print the micro-benchmark.
"""
from __future__ import annotations

import time

import torch

# The host's time to launch each op of a compiled step on a GPU (microseconds): what a host-bound
# step's pace follows. Measured on the 2-H200 host (torch 2.11, a runtime with one wait per
# coalesced group and reduce_grad without a clone), 953M Llama, by the profiler per op kind
# (benchmarks/results/host_profile_L16_h200_2gpu.json: 40.2 ms of compiled graphs and 10.1
# ms of optimizer step per step), scaled by 0.863 so that they add up to the host time the same
# run measured without the profiler (43.4 ms). "node": the
# generated wrapper's Python, spread over every op node (9.2 ms / 3086 nodes); "kernel": an
# Inductor kernel, charged per fused kernel (``fused_us``'s written outputs; 3.9 ms / 717);
# "per_param": a kept-gathered collective's per-parameter work. The gathers of parameters that
# are not kept were not in that run (it kept everything): allgather_params/allgather_param and
# the waits are a profile of a runtime without coalesced waits (424 us a fused gather, 31 us
# a wait) and are the least certain. gather_persistent_start / _wait (kept
# parameters gathered in need order, selective_unshard.group_mb) are not measured yet: a start
# is taken as a coalesced launch (40 us) plus the per-parameter work of gather_persistent_many,
# a wait as wait_allgather_many's.
HOST_US = {"node": 2.6, "matmul": 18.7, "attention": 81.0, "kernel": 4.7, "reduce_grad": 70.0,
           "gather_persistent": 13.4, "gather_persistent_many": 0.0, "per_param": 13.4,
           "gather_persistent_start": 40.0, "gather_persistent_wait": 31.0,
           "allgather_params": 424.0, "allgather_param": 60.0, "wait_allgather": 31.0,
           "wait_allgather_many": 31.0, "release_param": 1.0, "end_backward": 141.0,
           # reduce_grads: one call per reduce bucket (passes/zero3.group_reduces). Most of
           # reduce_grad's 70 us stays per gradient: on the CPU (1 rank, tiny tensors, no profiler) a
           # gradient costs ~0.8 us to add and ~8 us in its bucket's flush and hand-over (coalesced
           # reduce-scatter member, output slice, .grad view), the call itself ~1 us; on 2 H200s under
           # the profiler 40 calls took 12.5 ms a step where 147 reduce_grad calls took 14.4
           # (benchmarks/host_profile.py on a BENCH_TRACE of dc_default). So a call is charged 20 us and
           # each gradient it hands over ("per_grad") 50 us.
           "reduce_grads": 20.0, "per_grad": 50.0}

N = 2000
REPS = 5


def _python_round(n: int) -> float:
    # the shape of Inductor's generated wrapper: read buffers, unpack, call, drop references
    def call(a, b):
        return a, b

    t0 = time.perf_counter()
    bufs = (1, 2, 3)
    for _ in range(n):
        x, y, z = bufs
        u, v = call(x, y)
        del u
        w = (v, z)
        del w
    return (time.perf_counter() - t0) * 1e6 / n


def _dispatch_round(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, n: int) -> float:
    add = torch.add
    t0 = time.perf_counter()
    for _ in range(n):
        add(a, b, out=out)
    return (time.perf_counter() - t0) * 1e6 / n


def host_benchmark(device: torch.device | str | None = None, n: int = N, reps: int = REPS) -> dict:
    """``{"dispatch_us", "python_us", "n", "reps", "device"}``: this host's time per tiny device op
    and per wrapper-like Python iteration (medians over ``reps`` rounds of ``n``)."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    a = torch.ones(1, device=device)
    b = torch.ones(1, device=device)
    out = torch.empty(1, device=device)
    cuda = device.type == "cuda"
    _dispatch_round(a, b, out, 50)   # warm: the first launches load the kernel
    if cuda:
        torch.cuda.synchronize(device)
    disp, py = [], []
    for _ in range(reps):
        disp.append(_dispatch_round(a, b, out, n))
        if cuda:
            torch.cuda.synchronize(device)   # between rounds only: a round times launches alone
        py.append(_python_round(n))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"dispatch_us": round(med(disp), 4), "python_us": round(med(py), 4), "n": int(n), "reps": int(reps),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu"}


if __name__ == "__main__":
    import json

    print(json.dumps(host_benchmark()))


def resident_bytes() -> int:
    """This process's resident set (Linux ``/proc/self/statm``; 0 where it cannot be read): the
    host memory a CPU (gloo) rank's training state occupies."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
