#!/usr/bin/env python
"""ZeRO-1 benchmark: deepcompile ZeRO-1 against DDP (eager and compiled) and DDP with torch's
ZeroRedundancyOptimizer, on the Llama model of zero3.py, over a grid of micro-batch x sequence.

    torchrun --nproc-per-node=2 benchmarks/zero1.py \
        [--out benchmarks/results/zero1_h200_2gpu.json] [--micro-batches 1,2] [--seqs 512,1024] \
        [--steps 20] [--warmup 3] [--systems ddp,ddp_compiled,zero_redundancy,dc_zero1] \
        [--tiny] [--device cpu]

For every shape of the grid, every system runs one after the other in the same processes (all
freed in between, Dynamo reset: each system compiles once per shape). The helpers (model, data,
timing, memory, error handling, JSON) are benchmarks/zero3.py's. A system that fails is recorded
with its error and the run goes on; the JSON is rewritten after each system. A PNG (tokens/s per
GPU and peak memory per shape and system) goes next to the JSON, and a table is printed last.

Systems (bf16 compute, fp32 master weights, AdamW, bf16 gradient reduction on every one):
  ddp              torch DDP over fp32 parameters, forward under bf16 autocast, bf16_compress_hook
  ddp_compiled     the same DDP module passed to torch.compile (whole model; Dynamo's DDPOptimizer
                   splits the graph at DDP's bucket boundaries, torch's default for compiled DDP)
  zero_redundancy  DDP (eager) + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
  dc_zero1         deepcompile.initialize(..., {"zero_stage": 1, "passes": ["zero12"],
                   "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}})
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zero3 as z3  # noqa: E402  (the shared benchmark helpers)

z3.TAG = "zero1"
ALL_SYSTEMS = ["ddp", "ddp_compiled", "zero_redundancy", "dc_zero1"]
PEERS = ["ddp", "ddp_compiled", "zero_redundancy"]
GIB = z3.GIB


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    z3.add_common_args(p, "zero1", ALL_SYSTEMS, steps=20, warmup=3, systems_help=" (per shape)",
                       warmup_help="untimed steps first (cover compilation)")
    p.add_argument("--micro-batches", default=None, help="comma-separated micro-batches per GPU (default 1,2)")
    p.add_argument("--seqs", default=None, help="comma-separated sequence lengths (default 512,1024; --tiny 128)")
    p.add_argument("--append", action="store_true",
                   help="keep the shapes already in --out that this run does not measure (same model and "
                        "GPU count): lets the grid be split over several invocations, one JSON and plot")
    args = p.parse_args(argv)
    z3.common_defaults(p, args, ALL_SYSTEMS)
    args.micro_batches = _ints(args.micro_batches or "1,2")
    args.seqs = _ints(args.seqs or ("128" if args.tiny else "512,1024"))
    if not args.micro_batches or not args.seqs or min(args.micro_batches + args.seqs) < 1:
        p.error("--micro-batches and --seqs need positive integers")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    # what zero3's helpers read: the model is built for the longest sequence (at least the default
    # grid's, so that split invocations build the same model and --append can merge them); each
    # shape sets its own
    args.seq = max(args.seqs + [128 if args.tiny else 1024])
    args.micro_batch = max(args.micro_batches)
    return args


# ----------------------------------------------------------------------------------------------
# the systems: each returns (model, optimizer, autocast context factory, notes)
# ----------------------------------------------------------------------------------------------

def _autocast(args):
    dt = z3.DTYPES[args.dtype]
    if dt == torch.float32:
        return contextlib.nullcontext, "no autocast (float32 run)"

    def ac():
        return torch.autocast(device_type=args.device, dtype=dt)
    return ac, f"torch.autocast({args.device!r}, dtype={args.dtype}) around the forward"


def _ddp(model, args, dev):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, device_ids=[dev.index] if args.device == "cuda" else None)
    hook = None
    if args.dtype != "float32" and args.device != "cuda":
        hook = "none: the bf16/fp16 compress hooks need NCCL, gradients all-reduced in fp32 (gloo)"
    elif args.dtype != "float32":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        fn = default_hooks.bf16_compress_hook if args.dtype == "bfloat16" else default_hooks.fp16_compress_hook
        ddp.register_comm_hook(None, fn)
        hook = f"default_hooks.{fn.__name__} (gradients all-reduced in {args.dtype})"
    return ddp, hook


def build_ddp(name, base_model, args, dev):
    model = copy.deepcopy(base_model).to(dev)
    ddp, hook = _ddp(model, args, dev)
    ac, how = _autocast(args)
    notes = {"what": f"DistributedDataParallel (defaults: 25 MiB buckets, gradient_as_bucket_view=False) "
                     f"over fp32 parameters; {how}; comm hook: {hook or 'none (fp32 all-reduce)'}"}
    if name == "ddp_compiled":
        cfg = torch._dynamo.config
        notes["what"] += ("; the DDP module wrapped with torch.compile(ddp) (default inductor, whole model), "
                          f"torch._dynamo.config.optimize_ddp={getattr(cfg, 'optimize_ddp', None)!r}")
        model_out = torch.compile(ddp)
    else:
        model_out = ddp
    if name == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr)
        notes["optimizer"] = (f"torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=AdamW, "
                              f"lr={args.lr}): AdamW state for this rank's partition only; updated "
                              "parameters broadcast after each step")
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        notes["optimizer"] = f"torch.optim.AdamW(lr={args.lr}) over fp32 parameters (full state on every rank)"
    return model_out, opt, ac, notes


def build_dc_zero1(name, base_model, args, dev):
    model, opt, ac, notes = z3.build_dc(name, base_model, args, dev,
                                        extra={"zero_stage": 1, "passes": ["zero12"]})
    notes["what"] += ("; ZeRO-1: whole parameters gathered once per optimizer step (kept in the gather "
                      "dtype), AdamW state on this rank's fp32 shard only. With "
                      "gradient_accumulation_steps=1 every backward reduce-scatters its gradients "
                      "(bucketed) into the shard's .grad, as ZeRO-2 does")
    return model, opt, ac, notes


BUILDERS = {"ddp": build_ddp, "ddp_compiled": build_ddp, "zero_redundancy": build_ddp,
            "dc_zero1": build_dc_zero1}


def skip_reason(name):
    if name.startswith("dc_"):
        try:
            from deepcompile.passes import PASSES
        except Exception as e:  # noqa: BLE001
            return None, f"deepcompile.passes failed to import: {type(e).__name__}: {e}"
        if "zero12" not in PASSES:
            return "pass zero12 not implemented", None
    return None, None


# ----------------------------------------------------------------------------------------------
# comparisons, output
# ----------------------------------------------------------------------------------------------

def shape_key(mb: int, seq: int) -> str:
    return f"mb{mb}_seq{seq}"


def compare(shape: dict) -> dict:
    """dc_zero1 against the peers of one shape."""
    systems = shape["systems"]

    def ok(n):
        return n in systems and systems[n].get("median_step_s")
    out = {"best_peer": None, "dc_throughput_vs_best_peer": None, "dc_throughput_vs": {},
           "dc_peak_below_ddp": None, "dc_peak_vs": {}}
    peers = [n for n in PEERS if ok(n)]
    if peers:
        best = max(peers, key=lambda n: systems[n]["tokens_per_s_per_gpu"])
        out["best_peer"] = best
        out["best_peer_tokens_per_s_per_gpu"] = systems[best]["tokens_per_s_per_gpu"]
    if ok("dc_zero1"):
        dc = systems["dc_zero1"]
        for n in peers:
            out["dc_throughput_vs"][n] = dc["tokens_per_s_per_gpu"] / systems[n]["tokens_per_s_per_gpu"]
            if dc.get("peak_mem_gib") is not None and systems[n].get("peak_mem_gib"):
                out["dc_peak_vs"][n] = dc["peak_mem_gib"] / systems[n]["peak_mem_gib"]
        if peers:
            out["dc_throughput_vs_best_peer"] = out["dc_throughput_vs"][out["best_peer"]]
        if ok("ddp") and dc.get("peak_mem_gib") is not None and systems["ddp"].get("peak_mem_gib") is not None:
            out["dc_peak_below_ddp"] = dc["peak_mem_gib"] < systems["ddp"]["peak_mem_gib"]
    for n, e in systems.items():
        if e.get("median_step_s") and out.get("best_peer_tokens_per_s_per_gpu"):
            e["throughput_vs_best_peer"] = e["tokens_per_s_per_gpu"] / out["best_peer_tokens_per_s_per_gpu"]
    return out


COLORS = {"ddp": "#DD8452", "ddp_compiled": "#C44E52", "zero_redundancy": "#8172B3", "dc_zero1": "#4C72B0"}


def plot(path, result) -> str | None:
    plt = z3.pyplot("zero1")
    if plt is None:
        return None
    shapes = result["shapes"]
    keys = list(shapes)
    names = [n for n in ALL_SYSTEMS if any(n in shapes[k]["systems"] for k in keys)]
    env = result["environment"]
    fig, axes = plt.subplots(1, 2, figsize=(max(10.0, 2.6 * len(keys) * 2), 4.8))
    width = 0.8 / max(1, len(names))
    panels = [("tokens_per_s_per_gpu", 1.0, "tokens/s per GPU", "{:.0f}"),
              ("peak_mem_gib", 1.0, "peak memory, max over ranks (GiB)", "{:.1f}")]
    for ax, (key, scale, label, fmt) in zip(axes, panels):
        for j, n in enumerate(names):
            xs, vals, txts = [], [], []
            for i, k in enumerate(keys):
                e = shapes[k]["systems"].get(n)
                if e is None:
                    continue
                v = e.get(key)
                xs.append(i + (j - (len(names) - 1) / 2) * width)
                vals.append((v or 0.0) * scale)
                txts.append(z3.bar_label(v and v * scale, z3.status_of(e), fmt))
            bars = ax.bar(xs, vals, width=width, color=COLORS.get(n, "#55A868"), label=n)
            z3.label_bars(ax, bars, txts, fontsize=6, rotation=90)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"mb {shapes[k]['micro_batch']} x seq {shapes[k]['seq']}" for k in keys], fontsize=8)
        if key == "peak_mem_gib" and env["device_type"] != "cuda":
            label += ": not measured on CPU"
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=7)
    m = result["model"]
    fig.suptitle(f"ZeRO-1, {env['device']} x{env['world_size']}: Llama {m['params'] / 1e6:.0f}M params "
                 f"({m['config']['num_hidden_layers']} layers), {result['args']['dtype']} compute, "
                 "fp32 master weights, AdamW", fontsize=10)
    return z3.save_figure(fig, path)


def table(result) -> str:
    text_cols = [("shape", 14), ("system", 16), ("status", 7)]
    num_cols = [z3.STEP_MS, z3.TOKENS, z3.col("vs best peer", "12.2f", "throughput_vs_best_peer"), z3.PEAK,
                z3.col("first step s", "12.1f", "first_step_s")]
    lines = z3.table_header(text_cols, num_cols)
    for k, sh in result["shapes"].items():
        for n, e in sh["systems"].items():
            lines += z3.table_row([k, n, z3.status_of(e)], e, text_cols, num_cols)
        c = sh.get("comparison") or {}
        if c.get("dc_throughput_vs_best_peer") is not None or c.get("dc_peak_below_ddp") is not None:
            r = c.get("dc_throughput_vs_best_peer")
            lines.append(f"{'':14s} dc_zero1 / best peer ({c.get('best_peer')}): "
                         + (f"{r:.2f}x" if r is not None else "-")
                         + f"; dc peak < ddp peak: {c.get('dc_peak_below_ddp')}")
    return "\n".join(lines)


def load_previous(args, result, world) -> dict:
    """--append: the shapes of an earlier run in --out that this run does not measure."""
    mine = {shape_key(mb, seq) for mb in args.micro_batches for seq in args.seqs}
    return z3.load_previous(args.out, result, world, "shapes", mine)


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    rank, world, dev = z3.init_dist(args)
    env = z3.environment(args, world)
    if args.out is None:
        args.out = z3.default_out("zero1", env, args, world)
    base_model, mcfg_d, n_params = z3.build_base_model(args)
    grid = [(mb, seq) for mb in args.micro_batches for seq in args.seqs]
    z3.log(f"{world} ranks, {args.device}, {args.dtype}; shapes {[shape_key(*g) for g in grid]}; "
           f"systems {args.systems}")

    result = {
        "benchmark": "zero1",
        "partial": True,
        "environment": env,
        "args": {k: v for k, v in vars(args).items() if k not in ("seq", "micro_batch")},
        "model": z3.model_entry(args, mcfg_d, n_params, per_shape=True),
        "data": "per shape, 4 fixed random token batches per rank, torch.Generator seeded seed*1000+rank, "
                "cycled; labels = input_ids",
        "timing": "as zero3.py: wall time per step (forward + backward + optimizer.step + zero_grad), "
                  "torch.cuda.synchronize before and after, per step the max over ranks; median of the "
                  "timed steps after --warmup untimed ones (the first of which compiles). Peak memory = "
                  "torch.cuda.max_memory_allocated over the training steps (reset after setup), per rank. "
                  "Inductor's on-disk caches are left on.",
        "comparison": "per shape: dc_throughput_vs_best_peer = dc_zero1 tokens/s over the fastest of "
                      f"{PEERS} that ran; dc_peak_below_ddp = dc_zero1 peak_mem_gib < ddp peak_mem_gib",
        "shapes": {},
    }
    if args.append and rank == 0:  # in the file from the first write on: a run that dies keeps them
        result["shapes"].update(load_previous(args, result, world))

    for mb, seq in grid:
        sargs = copy.copy(args)
        sargs.micro_batch, sargs.seq = mb, seq
        key = shape_key(mb, seq)
        shape = {"micro_batch": mb, "seq": seq, "tokens_per_gpu_per_step": mb * seq,
                 "measured": env["date_utc"], "systems": {}}
        result["shapes"][key] = shape
        batches = z3.make_batches(sargs, rank, mcfg_d["vocab_size"], dev)
        for name in args.systems:
            skipped, err = skip_reason(name)
            if skipped or err:
                shape["systems"][name] = {"skipped": skipped} if skipped else {"error": err}
                z3.log(f"{key} {name}: {'skipped: ' + skipped if skipped else 'error: ' + err}")
                dist.barrier()
                continue
            z3.log(f"{key} {name}: start")
            dist.barrier()
            mine = z3.run_on_rank(name, base_model, batches, sargs, rank, dev, build=BUILDERS[name])
            dist.barrier()
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            if rank == 0:
                entry = z3.summarise(name, gathered, sargs, world)
                shape["systems"][name] = entry
                shape["comparison"] = compare(shape)
                z3.write_json(args.out, result)
                if "error" in entry:
                    z3.log(f"{key} {name}: FAILED: {entry['error'][:300]}")
                else:
                    z3.log(f"{key} {name}: step {entry['step_s'] * 1e3:.1f} ms ({entry['step_time_basis']}), "
                           f"{entry['tokens_per_s_per_gpu']:.0f} tok/s/GPU"
                           + (f", peak {entry['peak_mem_gib']:.2f} GiB" if "peak_mem_gib" in entry else "")
                           + f", first step {entry['first_step_s']:.1f}s")
            dist.barrier()
        del batches

    if rank == 0:
        for sh in result["shapes"].values():
            sh["comparison"] = compare(sh)
        z3.finish(args, result, plot, table,
                  f"{env['device']} x{world}, torch {env['torch']}, nccl {env['nccl']}, "
                  f"{n_params / 1e6:.1f}M params, {args.steps} timed steps after {args.warmup} warm-up per "
                  "system and shape")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
