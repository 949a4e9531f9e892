"""Compiled graphs as AOTAutograd calls them (boxed: one argument list): ``boxed_graph`` clears
the list as Inductor's code does, so a backward frees its saved activations after their last use
instead of at its end; ``interpret`` is the ``eager`` compiler."""
from __future__ import annotations

from typing import Callable

import torch.fx as fx

from deepcompile.compat import aot as aot_compat


def boxed_graph(gm: fx.GraphModule) -> Callable:
    """``gm`` as a boxed callable that *clears* its argument list, as Inductor's code does.

    ``make_boxed_func(gm.forward)`` calls ``forward(*args)``: the caller's list keeps every
    input alive until the graph returns. For a backward those inputs are the forward's saved
    activations, so the warm-up steps (and the ``aot_eager`` compiler) held all of them to
    the end of the backward, about 2 GiB above the step's real peak on the 953M Llama (the
    graph's own code frees intermediates after their last use; only the inputs were stuck).
    ``torch.fx.graph._BoxedCodeGen`` (compiled autograd's, private; present in 2.11 and 2.13)
    generates ``forward(self, args_list)`` that unpacks and clears the list; placeholders are
    then freed after their last use like any other value. The code is generated once here from
    the graph as it is now, without changing ``gm``'s own codegen (its ``forward`` stays the
    positional one the passes, the profiler and Inductor see). Falls back to
    ``make_boxed_func`` where the class is missing or the graph has a pytree codegen."""
    try:
        from torch.fx.graph import CodeGen, _BoxedCodeGen
        from torch.fx.graph_module import _forward_from_src
    except ImportError:
        return aot_compat.boxed(_generated_forward(gm))
    g = gm.graph
    if type(g._codegen) is not CodeGen:
        return aot_compat.boxed(_generated_forward(gm))
    saved = g._codegen
    g._codegen = _BoxedCodeGen()
    try:
        code = g.python_code(root_module="self")
    finally:
        g._codegen = saved
    fn = _forward_from_src(code.src, code.globals)

    def run(args):
        return fn(gm, args)
    run._boxed_call = True
    return run


def _generated_forward(gm: fx.GraphModule) -> Callable:
    """``gm.forward`` with its code generated now: a lazy graph's (``lazy_graph``) ``forward``
    taken before that would check for the code and go through ``Module.__call__`` at every step."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    _LazyGraphModule.force_recompile(gm)
    return gm.forward


def interpret(gm: fx.GraphModule) -> Callable:
    """The `eager` inner compiler: run node by node with torch.fx.Interpreter."""
    def run(args):
        return fx.Interpreter(gm).boxed_run(args)
    run._boxed_call = True
    return run
