"""zero12: ZeRO stages 1 and 2 in the graph.

Parameters stay whole on every rank for compute (gathered once after each optimizer step and
kept, ``gather_persistent``), optimizer state lives only on this rank's flat shard, and the
backward graph hands the gradients to the runtime as they become ready, one ``reduce_grads``
call per reduce bucket (zero3.group_reduces; bucketed reduce-scatter into the shard's gradient:
nothing but the partition the optimizer reads survives into the step). Stage 2 reduce-scatters every micro-batch; stage 1 sums gradients locally and
communicates only at the accumulation boundary (the runtime's grad-sync flag, set by the
optimizer wrapper), freeing the local sums as soon as they are reduced.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from deepcompile.passes import zero3
from deepcompile.passes.registry import OFFLINE_NONE, PassContext, register_pass
from deepcompile.passes.zero3 import is_op, lower_grad_reduce

DC = torch.ops.dc
NAME = "zero12"


def keep_all_gathered(gm: fx.GraphModule) -> int:
    g = gm.graph
    seen: dict[int, fx.Node] = {}
    n = 0
    for u in list(g.nodes):
        if not is_op(u, DC.unshard.default):
            continue
        pid = int(u.args[1])
        if pid not in seen:
            with g.inserting_before(u):
                p = g.call_function(DC.gather_persistent.default, (u.args[0], pid))
            p.meta.update({k: v for k, v in u.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
            p.meta["dc_param"] = pid
            seen[pid] = p
            n += 1
        u.replace_all_uses_with(seen[pid])
        g.erase_node(u)
    return n


@register_pass(NAME, help="ZeRO-1/2: whole parameters kept per step, gradients reduce-scattered into the optimizer's shard",
               lowers=(1, 2), graph_only=True, offline=OFFLINE_NONE,
               conflicts=(zero3.NAME,))   # one lowering per list: each inserts its own stage's communication
def zero12(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    kept = keep_all_gathered(gm)
    n_red = lower_grad_reduce(gm, ctx) if ctx.kind == "backward" else 0
    ctx.notes.append(f"whole parameters: {kept}, reduces: {n_red}")
    gm.graph.lint()
    gm.recompile()
    return gm
