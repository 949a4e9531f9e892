#!/usr/bin/env python
"""Compile time of the default plan on the CPU, per depth: where the host's time goes
before the first fast step, phase by phase, and how it grows with the number of layers.

    python benchmarks/compile_cpu.py [--layers 16 32] [--ranks 1 2] [--repeats 2] [--profile]
        [--out benchmarks/results/compile_cpu.json]

A Llama (transformers.LlamaForCausalLM, random init) with a small hidden size: trace time follows
the number of graph nodes, not the tensors' sizes, so hidden 64 shows the same Dynamo, AOTAutograd,
pass, profiling and planner work per layer as the 2048-wide GPU model at a fraction of the run time.
Each measurement is a fresh set of gloo processes (tests/dist_utils.run_ranks) running deepcompile's
default ZeRO-3 plan with ``compiler="inductor"``: step 0 traces through Inductor's front end
(``pipeline.inductor_compile``: decompositions, joint-graph passes, min-cut partition) and runs the
graphs as Python, step 1 is profiled in place, step 2 plans and re-compiles the warm-up's graphs
(trace once), step 3 is the first fast step.

Inductor's back end (codegen, C++/Triton compile) is replaced by the graph's own Python code
(``pipeline.inductor_inner`` patched in the child processes only): on the GPU it is a separate phase,
mostly kernel compiles that a warm cache removes, and a CPU C++ compile of every kernel would bury
the phases this measures. ``--real-inductor`` keeps it.

``--profile``: rank 0 runs under cProfile; the top functions (own and cumulative time) of each run go
into the JSON and a ``.prof`` file per run beside it (``python -m pstats``).

``--warm``: each measurement is followed by a second fresh set of processes for the same job, sharing
the first one's plan cache (config ``plan_cache``, :mod:`deepcompile.plan.cache`): a re-run, which
compiles the stored plan at step 0 (no warm-up, no profiling step, no planner). Every measurement
gets its own empty cache directory, so a cold run is always cold. ``--no-plan-cache`` turns the
cache off (``plan_cache: false``): the warm run then does what a re-run did before the cache.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

PHASES = ("dynamo", "causal_mask", "aot_autograd", "flatten", "passes", "inductor", "profiling", "planner", "reuse")
STEPS = 4


def model_config(layers: int, hidden: int) -> dict:
    return dict(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                num_key_value_heads=4, num_hidden_layers=layers, max_position_embeddings=128,
                tie_word_embeddings=False, use_cache=False)


def _rank(rank: int, world: int, layers: int, hidden: int, seq: int, real_inductor: bool, prof_path,
          clock: str = "wall", plan_cache=False, threads: int = 0):
    import cProfile

    if clock == "cpu":
        # every phase in this process's CPU seconds: deepcompile times its phases with
        # time.perf_counter and Dynamo with time.time_ns (both looked up at each call), so on a
        # shared CPU the phases count this process's work, not the other processes' turns
        time.perf_counter, time.time_ns = time.process_time, time.process_time_ns

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if threads:
        # N ranks x torch's default intra-op threads on a small shared CPU: OpenMP's spin-waits made
        # single optimizer steps take 2+ s at random (AdamW's per-tensor sqrt: 1.2-2.3 s of 4 steps)
        torch.set_num_threads(threads)

    import deepcompile
    from deepcompile.compat import aot as aot_compat
    from deepcompile.compile import pipeline

    if not real_inductor:
        def python_inner(gm, example_inputs, **kw):  # the graph as Python: Inductor's back end left out
            return aot_compat.boxed(gm.forward)
        pipeline.inductor_inner = python_inner
    torch.manual_seed(0)
    cfg = LlamaConfig(**model_config(layers, hidden))
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).float().train()
    t0 = time.perf_counter()
    # BENCH_DC_CONFIG: JSON merged into the config (an A/B of one setting, as benchmarks/zero3.py)
    extra = json.loads(os.environ.get("BENCH_DC_CONFIG") or "{}")
    model, opt = deepcompile.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                                        {"compiler": "inductor", "plan_cache": plan_cache, **extra})
    init_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (2, seq), generator=g)
    prof = cProfile.Profile() if (prof_path and rank == 0) else None
    import gc

    gc_s, gc_t0 = {0: 0.0, 1: 0.0, 2: 0.0}, [0.0]

    def gc_timer(phase, info):  # seconds in Python's cyclic GC, by generation (it grows with the heap)
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_s[info["generation"]] += time.perf_counter() - gc_t0[0]
    gc.callbacks.append(gc_timer)
    step_s, losses, nodes = [], [], None
    if prof is not None:
        prof.enable()
    t_first, c_first = time.perf_counter(), time.process_time()
    for s in range(STEPS):
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - t0)
        losses.append(float(loss.item()))
    until_fast, until_fast_cpu = time.perf_counter() - t_first, time.process_time() - c_first
    gc.callbacks.remove(gc_timer)
    if prof is not None:
        prof.disable()
        prof.dump_stats(prof_path)
    nodes = {f"{v.graph_id} {v.kind}": len(v.nodes) for v in model.dc_graphs
             if v.step == 0 and v.after == "input"}
    phases = {p: round(sum(d.get(p, 0.0) for d in model.dc_compile_phases.values()), 3) for p in PHASES}
    return {"init_s": round(init_s, 3), "step_s": [round(t, 3) for t in step_s], "until_fast_step_s": round(until_fast, 3),
            "until_fast_step_cpu_s": round(until_fast_cpu, 3),
            "phases_s": phases, "phases_by_step": model.dc_compile_phases, "trace_once": model.dc_trace_once,
            "losses": losses, "nodes_at_step0": nodes, "plan_cache": (model.dc_plan or {}).get("cache"),
            "planned_params": ((model.dc_plan or {}).get("chosen") or {}).get("params"), "gc_s_by_generation": {str(k): round(v, 3) for k, v in gc_s.items()}}


def top_functions(path: str, n: int = 25) -> dict:
    import pstats

    st = pstats.Stats(path)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"fn": f"{os.path.relpath(file, os.path.dirname(os.__file__)) if file.startswith(os.path.dirname(os.__file__)) else file}:{line}({fn})",
                     "calls": nc, "own_s": round(tt, 3), "cum_s": round(ct, 3)})
    return {"by_own": sorted(rows, key=lambda r: -r["own_s"])[:n], "by_cum": sorted(rows, key=lambda r: -r["cum_s"])[:n]}


def summary(path: str) -> str:
    """Median phase seconds (rank 0) per (tag, layers, ranks) over every run recorded in ``path``."""
    with open(path) as f:
        runs = json.load(f)["runs"]
    cells: dict = {}
    for run in runs:
        for e in run["results"]:
            tag = (run.get("tag", "") + ("/cpu" if run.get("clock") == "cpu" else "")
                   + (f"/t{run['threads']}" if run.get("threads") else ""))
            cells.setdefault((tag, e["layers"], e["ranks"]), []).extend(e["runs"])
            if e.get("warm_runs"):
                cells.setdefault((tag + "/warm", e["layers"], e["ranks"]), []).extend(e["warm_runs"])
    lines = [f"{'tag':>11} {'layers':>6} {'ranks':>5} {'n':>2} {'cpu s':>7} {'wall s':>7}  " + " ".join(f"{p:>12}" for p in PHASES)]
    for (tag, layers, world), reps in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        med = {p: statistics.median(r["phases_s"].get(p, 0.0) for r in reps) for p in PHASES}
        cpu = statistics.median(r.get("until_fast_step_cpu_s", float("nan")) for r in reps)
        wall = statistics.median(r["until_fast_step_s"] for r in reps)
        lines.append(f"{tag:>11} {layers:6d} {world:5d} {len(reps):2d} {cpu:7.2f} {wall:7.2f}  "
                     + " ".join(f"{med[p]:12.2f}" for p in PHASES))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[16, 32])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="fresh processes per (layers, ranks); medians reported")
    p.add_argument("--profile", action="store_true", help="rank 0 under cProfile (slows the run ~1.5-2x)")
    p.add_argument("--real-inductor", action="store_true", help="keep Inductor's back end (CPU C++ compile)")
    p.add_argument("--warm", action="store_true",
                   help="after each measurement, a re-run of the same job with its plan cache (fresh processes)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads in each rank (0: torch's default); 1 keeps OpenMP's spin-waits "
                        "between ranks out of the step times on a small shared CPU")
    p.add_argument("--no-plan-cache", action="store_true", help="config plan_cache false (the warm run re-plans)")
    p.add_argument("--tag", default="", help="label of this run in the JSON (e.g. before/after)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "compile_cpu.json"))
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="phase seconds as wall time, or as each rank's process CPU time (a shared, loaded "
                        "machine: the other processes' turns left out; the profiling step's node times too)")
    p.add_argument("--summary", action="store_true",
                   help="no run: medians per tag, layers and ranks over every run in --out (before/after tables)")
    args = p.parse_args(argv)
    if args.summary:
        print(summary(args.out))
        return

    import torch

    from tests.dist_utils import run_ranks

    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = None
    run = {"command": " ".join(["python", "benchmarks/compile_cpu.py", *(argv if argv is not None else sys.argv[1:])]),
           "tag": args.tag, "commit": commit, "torch": torch.__version__, "cpus": os.cpu_count(),
           "load_avg_before": os.getloadavg()[0], "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "hidden": args.hidden, "seq": args.seq, "real_inductor": args.real_inductor, "clock": args.clock,
           "threads": args.threads, "results": []}
    print(f"{'layers':>6} {'ranks':>5} {'rep':>3} {'until fast s':>12}  phases (s, rank 0)", flush=True)
    for layers in args.layers:
        for world in args.ranks:
            reps, warm_reps = [], []
            for r in range(args.repeats):
                prof_path = None
                if args.profile:
                    prof_path = os.path.splitext(args.out)[0] + f"_L{layers}_w{world}_r{r}{('_' + args.tag) if args.tag else ''}.prof"
                # an empty plan cache per measurement: the first run is cold, the warm re-run finds its plan
                with tempfile.TemporaryDirectory(prefix="dc_plans_") as plans:
                    cache = False if args.no_plan_cache else plans
                    for warm in ((False, True) if args.warm else (False,)):
                        pp = prof_path and (prof_path[:-5] + "_warm.prof" if warm else prof_path)
                        res = run_ranks(_rank, world, layers, args.hidden, args.seq, args.real_inductor,
                                        pp, args.clock, cache, args.threads, timeout=args.timeout)
                        r0 = res[0]
                        if pp:
                            r0["profile_top"] = top_functions(pp)
                            r0["profile_file"] = os.path.relpath(pp, REPO)
                        (warm_reps if warm else reps).append(r0)
                        ph = " ".join(f"{k} {v:.2f}" for k, v in r0["phases_s"].items() if v)
                        ph += f" | gc {sum(r0['gc_s_by_generation'].values()):.2f} | cpu {r0['until_fast_step_cpu_s']:.2f}"
                        hit = " | plan cache hit" if (r0.get("plan_cache") or {}).get("hit") else ""
                        print(f"{layers:6d} {world:5d} {r:3d}{'w' if warm else ' '}{r0['until_fast_step_s']:11.2f}  {ph}{hit}",
                              flush=True)
            entry = {"layers": layers, "ranks": world}
            for name, rs in (("", reps), ("warm_", warm_reps)):
                if not rs:
                    continue
                med = {k: round(statistics.median(x["phases_s"][k] for x in rs), 3) for k in PHASES}
                entry.update({f"{name}median_phases_s": med,
                              f"{name}median_until_fast_step_s": round(statistics.median(x["until_fast_step_s"] for x in rs), 3),
                              f"{name}runs": rs})
                ph = " ".join(f"{k} {v:.2f}" for k, v in med.items() if v)
                print(f"{layers:6d} {world:5d} {'med' if not name else 'mdw'} {entry[f'{name}median_until_fast_step_s']:11.2f}  {ph}",
                      flush=True)
            run["results"].append(entry)
    old = []
    if os.path.exists(args.out):
        try:
            with open(args.out) as f:
                old = json.load(f).get("runs", [])
        except (OSError, ValueError):
            old = []
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "compile_cpu", "runs": old + [run]}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
