"""recompute_activations: the chosen decoder blocks' activations are computed again in backward, not kept.

Activation checkpointing per block, as a rewrite of the partitioned graphs that keeps their
signature (what AOTAutograd saves between them stays as it is):

Forward: a saved-for-backward value whose storage is produced inside a chosen block and read
only inside that block (through views) is *dropped*: ``dc.drop_activation`` frees its storage
after its last forward reader, and the tensor object travels to backward empty. Values another
block or the head reads (the block's output, the next block's input) are never dropped: they are
what the recomputation starts from, as the inputs of a ``torch.utils.checkpoint`` region are.

Backward: before the first reader of any of the block's dropped values, the forward nodes that
compute them are copied in (a recipe the forward pass builds from its own graph: the block's
nodes between the kept values and the dropped ones), and the readers read the copies. A gathered
parameter the recipe needs (``dc.unshard`` of a shard the backward has anyway) is gathered once:
the recipe's gather and the backward's own for the same shard become one, at the earlier place.

The pass runs before ``zero3``, on graphs whose gathers are still ``dc.unshard``; ``zero3`` then
lowers the recipe's gathers with the rest. Which blocks is the planner's decision
(``plan/recompute_choice.py``: the blocks whose recomputation costs least per byte saved,
until the plan fits the memory limit); this pass takes the list.

A block is left whole (kept, noted) when its recipe would need a value the backward does not
have (an unsaved forward input, another block's dropped value), or would run an op that is
random or mutates its inputs (a second run would differ).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from deepcompile.compat import aot as aot_compat
from deepcompile.params import spec
from deepcompile.passes.alias import alias_closure, is_view, storage_keys
from deepcompile.passes.block_list import block_of, parse_blocks  # noqa: F401  (parse_blocks: the pass's API)
from deepcompile.passes.offload_activations import (_nbytes, _root, last_reader, owns_storage, runtime_storages,
                                                    storage_group)
from deepcompile.passes.registry import OFFLINE_NONE, PassContext, register_pass
from deepcompile.vocab.memory import fmt_bytes

DC = torch.ops.dc
NAME = "recompute_activations"


@dataclass
class RecomputeParams:
    blocks: str = spec("", help="decoder blocks (their index in the model's block list) whose activations backward "
                                "computes again instead of keeping them: comma-separated indices, 'all', or '' for none")

    def validate(self, path: str) -> None:
        parse_blocks(self.blocks, f"{path}.blocks")


@dataclass
class Recipe:
    """How backward computes block ``block``'s dropped values: ``graph``'s placeholders are named
    after the values backward has (saved ones, parameter shards), its output lists the dropped
    values in ``outputs`` order."""
    block: int
    graph: fx.Graph
    outputs: list[str]
    nbytes: int
    nodes: list[str] = field(default_factory=list)   # the forward nodes it copies


# The forward run leaves its recipes in ``ctx.handoff[NAME]`` for the same graph's backward run
# (AOTAutograd names backward's saved-value inputs after the forward nodes that produced them).


def _is_unshard(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is DC.unshard.default


def _is_dc(n: fx.Node) -> bool:
    return n.op == "call_function" and str(n.target).startswith("dc.")


def _replayable(n: fx.Node) -> bool:
    """An op that gives the same value when run again on the same inputs."""
    t = n.target
    if t is operator.getitem:
        return True
    tags = getattr(t, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    schema = getattr(t, "_schema", None)
    return not (schema is not None and schema.is_mutable)


def _saved(gm: fx.GraphModule) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """(user outputs, saved-for-backward values) of a forward graph; None when they cannot be told apart."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    start = aot_compat.saved_outputs_start(gm)
    if start is None:
        return None
    return ([o for o in outs[:start] if isinstance(o, fx.Node)],
            [o for o in outs[start:] if isinstance(o, fx.Node)])


def droppable(gm: fx.GraphModule) -> dict[int, list[tuple[fx.Node, list[fx.Node]]]]:
    """{block: [(storage root, the saved values over its storage)]}: the saved values each block
    could drop (see the module doc), by storage."""
    split = _saved(gm)
    if split is None:
        return {}
    user_outs, saved = split
    g = gm.graph
    protected = set()
    for p in g.nodes:
        if p.op in ("placeholder", "get_attr"):
            protected |= set(storage_keys(p) or ())
    for o in user_outs:
        protected |= set(storage_keys(o) or ())
    protected |= runtime_storages(g)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for o in saved:
        if o.op == "call_function":
            groups.setdefault(_root(o), []).append(o)
    out: dict[int, list] = {}
    for root, members in groups.items():
        b = block_of(root)
        v = root.meta.get("val")
        if b is None or _is_dc(root) or not isinstance(v, torch.Tensor) or not owns_storage(v):
            continue
        keys = set(storage_keys(root) or ())
        if not keys or keys & protected:
            continue
        closure = block_storage(g, root, b)
        readers = [u for a in closure for u in a.users if u not in closure and u.op != "output"]
        if any(block_of(u) != b for u in readers):
            continue  # read outside the block: a value the recomputation starts from
        out.setdefault(b, []).append((root, members))
    return out


def block_storage(g: fx.Graph, root: fx.Node, block: int) -> list[fx.Node]:
    """The nodes over ``root``'s storage: its views, and nodes of its block that share the storage
    by fake value. Other blocks' nodes are left out: where blocks were traced once
    (``compile/nested.py``) their fake values share storages with this block's although their
    real tensors never do."""
    mine = set(alias_closure(root))
    return [m for m in storage_group(g, root) if m in mine or block_of(m) == block]


def _gathered(n: fx.Node, available: set[fx.Node]) -> bool:
    """A runtime op's output or item (a gathered parameter, in a graph ``zero3`` has lowered)
    whose shards backward has: the graph inputs its chain of runtime ops reads are all saved."""
    while n.op == "call_function" and n.target is operator.getitem:
        n = n.args[0]
    if not _is_dc(n):
        return False
    seen, stack = set(), [n]
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        if m.op == "placeholder":
            if m not in available:
                return False
        elif _is_dc(m) or m.target is operator.getitem:
            stack.extend(m.all_input_nodes)
    return True


def _walk(block: int, targets: list[fx.Node], available: set[fx.Node], lowered: bool = False) -> tuple[set, set] | str:
    """(forward nodes to copy, values backward has that they read) to compute ``targets``, or why
    they cannot be computed in backward. ``lowered``: the graph is after ``zero3`` (the planner's
    profiled graphs), where a gathered parameter counts as one backward has (it gathers it again)."""
    need: set[fx.Node] = set()
    inputs: set[fx.Node] = set()
    stack = list(targets)
    while stack:
        n = stack.pop()
        if n in need or n in inputs:
            continue
        if n in available or (lowered and _gathered(n, available)):
            inputs.add(n)
            continue
        if n.op != "call_function":
            return f"needs {n.name}, which backward does not have"
        if _is_unshard(n):
            src = n.args[0]
            if not (isinstance(src, fx.Node) and src in available):
                return f"its gather {n.name} reads {src}, which backward does not have"
        elif block_of(n) not in (block, None) or (block_of(n) is None and not (is_view(n) or n.target is operator.getitem)):
            return f"needs {n.name} from outside block {block}"
        elif not _replayable(n):
            return f"{n.name} ({n.target}) is random or mutates its inputs"
        need.add(n)
        stack.extend(n.all_input_nodes)
    return need, inputs


def build_recipe(block: int, dropped: list[fx.Node], available: set[fx.Node], lowered: bool = False) -> Recipe | str:
    """The recipe computing ``dropped`` (saved values of ``block``) from ``available`` (what
    backward has), or why there is none."""
    walked = _walk(block, dropped, available, lowered)
    if isinstance(walked, str):
        return walked
    need, inputs = walked
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    order = list(dropped[0].graph.nodes)
    for n in order:
        if n in inputs:
            env[n] = g.placeholder(n.name)
            env[n].meta = dict(n.meta)
    copied = []
    for n in order:
        if n in need:
            env[n] = g.node_copy(n, env.__getitem__)
            copied.append(n.name)
    g.output(tuple(env[d] for d in dropped))
    return Recipe(block, g, [d.name for d in dropped], sum(_nbytes(d) for d in dropped), copied)


def plan_forward(gm: fx.GraphModule, wanted: set[int] | str, lowered: bool = False
                 ) -> tuple[list[Recipe], dict[int, list[fx.Node]], list[str]]:
    """(recipes, {block: storage roots to drop}, notes) for the blocks ``wanted``. A value whose
    recomputation would need what backward lacks (a buffer the backward never reads, say) is
    kept, and the values computed from it start from it."""
    split = _saved(gm)
    if split is None:
        return [], {}, ["cannot tell saved activations from user outputs: nothing recomputed"]
    saved = set(split[1])
    cands = droppable(gm)
    groups = {b: list(cands[b]) for b in (sorted(cands) if wanted == "all" else sorted(wanted)) if b in cands}
    kept: dict[int, int] = {}
    changed = True
    while changed:
        changed = False
        available = saved - {m for gs in groups.values() for _, ms in gs for m in ms}
        for b, gs in groups.items():
            for grp in list(gs):
                if isinstance(_walk(b, grp[1], available, lowered), str):
                    gs.remove(grp)
                    kept[b] = kept.get(b, 0) + 1
                    available |= set(grp[1])
                    changed = True
    notes = [f"block {b}: {k} saved values kept (their recomputation needs what backward lacks)"
             for b, k in sorted(kept.items())]
    available = saved - {m for gs in groups.values() for _, ms in gs for m in ms}
    recipes, roots = [], {}
    for b, gs in groups.items():
        if not gs:
            continue
        r = build_recipe(b, [m for _, ms in gs for m in ms], available, lowered)
        if isinstance(r, str):  # pragma: no cover - every group walked above
            raise AssertionError(f"{NAME}: block {b}: {r}")
        recipes.append(r)
        roots[b] = [root for root, _ in gs]
    return recipes, roots, notes


def drop_forward(gm: fx.GraphModule, roots: list[fx.Node]) -> None:
    """``dc.drop_activation`` after the last forward reader of each root's storage."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    for root in roots:
        last, readers = last_reader(block_storage(g, root, block_of(root)), order, DC.drop_activation.default)
        with g.inserting_after(last):
            op = g.call_function(DC.drop_activation.default, (root, readers))
        op.meta["val"] = None


def recompute_backward(gm: fx.GraphModule, recipes: list[Recipe]) -> tuple[int, int]:
    """Copy each recipe in before the first reader of its values; (recipes used, gathers merged)."""
    g = gm.graph
    ph = {n.name: n for n in g.nodes if n.op == "placeholder"}
    used = 0
    for r in recipes:
        outs = [ph.get(name) for name in r.outputs]
        readers = [u for p in outs if p is not None for u in p.users]
        if not readers:
            continue
        order = {n: i for i, n in enumerate(g.nodes)}
        first = min(readers, key=order.__getitem__)
        env: dict[fx.Node, fx.Node] = {}
        result = None
        with g.inserting_before(first):
            for n in r.graph.nodes:
                if n.op == "placeholder":
                    if n.name not in ph:
                        raise AssertionError(f"{NAME}: block {r.block}'s recipe reads {n.name}, which the backward "
                                             "graph does not take as an input")
                    env[n] = ph[n.name]
                elif n.op == "output":
                    result = n.args[0]
                else:
                    c = g.node_copy(n, env.__getitem__)
                    c.meta["recompute_of"] = n.name
                    env[n] = c
        for p, value in zip(outs, result):
            if p is not None:
                p.replace_all_uses_with(env[value])
        used += 1
    return used, merge_gathers(g)


def merge_gathers(g: fx.Graph) -> int:
    """One ``dc.unshard`` per shard: later ones read the earliest (a recipe's gather and the
    backward's own for the same parameter)."""
    first: dict[tuple, fx.Node] = {}
    merged = 0
    for n in list(g.nodes):
        if _is_unshard(n):
            key = (n.target, n.args, tuple(sorted(n.kwargs.items())))
            if key in first:
                n.replace_all_uses_with(first[key])
                g.erase_node(n)
                merged += 1
            else:
                first[key] = n
    return merged


@register_pass(NAME, RecomputeParams, graph_only=True, offline=OFFLINE_NONE, planned=("blocks",),
               planner_adds=True, precedes=("zero3",))
def recompute_activations(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Recompute the chosen decoder blocks' activations in backward instead of keeping them."""
    wanted = parse_blocks(ctx.params.blocks)
    if ctx.kind == "forward":
        if not wanted:
            ctx.handoff[NAME] = []
            return gm
        recipes, roots, notes = plan_forward(gm, wanted)
        ctx.handoff[NAME] = recipes
        drop_forward(gm, [r for b in sorted(roots) for r in roots[b]])
        ctx.notes.extend(notes)
        ctx.notes.append(f"recomputed in backward: blocks {[r.block for r in recipes]}, "
                         f"{fmt_bytes(sum(r.nbytes for r in recipes))} of saved activations dropped")
    elif ctx.kind == "backward":
        recipes = ctx.handoff.get(NAME, [])
        if not recipes:
            return gm
        used, merged = recompute_backward(gm, recipes)
        ctx.notes.append(f"recipes: {used} of {len(recipes)} blocks recomputed; {merged} gathers shared with backward's own")
    else:
        return gm
    gm.graph.lint()
    gm.recompile()
    return gm
