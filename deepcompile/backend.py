"""The torch.compile backend: graph ids, the forward/backward split, the pass pipeline.

Dynamo hands us one graph per captured segment (a graph break gives two segments, each its own
graph id). AOTAutograd splits each into forward and backward (or one inference graph); every
one of those runs the configured passes in order and then the inner compiler:
``inductor``, ``aot_eager`` (the graph's own Python code) or ``eager`` (node by node).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from deepcompile import compat
from deepcompile.passes import PASSES, PassContext, make_params
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


class Backend:
    def __init__(self, config, param_meta: dict, world_size: int, rank: int,
                 observers: list[Callable[[GraphVersion], None]] | None = None):
        self.config = config
        self.param_meta = param_meta
        self.world_size, self.rank = world_size, rank
        self.next_graph_id = 0
        self.versions: list[GraphVersion] = []
        self.observers = list(observers or [])
        self.compiled: dict[tuple[int, str], fx.GraphModule] = {}
        self.passes = config.passes
        self.step = 0
        self.profiling = False          # compile for the profiling interpreter instead
        self.profile = None             # the agreed Profile, once a profiling step has run
        self.measured = {}              # (graph_id, kind) -> node records of the profiling step

    def use_passes(self, passes: list, step: int, profiling: bool = False) -> None:
        """Switch the pass list (a scheduled re-compile): graph ids restart so the same segment
        keeps its id across compiles; versions carry the step they were compiled at."""
        self.passes, self.step, self.profiling = passes, step, profiling
        self.next_graph_id = 0
        self.compiled.clear()

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
        self._observe(GraphVersion(graph_id, kind, "input", serialize(gm), step=self.step))
        for entry in self.passes:
            pdef = PASSES[entry.name]
            ctx = PassContext(graph_id=graph_id, kind=kind, params=make_params(entry),
                              param_meta=self.param_meta, world_size=self.world_size, rank=self.rank,
                              profile=self.profile)
            t0 = time.perf_counter()
            gm = pdef.fn(gm, ctx)
            self._observe(GraphVersion(graph_id, kind, entry.name, serialize(gm), ctx.notes,
                                       time.perf_counter() - t0, step=self.step))
        self.compiled[(graph_id, kind)] = gm
        seqcheck.register_nodes(graph_id, kind, gm)  # a collective timeout names the node it is in
        return gm

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]):
        graph_id = self.next_graph_id
        self.next_graph_id += 1
        self._observe(GraphVersion(graph_id, "dynamo", "input", serialize(gm), step=self.step))
        compiler = self.config.compiler_at(self.step)
        if self.profiling:
            compiler = "profile"
        if compiler == "inductor":
            return compat.inductor_compile(
                gm, example_inputs, lambda g, inputs, kind: self.run_passes(g, graph_id, kind))

        def make(kind: str):
            def compile_one(g: fx.GraphModule, inputs):
                g = self.run_passes(g, graph_id, kind)

                def sink(records, key=(graph_id, kind)):
                    self.measured[key] = records
                profiled = profiled_callable(g, sink)
                if compiler == "profile":
                    return profiled
                fast = compat.interpret(g) if compiler == "eager" else compat.boxed(g.forward)

                # the same graph can be profiled in place (see profile_in_place)
                def run(args):
                    return (profiled if self.profiling else fast)(args)
                run._boxed_call = True
                return run
            return compile_one

        return compat.aot_compile(gm, example_inputs, make("forward"), make("backward"), make("inference"))
