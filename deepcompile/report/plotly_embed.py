"""plotly in the static report, offline: the plotly.min.js of the installed plotly package, read
to be inlined (:func:`plotly_js`), and the figures of one page (:class:`_Figures`: a ``<div>`` per
figure, all their JSON in one ``<script>``, drawn by the few lines of :data:`PLOT_JS`).
"""
from __future__ import annotations

import functools
import html
import importlib.util
from pathlib import Path

from deepcompile.report.style import figure_json

esc = html.escape


@functools.lru_cache(maxsize=2)
def _read_js(path: str, mtime: float) -> str:
    # a script element ends at the first "</script": keep any inside the library from ending it
    # (bytes, not read_text: the library is inlined byte for byte, its "\r"s untranslated)
    return Path(path).read_bytes().decode("utf-8").replace("</script", "<\\/script")


def plotly_js() -> str | None:
    """The text of ``plotly.min.js`` shipped inside the installed plotly package (located with
    ``importlib.util.find_spec``, which does not import plotly), or None without plotly. The
    report inlines it: its charts then work with no network."""
    try:
        spec = importlib.util.find_spec("plotly")
    except (ImportError, ValueError):
        return None
    for d in (spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(d) / "package_data" / "plotly.min.js"
        if p.is_file():
            return _read_js(str(p), p.stat().st_mtime)
    return None


NO_PLOTLY = ("The charts need plotly, which is not installed here (<code>pip install plotly</code>, or "
             "<code>pip install 'deepcompile[report]'</code>), then render the report again; the tables below "
             "do not need it.")


class _Figures:
    """The plotly figures of one report: each a ``<div>`` where it goes, all their JSON in one
    ``<script type="application/json">`` that a few lines of script hand to ``Plotly.newPlot``."""

    def __init__(self, enabled: bool):
        self.enabled, self.items = enabled, []

    def add(self, fig: dict, cls: str) -> str:
        if not self.enabled:
            return f"<p class='empty no-plotly'>{esc(cls)} chart: plotly is not installed.</p>"
        self.items.append(fig)
        h = int((fig.get("layout") or {}).get("height") or 300)
        return (f"<div class='plotly-fig {esc(cls)}' id='dc-fig-{len(self.items) - 1}' "
                f"data-fig='{len(self.items) - 1}' style='min-height:{h}px'></div>")

    def script(self) -> str:
        if not self.items:
            return ""
        return ("<script type='application/json' id='dc-figs'>["
                + ",".join(figure_json(f) for f in self.items) + "]</script>")


PLOT_JS = """
(function(){  // the plotly figures: JSON in #dc-figs, drawn by the inlined plotly.min.js
  var src=document.getElementById('dc-figs');if(!src)return;
  var divs=document.querySelectorAll('.plotly-fig');
  if(!window.Plotly){divs.forEach(function(d){d.innerHTML="<p class='empty'>plotly.js did not load</p>";});return;}
  var F=JSON.parse(src.textContent);
  divs.forEach(function(d){var f=F[+d.dataset.fig];
    Plotly.newPlot(d,f.data,f.layout,{responsive:true,displaylogo:false});});
})();
"""
