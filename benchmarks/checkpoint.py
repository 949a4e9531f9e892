#!/usr/bin/env python
"""Checkpoint benchmark: DCP (deepcompile.get_state_dict + torch.distributed.checkpoint.save) against
gathering everything and torch.save (deepcompile.full_state_dict + the optimizer state gathered the
same way, saved by rank 0), on the Llama model of zero3.py (953M parameters with 16 layers).

    torchrun --nproc-per-node=2 benchmarks/checkpoint.py \
        --out benchmarks/results/checkpoint_h200_2gpu.json [--layers 16] [--repeats 3] [--dir /tmp/dc_ckpt]
    torchrun --nproc-per-node=2 benchmarks/checkpoint.py --tiny --device cpu --out /tmp/ckpt_cpu.json  # smoke

What is saved: the model's parameters and AdamW's state (exp_avg, exp_avg_sq, step) of a ZeRO-3
model (fp32 master shards). The optimizer state is created by get_state_dict's zero step (no
training step is needed to have it: same tensors, same sizes).

Timing: wall time from a barrier to a barrier after the last rank's call returns, every repeat
recorded and printed, the two methods alternating (DCP first in even repeats, so the very first
save of the process is DCP's); files are deleted between runs. The targets are judged on the median
AND on the worst repeat (same-repeat ratio), because the first DCP save differed from the later ones.
Both methods fsync what they write (FileSystemWriter's default sync_files=True; the baseline
fsyncs its file), so both times include reaching the disk.

Host memory: per rank and repeat, the peak RSS during the call minus the RSS before it (Linux: VmHWM after
resetting it through /proc/self/clear_refs, then VmRSS), and what stays after it. The target is
that DCP's peak growth stays within the rank's own shards (model + optimizer bytes it holds),
where the baseline holds the whole model and optimizer on every rank.

Also recorded: DCP load time (get_state_dict + dcp.load + set_state_dict) on the same ranks.
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zero3 as z3  # noqa: E402  (the shared benchmark helpers)

z3.TAG = "checkpoint"
GIB = 2 ** 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/checkpoint_<device>_<N>gpu.json)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 16, --tiny 2)")
    p.add_argument("--tiny", action="store_true", help="hidden 256, 2 layers, vocab 1024 (smoke test)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="cuda (NCCL) if available, else cpu (gloo)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help="deepcompile.save_checkpoint's thread_count (default its SAVE_THREADS)")
    p.add_argument("--default-writer", action="store_true",
                   help="also time dcp.save with DCP's default FileSystemWriter (after the others in "
                        "every repeat: its pinned host memory stays cached, so it must not run first)")
    p.add_argument("--hidden", type=int, default=None,
                   help="hidden size of a CPU-sized Llama (intermediate 2.75x, vocab 8192, 8 heads) instead "
                        "of zero3.py's 953M one: e.g. --device cpu --hidden 1024 --layers 4")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default $TMPDIR/dc_ckpt_bench)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--pg-timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.layers is None:
        args.layers = 2 if args.tiny else 16
    args.seq = 128  # model_config_dict's max_position_embeddings only
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.threads is None:
        from deepcompile.checkpoint import SAVE_THREADS
        args.threads = SAVE_THREADS
    return args


# ---------------------------------------------------------------------------------- host memory
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class HostMemory:
    """RSS before, peak during (VmHWM after a reset) and after a block of code."""

    def __enter__(self):
        gc.collect()
        self.peak_ok = _reset_peak()
        self.before = _status("VmRSS")
        return self

    def __exit__(self, *exc):
        self.peak = _status("VmHWM") if self.peak_ok else None
        gc.collect()
        self.after = _status("VmRSS")

    def record(self) -> dict:
        return {"rss_before_gib": self.before / GIB,
                "peak_growth_gib": None if self.peak is None else (self.peak - self.before) / GIB,
                "retained_gib": (self.after - self.before) / GIB}


# ---------------------------------------------------------------------------------- the two methods
def full_optimizer_state(model, opt) -> dict:
    """The optimizer state gathered whole on every rank's CPU, the way full_state_dict gathers
    the parameters (what a user must do today without DCP)."""
    from deepcompile.compat import c10d as c10d_compat

    world = dist.get_world_size(model.dc_state.shard_group)
    out = {}
    for sp in model.dc_state.sharded:
        st = opt.state.get(sp.shard, {})
        entry = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.shape == sp.shard.shape:
                buf = torch.empty((world * v.shape[0], *v.shape[1:]), dtype=v.dtype, device=v.device)
                c10d_compat.all_gather_single(buf, v.contiguous(), model.dc_state.shard_group)
                full_rows = sp.meta.shape[0] if sp.meta.shape else 1
                entry[k] = buf[:full_rows].reshape(sp.meta.shape).cpu()
            else:
                entry[k] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
        out[sp.meta.name] = entry
    return out


def save_full(model, opt, path: str, rank: int, args) -> None:
    import deepcompile

    sd = {"model": deepcompile.full_state_dict(model), "optim": full_optimizer_state(model, opt)}
    if rank == 0:
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
    del sd


def save_dcp(model, opt, path: str, rank: int, args) -> None:
    import deepcompile

    deepcompile.save_checkpoint(path, model, opt, thread_count=args.threads)


def save_dcp_default(model, opt, path: str, rank: int, args) -> None:
    """What a user writes from torch's docs: DCP's default FileSystemWriter (one file per rank, one
    thread; it pins every staged GPU tensor: see deepcompile/checkpoint.py, SAVE_THREADS)."""
    import torch.distributed.checkpoint as dcp

    import deepcompile

    msd, osd = deepcompile.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(path))


def load_dcp(model, opt, path: str, rank: int, args) -> None:
    import deepcompile

    deepcompile.load_checkpoint(path, model, opt)


def timed(fn, model, opt, path, rank, args) -> dict:
    z3.sync(args)
    dist.barrier()
    with HostMemory() as mem:
        t0 = time.perf_counter()
        fn(model, opt, path, rank, args)
        z3.sync(args)
        dist.barrier()
        dt = time.perf_counter() - t0
    return {"seconds": dt, **mem.record()}


def _dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _gib(x):
    return None if x is None else round(x, 2)


def summarize(gathered: list, args, world: int) -> dict:
    """Every repeat's time (rank 0's wall clock, barrier to barrier) and the worst rank's peak host
    growth against that rank's own shards; the targets judged on the median and on the worst repeat.
    A median alone would hide a first save that is twice as slow as the later ones and over the
    memory bound (DCP's default writer pins every staged tensor on the first save)."""
    names = list(gathered[0]["runs"])
    repeats: dict = {}
    for name in names:
        rows = []
        for i in range(len(gathered[0]["runs"][name])):
            per_rank = [g["runs"][name][i] for g in gathered]
            growth = [x["peak_growth_gib"] for x in per_rank]
            over = [None if gr is None else gr - g["own_shards"]["total_gib"] for gr, g in zip(growth, gathered)]
            rows.append({"repeat": i, "seconds": per_rank[0]["seconds"],
                         "peak_host_growth_gib_per_rank": growth,
                         "retained_host_gib_per_rank": [x["retained_gib"] for x in per_rank],
                         "max_peak_growth_gib": max((x for x in growth if x is not None), default=None),
                         "max_growth_over_own_shards_gib": max((x for x in over if x is not None), default=None)})
        repeats[name] = rows
    summary = {}
    for name, rows in repeats.items():
        secs = [r["seconds"] for r in rows]
        summary[name] = {"seconds_per_repeat": secs, "median_s": statistics.median(secs), "max_s": max(secs),
                         "max_peak_growth_gib_per_repeat": [r["max_peak_growth_gib"] for r in rows],
                         "max_growth_over_own_shards_gib_per_repeat": [r["max_growth_over_own_shards_gib"] for r in rows]}
    dcp, full = repeats["dcp_save"], repeats["full_save"]
    ratios = [d["seconds"] / f["seconds"] for d, f in zip(dcp, full)]  # same repeat, same disk state
    over = [r["max_growth_over_own_shards_gib"] for r in dcp]
    known = [o for o in over if o is not None]
    targets = {
        "dcp_save_over_full_save_per_repeat": ratios,
        "dcp_save_over_full_save_median": summary["dcp_save"]["median_s"] / summary["full_save"]["median_s"],
        "dcp_save_over_full_save_worst": max(ratios),
        "at_most_half_median": summary["dcp_save"]["median_s"] / summary["full_save"]["median_s"] <= 0.5,
        "at_most_half_every_repeat": max(ratios) <= 0.5,
        "dcp_peak_growth_within_own_shards_every_repeat": (len(known) == len(over) and max(known) <= 0),
        "dcp_peak_growth_over_own_shards_worst_gib": max(known) if known else None,
    }
    return {"repeats": repeats, "summary": summary, "targets": targets}


def print_summary(result: dict) -> None:
    own = [round(g["own_shards"]["total_gib"], 2) for g in result["per_rank"]]
    print(f"  own shards per rank (GiB): {own}", flush=True)
    for name, rows in result["repeats"].items():
        for r in rows:
            print(f"  {name:16s} repeat {r['repeat']}: {r['seconds']:7.2f} s  peak host growth per rank "
                  f"{[_gib(g) for g in r['peak_host_growth_gib_per_rank']]} GiB, retained "
                  f"{[_gib(g) for g in r['retained_host_gib_per_rank']]} GiB", flush=True)
    for name, s in result["summary"].items():
        print(f"  {name:16s} median {s['median_s']:7.2f} s  worst {s['max_s']:7.2f} s", flush=True)
    t = result["targets"]
    print(f"  dcp_save / full_save per repeat {[round(x, 2) for x in t['dcp_save_over_full_save_per_repeat']]}: "
          f"median {t['dcp_save_over_full_save_median']:.2f}, worst {t['dcp_save_over_full_save_worst']:.2f} "
          f"(target <= 0.5: median {t['at_most_half_median']}, every repeat {t['at_most_half_every_repeat']})",
          flush=True)
    print(f"  DCP peak host growth minus own shards, worst rank and repeat: "
          f"{_gib(t['dcp_peak_growth_over_own_shards_worst_gib'])} GiB (target <= 0 in every repeat: "
          f"{t['dcp_peak_growth_within_own_shards_every_repeat']})", flush=True)


def _cpu_sized_config(args):
    """--hidden: a Llama small enough for a CPU run, with the benchmark's shape proportions."""
    h = args.hidden
    return dict(vocab_size=8192, hidden_size=h, intermediate_size=int(h * 2.75) // 64 * 64,
                num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=args.layers,
                max_position_embeddings=128, tie_word_embeddings=False, use_cache=False)


def main(argv=None):
    args = parse_args(argv)
    if args.hidden:
        z3.model_config_dict = _cpu_sized_config
    rank, world, dev = z3.init_dist(args)
    env = z3.environment(args, world)
    if args.out is None:
        args.out = z3.default_out("checkpoint", env, args, world)
    root = args.dir or os.path.join(os.environ.get("TMPDIR", "/tmp"), "dc_ckpt_bench")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root, exist_ok=True)
    dist.barrier()

    import deepcompile

    base_model, mcfg_d, n_params = z3.build_base_model(args)
    model, opt = deepcompile.initialize(base_model, lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                                        {"zero_stage": 3, "passes": ["zero3"]})
    del base_model
    deepcompile.get_state_dict(model, opt)  # creates AdamW's state (zero step), outside the timings
    own = {"params_gib": sum(sp.shard.numel() * sp.shard.element_size() for sp in model.dc_state.sharded) / GIB,
           "optimizer_gib": sum(v.numel() * v.element_size() for st in opt.state.values()
                                for v in st.values() if isinstance(v, torch.Tensor)) / GIB}
    own["total_gib"] = own["params_gib"] + own["optimizer_gib"]
    z3.log(f"model {n_params / 1e6:.0f}M params; this rank holds {own['total_gib']:.2f} GiB of shards "
           f"(params {own['params_gib']:.2f} + optimizer {own['optimizer_gib']:.2f})")

    names = ["dcp_save", "full_save"] + (["dcp_save_default"] if args.default_writer else [])
    runs = {n: [] for n in names + ["dcp_load"]}
    fns = {"dcp_save": save_dcp, "full_save": save_full, "dcp_save_default": save_dcp_default}
    sizes = {}
    for i in range(args.repeats):
        order = ["dcp_save", "full_save"]
        if i % 2:
            order.reverse()
        order += names[2:]  # the default writer last: its pinned blocks stay cached in the process
        for name in order:
            path = os.path.join(root, f"{name}_{i}" + (".pt" if name == "full_save" else ""))
            r = timed(fns[name], model, opt, path, rank, args)
            runs[name].append(r)
            z3.log(f"repeat {i} {name}: {r['seconds']:.2f} s, peak host growth {_gib(r['peak_growth_gib'])} GiB, "
                   f"retained {_gib(r['retained_gib'])} GiB (own shards {own['total_gib']:.2f} GiB)")
            if rank == 0:
                sizes[name] = _dir_bytes(path)
            if name == "dcp_save":
                r = timed(load_dcp, model, opt, path, rank, args)
                runs["dcp_load"].append(r)
                z3.log(f"repeat {i} dcp_load: {r['seconds']:.2f} s, peak host growth {_gib(r['peak_growth_gib'])} GiB")
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
            dist.barrier()

    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "own_shards": own, "runs": runs})
    if rank == 0:
        result = summarize(gathered, args, world)
        result.update({
            "benchmark": "checkpoint",
            "environment": env,
            "args": vars(args),
            "model": z3.model_entry(args, mcfg_d, n_params, per_shape=True),
            "config": {"zero_stage": 3, "optimizer": "AdamW (fp32 state)", "checkpoint_dir": root},
            "method": {"dcp_save": f"deepcompile.save_checkpoint (get_state_dict + torch.distributed.checkpoint.save "
                                   f"with a file per tensor, {args.threads} writer threads, device tensors staged "
                                   "to pageable host memory one at a time per thread)",
                       "dcp_save_default": "deepcompile.get_state_dict + torch.distributed.checkpoint.save with "
                                           "DCP's default FileSystemWriter (one file per rank, one thread)",
                       "full_save": "deepcompile.full_state_dict + the optimizer state all-gathered to every "
                                    "rank's CPU, torch.save on rank 0, fsync",
                       "dcp_load": "deepcompile.load_checkpoint (get_state_dict + torch.distributed.checkpoint.load "
                                   "+ set_state_dict)"},
            "bytes_written": sizes,
            "per_rank": gathered,
        })
        z3.write_json(args.out, result)
        print(f"\nwrote {args.out}", flush=True)
        print(f"{env['device']} x{world}, {n_params / 1e6:.0f}M params, torch {env['torch']}", flush=True)
        print_summary(result)
    deepcompile.destroy(model)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
