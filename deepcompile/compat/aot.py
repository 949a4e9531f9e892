"""AOTAutograd shims: the partitioner's recompute tag, boxed calls, input descriptors, the forward's
saved-output layout and output strides, cache counters. Checked against torch 2.11 (GPU machines)
and 2.13 (CI) unless a function says otherwise."""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx


def tag_unshard_for_recompute(joint: fx.GraphModule) -> None:
    """Make the partitioner re-gather parameters in backward: it never recomputes custom ops by
    default, so it would save every gathered parameter for backward (ZeRO-3 without its savings).
    Sets activation checkpointing's ``node.meta["recompute"]``, read by ``partitioners.must_recompute``."""
    from torch.utils.checkpoint import CheckpointPolicy

    gathers = (torch.ops.dc.unshard.default, torch.ops.dc.unshard_block.default)
    for n in joint.graph.nodes:
        if n.op == "call_function" and n.target in gathers:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta.setdefault("ac_graph_id", -1)


def boxed(fn: Callable) -> Callable:
    """AOTAutograd calls compiled graphs with a boxed argument list (``make_boxed_func``)."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(fn)


def aot_input_index(node: fx.Node) -> int | None:
    """A partitioned graph's placeholder's index into the Dynamo graph's example inputs: AOTAutograd's
    ``node.meta["desc"]``, the ``PlainAOTInput(idx)`` ``aot_module_simplified`` sets on every
    non-parameter input (all, as Dynamo inlines modules), shared by the partitioner with both graphs."""
    from torch._functorch._aot_autograd.descriptors import PlainAOTInput

    d = node.meta.get("desc")
    return d.idx if type(d) is PlainAOTInput else None


def saved_outputs_start(fw: fx.GraphModule) -> int | None:
    """Index of the first forward output saved for backward, after mutated inputs, user outputs and
    RNG offsets: ``ViewAndMutationMeta.num_forward`` on the tracing context while the forward
    compiler runs, else Inductor's ``user_visible_output_idxs`` on the output node, else the
    output descriptors, else None."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    if meta is not None and hasattr(meta, "num_forward"):
        return int(meta.num_forward)
    out = next(n for n in fw.graph.nodes if n.op == "output")
    idxs = out.meta.get("user_visible_output_idxs")
    if idxs:
        return max(idxs) + 1
    # outside the compile (the planner's copies of the profiled graphs): the partitioner's output
    # descriptors (``node.meta["desc"]``, 2.11 and 2.13), the saved values' being
    # SavedForBackwards(NoVcCheck)AOTOutput
    try:
        from torch._functorch._aot_autograd.descriptors import (SavedForBackwardsAOTOutput,
                                                                SavedForBackwardsNoVcCheckAOTOutput)
    except ImportError:  # pragma: no cover
        return None
    descs = out.meta.get("desc")
    if not isinstance(descs, (list, tuple)) or not descs:
        return None
    saved = (SavedForBackwardsAOTOutput, SavedForBackwardsNoVcCheckAOTOutput)
    first = next((i for i, d in enumerate(descs) if isinstance(d, saved)), len(descs))
    return first if all(isinstance(d, saved) for d in descs[first:]) else None


def forget_outputs(output_node: fx.Node, cleared: list[int]) -> None:
    """Drop graph outputs we replaced by None from AOTAutograd's ``user_visible_output_idxs`` on
    the output node: Inductor 2.11 (``graph.get_user_visible_output_strides``) dereferences every
    listed output and crashes on a None; 2.13 tolerates it."""
    idxs = output_node.meta.get("user_visible_output_idxs")
    if idxs is not None:
        output_node.meta["user_visible_output_idxs"] = type(idxs)(i for i in idxs if i not in set(cleared))


def report_output_strides():
    """The list ``TracingContext.report_output_strides`` fills with the forward outputs' strides in
    Inductor (None without a context); AOTAutograd gives the saved activations these in backward."""
    return torch._guards.TracingContext.report_output_strides()


def aot_cache_hits() -> int:
    """AOTAutograd cache hits in this process so far: the counter AOTAutogradCache bumps on a hit,
    ``torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"]``."""
    from torch._dynamo.utils import counters

    return int(counters["aot_autograd"]["autograd_cache_hit"])
