"""Host<->device copy bandwidth with pinned memory, per rank, with every local rank copying at once
(as offload does): device-to-host alone, host-to-device alone, and both directions together.

    torchrun --nproc-per-node=2 benchmarks/copy_bandwidth.py --mib 512 --out benchmarks/results/copy_bw_h200_2gpu.json

The offload passes' timing parameters (``offload_activations.h2d_gbps``) and the offload benchmark's
analysis read these figures; a GPU run only.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def timed(fn, reps: int) -> float:
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    n = a.mib * 2 ** 20
    host_a = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(n, dtype=torch.uint8, device=dev)
    dev_b = torch.empty(n, dtype=torch.uint8, device=dev)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def d2h():
        host_a.copy_(dev_a, non_blocking=True)

    def h2d():
        dev_b.copy_(host_b, non_blocking=True)

    def both():
        with torch.cuda.stream(s1):
            d2h()
        with torch.cuda.stream(s2):
            h2d()
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)

    for f in (d2h, h2d, both):
        timed(f, 2)
    res = {"d2h_gbps": n / timed(d2h, a.reps) / 1e9, "h2d_gbps": n / timed(h2d, a.reps) / 1e9}
    t = timed(both, a.reps)
    res["both_each_gbps"] = n / t / 1e9
    allres = [None] * world
    dist.all_gather_object(allres, res)
    if rank == 0:
        out = {"device": torch.cuda.get_device_name(dev), "ranks": world, "mib": a.mib, "reps": a.reps,
               "torch": torch.__version__, "per_rank": allres}
        print(f"{'rank':>4} {'d2h GB/s':>9} {'h2d GB/s':>9} {'both, each GB/s':>16}")
        for r, x in enumerate(allres):
            print(f"{r:>4} {x['d2h_gbps']:>9.1f} {x['h2d_gbps']:>9.1f} {x['both_each_gbps']:>16.1f}")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
