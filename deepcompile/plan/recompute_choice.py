"""What recomputing each decoder block would save and cost, and the orders the planner tries.

From the profiled graphs (after ``zero3``) the recompute pass's own analysis
(``passes.recompute_activations.plan_forward``) finds, per block, the saved activations its
forward would drop and the forward nodes backward would run again. The planner prices each block:

- **bytes**: the dropped values' sizes. They are gone from the drop (the block's last forward
  node) until the recomputation (just before backward's first reader of any of them), so a plan
  subtracts them from the profiled memory at every node in between (``plan.memory.plan_memory``);
- **time**: the copied nodes' profiled latencies (Inductor's fused estimate for pointwise ones
  where the final compile is Inductor's), added to the step once per micro-batch: the
  recomputation is compute on backward's critical path.

Blocks are tried cheapest per byte first (alike blocks: the earliest first, whose activations
are away longest), in growing prefixes of every length: none, one, two, ... all. Every length,
because one block more than needed costs its recomputation in every step (the 8B Llama at 8k
context: ~4-5 ms a block, 25 of 32 blocks recomputed under FSDP2's peak). The planner finds the
shortest prefix that fits by bisection (``planner.choose``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch.fx as fx

@dataclass(frozen=True)
class BlockCost:
    block: int
    nbytes: int      # saved activations its forward drops
    ms: float        # its recomputation in backward, per micro-batch
    start: int       # timeline position (plan.memory) after which the bytes are gone
    end: int         # timeline position from which they are back

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BlockCost":
        """The inverse of :meth:`to_dict` (plan.json's ``recompute_options``)."""
        return from_fields(cls, d)


_CASTS = {"int": int, "float": float}


def from_fields(cls, d: dict):
    """``cls`` (a dataclass of int and float fields) from a dict a record holds: each field cast
    to its type. KeyError, TypeError or ValueError on a missing or malformed field."""
    return cls(**{f.name: _CASTS[f.type](d[f.name]) for f in fields(cls)})


def chrono_key(gid: int, kind: str) -> tuple:
    """Graphs in the order a step runs them: forwards by graph id, then backwards in reverse."""
    return (0, gid) if kind != "backward" else (1, -gid)


def timeline_positions(profile) -> dict[tuple, int]:
    """(graph id, kind, node name) -> the node's position in the step (``chrono_key`` order)."""
    return step_timeline(profile)[2]


def step_timeline(profile, static: dict | None = None) -> tuple[list[float], dict, dict]:
    """(each position's start time (ms) and one more: the step's end, (graph id, kind) -> the
    graph's start (ms), (graph id, kind, node name) -> position): the profiled step in
    ``chrono_key`` order, node times as the block models count them (``_cost_us``: Inductor's fused
    estimate where ``static`` has one, else the profiled latency)."""
    starts, pos, graph_start, t = [], {}, {}, 0.0
    for (gid, kind), g in sorted(profile.graphs.items(), key=lambda kv: chrono_key(*kv[0])):
        graph_start[(gid, kind)] = t
        st = (static or {}).get((gid, kind))
        for n in g.nodes:
            pos[(gid, kind, n.name)] = len(starts)
            starts.append(t)
            t += (_cost_us(n.name, st) or n.latency_ms * 1e3) / 1e3
    starts.append(t)
    return starts, graph_start, pos


def _cost_us(name: str, static) -> float:
    lat, _rate, fused = static if static is not None else (None, None, None)
    c = (fused or {}).get(name)
    return c if c is not None else (lat or {}).get(name, 0.0)


def block_costs(compiled: dict, profile, static: dict) -> tuple[list[BlockCost], list[str]]:
    """Per recomputable block of the profiled graphs (``compiled``: (gid, kind) -> GraphModule
    after ``zero3``), what it saves and costs; and notes on blocks the pass would keep whole."""
    from deepcompile.passes.recompute_activations import block_of, plan_forward

    pos = timeline_positions(profile)
    out, notes = [], []
    for (gid, kind), gm in sorted(compiled.items()):
        if kind != "forward" or (gid, "backward") not in compiled:
            continue
        recipes, _roots, why = plan_forward(gm, "all", lowered=True)
        notes += [f"graph {gid}: {w}" for w in why]
        bw: fx.GraphModule = compiled[(gid, "backward")]
        first_reader: dict[str, int] = {}
        for n in bw.graph.nodes:
            if n.op == "placeholder":
                continue
            p = pos.get((gid, "backward", n.name))
            for a in n.all_input_nodes:
                if a.op == "placeholder" and p is not None:
                    first_reader.setdefault(a.name, p)
        last_fwd: dict[int, int] = {}
        for n in gm.graph.nodes:
            b, p = block_of(n), pos.get((gid, "forward", n.name))
            if b is not None and p is not None:
                last_fwd[b] = max(last_fwd.get(b, p), p)
        st = static.get((gid, "forward"))
        for r in recipes:
            ends = [first_reader[o] for o in r.outputs if o in first_reader]
            if r.block not in last_fwd or not ends:
                continue
            ms = sum(_cost_us(name, st) for name in r.nodes) / 1e3
            out.append(BlockCost(r.block, r.nbytes, ms, last_fwd[r.block], min(ends)))
    return out, notes


def levels(costs: list[BlockCost]) -> list[tuple[BlockCost, ...]]:
    """The block sets to try: the prefixes of every length of the blocks, cheapest per byte first. Costs
    within 10% of each other count as alike (identical blocks differ only by the profile's
    noise); among alike blocks, the one whose bytes are away longest first (the earliest: its
    activations wait for backward longest, so they are off the device wherever the peak is)."""
    def key(c: BlockCost):
        return (round(math.log(max(c.ms, 1e-9) / c.nbytes) / math.log(1.1)), -(c.end - c.start), c.block)
    order = sorted((c for c in costs if c.nbytes > 0 and c.end > c.start), key=key)
    return [tuple(order[:k]) for k in range(len(order) + 1)]


def blocks_param(chosen: tuple[BlockCost, ...]) -> str:
    """``recompute_activations.blocks`` for a chosen set."""
    return ",".join(str(b) for b in sorted(c.block for c in chosen))
