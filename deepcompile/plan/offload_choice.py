"""What offloading each decoder block's saved activations to host memory would save and cost.

The third way, beside keeping and recomputing, to take a block's activations off the device
between forward and backward (``passes/offload_activations.py`` with ``blocks``): copy them to
pinned host memory after their last forward reader and back before backward's first reader.
It runs no compute, only copies, each direction on its own stream at ``bytes_per_ms``
(``vocab.links.HOST_ONE_WAY_BYTES_PER_US``) beside the compute, so what it costs the step is the
part of the copies the compute cannot cover, plus what the covered copies still cost the compute
beside them (``COPY_OVERHEAD``, measured). The first part is found by running the copies on the
profiled step's timeline (:func:`schedule`):

- **out**: block by block, each block's copy starting when its last value is done with and the
  copy stream is free. The bytes leave the device when their copy ends (the runtime frees a
  storage after its copy), so a copy queue that falls behind the forward frees memory late;
- **back**: latest deadline first, as the pass places them: each reload as late as it can start
  and still end before its first reader once the later reloads are done, but never before its
  copy out has ended nor before its backward graph starts. Where a reload ends after its
  reader would start, compute waits, and everything after waits with it.

Blocks are offloaded earliest first (their activations wait for backward longest, so their
copies are hidden best), and the recomputed blocks are chosen from the rest
(``plan.recompute_choice.levels``). The planner tries prefixes of a few lengths: the longest
whose copies the compute hides, fractions of it, and the longest that still costs less than
recomputing those blocks would. On the CPU there is no device memory to save (the runtime's copy
is a memcpy within the same memory): the planner offers this lever only on CUDA.
"""
from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass

from deepcompile.passes.offload_activations import reload_starts
from deepcompile.plan.recompute_choice import from_fields, step_timeline

# a prefix whose copies add at most this much to the step counts as hidden
HIDDEN_MS = 0.5
# What copies the timeline hides still cost the compute beside them, as a share of their copy
# time. Measured on 1 H200 (8B-shape Llama, 4 layers, 16k tokens, 44 GiB limit): 2 blocks
# offloaded (2.3 GiB, 45 ms of copies each way) and 2 recomputed took 340.5 ms a step where
# recomputing 3 took 335.9 ms, and the timeline alone predicted the offloading plan 7.3 ms
# faster: 11.9 ms, 27% of the copies. (The offload ops also split Inductor's fused kernels
# around each offloaded value.)
COPY_OVERHEAD = 0.27
OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75, 1.0)   # of the longest hidden prefix, tried as levels


@dataclass(frozen=True)
class OffloadCost:
    block: int
    nbytes: int        # the saved activations of the block the pass would offload
    ready_ms: float    # step time at which the last of them is done with in forward
    need_ms: float     # step time at which backward first reads one of them
    bwd_start_ms: float  # step time at which that backward graph starts (no reload before)
    ready_pos: int     # timeline positions (plan.memory): the last forward reader,
    need_pos: int      # the first backward reader

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "OffloadCost":
        """The inverse of :meth:`to_dict` (plan.json's ``offload_options``)."""
        return from_fields(cls, d)


@dataclass(frozen=True)
class Away:
    """Bytes off the device between two timeline positions (what ``plan.memory`` subtracts)."""
    nbytes: int
    start: int
    end: int


@dataclass
class Timeline:
    """The profiled step's nodes in step order with their predicted start times (ms)."""
    start_ms: list      # per timeline position; one more entry: the step's end

    def pos_at(self, ms: float) -> int:
        """The last position that starts at or before ``ms`` (0 before the first)."""
        return max(0, bisect.bisect_right(self.start_ms, ms) - 1)


def offload_costs(compiled: dict, profile, static: dict, min_mb: float) -> tuple[list[OffloadCost], Timeline]:
    """Per block of the profiled graphs (``compiled``: (gid, kind) -> GraphModule after ``zero3``),
    what offloading its saved activations would move, and when."""
    from deepcompile.passes.alias import alias_closure
    from deepcompile.passes.offload_activations import _nbytes, by_block, eligible, last_reader, value_group

    starts, graph_start, pos = step_timeline(profile, static)
    tl = Timeline(starts)
    out = []
    for (gid, kind), gm in sorted(compiled.items()):
        if kind != "forward" or (gid, "backward") not in compiled:
            continue
        nodes = eligible(gm, min_mb)
        if not nodes:
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        bw = compiled[(gid, "backward")]
        placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
        for b, vals in sorted(by_block(nodes).items()):
            ready, need, nbytes = [], [], 0
            for v in vals:
                p = placeholders.get(v.name)
                if p is None:
                    continue
                last, _ = last_reader(value_group(gm.graph, v), order, None)
                r = pos.get((gid, "forward", last.name))
                readers = [u for a in alias_closure(p) for u in a.users if u.op == "call_function" and u is not a]
                firsts = [pos[(gid, "backward", u.name)] for u in readers if (gid, "backward", u.name) in pos]
                if r is None or not firsts:
                    continue
                ready.append(r)
                need.append(min(firsts))
                nbytes += _nbytes(v)
            if ready and nbytes:
                rp, np_ = max(ready), min(need)
                out.append(OffloadCost(b, nbytes, tl.start_ms[rp + 1], tl.start_ms[np_],
                                       graph_start[(gid, "backward")], rp, np_))
    return out, tl


def schedule(chosen: tuple, bytes_per_ms: float, tl: Timeline | None) -> tuple[float, tuple]:
    """(ms the copies add to one micro-batch's step, the bytes' ``Away`` windows) for offloading
    the blocks ``chosen`` (OffloadCost); see the module doc."""
    if not chosen:
        return 0.0, ()
    out_end: dict[int, float] = {}
    free = 0.0
    for c in sorted(chosen, key=lambda c: c.ready_ms):
        free = max(free, c.ready_ms) + c.nbytes / bytes_per_ms
        out_end[c.block] = free
    # back: latest deadline first, as the pass places them
    planned = dict(zip((c.block for c in chosen),
                       reload_starts([c.need_ms for c in chosen], [c.nbytes / bytes_per_ms for c in chosen])))
    # then as they run: compute waits where a reload ends late, and shifts everything after it
    delay, h2d_free = 0.0, 0.0
    back_start: dict[int, float] = {}
    for c in sorted(chosen, key=lambda c: c.need_ms):
        issue = max(planned[c.block], c.bwd_start_ms) + delay
        start = max(issue, out_end[c.block], h2d_free)
        h2d_free = start + c.nbytes / bytes_per_ms
        back_start[c.block] = start
        if h2d_free > c.need_ms + delay:
            delay = h2d_free - c.need_ms
    windows = []
    for c in chosen:
        if tl is None:
            start, end = c.ready_pos, c.need_pos
        else:  # (positions on the profiled timeline: the compute's delays are not in it)
            start = max(c.ready_pos, tl.pos_at(out_end[c.block]))
            # (a copy out that ends after the reload must start leaves the bytes on the device)
            end = max(start, min(c.need_pos, tl.pos_at(back_start[c.block])))
        windows.append(Away(c.nbytes, start, end))
    return delay, tuple(windows)


def price(chosen: tuple, bytes_per_ms: float, tl: Timeline | None) -> tuple[float, tuple]:
    """(what offloading ``chosen`` adds to one micro-batch's step, the bytes' windows): the
    compute's wait for late reloads (:func:`schedule`) plus ``COPY_OVERHEAD`` of the copies."""
    late, away = schedule(chosen, bytes_per_ms, tl)
    return late + COPY_OVERHEAD * sum(c.nbytes for c in chosen) / bytes_per_ms, away


def levels(costs: list[OffloadCost], bytes_per_ms: float, tl: Timeline | None,
           recompute_ms: dict[int, float] | None = None) -> list[tuple]:
    """The block sets to offload: none, and prefixes of the blocks earliest first; their lengths:
    fractions of the longest prefix whose copies stay hidden (``HIDDEN_MS``), and the longest
    whose copies cost less than recomputing the same blocks (``recompute_ms``: block -> ms)."""
    order = sorted((c for c in costs if c.nbytes > 0), key=lambda c: (c.ready_ms, c.block))
    if not order:
        return [()]
    late = [schedule(tuple(order[:k]), bytes_per_ms, tl)[0] for k in range(len(order) + 1)]
    hidden = max(k for k in range(len(order) + 1) if late[k] <= HIDDEN_MS)
    lengths = {0} | {max(1, round(hidden * f)) for f in OFFLOAD_FRACTIONS if hidden}
    if recompute_ms:
        # (price's terms, with the schedule already run)
        cheaper = [k for k in range(1, len(order) + 1)
                   if late[k] + COPY_OVERHEAD * sum(c.nbytes for c in order[:k]) / bytes_per_ms
                   < sum(recompute_ms.get(c.block, 0.0) for c in order[:k])]
        if cheaper:
            lengths.add(max(cheaper))
    return [tuple(order[:k]) for k in sorted(lengths)]


def blocks_param(chosen: tuple) -> str:
    """``offload_activations.blocks`` for a chosen set."""
    return ",".join(str(b) for b in sorted(c.block for c in chosen))
