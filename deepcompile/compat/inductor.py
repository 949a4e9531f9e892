"""Inductor shims: lowerings that keep the runtime's buffers out of Inductor's memory reuse, and
the ``del`` Inductor omits for them (torch 2.11 on the GPU machines, 2.13 here; each function
names what it relies on)."""
from __future__ import annotations

from typing import Callable

import torch


def never_reuse_output(op) -> None:
    """Inductor must never write into the tensor ``op`` returns (a gathered parameter the runtime
    keeps for later micro-batches): after its last use Inductor would otherwise hand its memory
    to a later buffer of the same size. The lowering is the default fallback plus the output's
    name in ``V.graph.never_reuse_buffers``, which ``wrapper.can_reuse`` consults (2.11, 2.13).
    """
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
    """Inductor must never reuse the memory of the tensors passed to ``op`` (``dc.reduce_grad``:
    the runtime's bucket holds the gradient itself, not a copy, until its asynchronous
    reduce-scatter has read it). After the op, the gradient is dead to the graph, and Inductor
    would hand its buffer to a later one of the same size (a ``ReuseLine``) or let a kernel write
    its output in place into it. The lowering is the default fallback plus the names of the
    buffers the fallback kernel reads in ``V.graph.never_reuse_buffers``, which
    ``wrapper.can_reuse`` consults for both (codegen_free / FreeIfNotReusedLine and the
    scheduler's in-place decision: 2.11, 2.13). The names are taken from the kernel's own
    inputs, after the fallback realized them, so a copy Inductor made of a view is the buffer
    kept; a buffer that only aliases another (NonOwningLayout, e.g. a slice of a cat) keeps
    the one it aliases too. Returns False where Inductor's internals are not as expected (the
    caller then copies every gradient); True also where there is no Inductor at all. If a
    lowering later finds no fallback kernel to read the buffers from, it calls ``on_failure``
    (at compile time, before the graph ever runs) and warns.
    """
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
            import warnings

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
    """Inductor's wrapper emits no ``del`` at all for a buffer in ``never_reuse_buffers``
    (``PythonWrapperCodegen.codegen_free`` returns early when ``can_reuse`` is False: 2.11,
    2.13), so every gradient handed to ``dc.reduce_grad(s)`` stayed referenced by the compiled
    backward until it returned: on 2 H200s (953M Llama, 16 layers) the step's forward/backward
    peak was 11.06 GiB where the profiled graph, which drops them, predicted 10.2. For the
    buffers ``never_reuse_inputs`` marks (``V.graph.dc_free_not_reuse``) the patched method
    writes the plain ``del`` Inductor writes for graph inputs ("can be freed but not reused")
    and records the name as freed, so it is neither reused nor freed twice. ``del`` only drops
    the graph's reference: the runtime's bucket keeps the memory until its reduce-scatter has
    read it. Returns False where the wrapper is not as expected (then nothing changes)."""
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
