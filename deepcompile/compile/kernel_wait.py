"""Inductor's kernel waits deferred to the end of a multi-module compile (the regions of one graph,
or a forward and its backward), so that the worker pool compiles one module's kernels while the
next is lowered."""
from __future__ import annotations

import time


class blocks_deferred_kernel_wait:
    """Context: the regions of one graph are compiled one after the other, and each compiled
    module waits for its own kernels on load (``async_compile.wait(globals())`` in Inductor's
    generated code: ``AsyncCompile.wait`` -> ``_wait_futures``, which swaps each kernel future
    in the module's globals for its result; 2.11 and 2.13). A whole graph's kernels compile in
    the worker pool while its long codegen runs, so that wait is short (1.2 s at 32 layers on
    the H200 host); a region's codegen is short, so each region would wait for its slowest kernel
    in turn (about half of the Inductor phase). Here the wait of every module loaded
    inside the context is recorded instead, and all of them are done on exit, before any region
    runs: the pool compiles one region's kernels while the next region is lowered. Re-entrant:
    inside an outer context (the trace-once re-compile of a forward and its backward,
    ``Backend.retarget``), the outer one waits for all of them, so the forward's kernels
    compile while the backward is lowered (2.2 s of forward wait at 16 layers, H100).

    Nothing reads a module's kernels between its load and the wait (the generated ``call``
    looks them up in its globals when it runs). Only with a worker pool (``compile_threads``
    > 1): in process, ``wait`` has nothing to wait for. On an error the recorded waits are
    dropped with the regions they belong to. ``deferred`` counts the modules waited for."""

    _outer = None  # the outermost context open: inner ones leave their waits to it

    def __enter__(self):
        self.scopes: list = []
        self.deferred = 0
        self.wait_s = 0.0
        self._cls = None
        if blocks_deferred_kernel_wait._outer is not None:
            return self  # the outer context's wait records this one's modules too
        try:
            from torch._inductor import async_compile as ac
        except ImportError:  # pragma: no cover - another layout: every module waits on load
            return self
        cls = getattr(ac, "AsyncCompile", None)
        orig = getattr(cls, "wait", None) if cls is not None else None
        if orig is None or not callable(getattr(cls, "_wait_futures", None)) \
                or not callable(getattr(ac, "get_compile_threads", None)):
            return self  # not the wait we know: leave it alone
        scopes = self.scopes

        def wait(inst, scope):
            if ac.get_compile_threads() > 1 and not getattr(inst, "_metal_sources", None):
                scopes.append((inst, scope))
                return None
            return orig(inst, scope)

        self._cls, self._orig = cls, cls.__dict__.get("wait", orig)
        cls.wait = wait
        blocks_deferred_kernel_wait._outer = self
        return self

    def __exit__(self, exc_type, *exc):
        if self._cls is None:
            return False
        blocks_deferred_kernel_wait._outer = None
        self._cls.wait = self._orig
        if exc_type is None:
            t0 = time.perf_counter()
            for inst, scope in self.scopes:
                self._orig(inst, scope)
            self.wait_s = time.perf_counter() - t0
            self.deferred = len(self.scopes)
        self.scopes.clear()
        return False
