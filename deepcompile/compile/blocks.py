"""Compile each distinct decoder block once.

Inductor used to compile every partitioned forward/backward graph whole, so its time grew with
depth (16 layers about 19 s on an H200 host, 32 layers about 40 s). Here a graph *after our
passes* is cut into regions along the decoder-block scope, each region is made canonical, and
Inductor compiles each distinct canonical region once; identical blocks share the artifact.

How
---
1. **Labels.** Every compute node carries the module scope it was traced in
   (``meta["nn_module_stack"]``; backward nodes ``meta["fwd_nn_module_stack"]``). A node's block
   is the outermost scope entry that ends in a list index (``...blocks.3``), keyed by that
   prefix, the index and the module's class; other scoped nodes are "outside any block".
   Communication ops (``dc.*``) and nodes without a scope take the label of the node before
   them: they belong to the region they *sit in*, not to the layer whose parameter they move.
   That is what keeps the passes' schedule: a gather that ``prefetch`` hoisted into the previous
   block is issued from that block's region, exactly where the pass put it.
2. **Regions.** Maximal runs of nodes with one label, in graph order (the order is the passes'
   schedule and is never changed). A region's inputs are the values it reads that are defined
   elsewhere (outer placeholders, earlier regions), in order of first use; its outputs are the
   values later regions or the graph's output read, in definition order. A run of fewer than
   ``MIN_REGION_NODES`` compute nodes joins its neighbour (the partitioner puts each block's
   saved-for-backward views at the end of the forward: one tail region, not one per block).
3. **Canonical form.** Node names become ``n0, n1, ...``; the int arguments of the ``dc`` ops
   (parameter ids, id lists) become extra graph inputs, symbolic ints whose example value is
   this region's own id. The key is the canonical code plus every input's shape, stride, dtype
   and device plus the shapes of the ``dc`` ops' outputs. Two blocks of one ``ModuleList``
   give the same key; the first and last block differ where prefetch reaches into the
   embedding or the head, and are compiled on their own.
4. **Compile.** The first region of each key goes through ``compile_fx_inner`` (inside the same
   ``compile_fx`` context, so our config patches hold); later ones call the same compiled
   artifact with their own tensors and ids. The ids reach the runtime ops as plain ints at run
   time. Three things make that hold: the ops declare their ids ``SymInt`` (csrc/zero3.cpp; with
   ``int`` the dispatcher pins a symbolic id to its value and Inductor writes the literal into
   the code); their fake impls read a symbolic id's hint (the first block's id: same shapes, by
   the key) without a guard (runtime/ops.py ``_meta``); and after each compile
   ``block_regions.blocks_specialized`` checks that no guard pinned an id anyway (an FX-graph-cache hit
   evaluates the cached artifact's guards): such an artifact is used for its own region only.
   Every region output is marked user-visible, so Inductor keeps its traced strides: the next
   region was compiled for them, and they are the strides reported to AOTAutograd for the
   graph's own outputs (the saved activations' strides for backward).
5. **Driver.** A small boxed callable runs the regions in order, keeps each value alive only
   until its last reader has run (the outer argument list is cleared at once, as Inductor's own
   compiled graphs do: saved activations die during backward), and builds the graph's outputs.
   One Python call per region; the regions themselves are Inductor code.
6. **Cache.** The driver is made an entry of Inductor's FX graph cache
   (``block_regions.blocks_cached_driver``): a compiled graph whose code is ``driver_source`` (the
   distinct regions' own code and the plan, as data). AOTAutograd's cache then keeps a blocks
   graph as it keeps a whole one: the planning run seeds it, and a re-run loads the driver, which
   loads its regions' modules (``load_driver``), instead of tracing. While the regions compile,
   each module's wait for its kernels is deferred to the end (``blocks_deferred_kernel_wait``),
   so the pool compiles one region's kernels while the next is lowered.

Only used where it pays: a graph with fewer than two regions of one key is compiled whole,
as before (so small models, irregular graphs, ``blocks: false`` (the default) and the CPU under
``"auto"`` behave exactly as they did; ``resolve`` says when it applies). Costs of the cut: no
fusion across a block boundary (the residual add at the end of a block and the next block's norm
are separate kernels: 549 kernels a step against 538 at 16 layers on the H100, the same GPU time
within 0.5%), one Python call per region; the step was slower at 32 layers in 7 of 9 pairs, in
host time (``resolve``).

Decision and rejected alternatives
----------------------------------
* ``torch.compiler.nested_compile_region`` / ``invoke_subgraph`` (hierarchical compilation):
  the region is marked in the *model* and traced as a higher-order op. Rejected: (a) our
  parameters are reached through the ``dc.unshard`` parametrization *inside* the block, so each
  layer's subgraph holds its own parameter id as a constant and the layers are not identical to
  Dynamo, or the model would have to pass gathered parameters in explicitly; (b) our passes see
  one ``invoke_subgraph`` node per block and would have to descend into shared subgraph modules,
  where a gather that prefetch hoists from block i+1 into block i cannot live (block i's body is
  shared by every layer); (c) every pass, the record and the inspector would have to learn
  higher-order-op graphs. Route chosen: our own grouping *after* the passes, which leaves the
  passes, the record and the schedule exactly as they were.
* Relative parameter ids (the runtime adds a per-block base that the driver sets): no Inductor
  symbols, but a change to every native op and hidden mutable state in the runtime; rejected
  while symbolic-int inputs work.
* Running the ``dc`` ops from the driver and compiling only the compute between them: no ids
  in compiled code at all, but a block splits into a dozen tiny regions (one per gather/release)
  with a Python call each, and the step is host-bound already.
* ``torch.fx.passes.split_module``: builds submodules with call_module glue and
  ``GraphModule`` code that keeps every intermediate alive until the graph returns; we need the
  canonical form and last-use freeing anyway, so the split is done here in a few lines.

Measured (CPU, tiny GPT, 1 rank, default plan, Inductor stubbed to count what it would lower:
``benchmarks/blocks_structure.py``): distinct regions compiled per step-2 compile
stay at 9 (forward 5, backward 4) from 8 to 32 layers; FX nodes lowered 982 vs 1892 at 8
layers, 1158 vs 3652 at 16, 1510 vs 7172 at 32; losses bit-identical with and without blocks.
Real Inductor on this shared 2-core CPU machine (caches off, default plan, load 3-5, noisy):
16 layers 56.8 s in compile_fx_inner with blocks (9 compiles: the first 15 s with Inductor's
one-time start-up, each block region 5-6 s, tails 2-3 s) vs 64.6 s whole (2 compiles); 8
layers 94.5 vs 76.8 s (under load 6). On CPU each region pays a fixed cost (its own C++
module and compiler run), so blocks only break even near 16 layers there and win beyond, as
the whole graph keeps growing and the regions do not. On the GPU, where kernels are Triton,
the gain comes from the first layers on (benchmarks/README.md).
"""
from __future__ import annotations

import operator
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from deepcompile.compile import block_regions
from deepcompile.compile.kernel_wait import blocks_deferred_kernel_wait
from deepcompile.runtime import state

_BLOCK_RE = re.compile(r"^(.*?)(?:\.(\d+)|\[(\d+)\]|\['(\d+)'\])$")


def _record():
    """The runtime state that keeps what block compiles did (``RuntimeState.block_compiles``,
    ``blocks_loaded``), or None outside ``deepcompile.initialize`` (nothing to keep it for)."""
    return state.current() if state.active() else None


def resolve(config, device_type: str) -> str | None:
    """How the final graphs compile, from config ``blocks``: "on" (``true``: any device, an error
    is raised), "auto" (``"auto"``, the default, on a CUDA device: a graph that cannot be cut is
    compiled whole, with a warning) or None (whole graphs: ``false``; auto off CUDA; another
    compiler than Inductor; CUDA graphs). The backend's compile and the reduce grouping
    (``ReduceLayout.by_block``) both take it from here (api.initialize).

    On by default on CUDA (benchmarks/README.md, docs/architecture.md). On 2 H200s, cold caches, the
    default plan's first fast step took 23.1 s at 16 layers and 32.1 s at 32 with blocks, 39.1
    and 63.0 s without (Inductor's phase 5.3 and 7.2 s against 18.4 and 36.3), and the step was
    58.0 against 63.4 ms and 106.2 against 115.9 (one pair each). Pairs on one GPU measured the
    step: blocks slower in 7 of 9 pairs at 32 layers on an H100 (-15% to +12%) and
    3 of 3 (+5%) at 16 layers on an H200; any cost is on the host: a trace at 32 layers shows the
    same GPU kernel time (52.1 against 52.7 ms per counted step; 1054 kernels against 1035, the
    boundaries' unfused pointwise kernels), and cProfile of the timed steps attributes ~3.6 ms a
    step to what blocks add (the driver, now generated code, 1.7; input realignment 0.95; input
    size asserts 0.55; device guards 0.4; all inflated by the profiler), while the main thread's
    CPU time per step varies by up to 14 ms between identical processes of one call.

    "auto" leaves the CPU whole: each region is its own C++ compile there, which only breaks even
    near 16 layers (module docstring)."""
    v = config.blocks
    if v is False or config.compiler != "inductor":
        return None
    if v is True:
        return "on"
    return "auto" if device_type == "cuda" else None


def _is_dc(n: fx.Node) -> bool:
    """A runtime op (``torch.ops.dc.*``), or a ``getitem`` of one (``wait_allgather_many``)."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        return _is_dc(n.args[0])
    return str(n.target).startswith("dc.")


_OUTSIDE = ("outside",)
MIN_REGION_NODES = 16  # runs with fewer compute nodes join a neighbour (see split)


def block_label(n: fx.Node):
    """(prefix, index, class name) of the outermost list-indexed scope; _OUTSIDE for a scoped
    node outside any block; None for a node that follows its neighbour (no scope, or a dc op)."""
    if _is_dc(n):
        return None
    stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    for v in stack.values():
        path = v[0] if isinstance(v, (tuple, list)) else str(v)
        m = _BLOCK_RE.match(str(path))
        if m:
            idx = next(g for g in m.groups()[1:] if g is not None)
            cls = v[1] if isinstance(v, (tuple, list)) and len(v) > 1 else None
            cls = getattr(cls, "__qualname__", None) or str(cls)
            return (m.group(1), int(idx), cls)
    return _OUTSIDE


@dataclass
class Region:
    nodes: list[fx.Node]
    label: Any
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    consts: list[Any] = field(default_factory=list)   # lifted int args, in canonical order
    key: str = ""
    gm: fx.GraphModule | None = None


def running_labels(graph: fx.Graph) -> dict[fx.Node, Any]:
    """The block label of every compute node as ``split`` cuts them: its own, or for a dc op
    or an unscoped node the label of the node before it (the first such nodes: the first label)."""
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    cur = next((lab for lab in map(block_label, body) if lab is not None), _OUTSIDE)
    out: dict[fx.Node, Any] = {}
    for n in body:
        lab = block_label(n)
        if lab is not None:
            cur = lab
        out[n] = cur
    return out


def cut_at_blocks(groups: list[list[fx.Node]]) -> list[list[fx.Node]]:
    """Split runtime-call groups (``passes/zero3.group_reduces``) where the block label of their
    nodes changes, so that no call spans two regions. A call that spans a block boundary reads a
    gradient from another region, and where the boundary falls differs from layer to layer, so
    the regions would no longer be identical (each would be compiled on its own)."""
    if not groups or not groups[0]:
        return groups
    labels = running_labels(groups[0][0].graph)
    out: list[list[fx.Node]] = []
    for grp in groups:
        cur: list[fx.Node] = []
        for n in grp:
            if cur and labels.get(n) != labels.get(cur[-1]):
                out.append(cur)
                cur = []
            cur.append(n)
        if cur:
            out.append(cur)
    return out


def split(gm: fx.GraphModule) -> list[Region]:
    """Cut ``gm``'s compute nodes into runs of one block label (graph order kept)."""
    running = running_labels(gm.graph)
    body, labels = list(running), list(running.values())
    runs: list[Region] = []
    for n, lab in zip(body, labels):
        if runs and runs[-1].label == lab:
            runs[-1].nodes.append(n)
        else:
            runs.append(Region([n], lab))
    # A run of a few compute nodes (the partitioner puts each block's saved-for-backward views
    # at the end of the forward; a norm's tail lands between blocks) is not worth a compile of
    # its own: it joins the run before it (the first run: the one after it).
    regions: list[Region] = []
    for r in runs:
        small = sum(1 for n in r.nodes if not _is_dc(n)) < MIN_REGION_NODES
        if regions and (small or regions[-1].label == r.label):
            regions[-1].nodes.extend(r.nodes)
        elif regions and sum(1 for n in regions[-1].nodes if not _is_dc(n)) < MIN_REGION_NODES \
                and len(regions) == 1:
            regions[-1].nodes.extend(r.nodes)
            regions[-1].label = r.label
        else:
            regions.append(r)
    where = {n: i for i, r in enumerate(regions) for n in r.nodes}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for i, r in enumerate(regions):
        inside = set(r.nodes)
        seen: dict[fx.Node, None] = {}
        for n in r.nodes:
            for a in n.all_input_nodes:
                if a not in inside:
                    seen.setdefault(a, None)
        r.inputs = list(seen)
        r.outputs = [n for n in r.nodes
                     if any(u is out_node or where.get(u, i) != i for u in n.users)]
    return regions


def _int_args(n: fx.Node) -> list[tuple[int, Any]]:
    """The id arguments of a dc op that can be region inputs: ints at SymInt positions of its
    schema (an ``int`` argument would be specialised by the dispatcher; it stays a literal)."""
    out = []
    for i in block_regions.blocks_symint_args(n.target):
        a = n.args[i] if i < len(n.args) else None
        if isinstance(a, int) and not isinstance(a, bool):
            out.append((i, a))
        elif isinstance(a, (list, tuple)) and a and all(isinstance(x, int) and not isinstance(x, bool) for x in a):
            out.append((i, a))
    return out


def _meta_str(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"T({tuple(v.shape)},{tuple(v.stride())},{v.dtype},{v.device.type},{v.storage_offset() % 16})"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_meta_str(x) for x in v) + "]"
    if isinstance(v, torch.SymInt):
        return f"S({v.node.expr})"
    return type(v).__name__


def canonicalize(r: Region) -> None:
    """Build ``r.gm`` with canonical names, dc int args lifted to inputs, and ``r.key``."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, a in enumerate(r.inputs):
        p = g.placeholder(f"in{k}")
        p.meta.update({key: a.meta[key] for key in ("val", "tensor_meta") if key in a.meta})
        env[a] = p
    lifted: list[tuple[fx.Node, int, Any]] = []  # (node, arg index, value)
    for n in r.nodes:
        if _is_dc(n):
            lifted.extend((n, i, a) for i, a in _int_args(n))
    consts: list[int] = []
    const_nodes: dict[int, fx.Node] = {}   # position in consts -> placeholder
    for n, i, a in lifted:
        vals = list(a) if isinstance(a, (list, tuple)) else [a]
        for v in vals:
            p = g.placeholder(f"id{len(consts)}")
            const_nodes[len(consts)] = p
            consts.append(int(v))
    r.consts = consts
    pos = 0
    lifted_at: dict[tuple[fx.Node, int], Any] = {}
    for n, i, a in lifted:
        if isinstance(a, (list, tuple)):
            lifted_at[(n, i)] = [const_nodes[pos + j] for j in range(len(a))]
            pos += len(a)
        else:
            lifted_at[(n, i)] = const_nodes[pos]
            pos += 1
    sig = []
    for k, n in enumerate(r.nodes):
        args = list(n.args)
        for (m, i), rep in lifted_at.items():
            if m is n:
                args[i] = rep
        def local(a: fx.Node) -> fx.Node:
            return a if a.graph is g else env[a]
        new = g.create_node(n.op, n.target, fx.node.map_arg(tuple(args), local),
                            fx.node.map_arg(n.kwargs, local), name=f"n{k}")
        new.meta = dict(n.meta)
        env[n] = new
        if _is_dc(n):
            sig.append(f"n{k}:{_meta_str(n.meta.get('val'))}")
    out = g.output(tuple(env[o] for o in r.outputs))
    # Inductor keeps the traced stride of every region output (as it does for invoke_subgraph's
    # outputs): the next region was compiled for those strides, and the outer graph's output
    # strides are reported from them (compile_graph)
    out.meta["user_visible_output_idxs"] = list(range(len(r.outputs)))
    out.meta["original_output_strides"] = [  # Inductor records the same itself (2.11, 2.13)
        tuple(v.stride()) if isinstance(v := o.meta.get("val"), torch.Tensor) else None for o in r.outputs]
    r.gm = fx.GraphModule(torch.nn.Module(), g)
    ins = ";".join(_meta_str(a.meta.get("val")) for a in r.inputs)
    r.key = r.gm.code + "\n#in " + ins + "\n#dc " + ";".join(sig)


@dataclass
class Plan:
    """What the driver does, as plain data (it is written into the cached driver's source):
    per region step the index of its distinct artifact, the slots it reads, its ids, the slots
    it writes and the slots freed after it; the outer inputs nobody reads; the outputs' slots
    (None: a None output) and whether they form a list or a tuple."""
    steps: list[tuple[int, list[int], list[int], list[int], list[int]]]
    n_slots: int
    unread: list[int]
    outs: list[int | None]
    out_list: bool


def make_plan(regions: list[Region], artifact: list[int], placeholders: list[fx.Node], out_args,
              n_outer: int) -> Plan:
    """The driver's plan; ``artifact[i]`` is region i's index among the distinct artifacts, and
    ``out_args`` the graph's outputs (a flat list or tuple of nodes and Nones)."""
    slot: dict[fx.Node, int] = {p: i for i, p in enumerate(placeholders)}
    for r in regions:
        for o in r.outputs:
            slot[o] = len(slot)
    last: dict[int, int] = {}
    for i, r in enumerate(regions):
        for a in r.inputs:
            last[slot[a]] = i
    keep_to_end = {slot[n] for n in out_args if n is not None}
    steps = []
    for i, r in enumerate(regions):
        ins = [slot[a] for a in r.inputs]
        free = sorted(s for s in set(ins) if last.get(s) == i and s not in keep_to_end)
        steps.append((artifact[i], ins, [int(c) for c in r.consts], [slot[o] for o in r.outputs], free))
    # outer placeholders nobody reads: dropped at once
    unread = [i for i in range(n_outer) if i not in last and i not in keep_to_end]
    return Plan(steps, len(slot), unread, [None if a is None else slot[a] for a in out_args],
                isinstance(out_args, list))


def run_plan(plan: Plan, fns: list[Callable]):
    """The boxed driver: run the regions in order, free each value after its last reader (the
    outer argument list is cleared at once, as Inductor's own compiled graphs do).

    Generated as straight-line Python (one local per value, the ids as literals), as Inductor
    writes its own wrappers: the loop it replaces indexed a list per input and output and was
    1.7 ms of host time per step at 32 layers under cProfile (H100), the largest
    cost blocks add to a step."""
    n_outer = plan.n_slots - sum(len(outs) for _, _, _, outs, _ in plan.steps)
    v = [f"v{i}" for i in range(plan.n_slots)]
    lines = ["def run(args):"]
    if n_outer:
        lines.append(f"    {', '.join(v[:n_outer])}, = args")
    lines.append("    args.clear()")
    if plan.unread:
        lines.append(f"    del {', '.join(v[s] for s in plan.unread)}")
    for a, ins, consts, outs, free in plan.steps:
        call = f"f{a}([{', '.join([v[s] for s in ins] + [str(int(c)) for c in consts])}])"
        if outs:
            lines.append(f"    {', '.join(v[s] for s in outs)}, = {call}")  # (no star: 255 names at most)
        else:
            lines.append(f"    {call}")
        if free:
            lines.append(f"    del {', '.join(v[s] for s in free)}")
    out = ", ".join("None" if s is None else v[s] for s in plan.outs)
    lines.append(f"    return [{out}]" if plan.out_list else f"    return ({out}{',' if len(plan.outs) == 1 else ''})")
    scope = {f"f{i}": fn for i, fn in enumerate(fns)}
    exec(compile("\n".join(lines), "<deepcompile blocks driver>", "exec"), scope)  # noqa: S102 - our own plan
    run = scope["run"]
    run._boxed_call = True
    return run


def driver_source(plan: Plan, sources: list[str], checks: list[tuple[list[int], list[int]]]) -> str:
    """The cached driver's module (Inductor's FX graph cache stores it as a compiled graph whose
    code is this): data only; ``load_driver`` loads each distinct region's module (Inductor's own
    code, as compiled) and builds the same driver the compiling run used."""
    return ("# deepcompile: one graph compiled as decoder-block regions (deepcompile/compile/blocks.py); generated\n"
            "from deepcompile.compile import blocks as _blocks\n"
            f"_SOURCES = {sources!r}\n_CHECKS = {checks!r}\n"
            f"_PLAN = _blocks.Plan({plan.steps!r}, {plan.n_slots!r}, {plan.unread!r}, {plan.outs!r}, {plan.out_list!r})\n"
            "call = _blocks.load_driver(_PLAN, _SOURCES, _CHECKS)\n")


def load_driver(plan: Plan, sources: list[str], checks: list[tuple[list[int], list[int]]]):
    """Called by a cached driver's module when Inductor loads it (an AOTAutograd cache hit)."""
    rec = _record()
    if rec is not None:
        rec.blocks_loaded.append(len(plan.steps))
    return run_plan(plan, [block_regions.blocks_region_callable(src, *chk) for src, chk in zip(sources, checks)])


def compile_graph(gm: fx.GraphModule, example_inputs, compile_one: Callable, mode: str = "on", **kw):
    """Compile ``gm`` region by region with ``compile_one(gm, inputs, **kw)``, identical
    regions once; None when the graph has no repeated block (compile it whole). ``mode``
    (``resolve``): "auto" leaves a graph with symbolic shapes whole, and a graph whose regions
    fail to compile is compiled whole with a warning naming the error; "on" raises it."""
    if mode == "auto":
        if any(isinstance(x, torch.SymInt) for v in example_inputs if isinstance(v, torch.Tensor)
               for x in (*v.shape, *v.stride())):
            return None  # not measured with blocks: whole, as before
        try:
            return _compile_graph(gm, example_inputs, compile_one, **kw)
        except Exception as e:  # noqa: BLE001 - the whole graph is the fallback
            import warnings

            warnings.warn(f"deepcompile blocks: this {'backward' if kw.get('is_backward') else 'forward'} graph "
                          f"is compiled whole, its regions failed: {type(e).__name__}: {str(e)[:300]} "
                          f"(config blocks=false compiles every graph whole; blocks=true raises this)")
            return None
    return _compile_graph(gm, example_inputs, compile_one, **kw)


def _compile_graph(gm: fx.GraphModule, example_inputs, compile_one: Callable, **kw):
    t0 = time.perf_counter()
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        return None
    regions = split(gm)
    for r in regions:
        canonicalize(r)
    counts: dict[str, int] = {}
    for r in regions:
        if r.label is not _OUTSIDE:
            counts[r.key] = counts.get(r.key, 0) + 1
    if not any(c >= 2 for c in counts.values()):
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    example = {p: v for p, v in zip(placeholders, example_inputs)}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out_node.args[0]
    if not isinstance(outs, (list, tuple)) or not all(a is None or isinstance(a, fx.Node) for a in outs):
        return None  # not a flat list of values (never seen from AOTAutograd): compile it whole
    seg_kw = {k: v for k, v in kw.items() if k in ("is_backward", "is_inference", "cudagraphs")}
    static = set(kw.get("static_input_idxs") or ())
    fake_mode = block_regions.blocks_fake_mode(example_inputs)
    if getattr(fake_mode, "shape_env", None) is None:
        return None  # no ShapeEnv for the id symbols (not a traced graph): compile it whole
    slot = {p: i for i, p in enumerate(placeholders)}
    cache: dict[str, int] = {}          # key -> index into artifacts
    artifacts: list[Callable] = []
    artifact: list[int] = []            # per region
    n_compiled = n_reused = n_pinned = 0
    nodes_compiled = 0  # FX nodes Inductor lowered (the whole graph would lower every node once)
    # each region's kernels compile in Inductor's pool while the next region is lowered; all
    # are waited for before the driver is returned (blocks_deferred_kernel_wait says why)
    with blocks_deferred_kernel_wait() as waits:
        for r in regions:
            if r.key in cache:
                artifact.append(cache[r.key])
                n_reused += 1
                continue
            missing = [a.name for a in r.inputs if a not in example and "val" not in a.meta]
            if missing:  # a pass made a node without its fake value: a region cannot take it as an input
                raise RuntimeError(f"deepcompile blocks: region {r.label} reads {missing} from an earlier region, "
                                   f"and they have no meta['val'] (the pass that inserts them must set it); "
                                   f"config blocks=false compiles the graph whole")
            ins = [example[a] if a in example else a.meta["val"] for a in r.inputs]
            ids = block_regions.blocks_symbolic_ints(fake_mode, r.consts)
            for p, v in zip([p for p in r.gm.graph.nodes if p.op == "placeholder"][len(ins):], ids):
                p.meta["val"] = v
            r.gm.recompile()
            with block_regions.blocks_region_compile():
                compiled = block_regions.blocks_boxed(compile_one(
                    r.gm, ins + ids,
                    static_input_idxs=[i for i, a in enumerate(r.inputs) if slot.get(a) in static], **seg_kw))
            n_compiled += 1
            nodes_compiled += len(r.nodes)
            artifact.append(len(artifacts))
            artifacts.append(compiled)
            if block_regions.blocks_specialized(ids):
                # the artifact has this region's ids baked in (a guard pinned them): never share it
                n_pinned += 1
                continue
            cache[r.key] = artifact[-1]
    out_vals = [o.meta.get("val") if isinstance(o, fx.Node) else o for o in outs]
    block_regions.blocks_report_output_strides(out_vals)
    plan = make_plan(regions, artifact, placeholders, outs, len(placeholders))
    fn = run_plan(plan, artifacts)
    # the driver as a compiled graph of Inductor's FX graph cache, so that AOTAutograd's cache
    # can keep this graph like any Inductor graph (a re-run of the plan loads it from there)
    graph, cached = block_regions.blocks_cached_driver(
        artifacts, lambda srcs, chks: driver_source(plan, srcs, chks), out_vals, example_inputs)
    if graph is not None:
        graph.current_callable, fn = fn, graph
    rec = _record()
    if rec is not None:
        rec.block_compiles.append({
            "kind": "backward" if kw.get("is_backward") else "forward", "regions": len(regions),
            "compiled": n_compiled, "reused": n_reused, "pinned": n_pinned,
            "nodes": sum(len(r.nodes) for r in regions), "nodes_compiled": nodes_compiled,
            "labels": [r.label[1] if r.label is not _OUTSIDE else None for r in regions],
            "kernel_waits_deferred": waits.deferred, "kernel_wait_s": round(waits.wait_s, 3),
            "cached": True if graph is not None else cached,
            "seconds": time.perf_counter() - t0})
    return fn

