"""Diagnostic: are the forward's saved activations alive during the backward? (GPU or CPU)

A probe op wraps the first decoder layer's input; its backward (near the end of the backward
graph) reports the saved tensors (``saved_tensors_hooks``) still alive, their bytes, and the
allocator's current and peak bytes at that moment. Default plan, the benchmark's Llama.

    torchrun --nproc-per-node=2 benchmarks/diag_saved_live.py --layers 16
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import weakref

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zero3  # noqa: E402

REFS: list = []
SEEN: list = []


@torch.library.custom_op("dcdiag::probe", mutates_args=())
def probe(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@probe.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("dcdiag::count", mutates_args=())
def count(g: torch.Tensor) -> torch.Tensor:
    gc.collect()
    st = {}
    for r in REFS:
        t = r()
        if t is None or isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            continue
        st[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    cur = torch.cuda.memory_allocated() if g.is_cuda else 0
    peak = torch.cuda.max_memory_allocated() if g.is_cuda else 0
    SEEN.append((len(st), sum(st.values()), cur, peak))
    return g.clone()


@count.register_fake
def _(g):
    return torch.empty_like(g)


probe.register_autograd(lambda ctx, g: count(g))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    args = zero3.parse_args(["--layers", str(a.layers), "--systems", "dc_default"])
    rank, world, dev = zero3.init_dist(args)
    base, _, _ = zero3.build_base_model(args)
    def pre(mod, a, k):  # a hook, not a patched forward: build_dc deep-copies the model
        if a:
            return (probe(a[0]), *a[1:]), k
        return a, {**k, "hidden_states": probe(k["hidden_states"])}
    base.model.layers[0].register_forward_pre_hook(pre, with_kwargs=True)
    model, opt, _, _ = zero3.build_dc("dc_default", base, args, dev)
    x = torch.randint(0, 32000, (args.micro_batch, args.seq), device=dev)
    G = 2 ** 30
    for s in range(a.steps):
        REFS.clear()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: REFS.append(weakref.ref(t)) or t, lambda t: t):
            out = model(input_ids=x, labels=x)
        st = {}
        for r in REFS:
            t = r()
            if t is None or isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
                continue
            st[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        out.loss.backward()
        n, b, cur, peak = SEEN[-1]
        if rank == 0:
            print(f"step {s}: saved {len(st)} storages {sum(st.values()) / G:.3f} GiB after forward; at the first "
                  f"layer's backward {n} alive, {b / G:.3f} GiB; allocated there {cur / G:.2f}, step peak so far "
                  f"{peak / G:.2f} GiB", flush=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
