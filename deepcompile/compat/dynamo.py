"""Dynamo shims: compiled-module checks, nested regions, reset, dynamic marks, counters (torch 2.11
on the GPU machines, 2.13 here; each function names what it relies on)."""
from __future__ import annotations

from typing import Callable

import torch


def is_compiled_module(model) -> bool:
    """``torch.compile(model)`` returns an OptimizedModule (``torch._dynamo.eval_frame``, 2.11 and 2.13)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule)


def is_dynamo_error(e: BaseException) -> bool:
    """An error Dynamo raised while tracing (``torch._dynamo.exc.TorchDynamoException``: Unsupported,
    the graph-break errors of a higher-order op, ...; 2.11 and 2.13), not one from the user's code
    run eagerly or from a backend's compile (``BackendCompilerFailed`` wraps ours: excluded)."""
    from torch._dynamo import exc

    return isinstance(e, exc.TorchDynamoException) and not isinstance(e, exc.BackendCompilerFailed)


def nested_region(fn: Callable) -> Callable:
    """``torch.compiler.nested_compile_region`` (public since 2.8; 2.11 and 2.13): Dynamo traces a
    call of ``fn`` as an ``invoke_subgraph`` higher-order op and installs one body for every call
    whose traced graph and inputs' metadata are the same (keyed by the function object: every
    layer must call this one wrapper); AOTAutograd traces and partitions each distinct body once."""
    return torch.compiler.nested_compile_region(fn)


def reset_dynamo(model=None) -> None:
    """Drop every compiled graph (scheduled re-compile, re-initialising).

    ``torch._dynamo.reset()`` clears the code caches, but Dynamo also installs each compiled
    graph as a global ``__compiled_fn_<n>_<uuid>`` in the module whose frame it compiled
    (checked in 2.11 and 2.13), and reset leaves those behind: every old forward/backward
    graph stayed alive. After a reset no guarded code refers to them any more, so we delete
    them from the modules the model's code lives in.
    """
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


def mark_dynamic(t: torch.Tensor, dims) -> None:
    """Ask Dynamo to trace ``dims`` of ``t`` symbolically on the next compile instead of
    specialising on the first size and recompiling at the second (automatic dynamic shapes).
    ``maybe_mark_dynamic`` (public API, ``torch._dynamo.maybe_mark_dynamic`` in 2.11 and 2.13)
    still lets Dynamo specialise where the model's code needs a concrete size."""
    torch._dynamo.maybe_mark_dynamic(t, list(dims))


def dynamo_compile_seconds() -> float | None:
    """Seconds Dynamo has spent compiling frames in this process, backends included:
    ``torch._dynamo.utils.compilation_time_metrics["_compile.compile_inner"]`` (2.11 and 2.13),
    0.0 before the first compile (the key appears with it), None where the dict is missing. The
    backend subtracts its own time to get Dynamo's."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover
        return None
    return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))


def dynamo_gc_after_compile(on: bool | None) -> bool | None:
    """Set ``torch._dynamo.config.run_gc_after_compile`` (2.11 and 2.13: a ``gc.collect(1)``
    after every frame Dynamo compiles) and return its old value; None: leave it, where the
    flag does not exist. While ``backend.paused_gc`` holds the collector, that collection would
    walk every object the compile made so far (1 s at 32 layers on the CPU benchmark), which the
    pause's one collection at its end walks anyway."""
    cfg = torch._dynamo.config
    if on is None or not hasattr(cfg, "run_gc_after_compile"):
        return None
    old = bool(cfg.run_gc_after_compile)
    cfg.run_gc_after_compile = on
    return old


def dynamo_frames_compiled() -> int:
    """Frames Dynamo compiled so far (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``,
    2.11 and 2.13): what the trace-once test counts to see that the final compile traced nothing."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
