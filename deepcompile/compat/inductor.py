"""Inductor shims: lowerings that keep the runtime's buffers out of Inductor's memory reuse, and
the ``del`` Inductor omits for them. Checked against torch 2.11 (GPU machines) and 2.13 (CI)."""
from __future__ import annotations

import warnings
from typing import Callable

import torch


def never_reuse_output(op) -> None:
    """Keep Inductor from reusing ``op``'s output (a gathered parameter the runtime keeps for later
    micro-batches) after its last use: the fallback lowering plus the output's name in
    ``V.graph.never_reuse_buffers``, which ``wrapper.can_reuse`` consults."""
    try:
        from torch._inductor import ir
        from torch._inductor.lowering import fallback_handler, register_lowering
        from torch._inductor.virtualized import V
    except ImportError:  # pragma: no cover - no Inductor: nothing can reuse the buffer
        return
    handler = fallback_handler(op, add_to_fallback_set=False)

    @register_lowering(op, type_promotion_kind=None)
    def _lower(*args, **kwargs):
        out = handler(*args, **kwargs)
        for t in (out if isinstance(out, (list, tuple)) else [out]):
            if isinstance(t, ir.TensorBox):
                V.graph.never_reuse_buffers.add(t.get_name())
        return out


def never_reuse_inputs(op, on_failure: Callable[[], None] | None = None) -> bool:
    """Keep Inductor from reusing ``op``'s inputs (``dc.reduce_grad``: the runtime's bucket holds the
    gradient, dead to the graph, until its asynchronous reduce-scatter has read it): the fallback
    lowering plus the fallback kernel's realized inputs (and what a NonOwningLayout aliases) in
    ``V.graph.never_reuse_buffers``, which ``wrapper.can_reuse`` consults for ``ReuseLine``s and
    in-place writes. False if Inductor is not as expected (the caller then copies every gradient).
    A lowering finding no fallback kernel warns and calls ``on_failure`` (at compile time)."""
    try:
        from torch._inductor import ir
        from torch._inductor.lowering import fallback_handler, register_lowering
        from torch._inductor.virtualized import V
    except ImportError:  # pragma: no cover - no Inductor: nothing can reuse the buffer
        return True
    if not (hasattr(ir, "NonOwningLayout") and hasattr(ir, "ExternKernel")):
        return False
    handler = fallback_handler(op, add_to_fallback_set=False)

    def keep(node, depth=0):
        if depth > 8 or not isinstance(node, ir.IRNode):
            return
        try:
            name = node.get_name()
        except Exception:  # noqa: BLE001 - an unnamed node is no buffer of its own
            return
        V.graph.never_reuse_buffers.add(name)
        # ... but still dropped (``del``) after its last use: see free_never_reused
        if not hasattr(V.graph, "dc_free_not_reuse"):
            V.graph.dc_free_not_reuse = set()
        V.graph.dc_free_not_reuse.add(name)
        try:
            layout = V.graph.get_buffer(name).get_layout()
        except Exception:  # noqa: BLE001 - a graph input or constant: never reused anyway
            return
        if isinstance(layout, ir.NonOwningLayout):
            keep(layout.view, depth + 1)

    free_never_reused()

    @register_lowering(op, type_promotion_kind=None)
    def _lower(*args, **kwargs):
        n0 = len(V.graph.operations)
        out = handler(*args, **kwargs)
        kernels = [o for o in V.graph.operations[n0:]
                   if isinstance(o, ir.ExternKernel) and getattr(o, "op_overload", None) is op]
        if not kernels:
            warnings.warn(f"deepcompile: the lowering of {op} found no fallback kernel in this torch "
                          f"({torch.__version__}); its inputs are copied instead of held "
                          "(deepcompile.compat.inductor.never_reuse_inputs needs updating)", stacklevel=2)
            if on_failure is not None:
                on_failure()
        for k in kernels:
            for inp in k.inputs:
                for t in (inp if isinstance(inp, (list, tuple)) else [inp]):
                    keep(t)
        return out

    return True


def free_never_reused() -> bool:
    """``PythonWrapperCodegen.codegen_free`` writes no ``del`` for ``never_reuse_buffers``, so the
    compiled backward would hold each gradient given to ``dc.reduce_grad(s)`` to its end (953M
    Llama on 2 H200s: 11.06 GiB peak, 10.2 profiled). For ``V.graph.dc_free_not_reuse`` the patch
    writes the ``del`` Inductor writes for graph inputs and marks the name freed (never freed twice;
    the bucket keeps the memory). False (nothing changed) where the wrapper is not as expected."""
    try:
        from torch._inductor.codegen import wrapper as W
        from torch._inductor.virtualized import V
    except ImportError:  # pragma: no cover
        return False
    cls = getattr(W, "PythonWrapperCodegen", None)
    if cls is None or not hasattr(cls, "make_buffer_free") or not hasattr(cls, "codegen_free"):
        return False
    if getattr(cls.codegen_free, "_dc_free_not_reuse", False):
        return True
    orig = cls.codegen_free

    def codegen_free(self, buffer):
        names = getattr(V.graph, "dc_free_not_reuse", None)
        name = buffer.get_name()
        if names and name in names:
            if name not in self.freed:
                self.freed.add(name)
                self.writeline(self.make_buffer_free(buffer))
            return
        return orig(self, buffer)
    codegen_free._dc_free_not_reuse = True
    cls.codegen_free = codegen_free
    return True
