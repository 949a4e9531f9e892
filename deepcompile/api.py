"""The public API: initialize, full_state_dict, load_full_state_dict, destroy, and the model
wrapper they act on (:class:`DeepCompileModel`, its state in one :class:`ModelState`)."""
from __future__ import annotations

import os
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

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
from deepcompile.params import ConfigError
from deepcompile.profile.profiler import StepTimer
from deepcompile.runtime import graphcheck, groups, ops, optim_chunks, optim_fused, seqcheck, state
from deepcompile.runtime.accumulation import wrap_for_accumulation
from deepcompile.runtime.state import RuntimeState
from deepcompile.sharding import ShardedParam, shard_module, shard_tensor

# a step that compiled for less than this prints nothing (config ``progress``)
PROGRESS_MIN_S = 1.0


def _rank0() -> bool:
    """Whether this process speaks for the job: rank 0 of the default process group, or the only
    process. A warning every rank raises alike (the same model, config and agreed plan) is
    printed by rank 0 alone, once per run, not once per rank."""
    return not (dist.is_initialized() and dist.get_rank() != 0)


@dataclass
class ModelState:
    """What deepcompile keeps about one wrapped model (``model.dc_state``): built by
    ``initialize``, read by the wrapper, the planner, the plan cache, clipping and checkpoints."""
    sharded: list[ShardedParam]     # this rank's shards, in registration order
    backend: Backend
    config: Config
    group: Any                      # the job's process group
    shard_group: Any                # the group the shards are split over (== group unless mesh.shard: HSDP)
    replicate_group: Any            # the replicas' group under mesh.shard, else None
    state_keys: list[str]           # the user model's state_dict() keys, in order
    runtime: RuntimeState           # the process's runtime state this model was initialised with
    compiled: Callable | None       # the module compiled with the backend (None after destroy)
    passes: list                    # the pass list the compiled graphs were built with
    # the last step whose forward compiles: the last scheduled re-compile (a later one, e.g. for
    # new input shapes, pauses the collector in the backend's own compile calls only)
    last_compile_step: int
    step: int = 0                   # optimizer steps taken
    dynamic: DynamicDims = field(default_factory=DynamicDims)  # input dims that vary, agreed across ranks
    plan: dict | None = None        # the planner's choice and why (deepcompile.plan.planner)
    seqcheck: seqcheck.SequenceCheck | None = None  # per-step collective count check
    optim_chunks: Any = None        # runtime.optim_chunks' chunked step (None: not chunked)
    # the chunk (MiB) the steps before the plan stream the optimizer state through, where all of it
    # on the device would pass memory_limit_gib (plan.device_memory.warmup_streams); None: resident
    warmup_stream_mb: float | None = None
    optim_fused: list = field(default_factory=list)  # param groups runtime.optim_fused set to fused=True
    # whether the backward running next ends an accumulation window (runtime.accumulation)
    next_is_boundary: Callable[[], bool] = lambda: True
    gc_paused: bool = False         # the collector paused while compiling (forward)
    forward_step: int = -1          # the step of the last forward
    forwards_in_step: int = 0       # and how many forwards that step ran
    profile_t0: float | None = None  # the profiling step's start (perf_counter), until it is agreed
    opt_timer: StepTimer | None = None  # the profiling step's optimizer.step() timer
    blocks_seen: int = 0            # block-region compiles already reported (runtime.block_compiles)
    ckpt_mesh: dict = field(default_factory=dict)   # device type -> the mesh checkpoints wrap shards on (deepcompile.checkpoint)


class DeepCompileModel(nn.Module):
    """The user's module, sharded, with its forward compiled by the deepcompile backend.

    ``parameters()`` yields this rank's shards, exactly the tensors the optimizer updates. Its
    state is one :class:`ModelState`, ``dc_state``. ``dc_backend``, ``dc_config`` and ``dc_plan``
    stay read-only properties over it because the README, the notebooks and the architecture
    notes tell users to read them (``RunRecorder(..., model.dc_config)``,
    ``model.dc_backend.observers``, ``model.dc_plan["cache"]``).
    """

    def __init__(self, module: nn.Module, st: ModelState):
        super().__init__()
        self.module = module
        self.dc_state = st

    @property
    def dc_backend(self) -> Backend:
        return self.dc_state.backend

    @property
    def dc_config(self) -> Config:
        return self.dc_state.config

    @property
    def dc_plan(self) -> dict | None:
        """The planner's choice and why (None before it ran)."""
        return self.dc_state.plan

    def forward(self, *args, **kwargs):
        # The collector waits from a compiling step's first forward to its optimizer step
        # (backend.paused_gc says why; _dc_on_optimizer_step ends the pause), or to a forward
        # past the step's micro-batches that compiled nothing: a loop without optimizer steps
        # (evaluation) must not run with it off
        step = self.dc_state.step
        if step > self.dc_state.last_compile_step and not self.dc_state.gc_paused:
            return self._dc_forward(*args, **kwargs)  # training at speed: nothing to decide
        frames = dynamo_compat.dynamo_frames_compiled()
        seen = self.dc_state.forwards_in_step + 1 if step == self.dc_state.forward_step else 1
        if seen == 1 and not self.dc_state.gc_paused:  # (a step's later forwards never pause again)
            paused_gc.pause()
            self.dc_state.gc_paused = True
        try:
            out = self._dc_forward(*args, **kwargs)
        except BaseException:
            self._dc_resume_gc(collect=False)
            raise
        if self.dc_state.gc_paused and seen > self.dc_config.gradient_accumulation_steps \
                and dynamo_compat.dynamo_frames_compiled() == frames:
            self._dc_resume_gc(collect=True)
        self.dc_state.forward_step = step
        self.dc_state.forwards_in_step = seen
        return out

    def _dc_resume_gc(self, collect: bool, freeze: bool = False) -> None:
        if self.dc_state.gc_paused:
            self.dc_state.gc_paused = False
            paused_gc.resume(collect, freeze)

    def _dc_forward(self, *args, **kwargs):
        passes = self.dc_config.passes_at(self.dc_state.step)
        profiling = self.dc_state.step == self.dc_config.profile_step
        if self.dc_backend.plan_cache is not None and self.dc_backend.plan_cache.hit:
            passes, profiling = self.dc_state.passes, False  # the stored plan, compiled at step 0 (plan.cache)
        if passes is not self.dc_state.passes or profiling != self.dc_backend.profiling:
            # dims that became dynamic: the graphs compiled so far may be static on some ranks and
            # symbolic on others; the profiling step must profile one graph every rank shares
            fresh = self.dc_state.dynamic.take_changed()
            if not (profiling and passes is self.dc_state.passes and not fresh and self.dc_backend.profile_in_place()):
                self._recompile(passes, profiling, dynamic_changed=bool(fresh))
            if profiling:  # the profiling step's cost, end to end (until _finish_profile)
                self.dc_state.profile_t0 = time.perf_counter()
        self.dc_state.dynamic.observe(args, kwargs)
        # the runtime names the graph node of a collective timeout by phase: forward while the
        # compiled forward runs, backward after it (two pybind calls per forward)
        ops.C.set_phase(0)
        b = self.dc_backend
        dyn0, call0 = dynamo_compat.dynamo_compile_seconds(), b.call_seconds
        graphs = b.next_graph_id
        try:
            try:
                return self.dc_state.compiled(*args, **kwargs)
            except Exception as e:
                if not (dynamo_compat.is_dynamo_error(e) and b.next_graph_id == graphs and nested.is_wrapped(self.module)):
                    raise
                self._dc_trace_flat(e)
                return self.dc_state.compiled(*args, **kwargs)
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
        self.dc_state.compiled = torch.compile(self.module, backend=self.dc_backend)

    def _recompile(self, passes, profiling: bool = False, dynamic_changed: bool = False) -> None:
        self.dc_state.runtime.optimizer_state.plan(0)  # the new pass list decides again (nothing, without offload_optimizer)
        planned = passes
        if not profiling and self.dc_config.plan and self.dc_backend.profile is not None:
            from deepcompile.plan.planner import plan_model

            planned = plan_model(self, passes)  # budgets from the profile and the memory limit
            self.dc_backend.add_phase("planner", (self.dc_plan or {}).get("seconds", 0.0), self.dc_state.step)
            if self.dc_backend.plan_cache is not None:  # for the next run of this job (plan.cache)
                self.dc_backend.plan_cache.store(self, planned, dynamic_changed)
        if not profiling:
            # trace once: the new passes and the final compiler on the warm-up's partitioned graphs,
            # swapped in under the guarded code Dynamo already has (backend.retarget)
            why = self.dc_backend.retarget(planned, self.dc_state.step, dynamic_changed)
            if why is None:
                self.dc_state.passes = passes
                return
            if self.dc_backend.trace_once and _rank0():
                warnings.warn(f"deepcompile: step {self.dc_state.step} re-traces the model (Dynamo + AOTAutograd) "
                              f"instead of reusing the warm-up trace: {why}", stacklevel=3)
        # Drop every compiled graph before compiling the new pass list: the old graphs (and
        # the memory their code objects pin) must not survive the switch.
        dynamo_compat.reset_dynamo(self.module)
        self.dc_backend.use_passes(planned, self.dc_state.step, profiling)
        self.dc_state.passes = passes
        self.dc_state.compiled = torch.compile(self.module, backend=self.dc_backend)

    @property
    def dc_profile(self):
        """The agreed profile of the profiling step (None before it has run)."""
        return self.dc_backend.profile

    def _dc_before_optimizer_step(self, *_args) -> None:
        # every rank issued the same collectives this step, or all stop here naming the rank behind
        if self.dc_state.seqcheck is not None:
            self.dc_state.seqcheck.check()
        # The step changes the shards, so kept gathered copies go stale; they are dropped before
        # the step, not after it: the step does not read them and would otherwise carry them at
        # its peak (the planner's memory model counts on this).
        ops.C.invalidate_persistent()
        # the profiling step times optimizer.step() too (and its peak memory): the cost model
        # predicts whole steps
        if self.dc_backend.profiling and self.dc_backend.measured:
            self.dc_state.opt_timer = StepTimer(self._dc_device())

    def _dc_on_optimizer_step(self, *_args) -> None:
        if self.dc_backend.profiling and self.dc_backend.measured:
            self._finish_profile()
        self._dc_progress()
        self.dc_backend.end_step()
        self.dc_state.dynamic.at_step_end(self.dc_config, self.dc_state.step, self.dc_state.group)  # collective before a re-compile
        self.dc_state.step = self.dc_state.step + 1
        # the compiling steps' collector: back on between them (the compile's heap frozen), and
        # one full collection after the last (backend.paused_gc)
        if self.dc_state.step > self.dc_state.last_compile_step:
            self._dc_resume_gc(collect=True)
        else:
            self._dc_resume_gc(collect=False, freeze=True)

    def _dc_progress(self) -> None:
        """One line on rank 0 for each step that spent a second or more compiling, profiling or
        planning (config ``progress``): the first fast step comes after tens of seconds of
        tracing, profiling, planning and Inductor; the user sees which, how long, and when it ends."""
        if not self.dc_config.progress or (dist.is_initialized() and dist.get_rank() != 0):
            return
        phases = self.dc_backend.phases.get(self.dc_state.step) or {}
        total = sum(phases.values())
        # the graphs this step compiled as block regions (config blocks)
        done = self.dc_state.runtime.block_compiles
        cut = done[self.dc_state.blocks_seen:]
        self.dc_state.blocks_seen = len(done)
        if total <= 0 or total < PROGRESS_MIN_S:   # (<= 0: nothing ran, even with a threshold of 0)
            return
        parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]) if v >= 0.05)
        line = f"deepcompile: step {self.dc_state.step}: {total:.1f} s of one-time work ({parts})"
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
        elif plan.get("step") == self.dc_state.step and plan.get("summary"):
            line += f"; {plan['summary']}"
        if hit and self.dc_backend.aot_cache_hits:
            line += "; graphs from AOTAutograd's cache (aot_cache: no trace, no passes)"
        later = [] if hit else [e.step for e in self.dc_config.schedule if e.step > self.dc_state.step]
        line += (f"; compiles again at step {min(later)}" if later
                 else "; the final graphs run from the next step")
        print(line, file=sys.stderr, flush=True)

    def _finish_profile(self) -> None:
        from deepcompile.profile.agree import agree
        from deepcompile.profile.comm_bench import benchmark_allreduce, benchmark_comm
        from deepcompile.profile.memory_split import take_memory_timeline
        from deepcompile.profile.profiler import GraphProfile, Profile, take_host_ops

        b = self.dc_backend
        prof = Profile(graphs={k: GraphProfile(k[0], k[1], v) for k, v in sorted(b.measured.items())},
                       hardware=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       step=self.dc_state.step)
        timer, self.dc_state.opt_timer = self.dc_state.opt_timer, None
        prof.optimizer_ms = timer.stop() if timer is not None else 0.0
        prof.optimizer_peak_bytes = timer.peak_bytes if timer is not None else 0
        mgr = self.dc_state.runtime.optimizer_state
        if mgr.streamed:   # (the steps before the plan stream it where it does not fit: initialize)
            prof.state_streamed_bytes = mgr.total_bytes()
        # this rank's memory timeline of the step, by category (the record's memory.json.gz)
        prof.memory = take_memory_timeline(b.compiled, self.dc_state.step, prof.optimizer_ms, prof.optimizer_peak_bytes)
        # the gathers the passes schedule run in the shard group (all ranks but under mesh.shard)
        prof.comm = benchmark_comm(self.dc_state.shard_group, self._dc_device())
        if self._dc_device().type == "cuda":
            # the host's pace: the host model (plan.estimate.host_model) follows the machine
            from deepcompile.profile.host import host_benchmark

            prof.host = host_benchmark(self._dc_device())
            prof.host["ops_us"] = take_host_ops()   # each dc op's own host time in the profiling step
            from deepcompile.profile import sustained

            # the heaviest matmul's busy-step clock against the profiled one (agree scales by it)
            prof.sustained = sustained.measure(dict(b.compiled), b.measured, self._dc_device())
        rep = self.dc_state.replicate_group
        if rep is not None:  # HSDP: the gradient all-reduce across replicas has its own link
            from deepcompile.vocab.links import ReplicateLink

            prof.replicate = ReplicateLink(benchmark_allreduce(rep, self._dc_device()),
                                           dist.get_world_size(self.dc_state.shard_group))
        b.profile = agree(prof, self.dc_state.group)
        b.measured = {}
        t0, self.dc_state.profile_t0 = self.dc_state.profile_t0, None
        if t0 is not None:
            b.add_phase("profiling", time.perf_counter() - t0, self.dc_state.step)

    def _dc_device(self) -> torch.device:
        return next(iter(self.dc_state.sharded)).shard.device if self.dc_state.sharded else torch.device("cpu")

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
    group = groups.resolve_group(group, cfg.collective_timeout_s)
    device = groups.device_for(group)
    by_block = blocks.resolve(cfg, device.type)  # the final graphs cut into block regions, or whole
    world = dist.get_world_size(group)
    shard_group, replicate_group = groups.hybrid_groups(group, cfg.mesh.shard, cfg.collective_timeout_s)
    from deepcompile.plan.device_memory import check_floor, step_bytes, warmup_streams

    streamable = cfg.optimizer_chunk_mb == "auto" or float(cfg.optimizer_chunk_mb) > 0   # runtime.optim_chunks cuts it
    floor = step_bytes(model, dist.get_world_size(shard_group), make_optimizer) if cfg.memory_limit_gib else None
    check_floor(cfg.memory_limit_gib, floor, dist.get_world_size(shard_group), streamable)  # model untouched yet

    C = ops.ensure_registered()
    if C.is_initialized():
        warnings.warn("deepcompile.initialize called again in this process: the previous model's "
                      "runtime state and compiled graphs are dropped", stacklevel=2)
        dynamo_compat.reset_dynamo()
    rt = state.install(RuntimeState())  # the previous model's runtime state (if any) is closed
    C.init(shard_group, cfg.reduce_bucket_size, cfg.max_inflight_reduces,
           max(1, int(cfg.collective_timeout_s * 1000)))
    C.set_reduce_pack(cfg.reduce_pack)
    C.set_cast_stream(cfg.cast_stream)
    try:
        state_keys = list(model.state_dict().keys())
        model.to(device)
        if replicate_group is not None:
            C.set_replicate_group(replicate_group)
        sharded = shard_module(model, group=shard_group, device=device,
                               gather_dtype=cfg.mixed_precision.torch_param_dtype(), registry=rt.params)
        if cfg.trace_blocks:
            nested.wrap(model)  # each distinct block traced once (nested.py)
        C.set_grad_scale(1.0 / (world * cfg.gradient_accumulation_steps))
        C.set_reduce_dtype(cfg.mixed_precision.torch_reduce_dtype())
        # the backward calls the runtime once per reduce bucket (passes/zero3.group_reduces)
        rt.reduce_layout = state.ReduceLayout(
            cfg.reduce_bucket_size, cfg.mixed_precision.torch_reduce_dtype(),
            copies_each=cfg.zero_stage == 1 and cfg.gradient_accumulation_steps > 1,
            by_block=by_block is not None)
    except Exception:
        C.cleanup()
        state.drop()
        raise
    # the passes size gathers by the shard group (chunk x its ranks)
    backend = Backend(cfg, dict(rt.params), dist.get_world_size(shard_group), dist.get_rank(shard_group),
                      blocks=by_block)
    backend.runtime = rt  # handed to the passes in their context (PassContext.runtime)
    st = ModelState(sharded=sharded, backend=backend, config=cfg, group=group, shard_group=shard_group,
                    replicate_group=replicate_group, state_keys=state_keys, runtime=rt,
                    compiled=torch.compile(model, backend=backend), passes=cfg.passes,
                    last_compile_step=max([0, cfg.profile_step or 0] + [e.step for e in cfg.schedule]),
                    seqcheck=seqcheck.SequenceCheck.create(group, cfg.collective_timeout_s))
    wrapped = DeepCompileModel(model, st)
    rt.model = weakref.ref(wrapped)
    backend.graph_check = graphcheck.GraphCheck.create(st.seqcheck)  # compiled graphs agree across ranks
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
    try:   # torch's fused kernel over the shards where the user left the choice (config optimizer_fused)
        st.optim_fused = optim_fused.install(opt, cfg.optimizer_fused)
    except ValueError as e:
        raise ConfigError(f"config.{e}") from None
    opt.register_step_pre_hook(wrapped._dc_before_optimizer_step)
    opt.register_step_post_hook(wrapped._dc_on_optimizer_step)  # real steps only (not accumulation)
    # the step's param groups in chunks (config optimizer_chunk_mb; 'auto': the planner sets it):
    # bounds the foreach optimizers' group-sized temporaries; user-visible groups unchanged
    st.optim_chunks = optim_chunks.install(opt, cfg.optimizer_chunk_mb)
    opt = wrap_for_accumulation(opt, cfg.gradient_accumulation_steps, cfg.zero_stage == 1)
    rt.optimizer_state.attach(opt, opt.dc_next_is_boundary)  # idle unless offload_optimizer plans
    if st.optim_chunks is not None and warmup_streams(cfg.memory_limit_gib, floor, streamable):
        # Adam creates all its state in the first step, before any plan: stream it from the start
        from deepcompile.plan.memory import STREAM_CHUNK_MB

        st.warmup_stream_mb = STREAM_CHUNK_MB if cfg.optimizer_chunk_mb == "auto" else float(cfg.optimizer_chunk_mb)
        st.optim_chunks.set_chunk_mb(st.warmup_stream_mb)
        rt.optimizer_state.plan(None, streamed=True)
    st.next_is_boundary = opt.dc_next_is_boundary
    from deepcompile.profile.memory_split import track_memory

    track_memory(rt, wrapped)  # the profiling step splits its memory by category (held weakly)
    clip.route_clip_grad_norm()
    return wrapped, opt



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
    return {n: sp for sp in model.dc_state.sharded for n in sp.names}


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
        for key in model.dc_state.state_keys:
            sp = by_name.get(key)
            if sp is not None:
                if sp.meta.id not in gathered:
                    gathered[sp.meta.id] = _gather_full(sp, model.dc_state.shard_group).cpu().clone()
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
    world, rank = dist.get_world_size(model.dc_state.shard_group), dist.get_rank(model.dc_state.shard_group)
    for key in model.dc_state.state_keys:  # check everything before writing anything
        sp = by_name.get(key)
        if sp is not None:
            _check_loadable(key, state_dict[key], tuple(sp.meta.shape), sp.meta.dtype)
        else:
            buf = model.module.get_buffer(key)
            _check_loadable(key, state_dict[key], tuple(buf.shape), buf.dtype)
    with torch.no_grad():
        for key in model.dc_state.state_keys:
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
    keys = set(model.dc_state.state_keys)
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
    st = model.dc_state
    if not state.active() or state.current() is st.runtime:
        dynamo_compat.reset_dynamo(model.module)
        state.drop()  # the optimizer's hooks, offloaded state and pinned buffers, the registry
        ops.ensure_registered().cleanup()
    # else: a model initialised before the current one. The runtime, the compiled graphs and
    # its state serve the current model now: free only this model's shards.
    for sp in st.sharded:
        sp.shard.grad = None
        sp.shard.data = torch.empty(0, dtype=sp.shard.dtype, device=sp.shard.device)
    st.compiled = None
    # Drop the model's process groups: while it holds them, the user's destroy_process_group()
    # cannot destroy the groups, so gloo's worker threads live on into interpreter finalization,
    # where one freeing a finished collective's tensors (it needs the GIL) aborts the process
    # ("terminate called without an active exception", seen once in CI under torchrun).
    st.group = st.shard_group = st.replicate_group = st.seqcheck = None
