"""The memory vocabulary every layer shares: the categories memory is split into (measured by the
profiler, predicted by the planner, stored in the record, drawn by the views), the split of a
predicted peak into them, and how bytes are written for a person."""
from __future__ import annotations

import math

MIB = 2 ** 20
GIB = 2 ** 30

# The one vocabulary of memory, measured (the profiled step's timeline, ``profile.profiler``) and
# predicted (:class:`PlanMemory`); the record, the plan and every view use this tuple. Every one but
# ``offloaded`` is on the device (the allocator's bytes on GPU; on CPU the bytes the profiling
# interpreter and the training state hold): they sum to the allocated total. ``offloaded`` is in
# host memory (optimizer state sent out by ``offload_optimizer``, offloaded activations).
MEMORY_CATEGORIES = ("parameter_shards", "gathered", "gradients", "optimizer_state", "activations", "offloaded")
DEVICE_CATEGORIES = MEMORY_CATEGORIES[:-1]


def categories_at_peak(m: dict) -> tuple[dict[str, int], str]:
    """A :class:`PlanMemory` (as its dict, e.g. ``plan.json``'s ``chosen.memory``) split into
    :data:`MEMORY_CATEGORIES` at its peak, and where the peak is.

    At a forward/backward peak: the shards, the kept and prefetched gathered parameters, the
    gradients (with the reduce buckets), the optimizer state left on the device, activations (the
    rest of the peak) and what was offloaded to the host. At an optimizer-step peak: shards,
    gradients, all of the state (offloaded state is back for the step) or, for a step that streams
    it (``step_state``), the share it holds at once, the rest offloaded; nothing gathered (kept
    copies are dropped before the step), and as "activations" the rest (the optimizer's
    temporaries). The device categories sum to ``peak``."""
    g = lambda k: max(0, int(m.get(k) or 0))  # noqa: E731
    peak = g("peak")
    if g("optimizer_peak") > g("fb_peak"):
        state = g("optimizer_state") + g("offloaded")
        held = state if m.get("step_state") is None else min(state, g("step_state"))
        known = {"parameter_shards": g("parameter_shards"), "gathered": 0, "gradients": g("gradients"),
                 "optimizer_state": held}
        where, offloaded = "optimizer step", state - held
    else:
        known = {"parameter_shards": g("parameter_shards"),
                 "gathered": g("gathered_kept") + g("gathered_prefetch"), "gradients": g("gradients"),
                 "optimizer_state": g("optimizer_state")}
        where, offloaded = "forward/backward", g("offloaded")
    out = dict(known, activations=max(0, peak - sum(known.values())), offloaded=offloaded)
    return {k: out[k] for k in MEMORY_CATEGORIES}, where


def fmt_bytes(n: float | None) -> str:
    """Bytes for a person: ``1.5 GiB``, ``512 B``; "–" for a missing or non-finite value."""
    if n is None or not isinstance(n, (int, float)) or not math.isfinite(n):
        return "–"
    if abs(n) < 1024:
        return f"{int(n)} B"
    k = min(int(math.log(abs(n), 1024)), 4)
    return f"{n / 1024 ** k:.1f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[k]}"
