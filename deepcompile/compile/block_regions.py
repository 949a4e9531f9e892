"""The torch internals block regions (compile/blocks.py) are compiled through: symbolic ids as
region inputs, Inductor's output-stride report, the schema's SymInt arguments, and the driver of a
graph compiled as regions stored in Inductor's FX graph cache (checked against torch 2.11.0 and
2.13.0; each function names what it relies on)."""
from __future__ import annotations

import torch

from deepcompile.compat import fx as fx_compat


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
    schema = fx_compat.op_schema(target)
    if schema is None:
        return []
    text = str(schema)
    inner = text[text.index("(") + 1:text.index(") ->")] if ") ->" in text else ""
    out = []
    for i, arg in enumerate(a.strip() for a in inner.split(",") if a.strip()):
        if arg.startswith("SymInt ") or arg.startswith("SymInt[] "):
            out.append(i)
    return out


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
