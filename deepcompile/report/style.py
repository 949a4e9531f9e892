"""How the report's figures write numbers and colour memory, shared by the figure modules and the
widgets: a duration in µs, ms or s and a size in B to TiB as a person reads them (never
scientific notation, :func:`fmt_us`, :func:`fmt_ms`; bytes: ``vocab.memory.fmt_bytes``), the unit of a byte axis
(:func:`byte_unit`), the JSON a figure is embedded as (:func:`figure_json`), and the colour of each
memory category (:data:`CATEGORY_COLORS`).
"""
from __future__ import annotations

import json
import math
from typing import Any

CATEGORY_COLORS = {"parameter_shards": "#4e79a7", "gathered": "#f28e2b", "gradients": "#9c6ade",
                   "optimizer_state": "#59a14f", "activations": "#e15759", "offloaded": "#bab0ac"}
_EXTRA_COLORS = ["#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#86bcb6"]


def fmt_us(us: float | None) -> str:
    """A duration or time given in µs, as a person reads it: ``850.0 µs``, ``12.34 ms``, ``2.500 s``."""
    if us is None or not isinstance(us, (int, float)) or not math.isfinite(us):
        return "–"
    a = abs(us)
    if a == 0:
        return "0 µs"
    if a < 10:
        return f"{us:.2f} µs"
    if a < 1000:
        return f"{us:.1f} µs"
    if a < 1e6:
        return f"{us / 1e3:.2f} ms"
    return f"{us / 1e6:.3f} s"


def fmt_ms(ms: float | None) -> str:
    return fmt_us(None if ms is None else ms * 1e3)




def byte_unit(max_bytes: float) -> tuple[str, float]:
    """(unit name, divisor) for an axis whose largest value is ``max_bytes``: MiB below 2 GiB, else GiB."""
    return ("GiB", float(1 << 30)) if max_bytes >= 2 * (1 << 30) else ("MiB", float(1 << 20))


def figure_json(fig: dict) -> str:
    """``fig`` as JSON that ``JSON.parse`` accepts (NaN/inf become null) and that is safe inside a
    ``<script>`` element (no ``</``)."""
    def clean(o):
        if isinstance(o, float) and not math.isfinite(o):
            return None
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o
    return json.dumps(clean(fig), separators=(",", ":"), ensure_ascii=False).replace("</", "<\\/")


def _fin(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
