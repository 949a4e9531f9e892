"""The host's speed, measured at the profiling step: what calibrates the host model to the machine.

A compiled step on a GPU is host-bound when the host needs longer to launch its ops than the
GPU to run them (the 953M Llama's default plan on 2 H200s: 70% of the step). The cost model
charges each op the host time ``plan.estimate.HOST_US`` gives its kind, measured on one host.
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
