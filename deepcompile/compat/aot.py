"""AOTAutograd shims: the partitioner's recompute tag, boxed calls, input descriptors, the forward's
saved-output layout and output strides, cache counters (torch 2.11 on the GPU machines, 2.13
here; each function names what it relies on)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx


def tag_unshard_for_recompute(joint: fx.GraphModule) -> None:
    """Make the partitioner re-gather parameters in backward instead of saving them.

    Without this, the min-cut partitioner saves the full-size output of ``dc.unshard`` for
    backward (custom ops are never recomputed by default), keeping every gathered parameter
    alive from forward to backward: ZeRO-3 without its memory savings. The tag is the one
    activation checkpointing uses (``node.meta["recompute"]``, read by
    ``torch._functorch.partitioners.must_recompute`` in 2.11 and 2.13).
    """
    from torch.utils.checkpoint import CheckpointPolicy

    gathers = (torch.ops.dc.unshard.default, torch.ops.dc.unshard_block.default)
    for n in joint.graph.nodes:
        if n.op == "call_function" and n.target in gathers:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta.setdefault("ac_graph_id", -1)


def boxed(fn: Callable) -> Callable:
    """AOTAutograd calls compiled graphs with a boxed argument list (``make_boxed_func``, the same in
    2.11 and 2.13)."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(fn)


def aot_input_index(node: fx.Node) -> int | None:
    """The index into the Dynamo graph's example inputs of a placeholder of a partitioned graph:
    AOTAutograd's input descriptor (``node.meta["desc"]``, ``PlainAOTInput(idx)``, set by
    ``aot_module_simplified`` for the non-parameter inputs, which with Dynamo's inlined modules are
    all of them; 2.11 and 2.13). The partitioner shares the joint node's meta with the placeholder
    it makes in either graph, so a forward input saved for the backward keeps its descriptor."""
    from torch._functorch._aot_autograd.descriptors import PlainAOTInput

    d = node.meta.get("desc")
    return d.idx if type(d) is PlainAOTInput else None


def saved_outputs_start(fw: fx.GraphModule) -> int | None:
    """Index of the first forward output that is saved for backward (None if unknown).

    AOTAutograd's forward graph returns mutated inputs, user outputs and RNG offsets first and
    the saved activations after them; ``ViewAndMutationMeta.num_forward`` counts the former and
    sits on the tracing context while the forward compiler runs (2.11 and 2.13). Inductor also
    records ``user_visible_output_idxs`` on the output node, used when the context is missing.
    """
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    if meta is not None and hasattr(meta, "num_forward"):
        return int(meta.num_forward)
    out = next(n for n in fw.graph.nodes if n.op == "output")
    idxs = out.meta.get("user_visible_output_idxs")
    if idxs:
        return max(idxs) + 1
    return None


def forget_outputs(output_node: fx.Node, cleared: list[int]) -> None:
    """Tell Inductor that graph outputs we replaced by None carry no stride contract.

    AOTAutograd records ``user_visible_output_idxs`` / ``original_output_strides`` on the output
    node; Inductor 2.11 (graph.get_user_visible_output_strides) dereferences every listed output
    and crashes on a None. 2.13 tolerates it; dropping the indices is right for both.
    """
    idxs = output_node.meta.get("user_visible_output_idxs")
    if idxs is not None:
        output_node.meta["user_visible_output_idxs"] = type(idxs)(i for i in idxs if i not in set(cleared))


def report_output_strides():
    """Collect the strides Inductor gives the forward's outputs (``TracingContext.
    report_output_strides``, 2.11 and 2.13); a list filled while compiling, or None without a
    tracing context. AOTAutograd takes the saved activations' strides from it for backward."""
    return torch._guards.TracingContext.report_output_strides()


def aot_cache_hits() -> int:
    """AOTAutograd cache hits in this process so far (``torch._dynamo.utils.counters``, the
    counter AOTAutogradCache bumps on a hit: "aot_autograd"/"autograd_cache_hit", 2.11 and 2.13)."""
    from torch._dynamo.utils import counters

    return int(counters["aot_autograd"]["autograd_cache_hit"])
