"""The command line: ``deepcompile demo | report | inspect`` (also ``python -m deepcompile``).

* ``demo``: train the embedded GPT on synthetic tokens with ZeRO-3 on N local ranks (gloo on CPU,
  NCCL when enough GPUs), write the run record, render the report, print its path last.
* ``report RUN_DIR [-o FILE]``: render the static HTML report of a record.
* ``inspect RUN_DIR``: a short text summary of a record.

A bad run directory, a broken record or a bad option prints one line to stderr and exits 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
import traceback
from pathlib import Path

from deepcompile.report.summary import summarize

EXIT_USAGE = 2


class CLIError(Exception):
    pass


# --------------------------------------------------------------------------- demo
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse_value(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def build_config(compiler: str, passes: str | None, pass_params: list[str], profile_step: int | None = None) -> dict:
    """The demo's config. Without ``passes`` (and without ``profile_step``): the default ZeRO-3
    plan (``Config.apply_default_schedule``: zero3, a profiling step, then zero3 + prefetch +
    selective_unshard with the planner's parameters), spelled out so that ``pass_params`` apply to
    the planned passes (a parameter set by hand is kept by the planner). Otherwise exactly those
    passes, with ``profile_step`` if given."""
    if passes is None and profile_step is None:
        from deepcompile.config import Config

        cfg = Config.load({"compiler": compiler}).to_dict()
        names = [e["name"] for e in cfg["schedule"][-1]["passes"]]
        _apply_pass_params(cfg["schedule"][-1]["passes"], names, pass_params)
        return cfg
    from deepcompile.passes import zero3

    names = [p.strip() for p in (passes or zero3.NAME).split(",") if p.strip()]
    entries = [{"name": n, "params": {}} for n in names]
    _apply_pass_params(entries, names, pass_params)
    cfg = {"compiler": compiler, "passes": entries}
    if profile_step is not None:
        cfg["profile_step"] = profile_step
    return cfg


def _apply_pass_params(entries: list[dict], names: list[str], pass_params: list[str]) -> None:
    for item in pass_params or []:
        key, eq, value = item.partition("=")
        name, dot, pkey = key.partition(".")
        if not eq or not dot or not pkey:
            raise CLIError(f"--pass-param {item!r}: expected NAME.KEY=VALUE, e.g. prefetch.budget_mb=512")
        hits = [e for e in entries if e["name"] == name]
        if not hits:
            raise CLIError(f"--pass-param {item!r}: pass {name!r} is not in the pass list ({','.join(names)}); "
                           "name it in --passes")
        for e in hits:
            e["params"][pkey] = _parse_value(value)


def load_factory(spec: str):
    """``package.module:function`` -> the function. The factory takes no arguments and returns
    ``(model, make_batch)``: an ``nn.Module`` whose forward returns the loss (a tensor, or an
    object with ``.loss`` such as a Hugging Face output) and ``make_batch(step, rank, device)``
    returning the forward's positional arguments."""
    import importlib

    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise CLIError(f"--model {spec!r}: expected 'package.module:function', e.g. 'mypkg.models:make_gpt'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise CLIError(f"--model {spec!r}: cannot import {mod_name!r} ({e}); is it on PYTHONPATH "
                       "(the current directory is)?") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise CLIError(f"--model {spec!r}: {mod_name} has no callable {fn_name!r}")
    return fn


def _builtin_gpt(batch: int, seed: int, world: int):
    from deepcompile.models import GPT, GPTConfig

    gcfg = GPTConfig()

    def make_batch(step, rank, device):
        import torch

        g = torch.Generator().manual_seed(seed * 1_000_003 + step * world + rank)
        x = torch.randint(0, gcfg.vocab_size, (batch, gcfg.block_size), generator=g)
        return x.to(device), ((x * 7 + 3) % gcfg.vocab_size).to(device)

    return GPT(gcfg), make_batch


class TimelineSamples:
    """Which of the demo's steps run under the profiler, so that a live view shows the latest
    measured step while training runs on: one steady step after ``WARM`` steady steps, then every
    ``every`` steps, ``every`` chosen from what the last sample cost against the steady median so
    that the samples take at most ``BUDGET`` of the run; and the last step (the record's final
    timeline). Steps count from 1; the first steady one runs the final graphs (after the last
    compile: optimizer step 0 and each scheduled re-compile)."""
    WARM = 5
    BUDGET = 0.02
    MIN_EVERY = 10

    def __init__(self, cfg, steps: int):
        self.steps = steps
        self.first_steady = max([e.step for e in (cfg.schedule or [])] + [0]) + 2
        self.next = self.first_steady + self.WARM
        self.steady: list[float] = []

    def due(self, step: int) -> bool:
        return (step == self.steps and self.steps > 1) or step == self.next

    def done(self, step: int, dt: float, sampled: bool) -> bool:
        """Note a step's time; True when it was a sample whose timeline to publish now."""
        if not sampled:
            if step >= self.first_steady:
                self.steady.append(dt)
            return False
        med = sorted(self.steady)[len(self.steady) // 2] if self.steady else dt
        cost = max(0.0, dt - med) / med   # the sample's extra time, in steps
        self.next = step + max(self.MIN_EVERY, math.ceil(cost / self.BUDGET))
        return step < self.steps


def _demo_rank(rank: int, world: int, port: int, backend: str, cfg: dict, steps: int, out: str,
               batch: int, seed: int, factory: str | None = None, timeout_s: float = 600.0,
               command: dict | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    fault = _fault_stack_to(Path(out) / f"rank{rank}" / FAULT_FILE)
    import torch
    import torch.distributed as dist

    from deepcompile.api import initialize

    if backend == "gloo" and "OMP_NUM_THREADS" not in os.environ:
        # the ranks share this host's cores: each takes its share, as torchrun's default does.
        # With every rank running a thread per core, a matmul's threads wait for threads the
        # other ranks hold (2 ranks on 2 cores: the step 2.7x slower, the profiled nodes ~30x)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from deepcompile.profile import trace
    from deepcompile.plan import estimate
    from deepcompile.record.writer import RunRecorder, memory_stats

    rec = None
    measured, overlap = [], {}
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        import datetime

        # the launcher holds the rendezvous store (bound to loopback); every rank is a client
        wait = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world, False, wait)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=wait)
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        torch.manual_seed(seed)  # same initial weights on every rank
        user_model, make_batch = load_factory(factory)() if factory else _builtin_gpt(batch, seed, world)
        model, opt = initialize(user_model, lambda ps: torch.optim.AdamW(ps, lr=3e-3), cfg)
        rec = RunRecorder(out, rank, world, model.dc_config, command=command)
        model.dc_backend.observers.append(rec.graph_version)  # graphs compile at the first call
        samples = TimelineSamples(model.dc_config, steps)
        for step in range(1, steps + 1):
            args = make_batch(step, rank, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            box = {}
            unprofiled = model.dc_profile is None

            def one_step():
                out_ = model(*args)
                box["loss"] = getattr(out_, "loss", out_)
                box["loss"].backward()
                opt.step()
                opt.zero_grad()

            sampled = samples.due(step)
            if sampled:  # a warm step under the profiler: its measured schedule
                measured, overlap = trace.measure_step(
                    one_step, lambda: trace.final_graphs(model.dc_graphs),
                    exact_aten=model.dc_config.compiler != "inductor")
            else:
                one_step()
            lv = float(box["loss"].item())
            dt = time.perf_counter() - t0
            mem = memory_stats(reset_peak=True)
            tl = model.dc_profile.memory if unprofiled and model.dc_profile is not None else None
            if tl and str(tl.get("device", "")).startswith("cuda"):
                # the profiler resets the allocator's peak at every node: this step's high-water
                # mark is its timeline's peak (the same allocator counter, read node by node)
                mem["peak"] = max(mem["peak"], int(tl["peak"]["bytes"]))
            rec.step(step, dt, lv, mem)
            if samples.done(step, dt, sampled):   # the latest measured step, for a live view
                events, _ = estimate.estimate_versions(model.dc_graphs, model.dc_profile,
                                                       fused=model.dc_config.compiler == "inductor")
                rec.schedule(events + measured, replace=True)
            if tl:  # the profiled step's timeline now (rewritten at the end): a live view plots it while training goes on
                rec.memory_timeline(tl)
            if rank == 0:
                print(f"step {step:>4}/{steps}  loss {lv:.4f}  {dt * 1e3:8.1f} ms", flush=True)
        rec.model(model)   # the profile, this rank's measured memory timeline, the plan
        events, samples = estimate.estimate_versions(model.dc_graphs, model.dc_profile,
                                                     fused=model.dc_config.compiler == "inductor")
        rec.schedule(events + measured, replace=True)
        if rank == 0 and overlap.get("overlap_fraction") is not None:
            print(f"measured step {steps}: compute busy {overlap['compute_busy_us'] / 1e3:.1f} ms, communication "
                  f"{overlap['comm_busy_us'] / 1e3:.1f} ms, {100 * overlap['overlap_fraction']:.0f}% of it "
                  "overlapped with compute", flush=True)
        if not (model.dc_profile is not None and model.dc_profile.memory):
            rec.memory(samples, replace=True)   # no profiling step: the naive estimate (predicted)
        rec.close()
        dist.barrier()
        dist.destroy_process_group()
        _fault_stack_done(fault)
    except BaseException as e:
        _fault_stack_done(fault)   # an exception, not a signal: error.txt has its traceback
        err = Path(out) / f"rank{rank}" / "error.txt"
        err.parent.mkdir(parents=True, exist_ok=True)
        err.write_text(traceback.format_exc())
        interrupted = isinstance(e, KeyboardInterrupt)
        reason = "interrupted (SIGINT)" if interrupted else f"rank {rank}: {_last_line(e)}"
        if rec is not None:
            rec.close(status="interrupted" if interrupted else "failed", reason=reason)
        sys.stdout.flush()
        sys.stderr.flush()
        # Exit now: a collective that another rank never joined may still hold a gloo worker
        # thread, and the process group's teardown at interpreter exit would wait for it. The
        # launcher reads error.txt for the message.
        os._exit(130 if interrupted else 1)


FAULT_FILE = "fault.txt"


def _fault_stack_to(path: Path):
    """Python's stack of every thread goes to ``path`` if this rank is killed by a signal
    (a segfault in native code leaves no exception and no error.txt): the launcher shows it."""
    import faulthandler

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "w")  # noqa: SIM115 - open while the rank runs: faulthandler writes to its descriptor
    except OSError:
        return None
    faulthandler.enable(f, all_threads=True)
    return f


def _fault_stack_done(f) -> None:
    """The rank finished: no stack to keep (an empty file would only clutter the record)."""
    import faulthandler

    if f is None:
        return
    faulthandler.disable()
    f.close()
    _drop_if_empty(Path(f.name))


def _drop_if_empty(path: Path) -> None:
    try:
        if path.stat().st_size == 0:
            path.unlink()
    except OSError:
        pass


def _fault_stack(out: Path, rank: int, frames: int = 12) -> str | None:
    """The crashing thread's innermost frames from a rank's fault stack (``_fault_stack_to``:
    faulthandler writes the fault, every other thread, then "Current thread ..."), or None."""
    try:
        lines = (out / f"rank{rank}" / FAULT_FILE).read_text(errors="replace").splitlines()
    except OSError:
        return None
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Current thread")), None)
    if start is None:
        return None
    body = []
    for ln in lines[start + 1:]:
        if not ln.startswith("  "):   # the block ends at a blank line, another thread, the module list
            break
        body.append(ln)
    head = [lines[0]] if lines and lines[0].startswith("Fatal Python error") else []
    return "\n".join(head + [lines[start]] + body[:frames] + (["  ..."] if len(body) > frames else []))


def _last_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(e).__name__


def _host_store(world: int, timeout_s: float):
    """The rendezvous store, served by the launcher on 127.0.0.1 only (TCPStore's own server
    listens on every interface): a socket bound to loopback is handed to it. The port is the
    socket's own, so no other process can take it between choosing and binding."""
    import datetime

    import torch.distributed as dist

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    kw = dict(wait_for_workers=False, master_listen_fd=sock.fileno())
    try:
        store = dist.TCPStore("127.0.0.1", port, world, True, datetime.timedelta(seconds=timeout_s), **kw)
    except (RuntimeError, ValueError):  # a libuv server without master_listen_fd: the classic one has it
        store = dist.TCPStore("127.0.0.1", port, world, True, datetime.timedelta(seconds=timeout_s),
                              use_libuv=False, **kw)
    sock.detach()  # the store's server owns (and closes) the descriptor now
    return store, port


def _stop_ranks(ctx, grace_s: float = 5.0) -> None:
    """SIGTERM every rank still alive, SIGKILL what is left after ``grace_s``."""
    procs = [p for p in ctx.processes if p.is_alive()]
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def _rank_error(out: Path, rank: int) -> str | None:
    try:
        lines = [ln for ln in (out / f"rank{rank}" / "error.txt").read_text().splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[-1].strip() if lines else None


def cmd_demo(a: argparse.Namespace) -> int:
    import torch
    import torch.multiprocessing as mp

    from deepcompile.config import Config

    if a.ranks < 1:
        raise CLIError(f"--ranks {a.ranks}: need at least 1")
    if a.steps < 1:
        raise CLIError(f"--steps {a.steps}: need at least 1")
    if a.batch < 1:  # an empty batch trains on nothing: the loss is NaN and the run "succeeds"
        raise CLIError(f"--batch {a.batch}: need at least 1 sequence per rank per step")
    use_gpu = (not a.cpu) and torch.cuda.is_available() and torch.cuda.device_count() >= a.ranks
    backend = "nccl" if use_gpu else "gloo"
    compiler = a.compiler or ("inductor" if use_gpu else "aot_eager")
    cfg = build_config(compiler, a.passes, a.pass_param, a.profile_step)
    cfg["collective_timeout_s"] = a.timeout
    Config.load(cfg)  # ConfigError (exit 2) before any process starts
    if a.model:
        load_factory(a.model)  # a bad --model fails here, not in every rank
    out = Path(a.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out}: is a file, not a directory; name a new directory for the run record")
    if (out / "manifest.json").exists():
        raise CLIError(f"{out}: already holds a run record; choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent that is a file, no permission, read-only file system
        raise CLIError(f"--out {out}: cannot create the run directory ({e.strerror or e})") from None
    plan = "".join(f", from step {e['step']} {[p['name'] for p in e['passes']]}" for e in cfg.get("schedule") or [])
    if cfg.get("profile_step") is not None:
        plan += f", step {cfg['profile_step']} profiled" + (" and planned" if cfg.get("plan") else "")
    print(f"deepcompile demo: {a.ranks} rank(s), {backend}, compiler {compiler}, passes "
          f"{[e['name'] for e in cfg['passes']]}{plan}, {a.steps} steps -> {out}", flush=True)
    from deepcompile.record.writer import launch_command

    # how to run this demo again (the inspector's Run): this command line, launched by the demo
    command = launch_command(a.ranks, launcher="deepcompile demo",
                             relaunch=[sys.executable, "-m", "deepcompile", *getattr(a, "argv", [])])
    t0 = time.perf_counter()
    from deepcompile.record.writer import finalize_manifest

    store, port = _host_store(a.ranks, a.timeout)
    ctx = None
    try:
        ctx = mp.start_processes(_demo_rank, args=(a.ranks, port, backend, cfg, a.steps,
                                                   str(out), a.batch, a.seed, a.model, a.timeout, command),
                                 nprocs=a.ranks, join=False, start_method="spawn")
        while not ctx.join(timeout=0.5):  # join=True would not return on SIGINT before the ranks end
            pass
    except KeyboardInterrupt:
        # the ranks are not stopped by the launcher's SIGINT alone (only a terminal's Ctrl-C
        # reaches them too): stop them, and say so in the record rank 0 may not have closed
        if ctx is not None:
            _stop_ranks(ctx)
        finalize_manifest(out, "interrupted", "interrupted (SIGINT to the demo launcher); ranks stopped")
        print("deepcompile demo: interrupted; ranks stopped", file=sys.stderr)
        return 130
    except mp.ProcessRaisedException as e:  # raised in a rank before it could exit on its own
        last = [ln for ln in str(e).strip().splitlines() if ln.strip()][-1]
        _stop_ranks(ctx)
        finalize_manifest(out, "failed", f"rank {e.error_index}: {last}")
        print(f"deepcompile demo: rank {e.error_index} failed: {last} "
              f"(traceback in {out / f'rank{e.error_index}' / 'error.txt'})", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        _stop_ranks(ctx)
        err = _rank_error(out, e.error_index)
        if err is not None:
            why = f"rank {e.error_index} failed: {err}"
        else:
            how = (f"signal {e.signal_name}" if getattr(e, "signal_name", None) else f"exit code {e.exit_code}")
            why = f"rank {e.error_index} died ({how})"
        stack = None if err is not None else _fault_stack(out, e.error_index)
        for f in out.glob(f"rank*/{FAULT_FILE}"):   # the stopped ranks' (SIGTERM writes no stack)
            _drop_if_empty(f)
        finalize_manifest(out, "interrupted" if e.exit_code == 130 else "failed", why)
        print(f"deepcompile demo: {why}"
              + (f" (traceback in {out / f'rank{e.error_index}' / 'error.txt'})" if err else "")
              + (f"; its Python stack when it died ({out / f'rank{e.error_index}' / FAULT_FILE}):\n{stack}"
                 if stack else ""), file=sys.stderr)
        return 130 if e.exit_code == 130 else 1
    finally:
        del store  # the rendezvous server stops with the run
    print(f"trained in {time.perf_counter() - t0:.1f} s; rendering the report", flush=True)
    from deepcompile.report.html import render_report

    path = render_report(out, out / "report.html")
    print(f"record: {out}")
    print(f"report: {path}")
    return 0


# --------------------------------------------------------------------------- report / inspect
def cmd_report(a: argparse.Namespace) -> int:
    from deepcompile.report.html import render_report

    path = render_report(a.run_dir, a.output, rank=a.rank)
    print(path)
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    print(summarize(a.run_dir, a.rank))
    return 0


# --------------------------------------------------------------------------- main
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepcompile", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train the embedded GPT with ZeRO-3 on local ranks, record and report")
    d.add_argument("--ranks", type=int, default=2, help="number of ranks (processes), default 2")
    d.add_argument("--steps", type=int, default=20, help="training steps, default 20")
    d.add_argument("--compiler", choices=("inductor", "aot_eager", "eager"), default=None,
                   help="inner compiler (default: aot_eager on CPU, inductor on GPU)")
    d.add_argument("--passes", default=None,
                   help="comma-separated pass names (default: the default ZeRO-3 plan: zero3, step 1 profiled, "
                        "then zero3,prefetch,selective_unshard with planned parameters)")
    d.add_argument("--profile-step", type=int, default=None,
                   help="optimizer step to run node by node under the profiler (its profile is recorded)")
    d.add_argument("--pass-param", action="append", default=[], metavar="NAME.KEY=VALUE",
                   help="a pass parameter, repeatable (value parsed as JSON when it can be)")
    d.add_argument("--out", default=None, help="run directory (default runs/demo-<timestamp>)")
    d.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--model", default=None, metavar="MODULE:FUNCTION",
                   help="train your model instead of the built-in GPT: FUNCTION() returns (model, "
                        "make_batch) with make_batch(step, rank, device) -> forward args; forward returns the loss")
    d.add_argument("--cpu", action="store_true", help="use gloo on CPU even when GPUs are present")
    d.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="collective_timeout_s: a rank that waits this long for the others in a collective "
                        "fails naming the collective, and the demo stops every rank (default 600)")
    d.set_defaults(fn=cmd_demo)
    r = sub.add_parser("report", help="render the static HTML report of a run record")
    r.add_argument("run_dir")
    r.add_argument("-o", "--output", default=None, help="output file (default RUN_DIR/report.html)")
    r.add_argument("--rank", type=int, default=0, help="whose graphs to show (default 0)")
    r.set_defaults(fn=cmd_report)
    i = sub.add_parser("inspect", help="print a short summary of a run record")
    i.add_argument("run_dir")
    i.add_argument("--rank", type=int, default=0)
    i.set_defaults(fn=cmd_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    from deepcompile.params import ConfigError
    from deepcompile.record.schema import RecordError

    a = parser().parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)   # the demo records it (run it again)
    try:
        return a.fn(a)
    except (CLIError, RecordError, ConfigError) as e:
        msg = " ".join(str(e).split())
        print(f"deepcompile {a.cmd}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"deepcompile {a.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
