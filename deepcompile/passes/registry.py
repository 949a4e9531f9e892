"""The pass registry: every pass is a function ``(graph_module, context) -> graph_module``
registered with its declared parameters (a dataclass built with ``deepcompile.params.spec``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch.fx as fx

from deepcompile.params import ConfigError, build, spec

# the config's default reduce bucket (elements), here so a pass replaying the bucket layout needs
# no config import (the config sits above the passes)
DEFAULT_REDUCE_BUCKET = 25_000_000


@dataclass
class PassEntry:
    name: str = spec(help="registered pass name (see `deepcompile.passes.PASSES`)")
    params: dict = spec(default_factory=dict, help="values for the pass's declared parameters")


@dataclass
class NoParams:
    pass


# How the what-if (``plan.whatif``) treats a pass on a record's graphs (``PassDef.offline``).
OFFLINE_BASE = "base"      # the record keeps this pass's output graphs: the passes after it run on them
OFFLINE_RERUN = "rerun"    # re-run on copies of the rebuilt graphs, priced by the cost model
OFFLINE_MEMORY = "memory"  # priced by the memory model (its decisions read the live allocator)
OFFLINE_NONE = "none"      # not predicted offline (no graph rewrite to price)
OFFLINE = (OFFLINE_BASE, OFFLINE_RERUN, OFFLINE_MEMORY, OFFLINE_NONE)


@dataclass(frozen=True)
class PassDef:
    """A registered pass and what the rest of deepcompile needs to know about it, declared once
    at its registration (``register_pass``) in the pass's own file."""
    name: str
    fn: Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]
    params_cls: type
    help: str
    # it only rewrites the graph: no runtime state is set while it compiles, so a compile made of
    # such passes alone can come from AOTAutograd's cache, which does not run them
    graph_only: bool
    offline: str                           # one of OFFLINE: how the what-if treats it
    lowers: tuple[int, ...] = ()           # ZeRO stages whose communication it inserts (first in their lists)
    planned: tuple[str, ...] = ()          # parameters the planner decides where not set by hand
    # values of ``planned`` at which the pass changes nothing: the planner holds them there when
    # the pass list lacks the pass
    absent: Mapping[str, Any] = field(default_factory=dict)
    # the planner appends it to the list when no plan fits without it; its planned parameters
    # are then the plan's, never "auto" by default
    planner_adds: bool = False
    plan_cacheable: bool = True            # a plan that runs it may be stored for later runs (plan.cache)
    requires: tuple[str, ...] = ()         # passes that must come earlier in the same list
    conflicts: tuple[str, ...] = ()        # passes that must not be in the same list (either way round)
    precedes: tuple[str, ...] = ()         # passes that, when in the same list, must come later


PASSES: dict[str, PassDef] = {}


def register_pass(name: str, params_cls: type = NoParams, help: str = "", *, graph_only: bool, offline: str,
                  lowers: tuple[int, ...] = (), planned: tuple[str, ...] = (), absent: Mapping[str, Any] | None = None,
                  planner_adds: bool = False, plan_cacheable: bool = True, requires: tuple[str, ...] = (),
                  conflicts: tuple[str, ...] = (), precedes: tuple[str, ...] = ()):
    """Register ``fn`` as the pass ``name`` with its declarations (see :class:`PassDef`)."""
    fields = {f.name for f in dataclasses.fields(params_cls)}
    bad = [k for k in (*planned, *(absent or {})) if k not in fields]
    if bad:
        raise ValueError(f"pass {name!r}: {bad} are not parameters of {params_cls.__name__}")
    if set(absent or {}) - set(planned):
        raise ValueError(f"pass {name!r}: absent values {sorted(absent)} must be planned parameters {list(planned)}")
    if offline not in OFFLINE:
        raise ValueError(f"pass {name!r}: offline {offline!r} is not one of {OFFLINE}")

    def deco(fn):
        if name in PASSES:
            raise ValueError(f"pass {name!r} registered twice")
        PASSES[name] = PassDef(name, fn, params_cls, help or (fn.__doc__ or "").strip().split("\n")[0],
                               graph_only=bool(graph_only), offline=offline, lowers=tuple(lowers),
                               planned=tuple(planned), absent=dict(absent or {}), planner_adds=bool(planner_adds),
                               plan_cacheable=bool(plan_cacheable), requires=tuple(requires),
                               conflicts=tuple(conflicts), precedes=tuple(precedes))
        return fn
    return deco


def lowering(stage: int) -> str:
    """The pass that inserts ZeRO stage ``stage``'s communication (the first of its pass lists)."""
    found = [n for n, p in PASSES.items() if stage in p.lowers]
    if len(found) != 1:
        raise KeyError(f"ZeRO stage {stage}: {len(found)} passes declare that they lower it ({found})")
    return found[0]


def lowering_index(names: list[str], first: str) -> int:
    """Where ``first`` (the pass that lowers a ZeRO stage) must stand in ``names``: after the
    passes at the front that declare they precede it (``PassDef.precedes``), which rewrite the
    graph before its communication is inserted."""
    i = 0
    while i < len(names) and names[i] in PASSES and first in PASSES[names[i]].precedes:
        i += 1
    return i


def planned_params() -> dict[str, tuple[str, ...]]:
    """{pass: parameters the planner decides} of every pass that has any."""
    return {n: p.planned for n, p in PASSES.items() if p.planned}


def absent_params(names) -> dict[str, dict]:
    """{pass: its ``absent`` values} for every planned pass not in ``names``: what the planner
    holds fixed for a pass the list lacks (a pass it may add itself is left to it)."""
    names = set(names)
    return {n: dict(p.absent) for n, p in PASSES.items() if p.absent and n not in names}


def list_problems(names: list[str]) -> list[str]:
    """What is wrong with a pass list by the declared requirements and conflicts (empty: nothing)."""
    out = []
    for i, n in enumerate(names):
        p = PASSES.get(n)
        if p is None:
            continue
        for r in p.requires:
            if r not in names[:i]:
                out.append(f"{n!r} needs {r!r} earlier in the list")
        for c in p.conflicts:
            if c in names:
                out.append(f"{n!r} and {c!r} cannot be in one list")
        for c in p.precedes:
            if c in names[:i]:
                out.append(f"{n!r} must come before {c!r}")
    return out


@dataclass
class PassContext:
    """What a pass may read. Passes never write records or talk to widgets."""
    graph_id: int
    kind: str                      # "forward", "backward" or "inference"
    params: Any                    # the pass's declared parameters (instance of params_cls)
    param_meta: dict               # id -> deepcompile.runtime.ops.ParamMeta
    world_size: int
    rank: int
    profile: Any = None            # the previous iteration's profile, when one exists
    notes: list[str] = field(default_factory=list)  # what the pass did, for the record
    # runtime.state.ReduceLayout the backward's reduce grouping replays (passes/zero3.group_reduces);
    # None: the runtime state's (``runtime.reduce_layout``), else the config defaults
    reduce_layout: Any = None
    # runtime.state.RuntimeState of the process the graph is compiled for (the backend's); None
    # offline (the what-if, the planner's pricing copies, tests): passes then use no runtime
    runtime: Any = None
    # what a pass's forward run leaves for the same graph's backward run (the backward is compiled
    # after the forward, from another context), keyed by pass name. Whoever builds the contexts owns
    # it, one dict per graph id: the backend per model, an offline runner per pricing; so two models,
    # or a what-if beside a training run in one process, never read each other's
    handoff: dict = field(default_factory=dict)


def normalize_entry(entry: Any, path: str):
    """A pass entry from the config: a name, or {name, params}; params validated with path."""
    if isinstance(entry, str):
        entry = {"name": entry}
    if isinstance(entry, PassEntry):
        entry = {"name": entry.name, "params": dict(entry.params)}
    if not isinstance(entry, dict):
        raise ConfigError(f"{path}: a pass is a name or {{\"name\": ..., \"params\": {{...}}}}, got {entry!r:.80}; "
                          f"known passes: {sorted(PASSES)}")
    if "name" not in entry:
        raise ConfigError(f"{path}.name: missing; a pass entry is {{\"name\": ..., \"params\": {{...}}}} with a "
                          f"name from {sorted(PASSES)}")
    pe = build(PassEntry, entry, path)
    pdef = PASSES.get(pe.name)
    if pdef is None:
        raise ConfigError(f"{path}.name: unknown pass {pe.name!r}; known: {sorted(PASSES)}")
    build(pdef.params_cls, pe.params, f"{path}.params")  # validate now, with the key path
    return pe


def make_params(entry) -> Any:
    return build(PASSES[entry.name].params_cls, entry.params, f"passes.{entry.name}.params")
