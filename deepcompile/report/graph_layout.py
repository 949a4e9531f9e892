"""The grouping and layout names that the inspector's graph drawing (``widgets/graph_render.py``)
reads through one module alias, ``L``, gathered from their modules.

The code lives by concern: the grouping by module scope in :mod:`deepcompile.report.graph_groups`,
the per-level layout and its SVG in :mod:`deepcompile.report.level_layout`, the pre-rendered
module pictures of the static report in :mod:`deepcompile.report.module_pictures`. The report
imports each name from its own module. ``have_dot`` here is the same function as
``level_layout.have_dot``; replacing it on one module does not replace it on the other.
"""
from __future__ import annotations

from deepcompile.report.graph_groups import (
    COMPUTE_COLOR, IO_COLOR, Collapsed, _short, comm_color, diff, module_box_lines)
from deepcompile.report.level_layout import (
    LEVEL_CACHE, Box, Level, have_dot, level_dot, nested_level_svg, nested_svg, simple_svg)

__all__ = ["COMPUTE_COLOR", "IO_COLOR", "Collapsed", "_short", "comm_color", "diff", "module_box_lines",
           "LEVEL_CACHE", "Box", "Level", "have_dot", "level_dot", "nested_level_svg", "nested_svg", "simple_svg"]
