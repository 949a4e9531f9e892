"""Inductor's parallel kernel-compile workers, started when the backend is created so that they are
up by the first Inductor compile."""
from __future__ import annotations


def warm_inductor_pool() -> bool:
    """Start Inductor's parallel compile workers now, where a compile will need them later.

    ``torch.compile(backend="inductor")`` calls ``torch._inductor.async_compile.maybe_warm_pool()``
    in its backend entry (``torch/_dynamo/backends/inductor.py``, 2.11 and 2.13) before
    ``compile_fx``; a backend of its own that calls ``compile_fx`` (ours) never does, so the pool
    is started at the first Triton kernel of the first Inductor compile, and
    ``AsyncCompile.use_process_pool()`` answers False until a no-op job has come back from it:
    until the workers are up, kernels compile one by one in the main process. Our first Inductor
    compile comes after the warm-up and profiling steps (the default plan's step 2), so starting
    the pool at the backend's creation gives it those steps to come up. ``maybe_warm_pool`` itself
    does nothing without Triton, under ``TORCH_WARM_POOL=0`` and with ``compile_threads`` <= 1
    (``TORCHINDUCTOR_COMPILE_THREADS=1``). Returns whether the call was made (False where this
    torch lacks it: the pool then starts at the first kernel)."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # pragma: no cover - older/newer layouts: the pool starts lazily
        return False
    maybe_warm_pool()
    return True
