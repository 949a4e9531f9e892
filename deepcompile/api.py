"""The public API: initialize, full_state_dict, load_full_state_dict, destroy."""
from __future__ import annotations

import os
import sys
import time
import types
import warnings
import weakref
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from deepcompile import clip
from deepcompile.backend import Backend, paused_gc
from deepcompile.compat import c10d as c10d_compat
from deepcompile.compat import dynamo as dynamo_compat
from deepcompile.compile import blocks, nested
from deepcompile.compile.dynamic import DynamicDims
from deepcompile.config import Config
from deepcompile.runtime import graphcheck, ops, optim_chunks, optimizer_state, seqcheck
from deepcompile.runtime.offload import ENGINE
from deepcompile.sharding import ShardedParam, shard_module, shard_tensor

# a step that compiled for less than this prints nothing (config ``progress``)
PROGRESS_MIN_S = 1.0


def _rank0() -> bool:
    """Whether this process speaks for the job: rank 0 of the default process group, or the only
    process. A warning every rank raises alike (the same model, config and agreed plan) is
    printed by rank 0 alone, once per run, not once per rank."""
    return not (dist.is_initialized() and dist.get_rank() != 0)

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DeepCompileModel(nn.Module):
    """The user's module, sharded, with its forward compiled by the deepcompile backend.

    ``parameters()`` yields this rank's shards, exactly the tensors the optimizer updates.
    """

    def __init__(self, module: nn.Module, sharded: list[ShardedParam], backend: Backend,
                 config: Config, group, state_keys: list[str]):
        super().__init__()
        self.module = module
        object.__setattr__(self, "dc_sharded", sharded)
        object.__setattr__(self, "dc_backend", backend)
        object.__setattr__(self, "dc_config", config)
        object.__setattr__(self, "dc_group", group)
        object.__setattr__(self, "dc_state_keys", state_keys)
        object.__setattr__(self, "_dc_compiled", torch.compile(module, backend=backend))
        object.__setattr__(self, "dc_step", 0)
        object.__setattr__(self, "_dc_passes", config.passes)
        object.__setattr__(self, "dc_dynamic", DynamicDims())  # input dims that vary, agreed across ranks
        object.__setattr__(self, "dc_plan", None)  # the planner's choice and why (deepcompile.plan.planner)
        object.__setattr__(self, "dc_seqcheck", None)  # per-step collective count check (initialize sets it)
        object.__setattr__(self, "_dc_gc_paused", False)  # the collector paused while compiling (forward)
        object.__setattr__(self, "_dc_forward_step", -1)  # the step of the last forward
        object.__setattr__(self, "_dc_forwards_in_step", 0)  # and how many forwards that step ran
        # the last step whose forward compiles: the last scheduled re-compile (a later one, e.g.
        # for new input shapes, pauses the collector in the backend's own compile calls only)
        object.__setattr__(self, "_dc_last_compile_step",
                           max([0, config.profile_step or 0] + [e.step for e in config.schedule]))

    def forward(self, *args, **kwargs):
        # The collector waits from a compiling step's first forward to its optimizer step
        # (backend.paused_gc says why; _dc_on_optimizer_step ends the pause), or to a forward
        # past the step's micro-batches that compiled nothing: a loop without optimizer steps
        # (evaluation) must not run with it off
        step = self.dc_step
        if step > self._dc_last_compile_step and not self._dc_gc_paused:
            return self._dc_forward(*args, **kwargs)  # training at speed: nothing to decide
        frames = dynamo_compat.dynamo_frames_compiled()
        seen = self._dc_forwards_in_step + 1 if step == self._dc_forward_step else 1
        if seen == 1 and not self._dc_gc_paused:  # (a step's later forwards never pause again)
            paused_gc.pause()
            object.__setattr__(self, "_dc_gc_paused", True)
        try:
            out = self._dc_forward(*args, **kwargs)
        except BaseException:
            self._dc_resume_gc(collect=False)
            raise
        if self._dc_gc_paused and seen > self.dc_config.gradient_accumulation_steps \
                and dynamo_compat.dynamo_frames_compiled() == frames:
            self._dc_resume_gc(collect=True)
        object.__setattr__(self, "_dc_forward_step", step)
        object.__setattr__(self, "_dc_forwards_in_step", seen)
        return out

    def _dc_resume_gc(self, collect: bool, freeze: bool = False) -> None:
        if self._dc_gc_paused:
            object.__setattr__(self, "_dc_gc_paused", False)
            paused_gc.resume(collect, freeze)

    def _dc_forward(self, *args, **kwargs):
        passes = self.dc_config.passes_at(self.dc_step)
        profiling = self.dc_step == self.dc_config.profile_step
        if self.dc_backend.plan_cache is not None and self.dc_backend.plan_cache.hit:
            passes, profiling = self._dc_passes, False  # the stored plan, compiled at step 0 (plan.cache)
        if passes is not self._dc_passes or profiling != self.dc_backend.profiling:
            # dims that became dynamic: the graphs compiled so far may be static on some ranks and
            # symbolic on others; the profiling step must profile one graph every rank shares
            fresh = self.dc_dynamic.take_changed()
            if not (profiling and passes is self._dc_passes and not fresh and self.dc_backend.profile_in_place()):
                self._recompile(passes, profiling, dynamic_changed=bool(fresh))
            if profiling:  # the profiling step's cost, end to end (until _finish_profile)
                object.__setattr__(self, "_dc_profile_t0", time.perf_counter())
        self.dc_dynamic.observe(args, kwargs)
        # the runtime names the graph node of a collective timeout by phase: forward while the
        # compiled forward runs, backward after it (two pybind calls per forward)
        ops.C.set_phase(0)
        b = self.dc_backend
        dyn0, call0 = dynamo_compat.dynamo_compile_seconds(), b.call_seconds
        graphs = b.next_graph_id
        try:
            try:
                return self._dc_compiled(*args, **kwargs)
            except Exception as e:
                if not (dynamo_compat.is_dynamo_error(e) and b.next_graph_id == graphs and nested.is_wrapped(self.module)):
                    raise
                self._dc_trace_flat(e)
                return self._dc_compiled(*args, **kwargs)
        finally:
            ops.C.set_phase(1)
            dyn1 = dynamo_compat.dynamo_compile_seconds()
            if dyn1 is not None and dyn0 is not None and dyn1 > dyn0:  # Dynamo compiled a frame
                b.add_phase("dynamo", (dyn1 - dyn0) - (b.call_seconds - call0))

    def _dc_trace_flat(self, e: Exception) -> None:
        """Dynamo could not trace a decoder block as a nested region (config trace_blocks; e.g. a
        block that returns one of its inputs, which ``invoke_subgraph`` refuses): trace every layer,
        as with trace_blocks false. Nothing was compiled yet (the caller checks), and every rank
        fails the same way on the same model, so each falls back alike."""
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        if _rank0():
            warnings.warn(f"deepcompile: tracing the decoder blocks once failed ({type(e).__name__}: {first[:300]}); "
                          "tracing every layer instead. Set config trace_blocks: false to skip the attempt.",
                          stacklevel=4)
        self.dc_backend.trace_blocks_failed = f"{type(e).__name__}: {first[:300]}"
        nested.unwrap(self.module)
        dynamo_compat.reset_dynamo(self.module)
        object.__setattr__(self, "_dc_compiled", torch.compile(self.module, backend=self.dc_backend))

    def _recompile(self, passes, profiling: bool = False, dynamic_changed: bool = False) -> None:
        optimizer_state.MANAGER.plan(0)  # the new pass list decides again (nothing, without offload_optimizer)
        planned = passes
        if not profiling and self.dc_config.plan and self.dc_backend.profile is not None:
            from deepcompile.plan.planner import plan_model

            planned = plan_model(self, passes)  # budgets from the profile and the memory limit
            self.dc_backend.add_phase("planner", (self.dc_plan or {}).get("seconds", 0.0), self.dc_step)
            if self.dc_backend.plan_cache is not None:  # for the next run of this job (plan.cache)
                self.dc_backend.plan_cache.store(self, planned, dynamic_changed)
        if not profiling:
            # trace once: the new passes and the final compiler on the warm-up's partitioned graphs,
            # swapped in under the guarded code Dynamo already has (backend.retarget)
            why = self.dc_backend.retarget(planned, self.dc_step, dynamic_changed)
            if why is None:
                object.__setattr__(self, "_dc_passes", passes)
                return
            if self.dc_backend.trace_once and _rank0():
                warnings.warn(f"deepcompile: step {self.dc_step} re-traces the model (Dynamo + AOTAutograd) "
                              f"instead of reusing the warm-up trace: {why}", stacklevel=3)
        # Drop every compiled graph before compiling the new pass list: the old graphs (and
        # the memory their code objects pin) must not survive the switch.
        dynamo_compat.reset_dynamo(self.module)
        self.dc_backend.use_passes(planned, self.dc_step, profiling)
        object.__setattr__(self, "_dc_passes", passes)
        object.__setattr__(self, "_dc_compiled", torch.compile(self.module, backend=self.dc_backend))

    @property
    def dc_profile(self):
        """The agreed profile of the profiling step (None before it has run)."""
        return self.dc_backend.profile

    def _dc_before_optimizer_step(self, *_args) -> None:
        # every rank issued the same collectives this step, or all stop here naming the rank behind
        if self.dc_seqcheck is not None:
            self.dc_seqcheck.check()
        # The step changes the shards, so kept gathered copies go stale; they are dropped before
        # the step, not after it: the step does not read them and would otherwise carry them at
        # its peak (the planner's memory model counts on this).
        ops.C.invalidate_persistent()
        # the profiling step times optimizer.step() too (and its peak memory): the cost model
        # predicts whole steps
        if self.dc_backend.profiling and self.dc_backend.measured:
            object.__setattr__(self, "_dc_opt_timer", _StepTimer(self._dc_device()))

    def _dc_on_optimizer_step(self, *_args) -> None:
        if self.dc_backend.profiling and self.dc_backend.measured:
            self._finish_profile()
        self._dc_progress()
        self.dc_backend.end_step()
        self.dc_dynamic.at_step_end(self.dc_config, self.dc_step, self.dc_group)  # collective before a re-compile
        object.__setattr__(self, "dc_step", self.dc_step + 1)
        # the compiling steps' collector: back on between them (the compile's heap frozen), and
        # one full collection after the last (backend.paused_gc)
        if self.dc_step > self._dc_last_compile_step:
            self._dc_resume_gc(collect=True)
        else:
            self._dc_resume_gc(collect=False, freeze=True)

    def _dc_progress(self) -> None:
        """One line on rank 0 for each step that spent a second or more compiling, profiling or
        planning (config ``progress``): the first fast step comes after tens of seconds of
        tracing, profiling, planning and Inductor; the user sees which, how long, and when it ends."""
        if not self.dc_config.progress or (dist.is_initialized() and dist.get_rank() != 0):
            return
        phases = self.dc_backend.phases.get(self.dc_step) or {}
        total = sum(phases.values())
        # the graphs this step compiled as block regions (config blocks; blocks.STATS is this process's)
        seen = self.__dict__.get("_dc_blocks_seen", 0)
        cut = blocks.STATS[seen:]
        object.__setattr__(self, "_dc_blocks_seen", len(blocks.STATS))
        if total <= 0 or total < PROGRESS_MIN_S:   # (<= 0: nothing ran, even with a threshold of 0)
            return
        parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]) if v >= 0.05)
        line = f"deepcompile: step {self.dc_step}: {total:.1f} s of one-time work ({parts})"
        if cut:
            line += (f"; Inductor compiled {sum(s['compiled'] for s in cut)} distinct regions for "
                     f"{sum(s['regions'] for s in cut)} block regions of {len(cut)} graphs (config blocks)")
        if self.dc_backend.profiling:
            line += "; this step is profiled"
        plan = self.dc_plan or {}
        cache = self.dc_backend.plan_cache
        hit = cache is not None and cache.hit   # the stored plan was compiled at step 0: no more compiles
        if hit and plan.get("summary"):
            line += f"; from the plan cache: {plan['summary']}"
        elif plan.get("step") == self.dc_step and plan.get("summary"):
            line += f"; {plan['summary']}"
        if hit and self.dc_backend.aot_cache_hits:
            line += "; graphs from AOTAutograd's cache (aot_cache: no trace, no passes)"
        later = [] if hit else [e.step for e in self.dc_config.schedule if e.step > self.dc_step]
        line += (f"; compiles again at step {min(later)}" if later
                 else "; the final graphs run from the next step")
        print(line, file=sys.stderr, flush=True)

    def _finish_profile(self) -> None:
        from deepcompile.profile.profiler import GraphProfile, Profile, agree, benchmark_comm

        b = self.dc_backend
        prof = Profile(graphs={k: GraphProfile(k[0], k[1], v) for k, v in sorted(b.measured.items())},
                       hardware=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       step=self.dc_step)
        timer = self.__dict__.pop("_dc_opt_timer", None)
        prof.optimizer_ms = timer.stop() if timer is not None else 0.0
        prof.optimizer_peak_bytes = timer.peak_bytes if timer is not None else 0
        from deepcompile.profile.profiler import take_memory_timeline

        # this rank's memory timeline of the step, by category (the record's memory.json.gz)
        prof.memory = take_memory_timeline(b.compiled, self.dc_step, prof.optimizer_ms, prof.optimizer_peak_bytes)
        # the gathers the passes schedule run in the shard group (all ranks but under mesh.shard)
        prof.comm = benchmark_comm(self.dc_shard_group, self._dc_device())
        if self._dc_device().type == "cuda":
            # the host's pace: the host model (plan.estimate.host_model) follows the machine
            from deepcompile.profile.host import host_benchmark

            prof.host = host_benchmark(self._dc_device())
            from deepcompile.profile.profiler import take_host_ops

            prof.host["ops_us"] = take_host_ops()   # each dc op's own host time in the profiling step
        rep = self.__dict__.get("dc_replicate_group")
        if rep is not None:  # HSDP: the gradient all-reduce across replicas has its own link
            from deepcompile.vocab.links import ReplicateLink
            from deepcompile.profile.profiler import benchmark_allreduce

            prof.replicate = ReplicateLink(benchmark_allreduce(rep, self._dc_device()),
                                           dist.get_world_size(self.dc_shard_group))
        b.profile = agree(prof, self.dc_group)
        b.measured = {}
        t0 = self.__dict__.pop("_dc_profile_t0", None)
        if t0 is not None:
            b.add_phase("profiling", time.perf_counter() - t0, self.dc_step)

    def _dc_device(self) -> torch.device:
        return next(iter(self.dc_sharded)).shard.device if self.dc_sharded else torch.device("cpu")

    @property
    def dc_graphs(self):
        """Every graph version the backend produced (input and after each pass)."""
        return self.dc_backend.versions

    @property
    def dc_compile_phases(self) -> dict:
        """Compile seconds per optimizer step and phase: ``{step: {"dynamo", "aot_autograd",
        "passes", "inductor", "profiling", "planner", "reuse": s}}`` (phases that took no time are
        absent). ``reuse``: copying the kept warm-up graphs for trace once; ``aot_autograd``: the
        trace and partition, Inductor's graph-level front end included."""
        return {s: dict(d) for s, d in sorted(self.dc_backend.phases.items())}

    @property
    def dc_trace_once(self) -> list:
        """One entry per scheduled re-compile: ``{"step", "reused": True, "graphs", ...}`` or
        ``{"step", "reused": False, "why"}`` (it re-traced)."""
        return list(self.dc_backend.trace_once_log)


class _StepTimer:
    """Milliseconds from construction to ``stop()``: CUDA events on the current stream (the
    kernels' time, as the profiler's node latencies are), wall time on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.peak_bytes = 0  # CUDA: the allocator's peak between construction and stop()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return (time.perf_counter() - self.t0) * 1e3
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        self.peak_bytes = int(torch.cuda.max_memory_allocated())
        return float(self.start.elapsed_time(end))


def _resolve_group(group, timeout_s: float = 600.0):
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    missing = [v for v in _LAUNCHER_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(
            "deepcompile.initialize: no torch.distributed process group exists and the launcher "
            f"environment is incomplete (missing {', '.join(missing)}). Launch with torchrun "
            "(torchrun --nproc-per-node=2 train.py), or call torch.distributed.init_process_group(...) "
            "before deepcompile.initialize, or pass group=..."
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    import datetime

    # collective_timeout_s bounds every collective of the group, not only the runtime's waits
    # (NCCL's watchdog aborts on it; gloo fails the collective)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.group.WORLD


def _hybrid_groups(group, shard: int | None, timeout_s: float):
    """(shard group, replicate group or None) for ``mesh.shard`` (HSDP). Ranks ``[k*S, (k+1)*S)``
    of ``group`` shard the model (a node, when torchrun numbers ranks node by node); ranks with the
    same position in their shard group replicate each other. Every rank creates every group, in the
    same order, as ``new_group`` requires."""
    import datetime

    world = dist.get_world_size(group)
    if shard is None or shard == world:
        return group, None
    if world % shard:
        raise ValueError(f"deepcompile.initialize: config mesh.shard = {shard} does not divide the world size "
                         f"{world}; use a divisor of {world} (e.g. the GPUs per node) or leave it out")
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    timeout = datetime.timedelta(seconds=timeout_s)
    shard_group = replicate_group = None
    for k in range(world // shard):
        members = ranks[k * shard:(k + 1) * shard]
        g = dist.new_group(members, timeout=timeout)
        if me in members:
            shard_group = g
    for j in range(shard):
        members = ranks[j::shard]
        g = dist.new_group(members, timeout=timeout)
        if me in members:
            replicate_group = g
    return shard_group, replicate_group


def _device_for(group) -> torch.device:
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wrap_optimizer(opt: torch.optim.Optimizer, accumulation: int, sync_only_at_boundary: bool = False
                    ) -> torch.optim.Optimizer:
    """Plain loop, accumulated: ``step()`` / ``zero_grad()`` only act every N-th micro-batch.

    The user's optimizer object is kept (LR schedulers and isinstance checks still work);
    only its bound ``step`` and ``zero_grad`` are wrapped on the instance.
    """
    if accumulation == 1:
        opt.dc_next_is_boundary = lambda: True
        return opt
    inner_step, inner_zero = opt.step, opt.zero_grad
    state = {"micro": 0, "stepped": False}

    def next_is_boundary() -> bool:
        """The backward running next ends an accumulation window (the next step() really steps)."""
        return (state["micro"] + 1) % accumulation == 0

    def set_sync():
        # ZeRO-1: the next backward communicates only if it ends an accumulation window
        if sync_only_at_boundary:
            ops.C.set_grad_sync(next_is_boundary())

    set_sync()

    def step(_opt, *args, **kwargs):
        state["micro"] += 1
        set_sync()
        if state["micro"] % accumulation == 0:
            state["stepped"] = True
            return inner_step(*args, **kwargs)
        return None

    def zero_grad(set_to_none: bool = True):
        if state["stepped"]:
            state["stepped"] = False
            inner_zero(set_to_none=set_to_none)

    # a bound method, as torch's own: LRScheduler re-wraps ``optimizer.step`` through its ``__func__``
    # (torch/optim/lr_scheduler.py, 2.11 and 2.13); a plain function made every scheduler fail
    opt.step, opt.zero_grad = types.MethodType(step, opt), zero_grad
    opt.dc_micro_steps = lambda: state["micro"]
    opt.dc_next_is_boundary = next_is_boundary
    return opt


def initialize(model: nn.Module, make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
               config: Config | dict | str | os.PathLike | None = None, *, group=None):
    """Shard ``model`` for the configured ZeRO stage and compile it with the deepcompile backend.

    Every stage keeps this rank's flat shard as the optimizer's parameter. Stage 3 gathers
    parameters around their uses; stages 1 and 2 keep them whole between optimizer steps.

    Returns ``(model, optimizer)`` that work in a plain loop:
    ``loss = model(x); loss.backward(); optimizer.step(); optimizer.zero_grad()``.
    """
    cfg = Config.load(config)  # validate before touching anything
    if dynamo_compat.is_compiled_module(model):
        raise TypeError(
            "deepcompile.initialize: the model is already compiled with torch.compile; pass the "
            "original module (compiled_model._orig_mod) and let deepcompile compile it.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"deepcompile.initialize: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, DeepCompileModel):
        raise TypeError("deepcompile.initialize: this model is already initialized by deepcompile")
    _reject_wrapped(model)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "deepcompile.initialize: the model has no trainable parameters (every requires_grad is False, "
            f"{sum(1 for _ in model.parameters())} parameters); deepcompile shards training state, so "
            "unfreeze the parameters to train (p.requires_grad_(True)) or run the model without deepcompile")
    from torch.nn.utils import parametrize
    if any(parametrize.is_parametrized(m) for m in model.modules()):
        raise TypeError("deepcompile.initialize: the model already has parametrizations (was it "
                        "initialized by deepcompile before?); pass a fresh module")
    if not callable(make_optimizer):
        raise TypeError("deepcompile.initialize: make_optimizer must be a callable taking the "
                        "parameters and returning a torch.optim.Optimizer, e.g. "
                        "lambda ps: torch.optim.AdamW(ps, lr=1e-3)")
    group = _resolve_group(group, cfg.collective_timeout_s)
    device = _device_for(group)
    by_block = blocks.resolve(cfg, device.type)  # the final graphs cut into block regions, or whole
    world = dist.get_world_size(group)
    shard_group, replicate_group = _hybrid_groups(group, cfg.mesh.shard, cfg.collective_timeout_s)

    C = ops.ensure_registered()
    if C.is_initialized():
        warnings.warn("deepcompile.initialize called again in this process: the previous model's "
                      "runtime state and compiled graphs are dropped", stacklevel=2)
        dynamo_compat.reset_dynamo()
    ops.PARAMS.clear()
    C.init(shard_group, cfg.reduce_bucket_size, cfg.max_inflight_reduces,
           max(1, int(cfg.collective_timeout_s * 1000)))
    C.set_reduce_pack(cfg.reduce_pack)
    C.set_cast_stream(cfg.cast_stream)
    seqcheck.clear_nodes()
    try:
        state_keys = list(model.state_dict().keys())
        model.to(device)
        if replicate_group is not None:
            C.set_replicate_group(replicate_group)
        sharded = shard_module(model, group=shard_group, device=device,
                               gather_dtype=cfg.mixed_precision.torch_param_dtype())
        if cfg.trace_blocks:
            nested.wrap(model)  # each distinct block traced once (nested.py)
        C.set_grad_scale(1.0 / (world * cfg.gradient_accumulation_steps))
        C.set_reduce_dtype(cfg.mixed_precision.torch_reduce_dtype())
        # the backward calls the runtime once per reduce bucket (passes/zero3.group_reduces)
        ops.REDUCE_LAYOUT = ops.ReduceLayout(
            cfg.reduce_bucket_size, cfg.mixed_precision.torch_reduce_dtype(),
            copies_each=cfg.zero_stage == 1 and cfg.gradient_accumulation_steps > 1,
            by_block=by_block is not None)
    except Exception:
        C.cleanup()
        ops.PARAMS.clear()
        raise
    # the passes size gathers by the shard group (chunk x its ranks)
    backend = Backend(cfg, dict(ops.PARAMS), dist.get_world_size(shard_group), dist.get_rank(shard_group),
                      blocks=by_block)
    wrapped = DeepCompileModel(model, sharded, backend, cfg, group, state_keys)
    object.__setattr__(wrapped, "dc_shard_group", shard_group)  # == group unless mesh.shard (HSDP)
    object.__setattr__(wrapped, "dc_replicate_group", replicate_group)  # None unless mesh.shard
    object.__setattr__(wrapped, "dc_seqcheck", seqcheck.SequenceCheck.create(group, cfg.collective_timeout_s))
    backend.graph_check = graphcheck.GraphCheck.create(wrapped.dc_seqcheck)  # compiled graphs agree across ranks
    from deepcompile.plan.cache import PlanCache

    backend.plan_cache = PlanCache.create(wrapped)  # a re-run of this job reuses its plan (config plan_cache)
    for sp in sharded:
        # who owns a shard: deepcompile.clip_grad_norm_ (and torch's, routed there) finds the
        # model's group and accumulation window from the parameters alone
        sp.shard._dc_owner = weakref.ref(wrapped)
    trainable = [sp.shard for sp in sharded if sp.shard.requires_grad]
    opt = make_optimizer(trainable)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"deepcompile.initialize: make_optimizer returned {type(opt).__name__}, "
                        "expected a torch.optim.Optimizer")
    opt.register_step_pre_hook(wrapped._dc_before_optimizer_step)
    opt.register_step_post_hook(wrapped._dc_on_optimizer_step)  # real steps only (not accumulation)
    # the step's param groups in chunks (config optimizer_chunk_mb; 'auto': the planner sets it):
    # bounds the foreach optimizers' group-sized temporaries; user-visible groups unchanged
    object.__setattr__(wrapped, "dc_optim_chunks", optim_chunks.install(opt, cfg.optimizer_chunk_mb))
    opt = _wrap_optimizer(opt, cfg.gradient_accumulation_steps, cfg.zero_stage == 1)
    optimizer_state.MANAGER.attach(opt, opt.dc_next_is_boundary)  # idle unless offload_optimizer plans
    object.__setattr__(wrapped, "dc_next_is_boundary", opt.dc_next_is_boundary)
    global _CURRENT
    _CURRENT = weakref.ref(wrapped)
    from deepcompile.profile.profiler import track_memory

    track_memory(wrapped)  # the profiling step splits its memory by category (held weakly)
    clip.route_clip_grad_norm()
    return wrapped, opt


_CURRENT = None  # the model the runtime serves now (one per process)


def _reject_wrapped(model: nn.Module) -> None:
    """DDP, FSDP1, FSDP2 and DTensor parameters already own communication and sharding: wrapped
    again they train to wrong losses or fail deep inside torch. Say what to pass instead."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, DataParallel)):
        raise TypeError(f"deepcompile.initialize: the model is wrapped in {type(model).__name__}; pass "
                        "the unwrapped module (model.module): deepcompile does the data parallelism itself")
    for name, m in model.named_modules():
        where = f"submodule '{name}'" if name else "the model"
        kind = c10d_compat.fsdp_wrapper_kind(m)
        if kind is not None:
            raise TypeError(f"deepcompile.initialize: {where} is wrapped by {kind}; pass the original, "
                            "unwrapped module (build it again without FSDP): deepcompile shards it itself")
        if isinstance(m, (DistributedDataParallel, DataParallel)):
            raise TypeError(f"deepcompile.initialize: {where} is wrapped in {type(m).__name__}; pass the "
                            "unwrapped module: deepcompile does the data parallelism itself")
    for name, p in model.named_parameters():
        if c10d_compat.is_dtensor(p):
            raise TypeError(f"deepcompile.initialize: parameter '{name}' is a DTensor (sharded by FSDP2 or "
                            "tensor parallelism); pass a module with ordinary parameters: deepcompile shards "
                            "them itself")


def _params_by_name(model: DeepCompileModel) -> dict[str, ShardedParam]:
    """Each parameter's state-dict key -> its ShardedParam (tied parameters: every name)."""
    return {n: sp for sp in model.dc_sharded for n in sp.names}


def _gather_full(sp: ShardedParam, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    shard = sp.shard.detach()
    out = torch.empty(sp.meta.chunk * world, dtype=shard.dtype, device=shard.device)
    c10d_compat.all_gather_single(out, shard.contiguous().view(-1), group)
    return out[: sp.meta.numel].view(sp.meta.shape)


def full_state_dict(model: DeepCompileModel) -> dict[str, torch.Tensor]:
    """Gathered parameters and buffers on CPU, keyed like the original model's ``state_dict()``.

    Collective: every rank must call it.
    """
    if not isinstance(model, DeepCompileModel):
        raise TypeError("deepcompile.full_state_dict expects the model returned by deepcompile.initialize")
    by_name = _params_by_name(model)
    gathered: dict[int, torch.Tensor] = {}
    out = {}
    with torch.no_grad():
        for key in model.dc_state_keys:
            sp = by_name.get(key)
            if sp is not None:
                if sp.meta.id not in gathered:
                    gathered[sp.meta.id] = _gather_full(sp, model.dc_shard_group).cpu().clone()
                out[key] = gathered[sp.meta.id]
            else:
                out[key] = model.module.get_buffer(key).detach().cpu().clone()
    return out


def load_full_state_dict(model: DeepCompileModel, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict into this rank's shards and the buffers."""
    if not isinstance(model, DeepCompileModel):
        raise TypeError("deepcompile.load_full_state_dict expects the model returned by deepcompile.initialize")
    from collections.abc import Mapping

    if not isinstance(state_dict, Mapping):
        raise TypeError(f"deepcompile.load_full_state_dict: state_dict must be a mapping of names to tensors, "
                        f"got {type(state_dict).__name__}")
    bad = _state_key_mismatch(model, state_dict)
    if bad:
        raise KeyError(f"deepcompile.load_full_state_dict: {bad}")
    by_name = _params_by_name(model)
    world, rank = dist.get_world_size(model.dc_shard_group), dist.get_rank(model.dc_shard_group)
    for key in model.dc_state_keys:  # check everything before writing anything
        sp = by_name.get(key)
        if sp is not None:
            _check_loadable(key, state_dict[key], tuple(sp.meta.shape), sp.meta.dtype)
        else:
            buf = model.module.get_buffer(key)
            _check_loadable(key, state_dict[key], tuple(buf.shape), buf.dtype)
    with torch.no_grad():
        for key in model.dc_state_keys:
            sp = by_name.get(key)
            v = state_dict[key]
            if sp is not None:
                if key == sp.names[0] or sp.names[0] not in state_dict:
                    sp.shard.copy_(shard_tensor(v.to(sp.shard.device, sp.shard.dtype), world, rank))
            else:
                model.module.get_buffer(key).copy_(v)
    ops.C.invalidate_persistent()  # kept gathered copies hold the old values


def _dtype_kind(dt: torch.dtype) -> str:
    if dt == torch.bool:
        return "bool"
    if dt.is_complex:
        return "complex"
    return "float" if dt.is_floating_point else "integer"


def _state_key_mismatch(model: DeepCompileModel, state_dict) -> str:
    """'' when ``state_dict`` has exactly the model's state keys, else what is missing and unexpected
    (the first five of each, with counts). load_full_state_dict and checkpoint.load_state_dict share it."""
    keys = set(model.dc_state_keys)
    missing, unexpected = sorted(keys - set(state_dict)), sorted(set(state_dict) - keys)
    if not (missing or unexpected):
        return ""
    return (f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]} "
            f"({len(missing)} missing, {len(unexpected)} unexpected)")


def _check_loadable(key: str, v, shape: tuple, dtype: torch.dtype) -> None:
    """A value ``load_full_state_dict`` can write into a tensor of ``shape`` and ``dtype``, or a
    ValueError/TypeError naming the key: nothing is written before every key has passed."""
    where = f"deepcompile.load_full_state_dict: '{key}'"
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{where} is a {type(v).__name__}, expected a tensor")
    if v.device.type == "meta":
        raise ValueError(f"{where} is a meta tensor (no data); load real values, e.g. from "
                         "deepcompile.full_state_dict or torch.load")
    if v.layout != torch.strided:
        raise ValueError(f"{where} has layout {v.layout}; convert it with .to_dense()")
    if tuple(v.shape) != shape:
        raise ValueError(f"{where} has shape {list(v.shape)}, the model expects {list(shape)}")
    if _dtype_kind(v.dtype) != _dtype_kind(dtype):
        raise TypeError(f"{where} is {v.dtype}, the model's is {dtype}: a {_dtype_kind(v.dtype)} value would "
                        f"be cast to {_dtype_kind(dtype)} silently; convert it explicitly (v.to({dtype})) if "
                        "that is what you mean")


def destroy(model: DeepCompileModel) -> None:
    """Free everything ``initialize`` built for ``model``: compiled graphs, the runtime (its
    registry and buckets) and the shards. Needed to run a second model in the same process
    without the first one's memory: Dynamo keeps compiled graphs (and through them the
    parameters) alive until they are dropped explicitly."""
    if not isinstance(model, DeepCompileModel):
        raise TypeError("deepcompile.destroy expects the model returned by deepcompile.initialize")
    global _CURRENT
    current = _CURRENT() if _CURRENT is not None else None
    if current is model or current is None:
        dynamo_compat.reset_dynamo(model.module)
        optimizer_state.MANAGER.detach()
        ENGINE.release_buffers()
        C = ops.ensure_registered()
        C.cleanup()
        ops.PARAMS.clear()
        _CURRENT = None
    # else: a model initialised before the current one. The runtime, the compiled graphs and
    # the optimizer-state manager serve the current model now: free only this model's shards.
    for sp in model.dc_sharded:
        sp.shard.grad = None
        sp.shard.data = torch.empty(0, dtype=sp.shard.dtype, device=sp.shard.device)
    object.__setattr__(model, "_dc_compiled", None)
    # Drop the model's process groups: while it holds them, the user's destroy_process_group()
    # cannot destroy the groups, so gloo's worker threads live on into interpreter finalization,
    # where one freeing a finished collective's tensors (it needs the GIL) aborts the process
    # ("terminate called without an active exception", seen once in CI under torchrun).
    for name in ("dc_group", "dc_shard_group", "dc_replicate_group", "dc_seqcheck"):
        object.__setattr__(model, name, None)
