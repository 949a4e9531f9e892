"""The planner: the default plan's pass parameters from what was measured.

Inputs: the agreed profile (forward/backward memory per node, the optimizer step's peak, latencies
and the communication model), the parameters' sizes, the device's capacity and the user's limit
(``memory_limit_gib``; default 90% of the device). Output: ``selective_unshard.budget_mb`` (what
stays gathered from forward to backward and across micro-batches), ``prefetch.budget_mb`` and
``fuse_mb`` (how far ahead gathers go and how they coalesce), ``recompute_activations.blocks``
(the decoder blocks whose activations backward computes again, :mod:`deepcompile.plan.recompute_choice`)
and, only when nothing fits otherwise, ``offload_optimizer.limit_mb``. Among candidate plans (a
grid of kept fractions x prefetch budgets x recomputed blocks), the one the cost model predicts
fastest whose predicted peak
(:mod:`deepcompile.plan.memory`) is within the limit; a plan predicted above the limit is never
chosen, and when none fits the error says how much is missing and which knob helps.

Step time comes from the cost model itself (``cost_model.predict``): the profiled graphs are
copied and the candidate's passes run on the copies, so the prediction sees the same collectives,
groups and kept parameters the real compile will. Without those graphs (a profile read from a
record, the synthetic tests) an analytic model stands in (:func:`analytic_step_ms`), and the
record says which one decided.

Every rank must decide alike, or ranks issue different collectives and the job deadlocks: the
profile is agreed (element-wise max), and the memory the decision uses is one all-reduce MIN of
every rank's capacity, free memory and limit (:func:`agree_memory`); the rest is deterministic.
The ranks share the candidates' pricing out (:class:`SplitTimer`) and gather the prices, so each
rank decides from the very same numbers in a fraction of the time.
Hand-set pass parameters (given in the config's pass entries) are kept as they are and the
planner plans around them. Which parameters are the planner's, and what a pass the list lacks
stands for, each pass declares at its registration (``PassDef.planned``, ``PassDef.absent``).

The device's memory is :mod:`deepcompile.plan.device_memory`, the candidates' pricing
:mod:`deepcompile.plan.pricing`.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from deepcompile.passes import PASSES, offload_activations, offload_optimizer, prefetch, recompute_activations, zero3
from deepcompile.passes import selective_unshard as su
from deepcompile.passes.registry import OFFLINE_RERUN, PassEntry, absent_params, planned_params
from deepcompile.plan.cost_model import resident_optimizer_ms
from deepcompile.plan.device_memory import TWO_MOMENTS, DeviceMemory, agree_memory, local_memory
from deepcompile.plan.estimate import host_model, offload_ms
from deepcompile.vocab.links import HOST_ONE_WAY_BYTES_PER_US
from deepcompile.plan.memory import (GIB, MIB, STREAM_CHUNK_MB, MemoryFacts, PlanMemory, optimizer_peak, plan_memory,
                                     prefetch_bytes, streamed_optimizer_peak, with_reloads)
from deepcompile.plan.pricing import PlanError, SplitTimer, no_gc, price
from deepcompile.plan import offload_choice
from deepcompile.plan.recompute_choice import blocks_param
from deepcompile.vocab.memory import fmt_bytes

PREFETCH_LEVELS_MB = (2048.0, 512.0, 64.0, 0.0)  # how far ahead gathers may run
KEEP_FRACTIONS = (1.0, 0.5, 0.25, 0.0)           # of all parameters' gathered bytes
KEEP_SMALL_MB = 64.0  # and the constant the default plan kept before the planner (its small parameters)
FUSE_MB = 128.0                                  # coalesced group size, never above the prefetch budget
# optimizer.step() in chunks (optimizer_chunk_mb 'auto'): the sizes tried, largest first, when the
# step's unchunked peak is above the limit; each extra chunk group costs the host one more pass of
# the optimizer's per-group Python and ~12 foreach launches: 0.03-0.04 ms a chunk measured on this
# CPU (benchmarks/optim_chunks.py --device cpu: AdamW foreach over the 16-layer Llama's 147 shards,
# narrowed; 1 vs 9 chunks 2.6 -> 2.9 ms, +11%), taken as 0.1 ms with CUDA's launches (to be
# measured on the GPU by the same script). Not negligible beside a host-bound 45 ms step whose
# optimizer.step takes 8-11 ms of host, so chunks only where the whole-group step does not fit.
CHUNK_FRACTIONS = (1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64)   # of the largest param group
CHUNK_HOST_MS = 0.1
# {pass: the parameters the planner decides}, as each pass declares them (``PassDef.planned``)
PLANNED = planned_params()


# ----------------------------------------------------------------------------------------- candidates
@dataclass
class Candidate:
    keep_mb: float
    prefetch_mb: float
    fuse_mb: float
    offload_limit_mb: float | None   # None: no offload_optimizer; else its limit_mb (the memory limit)
    kept: int                        # bytes kept gathered
    prefetch: int                    # bytes prefetched ahead, at most
    offloaded: int                   # optimizer state bytes offloaded
    memory: PlanMemory | None = None
    step_ms: float = math.inf
    chunk_mb: float | None = None    # optimizer.step() chunk size (0: whole groups; None: as profiled)
    recompute: tuple = ()            # plan.recompute_choice.BlockCost of the blocks backward recomputes
    streamed: bool = False           # all optimizer state offloaded, streamed through the step in chunks
    offload_act: tuple = ()          # plan.offload_choice.OffloadCost of the blocks whose activations go to host
    act_away: tuple = ()             # and when their bytes are off the device (plan.offload_choice.schedule)
    act_exposed_ms: float = 0.0      # what their copies add to a micro-batch

    @property
    def away(self) -> tuple:
        """Activation bytes off the device and when (recomputed and offloaded blocks), for plan_memory."""
        return tuple(self.recompute) + tuple(self.act_away)

    def params(self) -> dict[str, dict]:
        out = {su.NAME: {"budget_mb": self.keep_mb},
               prefetch.NAME: {"budget_mb": self.prefetch_mb, "fuse_mb": self.fuse_mb}}
        if self.recompute:
            out[recompute_activations.NAME] = {"blocks": blocks_param(self.recompute)}
        if self.offload_act:
            out[offload_activations.NAME] = {"blocks": offload_choice.blocks_param(self.offload_act),
                                             "h2d_gbps": HOST_ONE_WAY_BYTES_PER_US / 1e3}
        if self.offload_limit_mb is not None:
            out[offload_optimizer.NAME] = {"limit_mb": self.offload_limit_mb,
                                        # the amount itself: the pass's own sizing reads the profiled
                                        # peak, which knows nothing of what this plan recomputes
                                        "offload_mb": round(self.offloaded / MIB, 3),
                                        "final_reload": "fit",  # the limit holds at the end of backward too
                                        "step": "streamed" if self.streamed else "resident"}
        return out

    def summary(self) -> dict:
        return {"params": self.params(), "optimizer_chunk_mb": self.chunk_mb, "step_ms": round(self.step_ms, 3),
                "peak_bytes": self.memory.peak, "peak_gib": round(self.memory.peak / GIB, 3),
                "memory": self.memory.to_dict(), "kept_bytes": self.kept, "offloaded_bytes": self.offloaded,
                "recomputed_blocks": sorted(c.block for c in self.recompute),
                "recomputed_bytes": sum(c.nbytes for c in self.recompute),
                "recompute_ms": round(sum(c.ms for c in self.recompute), 3),
                "offloaded_act_blocks": sorted(c.block for c in self.offload_act),
                "offloaded_act_bytes": sum(c.nbytes for c in self.offload_act),
                "offload_act_exposed_ms": round(self.act_exposed_ms, 3)}


@dataclass
class Plan:
    chosen: Candidate
    runner_up: Candidate | None
    memory: DeviceMemory
    facts: MemoryFacts
    hand_set: dict
    time_model: str
    considered: int
    fitting: int
    why: str = ""
    passes: list = field(default_factory=list)   # the pass list compiled with the plan
    block_costs: list = field(default_factory=list)  # plan.recompute_choice.BlockCost of every recomputable block
    offload_costs: list = field(default_factory=list)  # plan.offload_choice.OffloadCost of every offloadable block
    pace: dict | None = None   # who sets the chosen plan's pace, host or GPU (:func:`pace`)
    roomy: bool = False        # every candidate fitted the limit (choose's host-time tie applied)

    def to_dict(self) -> dict:
        f = asdict(self.facts)
        f["gathered_total"] = self.facts.gathered_total
        f.pop("gathered")
        f.pop("timeline")  # one entry per profiled node: the record has the profile itself
        return {"chosen": self.chosen.summary(),
                "runner_up": None if self.runner_up is None else self.runner_up.summary(),
                "limit_bytes": self.memory.limit, "capacity_bytes": self.memory.capacity,
                "available_bytes": self.memory.available, "limit_source": self.memory.source,
                "limit_gib": round(self.memory.limit / GIB, 3), "capacity_gib": round(self.memory.capacity / GIB, 3),
                "facts": f, "hand_set": self.hand_set, "time_model": self.time_model,
                "considered": self.considered, "fitting": self.fitting, "why": self.why,
                "passes": self.passes, "summary": self.summary_line(),
                "recompute_options": [c.to_dict() for c in self.block_costs],
                "offload_options": [c.to_dict() for c in self.offload_costs],
                "pace": self.pace}

    def summary_line(self) -> str:
        c = self.chosen
        p = c.params()
        s = (f"plan: keep {fmt_bytes(c.kept)} gathered ({su.NAME}.budget_mb {p[su.NAME]['budget_mb']:g}), "
             f"{prefetch.NAME}.budget_mb {p[prefetch.NAME]['budget_mb']:g}, fuse_mb {p[prefetch.NAME]['fuse_mb']:g}")
        if c.offload_limit_mb is not None:
            s += f", offload {fmt_bytes(c.offloaded)} of optimizer state (limit_mb {c.offload_limit_mb:g})"
        if c.streamed:
            s += f", the optimizer step streams it through in chunks of {c.chunk_mb:g} MiB"
        elif c.chunk_mb:
            s += f", optimizer.step in chunks of {c.chunk_mb:g} MiB (optimizer_chunk_mb)"
        if c.recompute:
            s += (f", recompute {len(c.recompute)} block(s) in backward ({fmt_bytes(sum(x.nbytes for x in c.recompute))} "
                  f"of activations, +{sum(x.ms for x in c.recompute):.1f} ms)")
        if c.offload_act:
            s += (f", offload {len(c.offload_act)} block(s)' activations to host "
                  f"({fmt_bytes(sum(x.nbytes for x in c.offload_act))}, +{c.act_exposed_ms:.1f} ms exposed)")
        return s + (f"; predicted {c.step_ms:.1f} ms, peak {fmt_bytes(c.memory.peak)} "
                    f"of a {fmt_bytes(self.memory.limit)} limit ({self.memory.source})")


# The caching allocator rounds large blocks to 2 MiB: a predicted peak that far above the limit is
# not a real difference (the limit is often another system's measured peak, FSDP2's, whose
# optimizer step holds exactly the same shards, gradients and state as ours).
ALLOCATOR_SLACK = 2 * MIB
HOST_TIE = 0.02  # predicted step times this close count as equal (see choose)


def keep_levels(facts: MemoryFacts) -> list[float]:
    """selective_unshard budgets (MiB) to try: everything, halves, a quarter, 64 MiB (the small
    parameters, what the default plan kept before), nothing; the largest first. "Everything" gets
    a MiB of slack so rounding never leaves a parameter out."""
    total = facts.gathered_total
    levels = [round(total / MIB + 1.0, 3)] + [round(total * f / MIB, 3) for f in KEEP_FRACTIONS[1:]]
    if KEEP_SMALL_MB * MIB < total * min(f for f in KEEP_FRACTIONS if f > 0):
        levels.append(KEEP_SMALL_MB)
    out = []
    for mb in sorted(levels, reverse=True):
        if mb not in out:
            out.append(mb)
    return out


def candidates(facts: MemoryFacts, kept_bytes: Callable[[float], int], hand: dict,
               recompute_levels: list[tuple] | None = None, offload: "ActivationOffload | None" = None) -> list[Candidate]:
    """Every keep x prefetch x activation offload x recompute combination, hand-set values held
    fixed. A block whose activations are offloaded is not recomputed too."""
    hk = hand.get(su.NAME, {})
    hp = hand.get(prefetch.NAME, {})
    keeps = [hk["budget_mb"]] if "budget_mb" in hk else keep_levels(facts)
    out, seen = [], set()
    combos = []
    for off in (offload.levels if offload is not None else [()]):
        moved = {c.block for c in off}
        exposed, away = offload.schedule(off) if off else (0.0, ())
        for rc in (recompute_levels or [()]):
            combos.append((off, exposed, away, tuple(c for c in rc if c.block not in moved)))
    for off, exposed, away, rc in combos:
        for keep_mb in keeps:
            kept = kept_bytes(keep_mb)
            rest = facts.gathered_total - kept
            levels = [hp["budget_mb"]] if "budget_mb" in hp else (PREFETCH_LEVELS_MB if rest > 0 else (0.0,))
            for pf in levels:
                fuse = hp.get("fuse_mb", min(FUSE_MB, pf))
                key = (kept, pf, fuse, tuple(c.block for c in off), tuple(c.block for c in rc))
                if key in seen:
                    continue
                seen.add(key)
                out.append(Candidate(keep_mb, pf, fuse, None, kept, prefetch_bytes(facts, kept, pf, fuse), 0,
                                     recompute=tuple(rc), offload_act=tuple(off), act_away=away,
                                     act_exposed_ms=exposed))
    return out


@dataclass
class ActivationOffload:
    """The activation-offload lever as the planner sees it: the block sets to try and how each
    runs on the step's timeline (:mod:`deepcompile.plan.offload_choice`)."""
    costs: list                                  # OffloadCost of every offloadable block
    timeline: "offload_choice.Timeline | None"   # None: positions only (a record's plan.json)
    bytes_per_ms: float = HOST_ONE_WAY_BYTES_PER_US * 1e3
    levels: list = field(default_factory=list)
    recompute_ms: dict = field(default_factory=dict)   # block -> what recomputing it would cost instead

    def schedule(self, chosen: tuple) -> tuple[float, tuple]:
        return offload_choice.price(chosen, self.bytes_per_ms, self.timeline)

    @classmethod
    def of(cls, costs: list, timeline, recompute_ms: dict | None = None) -> "ActivationOffload | None":
        if not costs:
            return None
        a = cls(list(costs), timeline, recompute_ms=dict(recompute_ms or {}))
        a.levels = offload_choice.levels(a.costs, a.bytes_per_ms, timeline, recompute_ms)
        return a


def chunk_for(facts: MemoryFacts, limit: int, hand: dict | None = None) -> float | None:
    """The optimizer step's chunk size (MiB) for a limit: hand-set (``hand["optimizer"]["chunk_mb"]``)
    as it is; else 0 (whole groups, no host cost) where the unchunked step fits, else the largest
    of ``CHUNK_LEVELS_MB`` whose predicted step peak fits; None where no chunk size is predicted
    to fit (the model knows no temporaries that scale, or even the smallest chunk is too big).
    The step's peak does not depend on the rest of the plan (kept copies are dropped before it),
    so chunking never makes one plan fit and not another: it makes the step fit, or not."""
    h = (hand or {}).get("optimizer", {})
    if "chunk_mb" in h:
        return float(h["chunk_mb"])
    if optimizer_peak(facts, 0.0) <= limit + ALLOCATOR_SLACK:
        return 0.0
    for mb in chunk_levels(facts):
        if optimizer_peak(facts, mb) <= limit + ALLOCATOR_SLACK:
            return mb
    return None


def stream_chunk_mb(facts: MemoryFacts, hand: dict | None = None) -> float | None:
    """The chunk size (MiB) a streamed optimizer step would use: the hand-set ``optimizer_chunk_mb``
    if any, else ``STREAM_CHUNK_MB``; None where the step cannot be streamed (an optimizer
    runtime.optim_chunks cannot cut, or chunking set off by hand)."""
    if not facts.opt_streamable:
        return None
    h = (hand or {}).get("optimizer", {})
    if "chunk_mb" in h:
        return float(h["chunk_mb"]) if float(h["chunk_mb"]) > 0 else None
    return STREAM_CHUNK_MB


def chunk_levels(facts: MemoryFacts) -> list[float]:
    """Chunk sizes (MiB) to try, largest first: halves of the largest param group down to 1/64
    (the 953M Llama's 1.78 GiB group on 2 ranks: 909 MiB ... 28 MiB); none where the model knows
    no temporaries that scale."""
    if not facts.opt_groups or facts.opt_temp_factor <= 0:
        return []
    top = max(sum(g) for g in facts.opt_groups) / MIB
    return [round(top * f, 3) for f in CHUNK_FRACTIONS]


def chunk_ms(facts: MemoryFacts, chunk_mb: float | None) -> float:
    """Host time the chunk groups add to a step (``CHUNK_HOST_MS`` per group beyond the user's)."""
    if not chunk_mb or not facts.opt_groups:
        return 0.0
    from deepcompile.runtime.optim_chunks import count_chunks

    extra = count_chunks(facts.opt_groups, int(chunk_mb * MIB)) - sum(1 for g in facts.opt_groups if g)
    return CHUNK_HOST_MS * max(0, extra)


def choose(facts: MemoryFacts, mem: DeviceMemory, kept_bytes: Callable[[float], int],
           step_ms: Callable[[Candidate], float], hand: dict | None = None, time_model: str = "",
           offload_headroom_mb: float = 1024.0, allow_offload: bool = True,
           recompute_levels: list[tuple] | None = None, accumulation: int = 1,
           offload: ActivationOffload | None = None) -> Plan:
    """The fastest predicted candidate whose predicted peak is within ``mem.limit``; blocks
    recomputed in backward where that is the fastest way to fit (``recompute_levels``: the
    block sets to try, :func:`deepcompile.plan.recompute_choice.levels`; each costs its blocks'
    recomputation per micro-batch); offload only when no candidate fits without it; the
    optimizer step in chunks only when its unchunked peak is above the limit
    (:func:`chunk_for`); the activations of the earliest blocks offloaded to host where their copies
    cost less than recomputing them (``offload``, priced by the copies the compute does not cover).
    Raises PlanError when nothing fits."""
    hand = hand or {}
    cands = candidates(facts, kept_bytes, hand, recompute_levels, offload)
    chunk = chunk_for(facts, mem.limit, hand)

    def measure(c: Candidate) -> Candidate:
        if c.memory is None:
            c.chunk_mb = chunk
            c.memory = plan_memory(facts, c.kept, c.prefetch, chunk_mb=0.0 if chunk is None else chunk,
                                   recompute=c.away)
        return c

    def fits(c: Candidate) -> bool:
        return measure(c).memory.peak <= mem.limit + ALLOCATOR_SLACK

    # Candidates alike but for their recompute level differ in memory only: the timer prices the
    # passes after recompute, and each level recomputes the blocks of the one before and more
    # (recompute_choice.levels), so it costs more and peaks no higher. Of each such group only the
    # smallest level that fits can win; it is found by bisection, so every block count can be a
    # level (the 8B Llama at 8k context: 33 levels, ~6 memory models a group instead of 33).
    groups: dict[tuple, list[Candidate]] = {}
    for c in cands:
        groups.setdefault((c.kept, c.prefetch_mb, c.fuse_mb, tuple(x.block for x in c.offload_act)), []).append(c)
    fit, n_fit, roomy = [], 0, True   # roomy: every candidate fits (each group's first level does)
    for g in groups.values():
        if not fits(g[-1]):
            roomy = False
            continue
        lo, hi = 0, len(g) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(g[mid]) else (mid + 1, hi)
        fit.append(g[lo])
        n_fit += len(g) - lo
        roomy = roomy and lo == 0
    offloading = False
    if not fit and allow_offload:
        # what each would need offloaded: the forward/backward peak down to limit - headroom
        headroom = hand.get(offload_optimizer.NAME, {}).get("headroom_mb", offload_headroom_mb) * MIB
        room = mem.limit - headroom
        stream_mb = stream_chunk_mb(facts, hand)
        for c in map(measure, cands):
            if c.offload_act:
                # the state's copies would take the host link that the activations' copies are
                # priced with alone: the cost model has no account of the two sharing it
                continue
            need = c.memory.fb_peak - room
            limit_mb = hand.get(offload_optimizer.NAME, {}).get("limit_mb", round(mem.limit / MIB, 3))
            if 0 < need <= facts.state_bytes and c.memory.optimizer_peak <= mem.limit + ALLOCATOR_SLACK:
                c.offloaded = int(need)
                c.offload_limit_mb = limit_mb
                c.memory = with_reloads(plan_memory(facts, c.kept, c.prefetch, c.offloaded, chunk_mb=c.chunk_mb,
                                                    recompute=c.away), room)
                fit.append(c)
            elif stream_mb is not None and need <= facts.state_bytes:
                # the step itself is above the limit: only a step that never holds all the state fits
                s = Candidate(c.keep_mb, c.prefetch_mb, c.fuse_mb, limit_mb, c.kept, c.prefetch, facts.state_bytes,
                              chunk_mb=stream_mb, recompute=c.recompute, streamed=True)
                s.memory = with_reloads(plan_memory(facts, s.kept, s.prefetch, s.offloaded, recompute=s.away,
                                                    streamed_chunk_mb=stream_mb), room)
                if s.memory.peak <= mem.limit + ALLOCATOR_SLACK:
                    fit.append(s)
        n_fit = len(fit)
        offloading = True
    if not fit:
        raise PlanError(_nothing_fits(facts, mem, list(map(measure, cands)), offload_headroom_mb))
    priced = price(fit, _with_recompute(_with_chunks(step_ms, facts), accumulation))
    # fastest first; a tie goes to the plan that uses less memory. When the limit binds nothing
    # (every candidate fits), plans within HOST_TIE of the fastest are a tie for the cost model,
    # which prices the GPU's timeline, not the host's: there the tie goes to the plan that keeps
    # more gathered, since each kept parameter takes a gather, a wait and a release per pass off
    # the host, which sets the pace of a launch-bound step (2 H200s, 953M Llama: 73.5 ms of host
    # in an 80.6 ms step, the plan that kept nothing predicted 0.07% faster).
    fastest = min(c.step_ms for c in fit)
    roomy = roomy and not offloading

    def rank(c):
        tied = roomy and c.step_ms <= fastest * (1 + HOST_TIE)
        # among ties, recomputing nothing first: the cost model prices recomputation, but a
        # lower peak bought with it is worth nothing where every plan fits
        rc_ms = sum(x.ms for x in c.recompute)
        # and, at one predicted time, the fewest blocks offloaded: copies the model counts as
        # hidden still take host memory and the device's memory bandwidth
        return (not tied, -c.kept if tied else round(c.step_ms, 6), rc_ms if tied else 0.0, len(c.offload_act),
                c.memory.peak, -c.keep_mb)
    fit.sort(key=rank)
    best = fit[0]
    runner = fit[1] if len(fit) > 1 else None
    why = (f"fastest predicted of {n_fit} plans within the limit (of {len(cands)} considered"
           + (f"; {priced} priced, the rest cut by the coarse-to-fine search" if priced < len(fit) else "") + ")"
           + ("; none fit without offloading optimizer state" if offloading else "")
           + (f"; the optimizer step streams the state through in chunks of {best.chunk_mb:g} MiB: with it all "
              f"on the device the step would peak at {fmt_bytes(optimizer_peak(facts, 0.0))}" if best.streamed else ""))
    if chunk and not best.streamed:
        why += (f"; optimizer.step in chunks of {chunk:g} MiB: its whole-group peak "
                f"{fmt_bytes(optimizer_peak(facts, 0.0))} is above the limit, chunked {fmt_bytes(best.memory.optimizer_peak)}")
    if best.recompute:
        why += (f"; {len(best.recompute)} block(s) recomputed in backward: the fastest plan within the limit "
                f"(+{accumulation * sum(x.ms for x in best.recompute):.1f} ms of compute for "
                f"{fmt_bytes(sum(x.nbytes for x in best.recompute))} of activations)")
    if best.offload_act:
        why += (f"; the activations of {len(best.offload_act)} block(s) offloaded to host "
                f"({fmt_bytes(sum(x.nbytes for x in best.offload_act))}): their copies add "
                f"{accumulation * best.act_exposed_ms:.1f} ms where recomputing them would add "
                f"{accumulation * sum(offload.recompute_ms.get(x.block, 0.0) for x in best.offload_act):.1f} ms")
    if runner is not None:
        why += (f"; runner-up {runner.step_ms:.1f} ms at {fmt_bytes(runner.memory.peak)} "
                f"(keep {runner.keep_mb:g} MiB, prefetch {runner.prefetch_mb:g} MiB"
                + (f", recompute {len(runner.recompute)} block(s)" if runner.recompute else "")
                + (f", offload {len(runner.offload_act)} block(s)' activations" if runner.offload_act else "") + ")")
    return Plan(best, runner, mem, facts, dict(hand),
                time_model, len(cands), n_fit, why, roomy=roomy)


def _with_recompute(step_ms: Callable[[Candidate], float], accumulation: int) -> Callable[[Candidate], float]:
    """``step_ms`` plus the recomputed blocks' compute, once per micro-batch; keeps the timer's
    ``coarse_to_fine`` and ``many`` (:class:`SplitTimer`)."""
    def extra(c: Candidate) -> float:
        return accumulation * (sum(x.ms for x in c.recompute) + c.act_exposed_ms)

    def timed(c: Candidate) -> float:
        return float(step_ms(c)) + extra(c)
    timed.coarse_to_fine = getattr(step_ms, "coarse_to_fine", False)
    many = getattr(step_ms, "many", None)
    if many is not None:
        timed.many = lambda cs: [float(ms) + extra(c) for ms, c in zip(many(cs), cs)]
    return timed


def _with_chunks(step_ms: Callable[[Candidate], float], facts: MemoryFacts) -> Callable[[Candidate], float]:
    """``step_ms`` plus the chunk groups' host time; keeps the timer's ``coarse_to_fine`` and
    ``many`` (:class:`SplitTimer`)."""
    def timed(c: Candidate) -> float:
        return float(step_ms(c)) + chunk_ms(facts, c.chunk_mb)
    timed.coarse_to_fine = getattr(step_ms, "coarse_to_fine", False)
    many = getattr(step_ms, "many", None)
    if many is not None:
        timed.many = lambda cs: [float(ms) + chunk_ms(facts, c.chunk_mb) for ms, c in zip(many(cs), cs)]
    return timed


def _nothing_fits(facts: MemoryFacts, mem: DeviceMemory, cands: list[Candidate], headroom_mb: float) -> str:
    smallest = min(cands, key=lambda c: c.memory.peak)
    fb_min = smallest.memory.fb_peak - facts.state_bytes + headroom_mb * MIB  # all state offloaded
    opt_peak = smallest.memory.optimizer_peak
    chunked = ""
    if smallest.chunk_mb is None and chunk_levels(facts):  # auto, and no chunk size fits
        opt_peak = optimizer_peak(facts, chunk_levels(facts)[-1])
        chunked = f" in chunks of {chunk_levels(facts)[-1]:g} MiB"
    elif smallest.chunk_mb:
        chunked = f" in chunks of {smallest.chunk_mb:g} MiB"
    state_says = "which offloading cannot take off the step"
    stream_mb = stream_chunk_mb(facts)
    if stream_mb is not None and streamed_optimizer_peak(facts, stream_mb) < opt_peak:
        opt_peak = streamed_optimizer_peak(facts, stream_mb)
        chunked = ""
        state_says = f"streamed through the step in chunks of {stream_mb:g} MiB, three chunks' share at a time"
    need = max(min(smallest.memory.peak, max(fb_min, opt_peak)), opt_peak)
    short = need - mem.limit
    act = smallest.memory.activations
    if opt_peak > mem.limit:
        where = (f"the optimizer step alone peaks at {opt_peak / GIB:.2f} GiB{chunked} (shards, gradients and "
                 f"{facts.state_bytes / GIB:.2f} GiB of state, {state_says}), and "
                 f"forward/backward needs {fb_min / GIB:.2f} GiB at least")
        knob = ("spread the model over more ranks (smaller shards and state) or raise memory_limit_gib"
                + ("" if facts.opt_streamable or not facts.state_bytes else
                   "; a torch Adam/AdamW with optimizer_chunk_mb 'auto' lets the step stream its state from the host")
                + ("; a smaller micro-batch lowers forward/backward" if fb_min > mem.limit else ""))
    else:
        where = (f"forward/backward peaks at {fb_min / GIB:.2f} GiB even with nothing kept gathered, no prefetch "
                 f"and all {facts.state_bytes / GIB:.2f} GiB of optimizer state offloaded "
                 f"(offload_optimizer, {headroom_mb:g} MiB headroom); activations take ~{act / GIB:.2f} GiB of it "
                 f"(profiled peak at {facts.fb_peak_at or 'unknown'})")
        knob = ("use a smaller micro-batch (activations scale with it) or add 'offload_activations', "
                "or raise memory_limit_gib"
                + ("" if smallest.recompute else f"; the model has no block '{recompute_activations.NAME}' can recompute"))
    return (f"deepcompile planner: no plan fits the memory limit of {mem.limit / GIB:.2f} GiB ({mem.source}): "
            f"{where}; {short / GIB:.2f} GiB missing. To fit: {knob}.")


# ----------------------------------------------------------------------------------------- time
def pace(predicted: dict, roomy: bool) -> dict | None:
    """Who sets the pace of a predicted step (``plan.cost_model.predict``'s events): the host,
    where its time to launch the graphs (the cost model's host clock, ``HOST_US`` scaled to the
    profiled host) is at least the compute stream's busy time, else the GPU. The planner already
    prices every plan at that pace; where every plan fits (``roomy``), plans within ``HOST_TIE``
    of the fastest are a tie that goes to the one keeping the most gathered, which takes the most
    runtime ops off the host. ``why`` says which holds and what it means for the plan. None
    where the cost model has no host clock (a CPU profile: there each op's measured latency
    includes its launch)."""
    host = sum(e["end_us"] - e["start_us"] for e in predicted["events"] if e["stream"] == "host") / 1e3
    if host <= 0:
        return None
    busy = sum(e["end_us"] - e["start_us"] for e in predicted["events"] if e["stream"] == "compute") / 1e3
    bound = "host" if host >= busy else "gpu"
    if bound == "host":
        why = (f"host-bound: the host launches the graphs in {host:.1f} ms, the GPU computes for {busy:.1f} ms; "
               "every plan is priced at the host's pace"
               + (f"; among plans within {HOST_TIE:.0%} of the fastest the one keeping the most gathered wins "
                  "(each kept parameter is a gather, a wait and a release less for the host)" if roomy else ""))
    else:
        why = (f"GPU-bound: the GPU computes for {busy:.1f} ms, the host launches the graphs in {host:.1f} ms; "
               "compute, communication and memory decide between plans")
    return {"bound": bound, "host_ms": round(host, 3), "gpu_busy_ms": round(busy, 3), "why": why}


def with_pace(plan: Plan, runner) -> None:
    """``plan.pace`` (:func:`pace`) from ``runner``'s (a ``plan.runner.GraphRunner``) prediction of
    the chosen plan, added to the plan's why; nothing where the cost model has no host clock (a
    CPU profile), which spares pricing the chosen plan's events again."""
    if host_model(runner.b.profile) is None:
        return
    plan.pace = pace(runner.predicted(plan.chosen), plan.roomy)
    if plan.pace is not None:
        plan.why += "; " + plan.pace["why"]


def analytic_step_ms(c: Candidate, facts: MemoryFacts, comm, compute_ms: float, optimizer_ms: float,
                     accumulation: int = 1) -> float:
    """A coarse step time where the profiled graphs are not at hand: compute, plus the gathers
    each micro-batch still does (not-kept parameters twice, forward and backward; kept ones
    once per optimizer step), of which prefetch hides a share that grows with its budget
    against the largest parameter (never more than the compute), plus the offload copies that
    the compute does not cover."""
    kept_ids, rest = _split_kept(facts, c.kept)
    us = 0.0
    if rest:
        group = max(c.fuse_mb * MIB, 1.0)
        sizes = sorted(rest)
        n_groups = max(1, math.ceil(sum(sizes) / group)) if c.fuse_mb > 0 else len(sizes)
        us = 2 * (n_groups * comm.alpha_us + sum(sizes) / comm.bytes_per_us)
    hide = (c.prefetch / (c.prefetch + max(rest))) if (rest and c.prefetch) else 0.0
    exposed_ms = us / 1e3 - min(hide * us / 1e3, compute_ms)
    kept_ms = (comm.allgather_us(c.kept) / 1e3) if c.kept else 0.0
    return (accumulation * (compute_ms + exposed_ms) + kept_ms + optimizer_ms
            + offload_ms(c.offloaded, accumulation * compute_ms, c.streamed))


def _split_kept(facts: MemoryFacts, kept: int) -> tuple[list[int], list[int]]:
    """The sizes taken as kept (largest-saving-first is selective_unshard's business; here the
    smallest, which it favours) and the rest."""
    items = sorted(facts.gathered.values())
    acc, k = 0, 0
    while k < len(items) and acc + items[k] <= kept:
        acc += items[k]
        k += 1
    return items[:k], items[k:]


# ----------------------------------------------------------------------------------------- the model's plan
def hand_set(entries: list) -> dict:
    """{pass: {param: value}} the config's pass entries set by hand (the planner keeps them)."""
    out: dict = {}
    for e in entries:
        if e.name in PLANNED and e.params:
            out[e.name] = dict(e.params)
    return out


def apply(entries: list, plan: Plan) -> list:
    """The pass list with the plan's values for every parameter not set by hand, and the passes
    the planner may add (``PassDef.planner_adds``: ``offload_optimizer`` when the plan offloads)
    appended where the plan uses them and the list lacks them."""
    params = plan.chosen.params()
    out = []
    for e in entries:
        p = dict(e.params)
        for k, v in params.get(e.name, {}).items():
            p.setdefault(k, v)
        out.append(PassEntry(name=e.name, params=p))
    listed = {e.name for e in entries}
    for name, ps in params.items():
        if PASSES[name].planner_adds and name not in listed:
            e = PassEntry(name=name, params=dict(ps))
            before = [i for i, x in enumerate(out) if x.name in PASSES[name].precedes]
            out.insert(before[0], e) if before else out.append(e)
    return out


def plan_model(model, entries: list) -> list:
    """Plan ``entries`` (the pass list about to be compiled) for a DeepCompileModel whose
    profile has been agreed; sets ``model.dc_plan`` (a dict) and returns the planned list."""
    import torch

    from deepcompile.passes import PassContext
    from deepcompile.passes.registry import make_params
    from deepcompile.plan.memory import facts_from_profile
    t0 = time.perf_counter()
    b, cfg = model.dc_backend, model.dc_config
    if not any(e.name == zero3.NAME for e in entries):
        return entries  # ZeRO-1/2: parameters are whole between steps; nothing of this plan applies
    prof = b.profile
    device = model._dc_device()
    mgr = model.dc_state.runtime.optimizer_state
    state = mgr.total_bytes() if mgr.opt is not None else 0
    rdt = cfg.mixed_precision.torch_reduce_dtype()
    full = sum(m.chunk * b.world_size for m in b.param_meta.values() if m.requires_grad)
    reduce_bytes = (min(cfg.reduce_bucket_size * cfg.max_inflight_reduces, full)
                    * torch.empty((), dtype=rdt).element_size())  # buckets never outgrow the gradients
    chunks = model.dc_state.optim_chunks   # runtime.optim_chunks (None: not chunkable, or off by hand)
    opt_kw = {}
    if chunks is not None:
        from deepcompile.runtime import optim_chunks

        # the chunk size the profiled step ran with: 'auto' stays 0 until a plan sets it, and plans
        # come after the one profiling step (a re-plan must not read back its own earlier choice)
        # (or the chunk the steps before the plan streamed the state through: initialize)
        auto = cfg.optimizer_chunk_mb == "auto"
        profiled_mb = model.dc_state.warmup_stream_mb or (0.0 if auto else float(cfg.optimizer_chunk_mb))
        opt_kw = dict(opt_groups=optim_chunks.group_sizes(chunks.opt), opt_temp_factor=optim_chunks.temp_factor(chunks.opt),
                      opt_profiled_chunk=int(profiled_mb * MIB),
                      # the state streams where it is a torch Adam's: two moments per parameter
                      opt_streamable=optim_chunks.torch_kind(chunks.opt, TWO_MOMENTS) is not None)
    profiled = [e.name for e in (b.passes or [])]
    names = [e.name for e in entries]
    # the passes the runner prices; the block levers are priced from their block costs
    core = [n for n in names if n != recompute_activations.NAME]
    accumulation = cfg.gradient_accumulation_steps
    fused = cfg.compiler_at(model.dc_state.step) == "inductor"
    src = None
    if b.compiled and core[:len(profiled)] == profiled:
        # the what-if's runner (plan.runner): passes on fast copies of the profiled graphs, the
        # per-graph static costs worked out once, each candidate priced once
        from deepcompile.plan.runner import live_source

        src = live_source(dict(b.compiled), b.versions, profiled[-1] if profiled else None, meta=b.param_meta,
                          world=b.world_size, rank=b.rank, profile=prof, fused=fused, accumulation=accumulation,
                          facts=None)
    unmat = None
    if src is not None and fused and prof is not None:
        from deepcompile.plan.estimate import unmaterialized_by_graph

        unmat = unmaterialized_by_graph(prof, {k: d["nodes"] for k, d in src.base.items()})
    facts = facts_from_profile(prof, b.param_meta, b.world_size, state, reduce_bytes=reduce_bytes,
                               unmaterialized=unmat, **opt_kw)
    if src is not None:
        src.facts = facts
    mem = agree_memory(local_memory(device, cfg.device_memory_gib), cfg.memory_limit_gib, model.dc_state.group)
    hand = hand_set(entries)
    if cfg.optimizer_chunk_mb != "auto":   # set by hand: planned around, as a pass parameter is
        hand["optimizer"] = {"chunk_mb": float(cfg.optimizer_chunk_mb)}

    def ctx(gid, kind, name, params):
        from deepcompile.params import build

        return PassContext(graph_id=gid, kind=kind, params=build(PASSES[name].params_cls, params, f"plan.{name}"),
                           param_meta=b.param_meta, world_size=b.world_size, rank=b.rank, profile=prof)

    def kept_bytes(budget_mb: float) -> int:
        chosen = su.choose(ctx(0, "forward", su.NAME, {"budget_mb": budget_mb}))
        return sum(facts.gathered[p] for p in chosen)

    # priced per candidate: the passes after the profiled ones whose parameters the candidates
    # differ in and that re-run on graph copies (PassDef.planned, PassDef.offline)
    extra = [n for n in core[len(profiled):] if PASSES[n].planned and PASSES[n].offline == OFFLINE_RERUN]
    block_costs: list = []
    off_costs, off_timeline = [], None
    if src is not None:
        from deepcompile.plan.runner import GraphRunner

        graph_runner = GraphRunner(src, extra, {}, ctx_path="plan.{}")
        timer = graph_runner.step_ms
        time_model = "cost model on the planned graphs"
        if recompute_activations.NAME not in profiled:
            from deepcompile.plan.recompute_choice import block_costs as find_block_costs

            block_costs, _notes = find_block_costs(dict(b.compiled), prof, src.static)
        if offload_activations.NAME not in names and device.type == "cuda":
            # (a hand-listed offload_activations keeps its own rule and is priced with the core passes;
            # on the CPU the "host" is the device: a copy there frees nothing)
            from deepcompile.plan.offload_choice import offload_costs

            off_costs, off_timeline = offload_costs(dict(b.compiled), prof, src.static,
                                                    PASSES[offload_activations.NAME].params_cls().min_mb)
            hand_rc = recompute_activations.parse_blocks(hand.get(recompute_activations.NAME, {}).get("blocks", ""))
            off_costs = [c for c in off_costs if not (hand_rc == "all" or c.block in hand_rc)]
        if model.dc_state.group is not None:
            import torch.distributed as dist

            # the model's whole group, every rank of which plans now: under mesh.shard it is
            # larger than the shard group the backend's world_size and rank count in
            n = dist.get_world_size(model.dc_state.group)
            if n > 1:
                timer = SplitTimer(timer, model.dc_state.group, n, dist.get_rank(model.dc_state.group))
    else:
        compute = sum(n.latency_ms for g in prof.graphs.values() for n in g.nodes)
        from deepcompile.vocab.links import default_model

        comm = prof.comm or default_model("gloo")
        opt_ms = resident_optimizer_ms(prof)
        timer = lambda c: analytic_step_ms(c, facts, comm, compute, opt_ms, accumulation)  # noqa: E731
        time_model = "analytic (no profiled graphs at hand)"
    headroom = make_params(_entry(offload_optimizer.NAME, hand.get(offload_optimizer.NAME, {}))).headroom_mb
    # a pass the list lacks changes nothing: its planned parameters are fixed where it would not
    # (PassDef.absent: selective_unshard keeps nothing, prefetch prefetches nothing)
    fixed = {**hand, **absent_params(names)}
    rc_levels = recompute_levels(block_costs, hand)
    offload = ActivationOffload.of(off_costs, off_timeline, {c.block: c.ms for c in block_costs})
    with no_gc():
        plan = choose(facts, mem, kept_bytes, timer, fixed, time_model, offload_headroom_mb=headroom,
                      recompute_levels=rc_levels, accumulation=accumulation, offload=offload)
    plan.hand_set = hand
    if src is not None:
        with_pace(plan, graph_runner)
    plan.block_costs = block_costs
    plan.offload_costs = off_costs
    if chunks is not None and cfg.optimizer_chunk_mb == "auto":
        chunks.set_chunk_mb(plan.chosen.chunk_mb or 0.0)   # from the next optimizer.step()
    if model.dc_state.warmup_stream_mb is not None and not plan.chosen.streamed:
        mgr.plan(0)   # the steps before the plan streamed the state (initialize); this plan holds it on the device
    out = apply(entries, plan)
    plan.passes = [{"name": e.name, "params": dict(e.params)} for e in out]
    d = plan.to_dict()
    d["step"] = model.dc_state.step
    d["seconds"] = round(time.perf_counter() - t0, 3)  # planning time (every rank, at the re-compile)
    if isinstance(timer, SplitTimer):
        d["pricing_shared_by_ranks"] = timer.world
    model.dc_state.plan = d
    return out


def recompute_levels(costs: list, hand: dict) -> list[tuple]:
    """The block sets the planner tries (``recompute_choice.levels``), or the hand-set one."""
    from deepcompile.plan.recompute_choice import levels

    h = hand.get(recompute_activations.NAME, {})
    if "blocks" not in h:
        return levels(costs)
    wanted = recompute_activations.parse_blocks(h["blocks"])
    return [tuple(c for c in costs if wanted == "all" or c.block in wanted)]


def _entry(name: str, params: dict):
    return PassEntry(name=name, params=dict(params))

