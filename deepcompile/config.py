"""The typed configuration tree. Every key is declared once, with help, bounds and choices.

``Config.load`` accepts a dict, a path to a JSON file, or a ``Config``; unknown keys and bad
values raise :class:`ConfigError` naming the key path (``config.mixed_precision.param_dtype``).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from deepcompile.params import ConfigError, build, spec
from deepcompile.passes import prefetch, selective_unshard, zero3
from deepcompile.passes.registry import DEFAULT_REDUCE_BUCKET, list_problems, lowering, lowering_index

# the default ZeRO-3 plan's pass list after the profiling step (apply_default_schedule)
DEFAULT_PLAN = (zero3.NAME, prefetch.NAME, selective_unshard.NAME)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# keys of features deepcompile does not have: unknown keys, with a hint instead of a near-miss
REMOVED_KEYS = {"cuda_graphs": "CUDA graphs are not supported",
                "compile_workers": "compile worker processes are not supported"}


def _read_config_file(path: str | os.PathLike) -> Any:
    """The JSON of a config file; every way it can be wrong is a ConfigError naming the path."""
    import stat

    name = repr(os.fspath(path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"config file {name} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {name} cannot be read: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"config file {name} is a directory; pass the path of a JSON file")
    if not stat.S_ISREG(st.st_mode):   # a FIFO would block open() until someone writes to it
        raise ConfigError(f"config file {name} is not a regular file; pass the path of a JSON file")
    if st.st_size > 16 << 20:
        raise ConfigError(f"config file {name} is {st.st_size >> 20} MiB, not a config (at most 16 MiB)")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"config file {name} cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {name} is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                          "is it a binary file? A config is a JSON object") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {name} is not valid JSON: {e}") from None
    except (ValueError, RecursionError) as e:  # an over-long integer, nesting past the recursion limit
        raise ConfigError(f"config file {name} is not a valid config: {e or type(e).__name__}") from None


@dataclass
class MixedPrecision:
    param_dtype: str = spec("float32", choices=tuple(DTYPES),
                            help="dtype parameters are gathered and computed in (shards and optimizer stay in their own dtype)")
    reduce_dtype: str = spec("float32", choices=tuple(DTYPES),
                             help="dtype gradients are reduce-scattered in")

    def torch_param_dtype(self) -> torch.dtype | None:
        return None if self.param_dtype == "float32" else DTYPES[self.param_dtype]

    def torch_reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce_dtype]


@dataclass
class Mesh:
    shard: int | None = spec(None, min=1, max=1 << 20,
                             help="ranks each parameter is sharded over (hybrid sharding, HSDP): consecutive groups "
                                  "of this many ranks (one node, launched node by node) shard the model, the "
                                  "groups replicate it and all-reduce gradients; must divide the world size "
                                  "(default: every rank, plain ZeRO)")


@dataclass
class ScheduleEntry:
    step: int = spec(help="optimizer step from which these passes are used (re-compiles once there)", min=1,
                     max=1 << 30)
    passes: list[Any] = spec(default_factory=lambda: [zero3.NAME], help="pass list, like `passes`")


@dataclass
class Config:
    zero_stage: int = spec(3, choices=(1, 2, 3),
                           help="ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters")
    compiler: str = spec("inductor", choices=("inductor", "aot_eager", "eager"),
                         help="inner compiler for the rewritten graphs; eager interprets node by node")
    passes: list[Any] = spec(default_factory=lambda: [zero3.NAME],
                             help="passes run on every captured graph, in order: a name or {name, params}")
    schedule: list[ScheduleEntry] = spec(default_factory=list,
                                         help="later pass lists: [{step, passes}]; `passes` runs from step 0")
    profile_step: int | None = spec(None, min=0, max=1 << 30,
                                    help="optimizer step run node by node under the profiler; compiles after it give passes the profile")
    gradient_accumulation_steps: int = spec(1, min=1, max=1 << 20,
                                            help="micro-batches per optimizer step; optimizer.step() is a no-op in between")
    mixed_precision: MixedPrecision = spec(default_factory=MixedPrecision, help="compute and reduce dtypes")
    mesh: Mesh = spec(default_factory=Mesh, help="how ranks shard and replicate the model: {shard: S}")
    reduce_bucket_size: int = spec(DEFAULT_REDUCE_BUCKET, min=1, max=1 << 40,
                                   help="elements per gradient reduce-scatter bucket (a threshold: 2**40, more than "
                                        "any model's gradients, means one bucket per step)")
    max_inflight_reduces: int = spec(2, min=1, max=64, help="reduce-scatter buckets in flight before the oldest is waited for")
    reduce_pack: str = spec("coalesced", choices=("coalesced", "cat"),
                            help="how a bucket of several gradients is reduce-scattered: 'coalesced' (one coalesced "
                                 "collective over the gradients themselves, no copy) or 'cat' (packed by one copy "
                                 "kernel, one reduce-scatter: less host work per gradient); the same on every rank")
    cast_stream: bool = spec(True, help="on GPU, the casts around the collectives (a gather's shards to the compute "
                                        "dtype, a reduced bucket back to the shards' dtype) run on a side stream, so "
                                        "compute queued after them does not wait; false: on the compute stream")
    collective_timeout_s: float = spec(600.0, min=1.0, max=7 * 24 * 3600.0,
                                       help="seconds a rank waits for the others in any collective (and at the "
                                            "step's sequence check) before it fails naming the rank, the collective "
                                            "and the graph node; also the timeout of the process group deepcompile creates")
    warmup_compiler: str | None = spec(None, choices=(None, "inductor", "aot_eager", "eager"),
                                       help="compiler for the steps before the first scheduled re-compile (default: "
                                            "`compiler`); the default ZeRO-3 plan uses aot_eager there, so Inductor "
                                            "compiles once, with the final pass list")
    auto_schedule: bool = spec(True, help="ZeRO-3 with none of passes, schedule, profile_step given: compile "
                                          "zero3 at step 0, profile step 1, then zero3+prefetch+selective_unshard")
    memory_limit_gib: float | None = spec(None, min=0.001, max=1e6,
                                          help="device memory (GiB) the planned passes must fit in, the same on every "
                                               "rank (default: 90% of the device, lowered to the free memory of the "
                                               "fullest rank)")
    device_memory_gib: float | None = spec(None, min=0.001, max=1e6,
                                           help="the device's capacity for the planner (default: what CUDA reports; "
                                                "on the CPU, MemTotal)")
    optimizer_chunk_mb: Any = spec("auto", min=0.0, max=1e9,
                                   help="optimizer.step() runs each param group in chunks of about this many MiB of "
                                        "parameters (the user's param_groups and state dict do not change): bounds the "
                                        "foreach optimizers' group-sized temporaries, the step's peak; 0: one chunk per "
                                        "group; 'auto': the planner chooses (chunks only where that lets a faster plan fit)")
    optimizer_fused: Any = spec("auto", help="optimizer.step() over the shards with torch's fused kernel (Adam, AdamW, "
                                             "SGD on CUDA): one pass over each element where the default foreach step "
                                             "makes about a dozen; 'auto': for the param groups that leave fused and "
                                             "foreach unset; true: every group (an error where one cannot); false: "
                                             "torch's own choice")
    plan: bool | None = spec(None, help="after the profile, fill the parameters not set by hand of prefetch and "
                                        "selective_unshard (adding offload_optimizer when nothing fits otherwise) from "
                                        "the profile and memory_limit_gib; default: on for the default ZeRO-3 plan")
    progress: bool = spec(True, help="rank 0 prints one line to stderr for each step that spent a second or more "
                                     "compiling, profiling or planning (its phases and seconds, the plan chosen, and "
                                     "when training runs at speed); false: silent")
    blocks: Any = spec("auto", help="compile each distinct decoder block once: the final graphs (after the passes) "
                                    "are cut into regions along the model's repeated blocks (entries of an "
                                    "nn.ModuleList) and identical regions share one Inductor compile "
                                    "(deepcompile/compile/blocks.py), so the compile time stops growing with depth; the "
                                    "backward's reduce calls are cut at block boundaries. Inductor only. 'auto' "
                                    "(default): on CUDA devices, a graph it cannot cut is compiled whole with a "
                                    "warning (on the CPU whole graphs compile); true: on any device, and a graph "
                                    "it cannot cut raises; false: whole graphs (to compare, or where a "
                                    "cross-block fusion matters more than compile time)")
    trace_once: bool = spec(True, help="a scheduled re-compile (the default plan's step 2) re-uses the warm-up's "
                                        "traced and partitioned graphs instead of running Dynamo and AOTAutograd "
                                        "again; false: every compile traces (to compare)")
    trace_blocks: bool = spec(True, help="trace each distinct decoder block once: every entry of an nn.ModuleList "
                                          "of modules of one class is traced as a nested compile region "
                                          "(torch.compiler.nested_compile_region), so Dynamo installs, and "
                                          "AOTAutograd traces and partitions, one body for identical layers; each "
                                          "partitioned graph is flattened back before the passes "
                                          "(deepcompile/compile/nested.py), which see and schedule the same communication "
                                          "(each body partitioned on its own: its saved activations may differ a "
                                          "little), so the trace time grows little with depth. A block Dynamo "
                                          "cannot trace as a region falls back to a flat trace with a warning; "
                                          "false: a flat trace (to compare, or for a model whose blocks differ "
                                          "in ways the region trace does not allow)")
    causal_mask: bool = spec(True, help="before AOTAutograd, an attention call whose mask is a constant causal mask "
                                        "(as Hugging Face models build under torch.compile) runs as "
                                        "is_causal=True without the mask: the same math, causal kernels "
                                        "(deepcompile/passes/causal_mask.py); false: masks as traced")
    aot_cache: bool = spec(True, help="with a plan-cache hit, take the partitioned and compiled graphs from "
                                      "AOTAutograd's cache when an earlier run stored them: no joint trace, partition "
                                      "or passes (a warm re-run's largest cost); its graph versions come from the run "
                                      "that stored the entry. The run that plans stores it for the next run (from its "
                                      "final compile); false: neither, trace and run the passes every run")
    plan_cache: Any = spec(True, help="reuse the profile and plan of an earlier run of the same job (same graphs, config, "
                                      "world size, device, versions): compile the planned passes at step 0, no "
                                      "profiling step; true: under Inductor's cache dir (deepcompile_plans/), a path: "
                                      "that directory, false: off (deepcompile.plan.cache)")

    def validate(self, path: str = "config") -> None:
        self.optimizer_chunk_mb = self._check_chunk_mb(self.optimizer_chunk_mb, f"{path}.optimizer_chunk_mb")
        if not (isinstance(self.optimizer_fused, bool) or self.optimizer_fused == "auto"):
            raise ConfigError(f"{path}.optimizer_fused: expected true, false or 'auto', got {self.optimizer_fused!r}")
        if not (isinstance(self.blocks, bool) or self.blocks == "auto"):
            raise ConfigError(f"{path}.blocks: expected true, false or 'auto', got {self.blocks!r}")
        if not (isinstance(self.plan_cache, bool) or (isinstance(self.plan_cache, str) and self.plan_cache.strip())):
            raise ConfigError(f"{path}.plan_cache: expected true, false or a directory path, got {self.plan_cache!r}")
        first = lowering(self.zero_stage)   # the pass that declares it inserts this stage's communication
        if self.zero_stage != 3 and [p if isinstance(p, str) else getattr(p, "name", p) for p in self.passes] == [lowering(3)]:
            self.passes = [first]  # the default pass list names stage 3's lowering
        self.passes = self._check_passes(self.passes, f"{path}.passes", first, self.zero_stage)
        last = 0
        for i, e in enumerate(self.schedule):
            if e.step <= last:
                raise ConfigError(f"{path}.schedule[{i}].step: steps must increase and start above 0, got {e.step} after {last}")
            last = e.step
            e.passes = self._check_passes(e.passes, f"{path}.schedule[{i}].passes", first, self.zero_stage)

    @staticmethod
    def _check_chunk_mb(v: Any, path: str) -> "float | str":
        """'auto' or a finite number of MiB in [0, 1e9] (the typed field is Any: a union of a string
        choice and a number is not one of params' scalar types)."""
        if isinstance(v, str) and v == "auto":
            return v
        if isinstance(v, str):
            raise ConfigError(f"{path}: expected 'auto' or a number of MiB (0: no chunks), got {v!r}")
        from dataclasses import fields

        from deepcompile.params import _check_scalar

        f = next(f for f in fields(Config) if f.name == "optimizer_chunk_mb")
        return _check_scalar(path, v, float, f)

    @staticmethod
    def _check_passes(entries: list, path: str, first: str = zero3.NAME, stage: int = 3) -> list:
        from deepcompile.passes import PASSES, normalize_entry

        entries = [normalize_entry(e, f"{path}[{i}]") for i, e in enumerate(entries)]
        names = [e.name for e in entries]
        at = lowering_index(names, first)
        if at >= len(names) or names[at] != first:
            raise ConfigError(
                f"{path}: ZeRO-{stage} needs {first!r} as the first pass (it inserts the communication; only "
                f"passes that rewrite the graph before it, such as 'recompute_activations', may come earlier), got {names}")
        for i, e in enumerate(entries):
            if e.name not in PASSES:
                raise ConfigError(f"{path}[{i}].name: unknown pass {e.name!r}; known: {sorted(PASSES)}")
        problems = list_problems(names)   # each pass's declared requirements and conflicts
        if problems:
            raise ConfigError(f"{path}: {'; '.join(problems)} (got {names})")
        return entries

    def compiler_at(self, step: int) -> str:
        """The inner compiler for graphs compiled at optimizer step ``step``."""
        if self.warmup_compiler and self.schedule and step < self.schedule[0].step:
            return self.warmup_compiler
        return self.compiler

    def passes_at(self, step: int) -> list:
        """The pass list in force at optimizer step ``step``."""
        current = self.passes
        for e in self.schedule:
            if step >= e.step:
                current = e.passes
        return current

    @classmethod
    def load(cls, cfg: "Config | dict | str | os.PathLike | None") -> "Config":
        if cfg is None:
            cfg = {}
        if isinstance(cfg, Config):
            return build(cls, asdict(cfg), "config")  # every key explicit: no auto schedule
        if isinstance(cfg, (str, os.PathLike)):
            cfg = _read_config_file(cfg)
        gone = sorted(set(cfg) & set(REMOVED_KEYS)) if isinstance(cfg, dict) else []
        if gone:
            from dataclasses import fields

            raise ConfigError(f"config.{gone[0]}: unknown key ({REMOVED_KEYS[gone[0]]}). "
                              f"Known keys: {', '.join(sorted(f.name for f in fields(cls)))}")
        out = build(cls, cfg, "config")
        if (isinstance(cfg, dict) and out.zero_stage == 3 and out.auto_schedule
                and not {"passes", "schedule", "profile_step"} & set(cfg)):
            out.apply_default_schedule(explicit=set(cfg))
        return out

    def apply_default_schedule(self, explicit: set[str] = frozenset()) -> None:
        """The default ZeRO-3 plan: ``zero3`` at step 0, step 1 profiled node by node (warm
        kernels, training's own memory discipline), and from step 2 ``zero3, prefetch,
        selective_unshard`` compiled against that profile. The two warm-up steps run under
        aot_eager (seconds to compile) unless ``warmup_compiler`` says otherwise: Inductor's
        compile is paid once, for the graphs that train."""
        if "warmup_compiler" not in explicit and self.compiler == "inductor":
            self.warmup_compiler = "aot_eager"
        self.profile_step = 1
        if self.plan is None:  # the default plan's budgets come from the planner (deepcompile.plan)
            self.plan = True
        self.schedule = [build(ScheduleEntry, {"step": 2, "passes": list(DEFAULT_PLAN)},
                               "config.schedule[0]")]
        self.validate()

    def to_dict(self) -> dict:
        return asdict(self)
