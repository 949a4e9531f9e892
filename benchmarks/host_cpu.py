"""Host time per training step on the CPU (issue 16): what the step costs that does not scale with
the model. A small GPT on N gloo ranks, so compute is short and the fixed per-step work (the
runtime ops' calls, the generated wrapper, Python hooks, the sequence check) shows.

    python benchmarks/host_cpu.py --world 2 --layers 8 --compiler aot_eager --steps 40
    python benchmarks/host_cpu.py ... --per-gradient      # the control: one reduce call per gradient
    python benchmarks/host_cpu.py ... --cprofile 25       # rank 0's top deepcompile functions

Prints rank 0's medians (ms) of forward, backward, optimizer step (its pre-hook's sequence check
separately) and the whole step, wall time and the main thread's CPU time (``cpu_*``: the host
work itself, much less sensitive to other load on a shared machine than the wall time), and the
runtime's reduce counters of the last step. Torch runs on one intra-op thread.
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
        ops.REDUCE_LAYOUT = dataclasses.replace(ops.REDUCE_LAYOUT, copies_each=True)
    seq = {"s": 0.0, "cpu": 0.0}
    if model.dc_seqcheck is not None:
        inner = model.dc_seqcheck.check

        def timed_check():
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return inner()
            finally:
                seq["s"] += time.perf_counter() - t0
                seq["cpu"] += time.thread_time() - c0
        model.dc_seqcheck.check = timed_check
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--compiler", default="aot_eager")
    ap.add_argument("--passes", default=None, help="comma-separated pass list (default: the config's)")
    ap.add_argument("--bucket", type=int, default=25_000_000, help="reduce_bucket_size (elements)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--per-gradient", action="store_true", help="one reduce call per gradient (the control)")
    ap.add_argument("--cprofile", type=int, default=0, help="print rank 0's top N functions by own time")
    ap.add_argument("--json", default=None)
    a = vars(ap.parse_args())
    a["passes"] = a["passes"].split(",") if a["passes"] else None
    from tests.dist_utils import run_ranks

    res = run_ranks(_rank, a["world"], a, timeout=1800)
    r0 = res[0]
    prof = r0.pop("cprofile", None)
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r0.items()}))
    if prof:
        print(prof)
    if a["json"]:
        with open(a["json"], "w") as f:
            json.dump({"args": a, "rank0": r0}, f, indent=1)


if __name__ == "__main__":
    main()
