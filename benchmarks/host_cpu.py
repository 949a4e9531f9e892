"""Host time per training step on the CPU: what the step costs that does not scale with
the model. A small GPT on N gloo ranks, so compute is short and the fixed per-step work (the
runtime ops' calls, the generated wrapper, Python hooks, the sequence check) shows.

    python benchmarks/host_cpu.py --world 2 --layers 8 --compiler aot_eager --steps 40
    python benchmarks/host_cpu.py ... --per-gradient      # the control: one reduce call per gradient
    python benchmarks/host_cpu.py ... --cprofile 25       # rank 0's top deepcompile functions
    python benchmarks/host_cpu.py --ops --layers 16 --embd 256   # the runtime ops alone (below)

Prints rank 0's medians (ms) of forward, backward, optimizer step (its pre-hook's sequence check
separately) and the whole step, wall time and the main thread's CPU time (``cpu_*``: the host
work itself, much less sensitive to other load on a shared machine than the wall time), and the
runtime's reduce counters of the last step. Torch runs on one intra-op thread.

``--ops``: the runtime's ops called directly, no model compute, in the GPU run's shape (bf16
gathers and reduces of fp32 shards, the shards' .grad set to None before each backward as
``zero_grad(set_to_none=True)`` does): per step, the backward's ``reduce_grads`` calls (one per
bucket, cut where the runtime flushes, as passes/zero3.group_reduces cuts them) and
``end_backward``, and the forward's kept-parameter gathers (``gather_persistent_start`` /
``_wait`` in groups of ``--group`` parameters) and the optimizer pre-hook's
``invalidate_persistent``. Prints rank 0's main-thread CPU per step and per gradient (medians of
``--repeat`` blocks of ``--reps`` steps), and, from one step under the torch profiler, the ATen
ops each runtime op issues per gradient/parameter, the collective library's own (``c10d::`` and
below) counted apart.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _rank(rank: int, world: int, a: dict):
    import cProfile
    import dataclasses
    import io
    import pstats

    import torch

    import deepcompile
    from deepcompile.models import GPT, GPTConfig
    from deepcompile.runtime import ops

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=a["layers"], n_head=4, n_embd=a["embd"]))
    cfg = {"compiler": a["compiler"], "reduce_bucket_size": a["bucket"]}
    if a["passes"]:
        cfg["passes"] = a["passes"]
    model, opt = deepcompile.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), cfg)
    if a["per_gradient"]:
        rt = model.dc_state.runtime
        rt.reduce_layout = dataclasses.replace(rt.reduce_layout, copies_each=True)
    seq = {"s": 0.0, "cpu": 0.0}
    if model.dc_state.seqcheck is not None:
        inner = model.dc_state.seqcheck.check

        def timed_check():
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return inner()
            finally:
                seq["s"] += time.perf_counter() - t0
                seq["cpu"] += time.thread_time() - c0
        model.dc_state.seqcheck.check = timed_check
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (a["batch"], a["seq"]), generator=g)
    y = (x * 7 + 3) % 256
    rows = []
    prof = cProfile.Profile() if a["cprofile"] and rank == 0 else None
    for s in range(a["warmup"] + a["steps"]):
        timed = s >= a["warmup"]
        if timed and prof is not None and s == a["warmup"]:
            prof.enable()
        ops.C.reset_stats()
        seq["s"] = seq["cpu"] = 0.0
        c0, t0 = time.thread_time(), time.perf_counter()
        loss = model(x, y)
        c1, t1 = time.thread_time(), time.perf_counter()
        loss.backward()
        c2, t2 = time.thread_time(), time.perf_counter()
        opt.step()
        opt.zero_grad()
        c3, t3 = time.thread_time(), time.perf_counter()
        if timed:
            rows.append({"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "seqcheck": seq["s"],
                         "step": t3 - t0, "cpu_forward": c1 - c0, "cpu_backward": c2 - c1,
                         "cpu_optimizer": c3 - c2, "cpu_seqcheck": seq["cpu"], "cpu_step": c3 - c0})
    if prof is not None:
        prof.disable()
    out = {k: 1e3 * statistics.median(r[k] for r in rows) for k in rows[0]}
    st = dict(ops.C.stats())
    out["stats"] = {k: st.get(k) for k in ("reduce_calls", "reduce_ops", "reduce_ops_flushing", "reduce_scatters")}
    if prof is not None:
        buf = io.StringIO()
        ps = pstats.Stats(prof, stream=buf).sort_stats("tottime")
        ps.print_stats(a["cprofile"])
        out["cprofile"] = buf.getvalue()
    return out


def _ops_rank(rank: int, world: int, a: dict):
    import collections

    import torch

    import deepcompile
    from deepcompile.models import GPT, GPTConfig
    from deepcompile.runtime import ops

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=a["layers"], n_head=4, n_embd=a["embd"]))
    mp = {"param_dtype": a["dtype"], "reduce_dtype": a["dtype"]}
    model, opt = deepcompile.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                        {"compiler": "aot_eager", "reduce_bucket_size": a["bucket"],
                                         "mixed_precision": mp})
    C, D = ops.C, torch.ops.dc
    lay = model.dc_state.runtime.reduce_layout
    sps = list(model.dc_state.sharded)
    metas = [sp.meta for sp in sps]
    # the backward hands gradients over in reverse order, in the compute dtype
    order = list(reversed(range(len(sps))))
    grads = [torch.randn(metas[i].shape).to(metas[i].gather_dtype) for i in order]
    ids = [metas[i].id for i in order]
    # replay Runtime::add_grad's bucket fill: one reduce_grads per flush point, one for the rest
    groups, cur, elems = [], [], 0
    for g, pid, i in zip(grads, ids, order):
        e = metas[i].chunk * world
        if cur and elems + e > lay.bucket_elems:
            groups.append(cur)
            cur, elems = [], 0
        cur.append((g, pid))
        elems += e
        if elems >= lay.bucket_elems:
            groups.append(cur)
            cur, elems = [], 0
    if cur:
        groups.append(cur)
    rgroups = [([g for g, _ in grp], [p for _, p in grp]) for grp in groups]
    shards = [sp.shard for sp in sps]
    gk = max(1, a["group"])
    ggroups = [(shards[i:i + gk], [m.id for m in metas[i:i + gk]]) for i in range(0, len(sps), gk)]

    def backward():
        for s in shards:
            s.grad = None
        for gs, ps in rgroups:
            D.reduce_grads.default(gs, ps)
        D.end_backward.default(grads[:1], 0)

    def forward():
        hs = [D.gather_persistent_start.default(ss, ps) for ss, ps in ggroups]
        out = [D.gather_persistent_wait.default(h, ps) for h, (_, ps) in zip(hs, ggroups)]
        del out

    def invalidate():
        C.invalidate_persistent()

    res = {"grads": len(grads), "reduce_calls": len(rgroups), "gather_groups": len(ggroups), "params": len(sps)}
    for name, fn, per in (("backward", backward, len(grads)), ("forward", forward, len(sps)),
                          ("invalidate", invalidate, len(sps))):
        blocks = []
        for rep in range(a["repeat"] + 1):
            t = 0.0
            for _ in range(a["reps"]):
                if name == "invalidate":
                    forward()
                c0 = time.thread_time()
                fn()
                t += time.thread_time() - c0
                if name == "forward":
                    invalidate()
            if rep:  # the first block warms up
                blocks.append(t / a["reps"] * 1e6)
        res[f"{name}_us"] = round(statistics.median(blocks), 1)
        res[f"{name}_us_per_item"] = round(statistics.median(blocks) / per, 2)
        res[f"{name}_us_blocks"] = [round(b, 1) for b in blocks]
    # ATen ops per runtime op, one step under the profiler
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward()
        invalidate()
        backward()
    # Direct children of a dc:: op are the runtime's own dispatcher calls ("top", e.g. one
    # aten::narrow; "all" adds what they call inside, e.g. its aten::slice and aten::as_strided).
    # The collective library's (c10d:: and below) are counted apart; gloo's coalesced
    # reduce-scatter splits its inputs with aten::chunk, which the profiler parents to the dc op.
    lib_names = ("aten::chunk",)
    top, every, lib, calls = collections.Counter(), collections.Counter(), collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.name.startswith("dc::"):
            calls[ev.name] += 1
            continue
        p, under_lib, depth = ev.cpu_parent, ev.name.startswith("c10d::") or ev.name in lib_names, 1
        while p is not None and not p.name.startswith("dc::"):
            under_lib = under_lib or p.name.startswith("c10d::") or p.name in lib_names
            p, depth = p.cpu_parent, depth + 1
        if p is None:
            continue
        if under_lib:
            lib[p.name] += 1
        else:
            every[p.name] += 1
            if depth == 1:
                top[(p.name, ev.name)] += 1
    by_op = {}
    for op in calls:
        o = {k[1]: v for k, v in top.items() if k[0] == op}
        by_op[op] = {"calls": calls[op], "runtime_top": sum(o.values()), "runtime_all": every[op],
                     "collective_lib_ops": lib[op], "top_by_name": dict(sorted(o.items(), key=lambda kv: -kv[1]))}
    res["profile"] = by_op
    red = [op for op in ("dc::reduce_grads", "dc::end_backward") if op in by_op]
    gat = [op for op in ("dc::gather_persistent_start", "dc::gather_persistent_wait") if op in by_op]
    for what, opsel, n in (("reduce", red, len(grads)), ("gather", gat, len(sps))):
        for k in ("runtime_top", "runtime_all", "collective_lib_ops"):
            res[f"{what}_{k}_per_item"] = round(sum(by_op[o][k] for o in opsel) / n, 2)
    res["stats"] = {k: v for k, v in dict(C.stats()).items() if v}
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--compiler", default="aot_eager")
    ap.add_argument("--passes", default=None, help="comma-separated pass list (default: the config's)")
    ap.add_argument("--bucket", type=int, default=None,
                    help="reduce_bucket_size (elements; default 25M, with --ops 200K: about 4 gradients a bucket "
                         "at 16 layers of 256, as the GPU run's 147 gradients in 40 buckets)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--per-gradient", action="store_true", help="one reduce call per gradient (the control)")
    ap.add_argument("--cprofile", type=int, default=0, help="print rank 0's top N functions by own time")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ops", action="store_true", help="the runtime ops alone (see above)")
    ap.add_argument("--dtype", default="bfloat16", help="--ops: gather and reduce dtype (mixed_precision)")
    ap.add_argument("--group", type=int, default=9, help="--ops: kept parameters per gather group")
    ap.add_argument("--reps", type=int, default=50, help="--ops: steps per timed block")
    ap.add_argument("--repeat", type=int, default=5, help="--ops: timed blocks (median)")
    a = vars(ap.parse_args())
    a["passes"] = a["passes"].split(",") if a["passes"] else None
    if a["bucket"] is None:
        a["bucket"] = 200_000 if a["ops"] else 25_000_000
    from tests.dist_utils import run_ranks

    res = run_ranks(_ops_rank if a["ops"] else _rank, a["world"], a, timeout=1800)
    r0 = res[0]
    prof = r0.pop("cprofile", None)
    by_op = r0.get("profile") or {}
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r0.items() if k != "profile"}))
    for op, v in by_op.items():
        print(op, json.dumps(v))
    if prof:
        print(prof)
    if a["json"]:
        with open(a["json"], "w") as f:
            json.dump({"args": a, "rank0": r0}, f, indent=1)


if __name__ == "__main__":
    main()
