"""How a Dynamo graph is compiled: AOTAutograd with our partitioner (``aot_compile``, the
aot_eager/eager path) or Inductor's front end end to end (``inductor_compile``), each partitioned
graph handed to the backend's ``compile_one`` (our passes, then ``inductor_inner``). The policy
lives here: the Inductor config every compile of ours runs under, when AOTAutograd's cache is on
(a salted plan-cache hit only), and whether a graph is compiled whole or as block regions."""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from deepcompile.compat import aot as aot_compat
from deepcompile.compile.quiet_aot import quiet_aot_graph_strings


def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
    """Min-cut partition after tagging gathers for recompute (the aot_eager/eager path)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    aot_compat.tag_unshard_for_recompute(joint)
    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def aot_compile(gm: fx.GraphModule, example_inputs, fw_compiler: Callable, bw_compiler: Callable,
                inference_compiler: Callable):
    """AOTAutograd with our partitioner: ``torch._dynamo.backends.common.aot_autograd`` is the
    helper every in-tree backend uses (same name and signature in 2.11 and 2.13)."""
    from torch._dynamo.backends.common import aot_autograd

    backend = aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                           inference_compiler=inference_compiler, partition_fn=partition,
                           keep_inference_input_mutations=True)
    with quiet_aot_graph_strings():
        return backend(gm, example_inputs)


def inductor_compile(gm: fx.GraphModule, example_inputs,
                     compile_one: Callable[[fx.GraphModule, list, str, dict], Callable],
                     aot_cache_salt: str | None = None):
    """Inductor's front end (pre-grad passes, decompositions, joint-graph passes, the min-cut
    partition) end to end, handing each partitioned forward/backward/inference graph to
    ``compile_one(graph, example_inputs, kind, kw)``, which runs our passes and compiles it:
    through ``inductor_inner(graph, inputs, **kw)`` for Inductor, or to Python code for the
    trace-once warm-up (compile/trace_once.py).

    ``compile_fx(..., inner_compile=...)`` is Inductor's own hook for wrapping the per-graph
    compile; it is called after AOTAutograd's partition with ``is_backward`` / ``is_inference``
    in its keyword arguments. The recompute tag goes in through ``joint_custom_pre_pass``, the
    config hook Inductor runs on the joint graph just before partitioning.
    """
    from torch._inductor import compile_fx as cfx

    def inner(g, inputs, **kw):
        kind = "backward" if kw.get("is_backward") else ("inference" if kw.get("is_inference") else "forward")
        if aot_cache_salt is None:
            return compile_one(g, inputs, kind, kw)
        # the graph's own compile under the unsalted uuid: Inductor's FX graph cache keys on it
        # too, and an entry from a run without the AOTAutograd cache stays a hit
        with torch._inductor.config.patch(inductor_patches()):
            return compile_one(g, inputs, kind, kw)

    # AOTAutograd's cache (on by default in 2.11 and 2.13) keys on the Dynamo graph, which is
    # the same before and after a pass-schedule switch, and a hit skips partitioning *and*
    # inner_compile: our passes would not run (no graph versions for the record, no offload
    # plan) and a different pass list could get the old artifact. Inductor's FX graph cache
    # stays on: it keys on the graph after our passes, so it is exact and keeps warm compiles fast.
    #
    # Where the passes and their parameters are fixed before the compile (a plan-cache hit at
    # step 0: aot_cache_salt names the plan), the cache is safe and is turned on: the salt goes
    # into the joint pass's uuid(), which AOTAutograd's key hashes with Inductor's config, so
    # another plan, pass list or deepcompile version never shares an entry. (The joint pass has
    # run by the time ``inner`` is called; there the uuid is the plain one again.)
    with torch._functorch.config.patch(enable_autograd_cache=aot_cache_salt is not None), quiet_aot_graph_strings():
        return cfx.compile_fx(gm, example_inputs, inner_compile=inner, config_patches=inductor_patches(aot_cache_salt))


def inductor_inner(gm: fx.GraphModule, example_inputs, **kw):
    """The one place a partitioned forward/backward/inference graph (after our passes) goes to
    Inductor: ``torch._inductor.compile_fx.compile_fx_inner`` (same name and signature in 2.11
    and 2.13; ``kw`` are the keyword arguments ``compile_fx`` passes to its ``inner_compile``:
    ``is_backward``, ``is_inference``, ``graph_id``, ``cudagraphs``, ``boxed_forward_device_index``,
    ...). Both the normal Inductor path and the trace-once re-compile come through here, so
    whatever compiles identical blocks once (blocks.py) changes only this body."""
    from torch._inductor import compile_fx as cfx

    from deepcompile.compile import blocks

    by_block = kw.pop("dc_blocks", None)  # blocks.resolve's mode (the backend's): "on", "auto" or None
    cudagraphs = kw.get("cudagraphs")
    if by_block and not (cudagraphs is not None and bool(getattr(cudagraphs, "value", cudagraphs))):
        fn = blocks.compile_graph(gm, example_inputs, cfx.compile_fx_inner, by_block, **kw)
        if fn is not None:
            return fn
    return cfx.compile_fx_inner(gm, example_inputs, **kw)


def inductor_patches(salt: str | None = None) -> dict:
    """The Inductor config every compile of ours runs under (compile_fx's ``config_patches``; the
    trace-once re-compile applies the same around ``inductor_inner``).

    reorder_for_peak_memory (on by default in 2.11 and 2.13) moves each allgather down to just
    before its wait, since that lowers peak memory, which undoes the prefetch pass. Our passes
    own where communication happens, within their own memory budget."""
    def joint_pass(graph: fx.Graph):
        aot_compat.tag_unshard_for_recompute(graph.owning_module)

    return {"joint_custom_pre_pass": _JointPass(joint_pass, salt), "reorder_for_peak_memory": False}


try:  # the base class exists in 2.11 and 2.13; Inductor hashes uuid() into its cache key
    from torch._inductor.custom_graph_pass import CustomGraphPass as _CGP
except ImportError:  # pragma: no cover
    _CGP = object


class _JointPass(_CGP):
    """A joint-graph pass Inductor can hash for its FX graph cache (CustomGraphPass protocol)."""

    def __init__(self, fn, salt: str | None = None):
        self.fn = fn
        self.salt = salt

    def __call__(self, graph):
        return self.fn(graph)

    def uuid(self):
        # The FX graph cache does not key on our lowerings, so this name changes with them, and a
        # cached artifact compiled under other lowerings is never reused: dc.reduce_grad's inputs
        # are never reused (compat.inductor.never_reuse_inputs; otherwise a gradient's memory is reused
        # while the runtime's bucket still holds it), the dc ops' ids are SymInt (blocks.py; int
        # ids would be pinned by guards in a block region), and the gradients handed to
        # dc.reduce_grad(s) are deleted after it (free_never_reused; otherwise they are held to
        # the end of the backward).
        return "deepcompile-tag-unshard-recompute-v4" + (f"-{self.salt}" if self.salt else "")
