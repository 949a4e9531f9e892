"""Trace once: the final compile re-uses the warm-up's partitioned graphs instead of tracing again.

The default plan compiles its final graphs at step 2 from the same model it traced at step 0.
Instead of dropping everything and tracing again (Dynamo + AOTAutograd: about a third of the
whole compile at 16 layers), the backend keeps each partitioned forward/backward graph
of the warm-up compile as it was before our passes, with what compiling it later needs (below),
re-runs only the passes and Inductor on a copy, and re-points the callable that AOTAutograd's
runtime wrapper already holds (compile/kept_graphs.Slot). Checked in torch 2.13 (CPU, here) and read in
2.11's source: compile_fx's inner_compile hook, TracingContext.report_output_strides and the
backward stride fix-up in _aot_autograd (2.11: jit_compile_runtime_wrappers.py, 2.13:
graph_compile.py::_aot_stage2b_bw_compile) have the same shape in both.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from deepcompile.compat import fx as fx_compat
from deepcompile.compile.pipeline import inductor_patches


class TracedGraph:
    """One partitioned graph of a warm-up compile, before our passes, with its compile state.

    ``gm`` is a deep copy (the passes rewrite the original in place). ``example_inputs`` are the
    fake tensors AOTAutograd handed the compiler; they belong to ``fake_mode``. ``tracing_context``
    is the TracingContext the compiler ran under: Inductor reads the forward's metadata from it
    (``fw_metadata``, also read by ``saved_outputs_start``) and reports output strides into it.
    ``kw`` are compile_fx's keyword arguments for its inner compile (empty when the warm-up ran
    through plain ``aot_compile``, i.e. the final compiler is not Inductor).
    """

    def __init__(self, gm: fx.GraphModule, example_inputs, kind: str, kw: dict):
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # as AOTAutograd copies its backward (lifted constants are real)
            self.gm = fx_compat.copy_graph(gm)
        self.example_inputs = list(example_inputs)
        self.kind = kind
        self.kw = dict(kw)
        self.renamed: dict[str, str] = {}  # a forward's names removed by nested.flatten (restride_saved)
        self.tracing_context = torch._guards.TracingContext.try_get()
        self.fake_mode = detect_fake_mode(self.example_inputs)
        self.symbolic = any(isinstance(x, torch.SymInt) or (
            isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride())))
            for x in self.example_inputs)


def fresh_copy(tg: TracedGraph) -> fx.GraphModule:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return fx_compat.copy_graph(tg.gm)


def trace_once_context(tg: TracedGraph):
    """The state the warm-up compiler ran in, re-entered for the final compile of ``tg``: its
    tracing context (fw_metadata, output strides), its fake mode as Inductor's ``V.fake_mode``,
    the python dispatcher, no_grad and no autocast as compile_fx / AOTAutograd compile under (2.11, 2.13),
    effect tokens unlifted as compile_fx asks, and our Inductor config patches."""
    import contextlib

    from torch._dispatch.python import enable_python_dispatcher

    stack = contextlib.ExitStack()
    if tg.tracing_context is not None:
        stack.enter_context(torch._guards.tracing(tg.tracing_context))
    if tg.kw:
        from torch._inductor import config as iconfig
        from torch._inductor.virtualized import V

        if tg.fake_mode is not None:
            stack.enter_context(V.set_fake_mode(tg.fake_mode))
        stack.enter_context(iconfig.patch(inductor_patches()))
        if hasattr(torch._functorch.config, "unlift_effect_tokens"):
            stack.enter_context(torch._functorch.config.patch(unlift_effect_tokens=True))
    stack.enter_context(enable_python_dispatcher())
    stack.enter_context(torch.no_grad())
    # AOTAutograd compiles its graphs with autocast off (a training loop under autocast re-compiles
    # at its first step): the graphs already carry their casts
    stack.enter_context(torch._C._DisableAutocast())
    return stack


def restride_saved(fw: fx.GraphModule, strides, bw: fx.GraphModule, bw_inputs: list,
                   renamed: dict[str, str] | None = None) -> tuple[list, int, list]:
    """The backward's example inputs with the strides the compiled forward really gives the saved
    activations: what AOTAutograd does between its forward and backward compile (2.11 and 2.13:
    ``fwd_output_strides[tensors_saved_for_backwards_slice]`` -> the backward's placeholder fake
    tensors, ``as_strided`` where they differ). Inductor may lay out a saved activation (not a user
    output, so not stride-constrained) differently from eager; a backward compiled for the eager
    strides would read it wrongly (Inductor asserts its input strides at run time).

    Saved activations are matched by name instead of by AOTAutograd's index arithmetic: the
    partitioner names each backward placeholder after the forward node it saves (both versions),
    and the names are those of the graphs before our passes (the passes keep the output arity,
    which the backend checks). Returns (inputs, how many were restrided, the backward placeholders
    other than tangents that name no forward output: non-empty means the naming assumption does
    not hold in this torch, and the caller must not trust the match). ``renamed``: forward names
    the flattening of nested regions removed -> the node standing for each (nested.flatten)."""
    out = next(n for n in fw.graph.nodes if n.op == "output")
    fw_outs = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    by_name = {}
    for n, st in zip(fw_outs, strides):
        if isinstance(n, fx.Node) and st is not None:
            by_name[n.name] = st
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    names = {n.name for n in fw_outs if isinstance(n, fx.Node)}
    for old, new in (renamed or {}).items():
        if new in names:
            names.add(old)
            if new in by_name:
                by_name[old] = by_name[new]
    unmatched = [p.name for p in placeholders if not p.name.startswith("tangents") and p.name not in names]
    inputs, changed = list(bw_inputs), 0
    for i, (ph, x) in enumerate(zip(placeholders, bw_inputs)):
        st = by_name.get(ph.name)
        if st is None or not isinstance(x, torch.Tensor) or len(st) != x.dim():
            continue
        st = tuple(int(s) for s in st)
        if tuple(x.stride()) != st:
            inputs[i] = x.as_strided(x.shape, st)
            changed += 1
    return inputs, changed, unmatched
