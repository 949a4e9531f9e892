"""Every touch of torch internals, in one place.

Checked against torch 2.11.0 (the GPU machines) and 2.13.0 (CI). Each function says why it is
needed. Public extension points are used wherever torch has one: custom ops with fake impls
(``torch.library``), a ``torch.compile`` backend function, FX passes, ``torch.nn.utils.parametrize``.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.fx as fx


def mark_side_effect(op) -> None:
    """Keep a side-effect-only op through FX dead-code elimination.

    Our side-effect ops also declare a mutated argument in their schema, which is what Inductor
    (2.11 and 2.13) checks; ``torch.fx.node.has_side_effect`` covers FX's own DCE and, in 2.13,
    Inductor's ``is_impure`` too.
    """
    fn = getattr(torch.fx.node, "has_side_effect", None)
    if fn is not None:
        fn(op)


def gpu_spin(cycles: int) -> None:
    """Enqueue a kernel that spins for ``cycles`` GPU clock cycles on the current stream.

    The profiler parks the compute stream with it so that its CUDA events time kernels, not the
    interpreter (``profile.profiler._GpuLead``). ``torch.cuda._sleep`` is private (it backs
    torch's own stream tests) and has the same signature in 2.11 and 2.13.
    """
    torch.cuda._sleep(int(cycles))


def direct_parametrization_getter(mod, attr: str) -> None:
    """Make ``mod.<attr>`` call the parametrization's ``forward`` on the original directly.

    The property ``torch.nn.utils.parametrize.register_parametrization`` installs runs
    ``ParametrizationList.__call__`` (a module call), ``self[0]`` (a ``ModuleList`` index), the
    parametrization's module call and a ``hasattr`` that misses (it looks for a second
    parametrization) at every access. Dynamo inlines all of that at every access of every layer:
    it doubled the Dynamo trace of a 16-layer CPU Llama. This
    getter reads the same original and calls the same (single) parametrization, held in the
    list's ``__dict__`` so that ``deepcopy`` copies it with the list; the setter is kept.

    Internal: the property lives on the class parametrize made for this module alone
    (``_inject_new_class``, 2.11 and 2.13); it is replaced there and nowhere else. The getter
    reads everything through ``self``, so it stays right for any module of that class."""
    from torch.nn.utils import parametrize

    cls = type(mod)
    prop = cls.__dict__.get(attr)
    plist = mod.parametrizations[attr]
    if not (parametrize.is_parametrized(mod, attr) and isinstance(prop, property) and len(plist) == 1
            and plist.is_tensor):
        raise RuntimeError(f"deepcompile: {cls.__name__}.{attr} is not a single parametrization of one tensor "
                           "as torch.nn.utils.parametrize installs it; this torch version is not supported")
    plist.__dict__["dc_parametrization"] = plist[0]

    def unsharded(self, _name=attr):
        p = self.parametrizations[_name]
        return p.dc_parametrization.forward(p.original)

    setattr(cls, attr, property(unsharded, prop.fset))


def is_compiled_module(model) -> bool:
    """``torch.compile(model)`` returns an OptimizedModule (torch._dynamo.eval_frame)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule)


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


# --- nested regions (deepcompile/nested.py) --------------------------------------------------

def nested_region(fn: Callable) -> Callable:
    """``torch.compiler.nested_compile_region`` (public since 2.8; 2.11 and 2.13): Dynamo traces a
    call of ``fn`` as an ``invoke_subgraph`` higher-order op and installs one body for every call
    whose traced graph and inputs' metadata are the same (keyed by the function object: every
    layer must call this one wrapper); AOTAutograd traces and partitions each distinct body once."""
    return torch.compiler.nested_compile_region(fn)


_SCHEMA_CACHE = None


def cache_nested_region_schemas() -> bool:
    """One schema per distinct body and operand metadata for ``invoke_subgraph`` (torch 2.11).

    ``InvokeSubgraphHOP.gen_schema`` re-traces the body (``materialize_as_graph``) at every call it
    is asked for, and 2.11 asks at every layer's call in each of AOTAutograd's passes over the
    graph (autograd's ``maybe_run_autograd``, functionalization's alias/mutation checks): 80 traces
    of the body at 16 layers, 8 of the 8.4 s of Dynamo+AOTAutograd under cProfile on this CPU, which
    made the nested trace slower than the flat one (on the H100 host: AOTAutograd 17.3 s against
    12.4). The schema is a function of the body and its operands' types and tensor metadata only
    (``HopSchemaGenerator`` records argument types and whether the body mutates each; the outputs'
    types), so it is cached on (body, identifier, that metadata); the body is held weakly. 2.13
    does not re-trace per call (measured: no such cost), and is left as it is. Returns whether the
    cache is installed."""
    global _SCHEMA_CACHE
    if _SCHEMA_CACHE is not None:
        return True
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13):
        return False
    import weakref

    try:
        from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP
    except ImportError:  # pragma: no cover
        return False
    original = InvokeSubgraphHOP.gen_schema
    cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def meta(o):
        if isinstance(o, torch.Tensor):
            return (type(o).__name__, tuple(o.shape), tuple(o.stride()), o.dtype, o.device.type,
                    o.requires_grad, o.storage_offset())
        return (type(o).__name__,)

    def gen_schema(self, subgraph, identifier, *operands):
        body = getattr(subgraph, "subgraph", subgraph)
        try:
            key = (identifier, tuple(meta(o) for o in operands))
            per_body = cache.setdefault(body, {})
        except TypeError:  # unhashable metadata (symbolic sizes) or a body weakref cannot hold
            return original(self, subgraph, identifier, *operands)
        hit = per_body.get(key)
        if hit is None:
            hit = per_body[key] = original(self, subgraph, identifier, *operands)
        return hit

    InvokeSubgraphHOP.gen_schema = gen_schema
    _SCHEMA_CACHE = cache
    return True


def is_dynamo_error(e: BaseException) -> bool:
    """An error Dynamo raised while tracing (``torch._dynamo.exc.TorchDynamoException``: Unsupported,
    the graph-break errors of a higher-order op, ...; 2.11 and 2.13), not one from the user's code
    run eagerly or from a backend's compile (``BackendCompilerFailed`` wraps ours: excluded)."""
    from torch._dynamo import exc

    return isinstance(e, exc.TorchDynamoException) and not isinstance(e, exc.BackendCompilerFailed)


def aot_input_index(node: fx.Node) -> int | None:
    """The index into the Dynamo graph's example inputs of a placeholder of a partitioned graph:
    AOTAutograd's input descriptor (``node.meta["desc"]``, ``PlainAOTInput(idx)``, set by
    ``aot_module_simplified`` for the non-parameter inputs, which with Dynamo's inlined modules are
    all of them; 2.11 and 2.13). The partitioner shares the joint node's meta with the placeholder
    it makes in either graph, so a forward input saved for the backward keeps its descriptor."""
    from torch._functorch._aot_autograd.descriptors import PlainAOTInput

    d = node.meta.get("desc")
    return d.idx if type(d) is PlainAOTInput else None


def _restack(stack: dict | None, depth: int, call_stack: list) -> dict | None:
    """A body node's module scope as it would read at this call: the body was traced at the first
    call (its scope names that layer), so the call's own scope replaces the first ``depth`` entries
    and that layer's path prefix in the deeper ones."""
    if not stack or depth == 0 or len(stack) < depth:
        return stack
    items = list(stack.items())
    old = items[depth - 1][1][0] if isinstance(items[depth - 1][1], (tuple, list)) else str(items[depth - 1][1])
    new = call_stack[depth - 1][1][0] if isinstance(call_stack[depth - 1][1], (tuple, list)) else str(call_stack[depth - 1][1])
    out = dict(call_stack[:depth])
    for k, v in items[depth:]:
        path, rest = (v[0], tuple(v[1:])) if isinstance(v, (tuple, list)) else (str(v), ())
        if path == old or path.startswith(old + "."):
            path = new + path[len(old):]
        out[f"{k}@{new}"] = (path, *rest)
    return out


def rename_node(n: fx.Node, name: str) -> None:
    """Give ``n`` the name ``name`` if its graph has not used it (``Node._rename``, 2.11 and 2.13:
    the namespace's next free name for the candidate, so a used name gets a suffix instead)."""
    n._rename(name)


def inline_subgraphs(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """Replace every ``invoke_subgraph`` call of a partitioned graph by a copy of its body, in place
    (nested calls too). The HOP's form (2.11 and 2.13): ``invoke_subgraph(get_attr body, identifier,
    *operands)``, a tuple whose elements its users take with ``getitem``; the body's placeholders are
    the operands in order. Each copied node keeps its meta, with its module scope rewritten to the
    call's layer (``_restack``). Returns, for every ``getitem`` removed, the node that now stands for
    it: the partitioner names a backward input after the forward node it receives (a value the
    forward saved), so the backward graph's placeholders can be matched to the forward's values."""
    import operator

    aliases: dict[str, fx.Node] = {}
    g = gm.graph
    hop = torch.ops.higher_order.invoke_subgraph
    while True:
        calls = list(g.find_nodes(op="call_function", target=hop))
        if not calls:
            break
        for call in calls:
            body_ref, operands = call.args[0], call.args[2:]
            body = getattr(gm, body_ref.target)
            phs = [n for n in body.graph.nodes if n.op == "placeholder"]
            if len(phs) != len(operands):
                raise RuntimeError(f"deepcompile: {call.name} passes {len(operands)} operands to a body "
                                   f"with {len(phs)} inputs")
            call_stack = list((call.meta.get("nn_module_stack") or call.meta.get("fwd_nn_module_stack") or {}).items())
            depth = len(call_stack)
            env: dict[fx.Node, Any] = dict(zip(phs, operands))
            outs: tuple = ()
            with g.inserting_before(call):
                for n in body.graph.nodes:
                    if n.op == "placeholder":
                        continue
                    if n.op == "output":
                        outs = tuple(fx.map_arg(n.args[0], lambda x: env[x]))
                        continue
                    if n.op == "get_attr":
                        attr = f"_dc_inlined_{body_ref.target}_{n.target}".replace(".", "_")
                        if not hasattr(gm, attr):
                            setattr(gm, attr, getattr(body, n.target))
                        new = g.get_attr(attr)
                        new.meta = dict(n.meta)
                    else:
                        new = g.node_copy(n, lambda x: env[x])
                        new.meta = dict(n.meta)
                    for key in ("nn_module_stack", "fwd_nn_module_stack"):
                        if key in new.meta:
                            new.meta[key] = _restack(new.meta[key], depth, call_stack)
                    env[n] = new
            copies = {env[n] for n in body.graph.nodes if n.op not in ("placeholder", "output")}
            for u in list(call.users):
                if u.op != "call_function" or u.target is not operator.getitem:
                    raise RuntimeError(f"deepcompile: {u.format_node()} uses {call.name} other than by getitem")
                v = outs[u.args[1]]
                name = u.name
                if isinstance(v, fx.Node):
                    aliases[name] = v
                    u.replace_all_uses_with(v, propagate_meta=False)
                elif u.users:
                    raise RuntimeError(f"deepcompile: {u.name} takes a non-tensor output ({v!r}) of {call.name}")
                g.erase_node(u)
                if isinstance(v, fx.Node) and v in copies:
                    # the copy takes the name of the getitem it replaces: the partitioner names a
                    # backward input after the forward value it receives (restride, offload plans
                    # and our ids match on it). The erased getitem's name is unique among the live
                    # nodes and stays reserved in the graph's namespace, so no new node takes it
                    # (Node._rename would pick a fresh name instead).
                    copies.discard(v)
                    v.name = name
            g.erase_node(call)
            if not body_ref.users:
                g.erase_node(body_ref)
    for name, _ in list(gm.named_children()):
        if not any(n.op == "get_attr" and n.target == name for n in g.nodes) and isinstance(getattr(gm, name), fx.GraphModule):
            delattr(gm, name)
    for k, v in list(aliases.items()):  # an alias of an alias (nested calls): the final node
        while v.name in aliases and aliases[v.name] is not v:
            v = aliases[v.name]
        aliases[k] = v
    return aliases


def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
    """Min-cut partition after tagging gathers for recompute (the aot_eager/eager path)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    tag_unshard_for_recompute(joint)
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


def boxed(fn: Callable) -> Callable:
    """AOTAutograd calls compiled graphs with a boxed argument list."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(fn)


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
        return boxed(_generated_forward(gm))
    g = gm.graph
    if type(g._codegen) is not CodeGen:
        return boxed(_generated_forward(gm))
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


def inductor_compile(gm: fx.GraphModule, example_inputs,
                     compile_one: Callable[[fx.GraphModule, list, str, dict], Callable],
                     aot_cache_salt: str | None = None):
    """Inductor's front end (pre-grad passes, decompositions, joint-graph passes, the min-cut
    partition) end to end, handing each partitioned forward/backward/inference graph to
    ``compile_one(graph, example_inputs, kind, kw)``, which runs our passes and compiles it:
    through ``inductor_inner(graph, inputs, **kw)`` for Inductor, or to Python code for the
    trace-once warm-up (see the ``trace once`` section below).

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
        with torch._inductor.config.patch(_inductor_patches()):
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
        return cfx.compile_fx(gm, example_inputs, inner_compile=inner, config_patches=_inductor_patches(aot_cache_salt))


def aot_cache_hits() -> int:
    """AOTAutograd cache hits in this process so far (``torch._dynamo.utils.counters``, the
    counter AOTAutogradCache bumps on a hit: "aot_autograd"/"autograd_cache_hit", 2.11 and 2.13)."""
    from torch._dynamo.utils import counters

    return int(counters["aot_autograd"]["autograd_cache_hit"])


def _inductor_patches(salt: str | None = None) -> dict:
    """The Inductor config every compile of ours runs under (compile_fx's ``config_patches``; the
    trace-once re-compile applies the same around ``inductor_inner``).

    reorder_for_peak_memory (on by default in 2.11 and 2.13) moves each allgather down to just
    before its wait, since that lowers peak memory, which undoes the prefetch pass. Our passes
    own where communication happens, within their own memory budget."""
    def joint_pass(graph: fx.Graph):
        tag_unshard_for_recompute(graph.owning_module)

    return {"joint_custom_pre_pass": _JointPass(joint_pass, salt), "reorder_for_peak_memory": False}


def inductor_inner(gm: fx.GraphModule, example_inputs, **kw):
    """The one place a partitioned forward/backward/inference graph (after our passes) goes to
    Inductor: ``torch._inductor.compile_fx.compile_fx_inner`` (same name and signature in 2.11
    and 2.13; ``kw`` are the keyword arguments ``compile_fx`` passes to its ``inner_compile``:
    ``is_backward``, ``is_inference``, ``graph_id``, ``cudagraphs``, ``boxed_forward_device_index``,
    ...). Both the normal Inductor path and the trace-once re-compile come through here, so
    whatever compiles identical blocks once (blocks.py) changes only this body."""
    from torch._inductor import compile_fx as cfx

    from deepcompile import blocks

    by_block = kw.pop("dc_blocks", None)  # blocks.resolve's mode (the backend's): "on", "auto" or None
    cudagraphs = kw.get("cudagraphs")
    if by_block and not (cudagraphs is not None and bool(getattr(cudagraphs, "value", cudagraphs))):
        fn = blocks.compile_graph(gm, example_inputs, cfx.compile_fx_inner, by_block, **kw)
        if fn is not None:
            return fn
    return cfx.compile_fx_inner(gm, example_inputs, **kw)


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
        # are never reused (compat.never_reuse_inputs; otherwise a gradient's memory is reused
        # while the runtime's bucket still holds it), the dc ops' ids are SymInt (blocks.py; int
        # ids would be pinned by guards in a block region), and the gradients handed to
        # dc.reduce_grad(s) are deleted after it (free_never_reused; otherwise they are held to
        # the end of the backward).
        return "deepcompile-tag-unshard-recompute-v4" + (f"-{self.salt}" if self.salt else "")


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
                          "(compat.never_reuse_inputs needs updating)", stacklevel=2)
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


def forget_outputs(output_node: fx.Node, cleared: list[int]) -> None:
    """Tell Inductor that graph outputs we replaced by None carry no stride contract.

    AOTAutograd records ``user_visible_output_idxs`` / ``original_output_strides`` on the output
    node; Inductor 2.11 (graph.get_user_visible_output_strides) dereferences every listed output
    and crashes on a None. 2.13 tolerates it; dropping the indices is right for both.
    """
    idxs = output_node.meta.get("user_visible_output_idxs")
    if idxs is not None:
        output_node.meta["user_visible_output_idxs"] = type(idxs)(i for i in idxs if i not in set(cleared))


def interpret(gm: fx.GraphModule) -> Callable:
    """The `eager` inner compiler: run node by node with torch.fx.Interpreter."""
    def run(args):
        return fx.Interpreter(gm).boxed_run(args)
    run._boxed_call = True
    return run


def reset_dynamo(model=None) -> None:
    """Drop every compiled graph (scheduled re-compile, re-initialising).

    ``torch._dynamo.reset()`` clears the code caches, but Dynamo also installs each compiled
    graph as a global ``__compiled_fn_<n>_<uuid>`` in the module whose frame it compiled
    (checked in 2.11 and 2.13), and reset leaves those behind: every old forward/backward
    graph stayed alive. After a reset no guarded code refers to them any more, so we delete
    them from the modules the model's code lives in.
    """
    import sys

    torch._dynamo.reset()
    names = {type(m).__module__ for m in model.modules()} if model is not None else set(sys.modules)
    for name in names:
        mod = sys.modules.get(name)
        g = getattr(mod, "__dict__", None)
        if not isinstance(g, dict):
            continue
        for k in [k for k in g if k.startswith("__compiled_fn_")]:
            del g[k]


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



def default_store():
    """The c10d store of the default process group (the rendezvous store), or None.

    The collective sequence check (``runtime/seqcheck.py``) posts one count per rank per step
    there: a channel of its own, so it cannot be matched against the model's collectives.
    ``torch.distributed.distributed_c10d._get_default_store`` is private; it exists, with this
    name and no arguments, in 2.11 and 2.13 (checked), and has since 1.x.
    """
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def storage_key(t: torch.Tensor) -> int | None:
    """An identity for ``t``'s storage, equal for every tensor over the same storage (fake
    tensors included: a fake view shares its base's fake storage, ``_unsafe_view`` too).
    ``UntypedStorage._cdata`` is the StorageImpl's address, what torch's own ``StorageWeakRef``
    keys on (torch.multiprocessing.reductions, 2.11 and 2.13). None for tensors without one."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def size_hint(x, fallback: int = 0) -> int:
    """A concrete int for a size that may be symbolic (dynamic shapes): the example value it was
    traced with, without adding a guard. For budgets and costs only, never for control flow
    that must hold for every size. ``optimization_hint`` is 2.13's name; 2.11 has
    ``hint_int``; both read ``SymNode.hint`` (``_hint``) first."""
    if isinstance(x, int):
        return int(x)
    if isinstance(x, torch.SymInt):
        from torch.fx.experimental import symbolic_shapes as ss

        fn = getattr(ss, "optimization_hint", None) or getattr(ss, "hint_int", None)
        try:
            if fn is not None:
                return int(fn(x, fallback=fallback))
            h = x.node.hint
            return int(h) if h is not None else fallback
        except Exception:  # noqa: BLE001 - an unbacked size: no hint exists
            return fallback
    try:
        return int(x)
    except (TypeError, ValueError):
        return fallback


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of a (possibly fake, possibly symbolic-shaped) tensor, by size hints."""
    n = 1
    for s in t.shape:
        n *= size_hint(s, 1)
    return n * t.element_size()


def mark_dynamic(t: torch.Tensor, dims) -> None:
    """Ask Dynamo to trace ``dims`` of ``t`` symbolically on the next compile instead of
    specialising on the first size and recompiling at the second (automatic dynamic shapes).
    ``maybe_mark_dynamic`` (public API, ``torch._dynamo.maybe_mark_dynamic`` in 2.11 and 2.13)
    still lets Dynamo specialise where the model's code needs a concrete size."""
    torch._dynamo.maybe_mark_dynamic(t, list(dims))


def fsdp_wrapper_kind(m) -> str | None:
    """'FSDP1 (FullyShardedDataParallel)' / 'FSDP2 (fully_shard)' if ``m`` is such a wrapper.

    Public classes in 2.11 and 2.13 (``torch.distributed.fsdp.FSDPModule`` is FSDP2's mixin);
    looked up lazily since a torch build without distributed has neither.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return None
    if isinstance(m, FullyShardedDataParallel):
        return "FSDP1 (FullyShardedDataParallel)"
    fsdp2 = getattr(torch.distributed.fsdp, "FSDPModule", None)
    if fsdp2 is not None and isinstance(m, fsdp2):
        return "FSDP2 (fully_shard)"
    return None


def is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


_CLIP_ROUTED = False


def route_clip_grad_norm() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` correct on deepcompile parameters.

    Why a patch: each rank holds only its rows of every gradient (plain tensors, not DTensors:
    see sharding.py), so torch's function would clip each rank by its own partial norm, silently
    wrong and different on every rank. Parameters that deepcompile owns are routed to
    ``deepcompile.clip_grad_norm_`` (the global norm, one all-reduce); any other call goes to
    torch's function unchanged. We replace the public module attributes
    (``torch.nn.utils.clip_grad_norm_`` and ``torch.nn.utils.clip_grad.clip_grad_norm_``, the
    same function in 2.11 and 2.13): code that looks the function up at call time, as
    nanoGPT, Hugging Face's Trainer and Accelerate do, gets the right norm. It is routed when
    ``deepcompile`` is imported, so ``from torch.nn.utils import clip_grad_norm_`` after
    ``import deepcompile`` gets it too; a name bound before that still holds torch's function
    (the README says to call ``deepcompile.clip_grad_norm_`` in such code).
    """
    global _CLIP_ROUTED
    if _CLIP_ROUTED:
        return
    import functools

    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad_mod

    from deepcompile import clip

    original = clip_grad_mod.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(clip.is_dc_param(p) for p in params):
            return clip.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)

    clip_grad_norm_.__dc_original__ = original
    nn_utils.clip_grad_norm_ = clip_grad_norm_
    clip_grad_mod.clip_grad_norm_ = clip_grad_norm_
    _CLIP_ROUTED = True


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``dist.all_gather_single`` where torch has it (2.13: ``all_gather_into_tensor`` warns that it
    is deprecated at every call), ``all_gather_into_tensor`` before (2.11 has only that name)."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def op_schema(target):
    """The schema of an aten/custom op overload (``torch._ops.OpOverload._schema``, 2.11 and
    2.13), or None for anything else (``operator.getitem``, Python callables)."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return target._schema


# --- blocks ---
# deepcompile/blocks.py compiles identical decoder-block regions once; these are the torch
# internals it needs (checked against torch 2.11.0 and 2.13.0).

_BLOCK_ID_COUNTER = [0]


def blocks_fake_mode(example_inputs):
    """The fake mode of a partitioned graph's example inputs (the one AOTAutograd traced with).
    ``torch._guards.detect_fake_mode`` (2.11, 2.13) also consults the tracing context."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode(example_inputs)


def blocks_symbolic_ints(fake_mode, values: list[int]) -> list:
    """A fresh symbolic int per value, hinted with it, in the graph's own ShapeEnv, so that
    Inductor compiles a region with its parameter ids as *inputs* (the fallback kernels of the
    ``dc`` ops then take them from the argument list, not from literals in the code).

    ``ShapeEnv.create_unspecified_symbol`` with ``DimDynamic.DYNAMIC``: no duck sizing (an id
    equal to some size must not share its symbol), no 0/1 specialisation, no positivity
    assumption (2.11 and 2.13, same signature). The source is a ``ConstantSource`` with a unique
    name; nothing guards on these symbols (the ops' fake impls read the hint, runtime/ops.py),
    so no guard refers to it (``blocks_specialized`` checks that after each compile).
    """
    shape_env = fake_mode.shape_env  # the caller checked it exists
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    out = []
    for v in values:
        _BLOCK_ID_COUNTER[0] += 1
        src = ConstantSource(f"__dc_block_id_{_BLOCK_ID_COUNTER[0]}")
        sym = shape_env.create_unspecified_symbol(int(v), source=src, dynamic_dim=DimDynamic.DYNAMIC)
        out.append(shape_env.create_symintnode(sym, hint=int(v), source=src))
    return out


def blocks_boxed(fn):
    """``compile_fx_inner``'s result takes one list argument (boxed: ``OutputCode.__call__``
    in 2.13, ``CompiledFxGraph.__call__`` in 2.11) and clears it; unboxed callables are wrapped."""
    if getattr(fn, "_boxed_call", False) or hasattr(fn, "current_callable"):
        return fn
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(fn)


class blocks_region_compile:
    """Context for compiling one region of a graph: Inductor's ``post_compile`` reports the
    compiled graph's output strides to AOTAutograd through ``TracingContext.output_strides``
    (``set_tracing_context_output_strides``, 2.11 and 2.13), asserting the list is empty. A region
    is not the graph AOTAutograd asked for: it reports into a list of its own, and the outer
    graph's strides are reported once by ``blocks_report_output_strides``."""

    def __enter__(self):
        self.ctx = torch._guards.TracingContext.try_get()
        self.saved = getattr(self.ctx, "output_strides", None)
        if self.saved is not None:
            self.ctx.output_strides = []
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            self.ctx.output_strides = self.saved
        return False


def blocks_report_output_strides(values) -> None:
    """Report the strides of the outer graph's outputs (their traced values: Inductor keeps
    output strides as traced, ``keep_output_stride``) where AOTAutograd collects them."""
    ctx = torch._guards.TracingContext.try_get()
    out = getattr(ctx, "output_strides", None)
    if out is None:
        return
    assert len(out) == 0, "deepcompile blocks: output strides were reported twice"
    for v in values:
        out.append(tuple(v.stride()) if isinstance(v, torch.Tensor) else None)


def blocks_symint_args(target) -> list[int]:
    """Positions of the ``SymInt`` / ``SymInt[]`` arguments of an op overload. Python's
    ``Argument.type`` prints both as ``int`` (2.11, 2.13), so the schema's text decides; an
    ``int`` argument is coerced to a concrete int by the dispatcher (a guard), so only SymInt
    arguments can be region inputs."""
    schema = op_schema(target)
    if schema is None:
        return []
    text = str(schema)
    inner = text[text.index("(") + 1:text.index(") ->")] if ") ->" in text else ""
    out = []
    for i, arg in enumerate(a.strip() for a in inner.split(",") if a.strip()):
        if arg.startswith("SymInt ") or arg.startswith("SymInt[] "):
            out.append(i)
    return out


class blocks_deferred_kernel_wait:
    """Context: the regions of one graph are compiled one after the other, and each compiled
    module waits for its own kernels on load (``async_compile.wait(globals())`` in Inductor's
    generated code: ``AsyncCompile.wait`` -> ``_wait_futures``, which swaps each kernel future
    in the module's globals for its result; 2.11 and 2.13). A whole graph's kernels compile in
    the worker pool while its long codegen runs, so that wait is short (1.2 s at 32 layers on
    the H200 host); a region's codegen is short, so each region would wait for its slowest kernel
    in turn (about half of the Inductor phase). Here the wait of every module loaded
    inside the context is recorded instead, and all of them are done on exit, before any region
    runs: the pool compiles one region's kernels while the next region is lowered. Re-entrant:
    inside an outer context (the trace-once re-compile of a forward and its backward,
    ``Backend.retarget``), the outer one waits for all of them, so the forward's kernels
    compile while the backward is lowered (2.2 s of forward wait at 16 layers, H100).

    Nothing reads a module's kernels between its load and the wait (the generated ``call``
    looks them up in its globals when it runs). Only with a worker pool (``compile_threads``
    > 1): in process, ``wait`` has nothing to wait for. On an error the recorded waits are
    dropped with the regions they belong to. ``deferred`` counts the modules waited for."""

    _outer = None  # the outermost context open: inner ones leave their waits to it

    def __enter__(self):
        self.scopes: list = []
        self.deferred = 0
        self.wait_s = 0.0
        self._cls = None
        if blocks_deferred_kernel_wait._outer is not None:
            return self  # the outer context's wait records this one's modules too
        try:
            from torch._inductor import async_compile as ac
        except ImportError:  # pragma: no cover - another layout: every module waits on load
            return self
        cls = getattr(ac, "AsyncCompile", None)
        orig = getattr(cls, "wait", None) if cls is not None else None
        if orig is None or not callable(getattr(cls, "_wait_futures", None)) \
                or not callable(getattr(ac, "get_compile_threads", None)):
            return self  # not the wait we know: leave it alone
        scopes = self.scopes

        def wait(inst, scope):
            if ac.get_compile_threads() > 1 and not getattr(inst, "_metal_sources", None):
                scopes.append((inst, scope))
                return None
            return orig(inst, scope)

        self._cls, self._orig = cls, cls.__dict__.get("wait", orig)
        cls.wait = wait
        blocks_deferred_kernel_wait._outer = self
        return self

    def __exit__(self, exc_type, *exc):
        if self._cls is None:
            return False
        blocks_deferred_kernel_wait._outer = None
        self._cls.wait = self._orig
        if exc_type is None:
            t0 = time.perf_counter()
            for inst, scope in self.scopes:
                self._orig(inst, scope)
            self.wait_s = time.perf_counter() - t0
            self.deferred = len(self.scopes)
        self.scopes.clear()
        return False


def _region_check(g) -> tuple[list[int], list[int]] | None:
    """(inputs to realign, mutated inputs) of a compiled region, as ``post_compile`` computes
    them when it wraps the region (``maybe_realign_inputs``): a graph whose code copies misaligned
    inputs itself (``_defers_input_alignment``, 2.13) leaves only its mutated inputs to the
    wrapper. None for what is not a CompiledFxGraph we can rebuild from its code."""
    from torch._inductor.output_code import CompiledFxGraph

    if type(g) is not CompiledFxGraph or not isinstance(getattr(g, "source_code", None), str):
        return None
    if getattr(g, "constants", None) or getattr(g, "allocated_constant_name", None) \
            or getattr(g, "torchbind_constants", None):
        return None  # its module needs attributes the code alone does not carry
    check = [int(i) for i in (getattr(g, "inputs_to_check", None) or ())]
    mutated = sorted(int(i) for i in (getattr(g, "mutated_input_idxs", None) or ()))
    if getattr(g, "_defers_input_alignment", False):
        check = [i for i in check if i in mutated]
    return check, mutated


def blocks_region_callable(source: str, check: list[int], mutated: list[int]):
    """A region's boxed callable rebuilt from its code (a cached driver being loaded): the module
    Inductor generated (``PyCodeCache.load``: its kernels load from Triton's cache as on any FX
    graph cache hit), wrapped to realign inputs as ``post_compile`` wraps it."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.utils import align_inputs_from_check_idxs
    from torch.utils._ordered_set import OrderedSet

    fn = PyCodeCache.load(source).call
    return align_inputs_from_check_idxs(fn, check, OrderedSet(mutated)) if check else fn


def blocks_cached_driver(regions: list, make_source, out_vals, example_inputs):
    """The driver of a graph compiled as regions, made a compiled graph of Inductor's FX graph
    cache, so that AOTAutograd's cache (and its seeding by the planning run) keeps the graph as it
    keeps any Inductor graph, and a re-run that hits it loads the driver and its regions' code
    instead of tracing. Returns (CompiledFxGraph, None) or (None, why not).

    How: a shallow copy of the first region's ``CompiledFxGraph`` (device, kwargs, boxed call:
    the same for every region of a graph) whose ``source_code`` is the driver's module
    (``blocks.driver_source``: the distinct regions' own code and the plan, as data), whose
    ``cache_key`` is that module's ``PyCodeCache`` key (``after_deserialization`` writes and loads
    it from there), with the whole graph's output strides, nothing to realign at its level (each
    region realigns its own inputs), no Triton bundle (the kernels are in Triton's cache) and no
    graph strings. It is saved with ``FxGraphCache._save_graph`` under a key made from its code,
    which computes its guards (none: the regions' id symbols are not among the graph's inputs).
    Checked against torch 2.13 (here) and 2.11 (the GPU machines): ``CompiledFxGraph`` fields,
    ``_save_graph(key, graph, example_inputs, local, remote_cache)`` (it logs and counts a failed
    write instead of raising: the counters are read), ``after_deserialization``."""
    import copy
    import hashlib
    import inspect

    from torch._dynamo.utils import counters
    from torch._inductor import config as icfg
    from torch._inductor.codecache import FxGraphCache, PyCodeCache

    if not icfg.fx_graph_cache:
        return None, "Inductor's FX graph cache is off"
    checks = []
    for g in regions:
        chk = _region_check(g)
        if chk is None:
            return None, f"a region compiled to {type(g).__name__} with constants or without code"
        checks.append(chk)
    save = getattr(FxGraphCache, "_save_graph", None)
    try:
        params = list(inspect.signature(save).parameters)
    except (TypeError, ValueError):
        params = []
    if params[:5] != ["key", "compiled_graph", "example_inputs", "local", "remote_cache"]:
        return None, f"FxGraphCache._save_graph takes {params} here"
    source = make_source([g.source_code for g in regions], checks)
    code_key, _path = PyCodeCache.write(source)
    driver = copy.copy(regions[0])
    fields = {"source_code": source, "cache_key": code_key, "cache_linemap": [],
              "output_strides": [tuple(v.stride()) if isinstance(v, torch.Tensor) else None for v in out_vals],
              "inputs_to_check": (), "mutated_inputs": set(), "mutated_input_idxs": set(),
              "current_callable": None, "recursively_apply_fns": None, "compiled_fn_runner": None,
              "_triton_bundle": None, "_original_gm": None, "_serialized_original_gm": None,
              "runnable_graph_str": "", "inductor_post_grad_graph_str": "", "guards_expr": None,
              "_fx_graph_cache_debug_lines": []}
    for k, v in fields.items():
        if k in ("source_code", "cache_key", "output_strides", "inputs_to_check") or hasattr(driver, k):
            setattr(driver, k, v)
    key = "fdcblk" + hashlib.sha256(source.encode()).hexdigest()[:46]
    errs = ("fxgraph_cache_pickle_error", "fxgraph_cache_write_error")
    before = [counters["inductor"][e] for e in errs]
    try:
        save(key, driver, list(example_inputs), True, None)
    except Exception as e:  # noqa: BLE001 - the driver still runs; only the cache entry is missing
        return None, f"FxGraphCache._save_graph: {type(e).__name__}: {str(e)[:200]}"
    if [counters["inductor"][e] for e in errs] != before:
        return None, "FxGraphCache._save_graph could not write the driver (torch's log says why)"
    driver._fx_graph_cache_key = key
    return driver, None


def blocks_specialized(ids) -> bool:
    """Whether compiling a region pinned any of its symbolic ids to a value (a guard or a
    replacement in the ShapeEnv: an FX-graph-cache hit evaluates the cached artifact's guards,
    ``FxGraphCache._lookup_graph``). ``SymNode.expr`` applies the ShapeEnv's replacements
    (2.11, 2.13); a pinned id has no free symbol left. Such a region is not shared."""
    for v in ids:
        if isinstance(v, torch.SymInt) and not v.node.expr.free_symbols:
            return True
    return False


# --- trace once ---
# The default plan compiles its final graphs at step 2 from the same model it traced at step 0.
# Instead of dropping everything and tracing again (Dynamo + AOTAutograd: about a third of the
# whole compile at 16 layers), the backend keeps each partitioned forward/backward graph
# of the warm-up compile as it was before our passes, with what compiling it later needs (below),
# re-runs only the passes and Inductor on a copy, and re-points the callable that AOTAutograd's
# runtime wrapper already holds (backend._Slot). Checked in torch 2.13 (CPU, here) and read in
# 2.11's source: compile_fx's inner_compile hook, TracingContext.report_output_strides and the
# backward stride fix-up in _aot_autograd (2.11: jit_compile_runtime_wrappers.py, 2.13:
# graph_compile.py::_aot_stage2b_bw_compile) have the same shape in both.


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
            self.gm = copy_graph(gm)
        self.example_inputs = list(example_inputs)
        self.kind = kind
        self.kw = dict(kw)
        self.renamed: dict[str, str] = {}  # a forward's names removed by nested.flatten (restride_saved)
        self.tracing_context = torch._guards.TracingContext.try_get()
        self.fake_mode = detect_fake_mode(self.example_inputs)
        self.symbolic = any(isinstance(x, torch.SymInt) or (
            isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride())))
            for x in self.example_inputs)


def lazy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as a ``_LazyGraphModule`` over the same graph: its Python code is generated when it
    is first run or its ``code`` read, not at every ``recompile()``.

    AOTAutograd hands the compiler eager GraphModules, so every pass's ``recompile()``, the
    flatten of block regions and each deep copy of a kept graph generated the whole graph's
    code, most of it never run (seconds of a 32-layer CPU compile). Inductor uses the same class
    for its own graphs. The wrapper takes the graph (``owning_module`` moves to it, so get_attr
    targets resolve against it); the caller uses the
    returned module from then on. ``meta`` and ``shape_env`` are carried over (``__init__``
    resets them). Checked on 2.13 and in 2.11's source: ``_LazyGraphModule(root, graph)`` and
    its deepcopy (``_deepcopy_init``) are the same."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if isinstance(gm, _LazyGraphModule):
        return gm
    out = _LazyGraphModule(gm, gm.graph)
    out.meta.update(getattr(gm, "meta", {}))
    if getattr(gm, "shape_env", None) is not None:
        out.shape_env = gm.shape_env
    return out


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A deep copy of a partitioned graph (its nodes' meta, fake values included), lazy: its code
    is generated only if the copy is run (``lazy_graph``)."""
    import copy

    src = lazy_graph(gm)
    try:
        return copy.deepcopy(src)
    finally:
        if src is not gm:  # the wrapper took the graph; the original stays its owner
            gm.graph.owning_module = gm


def fresh_copy(tg: TracedGraph) -> fx.GraphModule:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return copy_graph(tg.gm)


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
        stack.enter_context(iconfig.patch(_inductor_patches()))
        if hasattr(torch._functorch.config, "unlift_effect_tokens"):
            stack.enter_context(torch._functorch.config.patch(unlift_effect_tokens=True))
    stack.enter_context(enable_python_dispatcher())
    stack.enter_context(torch.no_grad())
    # AOTAutograd compiles its graphs with autocast off (a training loop under autocast re-compiles
    # at its first step): the graphs already carry their casts
    stack.enter_context(torch._C._DisableAutocast())
    return stack


def report_output_strides():
    """Collect the strides Inductor gives the forward's outputs (``TracingContext.
    report_output_strides``, 2.11 and 2.13); a list filled while compiling, or None without a
    tracing context. AOTAutograd takes the saved activations' strides from it for backward."""
    return torch._guards.TracingContext.report_output_strides()


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


def dynamo_compile_seconds() -> float | None:
    """Seconds Dynamo has spent compiling frames in this process, backends included:
    ``torch._dynamo.utils.compilation_time_metrics["_compile.compile_inner"]`` (2.11 and 2.13),
    0.0 before the first compile (the key appears with it), None where the dict is missing. The
    backend subtracts its own time to get Dynamo's."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover
        return None
    return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))


def dynamo_gc_after_compile(on: bool | None) -> bool | None:
    """Set ``torch._dynamo.config.run_gc_after_compile`` (2.11 and 2.13: a ``gc.collect(1)``
    after every frame Dynamo compiles) and return its old value; None: leave it, where the
    flag does not exist. While ``backend.paused_gc`` holds the collector, that collection would
    walk every object the compile made so far (1 s at 32 layers on the CPU benchmark), which the
    pause's one collection at its end walks anyway."""
    cfg = torch._dynamo.config
    if on is None or not hasattr(cfg, "run_gc_after_compile"):
        return None
    old = bool(cfg.run_gc_after_compile)
    cfg.run_gc_after_compile = on
    return old


def dynamo_frames_compiled() -> int:
    """Frames Dynamo compiled so far (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``,
    2.11 and 2.13): what the trace-once test counts to see that the final compile traced nothing."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# --- whatif ---
def fast_graph_copy(src: fx.Graph) -> fx.Graph:
    """A copy of ``src`` (nodes, names, meta shallow-copied) for the what-if's re-plans
    (``plan.whatif``), which copy a record's rebuilt graphs once per candidate plan.

    ``Graph.graph_copy`` goes through ``create_node``, which since torch 2.13 walks every
    argument with pytree to warn about raw SymInts: two thirds of a copy's time, for graphs
    rebuilt from JSON that hold none. This builds each ``Node`` and does what ``create_node``
    does after its checks (name, ``_insert``, the ``find_nodes`` table, ``_len``), checked on
    torch 2.13 (the same steps are in 2.11's ``create_node``). Any other layout of those
    internals falls back to ``graph_copy``."""
    try:
        out = fx.Graph()
        ns, table = out._graph_namespace, out._find_nodes_lookup_table
        env: dict = {}
        get = env.__getitem__
        for n in src.nodes:
            if n.op == "output":
                out.output(fx.node.map_arg(n.args[0], get), n.type)
                continue
            name = ns.create_name(n.name, None)
            m = fx.Node(out, name, n.op, n.target, fx.node.map_arg(n.args, get), fx.node.map_arg(n.kwargs, get),
                        n.type)
            ns.associate_name_with_obj(name, m)
            out._insert(m)
            table.insert(m)
            out._len += 1
            m.meta.update(n.meta)  # (Node.__init__ made it; assigning goes through Node.__setattr__)
            env[n] = m
        if len(out.nodes) != len(src.nodes):
            raise AttributeError("node count")
        return out
    except (AttributeError, TypeError):
        out = fx.Graph()
        out.output(out.graph_copy(src, {}))
        return out


# --- Inductor's parallel kernel compile ---
def warm_inductor_pool() -> bool:
    """Start Inductor's parallel compile workers now, where a compile will need them later.

    ``torch.compile(backend="inductor")`` calls ``torch._inductor.async_compile.maybe_warm_pool()``
    in its backend entry (``torch/_dynamo/backends/inductor.py``, 2.11 and 2.13) before
    ``compile_fx``; a backend of its own that calls ``compile_fx`` (ours) never does, so the pool
    is started at the first Triton kernel of the first Inductor compile, and
    ``AsyncCompile.use_process_pool()`` answers False until a no-op job has come back from it:
    until the workers are up, kernels compile one by one in the main process. Our first Inductor
    compile comes after the warm-up and profiling steps (the default plan's step 2), so starting
    the pool at the backend's creation gives it those steps to come up. ``maybe_warm_pool`` itself
    does nothing without Triton, under ``TORCH_WARM_POOL=0`` and with ``compile_threads`` <= 1
    (``TORCHINDUCTOR_COMPILE_THREADS=1``). Returns whether the call was made (False where this
    torch lacks it: the pool then starts at the first kernel)."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # pragma: no cover - older/newer layouts: the pool starts lazily
        return False
    maybe_warm_pool()
    return True


# --- optimizer chunks (runtime/optim_chunks.py) ---
def default_foreach(params: list, differentiable: bool = False) -> bool:
    """Whether torch's optimizers pick their foreach (multi-tensor) kernels for ``params`` when the
    group says neither ``foreach`` nor ``fused``: ``torch.optim.optimizer._default_to_fused_or_foreach``
    (private; same signature and meaning in 2.11 and 2.13: foreach where every parameter is a plain
    Tensor/Parameter on a device with foreach kernels, CUDA, and not differentiable). Where this
    torch lacks it: CUDA parameters only, its rule in those versions."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # pragma: no cover - a torch that moved it
        return not differentiable and bool(params) and all(p.device.type == "cuda" for p in params)
    return bool(_default_to_fused_or_foreach(params, differentiable, use_fused=False)[1])


# --- compile time: AOTAutograd's graph strings ---
# AOTAutograd prints every joint, forward and backward graph it makes to a string
# (``GraphModule.print_readable``: Python code generation for the whole graph, three times per
# compiled graph) whether or not anyone reads it: ``_log_joint_graph`` / ``_log_fw_bw_graphs``
# in ``torch._functorch._aot_autograd.graph_compile`` do it whenever ``AOTConfig.enable_log``,
# which ``aot_module_simplified`` (Dynamo backends, compile_fx) always leaves on. The strings go
# to the ``aot_joint_graph`` / ``aot_graphs`` logs (TORCH_LOGS), the structured trace
# (TORCH_TRACE / tlparse) and an AOTAutograd cache entry (``aot_config.cache_info``, where they
# serve the same readers on a hit). On the CPU profile of a 32-layer Llama they were 2-3 s of the
# 37 s AOTAutograd phase, growing with depth. While our compile runs, the two functions are
# wrapped so that they run unchanged whenever one of those readers is there and return no
# string otherwise. Checked: torch 2.13 (here; both functions, same signatures, the strings read
# only by the logs, trace_structured and ``_cache_autograd_info`` under ``cache_info``) and the
# same two functions in the 2.x source before 2.13 (read, not run). Anything else: untouched.

_AOT_LOG_FNS = ("_log_joint_graph", "_log_fw_bw_graphs")


def _aot_graph_strings_wanted(aot_config) -> bool:
    """Whether anyone would read the graph strings AOTAutograd prints for ``aot_config``."""
    import logging

    from torch._functorch._aot_autograd import graph_compile as gc_mod

    if aot_config is None or not hasattr(aot_config, "cache_info"):  # not the AOTConfig we know: keep them
        return True
    # an AOTAutograd cache entry (cache_info) keeps them for the logs of the run that hits it; that
    # run prints them only to the same readers, and an entry without them (None) is valid
    try:
        from torch._logging._internal import trace_log
        if trace_log.handlers:  # TORCH_TRACE: trace_structured writes them
            return True
    except ImportError:  # pragma: no cover - another layout: keep the strings
        return True
    for name in ("aot_joint_log", "aot_graphs_log"):
        log = getattr(gc_mod, name, None)
        if log is None or log.isEnabledFor(logging.INFO):
            return True
    return False


class quiet_aot_graph_strings:
    """Context: AOTAutograd's graph-printing log functions skip the print when nobody reads it
    (see above). Re-entrant (a nested compile finds them already wrapped); restored on exit."""

    def __enter__(self):
        self.saved = {}
        try:
            from torch._functorch._aot_autograd import graph_compile as gc_mod
        except ImportError:  # pragma: no cover - another layout: nothing to skip
            return self
        self.mod = gc_mod
        for name in _AOT_LOG_FNS:
            fn = getattr(gc_mod, name, None)
            if fn is None or getattr(fn, "_dc_quiet", False):
                continue
            self.saved[name] = fn
            setattr(gc_mod, name, _quiet(fn, (None, None) if name == "_log_fw_bw_graphs" else None))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.mod, name, fn)
        return False


QUIET_SKIPPED = [0]  # graph prints skipped (tests/test_compile_time.py counts them)


def _quiet(fn, nothing):
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        aot_config = kwargs.get("aot_config", args[-1] if args else None)
        if _aot_graph_strings_wanted(aot_config):
            return fn(*args, **kwargs)
        QUIET_SKIPPED[0] += 1
        return nothing
    wrapper._dc_quiet = True
    return wrapper


# --- AOTAutograd's cache, seeded by the trace-once compile ---
# A re-run that hits the plan cache compiles the stored plan at step 0 through AOTAutograd with its
# cache on (``inductor_compile(aot_cache_salt=...)``); a hit skips Dynamo's backend work, the joint
# trace, the partition and our passes. The run that *made* the plan compiled its final graphs by
# trace once, outside AOTAutograd, so it stores no entry of its own, and the first re-run would pay
# the whole trace again (about twice the time of a re-run that hits).
#
# So the planning run's warm-up compile (step 0) goes through AOTAutograd with the cache on, under
# the salt the re-run will use: AOTAutograd computes the re-run's key, misses (the salt names a
# plan not made yet) and, for a lazily compiled backward, builds the closure that saves an entry
# once the forward and the backward carry an FX graph cache key (``_cache_autograd_info`` returns
# it; the backward's first compile calls it, and with the warm-up's Python graphs it saves
# nothing: ``_should_save_cache`` wants Inductor's keys). After the trace-once compile, the warm-up
# forward's callable is given the final forward's key and the closure is called with the final
# backward: torch's own code builds and saves the entry. The runtime metadata, wrappers and
# partition facts are the warm-up's, which are the ones the final graphs run under in this run
# (trace once re-points AOTAutograd's callables and keeps everything else).
#
# Checked: torch 2.13 (here: ``graph_compile._cache_autograd_info(aot_config, flat_args,
# compiled_fw_func, compiled_bw_func, ..., fw_metadata, ..., bw_module, ...)`` returning
# ``(try_save_cache_entry, entry)``; the closure's arguments ``(compiled_bw_func, bw_module,
# fw_metadata, aot_config)``, as ``CompiledFunction``'s lazy backward calls it) and torch 2.11 (the
# GPU machines: run, not read; the entry saved, and the re-run hit it). Anything else
# (another signature, a bundled cache, an eagerly compiled backward): nothing is seeded, and the
# re-run stores the entry itself.

class AotSeed:
    """One Dynamo graph's pending AOTAutograd entry (see above)."""

    def __init__(self, save, compiled_fw, bw_module, fw_metadata, aot_config):
        self.save, self.compiled_fw = save, compiled_fw
        self.bw_module, self.fw_metadata, self.aot_config = bw_module, fw_metadata, aot_config


class aot_seed_recorder:
    """Context around a warm-up compile: collects an ``AotSeed`` per AOTAutograd graph compiled in
    it (``seeds``), or says why none can be (``why``)."""

    def __init__(self):
        self.seeds: list[AotSeed] = []
        self.why: str | None = None
        self._restore = None

    def __enter__(self):
        import inspect

        try:
            from torch._functorch._aot_autograd import graph_compile as gc_mod
            from torch._functorch._aot_autograd.autograd_cache import should_bundle_autograd_cache
            orig = gc_mod._cache_autograd_info
            sig = inspect.signature(orig)
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            self.why = f"this torch has no _cache_autograd_info to hook ({type(e).__name__})"
            return self
        missing = {"aot_config", "compiled_fw_func", "compiled_bw_func", "fw_metadata", "bw_module"} - set(sig.parameters)
        if missing:
            self.why = f"_cache_autograd_info has no {sorted(missing)} here"
            return self
        if should_bundle_autograd_cache():
            self.why = "AOTAutograd's cache is bundled (it would keep the warm-up's own graphs)"
            return self

        def hooked(*args, **kwargs):
            out = orig(*args, **kwargs)
            try:
                a = sig.bind(*args, **kwargs).arguments
                save = out[0] if isinstance(out, tuple) else None
                if save is None or a["compiled_bw_func"] is not None:
                    self.why = "the backward was compiled with the forward (no lazy save to take over)"
                elif getattr(a["aot_config"], "cache_info", None) is None:
                    self.why = "AOTAutograd computed no cache key for the warm-up compile"
                else:
                    self.seeds.append(AotSeed(save, a["compiled_fw_func"], a["bw_module"], a["fw_metadata"],
                                              a["aot_config"]))
            except Exception as e:  # noqa: BLE001 - seeding is an optimization; the compile goes on
                self.why = f"{type(e).__name__}: {e}"
            return out

        gc_mod._cache_autograd_info = hooked
        self._restore = (gc_mod, orig)
        return self

    def __exit__(self, *exc):
        if self._restore is not None:
            mod, orig = self._restore
            mod._cache_autograd_info = orig
        return False


def aot_seed_save(seed: AotSeed, fw, bw, tracing_context) -> str | None:
    """Save the AOTAutograd entry of ``seed`` for the compiled final forward ``fw`` and backward
    ``bw`` (Inductor's, each with its FX graph cache key). None when saved, else why not."""
    from torch._dynamo.utils import counters

    keys = [getattr(f, "_fx_graph_cache_key", None) for f in (fw, bw)]
    if None in keys:
        return "a final graph has no FX graph cache key (Inductor's cache was bypassed for it)"
    # what make_entry reads off the compiled forward the closure holds (the warm-up's callable,
    # which keeps running: it gets them for the save only)
    attrs = {"_fx_graph_cache_key": keys[0], "_fx_graph_cache_debug_lines": getattr(fw, "_fx_graph_cache_debug_lines", []),
             "guards_expr": getattr(fw, "guards_expr", None)}
    try:
        for attr, value in attrs.items():
            setattr(seed.compiled_fw, attr, value)
    except AttributeError:
        return f"the warm-up forward ({type(seed.compiled_fw).__name__}) takes no attributes"
    saved = counters["aot_autograd"]["autograd_cache_saved"]
    try:
        with torch._guards.tracing(tracing_context):  # the guards expression reads its shape env
            seed.save(bw, seed.bw_module, seed.fw_metadata, seed.aot_config)
    except Exception as e:  # noqa: BLE001 - the re-run stores the entry itself
        return f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        for attr in attrs:
            seed.compiled_fw.__dict__.pop(attr, None)
    if counters["aot_autograd"]["autograd_cache_saved"] == saved:
        return "AOTAutograd did not save the entry (see torch's log for the reason)"
    return None
