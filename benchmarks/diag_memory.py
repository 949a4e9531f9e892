"""Diagnostics: what the default plan's step keeps alive, on the benchmark's Llama (GPU; ``saved``
also runs on CPU).

``saved``: a probe op wraps the first decoder layer's input; its backward (near the end of the
backward graph) reports the forward's saved tensors (``saved_tensors_hooks``) still alive, their
bytes, and the allocator's current and peak bytes at that moment: whether what is still held
there is saved activations or gradients.

``sites``: the allocator's bytes around forward and backward per step, then
``torch.cuda.memory._snapshot()`` right after a final-compile backward (recorded from before its
forward), live blocks grouped by allocation site.

    torchrun --nproc-per-node=2 benchmarks/diag_memory.py saved --layers 16
    torchrun --nproc-per-node=2 benchmarks/diag_memory.py sites --layers 4
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import weakref

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zero3  # noqa: E402  (the benchmark's model and process-group setup)

G = 2 ** 30
REFS: list = []
SEEN: list = []


def _saved_storages() -> dict[int, int]:
    """Storage bytes of the saved tensors still alive (parameters and their views left out)."""
    st = {}
    for r in REFS:
        t = r()
        if t is None or isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            continue
        st[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return st


@torch.library.custom_op("dcdiag::probe", mutates_args=())
def probe(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@probe.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("dcdiag::count", mutates_args=())
def count(g: torch.Tensor) -> torch.Tensor:
    gc.collect()
    st = _saved_storages()
    cur = torch.cuda.memory_allocated() if g.is_cuda else 0
    peak = torch.cuda.max_memory_allocated() if g.is_cuda else 0
    SEEN.append((len(st), sum(st.values()), cur, peak))
    return g.clone()


@count.register_fake
def _(g):
    return torch.empty_like(g)


probe.register_autograd(lambda ctx, g: count(g))


def setup(layers: int, hook_first_layer: bool):
    args = zero3.parse_args(["--layers", str(layers), "--systems", "dc_default"])
    rank, world, dev = zero3.init_dist(args)
    base, _, _ = zero3.build_base_model(args)
    if hook_first_layer:
        def pre(mod, a, k):  # a hook, not a patched forward: build_dc deep-copies the model
            if a:
                return (probe(a[0]), *a[1:]), k
            return a, {**k, "hidden_states": probe(k["hidden_states"])}
        base.model.layers[0].register_forward_pre_hook(pre, with_kwargs=True)
    model, opt, _, _ = zero3.build_dc("dc_default", base, args, dev)
    x = torch.randint(0, 32000, (args.micro_batch, args.seq), device=dev)
    return rank, dev, model, opt, x


def saved(a) -> None:
    rank, dev, model, opt, x = setup(a.layers, hook_first_layer=True)
    for s in range(a.steps):
        REFS.clear()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: REFS.append(weakref.ref(t)) or t, lambda t: t):
            out = model(input_ids=x, labels=x)
        st = _saved_storages()
        out.loss.backward()
        n, b, cur, peak = SEEN[-1]
        if rank == 0:
            print(f"step {s}: saved {len(st)} storages {sum(st.values()) / G:.3f} GiB after forward; at the first "
                  f"layer's backward {n} alive, {b / G:.3f} GiB; allocated there {cur / G:.2f}, step peak so far "
                  f"{peak / G:.2f} GiB", flush=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out


def sites(a) -> None:
    rank, dev, model, opt, x = setup(a.layers, hook_first_layer=False)
    for s in range(a.steps):
        last = s == a.steps - 1
        torch.cuda.synchronize()
        if last:  # from before the forward: what the forward allocates and the backward leaves
            torch.cuda.memory._record_memory_history(max_entries=200000)
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = model(input_ids=x, labels=x)
        torch.cuda.synchronize()
        a1, p1 = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out.loss.backward()
        torch.cuda.synchronize()
        a2, p2 = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        if rank == 0:
            print(f"step {s}: allocated before {a0 / G:.2f}, after forward {a1 / G:.2f} (peak {p1 / G:.2f}), "
                  f"after backward {a2 / G:.2f} (peak {p2 / G:.2f}) GiB", flush=True)
        if last:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not last:
            del out
    if rank == 0:
        by_site = collections.Counter()
        for seg in snap["segments"]:
            for b in seg["blocks"]:
                if b["state"] == "active_allocated":
                    py = [f for f in b.get("frames") or [] if f["filename"].endswith(".py")]
                    key = " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in py[:4])
                    by_site[key or "(no python frames)"] += b["size"]
        print(f"live after backward: {sum(by_site.values()) / G:.3f} GiB; "
              f"allocated {torch.cuda.memory_allocated() / G:.3f}")
        for k, v in by_site.most_common(a.top):
            print(f"{v / G:8.3f} GiB  {k}")
        print("output object:", type(out).__name__, {k: type(v).__name__ for k, v in out.items()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("saved", "sites"))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=14, help="sites: allocation sites to print")
    a = ap.parse_args()
    (saved if a.what == "saved" else sites)(a)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
