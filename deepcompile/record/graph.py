"""FX graph -> plain data (the record's graph format; also what tests inspect).

Each node: name, op, target, args (node names or literals), output shape and dtype, the
``nn.Module`` scope it came from, and the parameter id on communication ops. Optional:
``params`` (every parameter id of a fused collective or its wait), ``moved`` (what the prefetch
pass did with a collective: ``{"from", "to", "params", "first_use": {str(id): node}, "earlier",
"bytes"}``, see :mod:`deepcompile.passes.prefetch`) and ``source`` (the user's source line the
node came from, ``"file.py:12 in forward: x = self.fc(x)"``).
"""
from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.fx as fx

COMM_OPS = {"allgather_param", "allgather_params", "gather_persistent", "gather_persistent_many", "wait_allgather", "wait_allgather_many", "release_param", "reduce_grad", "reduce_grads", "end_backward",
            "unshard", "shard_grad"}


def target_name(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, str):
        return t
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}" + (
            f".{t._overloadname}" if t._overloadname not in ("default", "") else "")
    return getattr(t, "__name__", str(t))


def _arg(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return {"node": a.name}
    if isinstance(a, (list, tuple)):
        return [_arg(x) for x in a]
    if isinstance(a, dict):
        return {str(k): _arg(v) for k, v in a.items()}
    if isinstance(a, (int, float, bool, str)) or a is None:
        return a
    return repr(a)


def _shape(t: torch.Tensor) -> list:
    # symbolic sizes (dynamic shapes) as their expression: JSON has no SymInt
    return [int(s) if not isinstance(s, torch.SymInt) else str(s) for s in t.shape]


def _val(v: Any) -> tuple[list | None, str | None]:
    if isinstance(v, torch.Tensor):
        return _shape(v), str(v.dtype).replace("torch.", "")
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, torch.Tensor) for x in v):
        return [_shape(x) for x in v], "tuple"
    return None, None


def module_scope(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1]
    path = path[0] if isinstance(path, tuple) else path
    # Dynamo writes L['self'].layers[0].attn style paths; keep the dotted module path only
    path = str(path).replace("L['self'].", "").replace("L['self']", "")
    path = path.replace("._modules['", ".").replace("']", "").replace("['", ".").replace("]", "").replace("[", ".")
    path = path.replace("parametrizations.", "").strip(".")
    return path


_ACCESS = {"unshard", "dc.unshard", "dc.unshard_block", "dc.allgather_param", "dc.wait_allgather"}


def access_scope(module: str, pid: int) -> str:
    """The scope of a parameter access as the record keeps it: ``<module>.<attr>.0``, e.g.
    ``blocks.0.attn.qkv.weight.0`` (``report.graph_groups.param_module_scope`` reads the module
    back). It was the scope of the parametrization module Dynamo called; the getter now calls
    ``Unshard`` directly (``nn_compat.direct_parametrization_getter``), so the access is traced in the owning
    module's scope and the parameter's own name gives the rest."""
    from deepcompile.runtime import state

    meta = state.current().params.get(pid) if state.active() else None
    if meta is None:
        return module
    attr = meta.name.rsplit(".", 1)[-1]
    return f"{module}.{attr}.0" if module else f"{attr}.0"


_OWN = re.compile(r"/deepcompile/(?!models/)|/torch/")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


_SOURCES: dict[str, str | None] = {}  # stack trace -> source_line's answer (see source_line)
_SOURCES_MAX = 20_000  # (a trace is a few KiB: tens of MiB at most)


def source_line(n: fx.Node) -> str | None:
    """The innermost frame of the node's ``stack_trace`` (where in the user's code it came from):
    ``"model.py:42 in forward: y = self.fc(x)"``; None without a stack trace.

    Answers are kept per trace text: the record serializes each graph after every pass (a dozen
    times per compile at the default plan), and the same node carries the same trace string
    each time; parsing it again would be a tenth of the passes phase."""
    st = n.meta.get("stack_trace")
    if not st:
        return None
    st = str(st)
    hit = _SOURCES.get(st, _FRAME)  # (_FRAME: a sentinel no answer can be)
    if hit is not _FRAME:
        return hit
    if len(_SOURCES) >= _SOURCES_MAX:
        _SOURCES.clear()
    out = _SOURCES[st] = _source_line(st)
    return out


def _source_line(st: str) -> str | None:
    frames = _FRAME.findall(st)
    if not frames:
        return None
    # the innermost frame of the user's code: a gathered parameter's innermost frame is
    # deepcompile's own unshard wrapper (sharding.py), the line that used it is one further out
    user = [fr for fr in frames if not _OWN.search(fr[0].replace(os.sep, "/"))]
    f, line, fn, code = (user or frames)[-1]
    return f"{os.path.basename(f)}:{line} in {fn}: {code.strip()[:160]}"


def _moved(m: dict) -> dict:
    # JSON objects have string keys: first_use is {str(id): node name}
    return {"from": m.get("from"), "to": m.get("to"), "params": [int(p) for p in m.get("params", [])],
            "first_use": {str(k): str(v) for k, v in m.get("first_use", {}).items()},
            "earlier": int(m.get("earlier", 0)), "bytes": int(m.get("bytes", 0))}


def serialize(gm: fx.GraphModule) -> list[dict]:
    out = []
    for n in gm.graph.nodes:
        shape, dtype = _val(n.meta.get("val"))
        target = target_name(n)
        d = {"name": n.name, "op": n.op, "target": target, "args": _arg(list(n.args)),
             "shape": shape, "dtype": dtype, "scope": module_scope(n)}
        if kwargs := _arg(dict(n.kwargs)):
            d["kwargs"] = kwargs
        if "recompute_of" in n.meta:   # a forward node recompute_activations copied into backward
            d["recompute_of"] = str(n.meta["recompute_of"])
        dc = n.op == "call_function" and target.split(".")[0] == "dc"
        pid = n.meta.get("dc_param") if dc else None
        if pid is None and (dc or (n.op == "call_function" and target == "unshard")) and len(n.args) > 1 and isinstance(n.args[1], int):
            pid = n.args[1]  # Dynamo's graph names the op packet ("unshard"): a scope, no "param"
        # a root module's access has no stack; other runtime ops keep the scope they were given
        if pid is not None and ("nn_module_stack" in n.meta or target in _ACCESS):
            d["scope"] = access_scope(d["scope"], int(pid))
        if dc:
            if pid is not None:
                d["param"] = int(pid)
            pids = n.meta.get("dc_params")
            if pids is not None and len(pids) > 1:
                d["params"] = [int(p) for p in pids]
            if (m := n.meta.get("dc_moved")) is not None:
                d["moved"] = _moved(m)
        if (src := source_line(n)) is not None:
            d["source"] = src
        out.append(d)
    return out
