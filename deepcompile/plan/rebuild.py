"""FX graphs rebuilt from a run record's serialized nodes, and the parameters they gather.

A record keeps each graph version as serialized nodes (``record.graph.serialize``).
:func:`rebuild` turns them back into an FX graph: dc ops with their real operators, which the
passes match; every other op a stand-in of the same name, which the cost model matches by name;
every value a meta tensor of its recorded shape. :func:`param_meta` reads the parameters'
``ParamMeta`` back from a forward's gathers. The what-if (``plan.whatif``) runs passes on them.
"""
from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
          "bool": torch.bool, "int32": torch.int32, "float64": torch.float64, "uint8": torch.uint8,
          "int8": torch.int8, "int16": torch.int16, "complex64": torch.complex64}


class WhatIfError(ValueError):
    """The record cannot answer the what-if (no zero3 graphs, no profile) or a parameter is bad."""


_STANDINS: dict[str, Any] = {}


def _standin(name: str):
    """A callable whose ``__name__`` is the recorded target (``record.graph.target_name`` gives it back)."""
    f = _STANDINS.get(name)
    if f is None:
        def f(*a, **k):
            raise RuntimeError(f"{name}: a stand-in for planning, not runnable")
        f.__name__ = f.__qualname__ = name
        _STANDINS[name] = f
    return f


def _target(t: str):
    if t in ("getitem", "_operator.getitem", "operator.getitem"):
        return operator.getitem
    parts = t.split(".")
    if parts[0] == "dc":
        return getattr(torch.ops.dc, parts[1]).default
    return _standin(t)


def _val(shape, dtype):
    if not isinstance(shape, list):
        return None
    if shape and all(isinstance(s, list) for s in shape):
        if all(isinstance(x, int) for s in shape for x in s):
            return [torch.empty(s, device="meta") for s in shape]
        return None
    if all(isinstance(s, int) for s in shape):
        return torch.empty(shape, dtype=DTYPES.get(dtype or "", torch.float32), device="meta")
    return None


def rebuild(nodes: list[dict]) -> fx.Graph:
    """An FX graph of a record's serialized nodes (see the module doc)."""
    g = fx.Graph()
    env: dict[str, fx.Node] = {}

    def arg(a):
        if isinstance(a, dict):
            if len(a) == 1 and "node" in a:
                return env[a["node"]]
            return {k: arg(v) for k, v in a.items()}
        if isinstance(a, list):
            return [arg(x) for x in a]
        return a

    for n in nodes:
        if n["op"] == "placeholder":
            node = g.placeholder(n["name"])
        elif n["op"] == "output":
            g.output(arg(n["args"][0]))
            continue
        else:
            node = g.create_node(n["op"], _target(n["target"]), tuple(arg(n["args"])), arg(n.get("kwargs") or {}),
                                 name=n["name"])
        if node.name != n["name"]:
            raise WhatIfError(f"node {n['name']!r} came back as {node.name!r}")
        env[n["name"]] = node
        v = _val(n.get("shape"), n.get("dtype"))
        if v is not None:
            node.meta["val"] = v
        if "param" in n:
            node.meta["dc_param"] = n["param"]
    return g


def param_meta(forward: list[dict], backward: list[dict] | None, world: int) -> dict:
    """runtime.ops.ParamMeta per parameter id, from the forward's gathers: the shard is the
    gather's input placeholder, the gathered value the wait's output; a parameter without a
    ``reduce_grad`` (or place in a ``reduce_grads``) in the backward is frozen."""
    from deepcompile.runtime.ops import ParamMeta

    by = {n["name"]: n for n in forward}
    reduced = None
    if backward:
        reduced = {int(p) for n in backward if n.get("target") in ("dc.reduce_grad", "dc.reduce_grads")
                   for p in (n.get("params") or ([n["param"]] if "param" in n else []))}
    out = {}
    for n in forward:
        if n.get("target") != "dc.wait_allgather" or len(n.get("args") or []) < 2:
            continue
        issue = by.get((n["args"][0] or {}).get("node") if isinstance(n["args"][0], dict) else None)
        pid = int(n["args"][1])
        if pid in out or issue is None or issue.get("target") != "dc.allgather_param":
            continue
        shard = by.get(issue["args"][0]["node"]) if isinstance(issue["args"][0], dict) else None
        if shard is None or not isinstance(shard.get("shape"), list) or not isinstance(n.get("shape"), list):
            continue
        chunk = math.prod(shard["shape"])
        shape = tuple(int(s) for s in n["shape"])
        out[pid] = ParamMeta(id=pid, name=n.get("scope") or f"param{pid}", shape=shape, numel=math.prod(shape),
                             chunk=chunk, dtype=DTYPES.get(shard.get("dtype") or "", torch.float32),
                             gather_dtype=DTYPES.get(n.get("dtype") or "", torch.float32),
                             requires_grad=reduced is None or pid in reduced,
                             shard_shape=tuple(shard["shape"]) if len(shard["shape"]) > 1 else None)
    return out
