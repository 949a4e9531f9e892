"""The pass registry: every pass is a function ``(graph_module, context) -> graph_module``
registered with its declared parameters (a dataclass built with ``deepcompile.params.spec``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

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


@dataclass
class PassDef:
    name: str
    fn: Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]
    params_cls: type
    help: str


PASSES: dict[str, PassDef] = {}


def register_pass(name: str, params_cls: type = NoParams, help: str = ""):
    def deco(fn):
        if name in PASSES:
            raise ValueError(f"pass {name!r} registered twice")
        PASSES[name] = PassDef(name, fn, params_cls, help or (fn.__doc__ or "").strip().split("\n")[0])
        return fn
    return deco


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
    # runtime.ops.ReduceLayout the backward's reduce grouping replays (passes/zero3.group_reduces);
    # None: this process's runtime's (ops.REDUCE_LAYOUT), else the config defaults
    reduce_layout: Any = None


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
