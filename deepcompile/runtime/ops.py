"""The Python face of the native runtime: op schemas' fake impls, autograd, and metadata.

``torch.ops.dc.unshard`` / ``torch.ops.dc.shard_grad`` are what tracing sees: a sharded
parameter becomes its full-shape value through ``unshard`` and its gradient goes back through
``shard_grad``. Both have real (synchronous) implementations, so an un-lowered graph still runs
correctly; the ``zero3`` pass lowers them to the asynchronous runtime ops
(``allgather_param`` / ``wait_allgather`` / ``release_param`` / ``reduce_grad`` / ``end_backward``).

Fake implementations need the full shape and dtype of each parameter; they come from the
parameter registry of this process's runtime state (``state.current().params``, filled by
:mod:`deepcompile.sharding` when parameters are registered). The fake impls and the Python
kernels of the offload ops run inside torch's dispatch, where nothing can be handed to them:
they reach the state through ``runtime.state.current()``, the one scoped global.
"""
from __future__ import annotations

import torch

from deepcompile.runtime import offload, optimizer_state, state
from deepcompile.runtime.build import load
from deepcompile.runtime.state import ParamMeta, ReduceLayout  # noqa: F401 - the registry's types, named here too


_REGISTERED = False
C = None  # the compiled extension module, once loaded
_BLOCK_LIB = None  # the Python-defined fragment of the dc namespace (the block forms below)


def _define_block_ops() -> None:
    """``dc::unshard_block`` / ``dc::shard_grad_block``: ``unshard`` and ``shard_grad`` with the
    parameter id as a 0-d CPU tensor instead of an int (deepcompile/compile/nested.py). Inside a decoder
    block traced once as a nested region, an int id would be a constant of the traced body and
    no two layers would share it; a tensor id is one more input of the body. The full shape and
    dtype (which the int form reads from the parameter registry by id) come as arguments, the same for
    every layer of a block. They exist only between Dynamo and our first pass: every compiled
    graph gets them back as the int forms (``nested.resolve_ids``); the eager impls (a model run
    outside the compile) call the int forms."""
    global _BLOCK_LIB
    if _BLOCK_LIB is not None:
        return
    lib = torch.library.Library("dc", "FRAGMENT")
    tags = (torch.Tag.cudagraph_unsafe,)
    lib.define("unshard_block(Tensor shard, Tensor pid, SymInt[] shape, ScalarType dtype) -> Tensor", tags=tags)
    lib.define("shard_grad_block(Tensor grad, Tensor pid, SymInt[] shape, ScalarType dtype) -> Tensor", tags=tags)

    def unshard_block(shard, pid, shape, dtype):
        return torch.ops.dc.unshard(shard, int(pid))

    def shard_grad_block(grad, pid, shape, dtype):
        return torch.ops.dc.shard_grad(grad, int(pid))

    lib.impl("unshard_block", unshard_block, "CompositeExplicitAutograd")
    lib.impl("shard_grad_block", shard_grad_block, "CompositeExplicitAutograd")

    def fake(t, pid, shape, dtype):
        return t.new_empty(shape, dtype=dtype)

    torch.library.register_fake("dc::unshard_block", fake, lib=lib)
    torch.library.register_fake("dc::shard_grad_block", fake, lib=lib)

    def setup(ctx, inputs, output):
        shard, ctx.pid = inputs[0], inputs[1]
        ctx.shape, ctx.dtype = list(shard.shape), shard.dtype

    def backward(ctx, grad):
        return torch.ops.dc.shard_grad_block(grad, ctx.pid, ctx.shape, ctx.dtype), None, None, None

    torch.library.register_autograd("dc::unshard_block", backward, setup_context=setup, lib=lib)
    _BLOCK_LIB = lib


def _meta(pid: int) -> ParamMeta:
    if isinstance(pid, torch.SymInt):
        # a block region's id is a symbolic input (deepcompile/compile/blocks.py): its shapes are those of
        # the id it was compiled with (the hint), read without a guard so Inductor never
        # specialises the shared region on one layer's id
        from deepcompile.compat import fx as fx_compat

        pid = fx_compat.size_hint(pid, -1)
    params = state.current().params
    try:
        return params[pid]
    except KeyError:
        raise RuntimeError(
            f"deepcompile: unknown parameter id {pid} while tracing; parameters known: {len(params)}. "
            "Was the model initialised with deepcompile.initialize in this process?"
        ) from None


def ensure_registered():
    """Load the extension and register fake impls and autograd (idempotent)."""
    global _REGISTERED, C
    if _REGISTERED:
        return C
    C = load()
    lib = torch.library

    @lib.register_fake("dc::unshard")
    def _(shard, pid):
        m = _meta(pid)
        return shard.new_empty(m.shape, dtype=m.gather_dtype)

    @lib.register_fake("dc::shard_grad")
    def _(grad, pid):
        m = _meta(pid)
        return grad.new_empty(m.local_shape, dtype=m.dtype)

    @lib.register_fake("dc::allgather_param")
    def _(shard, pid):
        return shard.new_empty((0,))

    @lib.register_fake("dc::allgather_params")
    def _(shards, pids):
        return shards[0].new_empty((0,))

    @lib.register_fake("dc::wait_allgather")
    def _(handle, pid):
        m = _meta(pid)
        return handle.new_empty(m.shape, dtype=m.gather_dtype)

    @lib.register_fake("dc::wait_allgather_many")
    def _(handle, pids):
        return [handle.new_empty(_meta(p).shape, dtype=_meta(p).gather_dtype) for p in pids]

    @lib.register_fake("dc::gather_persistent")
    def _(shard, pid):
        m = _meta(pid)
        return shard.new_empty(m.shape, dtype=m.gather_dtype)

    @lib.register_fake("dc::gather_persistent_many")
    def _(shards, pids):
        return [s.new_empty(_meta(p).shape, dtype=_meta(p).gather_dtype) for s, p in zip(shards, pids)]

    @lib.register_fake("dc::gather_persistent_start")
    def _(shards, pids):
        return shards[0].new_empty((0,))

    @lib.register_fake("dc::gather_persistent_wait")
    def _(handle, pids):
        return [handle.new_empty(_meta(p).shape, dtype=_meta(p).gather_dtype) for p in pids]

    @lib.register_fake("dc::release_param")
    def _(gathered, pid):
        return None

    @lib.register_fake("dc::reduce_grad")
    def _(grad, pid):
        return None

    @lib.register_fake("dc::reduce_grads")
    def _(grads, pids):
        return None

    @lib.register_fake("dc::end_backward")
    def _(grads, graph_id):
        return None

    def _setup(ctx, inputs, output):
        ctx.pid = inputs[1]

    def _backward(ctx, grad):
        return torch.ops.dc.shard_grad(grad, ctx.pid), None

    lib.register_autograd("dc::unshard", _backward, setup_context=_setup)
    _define_block_ops()

    # Side-effect ops must survive dead-code elimination (FX and Inductor); their schemas
    # already declare a mutated argument, this adds the explicit mark where torch has it.
    from deepcompile.compat import fx as fx_compat
    from deepcompile.compat import inductor as inductor_compat

    for op in (torch.ops.dc.release_param.default, torch.ops.dc.reduce_grad.default,
               torch.ops.dc.reduce_grads.default, torch.ops.dc.end_backward.default):
        fx_compat.mark_side_effect(op)
    inductor_compat.never_reuse_output(torch.ops.dc.gather_persistent.default)
    inductor_compat.never_reuse_output(torch.ops.dc.gather_persistent_many.default)
    inductor_compat.never_reuse_output(torch.ops.dc.gather_persistent_wait.default)
    # reduce_grad's bucket holds the gradient itself until its reduce-scatter has run (no copy):
    # Inductor must not hand that memory to a later buffer. Where the lowering cannot be
    # installed the runtime copies each gradient instead.
    for op in (torch.ops.dc.reduce_grad.default, torch.ops.dc.reduce_grads.default):
        if not inductor_compat.never_reuse_inputs(op, on_failure=lambda: C.set_copy_grads(True)):
            C.set_copy_grads(True)
    # their kernels act on the current runtime state's copy engine and optimizer-state manager
    offload.define_ops({**offload.activation_ops(lambda: state.current().offload),
                        **optimizer_state.graph_ops(lambda: state.current().optimizer_state)})
    _REGISTERED = True
    return C
