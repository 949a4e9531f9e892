"""Python's cyclic garbage collector paused while deepcompile compiles.

A compile makes millions of long-lived objects; :class:`paused_gc` keeps the collector from
walking that growing heap again and again (the class docstring has the figures). The backend
pauses it around each compile, ``deepcompile.api`` across the compiling steps.
"""
from __future__ import annotations

from deepcompile.compat import dynamo as dynamo_compat


class paused_gc:
    """Python's cyclic garbage collector off while we compile (re-entrant; a collector the user
    turned off stays off): ``with paused_gc()`` around one compile, or ``pause`` / ``resume``
    across a compiling step (``api``).

    A compile allocates millions of long-lived objects (FX nodes, fake tensors, sympy
    expressions, the planner's graph copies), and every time the heap grows by a quarter a full
    collection walks all of it again: on the CPU compile benchmark (32 layers,
    ``benchmarks/compile_cpu.py``) those took 4.1 s of a 30 s compile. Paused in the forwards
    of the compiling steps (``api``) and frozen between them, the heap is walked once, by one
    collection at the end of the last compiling step, which also frees the compile's garbage
    (10 unreachable objects of 1.07 million at 32 layers) before training starts. Between the
    steps (a notebook that stops after one) the collector runs as usual on everything newer."""

    depth = 0
    resumed = False
    dynamo_gc = None  # Dynamo's own collection after each frame, off while paused
    frozen = False    # objects frozen between two compiling steps (resume's freeze)
    theirs = False    # the user had frozen objects before our first freeze

    def __enter__(self):
        paused_gc.pause()
        return self

    def __exit__(self, *exc):
        paused_gc.resume()
        return False

    @staticmethod
    def pause() -> None:
        import gc

        if paused_gc.depth == 0:
            paused_gc.resumed = gc.isenabled()
            gc.disable()
            paused_gc.dynamo_gc = dynamo_compat.dynamo_gc_after_compile(False)
        paused_gc.depth += 1

    @staticmethod
    def resume(collect: bool = False, freeze: bool = False) -> None:
        """End one pause. The outermost: ``freeze`` moves every object alive now out of the
        collector's reach first (``gc.freeze``: between two compiling steps the collector runs,
        but only over what the user's loop makes, not the compile's heap); ``collect`` takes
        frozen objects back (``gc.unfreeze``) and runs the one full collection."""
        import gc

        paused_gc.depth -= 1
        if paused_gc.depth > 0:
            return
        dynamo_compat.dynamo_gc_after_compile(paused_gc.dynamo_gc)
        if not paused_gc.resumed:
            return  # the user's own gc.disable() stays
        if freeze and not collect:
            if not paused_gc.frozen:
                # objects the user froze (e.g. before forking workers) must stay frozen: then the
                # compile's heap stays frozen with them rather than unfreezing theirs at the end
                paused_gc.theirs = gc.get_freeze_count() > 0
            gc.freeze()
            paused_gc.frozen = True
        gc.enable()
        if collect:
            if paused_gc.frozen and not paused_gc.theirs:
                gc.unfreeze()
            paused_gc.frozen = False
            gc.collect()
