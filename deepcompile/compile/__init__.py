"""Compile machinery: the features that make deepcompile's compile fast and its graphs right,
built on the torch shims of ``deepcompile.compat``, one module each.

- ``pipeline``: AOTAutograd / Inductor entry points, the Inductor config we compile under, and
  the choice of compiling a graph whole or as block regions
- ``nested``: trace each distinct decoder block once (nested compile regions, flattened back)
- ``blocks``: compile each distinct decoder block once (regions of the final graph)
- ``block_regions``: the torch internals block regions are compiled and cached through
- ``kernel_wait``: Inductor's kernel waits deferred to the end of a multi-module compile
- ``trace_once``: the final compile re-uses the warm-up's partitioned graphs
- ``aot_seed``: AOTAutograd's cache seeded by the trace-once compile
- ``quiet_aot``: AOTAutograd's graph strings printed only when someone reads them
- ``boxed_graph``: compiled graphs that free their inputs after last use; the eager compiler
- ``inductor_pool``: Inductor's compile workers started early
- ``dynamic``: input dimensions that vary, agreed across ranks and marked dynamic
"""
