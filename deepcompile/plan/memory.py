"""The memory of a plan, by category, and its peak: from what the profiling step measured.

The profiling step measured the zero3-only plan: per node the memory allocated after it and the
peak during it (the CUDA allocator's counters on GPU, so every resident byte is in them: shards,
optimizer state, gradients, reduce buckets, the gathered parameter in use, activations), and the
optimizer step's peak. A plan differs from the profiled one only in what it adds or takes away:

- parameters kept gathered (``selective_unshard``): gathered at the top of the first forward and
  resident until the optimizer step, so they add their whole size to every point of forward and
  backward. They are dropped *before* ``optimizer.step()`` (``api._dc_before_optimizer_step``),
  so the optimizer step does not carry them;
- gathers prefetched ahead of need (``prefetch``): at most ``budget_mb`` of gathered parameters
  ahead of their use, and a coalesced group (``fuse_mb``) lands at once; bounded by what is
  still gathered per use (nothing when everything is kept), and at each point of a graph by the
  gathers that graph still has to wait for after it (``MemoryFacts.ahead``): the profiled peak
  of the 953M Llama is the backward's last op (the embedding's gradient), where nothing is left
  to prefetch; adding the whole budget there over-predicted keep 448 MiB + prefetch 512 MiB by
  5.5% on 2 H200s (10.32 GiB against 9.78 measured; 9.82 with the bound);
- optimizer state offloaded (``offload_optimizer``): off the device during forward and backward,
  back for the step, so it lowers the forward/backward peak, not the step's; unless the step is
  streamed (``offload_optimizer.step`` 'streamed', :mod:`deepcompile.runtime.optimizer_state`):
  then all of it is off in forward and backward, and the step holds the state of the
  ``STREAM_DEPTH`` consecutive chunks that hold the most of it instead of the whole; backward's
  reload points bring state back early as far as the room under the limit allows
  (:func:`with_reloads`);
- the optimizer step in chunks (``optimizer_chunk_mb``, :mod:`deepcompile.runtime.optim_chunks`):
  the step's peak is shards + gradients + state + temporaries, and torch's foreach Adam/AdamW
  allocates ``temp_factor`` state-sized copies of a whole param group at once (the profile measured
  them for the groups as they were then). The temporaries are what the measured peak holds above
  the known resident bytes; the share that scales (at most ``temp_factor`` x the largest group or
  chunk profiled) scales with the largest chunk, the rest (other live buffers) stays.

So ``peak = max(max over profiled nodes of (peak there + kept + min(prefetch, gathers still to come
in its graph)) - offloaded, profiled optimizer peak)``.
Two sources of error, both on the safe side: a kept parameter in use at the profiled peak is
counted twice (at most one layer's parameters), and the profile runs the graph node by node,
unfused, whose peak was up to 0.6 GiB above Inductor's on the 953M Llama (unfused pointwise
intermediates). The categories split the peak for the record; "activations" is what remains of the
profiled peak after the known categories (it includes the parameter being used at that node).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from deepcompile.vocab.memory import GIB, MIB, categories_at_peak

# a streamed optimizer step holds three chunks' state at once: the one stepped, the next coming
# in and the previous going out (runtime.optimizer_state)
STREAM_DEPTH = 3
# its chunk size where the planner chooses it: large enough that a chunk's copy (~14 ms each way)
# dwarfs the per-group host time, small beside the state it streams (30 GiB for the 8B Llama)
STREAM_CHUNK_MB = 512.0


@dataclass
class MemoryFacts:
    """What a plan's memory is computed from (bytes, one rank, identical on every rank)."""
    fb_peak: int                  # profiled forward/backward peak (the zero3-only plan)
    optimizer_peak: int           # profiled optimizer.step() peak
    shard_bytes: int              # this rank's parameter shards
    grad_bytes: int               # this rank's gradient shards (the optimizer's .grad)
    state_bytes: int              # optimizer state (resident while profiled)
    reduce_bytes: int = 0         # reduce-scatter buckets in flight at most
    gathered: dict[int, int] = field(default_factory=dict)  # parameter id -> gathered bytes
    fb_peak_at: str = ""          # where the profiled peak was ("graph 0 backward, node mm_3")
    # (profiled peak at a node, gathered bytes its graph still waits for after it): the nodes no
    # other node beats on both, so a plan's peak is the max over them of peak + kept + what
    # prefetch can hold ahead there (empty: unknown, the whole budget is added to fb_peak)
    ahead: list[tuple[int, int]] = field(default_factory=list)
    # the optimizer's param groups, each as its parameters' bytes in order (what chunks are cut
    # from), the state-sized copies of a group its step allocates at once (0: none that scale:
    # fused, foreach=False, an optimizer we do not know), and the chunk size in force when
    # optimizer_peak was measured (0: the whole groups)
    opt_groups: list[list[int]] = field(default_factory=list)
    opt_temp_factor: float = 0.0
    opt_profiled_chunk: int = 0
    # whether the step can be streamed: a per-group torch optimizer runtime.optim_chunks can cut
    opt_streamable: bool = False
    # (position in the step, profiled peak there, gathered bytes its graph waits for after it) of
    # every profiled node, in step order (plan.recompute_choice.timeline_positions): where a plan
    # recomputes blocks, what it saves depends on where in the step a node is
    timeline: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def gathered_total(self) -> int:
        return sum(self.gathered.values())


@dataclass
class PlanMemory:
    """A plan's predicted memory at its peak, by category (bytes)."""
    parameter_shards: int
    optimizer_state: int          # on the device during forward/backward
    gradients: int                # gradient shards + reduce buckets in flight (at most)
    gathered_kept: int            # selective_unshard: resident forward -> backward, across micro-batches
    gathered_prefetch: int        # prefetch: in flight ahead of use (at most)
    activations: int              # the rest of the profiled peak (includes the parameter in use)
    offloaded: int                # optimizer state on the host during forward/backward (not on the device)
    fb_peak: int                  # forward/backward peak of this plan
    optimizer_peak: int           # optimizer step peak of this plan
    peak: int                     # max of the two
    step_state: int | None = None  # state on the device at the optimizer step's peak (None: all of it;
                                   # a streamed step holds its three largest consecutive chunks' share)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["by_category"], d["peak_at"] = self.by_category()
        return d

    def by_category(self) -> tuple[dict[str, int], str]:
        """({category: bytes} at the predicted peak, where the peak is: ``"forward/backward"`` or
        ``"optimizer step"``), in :data:`MEMORY_CATEGORIES`; see :func:`categories_at_peak`."""
        return categories_at_peak(asdict(self))

    def summary(self) -> str:
        from deepcompile.passes import prefetch

        parts = [("shards", self.parameter_shards), ("optimizer state", self.optimizer_state),
                 ("gradients", self.gradients), ("kept gathered", self.gathered_kept),
                 (prefetch.NAME, self.gathered_prefetch), ("activations", self.activations)]
        s = ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts if v)
        if self.offloaded:
            s += f"; offloaded {self.offloaded / GIB:.2f}"
        return f"peak {self.peak / GIB:.2f} GiB ({s} GiB)"


def prefetch_bytes(facts: MemoryFacts, kept: int, budget_mb: float, fuse_mb: float) -> int:
    """Gathered bytes prefetch holds ahead of need, at most: its budget, or a fused group's size
    if larger (a group lands at once), never more than what is not kept."""
    ahead = int(max(budget_mb, fuse_mb) * MIB)
    return max(0, min(ahead, facts.gathered_total - kept))


def optimizer_peak(facts: MemoryFacts, chunk_mb: float | None = None) -> int:
    """The optimizer step's peak with its groups stepped in chunks of ``chunk_mb`` MiB (0: whole
    groups; None: as profiled). See the module doc; where nothing is known to scale (no groups,
    ``opt_temp_factor`` 0) it is the profiled peak."""
    from deepcompile.runtime.optim_chunks import largest_chunk

    if chunk_mb is None or not facts.opt_groups or facts.opt_temp_factor <= 0:
        return facts.optimizer_peak
    known = facts.shard_bytes + facts.grad_bytes + facts.state_bytes
    temp = max(0, facts.optimizer_peak - known)
    g0 = largest_chunk(facts.opt_groups, facts.opt_profiled_chunk)
    g1 = largest_chunk(facts.opt_groups, int(chunk_mb * MIB))
    if g0 <= 0:
        return facts.optimizer_peak
    scales = min(temp, int(facts.opt_temp_factor * g0))
    return int(facts.optimizer_peak - scales + scales * g1 / g0)


def streamed_optimizer_peak(facts: MemoryFacts, chunk_mb: float) -> int:
    """The optimizer step's peak when it streams the state through in chunks of ``chunk_mb`` MiB:
    the resident step's, with :func:`streamed_state_held` in place of all the state."""
    return optimizer_peak(facts, chunk_mb) - facts.state_bytes + streamed_state_held(facts, chunk_mb)


def streamed_state_held(facts: MemoryFacts, chunk_mb: float) -> int:
    """The state a streamed step holds on the device at most: that of the ``STREAM_DEPTH``
    consecutive chunks (in step order) that hold the most of it. A parameter larger than the chunk
    is a chunk of its own: the Llama's embedding and output projection (1 GiB each per rank for the
    8B on 2 ranks) sit at the two ends of the order, each beside small chunks."""
    from deepcompile.runtime.optim_chunks import split

    params = sum(sum(g) for g in facts.opt_groups) or facts.shard_bytes
    sizes = [sum(g[a:b]) for g in facts.opt_groups for a, b in split(g, int(chunk_mb * MIB))] or [params]
    window = max(sum(sizes[i:i + STREAM_DEPTH]) for i in range(len(sizes)))
    return min(facts.state_bytes, int(facts.state_bytes * window / max(1, params)))


def plan_memory(facts: MemoryFacts, kept: int, prefetch: int, offloaded: int = 0,
                chunk_mb: float | None = None, recompute: tuple = (),
                streamed_chunk_mb: float | None = None) -> PlanMemory:
    """The predicted memory of a plan that keeps ``kept`` bytes gathered, prefetches up to
    ``prefetch`` bytes, offloads ``offloaded`` bytes of optimizer state, steps the optimizer in
    chunks of ``chunk_mb`` MiB (None: as profiled; see the module doc) and recomputes the blocks
    ``recompute`` (plan.recompute_choice.BlockCost: their bytes are off the device between
    their drop in forward and their recomputation in backward). ``streamed_chunk_mb``: the
    optimizer step streams the (offloaded) state through in chunks of that size."""
    offloaded = max(0, min(offloaded, facts.state_bytes))
    at, ahead = facts.fb_peak, prefetch
    if recompute and facts.timeline:
        at, ahead = _with_recompute(facts, prefetch, recompute)
    elif facts.ahead and prefetch > 0:
        # (a run's own fb_peak may replace the profile's, see plan.whatif: shift the points with it)
        shift = facts.fb_peak - max(p for p, _ in facts.ahead)
        at, ahead = max(((p + shift, min(prefetch, r)) for p, r in facts.ahead), key=lambda x: x[0] + x[1])
    fb = at + kept + ahead - offloaded
    step_state = None
    if streamed_chunk_mb is not None:
        opt = streamed_optimizer_peak(facts, streamed_chunk_mb)
        step_state = streamed_state_held(facts, streamed_chunk_mb)
    else:
        opt = optimizer_peak(facts, chunk_mb)
    grads = facts.grad_bytes + facts.reduce_bytes
    known = facts.shard_bytes + facts.state_bytes + grads
    return PlanMemory(parameter_shards=facts.shard_bytes, optimizer_state=facts.state_bytes - offloaded,
                      gradients=grads, gathered_kept=kept, gathered_prefetch=ahead,
                      activations=max(0, at - known), offloaded=offloaded,
                      fb_peak=fb, optimizer_peak=opt, peak=max(fb, opt), step_state=step_state)


def with_reloads(pm: PlanMemory, room: int) -> PlanMemory:
    """``pm`` with the state ``offload_optimizer``'s backward reload points bring back early: each
    brings back as much offloaded state as fits under ``room`` (the limit minus its headroom) beside
    what the rest of backward needs, so with more state offloaded than the forward/backward peak
    leaves room for, the device fills up to ``room``. Counted at the forward/backward peak (an upper
    bound where that peak is in forward, before any reload). Measured on H200s under a 40 GiB limit
    (39 GiB of room): 38.98 GiB (8B Llama, 2 ranks) and 38.99 GiB (its 14-layer cut, 1 rank), where
    the peak without the reloads was predicted at 36.6 and 37.2 GiB."""
    back = int(max(0, min(pm.offloaded, room - pm.fb_peak)))
    if not back:
        return pm
    from dataclasses import replace

    fb = pm.fb_peak + back
    return replace(pm, optimizer_state=pm.optimizer_state + back, offloaded=pm.offloaded - back, fb_peak=fb,
                   peak=max(fb, pm.optimizer_peak))


def _with_recompute(facts: MemoryFacts, prefetch: int, recompute: tuple) -> tuple[int, int]:
    """(memory at the plan's peak node before kept parameters, prefetched bytes there) when
    ``recompute``'s bytes are off the device from each block's ``start`` to its ``end``."""
    delta: dict[int, int] = {}
    for c in recompute:
        if c.end > c.start:
            delta[c.start + 1] = delta.get(c.start + 1, 0) - c.nbytes
            delta[c.end] = delta.get(c.end, 0) + c.nbytes
    events = sorted(delta.items())
    shift = facts.fb_peak - max(p for _, p, _ in facts.timeline)
    saved, k, best, at, ahead = 0, 0, None, facts.fb_peak, 0
    for pos, p, r in facts.timeline:
        while k < len(events) and events[k][0] <= pos:
            saved += events[k][1]
            k += 1
        a = min(prefetch, r) if prefetch > 0 else 0
        v = p + shift + saved + a
        if best is None or v > best:
            best, at, ahead = v, p + shift + saved, a
    return at, ahead


def facts_from_profile(profile, param_meta: dict, world: int, state_bytes: int, grad_bytes: int | None = None,
                       reduce_bytes: int = 0, opt_groups: list[list[int]] | None = None, opt_temp_factor: float = 0.0,
                       opt_profiled_chunk: int = 0, unmaterialized: dict | None = None,
                       opt_streamable: bool = False) -> MemoryFacts:
    """MemoryFacts of a run: the agreed profile's peaks, the parameters' sizes (``param_meta``:
    id -> ParamMeta) and the optimizer's state bytes. The plan's own offload points
    (``reload_optimizer_state``) are left out of the peak, as ``offload_optimizer`` does.
    ``unmaterialized``: (graph id, kind) -> per profiled node, bytes the profile held that the
    final compile never writes (``estimate.unmaterialized_bytes``), taken off every peak."""
    import torch

    def size(dt) -> int:
        return torch.empty((), dtype=dt).element_size()

    from deepcompile.plan.recompute_choice import chrono_key

    best, where = 0, ""
    points: list[tuple[int, int]] = []  # (peak at a node, gathered bytes its graph waits for after it)
    timeline: list[tuple[int, int, int]] = []
    pos = -1
    for (gid, kind), g in sorted(profile.graphs.items(), key=lambda kv: chrono_key(*kv[0])):
        rest = sum(n.out_bytes for n in g.nodes if _waits(n.name))
        away = (unmaterialized or {}).get((gid, kind))
        if away is not None and len(away) != len(g.nodes):
            away = None
        for i, n in enumerate(g.nodes):
            pos += 1
            if _waits(n.name):
                rest -= n.out_bytes
            if n.name.startswith("reload_optimizer_state") or n.name.startswith("release_optimizer_state"):
                continue
            peak = n.peak_bytes - (away[i] if away else 0)
            points.append((peak, max(0, rest)))
            timeline.append((pos, peak, max(0, rest)))
            if peak > best:
                best, where = peak, f"graph {gid} {kind}, node {n.name}"
    shards = sum(m.chunk * size(m.dtype) for m in param_meta.values())
    grads = grad_bytes if grad_bytes is not None else sum(
        m.chunk * size(m.dtype) for m in param_meta.values() if m.requires_grad)
    gathered = {pid: m.chunk * world * size(m.gather_dtype) for pid, m in param_meta.items()}
    extra = 0
    streamed = int(getattr(profile, "state_streamed_bytes", 0) or 0)
    if getattr(profile, "hardware", "") == "cpu":
        # the CPU profile counts only the tensors its interpreter holds (graph inputs and
        # values), not the optimizer's state and gradient shards held outside the graphs
        extra = int(state_bytes) + grads
        best += extra
    elif streamed:
        # the profiled step kept the state on the host: its peaks are a plan's that offloads all
        # of it; the facts are the resident profile's, which every plan takes its offload from
        extra = streamed
        best += extra
    opt_peak = int(getattr(profile, "optimizer_peak_bytes", 0) or 0)
    measured_streamed = streamed and opt_peak > 0
    if opt_peak <= 0:  # not measured (a CPU run, an older record): what the step holds at least
        opt_peak = shards + grads + state_bytes
    facts = MemoryFacts(fb_peak=int(best), optimizer_peak=opt_peak, shard_bytes=shards, grad_bytes=grads,
                       state_bytes=int(state_bytes), reduce_bytes=int(reduce_bytes), gathered=gathered,
                       fb_peak_at=where, ahead=_frontier([(p + extra, r) for p, r in points]),
                       timeline=[(i, p + extra, r) for i, p, r in timeline],
                       opt_groups=[list(map(int, g)) for g in (opt_groups or [])],
                       opt_temp_factor=float(opt_temp_factor), opt_profiled_chunk=int(opt_profiled_chunk),
                       opt_streamable=bool(opt_streamable))
    if measured_streamed:   # the streamed step held a few chunks' state where the resident one holds all
        facts.optimizer_peak = opt_peak - streamed_state_held(facts, opt_profiled_chunk / MIB) + int(state_bytes)
    return facts


def _waits(name: str) -> bool:
    """A profiled node that waits for a transient gather (the zero3-only plan's ``wait_allgather``;
    its output is the gathered parameter)."""
    return name.startswith("wait_allgather")


def _frontier(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (peak, ahead) points that no other point beats in both: enough for the max over every
    node of ``peak + kept + min(prefetch, ahead)``, for any kept and prefetch."""
    out: list[tuple[int, int]] = []
    for p, r in sorted(points, key=lambda x: (-x[1], -x[0])):
        if not out or p > out[-1][0]:
            out.append((int(p), int(r)))
    return out
