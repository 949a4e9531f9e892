"""Dynamo shims: compiled-module and error checks, reset, the GC after compile, counters. Checked
against torch 2.11 (GPU machines) and 2.13 (CI)."""
from __future__ import annotations

import torch


def is_compiled_module(model) -> bool:
    """``torch.compile(model)`` returns an OptimizedModule (``torch._dynamo.eval_frame``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule)


def is_dynamo_error(e: BaseException) -> bool:
    """An error Dynamo raised while tracing (``torch._dynamo.exc.TorchDynamoException``: Unsupported,
    a higher-order op's graph-break errors, ...), not one from the user's code run eagerly or from
    a backend's compile (``BackendCompilerFailed`` wraps ours: excluded)."""
    from torch._dynamo import exc

    return isinstance(e, exc.TorchDynamoException) and not isinstance(e, exc.BackendCompilerFailed)


def reset_dynamo(model=None) -> None:
    """Drop every compiled graph. ``torch._dynamo.reset()`` leaves alive the globals
    ``__compiled_fn_<n>_<uuid>`` Dynamo puts in each compiled frame's module; no guarded code refers
    to them after the reset, so they are deleted from the modules of the model's code."""
    import sys

    torch._dynamo.reset()
    names = {type(m).__module__ for m in model.modules()} if model is not None else set(sys.modules)
    for name in names:
        mod = sys.modules.get(name)
        g = getattr(mod, "__dict__", None)
        if not isinstance(g, dict):
            continue
        for k in [k for k in g if k.startswith("__compiled_fn_")]:
            del g[k]


def dynamo_compile_seconds() -> float | None:
    """Seconds Dynamo compiled frames in this process, backends included (the backend subtracts its
    own): ``utils.compilation_time_metrics["_compile.compile_inner"]``, 0.0 before it exists, or None."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover
        return None
    return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))


def dynamo_gc_after_compile(on: bool | None) -> bool | None:
    """Set ``torch._dynamo.config.run_gc_after_compile`` and return its old value (None: leave it or
    no such flag). While ``paused_gc`` holds the collector, its ``gc.collect(1)`` after every frame
    walks all the compile made (1 s at 32 CPU layers), which the pause's last collection walks anyway."""
    cfg = torch._dynamo.config
    if on is None or not hasattr(cfg, "run_gc_after_compile"):
        return None
    old = bool(cfg.run_gc_after_compile)
    cfg.run_gc_after_compile = on
    return old


def dynamo_frames_compiled() -> int:
    """Frames Dynamo compiled so far (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``):
    the trace-once test counts them to see that the final compile traced nothing."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
