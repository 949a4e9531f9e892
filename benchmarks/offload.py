#!/usr/bin/env python
"""Optimizer-state offload benchmark: deepcompile ZeRO-3 + the adaptive ``offload_optimizer`` pass
against FSDP2 with ``CPUOffloadPolicy``, both under a GPU memory cap that ZeRO-3 without offload
does not fit in. One torchrun invocation, 2 GPUs:

    torchrun --nproc-per-node=2 benchmarks/offload.py \
        [--out benchmarks/results/offload_h200_2gpu.json] [--cap-gib G] [--micro-batch 2] [--seq 2048] \
        [--steps 20] [--warmup 5] [--systems ...] [--tiny] [--device cpu]

The run, in order (the helpers are benchmarks/zero3.py's; everything freed between systems):

1. ``dc_zero3_uncapped`` (skipped with ``--cap-gib``): deepcompile ZeRO-3, passes
   ["zero3", "prefetch"], no offload, no cap, a few steps. Optimizer-step hooks split its peak
   memory into the forward+backward phase (with the Adam moments resident: steps after the first)
   and the optimizer-step phase.
2. The cap: ``cap = fwd/bwd peak - --cap-state-fraction (0.6) x Adam-moment bytes per rank``,
   raised if needed to ``max(step-phase peak + 0.5 GiB, fwd/bwd peak - all moments + headroom_mb)``
   (the state must come back to the GPU for the optimizer step, which the pass cannot avoid, so a
   cap below the step's own peak cannot be met by any amount of state offload; ``cap.feasible`` is
   false, with a warning, if the raised cap no longer makes the run without offload OOM).
   Applied with ``torch.cuda.set_per_process_memory_fraction`` on every rank, for the rest of the run.
3. Under the cap: ``dc_offload`` (passes ["zero3", "prefetch", offload_optimizer(limit_mb=cap,
   headroom_mb)], ``profile_step`` 2: steps 0-1 offload all state, step 2 is profiled, step 3
   recompiles with the profile and offloads only what exceeds the limit; the warm-up covers all of
   it), ``fsdp2_cpu_offload`` (fully_shard per decoder layer + root, bf16 MixedPrecisionPolicy,
   CPUOffloadPolicy(): parameters, gradients and AdamW on the CPU, torch's default AdamW),
   ``fsdp2_cpu_offload_fused`` (the same with AdamW(fused=True), the faster CPU optimizer), and
   last ``dc_zero3_no_offload`` (step 1's system under the cap: expected to run out of memory; it
   goes last because an out-of-memory error on only one rank would leave the other waiting in a
   collective until --pg-timeout, and everything before it is already in the JSON).

Per system: median step, tokens/s, peak allocated and reserved memory (max over ranks, and per
phase), deepcompile's offload counters, error / ``oom``. ``comparison``: dc_offload's throughput
over the best FSDP2 peer, and whether the target (>= 2x, no OOM) is met. A PNG beside the JSON,
a table printed last. On CPU (``--device cpu``, gloo) there is no memory to cap: the cap is computed
from nothing and not applied, the offload pass moves the state between host buffers (it says so),
and nothing runs out of memory; the smoke mode only checks that every path runs.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zero3 as z3  # noqa: E402  (the shared benchmark helpers)

z3.TAG = "offload"
ALL_SYSTEMS = ["dc_zero3_uncapped", "dc_offload", "fsdp2_cpu_offload", "fsdp2_cpu_offload_fused",
               "dc_zero3_no_offload"]
PEERS = ["fsdp2_cpu_offload", "fsdp2_cpu_offload_fused"]
BASE_PASSES = ["zero3", "prefetch"]
GIB = z3.GIB
MIB = 2 ** 20
CAP_SLACK = 0.5 * GIB  # above the step-phase peak: the allocator's fragmentation (reserved - allocated)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    z3.add_common_args(p, "offload", ALL_SYSTEMS, steps=20, warmup=5, pg_timeout=600.0, step_sync="stream",
                       warmup_help="untimed steps first; dc_offload gets at least profile_step + 2 (compile, "
                                   "profiling step, recompile with the profile)",
                       systems_help=" (dc_zero3_uncapped always runs first, dc_zero3_no_offload is best left last)")
    p.add_argument("--measure-steps", type=int, default=4,
                   help="steps of the uncapped measurement run (the first one has no optimizer state yet)")
    p.add_argument("--cap-gib", type=float, default=None,
                   help="GPU memory cap per rank, GiB (default: measured by dc_zero3_uncapped)")
    p.add_argument("--cap-state-fraction", type=float, default=0.6,
                   help="cap = uncapped fwd/bwd peak - this fraction of the Adam-moment bytes per rank")
    p.add_argument("--headroom-mb", type=float, default=1024.0, help="offload_optimizer's headroom_mb")
    p.add_argument("--profile-step", type=int, default=2, help="dc_offload's profile_step")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per GPU per step")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048, --tiny 128)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch CPU threads per rank (the FSDP2 peers run AdamW on the CPU; torchrun sets "
                        "OMP_NUM_THREADS=1). Default on cuda: the CPUs this process may use / local ranks")
    args = p.parse_args(argv)
    z3.common_defaults(p, args, ALL_SYSTEMS)
    if "dc_zero3_uncapped" in args.systems:  # the cap comes from it: always first
        args.systems.remove("dc_zero3_uncapped")
        if args.cap_gib is None:
            args.systems.insert(0, "dc_zero3_uncapped")
    if args.device == "cuda" and args.cap_gib is None and "dc_zero3_uncapped" not in args.systems:
        p.error("without dc_zero3_uncapped in --systems the cap must be given: --cap-gib")
    if args.seq is None:
        args.seq = 128 if args.tiny else 2048
    if args.steps < 1 or args.warmup < 0 or args.measure_steps < 2:
        p.error("--steps must be >= 1, --warmup >= 0, --measure-steps >= 2")
    return args


# ----------------------------------------------------------------------------------------------
# phase peaks: optimizer hooks split max_memory_allocated into forward+backward and step
# ----------------------------------------------------------------------------------------------

class PhasePeaks:
    """Peak allocated / reserved memory per phase of every step, from optimizer pre/post hooks.

    ``fwd_bwd[i]``: the peak from the end of step i-1's optimizer step to the start of step i's
    (zero_grad, forward, backward, and any hook registered before this one: deepcompile's
    offload manager waits for the state to come back there); ``step[i]``: the optimizer step.
    The hooks reset the peak counters, so the overall peak is kept here too.
    """

    def __init__(self, opt, device: str):
        self.fwd_bwd, self.step, self.overall_alloc, self.overall_reserved = [], [], 0, 0
        self.on = device == "cuda"
        if self.on:
            opt.register_step_pre_hook(lambda *_: self._mark(self.fwd_bwd))
            opt.register_step_post_hook(lambda *_: self._mark(self.step))

    def _mark(self, into: list) -> None:
        a, r = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        into.append(a)
        self.overall_alloc, self.overall_reserved = max(self.overall_alloc, a), max(self.overall_reserved, r)
        torch.cuda.reset_peak_memory_stats()

    def finish(self, res: dict) -> None:
        if not self.on:
            return
        a, r = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        res["peak_alloc_gib"] = max(self.overall_alloc, a) / GIB
        res["peak_reserved_gib"] = max(self.overall_reserved, r) / GIB
        res["phase_fwd_bwd_gib"] = [v / GIB for v in self.fwd_bwd]
        res["phase_step_gib"] = [v / GIB for v in self.step]


# ----------------------------------------------------------------------------------------------
# the systems: each returns (model, optimizer, autocast context factory, notes)
# ----------------------------------------------------------------------------------------------

def build_dc_system(name, base_model, args, dev):
    passes = list(BASE_PASSES)
    extra = {"zero_stage": 3, "passes": passes}
    if name == "dc_offload":
        limit = round(args.cap_bytes / MIB) if (args.cap_bytes and args.device == "cuda") else 0
        passes.append({"name": "offload_optimizer",
                       "params": {"limit_mb": limit, "headroom_mb": args.headroom_mb}})
        extra["profile_step"] = args.profile_step
    model, opt, ac, notes = z3.build_dc(name, base_model, args, dev, extra=extra)
    if name == "dc_offload":
        notes["what"] += (f"; offload_optimizer: Adam moments to pinned host memory after every step, "
                          f"reloaded during backward; no profile -> all of them; after the profiling step "
                          f"({args.profile_step}) only what exceeds limit_mb - headroom_mb")
    opt._bench_peaks = PhasePeaks(opt, args.device)
    return model, opt, ac, notes


def build_fsdp2_offload(name, base_model, args, dev):
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import CPUOffloadPolicy
    pin = args.device == "cuda"  # pinned memory needs an accelerator
    fused = name.endswith("_fused")
    model, opt, ac, notes = z3.build_fsdp2(name, base_model, args, dev,
                                           offload_policy=CPUOffloadPolicy(pin_memory=pin),
                                           opt_kwargs={"fused": True} if fused else None)
    notes["what"] += (f"; offload_policy=CPUOffloadPolicy(pin_memory={pin}) on every fully_shard: fp32 "
                      "sharded parameters, gradients and the optimizer state live on the CPU, the "
                      "optimizer step runs on the CPU")
    notes["optimizer"] = (f"torch.optim.AdamW(lr={args.lr}{', fused=True' if fused else ''}) over fp32 "
                          f"DTensor shards on the CPU ({torch.get_num_threads()} CPU threads per rank)")
    opt._bench_peaks = PhasePeaks(opt, args.device)
    return model, opt, ac, notes


def build(name, base_model, args, dev):
    if name.startswith("dc_"):
        return build_dc_system(name, base_model, args, dev)
    return build_fsdp2_offload(name, base_model, args, dev)


def after_train(model, opt, res) -> None:
    peaks = getattr(opt, "_bench_peaks", None)
    if peaks is not None:
        peaks.finish(res)
    if not hasattr(model, "dc_graphs"):
        return
    try:
        from deepcompile.runtime import ops
        res["dc_stats"] = {k: int(v) for k, v in dict(ops.C.stats()).items()}
    except Exception as e:  # noqa: BLE001
        res["dc_stats"] = {"unavailable": f"{type(e).__name__}: {e}"}
    try:
        rt = model.dc_state.runtime
        m = rt.optimizer_state
        res["offload"] = {"state_total_bytes": int(m.total_bytes()), "offloaded_bytes": int(m.offloaded_bytes()),
                          "plan_target_bytes": m.target, "manager_stats": dict(m.stats),
                          "engine_stats": dict(rt.offload.stats)}
    except Exception as e:  # noqa: BLE001
        res["offload"] = {"unavailable": f"{type(e).__name__}: {e}"}
    try:  # the pass's own account of its plan, per compile (the last few)
        notes = [{"step": v.step, "graph": v.graph_id, "kind": v.kind, "notes": list(v.notes)}
                 for v in model.dc_graphs if v.after == "offload_optimizer"]
        if notes:
            res["offload_pass_notes"] = notes[-6:]
    except Exception:  # noqa: BLE001
        pass


def skip_reason(name):
    if name.startswith("dc_"):
        try:
            from deepcompile.passes import PASSES
        except Exception as e:  # noqa: BLE001
            return None, f"deepcompile.passes failed to import: {type(e).__name__}: {e}"
        need = BASE_PASSES + (["offload_optimizer"] if name == "dc_offload" else [])
        for p in need:
            if p not in PASSES:
                return f"pass {p} not implemented", None
    return None, None


# ----------------------------------------------------------------------------------------------
# the cap
# ----------------------------------------------------------------------------------------------

def state_bytes_per_rank(model, world: int) -> int:
    """AdamW's two fp32 moments over this rank's padded shard of every trainable parameter."""
    return 8 * sum(-(-p.numel() // world) for p in model.parameters() if p.requires_grad)


def choose_cap(entry: dict, per_rank: list, state_bytes: int, args) -> dict:
    """From the uncapped run's phase peaks (rank 0, after gathering)."""
    ran = [r for r in per_rank if r and "phase_fwd_bwd_gib" in r]
    info = {"source": "dc_zero3_uncapped", "state_bytes_per_rank": state_bytes,
            "state_fraction": args.cap_state_fraction}
    if args.device != "cuda":
        info.update(cap_bytes=None, why_not_applied="CPU run: no device memory to measure or cap")
        return info
    if not ran or "error" in entry:
        info["error"] = "the uncapped measurement did not finish: " + str(entry.get("error", "no phase peaks"))
        return info
    fb = max(max(r["phase_fwd_bwd_gib"][1:] or r["phase_fwd_bwd_gib"]) for r in ran) * GIB
    st = max(max(r["phase_step_gib"]) for r in ran) * GIB
    rule = fb - args.cap_state_fraction * state_bytes
    headroom = args.headroom_mb * MIB
    floor = max(st + CAP_SLACK, fb - state_bytes + headroom)
    cap = max(rule, floor)
    info.update({
        "fwd_bwd_peak_with_state_bytes": int(fb), "step_peak_bytes": int(st),
        "rule_cap_bytes": int(rule), "floor_bytes": int(floor), "cap_bytes": int(cap),
        "rule": f"fwd/bwd peak with the state resident ({fb / GIB:.2f} GiB) - {args.cap_state_fraction} x "
                f"Adam-moment bytes per rank ({state_bytes / GIB:.2f} GiB) = {rule / GIB:.2f} GiB; floor "
                f"max(step-phase peak {st / GIB:.2f} + {CAP_SLACK / GIB:.1f}, fwd/bwd peak without any state "
                f"{(fb - state_bytes) / GIB:.2f} + headroom {headroom / GIB:.2f}) = {floor / GIB:.2f} GiB",
        "raised_to_floor": rule < floor,
        "feasible": cap < fb,
    })
    if not info["feasible"]:
        info["warning"] = ("no cap both fits the offloaded run and makes the non-offloaded run OOM: the "
                           "optimizer step's own peak (state, gradients and AdamW's temporaries on the GPU) "
                           "is too close to the fwd/bwd peak; use a larger --micro-batch or --seq")
    return info


def apply_cap(cap_bytes: int, dev) -> dict:
    total = torch.cuda.get_device_properties(dev).total_memory
    frac = min(1.0, cap_bytes / total)
    torch.cuda.set_per_process_memory_fraction(frac, dev)
    return {"fraction": frac, "device_total_bytes": total}


# ----------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------

def is_oom(err: str | None) -> bool:
    return bool(err) and ("OutOfMemoryError" in err or "out of memory" in err.lower())


def extend_entry(name, entry, per_rank, args) -> None:
    ran = [r for r in per_rank if r]
    if "error" in entry:
        entry["oom"] = is_oom(entry["error"]) or any(is_oom(r.get("error")) for r in ran)
    if name == "dc_zero3_no_offload":
        entry["expected"] = "oom"
        entry["as_expected"] = bool(entry.get("oom"))
        if args.device != "cuda":
            entry["note"] = "no cap on CPU: cannot run out of device memory"
    if "error" in entry:
        return
    entry["tokens_per_s"] = entry["tokens_per_s_per_gpu"] * len(ran)
    if args.device == "cuda":
        entry["peak_reserved_gib"] = max(r["peak_reserved_gib"] for r in ran)
        if all("phase_fwd_bwd_gib" in r for r in ran):
            n = min(len(r["phase_fwd_bwd_gib"]) for r in ran)
            entry["phase_fwd_bwd_gib"] = [max(r["phase_fwd_bwd_gib"][i] for r in ran) for i in range(n)]
            n = min(len(r["phase_step_gib"]) for r in ran)
            entry["phase_step_gib"] = [max(r["phase_step_gib"][i] for r in ran) for i in range(n)]
    r0 = ran[0]
    for k in ("offload", "dc_stats", "offload_pass_notes"):
        if k in r0:
            entry[k] = r0[k]
    if "offload" in r0 and "offloaded_bytes" in r0["offload"]:
        entry["offloaded_gib"] = r0["offload"]["offloaded_bytes"] / GIB


def compare(result) -> dict:
    s = result["systems"]
    ok = [n for n in PEERS if n in s and s[n].get("median_step_s")]
    out = {"target": "dc_offload >= 2x the best FSDP2 CPU-offload peer's throughput, no OOM",
           "best_peer": None, "dc_offload_vs_best_peer": None, "dc_offload_vs": {}, "target_met": None,
           "no_offload_ooms": s.get("dc_zero3_no_offload", {}).get("as_expected")}
    if ok:
        best = max(ok, key=lambda n: s[n]["tokens_per_s_per_gpu"])
        out["best_peer"] = best
        for n, e in s.items():
            if e.get("median_step_s"):
                e["throughput_vs_best_peer"] = e["tokens_per_s_per_gpu"] / s[best]["tokens_per_s_per_gpu"]
    dc = s.get("dc_offload", {})
    if dc.get("median_step_s") and ok:
        out["dc_offload_vs"] = {n: dc["tokens_per_s_per_gpu"] / s[n]["tokens_per_s_per_gpu"] for n in ok}
        out["dc_offload_vs_best_peer"] = out["dc_offload_vs"][out["best_peer"]]
        out["target_met"] = out["dc_offload_vs_best_peer"] >= 2.0
        out["target_met_vs"] = {n: r >= 2.0 for n, r in out["dc_offload_vs"].items()}
    elif "dc_offload" in s:
        out["target_met"] = False
    return out


COLORS = {"dc_zero3_uncapped": "#8C8C8C", "dc_offload": "#4C72B0", "fsdp2_cpu_offload": "#DD8452",
          "fsdp2_cpu_offload_fused": "#C44E52", "dc_zero3_no_offload": "#8172B3"}


def status(e: dict) -> str:
    if e.get("oom"):
        return "OOM (expected)" if e.get("expected") == "oom" else "OOM"
    return z3.status_of(e)


def plot(path, result) -> str | None:
    plt = z3.pyplot("offload")
    if plt is None:
        return None
    s = result["systems"]
    names = list(s)
    env = result["environment"]
    fig, axes = plt.subplots(1, 2, figsize=(max(11.0, 2.4 * len(names)), 5.0))
    ax = axes[0]
    raw = [s[n].get("tokens_per_s_per_gpu") for n in names]
    bars = ax.bar(range(len(names)), [v or 0.0 for v in raw], color=[COLORS.get(n, "#55A868") for n in names])
    z3.label_bars(ax, bars, [z3.bar_label(v, status(s[n]), "{:.0f}") for n, v in zip(names, raw)])
    ax.set_title("tokens/s per GPU" + ("" if env["device_type"] == "cuda" else " (CPU smoke run)"), fontsize=10)
    ax = axes[1]
    w = 0.38
    for off, key, lab, alpha in ((-w / 2, "peak_mem_gib", "allocated", 1.0), (w / 2, "peak_reserved_gib", "reserved", 0.5)):
        v = [s[n].get(key) or 0.0 for n in names]
        ax.bar([i + off for i in range(len(names))], v, width=w, alpha=alpha, label=f"peak {lab}",
               color=[COLORS.get(n, "#55A868") for n in names])
    cap = (result.get("cap") or {}).get("cap_bytes")
    if cap and result["cap"].get("applied"):
        ax.axhline(cap / GIB, color="red", ls="--", lw=1, label=f"cap {cap / GIB:.2f} GiB")
    for i, n in enumerate(names):
        if status(s[n]) != "ok":
            ax.text(i, 0, status(s[n]), ha="center", va="bottom", fontsize=8, rotation=90)
    ax.legend(fontsize=8)
    ax.set_title("peak memory, max over ranks (GiB)" + ("" if env["device_type"] == "cuda" else
                                                         ": not measured on CPU"), fontsize=10)
    for ax in axes:
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    m = result["model"]
    fig.suptitle(f"Optimizer-state offload under a memory cap, {env['device']} x{env['world_size']}: Llama "
                 f"{m['params'] / 1e6:.0f}M, micro-batch {m['micro_batch']} x seq {m['seq']} per GPU",
                 fontsize=10)
    return z3.save_figure(fig, path)


def table(result) -> str:
    text_cols = [("system", 24), ("status", 15)]
    num_cols = [z3.STEP_MS, z3.TOKENS, z3.col("vs best peer", "12.2f", "throughput_vs_best_peer"), z3.PEAK,
                z3.col("reserved", "9.2f", "peak_reserved_gib"), z3.col("offloaded GiB", "13.2f", "offloaded_gib")]
    lines = z3.table_header(text_cols, num_cols)
    for n, e in result["systems"].items():
        lines += z3.table_row([n, status(e)], e, text_cols, num_cols)
    cap = result.get("cap") or {}
    c = result.get("comparison") or {}
    cb = cap.get("cap_bytes")
    lines.append("cap: " + (f"{cb / GIB:.2f} GiB per rank " if cb else "none ")
                 + ("(applied)" if cap.get("applied") else
                    "(NOT applied: " + str(cap.get("why_not_applied") or cap.get("error")
                                           or "no cap: dc_zero3_uncapped did not run and --cap-gib was not given") + ")"))
    r = c.get("dc_offload_vs_best_peer")
    vs = ", ".join(f"{n} {v:.2f}x" for n, v in (c.get("dc_offload_vs") or {}).items())
    lines.append(f"dc_offload / best peer ({c.get('best_peer')}): " + (f"{r:.2f}x" if r is not None else "-")
                 + (f" (against each: {vs})" if vs else "")
                 + f"; target (>= 2x, no OOM) met: {c.get('target_met')}; "
                 f"ZeRO-3 without offload ran out of memory: {c.get('no_offload_ooms')}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda":
        threads = args.cpu_threads
        if threads is None:
            try:
                ncpu = len(os.sched_getaffinity(0))
            except AttributeError:
                ncpu = os.cpu_count() or 1
            threads = max(1, ncpu // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        torch.set_num_threads(threads)
    elif args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    rank, world, dev = z3.init_dist(args)
    env = z3.environment(args, world)
    env["cpu_threads_per_rank"] = torch.get_num_threads()
    if args.out is None:
        args.out = z3.default_out("offload", env, args, world)
    base_model, mcfg_d, n_params = z3.build_base_model(args)
    state_bytes = state_bytes_per_rank(base_model, world)
    z3.log(f"{world} ranks, {args.device}, {args.dtype}, micro-batch {args.micro_batch} x seq {args.seq}; "
           f"Adam moments {state_bytes / GIB:.2f} GiB per rank; systems {args.systems}")
    batches = z3.make_batches(args, rank, mcfg_d["vocab_size"], dev)
    args.cap_bytes = int(args.cap_gib * GIB) if args.cap_gib else None

    result = {
        "benchmark": "offload",
        "partial": True,
        "environment": env,
        "args": {k: v for k, v in vars(args).items()},
        "model": {**z3.model_entry(args, mcfg_d, n_params), "adam_state_bytes_per_rank": state_bytes},
        "data": "4 fixed random token batches per rank, torch.Generator seeded seed*1000+rank, cycled; "
                "labels = input_ids",
        "timing": "as zero3.py (median of the timed steps after the warm-up, per step the max over ranks). "
                  "Peak memory: torch.cuda.max_memory_allocated / max_memory_reserved over the training "
                  "steps, per rank; optimizer pre/post-step hooks also record it per phase "
                  "(phase_fwd_bwd_gib, phase_step_gib, max over ranks per step).",
        "cap": {"cap_bytes": args.cap_bytes, "source": "--cap-gib"} if args.cap_bytes else None,
        "systems": {},
    }
    if args.device != "cuda":
        result["cap_note"] = "CPU run: no device memory to cap; the cap is not applied and nothing can OOM"

    for name in args.systems:
        skipped, err = skip_reason(name)
        if skipped or err:
            result["systems"][name] = {"skipped": skipped} if skipped else {"error": err}
            z3.log(f"{name}: {'skipped: ' + skipped if skipped else 'error: ' + err}")
            dist.barrier()
            continue
        sargs = copy.copy(args)
        if name == "dc_zero3_uncapped":
            sargs.warmup, sargs.steps = 1, args.measure_steps - 1
        if name == "dc_offload" and sargs.warmup < args.profile_step + 2:
            sargs.warmup = args.profile_step + 2
        if name != "dc_zero3_uncapped" and args.device == "cuda" and result["cap"] is not None \
                and not result["cap"].get("applied") and result["cap"].get("cap_bytes"):
            result["cap"].update(apply_cap(result["cap"]["cap_bytes"], dev), applied=True)
            z3.log(f"cap {result['cap']['cap_bytes'] / GIB:.2f} GiB per rank applied "
                   f"(fraction {result['cap']['fraction']:.4f} of {result['cap']['device_total_bytes'] / GIB:.1f} GiB)")
        z3.log(f"{name}: start")
        dist.barrier()
        mine = z3.run_on_rank(name, base_model, batches, sargs, rank, dev, build=build, after_train=after_train)
        dist.barrier()
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            entry = z3.summarise(name, gathered, sargs, world)
            extend_entry(name, entry, gathered, sargs)
            if sargs.warmup != args.warmup or sargs.steps != args.steps:
                entry["warmup_steps"], entry["timed_steps_requested"] = sargs.warmup, sargs.steps
            if name == "dc_zero3_uncapped":
                entry["note"] = "measurement run, no cap: gives the cap"
                result["cap"] = choose_cap(entry, gathered, state_bytes, args)
            result["systems"][name] = entry
            result["comparison"] = compare(result)
            z3.write_json(args.out, result)
            if "error" in entry:
                z3.log(f"{name}: {'OOM' if entry.get('oom') else 'FAILED'}"
                       f"{' (expected)' if entry.get('as_expected') else ''}: {entry['error'][:300]}")
            else:
                z3.log(f"{name}: step {entry['step_s'] * 1e3:.1f} ms ({entry['step_time_basis']}), "
                       f"{entry['tokens_per_s_per_gpu']:.0f} tok/s/GPU"
                       + (f", peak {entry['peak_mem_gib']:.2f} GiB (reserved {entry['peak_reserved_gib']:.2f})"
                          if "peak_mem_gib" in entry else "")
                       + (f", offloaded {entry['offloaded_gib']:.2f} GiB" if "offloaded_gib" in entry else ""))
        if name == "dc_zero3_uncapped":  # every rank takes rank 0's cap
            box = [result["cap"] if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            result["cap"] = box[0]
            args.cap_bytes = result["cap"].get("cap_bytes")
            if args.cap_bytes:
                z3.log(f"cap: {result['cap']['rule']} -> {args.cap_bytes / GIB:.2f} GiB"
                       + ("" if result["cap"].get("feasible", True) else f"; WARNING {result['cap']['warning']}"))
            else:
                z3.log(f"no cap: {result['cap'].get('why_not_applied') or result['cap'].get('error')}")
        dist.barrier()

    if rank == 0:
        result["comparison"] = compare(result)
        z3.finish(args, result, plot, table,
                  f"{env['device']} x{world}, torch {env['torch']}, nccl {env['nccl']}, {n_params / 1e6:.1f}M "
                  f"params, {args.micro_batch}x{args.seq} tokens/GPU/step, {args.steps} timed steps after "
                  f"{args.warmup} warm-up, {env['cpu_threads_per_rank']} CPU threads per rank")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
