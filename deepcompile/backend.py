"""The torch.compile backend: graph ids, the forward/backward split, the pass pipeline.

Dynamo hands us one graph per captured segment (a graph break gives two segments, each its own
graph id). AOTAutograd splits each into forward and backward (or one inference graph); every
one of those runs the configured passes in order and then the inner compiler:
``inductor``, ``aot_eager`` (the graph's own Python code) or ``eager`` (node by node).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from deepcompile.compat import aot as aot_compat
from deepcompile.compat import fx as fx_compat
from deepcompile.compile import aot_seed, boxed_graph, inductor_pool, kernel_wait, nested, pipeline, trace_once
from deepcompile.compile.gc_pause import paused_gc
from deepcompile.compile.kept_graphs import Kept, Mismatch, Slot, signature
from deepcompile.passes import PASSES, PassContext, make_params
from deepcompile.passes import causal_mask
from deepcompile.profile.profiler import profiled_callable
from deepcompile.record.graph import serialize
from deepcompile.runtime import seqcheck


@dataclass
class GraphVersion:
    graph_id: int
    kind: str        # "dynamo", "forward", "backward", "inference"
    after: str       # "input" or the pass name
    nodes: list[dict]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    step: int = 0    # the optimizer step whose pass list produced this version



def _no_recompile() -> None:
    """GraphModule.recompile while passes run (Backend.run_passes generates the code once, after them)."""


PHASES = ("dynamo", "causal_mask", "aot_autograd", "flatten", "passes", "inductor", "profiling", "planner", "reuse")


class Backend:
    def __init__(self, config, param_meta: dict, world_size: int, rank: int,
                 observers: list[Callable[[GraphVersion], None]] | None = None, blocks: str | None = None):
        self.config = config
        self.blocks = blocks  # blocks.resolve: the final graphs compiled as block regions ("on", "auto") or whole
        self.param_meta = param_meta
        self.world_size, self.rank = world_size, rank
        self.next_graph_id = 0
        self.versions: list[GraphVersion] = []
        self.observers = list(observers or [])
        self.compiled: dict[tuple[int, str], fx.GraphModule] = {}
        self.aot_cache_hits: list[int] = []  # graphs taken from AOTAutograd's cache (_aot_cache_salt)
        self._aot_stored: str | None = None  # salt of this step's compile that stored an AOTAutograd entry
        # graph_id -> aot_seed.AotSeed: the planning run's warm-up compile, ready to store the re-run's
        # AOTAutograd entry once trace once has compiled the final graphs (_seed_aot_cache)
        self.aot_seeds: dict[int, Any] = {}
        self.aot_seed_log: dict[str, Any] = {}  # what the seeding did, for the record and benchmarks
        self.passes = config.passes
        self.step = 0
        self.profiling = False          # compile for the profiling interpreter instead
        self.profile = None             # the agreed Profile, once a profiling step has run
        self.measured = {}              # (graph_id, kind) -> node records of the profiling step
        # trace once: the scheduled re-compile reuses the warm-up's partitioned graphs instead of
        # tracing again; config trace_once: false turns it off (every compile traces)
        self.trace_once = bool(getattr(config, "trace_once", True))
        self.kept: list[Kept] = []
        self.trace_once_log: list[dict] = []   # one entry per scheduled re-compile: reused or why not
        self.plan_cache = None          # deepcompile.plan.cache.PlanCache (initialize sets it), or None: off
        self.graph_check = None         # runtime.graphcheck.GraphCheck (initialize sets it), or None: off
        self.runtime = None             # runtime.state.RuntimeState the passes get (initialize sets it), or None
        self.handoff: dict[int, dict] = {}   # graph id -> PassContext.handoff (a forward run to its backward)
        # compile seconds per optimizer step and phase (PHASES); see add_phase
        self.phases: dict[int, dict[str, float]] = {}
        self.call_seconds = 0.0         # total seconds inside __call__ (Dynamo's time excludes it)
        self._acc = {"passes": 0.0, "inductor": 0.0, "aot_autograd": 0.0, "flatten": 0.0, "causal_mask": 0.0}  # for nested _timed
        self.nested_calls = 0           # nested-region calls inlined (deepcompile/compile/nested.py)
        self.trace_blocks_failed: str | None = None  # why the nested trace fell back to a flat one
        self.nested_log: list[dict] = []  # per Dynamo graph traced with nested regions: calls, distinct bodies
        # Inductor's compile workers, started now so that they are up by the first Inductor
        # compile (after the warm-up steps); torch.compile's own backend does the same at its
        # entry, ours calls compile_fx directly (inductor_pool.warm_inductor_pool says why)
        if getattr(config, "compiler", None) == "inductor":
            import torch

            if torch.cuda.is_available():
                inductor_pool.warm_inductor_pool()

    def add_phase(self, phase: str, seconds: float, step: int | None = None) -> None:
        """Accumulate ``seconds`` of compile work in ``phase`` for ``step`` (default: the step the
        current pass list was compiled at)."""
        if seconds <= 0:
            return
        d = self.phases.setdefault(self.step if step is None else step, {})
        d[phase] = d.get(phase, 0.0) + seconds
        if phase in self._acc:
            self._acc[phase] += seconds

    def use_passes(self, passes: list, step: int, profiling: bool = False) -> None:
        """Switch the pass list (a scheduled re-compile): graph ids restart so the same segment
        keeps its id across compiles; versions carry the step they were compiled at."""
        self.passes, self.step, self.profiling = passes, step, profiling
        self.next_graph_id = 0
        self.compiled.clear()
        self.kept.clear()  # Dynamo traces again: the graphs kept from the last trace are gone with it

    def profile_in_place(self) -> bool:
        """Make the graphs compiled now run through the profiler, without compiling again.
        Possible when they were compiled here in Python (``aot_eager``/``eager``, the default
        plan's warm-up compiler), not by Inductor: each such graph checks this flag per call.
        Saves the profiling step a Dynamo trace and an AOTAutograd partition (about as long as
        the first step's compile). False when a re-compile is needed."""
        if self.profiling or not self.versions or self.config.compiler_at(self.step) == "inductor":
            return False
        self.profiling = True
        return True

    def _observe(self, v: GraphVersion) -> None:
        self.versions.append(v)
        for o in self.observers:
            o(v)

    def run_passes(self, gm: fx.GraphModule, graph_id: int, kind: str) -> fx.GraphModule:
        t0 = time.perf_counter()
        self._observe(GraphVersion(graph_id, kind, "input", serialize(gm), step=self.step))
        # every pass ends with gm.recompile() (Python code generation for the whole graph); only
        # the last one's code is ever run, so the ones before it are skipped and the code is
        # generated once below (an instance attribute over GraphModule.recompile, removed after)
        first = gm
        defer = len(self.passes) > 1 and isinstance(gm, fx.GraphModule)
        if defer:
            object.__setattr__(first, "recompile", _no_recompile)
        try:
            for entry in self.passes:
                pdef = PASSES[entry.name]
                ctx = PassContext(graph_id=graph_id, kind=kind, params=make_params(entry),
                                  param_meta=self.param_meta, world_size=self.world_size, rank=self.rank,
                                  profile=self.profile, runtime=self.runtime,
                                  handoff=self.handoff.setdefault(graph_id, {}))
                t1 = time.perf_counter()
                gm = pdef.fn(gm, ctx)
                self._observe(GraphVersion(graph_id, kind, entry.name, serialize(gm), ctx.notes,
                                           time.perf_counter() - t1, step=self.step))
        finally:
            if defer:
                first.__dict__.pop("recompile", None)
        if defer:
            gm.recompile()
        self.compiled[(graph_id, kind)] = gm
        seqcheck.register_nodes(graph_id, kind, gm)  # a collective timeout names the node it is in
        if self.graph_check is not None:  # the ranks' collective sequences for this graph agree
            self.graph_check.compiled(graph_id, kind, self.step, gm)
        self.add_phase("passes", time.perf_counter() - t0)  # the record's serialization included
        return gm

    def _inductor(self, gm: fx.GraphModule, inputs, kw: dict):
        t0 = time.perf_counter()
        try:
            return pipeline.inductor_inner(gm, inputs, dc_blocks=self.blocks, **kw)
        finally:
            self.add_phase("inductor", time.perf_counter() - t0)

    def _aot_cache_salt(self) -> str | None:
        """What makes AOTAutograd's cache safe for this compile, or None (keep it off).

        Safe where the compile's passes and their parameters are fixed before it (the plan
        cache hit at step 0, whose key covers the model's graph, the config and the ranks), the
        passes only rewrite the graph (a hit skips them: no runtime state may be set while they
        run) and our compiled graphs are ones its cache can store: Inductor's own, or blocks'
        driver, which is made one (block_regions.blocks_cached_driver). A warm re-run then skips the
        joint trace, the partition and our passes (most of a warm compile's AOTAutograd time)."""
        pc = self.plan_cache
        if pc is None or not pc.hit or pc.key is None or self.profiling or not self._aot_cacheable():
            return None
        if self._stateful_passes():
            return None
        if pc.aot_nonce:  # the entry's own name for its plan (the planning run seeded under it)
            return self._plan_salt(pc.key, pc.aot_nonce)
        import hashlib

        plan = repr([(e.name, make_params(e)) for e in self.passes])
        return f"{pc.key}-{hashlib.sha256(plan.encode()).hexdigest()[:16]}-r{self.rank}of{self.world_size}"

    def _plan_salt(self, key: str, nonce: str) -> str:
        return f"{key}-{nonce}-r{self.rank}of{self.world_size}"

    def _aot_cacheable(self) -> bool:
        """AOTAutograd's cache may keep our graphs: Inductor's own, or blocks' driver, which
        block_regions.blocks_cached_driver makes an entry of Inductor's FX graph cache (where it
        cannot, the graph has no cache key and AOTAutograd stores nothing)."""
        return bool(getattr(self.config, "aot_cache", True))

    def _stateful_passes(self) -> list[str]:
        """The passes in force that set runtime state while they compile (a cache hit skips them):
        those not declared ``graph_only`` at their registration."""
        return sorted({e.name for e in self.passes if not PASSES[e.name].graph_only})

    def _seed_salt(self) -> str | None:
        """The salt a re-run hitting this run's plan will give AOTAutograd's cache, where this
        run's warm-up compile can seed that entry (compile/aot_seed.py): a plan
        cache miss that will plan (trace once, the final compiler Inductor), with nothing that
        keeps the re-run off AOTAutograd's cache (_aot_cache_salt) known to be off already; the
        planned passes are checked when the entry is saved."""
        pc = self.plan_cache
        if (pc is None or pc.hit or not pc.key or not pc.aot_nonce or self.step != 0 or not self.trace_once
                or self.config.compiler != "inductor" or not self._aot_cacheable()):
            return None
        return self._plan_salt(pc.key, pc.aot_nonce)

    def _seed_aot_cache(self, new: list, step: int) -> dict | None:
        """After the planned compile (trace once) of a run whose plan the plan cache stored: save
        AOTAutograd's entry for each graph, as the re-run that hits the plan will look it up, with
        the final Inductor graphs; and keep their graph versions for it (end_step)."""
        pc = self.plan_cache
        if pc is None or pc.stored is None:
            return None  # not the planned compile (or its plan was not stored): the seeds wait
        seeds, self.aot_seeds = self.aot_seeds, {}
        t0 = time.perf_counter()
        if stateful := self._stateful_passes():
            self.aot_seed_log.update({"step": step, "saved": 0, "of": len(seeds), "why": (
                f"the plan runs {stateful}, which set runtime state a cache hit would skip")})
            return self.aot_seed_log
        fns = {(k.graph_id, k.kind): (k, fn) for k, fn in new}
        saved, whys = 0, []
        for graph_id, seed in sorted(seeds.items()):
            fw, bw = fns.get((graph_id, "forward")), fns.get((graph_id, "backward"))
            if fw is None or bw is None:
                whys.append(f"graph {graph_id}: no final forward and backward")
                continue
            w = aot_seed.aot_seed_save(seed, fw[1], bw[1], fw[0].traced.tracing_context)
            if w is None:
                saved += 1
            else:
                whys.append(f"graph {graph_id}: {w}")
        self.aot_seed_log.update({"step": step, "saved": saved, "of": len(seeds), "why": "; ".join(whys),
                                  "seconds": round(time.perf_counter() - t0, 3)})
        if saved:  # the graph versions follow at the step's end (end_step), under the re-run's salt
            self._aot_stored = self._plan_salt(pc.key, pc.aot_nonce)
        return self.aot_seed_log

    def _versions_file(self, salt: str) -> str | None:
        import hashlib
        import os

        pc = self.plan_cache
        if pc is None or not getattr(pc, "dir", None):
            return None
        return os.path.join(pc.dir, f"aotgraphs-{hashlib.sha256(salt.encode()).hexdigest()[:24]}.json")

    def end_step(self) -> None:
        """At the optimizer step: a compile that stored an AOTAutograd entry also keeps its graph
        versions (every pass's output, forward and backward) beside the plan cache, so that a run
        taking the graphs from that entry still shows them (record, report, inspector, what-if)."""
        salt, self._aot_stored = self._aot_stored, None
        path = self._versions_file(salt) if salt else None
        if path is None:
            return
        import json

        from deepcompile.record.writer import atomic_write, version_fields

        kept = [version_fields(v) for v in self.versions if v.step == self.step and v.kind != "dynamo"]
        try:
            atomic_write(path, json.dumps({"salt": salt, "versions": kept}).encode())
        except (OSError, TypeError, ValueError) as e:  # costs a later run its graph views, not this run
            import warnings
            warnings.warn(f"deepcompile: could not keep the graph versions for AOTAutograd's cache in {path}: {e}")

    def _replay_versions(self, salt: str, graph_id: int) -> None:
        path = self._versions_file(salt)
        import json

        try:
            with open(path) as f:
                stored = json.load(f)
        except (OSError, TypeError, ValueError):
            return  # none kept (or unreadable): the record has the Dynamo graph only
        if stored.get("salt") != salt:
            return
        for d in stored.get("versions", []):
            if d.get("graph_id") == graph_id:
                self._observe(GraphVersion(graph_id, d["kind"], d["after"], d["nodes"],
                                           list(d.get("notes") or []) + ["from AOTAutograd's cache: the passes ran in "
                                                                         "the run that stored it"],
                                           d.get("seconds", 0.0), step=self.step))

    def _timed(self, fn: Callable, *args):
        """Run a compile step; what it spent outside our passes and Inductor is AOTAutograd's
        (the trace, the partition, Inductor's graph-level front end)."""
        t0, before = time.perf_counter(), sum(self._acc.values())
        try:
            with paused_gc():
                return fn(*args)
        finally:
            spent = time.perf_counter() - t0
            self.add_phase("aot_autograd", spent - (sum(self._acc.values()) - before))

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]):
        t0 = time.perf_counter()
        try:
            return self._timed(self._compile, gm, example_inputs)
        finally:
            self.call_seconds += time.perf_counter() - t0

    def _keep_traces(self, compiler: str) -> bool:
        """Keep this compile's graphs for trace-once: a Python (warm-up) compile that a scheduled
        re-compile will follow."""
        return (self.trace_once and compiler != "inductor" and not (self.plan_cache and self.plan_cache.hit)
                and any(e.step > self.step for e in self.config.schedule))

    def _compile(self, gm: fx.GraphModule, example_inputs: list[Any]):
        graph_id = self.next_graph_id
        self.next_graph_id += 1
        # before AOTAutograd: a materialized causal mask becomes is_causal=True (passes/causal_mask.py)
        t0 = time.perf_counter()
        pre = causal_mask.restore_causal_sdpa(gm) if getattr(self.config, "causal_mask", True) else []
        # its own phase: it runs on every compile, an AOTAutograd cache hit too (the cache key is
        # the rewritten graph), where no pass runs
        self.add_phase("causal_mask", time.perf_counter() - t0)
        dynamo_nodes = serialize(gm)
        # a scheduled re-compile that could not reuse the warm-up trace says so in the record
        why = next((e["why"] for e in self.trace_once_log if e["step"] == self.step and not e["reused"]), None)
        notes = pre + ([f"trace once: not reused, re-traced: {why}"] if why else [])
        self._observe(GraphVersion(graph_id, "dynamo", "input", dynamo_nodes, notes, step=self.step))
        if self.plan_cache is not None and self.step == 0:
            self.plan_cache.on_graph(self, graph_id, gm, example_inputs)  # a hit sets the stored passes and profile
        # blocks traced once (deepcompile/compile/nested.py): each partitioned graph is flattened first
        ids, names, renamed = nested.input_ids(example_inputs), {}, {}
        calls, distinct = nested.bodies(gm)
        if calls:
            self.nested_log.append({"step": self.step, "graph": graph_id, "calls": calls, "bodies": distinct})

        def flat(g: fx.GraphModule) -> fx.GraphModule:
            g = fx_compat.lazy_graph(g)  # code generated once, when run (not at each pass's recompile)
            if ids or calls:  # the Dynamo graph's region calls: none, nothing to flatten
                t0 = time.perf_counter()
                self.nested_calls += nested.flatten(g, ids, names, renamed)
                self.add_phase("flatten", time.perf_counter() - t0)
            return g
        compiler = self.config.compiler_at(self.step)
        if self.plan_cache is not None and self.plan_cache.hit:
            compiler = self.config.compiler  # the stored plan, compiled at step 0 with the final compiler
        if self.profiling:
            compiler = "profile"
        if compiler == "inductor":
            def compile_inductor(g, inputs, kind, kw):
                return self._inductor(self.run_passes(flat(g), graph_id, kind), inputs, kw)
            # timed per graph: a backward is compiled at its first run, outside __call__
            salt = self._aot_cache_salt()
            hits = aot_compat.aot_cache_hits()
            fn = pipeline.inductor_compile(gm, example_inputs,
                                         lambda g, inputs, kind, kw: self._timed(compile_inductor, g, inputs, kind, kw),
                                         aot_cache_salt=salt)
            if salt is not None and aot_compat.aot_cache_hits() > hits:
                # the passes did not run: their graph versions come from the run that stored the entry
                self.aot_cache_hits.append(graph_id)
                self._replay_versions(salt, graph_id)
            elif salt is not None:
                self._aot_stored = salt  # the versions are kept at the step's end (backward compiles lazily)
            return fn

        keep = self._keep_traces(compiler)

        def make(kind: str):
            def compile_one(g: fx.GraphModule, inputs, kw=None):
                g = flat(g)
                traced = trace_once.TracedGraph(g, inputs, kind, kw or {}) if keep else None
                if traced is not None:
                    traced.renamed = renamed  # the forward's inlined names, for its backward's restride
                g = self.run_passes(g, graph_id, kind)

                def sink(records, key=(graph_id, kind)):
                    self.measured[key] = records
                profiled = profiled_callable(g, sink)
                if compiler == "profile" and not keep:
                    return profiled
                fast = boxed_graph.interpret(g) if compiler == "eager" else boxed_graph.boxed_graph(g)

                # the same graph can be profiled in place (see profile_in_place)
                def run(args):
                    return (profiled if self.profiling else fast)(args)
                run._boxed_call = True
                if not keep:
                    return run
                slot = Slot(run)
                self.kept.append(Kept(graph_id, kind, traced, slot, signature(g), dynamo_nodes))
                return slot
            return compile_one

        if keep and self.config.compiler == "inductor":
            # trace as Inductor will want the graphs (its decompositions, joint-graph passes and
            # partition), so that the final compile can hand the same graphs to Inductor; the
            # warm-up steps run them as Python code
            by_kind = {k: make(k) for k in ("forward", "backward", "inference")}

            def warm_up(g, inputs, kind, kw):
                return self._timed(by_kind[kind], g, inputs, kw)
            seed_salt = self._seed_salt()
            if seed_salt is None:
                return pipeline.inductor_compile(gm, example_inputs, warm_up)
            # AOTAutograd's cache on, keyed as the re-run of this plan will key it: the final
            # compile saves that entry (_seed_aot_cache)
            hits = aot_compat.aot_cache_hits()
            with aot_seed.aot_seed_recorder() as rec:
                fn = pipeline.inductor_compile(gm, example_inputs, warm_up, aot_cache_salt=seed_salt)
            if aot_compat.aot_cache_hits() > hits:  # a fresh nonce cannot hit; if it did, no trace was kept
                raise RuntimeError(f"deepcompile: AOTAutograd's cache hit under a fresh plan salt {seed_salt}")
            if rec.seeds:
                self.aot_seeds[graph_id] = rec.seeds[-1]
            elif rec.why:
                self.aot_seed_log.setdefault("not_recorded", []).append(f"graph {graph_id}: {rec.why}")
            return fn
        return pipeline.aot_compile(gm, example_inputs, *(
            (lambda g, inputs, one=make(k): self._timed(one, g, inputs)) for k in ("forward", "backward", "inference")))

    # --- trace once -------------------------------------------------------------------------

    def retarget(self, passes: list, step: int, dynamic_changed: bool = False) -> str | None:
        """The scheduled re-compile without a trace: run ``passes`` on copies of the graphs kept
        from the warm-up compile, compile them with the configured compiler and re-point the
        callables AOTAutograd already holds. Returns None when done, else why it could not be
        done (nothing changed then; the caller re-traces). Everything is compiled and checked
        before anything is re-pointed, so a graph whose signature the passes changed leaves the
        warm-up code running until the re-trace replaces it."""
        why = self._cannot_retarget(dynamic_changed)
        if why is not None:
            self.trace_once_log.append({"step": step, "reused": False, "why": why})
            return why
        t_start = time.perf_counter()
        old = (self.passes, self.step, self.profiling, dict(self.compiled))
        self.passes, self.step, self.profiling = passes, step, False
        self.compiled.clear()
        compiler = self.config.compiler_at(step)
        buffered: list[GraphVersion] = []
        observers, self.observers = self.observers, [buffered.append]
        versions_before = len(self.versions)
        new: list[tuple[Kept, Callable]] = []
        fw_strides: dict[int, tuple] = {}  # graph_id -> (forward graph before passes, its output strides)
        restrided = 0
        try:
            # block regions: the forward's kernels compile while the backward is lowered, and all
            # are waited for once (kernel_wait.blocks_deferred_kernel_wait)
            defer = self.blocks and compiler == "inductor"
            with (kernel_wait.blocks_deferred_kernel_wait() if defer else contextlib.nullcontext()) as waits:
                for k in sorted(self.kept, key=lambda k: (k.graph_id, k.kind == "backward")):
                    tg = k.traced
                    t0 = time.perf_counter()
                    g = trace_once.fresh_copy(tg)
                    inputs = tg.example_inputs
                    if k.kind == "backward" and k.graph_id in fw_strides:
                        inputs, n = self._restride(k, fw_strides, g, inputs)
                        restrided += n
                    self.add_phase("reuse", time.perf_counter() - t0)
                    if k.kind in ("forward", "inference"):  # the record keeps one Dynamo graph per compile
                        self._observe(GraphVersion(k.graph_id, "dynamo", "input", k.dynamo_nodes, [
                            f"trace once: the step-{old[1]} trace reused (no Dynamo, no AOTAutograd)"], step=step))
                    with trace_once.trace_once_context(tg):
                        g = self.run_passes(g, k.graph_id, k.kind)
                        sig = signature(g)
                        if sig != k.signature:
                            raise Mismatch(f"graph {k.graph_id} {k.kind}: the passes {[e.name for e in passes]} "
                                            f"give it {sig[0]} inputs / {len(sig[1])} outputs (None at "
                                            f"{[i for i, z in enumerate(sig[1]) if z]}), the traced runtime expects "
                                            f"{k.signature[0]} / {len(k.signature[1])} (None at "
                                            f"{[i for i, z in enumerate(k.signature[1]) if z]})")
                        if compiler == "inductor" and not tg.kw:
                            raise Mismatch("the warm-up graphs were not traced for Inductor")
                        if compiler == "inductor":
                            fn = self._final_inductor(k, g, inputs, fw_strides)
                        elif compiler == "eager":
                            fn = boxed_graph.interpret(g)
                        else:
                            fn = boxed_graph.boxed_graph(g)
                    new.append((k, fn))
            if defer:  # the wait is Inductor's (each graph's own compile was timed without it)
                self.add_phase("inductor", waits.wait_s, step)
        except Exception as e:  # noqa: BLE001 - anything unexpected: re-trace, never run half-swapped
            if isinstance(e, Mismatch):
                why = str(e)
            else:
                import traceback
                at = traceback.extract_tb(e.__traceback__)[-1]
                why = f"unexpected {type(e).__name__}: {e} (at {at.filename}:{at.lineno})"
            del self.versions[versions_before:]
            self.passes, self.step, self.profiling = old[:3]
            self.compiled.clear()
            self.compiled.update(old[3])
            self.trace_once_log.append({"step": step, "reused": False, "why": why})
            return why
        finally:
            self.observers = observers
        for v in buffered:
            for o in self.observers:
                o(v)
        for k, fn in new:
            k.slot.fn = fn
        seeded = self._seed_aot_cache(new, step) if self.aot_seeds else None
        self.trace_once_log.append({
            "step": step, "reused": True, "graphs": len(new), "restrided_inputs": restrided,
            "seconds": round(time.perf_counter() - t_start, 3),
            **({"aot_seeded": seeded} if seeded else {})})
        return None

    def _final_inductor(self, k: Kept, g: fx.GraphModule, inputs: list, fw_strides: dict):
        """Inductor for one trace-once graph; a forward's compiled output strides go into
        ``fw_strides`` for its backward (see _restride)."""
        if k.kind != "forward":
            return self._inductor(g, inputs, k.traced.kw)
        with aot_compat.report_output_strides() as strides:
            fn = self._inductor(g, inputs, k.traced.kw)
        fw_strides[k.graph_id] = (k.traced.gm, list(strides or []), k.traced.renamed)
        return fn

    def _restride(self, k: Kept, fw_strides: dict, g: fx.GraphModule, inputs: list) -> tuple[list, int]:
        fw_pre, strides, renamed = fw_strides[k.graph_id]
        inputs, n, unmatched = trace_once.restride_saved(fw_pre, strides, g, inputs, renamed)
        if unmatched:
            raise Mismatch(f"graph {k.graph_id} backward: placeholders {unmatched[:5]} name no "
                            "forward output, so the forward's real strides cannot be carried over")
        return inputs, n

    def _cannot_retarget(self, dynamic_changed: bool = False) -> str | None:
        if not self.trace_once:
            return "trace once is off (config trace_once: false)"
        if dynamic_changed:  # the kept graphs are static in dims that now vary
            return "dims became dynamic since the warm-up trace"
        if not self.kept:
            return "no warm-up graphs kept (the last compile was not a warm-up compile)"
        sym = [f"{k.graph_id} {k.kind}" for k in self.kept if k.traced.symbolic]
        if sym:
            return f"graphs {sym} were traced with dynamic shapes; re-tracing keeps the guards exact"
        kinds = {}
        for k in self.kept:
            kinds.setdefault(k.graph_id, set()).add(k.kind)
        lonely = [g for g, ks in kinds.items() if "forward" in ks and "backward" not in ks]
        if lonely:
            return (f"graphs {lonely}: the backward never ran in the warm-up steps, so it was never "
                    "compiled and cannot be re-compiled without AOTAutograd")
        return None
