#!/usr/bin/env python
"""ZeRO-3 benchmark: deepcompile against FSDP2 (eager and per-layer compiled) and a compute-bound
single-GPU baseline, on the same Llama model and the same data, in one torchrun invocation.

    torchrun --nproc-per-node=2 benchmarks/zero3.py \
        --out benchmarks/results/zero3_h200_2gpu.json [--layers 16] [--steps 25] [--warmup 5] \
        [--systems fsdp2_eager,fsdp2_compiled,compute_bound,dc_zero3,dc_prefetch,dc_prefetch_unshard] \
        [--tiny] [--device cpu]

Every system runs one after the other in the same processes. Between systems everything is freed
(model, optimizer, deepcompile runtime, Dynamo caches, CUDA cache). A system that fails is recorded
with its error and the run goes on; the JSON is rewritten after each system, so a run that dies
part-way still leaves the systems it finished. A PNG (median step time and peak memory per system)
is written next to the JSON, and a short table is printed last.

Systems:
  dc_zero3              deepcompile, passes ["zero3"]
  dc_prefetch           deepcompile, passes ["zero3", "prefetch"]                       (skipped if missing)
  dc_prefetch_unshard   deepcompile, passes ["zero3", "prefetch", "selective_unshard"]  (skipped if missing)
  dc_default            deepcompile's default plan (no passes given): zero3, a profiling step, then
                        zero3+prefetch+selective_unshard compiled from the profile (--warmup >= 3)
  dc_fsdp_budget        prefetch and selective_unshard with budgets adding up to fsdp2_compiled's peak
                        minus dc_zero3's (both must run earlier in the same invocation)
  dc_default_fsdp_limit dc_default with memory_limit_gib = fsdp2_compiled's measured peak: the planner
                        fits the plan under what FSDP2 needs (fsdp2_compiled must run earlier)
  dc_default_limit      dc_default with memory_limit_gib = --memory-limit-gib X, or with --limit-from SYSTEM
                        SYSTEM's measured peak (max over ranks), SYSTEM measured earlier in the same run or
                        found in the --append JSON (a CPU run, which measures no peaks, plans under a roomy
                        64 GiB); the limit used is in the system's notes ("memory_limit")

--slow-links sets NCCL_P2P_DISABLE=1 before NCCL starts (NCCL's traffic goes through host shared memory:
a stand-in for the slower links between nodes) and records it; --append never mixes the two regimes.
dc_default, dc_default_fsdp_limit and dc_default_limit record the planner's choice ("plan") and its predicted peak
next to the measured one ("predicted_plan_peak_gib", "predicted_plan_peak_error"), and its predicted
step ("predicted_plan_step_ms", "predicted_plan_step_error").

Every deepcompile system also records the cost model's predicted step time and peak memory next to
the measured ones ("predicted", "predicted_step_error", "predicted_peak_error").
  fsdp2_eager           torch.distributed.fsdp.fully_shard per decoder layer and on the root
  fsdp2_compiled        same, each decoder layer torch.compile'd before fully_shard (torchtitan style)
  fsdp2_compiled_ac     fsdp2_compiled with full activation checkpointing per decoder layer: each layer
                        wrapped with checkpoint_wrapper (non-reentrant, preserve_rng_state=False), then
                        compiled, then fully_shard'ed (torchtitan's apply_ac, apply_compile, apply_fsdp)
  fsdp2_offload_ac      fsdp2_compiled_ac with CPUOffloadPolicy on every fully_shard: fp32 shards, gradients
                        and AdamW state on the host, the optimizer step on the CPU (FSDP2's way to fit)
  compute_bound         the unsharded model on rank 0 only, fp32 params under bf16 autocast, decoder
                        layers compiled, no communication (other ranks wait at a barrier)
  gpu_work_bound        the GPU work of one rank of a sharded step with no communication: compute_bound's
                        forward and backward, but optimizer.step() over 1/N of the parameters (each
                        parameter's ceil(numel/N) elements); the physical limit of a ZeRO-3 step
fsdp2_compiled_ac, fsdp2_offload_ac and dc_default_limit (the peers of the memory-bound regime) are not
in the default --systems list: name them.
Every system records the host time per step ("host_step_s"): from the step's start until its Python
calls return, before the final synchronize. A step whose host time is close to its step time is
host-bound: its pace follows the host's, not the GPU's. "host_cpu_step_s" is the main thread's CPU
time over the same part (``time.thread_time``): the host's own work, which other load on a shared
host moves much less than the wall time; compare host work across runs with it.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DEFAULT_SYSTEMS = ["fsdp2_eager", "fsdp2_compiled", "compute_bound", "dc_zero3", "dc_prefetch",
                   "dc_prefetch_unshard", "dc_default", "dc_fsdp_budget", "dc_default_fsdp_limit", "gpu_work_bound"]
# The memory-bound regime's peers run only when named: dc_default_limit needs a limit
# (--memory-limit-gib / --limit-from), and the activation-checkpointed and offloaded FSDP2 steps
# answer another question than the default list's (who fits, not who is fastest).
ALL_SYSTEMS = DEFAULT_SYSTEMS + ["fsdp2_compiled_ac", "fsdp2_offload_ac", "dc_default_limit", "fsdp2_compiled_fused"]
FSDP2_AC = ("fsdp2_compiled_ac", "fsdp2_offload_ac")  # each decoder layer checkpointed, then compiled
# each decoder layer torch.compile'd before fully_shard; fsdp2_compiled_fused: with AdamW(fused=True),
# the optimizer kernel deepcompile's default steps its shards with on CUDA (config optimizer_fused)
FSDP2_COMPILED = ("fsdp2_compiled", "fsdp2_compiled_fused") + FSDP2_AC
DC_PASSES = {
    "dc_zero3": ["zero3"],
    "dc_prefetch": ["zero3", "prefetch"],
    "dc_prefetch_unshard": ["zero3", "prefetch", "selective_unshard"],
    # no "passes" key: deepcompile's default ZeRO-3 plan (zero3; profile step 1; from step 2
    # zero3+prefetch+selective_unshard compiled against the profile)
    "dc_default": None,
    # prefetch + selective_unshard with budgets that add up to FSDP2-compiled's measured peak minus
    # dc_zero3's (both measured earlier in the same run)
    "dc_fsdp_budget": ["zero3", "prefetch", "selective_unshard"],
    # the default plan, planned under memory_limit_gib = FSDP2-compiled's measured peak
    "dc_default_fsdp_limit": None,
    # the default plan, planned under --memory-limit-gib or the measured peak of --limit-from's system
    "dc_default_limit": None,
}
SINGLE_GPU = ("compute_bound", "gpu_work_bound")  # rank 0 alone; the other ranks wait at a barrier
PEAKS: dict[str, float] = {}  # system -> max-rank peak GiB, filled on every rank as systems finish
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
GIB = 2 ** 30
TAG = "zero3"  # log prefix; benchmarks that import these helpers set their own


# ----------------------------------------------------------------------------------------------
# arguments, environment
# ----------------------------------------------------------------------------------------------

def add_common_args(p: argparse.ArgumentParser, bench: str, all_systems: list[str], *, steps: int, warmup: int,
                    warmup_help: str, systems_help: str = "", pg_timeout: float = 1800.0,
                    step_sync: str = "device", default_systems: list[str] | None = None) -> None:
    """The options every benchmark shares, declared once (zero3, zero1 and offload add their own).
    ``default_systems``: what --systems runs when not given (every known system unless set)."""
    p.add_argument("--out", default=None,
                   help=f"result JSON (default benchmarks/results/{bench}_<device>_<N>gpu.json); the PNG goes "
                        "next to it with the same stem")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 16, --tiny 2)")
    p.add_argument("--steps", type=int, default=steps, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    p.add_argument("--systems", default=",".join(default_systems or all_systems),
                   help=f"comma-separated, run in this order; known: {','.join(all_systems)}{systems_help}"
                        + (f"; default: {','.join(default_systems)}" if default_systems else ""))
    p.add_argument("--tiny", action="store_true", help="hidden 256, 2 layers, vocab 1024, seq 128 (smoke test)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="llama_1b",
                   help="model shape: llama_1b (hidden 2048, ffn 5632, 16 heads, vocab 32000; --layers sets "
                        "the depth, 16 by default) or llama3_8b (Llama-3-8B: hidden 4096, ffn 14336, 32 heads, "
                        "8 kv heads, vocab 128256, 32 layers unless --layers)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (NCCL) if available, else cpu (gloo)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="compute / gather / reduce dtype (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--dc-compiler", choices=("inductor", "aot_eager", "eager"), default="inductor",
                   help="deepcompile's inner compiler")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0, help="model-weight seed (data seed is seed*1000+rank)")
    p.add_argument("--pg-timeout", type=float, default=pg_timeout, help="process-group timeout, seconds")
    p.add_argument("--step-sync", choices=("device", "stream"), default=step_sync,
                   help="end of a timed step: every stream done (device; the step time is the median) or the "
                        "compute stream done (stream; side-stream copies may run under the next step, the "
                        "window ends with every stream done, and the step time is the mean over it)")
    p.add_argument("--no-plot", action="store_true")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "zero3", ALL_SYSTEMS, steps=25, warmup=5, systems_help=" (NAME#2 runs NAME again, as a control)",
                    warmup_help="untimed steps first (must cover compilation and any pass-schedule recompile)",
                    default_systems=DEFAULT_SYSTEMS)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per GPU per step")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 1024, --tiny 128)")
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="no run: draw the plot and print the table of an earlier result (benchmarks/zero3_each.sh)")
    p.add_argument("--append", action="store_true",
                   help="keep the systems already in --out that this run does not measure (same model, "
                        "device and GPU count): run each system in its own process, one invocation each")
    p.add_argument("--accumulation", type=int, default=1,
                   help="micro-batches per optimizer step (deepcompile: gradient_accumulation_steps; the others: "
                        "loss/N, one step()); a step's tokens and time cover all N")
    p.add_argument("--slow-links", action="store_true",
                   help="NCCL_P2P_DISABLE=1 for this run (set before NCCL starts, recorded in the JSON): "
                        "NCCL goes through host shared memory instead of NVLink, like slower inter-node links")
    limit = p.add_mutually_exclusive_group()
    limit.add_argument("--memory-limit-gib", type=float, default=None, metavar="X",
                       help="dc_default_limit: plan under memory_limit_gib = X")
    limit.add_argument("--limit-from", default=None, metavar="SYSTEM",
                       help="dc_default_limit: plan under SYSTEM's measured peak (max over ranks), SYSTEM "
                            "run earlier in --systems or found in the --append JSON (zero3_each.sh passes "
                            "this to every process; each process appends to the same JSON)")
    args = p.parse_args(argv)
    common_defaults(p, args, ALL_SYSTEMS, repeats=True)
    check_limit_args(p, args)
    if args.seq is None:
        args.seq = 128 if args.tiny else 1024
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.accumulation < 1:
        p.error("--accumulation must be >= 1")
    return args


def check_limit_args(p: argparse.ArgumentParser, args) -> None:
    """dc_default_limit needs a limit; --limit-from's system, when this run measures it, must come first."""
    limited = [i for i, s in enumerate(args.systems) if base_name(s) == "dc_default_limit"]
    if args.memory_limit_gib is not None and args.memory_limit_gib <= 0:
        p.error("--memory-limit-gib must be > 0")
    if args.limit_from is not None and base_name(args.limit_from) not in ALL_SYSTEMS:
        p.error(f"--limit-from {args.limit_from}: unknown system; known: {ALL_SYSTEMS}")
    if not limited:
        return
    if args.memory_limit_gib is None and args.limit_from is None:
        p.error("dc_default_limit needs --memory-limit-gib X or --limit-from SYSTEM")
    if args.limit_from in args.systems and args.systems.index(args.limit_from) > limited[0]:
        p.error(f"--limit-from {args.limit_from} runs after dc_default_limit; list it before")


def base_name(name: str) -> str:
    """``NAME#tag`` runs system NAME again later in the same invocation (a control: did the
    machine or the process change between the first run and this one?), recorded under its own key."""
    return name.split("#", 1)[0]


def common_defaults(p: argparse.ArgumentParser, args, all_systems: list[str], repeats: bool = False) -> None:
    """The argument checks and defaults every benchmark shares: --systems parsed and checked,
    --device (cuda when present), --dtype (bf16 on cuda, fp32 on cpu), --layers (16, --tiny 2)."""
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if (base_name(s) if repeats else s) not in all_systems]
    if len(set(args.systems)) != len(args.systems):
        p.error(f"--systems names one system twice: {args.systems}; run it again as NAME#2")
    if unknown:
        p.error(f"unknown systems {unknown}; known: {all_systems}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.layers is None:
        args.layers = 2 if args.tiny else SHAPE_LAYERS[getattr(args, "shape", "llama_1b")]


def load_previous(path: str, result: dict, world: int, key: str, mine: set) -> dict:
    """--append: the entries under ``key`` ("systems", "shapes") of an earlier run of the same
    benchmark in ``path`` that this run does not measure (same model, device and GPU count).
    Each keeps the date it was measured at; ``result["appended_to"]`` lists the earlier runs."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError) as e:
        log(f"--append: cannot read {path} ({e}); starting a new file")
        return {}
    same = (old.get("benchmark") == result["benchmark"]
            and old.get("model", {}).get("config") == result["model"]["config"]
            and old.get("environment", {}).get("world_size") == world
            and old.get("environment", {}).get("device") == result["environment"]["device"]
            # a run with NCCL_P2P_DISABLE (--slow-links) is another regime: never merged with one without
            and old.get("environment", {}).get("nccl_p2p_disable") == result["environment"].get("nccl_p2p_disable")
            and old.get("args", {}).get("accumulation", 1) == result.get("args", {}).get("accumulation", 1))
    if not same:
        log(f"--append: {path} is another benchmark, model, device or GPU count; not merged (overwritten)")
        return {}
    kept = {k: v for k, v in old.get(key, {}).items() if k not in mine}
    for v in kept.values():
        v.setdefault("measured", old.get("environment", {}).get("date_utc"))
    result["appended_to"] = old.get("appended_to", []) + [old.get("environment", {}).get("date_utc")]
    log(f"--append: keeping {sorted(kept)} from {path}")
    return kept


def finish(args, result, plot_fn, table_fn, header: str) -> None:
    """Rank 0, after the last system: final JSON, the plot beside it, the header and table."""
    result["partial"] = False
    png = None if args.no_plot else plot_fn(args.out, result)
    result["plot"] = os.path.relpath(png, os.path.dirname(os.path.abspath(args.out))) if png else None
    write_json(args.out, result)
    print(f"\nwrote {args.out}" + (f" and {png}" if png else ""), flush=True)
    print(f"\n{header}", flush=True)
    print(table_fn(result), flush=True)


SHAPES = {
    "llama_1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                     num_key_value_heads=16),
    "llama3_8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, rope_theta=500000.0),
}
SHAPE_LAYERS = {"llama_1b": 16, "llama3_8b": 32}


def model_config_dict(args) -> dict:
    if args.tiny:
        d = dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_attention_heads=4,
                 num_key_value_heads=4)
    else:
        d = dict(SHAPES[getattr(args, "shape", "llama_1b")])
    d.update(num_hidden_layers=args.layers, max_position_embeddings=max(args.seq, 128),
             tie_word_embeddings=False, use_cache=False)
    return d


def device_name(args) -> str:
    if args.device == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return platform.processor() or platform.machine() or "cpu"


def default_out(bench: str, env: dict, args, world: int) -> str:
    """``benchmarks/results/<bench>_<device>_<N>gpu.json``: where a benchmark writes without --out."""
    return os.path.join(REPO, "benchmarks", "results",
                        f"{bench}_{device_slug(env['device'], args.device)}_{world}gpu.json")


def device_slug(name: str, device: str) -> str:
    if device == "cpu":
        return "cpu"
    m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name.upper())  # "NVIDIA H200" -> h200
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "", name.lower())[:16] or "gpu").lower()


def environment(args, world: int) -> dict:
    env = {
        "device": device_name(args),
        "device_type": args.device,
        "gpu_count": world if args.device == "cuda" else 0,
        "world_size": world,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # --slow-links (or the caller's environment): NCCL without NVLink/PCIe peer-to-peer
        "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE"),
        "slow_links": bool(getattr(args, "slow_links", False)),
        # what decides the compile breakdown: trace once / blocks switches, Inductor's cache dir
        # (a fresh one = cold caches), and the command itself
        "compile_env": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith(("DEEPCOMPILE_", "TORCHINDUCTOR_"))},
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
    if args.device == "cuda":
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # pragma: no cover
            env["nccl"] = f"unknown ({e})"
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["gpu_memory_gib"] = round(props.total_memory / GIB, 1)
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except Exception:
        env["transformers"] = None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        env["git_commit"] = head if re.fullmatch(r"[0-9a-f]{40}", head) else None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        env["git_dirty"] = bool(dirty)
    except Exception:
        env["git_commit"] = None
    return env


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[{TAG} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def free_all(args) -> None:
    gc.collect()
    try:
        torch._dynamo.reset()
    except Exception:
        pass
    gc.collect()
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def raise_dynamo_limits() -> None:
    """Compiled decoder layers share one code object; give Dynamo room for them and their variants."""
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))
    if hasattr(cfg, "accumulated_cache_size_limit"):
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 1024)
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 1024)


def dynamo_unique_graphs():
    try:
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return None


def process_state(args) -> dict:
    """What a process carries from one system to the next: threads, Python objects, resident
    memory, and the CUDA allocator's device allocations and retries. Recorded before and after
    every system, because a deepcompile system measured later in a process ran slower than one
    measured earlier (the reason ``zero3_each.sh`` runs one process per system); the cause is not
    known."""
    st = {"threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
          "python_objects": len(gc.get_objects())}
    try:
        with open("/proc/self/status") as f:
            st["rss_gib"] = next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 2**20
    except (OSError, StopIteration, ValueError):
        pass
    if args.device == "cuda":
        m = torch.cuda.memory_stats()
        st["cuda_mallocs"] = m.get("num_device_alloc")
        st["cuda_alloc_retries"] = m.get("num_alloc_retries")
    return st


def median(xs):
    return statistics.median(xs) if xs else None


def checkpoint_layers(model) -> None:
    """Full activation checkpointing per decoder layer, as torchtitan's apply_ac does: each layer
    wrapped with checkpoint_wrapper (non-reentrant torch.utils.checkpoint, which passes HF's keyword
    arguments such as position_embeddings and attention_mask through); the wrapper replaces the
    layer in model.model.layers, so the model's forward calls it. No dropout in this model, so the
    RNG state need not be kept for the recompute."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=False)


def compile_layers(model) -> None:
    """torch.compile each decoder layer in place of the layer (torchtitan's per-block compile)."""
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = torch.compile(layers[i])


def make_batches(args, rank: int, vocab: int, device) -> list:
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    return [torch.randint(0, vocab, (args.micro_batch, args.seq), generator=g).to(device) for _ in range(4)]


# ----------------------------------------------------------------------------------------------
# the systems: each returns (model, optimizer, autocast context factory, notes)
# ----------------------------------------------------------------------------------------------

def build_dc(name, base_model, args, dev, extra=None):
    """``extra``: config keys that override / add to the default (e.g. zero_stage, passes)."""
    import deepcompile
    cfg = {"compiler": args.dc_compiler, "mixed_precision": {"param_dtype": args.dtype, "reduce_dtype": args.dtype}}
    passes = DC_PASSES.get(base_name(name), ["zero3"])
    if passes is not None:
        cfg["passes"] = list(passes)
    if base_name(name) == "dc_fsdp_budget":
        cfg["passes"] = fsdp_budget_passes()
    if base_name(name) == "dc_default_fsdp_limit":
        cfg["memory_limit_gib"] = fsdp_limit_gib()
    limit = None
    if base_name(name) == "dc_default_limit":
        limit = memory_limit(args)
        cfg["memory_limit_gib"] = limit["gib"]
    if getattr(args, "accumulation", 1) > 1:
        cfg["gradient_accumulation_steps"] = args.accumulation
    cfg.update(copy.deepcopy(extra or {}))
    # BENCH_DC_CONFIG='{"optimizer_chunk_mb": 256}': config keys for every dc system of this run (A/B
    # runs of one setting; recorded in the system's notes with the rest of its config)
    cfg.update(json.loads(os.environ.get("BENCH_DC_CONFIG", "{}")))
    model = copy.deepcopy(base_model)
    model, opt = deepcompile.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=args.lr), cfg)
    fused = ", fused=True (config optimizer_fused 'auto')" if model.dc_state.optim_fused else ""
    notes = {"config": cfg, "optimizer": f"torch.optim.AdamW(lr={args.lr}{fused}) over the fp32 flat shards",
             "what": "deepcompile.initialize(model, AdamW, config); the whole model is torch.compile'd "
                     "with the deepcompile backend"}
    if limit is not None:
        notes["memory_limit"] = limit
    return model, opt, contextlib.nullcontext, notes


def fsdp_budget_passes() -> list:
    """Pass list whose extra memory over plain zero3 is FSDP2-compiled's peak minus dc_zero3's,
    split evenly between prefetching and kept (unsharded) parameters."""
    if not torch.cuda.is_available():  # CPU smoke run: no CUDA peaks; exercise the path with 1 MiB each
        return ["zero3", {"name": "prefetch", "params": {"budget_mb": 1.0}},
                {"name": "selective_unshard", "params": {"budget_mb": 1.0}}]
    if "fsdp2_compiled" not in PEAKS or "dc_zero3" not in PEAKS:
        raise RuntimeError("dc_fsdp_budget needs fsdp2_compiled and dc_zero3 measured earlier in the same run")
    extra_mb = max(0.0, (PEAKS["fsdp2_compiled"] - PEAKS["dc_zero3"]) * 1024)
    return ["zero3", {"name": "prefetch", "params": {"budget_mb": extra_mb / 2}},
            {"name": "selective_unshard", "params": {"budget_mb": extra_mb / 2}}]


def fsdp_limit_gib() -> float:
    """FSDP2-compiled's measured peak (max over ranks, GiB): the memory limit under which
    dc_default_fsdp_limit plans. CPU smoke runs have no CUDA peaks: a roomy 64 GiB exercises the path."""
    if not torch.cuda.is_available():
        return 64.0
    if "fsdp2_compiled" not in PEAKS:
        raise RuntimeError("dc_default_fsdp_limit needs fsdp2_compiled measured earlier in the same run "
                           "(or in the --append JSON)")
    return float(PEAKS["fsdp2_compiled"])


def memory_limit(args) -> dict:
    """dc_default_limit's memory limit: {"gib", "from"}. --memory-limit-gib as given; with
    --limit-from SYSTEM, SYSTEM's measured peak (max over ranks, GiB) from this run or the --append
    JSON. A CPU run measures no peaks: a roomy 64 GiB exercises the path."""
    if args.memory_limit_gib is not None:
        return {"gib": float(args.memory_limit_gib), "from": "--memory-limit-gib"}
    src = args.limit_from
    if src in PEAKS:
        return {"gib": float(PEAKS[src]), "from": f"{src}'s measured peak (max over ranks)"}
    if args.device != "cuda":
        return {"gib": 64.0, "from": f"no measured peak of {src} on {args.device}: a roomy 64 GiB"}
    raise RuntimeError(f"dc_default_limit: no measured peak of {src}; run it earlier in the same run "
                       "or in the --append JSON (it may have failed)")


def dc_prediction(model, opt, res) -> None:
    """The cost model's prediction for the compiled graphs (from the run's profile, if one was
    taken), next to what was measured. Persistent memory (shards, optimizer state) is measured,
    not predicted: predicted peak = allocated between steps - this rank's shards + the predicted
    peak of the graphs (whose inputs include the shards)."""
    from deepcompile.plan.cost_model import predict

    try:  # where the compile time went (Dynamo, AOTAutograd, Inductor), cumulative in this process
        res["compile_times"] = torch._dynamo.utils.compile_times(repr="str", aggregate=True)
    except Exception as e:  # noqa: BLE001
        res["compile_times"] = f"unavailable: {type(e).__name__}: {e}"
    # deepcompile's own breakdown, per optimizer step that compiled and per phase (seconds): dynamo,
    # aot_autograd (trace + partition, Inductor's front end included), passes, inductor, profiling,
    # planner, reuse (trace once); and whether each scheduled re-compile reused the warm-up trace
    res["compile_phases"] = {str(k): {p: round(v, 3) for p, v in d.items()}
                             for k, d in getattr(model, "dc_compile_phases", {}).items()}
    res["trace_once"] = getattr(model, "dc_trace_once", None)
    # graphs taken from AOTAutograd's cache (config aot_cache, a plan-cache hit): no trace, no passes
    res["aot_cache_hits"] = len(getattr(model.dc_backend, "aot_cache_hits", []))
    # config blocks (BENCH_DC_CONFIG='{"blocks": true}'): regions per graph, compiled / reused, kernel wait
    res["blocks"] = [{k: v for k, v in s.items() if k != "labels"} for s in model.dc_state.runtime.block_compiles]
    res["nested_calls"] = model.dc_backend.nested_calls  # config trace_blocks: region calls flattened
    prof = model.dc_profile
    # the final graphs are Inductor's unless the run chose another compiler: fused pointwise ops
    p = predict(model.dc_graphs, prof, fused=model.dc_config.compiler == "inductor")
    dump_graphs(model, prof, res)
    # Without a profile the step time would come from fixed laptop-CPU rates (tens of seconds
    # for this model): not a prediction, so none is recorded. The memory estimate needs only
    # the graph's tensor sizes and is recorded either way.
    res["predicted"] = {"from_profile": prof is not None, "step_ms": p["step_ms"] if prof is not None else None,
                        "graph_peak_gib": p["peak_bytes"] / GIB}
    if prof is not None:
        from deepcompile.plan.cost_model import profiled_ms_by_class
        res["predicted"]["profiled_ms_by_class"] = profiled_ms_by_class(model.dc_graphs, prof)
        res["predicted"]["per_graph_ms"] = p["per_graph_ms"]  # where the predicted step goes
        res["predicted"]["optimizer_ms"] = p.get("optimizer_ms")  # measured in the profiling step
        if prof.comm is not None:  # the measured alpha-beta line the prediction's collectives use
            res["predicted"]["comm_model"] = {"alpha_us": prof.comm.alpha_us,
                                              "allgather_gb_per_s": prof.comm.bytes_per_us / 1e3}
    # optimizer state the runtime moved, beside what the plan offloads (chosen["offloaded_bytes"]):
    # whole state tensors, largest first, so the bytes moved round up to a tensor
    st = model.dc_state.runtime.optimizer_state.stats
    if st.get("steps_offloaded"):
        res["optimizer_state_offload"] = {k: st[k] for k in ("last_offloaded_bytes", "steps_offloaded", "graph_reloads",
                                                              "late_reloads", "released_bytes", "streamed_steps")}
    plan = getattr(model, "dc_plan", None)
    if plan:  # the planner's choice, its predicted step and peak (memory model), the runner-up
        res["predicted"]["plan"] = plan
        res["predicted"]["plan_peak_gib"] = plan["chosen"]["peak_bytes"] / GIB
        res["predicted"]["plan_step_ms"] = plan["chosen"]["step_ms"]
    if torch.cuda.is_available():
        shards = sum(q.numel() * q.element_size() for q in model.parameters())
        between = torch.cuda.memory_allocated()
        res["predicted"].update({"allocated_between_steps_gib": between / GIB, "shards_gib": shards / GIB,
                                 "peak_gib": (between - shards + p["peak_bytes"]) / GIB})


def dump_graphs(model, prof, res) -> None:
    """``BENCH_GRAPHS=DIR``: rank 0 writes this system's graph versions and agreed profile as a
    run record (``deepcompile.record``) in DIR/<system>, so that the cost model can be re-run
    offline against the measured step (``benchmarks/predict_offline.py``) and the graphs opened
    in the report and the inspector."""
    out_dir = os.environ.get("BENCH_GRAPHS")
    if not out_dir or res.get("rank") != 0:
        return
    from deepcompile.record.writer import RunRecorder

    path = os.path.join(out_dir, res["system"].replace("#", "_"))
    with RunRecorder(path, rank=0, world=1, config=model.dc_config) as rec:
        for v in model.dc_graphs:
            rec.graph_version(v)
        # the agreed profile, the profiled step's memory timeline by category and plan.json:
        # what the what-if (plan/whatif.py) and the inspector compare against this run
        rec.model(model)
        if prof is not None and getattr(model, "dc_profile", None) is not prof:
            rec.profile(prof.to_records())
        # the timed steps (step time and host time, as the what-if's host floor reads them);
        # memory from the allocator without resetting its peak (the result reads it after this)
        mem = {}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            mem = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                   "peak": torch.cuda.max_memory_allocated()}
        for i, t in enumerate(res.get("times_s") or []):
            host = (res.get("host_times_s") or [])[i:i + 1]
            rec.step(i, float(t), mem=mem, **({"host_s": float(host[0])} if host else {}))
    log(f"graphs and profile: {path}")


def release_dc(model, opt) -> None:
    """Drop the shards' storage and the optimizer state before the model goes.

    The deepcompile model's parametrized modules are kept alive after ``del`` (seen on torch 2.11
    and 2.13: the class that ``torch.nn.utils.parametrize`` creates per module holds a property
    whose closure refers to the module, and something keeps that class alive), and with them every
    shard; without this each deepcompile system leaks its shards into the next system's memory.
    """
    try:  # optimizer-state offload (offload_optimizer pass): unhook it from this optimizer first
        from deepcompile.runtime import state
        if state.active():
            state.current().optimizer_state.detach()
    except Exception:  # noqa: BLE001  (not there in this version, or the state could not come back)
        pass
    if opt is not None:
        opt.state.clear()
    if model is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.grad = None
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def teardown_dc() -> None:
    try:
        from deepcompile.runtime import ops
        if ops.C is not None and ops.C.is_initialized():
            ops.C.cleanup()
    except Exception:
        pass
    try:  # the runtime state: the registry, the offload engine's pinned host buffers
        from deepcompile.runtime import state
        state.drop()
    except Exception:
        pass


_MESH = None


def build_fsdp2(name, base_model, args, dev, offload_policy=None, opt_kwargs=None):
    """``offload_policy``: passed to every fully_shard (e.g. CPUOffloadPolicy()); fsdp2_offload_ac
    sets CPUOffloadPolicy itself. ``opt_kwargs``: extra AdamW arguments (e.g. fused=True)."""
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    global _MESH
    if _MESH is None:
        _MESH = init_device_mesh(args.device, (dist.get_world_size(),))
    dt = DTYPES[args.dtype]
    mp = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=dt)
    kind = base_name(name)
    if kind == "fsdp2_offload_ac" and offload_policy is None:
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import CPUOffloadPolicy
        offload_policy = CPUOffloadPolicy(pin_memory=args.device == "cuda")  # pinning needs an accelerator
    model = copy.deepcopy(base_model)
    # torchtitan's order: checkpoint, then compile (the checkpoint is traced into the layer's graph),
    # then fully_shard
    if kind in FSDP2_AC:
        checkpoint_layers(model)
    if kind in FSDP2_COMPILED:
        compile_layers(model)
    extra = {} if offload_policy is None else {"offload_policy": offload_policy}
    for layer in model.model.layers:
        fully_shard(layer, mesh=_MESH, mp_policy=mp, **extra)
    fully_shard(model, mesh=_MESH, mp_policy=mp, **extra)
    if offload_policy is None:
        model.to(dev)  # fully_shard already moved the managed states; this is a no-op safety net
    if kind == "fsdp2_compiled_fused":
        opt_kwargs = {**(opt_kwargs or {}), "fused": True}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, **(opt_kwargs or {}))
    notes = {"what": "fully_shard(layer, mp_policy) for every decoder layer, then fully_shard(root); "
                     "reshard_after_forward left at its default (True)"
                     + ("; each decoder layer wrapped with checkpoint_wrapper(layer, preserve_rng_state=False) "
                        "(full activation checkpointing, non-reentrant)" if kind in FSDP2_AC else "")
                     + ("; each decoder layer wrapped with torch.compile(layer) (default inductor) "
                        "before fully_shard, as torchtitan does" if kind in FSDP2_COMPILED else ""),
             "mp_policy": {"param_dtype": args.dtype, "reduce_dtype": args.dtype},
             "optimizer": f"torch.optim.AdamW(lr={args.lr}{''.join(f', {k}={v}' for k, v in (opt_kwargs or {}).items())}) "
                          "over fp32 DTensor shards"}
    if kind == "fsdp2_offload_ac":
        notes["what"] += (f"; offload_policy=CPUOffloadPolicy(pin_memory={args.device == 'cuda'}) on every "
                          "fully_shard: fp32 sharded parameters, gradients and the optimizer state live on "
                          "the CPU, the optimizer step runs on the CPU")
        kw = "".join(f", {k}={v}" for k, v in (opt_kwargs or {}).items())
        notes["optimizer"] = (f"torch.optim.AdamW(lr={args.lr}{kw}) over fp32 DTensor shards on the CPU "
                              f"({torch.get_num_threads()} CPU threads per rank)")
    return model, opt, contextlib.nullcontext, notes


def build_compute_bound(name, base_model, args, dev):
    model = copy.deepcopy(base_model).to(dev)
    compile_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, **bound_opt_kwargs(args))
    dt = DTYPES[args.dtype]
    if dt == torch.float32:
        ac = contextlib.nullcontext
        how = "no autocast (float32 run)"
    else:
        def ac():
            return torch.autocast(device_type=args.device, dtype=dt)
        how = f"torch.autocast({args.device!r}, dtype={args.dtype}) around the forward"
    notes = {"what": "unsharded model on rank 0 only (other ranks wait at a barrier): fp32 parameters, "
                     f"{how}; backward and optimizer outside autocast; every decoder layer wrapped with "
                     "torch.compile(layer) (default inductor); no communication. Same micro-batch per "
                     "GPU as the sharded systems, rank 0's data.",
             "optimizer": f"torch.optim.AdamW(lr={args.lr}{_kw(bound_opt_kwargs(args))}) over fp32 parameters"}
    return model, opt, ac, notes


def bound_opt_kwargs(args) -> dict:
    """The bounds' AdamW kernel: the one deepcompile's default plan steps its shards with (config
    ``optimizer_fused`` 'auto': torch's fused kernel on CUDA), so a bound is never slower than the
    step it bounds by its optimizer alone."""
    return {"fused": True} if args.device == "cuda" else {}


def _kw(kw: dict) -> str:
    return "".join(f", {k}={v}" for k, v in kw.items())


class _ShardStep:
    """``optimizer.step()`` over one rank's share of the parameters, for ``gpu_work_bound``: AdamW on
    fp32 tensors of ceil(numel/N) elements per parameter (the shard a ZeRO-3 rank updates), whose
    gradients are stand-ins; the model's own gradients are dropped at ``zero_grad`` as usual."""

    def __init__(self, model, world: int, lr: float, opt_kwargs: dict):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shards = [torch.zeros(-(-p.numel() // world), device=p.device, dtype=torch.float32,
                                   requires_grad=True) for p in self.params]
        for s in self.shards:
            s.grad = torch.randn_like(s) * 1e-3
        self.inner = torch.optim.AdamW(self.shards, lr=lr, **opt_kwargs)

    def step(self):
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None


def build_gpu_work_bound(name, base_model, args, dev):
    model, _, ac, notes = build_compute_bound(name, base_model, args, dev)
    world = dist.get_world_size() if dist.is_initialized() else 1
    notes = dict(notes)
    notes["what"] = ("one rank's GPU work of a sharded step, no communication: " + notes["what"]
                     + f" optimizer.step() over 1/{world} of the parameters (fp32 AdamW on ceil(numel/{world}) "
                       "elements per parameter).")
    notes["optimizer"] = f"torch.optim.AdamW(lr={args.lr}{_kw(bound_opt_kwargs(args))}) over 1/{world} of the parameters"
    return model, _ShardStep(model, world, args.lr, bound_opt_kwargs(args)), ac, notes


# ----------------------------------------------------------------------------------------------
# running one system on one rank
# ----------------------------------------------------------------------------------------------

def step_sync(args) -> None:
    """The end of a timed step. ``--step-sync device`` (default): every stream is done.
    ``stream``: the compute stream is done, as a training loop's ``loss.item()`` would see it;
    copies a system left on side streams (offload) may overlap the next step, and
    :func:`train_steps` adds the wait for them to the last step, so the timed steps still add up
    to the window's wall time. A full device sync per step would charge every step with a copy
    that in training runs under the next one."""
    if args.device == "cuda" and getattr(args, "step_sync", "device") == "stream":
        torch.cuda.current_stream().synchronize()
    else:
        sync(args)


def _rank0_profile(var: str):
    """(cProfile.Profile, path), already enabled, on rank 0 when the environment variable ``var``
    names a path; None otherwise."""
    path = os.environ.get(var) if os.environ.get("RANK", "0") == "0" else None
    if not path:
        return None
    import cProfile

    p = cProfile.Profile()
    p.enable()
    return p, path


def _dump_profile(prof) -> None:
    if prof is not None:
        prof[0].disable()
        prof[0].dump_stats(prof[1])


def train_steps(model, opt, autocast, batches, args):
    times, losses, host, host_cpu = [], [], [], []
    total = args.warmup + args.steps
    sync(args)
    acc = getattr(args, "accumulation", 1)
    dc = hasattr(model, "dc_backend")  # deepcompile's optimizer steps itself every acc-th step() call
    split = os.environ.get("BENCH_PEAK_SPLIT") == "1" and args.device == "cuda"
    peaks = {"fb": 0, "opt": 0, "fb_steps": [], "opt_steps": []}
    args.peak_split = peaks if split else None
    # BENCH_CPROFILE=PATH: rank 0 runs the warm-up (every compile) under cProfile and writes the
    # stats to PATH, to see where a phase's seconds go on the machine that measures them;
    # BENCH_CPROFILE_STEPS=PATH: the timed steps (not the compiles), to compare the host's Python
    # per step of two configurations (functions' own time / steps)
    prof = _rank0_profile("BENCH_CPROFILE")
    for s in range(total):
        if s == args.warmup:
            _dump_profile(prof)
            prof = _rank0_profile("BENCH_CPROFILE_STEPS")
        t0, c0 = time.perf_counter(), time.thread_time()
        for j in range(acc):
            x = batches[(s * acc + j) % len(batches)]
            with autocast():
                out = model(input_ids=x, labels=x)
            loss = out.loss
            if dc or acc == 1:
                loss.backward()
                if split:  # BENCH_PEAK_SPLIT=1: forward/backward's peak and optimizer.step()'s apart
                    fb = torch.cuda.max_memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                opt.step()
                if split:
                    op = torch.cuda.max_memory_allocated()
                    if s >= args.warmup:
                        peaks["fb"], peaks["opt"] = max(peaks["fb"], fb), max(peaks["opt"], op)
                    peaks["fb_steps"].append(round(fb / GIB, 3))
                    peaks["opt_steps"].append(round(op / GIB, 3))
                    torch.cuda.reset_peak_memory_stats()
                opt.zero_grad(set_to_none=True)
            else:
                (loss / acc).backward()
        if not dc and acc > 1:
            opt.step()
            opt.zero_grad(set_to_none=True)
        host.append(time.perf_counter() - t0)  # the host's part: every call of the step returned
        # the main thread's own CPU time in that part: the host's work, much less sensitive to
        # other load on a shared host than the wall time (a blocked launch or sync spins or sleeps)
        host_cpu.append(time.thread_time() - c0)
        step_sync(args)
        if s == args.warmup - 1 or s == total - 1:
            sync(args)  # warm-up's tail is not the timed window's; the window ends with every stream done
        if s == args.warmup - 1 and args.device == "cuda":
            # the warm-up (compiles, the profiling step) and the steady state apart: the planner
            # predicts the steady state's peak; a memory limit must hold for both
            args.warmup_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach().float().item()))
        del out, loss
        if s < args.warmup or s == total - 1:
            log(f"  step {s}: {times[-1] * 1e3:.1f} ms loss {losses[-1]:.4f}"
                + (" (warm-up)" if s < args.warmup else ""))
    _dump_profile(prof)
    trace_steps(model, opt, autocast, batches, args)
    memory_history_step(model, opt, autocast, batches, args)
    args.host_times, args.host_cpu_times = host, host_cpu
    return times, losses


def _asked_dir(var: str, args) -> str | None:
    """DIR of ``var=system[,system]:DIR`` (created) when it names the system running now; None otherwise."""
    spec = os.environ.get(var, "")
    if ":" not in spec or getattr(args, "current_system", None) not in spec.split(":")[0].split(","):
        return None
    out_dir = spec.split(":", 1)[1]
    os.makedirs(out_dir, exist_ok=True)
    return out_dir


def trace_steps(model, opt, autocast, batches, args, n: int = 3) -> None:
    """``BENCH_TRACE=system[,system]:DIR``: after the timed steps, ``n`` more untimed steps under
    ``torch.profiler`` (a Chrome trace per rank in DIR), to see where a system's step time goes
    (which stream waits for what). Off unless asked: the profiler slows the steps it sees."""
    out_dir = _asked_dir("BENCH_TRACE", args)
    if out_dir is None:
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=acts) as prof:
        for s in range(n):
            x = batches[s % len(batches)]
            with autocast():
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(args)
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(out_dir, f"{args.current_system}_rank{rank}.json")
    prof.export_chrome_trace(path)
    log(f"  trace of {n} steps: {path}")
    args.stream_breakdown = stream_breakdown(path, n)


def memory_history_step(model, opt, autocast, batches, args) -> None:
    """``BENCH_MEMORY_HISTORY=system[,system]:DIR``: after the timed steps, one more untimed step
    with the allocator's history on (Python stacks), written per rank as a snapshot pickle in DIR:
    ``memory_peak.py`` names what is live at the step's peak. Off unless asked: recording slows
    every allocation."""
    out_dir = _asked_dir("BENCH_MEMORY_HISTORY", args)
    if out_dir is None or args.device != "cuda":
        return
    sync(args)
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    x = batches[0]
    with autocast():
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    fb_peak = torch.cuda.max_memory_allocated()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(args)
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(out_dir, f"{args.current_system}_rank{rank}.pickle")
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    # what the replay in memory_peak.py cannot see: the bytes live before the recording began
    snap["dc_bench"] = {"allocated_at_start": start, "fb_peak": fb_peak,
                        "step_peak": torch.cuda.max_memory_allocated()}
    import pickle

    with open(path, "wb") as f:
        pickle.dump(snap, f)
    log(f"  memory history of one step: {path} (forward/backward peak {fb_peak / GIB:.3f} GiB)")


def stream_breakdown(path: str, steps: int) -> dict:
    """Where a traced step's GPU time goes (``trace_streams.py`` on the trace just written), per step:
    each stream's busy ms by what it mostly runs, the span, and GPU ms and launches by kernel kind."""
    import trace_streams as ts

    events = ts.load(path)
    res = ts.analyse(events)
    busy: dict = {}
    for s in res["streams"].values():
        busy[s["label"]] = busy.get(s["label"], 0.0) + s["busy_ms"] / steps
    return {"trace": os.path.basename(path), "steps": steps, "step_span_ms": round(res["span_ms"] / steps, 2),
            "stream_busy_ms": {k: round(v, 2) for k, v in busy.items()},
            "kernels": {k: {"ms": round(ms, 2), "launches": n} for k, n, ms in ts.kinds(events, steps)}}


def _inject_failure(name, rank, phase) -> None:
    """Testing hook: ZERO3_BENCH_FAIL=system:rank:phase (rank '*' = all, phase setup|train)."""
    spec = os.environ.get("ZERO3_BENCH_FAIL", "")
    for item in filter(None, spec.split(",")):
        sysname, r, ph = (item.split(":") + ["*", "setup"])[:3]
        if sysname == name and r in ("*", str(rank)) and ph == phase:
            raise RuntimeError(f"injected failure ({item})")


def _all_ok(ok: bool, dev) -> bool:
    """Every rank's verdict (a MIN all-reduce), outside any timed region."""
    t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _record_error(res, name, rank, e) -> None:
    res["error"] = f"{type(e).__name__}: {e}"[:4000]
    res["traceback"] = traceback.format_exc()[-6000:]
    print(f"[{TAG} rank {rank}] {name} failed: {res['error'][:500]}", file=sys.stderr, flush=True)


def run_on_rank(name, base_model, batches, args, rank, dev, collective=True, build=None, after_train=None):
    """This rank's part of one system. Never raises: errors come back in the dict.

    ``build(name, base_model, args, dev) -> (model, opt, autocast, notes)`` replaces the built-in
    choice by name prefix; ``after_train(model, opt, res)`` runs after the timed steps succeeded
    (to read counters into ``res``).

    ``collective``: all ranks run this system, and agree after setup whether to train, so a setup
    failure on one rank does not leave the others waiting in a collective. A failure during the
    training steps on only some ranks cannot be caught that way (the others are inside the step's
    collectives): the process-group timeout (--pg-timeout) ends the run, and the JSON written after
    each system keeps what finished.
    """
    res = {"rank": rank, "system": name}
    model = opt = None
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        res["alloc_before_gib"] = torch.cuda.memory_allocated() / GIB
    res["process_before"] = process_state(args)
    graphs0 = dynamo_unique_graphs()
    setup_ok = False
    try:
        t0 = time.perf_counter()
        _inject_failure(name, rank, "setup")
        if build is not None:
            model, opt, ac, notes = build(name, base_model, args, dev)
        elif name.startswith("dc_"):
            model, opt, ac, notes = build_dc(name, base_model, args, dev)
        elif name.startswith("fsdp2_"):
            model, opt, ac, notes = build_fsdp2(name, base_model, args, dev)
        elif base_name(name) == "gpu_work_bound":
            model, opt, ac, notes = build_gpu_work_bound(name, base_model, args, dev)
        else:
            model, opt, ac, notes = build_compute_bound(name, base_model, args, dev)
        model.train()
        sync(args)
        res["setup_s"] = time.perf_counter() - t0
        res["notes"] = notes
        setup_ok = True
    except Exception as e:  # noqa: BLE001
        _record_error(res, name, rank, e)
        del e
    go = _all_ok(setup_ok, dev) if collective else setup_ok
    if setup_ok and not go:
        res["error"] = "not run: another rank failed during setup"
    if go:
        try:
            if args.device == "cuda":
                res["setup_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
                torch.cuda.reset_peak_memory_stats()
            _inject_failure(name, rank, "train")
            args.current_system = name  # for trace_steps
            times, losses = train_steps(model, opt, ac, batches, args)
            res["times_s"] = times
            res["host_times_s"] = list(getattr(args, "host_times", []))
            res["host_cpu_times_s"] = list(getattr(args, "host_cpu_times", []))
            if getattr(args, "stream_breakdown", None):
                res["stream_breakdown"], args.stream_breakdown = args.stream_breakdown, None
            if args.device == "cuda":
                res["warmup_peak_gib"] = getattr(args, "warmup_peak", 0) / GIB
                args.warmup_peak = 0
                ps = getattr(args, "peak_split", None)
                if ps:  # the per-phase peaks reset the allocator's peak: the timed peak is their max
                    res["peak_split_gib"] = {"forward_backward": ps["fb"] / GIB, "optimizer": ps["opt"] / GIB,
                                             "fb_by_step": ps["fb_steps"], "opt_by_step": ps["opt_steps"]}
                    w = args.warmup
                    res["warmup_peak_gib"] = max([res["warmup_peak_gib"], *ps["fb_steps"][:w], *ps["opt_steps"][:w]])
                    args.peak_split = None
            res["losses"] = losses
            if args.device == "cuda":
                split_peaks = [v for k, v in (res.get("peak_split_gib") or {}).items() if not k.endswith("step")]
                res["peak_alloc_gib"] = max([torch.cuda.max_memory_allocated() / GIB, *split_peaks])
                res["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
            res["process_after_train"] = process_state(args)
            if after_train is not None:
                after_train(model, opt, res)
        except Exception as e:  # noqa: BLE001  (OOM, compile errors, anything: record and go on)
            _record_error(res, name, rank, e)
            del e
    g1 = dynamo_unique_graphs()
    if graphs0 is not None and g1 is not None:
        res["dynamo_unique_graphs"] = g1 - graphs0
    if name.startswith("dc_"):
        try:
            release_dc(model, opt)
        except Exception as e:  # noqa: BLE001
            res["release_error"] = f"{type(e).__name__}: {e}"
    del model, opt
    if name.startswith("dc_"):
        teardown_dc()
    free_all(args)
    if args.device == "cuda":
        res["alloc_after_gib"] = torch.cuda.memory_allocated() / GIB
    return res


def summarise(name, per_rank, args, world) -> dict:
    """Rank 0: merge the ranks' dicts into the system's entry."""
    ran = [r for r in per_rank if r is not None and not r.get("idle")]
    errors = {str(r["rank"]): r["error"] for r in ran if "error" in r}
    entry = {"notes": next((r["notes"] for r in ran if "notes" in r), None)}
    if errors:
        real = [v for v in errors.values() if not v.startswith("not run:")]
        entry["error"] = (real or list(errors.values()))[0]
        entry["errors_by_rank"] = errors
        entry["traceback_rank"] = next((r["traceback"] for r in ran if "traceback" in r), None)
        return entry
    r0 = ran[0]
    w = args.warmup
    # a step is as slow as the slowest rank: per-step max over ranks
    times = [max(r["times_s"][i] for r in ran) for i in range(len(r0["times_s"]))]
    timed = times[w:]
    med = median(timed)
    # with --step-sync stream, a step's copies may run under the next one: the mean over the
    # window (which ends with every stream done) is the honest per-step time
    basis = statistics.fmean(timed) if getattr(args, "step_sync", "device") == "stream" else med
    tokens_per_gpu_step = args.micro_batch * args.seq * getattr(args, "accumulation", 1)
    entry.update({
        "ranks_used": len(ran),
        "step_times_s": times,
        "step_times_s_by_rank": {str(r["rank"]): r["times_s"] for r in ran},
        "timed_steps": len(timed),
        "median_step_s": med,
        "mean_step_s": statistics.fmean(timed),
        "min_step_s": min(timed),
        "max_step_s": max(timed),
        "stdev_step_s": statistics.stdev(timed) if len(timed) > 1 else 0.0,
        "first_step_s": times[0],
        "warmup_total_s": sum(times[:w]),
        "compile_s": sum(times[:w]) - w * med if w else None,
        "setup_s": max(r["setup_s"] for r in ran),
        "slow_timed_steps": [w + i for i, t in enumerate(timed) if t > 2.0 * med],
        "step_time_basis": ("mean over the timed window (--step-sync stream)" if basis is not med else "median"),
        "step_s": basis,
        "tokens_per_s_per_gpu": tokens_per_gpu_step / basis,
        "losses_rank0": r0["losses"],
        "loss_first_mean": statistics.fmean(r["losses"][0] for r in ran),
        "loss_last_mean": statistics.fmean(r["losses"][-1] for r in ran),
        "dynamo_unique_graphs": r0.get("dynamo_unique_graphs"),
    })
    if all(r.get("host_times_s") for r in ran):
        # the host's share of a step: the slowest rank's host time, over the timed window
        host = [max(r["host_times_s"][i] for r in ran) for i in range(len(r0["host_times_s"]))][w:]
        entry["host_step_s"] = median(host)
        entry["host_fraction"] = entry["host_step_s"] / med
    if all(r.get("host_cpu_times_s") for r in ran):
        entry["host_cpu_step_s"] = median([max(r["host_cpu_times_s"][i] for r in ran)
                                           for i in range(len(r0["host_cpu_times_s"]))][w:])
    if r0.get("stream_breakdown"):   # rank 0's traced steps (BENCH_TRACE)
        entry["stream_breakdown"] = r0["stream_breakdown"]
    if r0.get("optimizer_state_offload"):
        entry["optimizer_state_offload"] = r0["optimizer_state_offload"]
    if "predicted" in r0:
        pr = r0["predicted"]
        entry["predicted"] = pr
        if "compile_times" in r0:
            entry["compile_times"] = r0["compile_times"]
        if pr.get("step_ms") is not None:
            entry["predicted_step_error"] = pr["step_ms"] / (med * 1e3) - 1.0
        if args.device == "cuda" and "peak_gib" in pr:
            entry["predicted_peak_error"] = pr["peak_gib"] / r0["peak_alloc_gib"] - 1.0
    if "compile_phases" in r0:  # per rank: compile seconds by step and phase (the slowest rank gates)
        entry["compile_phases_by_rank"] = {str(r["rank"]): r.get("compile_phases") for r in ran}
        steps = [list((r.get("compile_phases") or {}).values()) for r in ran]
        phases = sorted({ph for per_rank in steps for d in per_rank for ph in d})
        entry["compile_phases_total_s"] = {  # per phase: summed over steps, max over ranks
            ph: round(max(sum(d.get(ph, 0.0) for d in per_rank) for per_rank in steps), 3) for ph in phases}
        entry["trace_once"] = r0.get("trace_once")
        entry["aot_cache_hits"] = r0.get("aot_cache_hits")
        entry["blocks"] = r0.get("blocks")
        entry["nested_calls"] = r0.get("nested_calls")
    if args.device == "cuda":
        entry["peak_mem_gib_by_rank"] = {str(r["rank"]): r["peak_alloc_gib"] for r in ran}
        entry["peak_mem_gib"] = max(r["peak_alloc_gib"] for r in ran)
        # memory still allocated from earlier systems (a leak) would count in the peak: also net of it
        entry["peak_mem_net_gib"] = max(r["peak_alloc_gib"] - r["alloc_before_gib"] for r in ran)
        entry["warmup_peak_mem_gib"] = max(r.get("warmup_peak_gib", 0.0) for r in ran)
        entry["run_peak_mem_gib"] = max(entry["peak_mem_gib"], entry["warmup_peak_mem_gib"])
        if any(r.get("peak_split_gib") for r in ran):
            entry["peak_split_gib_by_rank"] = {str(r["rank"]): r.get("peak_split_gib") for r in ran}
        entry["peak_reserved_gib_by_rank"] = {str(r["rank"]): r["peak_reserved_gib"] for r in ran}
        entry["setup_peak_gib_by_rank"] = {str(r["rank"]): r["setup_peak_gib"] for r in ran}
        entry["alloc_before_gib_by_rank"] = {str(r["rank"]): r["alloc_before_gib"] for r in ran}
        entry["alloc_after_gib_by_rank"] = {str(r["rank"]): r["alloc_after_gib"] for r in ran}
    plan_peak = (entry.get("predicted") or {}).get("plan_peak_gib")
    if plan_peak is not None:  # the planner's memory model against the measured peak (max over ranks)
        entry["predicted_plan_peak_gib"] = plan_peak
        entry["plan"] = entry["predicted"]["plan"].get("summary")
        if entry.get("peak_mem_gib"):
            entry["predicted_plan_peak_error"] = plan_peak / entry["peak_mem_gib"] - 1.0
        # the plan's step (with what the plan adds beside the graphs: the offload copies, the
        # recomputation) against the measured one; "predicted_step_error" prices the graphs alone
        plan_ms = ((entry["predicted"]["plan"].get("chosen") or {}).get("step_ms"))
        if plan_ms and entry.get("step_s"):
            entry["predicted_plan_step_ms"] = plan_ms
            entry["predicted_plan_step_error"] = plan_ms / (entry["step_s"] * 1e3) - 1.0
    entry["process_rank0"] = {k: r0.get(k) for k in ("process_before", "process_after_train")}
    return entry


def add_ratios(systems: dict) -> None:
    def ok(n):
        return n in systems and systems[n].get("median_step_s")
    for name, e in systems.items():
        if not e.get("median_step_s"):
            continue
        e["throughput_vs_fsdp2_compiled"] = (
            e["tokens_per_s_per_gpu"] / systems["fsdp2_compiled"]["tokens_per_s_per_gpu"]
            if ok("fsdp2_compiled") else None)
        e["step_time_vs_compute_bound"] = (
            e["median_step_s"] / systems["compute_bound"]["median_step_s"] if ok("compute_bound") else None)
        e["step_time_vs_gpu_work_bound"] = (
            e["median_step_s"] / systems["gpu_work_bound"]["median_step_s"] if ok("gpu_work_bound") else None)


def skip_reason(name, args):
    if name.startswith("dc_"):
        try:
            from deepcompile.passes import PASSES
        except Exception as e:
            return None, f"deepcompile.passes failed to import: {type(e).__name__}: {e}"
        for p in DC_PASSES[base_name(name)] or ["zero3", "prefetch", "selective_unshard"]:
            if p not in PASSES:
                return f"pass {p} not implemented", None
    return None, None


# ----------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------

def write_json(path, result) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


def status_of(e: dict) -> str:
    if "skipped" in e:
        return "skipped"
    if "error" in e:
        return "FAILED"
    return "ok"


def pyplot(tag: str = TAG):
    """matplotlib.pyplot on the Agg backend, or None (said once) where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"[{tag}] no plot: matplotlib unavailable ({e})", flush=True)
        return None
    return plt


def model_entry(args, mcfg_d: dict, n_params: int, per_shape: bool = False) -> dict:
    """The result JSON's "model" block every benchmark writes (shape keys unless per_shape)."""
    m = {"class": "transformers.LlamaForCausalLM (random init on the benchmark's device, seed %d, kept on CPU)" % args.seed,
         "config": mcfg_d, "attn_implementation": "sdpa", "params": n_params}
    if not per_shape:
        m.update(micro_batch=args.micro_batch, seq=args.seq, tokens_per_gpu_per_step=args.micro_batch * args.seq)
    return m


def plot(path, result) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    systems = result["systems"]
    names = list(systems)
    env = result["environment"]
    fig, axes = plt.subplots(1, 2, figsize=(max(10.0, 2.2 * len(names)), 4.8))
    panels = [("step_s", 1e3, "step time (ms)"), ("peak_mem_gib", 1.0, "peak memory, max over ranks (GiB)")]
    for ax, (key, scale, label) in zip(axes, panels):
        raw = [systems[n].get(key) for n in names]
        colors = ["#4C72B0" if n.startswith("dc_") else "#DD8452" if n.startswith("fsdp2") else "#55A868"
                  for n in names]
        bars = ax.bar(range(len(names)), [(v or 0.0) * scale for v in raw], color=colors)
        label_bars(ax, bars, [bar_label(v and v * scale, status_of(systems[n])) for n, v in zip(names, raw)])
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel(label)
        if key == "peak_mem_gib" and env["device_type"] != "cuda":
            label += ": not measured on CPU"
        ax.set_title(label, fontsize=10)
    m = result["model"]
    fig.suptitle(f"ZeRO-3, {env['device']} x{env['world_size']}: Llama {m['params'] / 1e6:.0f}M params "
                 f"({m['config']['num_hidden_layers']} layers), micro-batch {m['micro_batch']} x seq "
                 f"{m['seq']} per GPU, {result['args']['dtype']}", fontsize=10)
    return save_figure(fig, path)


def bar_label(v, status: str, fmt: str = "{:.1f}") -> str:
    """The text over a bar: the value, "n/a" where a system that ran has none, else its status."""
    if status != "ok":
        return status
    return "n/a" if v is None else fmt.format(v)


def label_bars(ax, bars, texts, **kw) -> None:
    for b, t in zip(bars, texts):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), t, ha="center", va="bottom", **{"fontsize": 8, **kw})


def save_figure(fig, json_path: str) -> str:
    """The PNG beside the result JSON (same stem)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    png = os.path.splitext(json_path)[0] + ".png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def cell(v, fmt: str) -> str:
    """A table cell: the number formatted, or a right-aligned '-' where there is none."""
    width = int(fmt.split(".")[0] or 0)
    return format(v, fmt) if isinstance(v, (int, float)) else "-".rjust(width)


# Table columns every benchmark prints: (title, format, value of a system's entry)
STEP_MS = ("step ms", "10.1f", lambda e: e.get("step_s") and e["step_s"] * 1e3)
TOKENS = ("tok/s/GPU", "10.0f", lambda e: e.get("tokens_per_s_per_gpu"))
PEAK = ("peak GiB", "9.2f", lambda e: e.get("peak_mem_gib"))


def col(title: str, fmt: str, key: str):
    """A table column showing entry[key]."""
    return (title, fmt, lambda e: e.get(key))


def table_header(text_cols: list, num_cols: list) -> list[str]:
    """The header line and its rule: text columns (title, width) left-aligned, numbers right."""
    hdr = " ".join([f"{t:{w}s}" for t, w in text_cols]
                   + [f"{t:>{int(fmt.split('.')[0])}s}" for t, fmt, _ in num_cols])
    return [hdr, "-" * len(hdr)]


def table_row(texts: list[str], e: dict, text_cols: list, num_cols: list) -> list[str]:
    """A system's line (``texts`` fill the text columns, the last one is its status), and the
    reason under it when it did not run cleanly."""
    lines = [" ".join([f"{x:{w}s}" for x, (_, w) in zip(texts, text_cols)]
                      + [cell(get(e), fmt) for _, fmt, get in num_cols])]
    if texts[-1] != "ok":
        lines.append(f"    {(e.get('skipped') or e.get('error', '') or e.get('note', ''))[:160]}")
    return lines


def table(result) -> str:
    text_cols = [("system", 22), ("status", 8)]
    num_cols = [STEP_MS, TOKENS, col("vs fsdp2c", "9.2f", "throughput_vs_fsdp2_compiled"),
                col("vs compute", "10.2f", "step_time_vs_compute_bound"),
                col("vs gpuwork", "10.2f", "step_time_vs_gpu_work_bound"),
                ("host ms", "8.1f", lambda e: e.get("host_step_s") and e["host_step_s"] * 1e3),
                col("host %", "7.0%", "host_fraction"),
                ("host cpu ms", "11.1f", lambda e: e.get("host_cpu_step_s") and e["host_cpu_step_s"] * 1e3), PEAK,
                col("pred peak", "9.2f", "predicted_plan_peak_gib"), col("warm-up s", "9.1f", "warmup_total_s")]
    lines = table_header(text_cols, num_cols)
    for n, e in result["systems"].items():
        lines += table_row([n, status_of(e)], e, text_cols, num_cols)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------

def init_dist(args):
    """The process group from torchrun's environment (or a 1-rank one); returns (rank, world, dev)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.pg_timeout),
                            **({"device_id": dev} if args.device == "cuda" else {}))
    rank, world = dist.get_rank(), dist.get_world_size()
    raise_dynamo_limits()
    return rank, world, dev


def build_base_model(args):
    """The Llama model of ``model_config_dict(args)``, random weights (seed), fp32, on CPU, the
    same on every rank (initialised on the benchmark's device). Returns (model, config dict, parameter count)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    mcfg_d = model_config_dict(args)
    mcfg = LlamaConfig(**mcfg_d)
    try:
        mcfg._attn_implementation = "sdpa"
    except Exception:
        pass
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    # The random init runs where the benchmark runs: on a GPU it takes a second where the CPU,
    # one thread per rank under torchrun, takes ~110 s for the 8B shape. The same seed gives every
    # rank the same weights either way; the model is then kept on CPU, each system copies it.
    init_on = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    with init_on:
        base_model = LlamaForCausalLM(mcfg).float()
    if init_on.type != "cpu":
        base_model.to("cpu")
        torch.cuda.empty_cache()
    base_model.train()
    n_params = sum(p.numel() for p in base_model.parameters())
    log(f"model: {n_params / 1e6:.1f}M params, initialised on {init_on.type} in {time.perf_counter() - t0:.1f}s")
    return base_model, mcfg_d, n_params


def main(argv=None):
    args = parse_args(argv)
    if args.slow_links:  # before NCCL reads its environment (init_dist); recorded by environment()
        os.environ["NCCL_P2P_DISABLE"] = "1"
    if args.replot:
        with open(args.replot) as f:
            result = json.load(f)
        add_ratios(result["systems"])
        png = plot(args.replot, result)
        e = result["environment"]
        runs = len(result.get("appended_to", [])) + 1
        print(f"{e['device']} x{e['world_size']}, torch {e['torch']}, nccl {e['nccl']}; "
              f"{len(result['systems'])} systems from {runs} run(s)" + (f"\nplot: {png}" if png else ""))
        print(table(result))
        return
    rank, world, dev = init_dist(args)
    env = environment(args, world)
    if args.out is None:
        args.out = default_out("zero3", env, args, world)
    base_model, mcfg_d, n_params = build_base_model(args)
    log(f"model: {n_params / 1e6:.1f}M params; "
        f"{world} ranks, {args.device}, {args.dtype}; systems {args.systems}")
    batches = make_batches(args, rank, mcfg_d["vocab_size"], dev)

    result = {
        "benchmark": "zero3",
        "partial": True,
        "environment": env,
        "args": {k: v for k, v in vars(args).items()},
        "model": model_entry(args, mcfg_d, n_params),
        "data": "4 fixed random token batches per rank, torch.Generator seeded seed*1000+rank, cycled; "
                "labels = input_ids; compute_bound uses rank 0's",
        "timing": "wall time per step (forward + backward + optimizer.step + zero_grad), torch.cuda.synchronize "
                  "before and after; per step the max over ranks; median of the timed steps after --warmup "
                  "untimed ones. compile_s = sum(warm-up steps) - warmup * median. Peak memory = "
                  "torch.cuda.max_memory_allocated over the timed steps only (reset after setup and again after "
                  "the warm-up steps; the setup peak and the warm-up's peak (compiles, profiling step) are "
                  "recorded apart: warmup_peak_mem_gib, run_peak_mem_gib = the larger), per rank; peak_mem_net_gib subtracts what was still allocated "
                  "before the system started. Inductor's on-disk caches are left on, so a system compiled "
                  "after a similar one may show a shorter compile time.",
        "systems": {},
    }

    if args.append:  # every rank: dc_fsdp_budget and dc_default_limit read the peaks of systems measured earlier
        previous = load_previous(args.out, result, world, "systems", set(args.systems))
        PEAKS.update({k: v["peak_mem_gib"] for k, v in previous.items() if v.get("peak_mem_gib")})
        if rank == 0:
            result["systems"].update(previous)

    for name in args.systems:
        skipped, err = skip_reason(name, args)
        if skipped or err:
            result["systems"][name] = {"skipped": skipped} if skipped else {"error": err}
            log(f"{name}: {'skipped: ' + skipped if skipped else 'error: ' + err}")
            dist.barrier()
            continue
        log(f"{name}: start")
        dist.barrier()
        if base_name(name) in SINGLE_GPU and rank != 0:
            mine = {"rank": rank, "idle": True}
        else:
            mine = run_on_rank(name, base_model, batches, args, rank, dev,
                               collective=(base_name(name) not in SINGLE_GPU),
                               after_train=dc_prediction if name.startswith("dc_") else None)
        dist.barrier()
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        peaks = [r.get("peak_alloc_gib") for r in gathered if r and r.get("peak_alloc_gib") is not None]
        if peaks:
            PEAKS[name] = max(peaks)
        if rank == 0:
            entry = summarise(name, gathered, args, world)
            result["systems"][name] = entry
            add_ratios(result["systems"])
            write_json(args.out, result)
            if "error" in entry:
                log(f"{name}: FAILED: {entry['error'][:300]}")
            else:
                log(f"{name}: step {entry['step_s'] * 1e3:.1f} ms ({entry['step_time_basis']}), "
                    f"{entry['tokens_per_s_per_gpu']:.0f} tok/s/GPU"
                    + (f", peak {entry['peak_mem_gib']:.2f} GiB" if "peak_mem_gib" in entry else "")
                    + (f", limit {lim['gib']:.2f} GiB ({lim['from']})"
                       if (lim := (entry.get("notes") or {}).get("memory_limit")) else "")
                    + f", warm-up {entry['warmup_total_s']:.1f}s")
        dist.barrier()

    if rank == 0:
        add_ratios(result["systems"])
        finish(args, result, plot, table,
               f"{env['device']} x{world}, torch {env['torch']}, nccl {env['nccl']}, "
               f"{n_params / 1e6:.1f}M params, {args.micro_batch}x{args.seq} tokens/GPU/step, "
               f"{args.steps} timed steps after {args.warmup} warm-up")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
