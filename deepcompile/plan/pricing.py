"""Pricing the planner's candidates: coarse to fine, shared out among the ranks.

Pricing a candidate runs its passes and the cost model on copies of the profiled graphs, the
planner's main cost. :func:`price` prices only the candidates that can win (coarse to fine over
each group's prefetch budgets), :class:`SplitTimer` shares each batch out among the ranks and
gathers the prices, so every rank decides from the same numbers; :func:`no_gc` keeps Python's
cyclic collector out of it. A candidate is ``plan.planner.Candidate`` (its ``params()``,
``prefetch_mb``, ``fuse_mb`` and ``step_ms``).
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable

from deepcompile.passes import prefetch

Timer = Callable[[Any], float]   # a candidate's predicted step (ms)


class PlanError(RuntimeError):
    """No plan fits the memory limit, or the candidates could not be priced."""


def _price_all(cands: list, step_ms: Timer) -> None:
    """Set ``step_ms`` of each of ``cands``: in one batch where the timer prices batches
    (``many``: :class:`SplitTimer`, the ranks sharing the work), else one by one."""
    many = getattr(step_ms, "many", None)
    times = many(cands) if many is not None else [step_ms(c) for c in cands]
    for c, ms in zip(cands, times):
        c.step_ms = float(ms)


class SplitTimer:
    """A candidate timer whose batches are shared out among the ranks of ``group``: rank r prices
    candidates r, r + world, ... of each batch and one ``all_gather_object`` gives every rank every
    price. Pricing runs the passes and the cost model on full-depth graph copies (0.2 s a candidate
    at 32 layers on the 2-H200 host, 12-17 candidates), the same deterministic work on every rank
    (the profile and the memory are agreed): shared out, the planner's time is divided by the
    world size, and every rank still decides from the very same numbers. A rank whose pricing
    raises still joins the gather (else the others wait there forever) and every rank raises
    :class:`PlanError` naming it."""

    def __init__(self, step_ms: Timer, group, world: int, rank: int):
        self.step_ms, self.group, self.world, self.rank = step_ms, group, world, rank
        self.coarse_to_fine = getattr(step_ms, "coarse_to_fine", False)

    def __call__(self, c) -> float:
        return float(self.step_ms(c))

    def many(self, cands: list) -> list[float]:
        import torch.distributed as dist

        mine: dict = {}
        try:
            for i in range(self.rank, len(cands), self.world):
                mine[i] = float(self.step_ms(cands[i]))
        except Exception as ex:  # noqa: BLE001 - reach the gather below, or the other ranks hang
            mine = {"error": f"{type(ex).__name__}: {ex}"}
        every: list = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        bad = [(r, d["error"]) for r, d in enumerate(every) if "error" in d]
        if bad:
            raise PlanError("pricing the plan candidates failed on "
                            + "; ".join(f"rank {r}: {why}" for r, why in bad))
        out: dict = {}
        for d in every:
            out.update(d)
        if sorted(out) != list(range(len(cands))):
            raise PlanError(f"pricing the plan candidates: the ranks priced {sorted(out)} of {len(cands)} "
                            "(they planned from different candidate lists)")
        return [out[i] for i in range(len(cands))]


REFINE_WITHIN = 0.10  # coarse-to-fine: a group's middle prefetch budgets are priced within this of the best


def price(fit: list, step_ms: Timer) -> int:
    """Set ``step_ms`` of the candidates in ``fit`` that can win; returns how many were priced.

    A timer that prices by running the passes (``plan.runner.GraphRunner``, ``coarse_to_fine``
    set) costs ~80 ms a candidate on the 953M record; it is searched coarse to fine: in each group
    of candidates alike but for their prefetch budget, the smallest and the largest budget first,
    and the budgets between them only where the better of those two is within ``REFINE_WITHIN``
    of the fastest end (so ties within ``HOST_TIE`` are always all priced). Two batches, all the
    ends then the middles worth pricing, so that a :class:`SplitTimer` shares each out. What this
    assumes: the predicted step does not dip between a group's two ends by more than
    ``REFINE_WITHIN - HOST_TIE`` below both (on the 953M record's 4 settings (NVLink, 40 GB/s,
    each at a 125.8 and a 9.07 GiB limit) the middle budgets were within 3% of the better end,
    and every decision and runner-up came out the same with 11-17 of 17 priced). The unpriced
    keep ``step_ms = inf`` and rank last, so the runner-up is exact where it is within
    ``REFINE_WITHIN`` of the choice, else the best one priced. Any other timer (the analytic
    model) prices everything."""
    if not getattr(step_ms, "coarse_to_fine", False):
        _price_all(fit, step_ms)
        return len(fit)
    groups: dict = {}
    for c in fit:
        p = c.params()
        p.pop(prefetch.NAME, None)
        groups.setdefault(repr(sorted((k, sorted(v.items())) for k, v in p.items())), []).append(c)
    ends, later = [], []
    for g in groups.values():
        g.sort(key=lambda c: (c.prefetch_mb, c.fuse_mb))
        ends += [g[0], g[-1]] if len(g) > 2 else g
    _price_all(ends, step_ms)   # every group's ends in one batch
    n = len(ends)
    for g in groups.values():
        if len(g) > 2:
            later.append((min(g[0].step_ms, g[-1].step_ms), g[1:-1]))
    # The middles worth pricing, as the one-by-one search would pick them (each group in order of
    # its better end, against the best price of the ends), in one batch. Where a priced middle
    # would have lowered the bar for a later group, that group is priced anyway: a candidate more,
    # never one fewer, so the choice is the one-by-one search's or a faster plan.
    best = min(c.step_ms for c in fit)
    middles = [c for lo, middle in sorted(later, key=lambda x: x[0]) if lo <= best * (1 + REFINE_WITHIN)
               for c in middle]
    _price_all(middles, step_ms)
    return n + len(middles)


@contextlib.contextmanager
def no_gc():
    """Python's cyclic GC off for the duration. Pricing a candidate copies graphs into many small
    objects, which triggers collections that walk the whole heap (a training process: the model,
    Dynamo's caches, the compiled graphs): on the 953M record a prefetch candidate took 0.32 s with
    it and 0.13 s without, the same prediction. Nothing priced here makes cycles that must be freed
    before the call returns."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
