"""Compile time: AOTAutograd's graph strings, printed only when someone reads them.

AOTAutograd prints every joint, forward and backward graph it makes to a string
(``GraphModule.print_readable``: Python code generation for the whole graph, three times per
compiled graph) whether or not anyone reads it: ``_log_joint_graph`` / ``_log_fw_bw_graphs``
in ``torch._functorch._aot_autograd.graph_compile`` do it whenever ``AOTConfig.enable_log``,
which ``aot_module_simplified`` (Dynamo backends, compile_fx) always leaves on. The strings go
to the ``aot_joint_graph`` / ``aot_graphs`` logs (TORCH_LOGS), the structured trace
(TORCH_TRACE / tlparse) and an AOTAutograd cache entry (``aot_config.cache_info``, where they
serve the same readers on a hit). On the CPU profile of a 32-layer Llama they were 2-3 s of the
37 s AOTAutograd phase, growing with depth. While our compile runs, the two functions are
wrapped so that they run unchanged whenever one of those readers is there and return no
string otherwise. Checked: torch 2.13 (here; both functions, same signatures, the strings read
only by the logs, trace_structured and ``_cache_autograd_info`` under ``cache_info``) and the
same two functions in the 2.x source before 2.13 (read, not run). Anything else: untouched.
"""
from __future__ import annotations


_AOT_LOG_FNS = ("_log_joint_graph", "_log_fw_bw_graphs")


def _aot_graph_strings_wanted(aot_config) -> bool:
    """Whether anyone would read the graph strings AOTAutograd prints for ``aot_config``."""
    import logging

    from torch._functorch._aot_autograd import graph_compile as gc_mod

    if aot_config is None or not hasattr(aot_config, "cache_info"):  # not the AOTConfig we know: keep them
        return True
    # an AOTAutograd cache entry (cache_info) keeps them for the logs of the run that hits it; that
    # run prints them only to the same readers, and an entry without them (None) is valid
    try:
        from torch._logging._internal import trace_log
        if trace_log.handlers:  # TORCH_TRACE: trace_structured writes them
            return True
    except ImportError:  # pragma: no cover - another layout: keep the strings
        return True
    for name in ("aot_joint_log", "aot_graphs_log"):
        log = getattr(gc_mod, name, None)
        if log is None or log.isEnabledFor(logging.INFO):
            return True
    return False


class quiet_aot_graph_strings:
    """Context: AOTAutograd's graph-printing log functions skip the print when nobody reads it
    (see above). Re-entrant (a nested compile finds them already wrapped); restored on exit."""

    def __enter__(self):
        self.saved = {}
        try:
            from torch._functorch._aot_autograd import graph_compile as gc_mod
        except ImportError:  # pragma: no cover - another layout: nothing to skip
            return self
        self.mod = gc_mod
        for name in _AOT_LOG_FNS:
            fn = getattr(gc_mod, name, None)
            if fn is None or getattr(fn, "_dc_quiet", False):
                continue
            self.saved[name] = fn
            setattr(gc_mod, name, _quiet(fn, (None, None) if name == "_log_fw_bw_graphs" else None))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.mod, name, fn)
        return False


QUIET_SKIPPED = [0]  # graph prints skipped (tests/test_compile_time.py counts them)


def _quiet(fn, nothing):
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        aot_config = kwargs.get("aot_config", args[-1] if args else None)
        if _aot_graph_strings_wanted(aot_config):
            return fn(*args, **kwargs)
        QUIET_SKIPPED[0] += 1
        return nothing
    wrapper._dc_quiet = True
    return wrapper
