"""Which recorded steps are steady state, and their median.

The compile step, the profiled step and the re-compiles are not what a user's training loop pays
per step; every view (the report, ``deepcompile inspect``, the inspector, the what-if's measured
side) leaves the same steps out of its median, so they all state one number.
"""
from __future__ import annotations

import math
from typing import Any


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def special_steps(steps: list[dict], config: dict | None = None) -> dict[int, str]:
    """{step: why it is not a steady-state step}: the first (compile), the profiling step and the
    scheduled re-compiles of ``config`` (optimizer steps count from 0, the record's first step is
    step 0's), and, without a config, any step over 4x the median of the others."""
    nums = [s["step"] for s in steps if isinstance(s.get("step"), int)]
    if not nums:
        return {}
    first = min(nums)
    out: dict[int, str] = {first: "compile"}
    cfg = config or {}

    def mark(step: int, why: str) -> None:
        out[step] = f"{out[step]} + {why}" if step in out and why not in out[step] else why

    ps = cfg.get("profile_step")
    if isinstance(ps, int) and not isinstance(ps, bool):
        mark(first + ps, "profiling")
        mark(first + ps + 1, "re-compile")   # the step after the profile compiles with it
    for e in cfg.get("schedule") or []:
        if isinstance(e, dict) and isinstance(e.get("step"), int) and not isinstance(e.get("step"), bool):
            mark(first + e["step"], "re-compile")
    if config is None:
        ts = [s["time_s"] for s in steps if s["step"] not in out and _finite(s.get("time_s"))]
        if ts:
            med = sorted(ts)[len(ts) // 2]
            for s in steps:
                if s["step"] not in out and _finite(s.get("time_s")) and s["time_s"] > 4 * med:
                    out[s["step"]] = "slow"
    return out


def steady_ms(steps: list[dict], config: dict | None = None) -> list[float]:
    """The steady-state steps' times in ms, in step order: every step but those
    :func:`special_steps` marks (compile, profiling, re-compiles)."""
    special = special_steps(steps, config)
    return [float(s["time_s"]) * 1e3 for s in steps
            if s.get("step") not in special and _finite(s.get("time_s"))]


def steady_median_ms(steps: list[dict], config: dict | None = None) -> tuple[float | None, int]:
    """(median step time in ms, how many steps) over :func:`steady_ms`. The one median every view
    states (the report, ``deepcompile inspect``, the inspector, the what-if's measured side)."""
    import statistics

    ts = steady_ms(steps, config)
    return (statistics.median(ts) if ts else None), len(ts)
