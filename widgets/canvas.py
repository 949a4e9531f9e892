"""The graph view's clickable canvas: an ``anywidget`` that shows the SVG and sends clicks back.

The front end is a few lines of ES module shipped inside this file (anywidget sends it to the
browser through the kernel's comm), so it works without network access in JupyterLab, Notebook 7
and VS Code. A click on an element with ``id="group-<key>"`` (every box the graph view draws)
sends ``{"event": "click", "key": <key>, "shift": <shift or alt held>}`` to Python, where
:meth:`GraphCanvas.on_box_click` callbacks run (the Inspector calls
``InspectorModel.click_graph``), then ``{"event": "done"}`` goes back (the picture is dimmed
meanwhile). Tests send the same message with ``canvas._handle_custom_msg({...}, [])``.

Without anywidget installed, :func:`make_canvas` returns a plain ``ipywidgets.HTML`` (no clicks;
the module dropdown and its expand / collapse button remain).
"""
from __future__ import annotations

from typing import Callable

ESM = r"""
function render({ model, el }) {
  const box = document.createElement("div");
  box.className = "dc-graph-canvas";
  el.appendChild(box);
  let focus = null;  // the key clicked last: scrolled back into view after the redraw
  const esc = (s) => (window.CSS && CSS.escape) ? CSS.escape(s) : s.replace(/["\\]/g, "\\$&");
  const draw = () => {
    box.innerHTML = model.get("value");
    box.classList.remove("dc-busy");
    if (focus !== null) {
      const k = esc(focus);
      const t = box.querySelector(`[id="group-${k}"]`) || box.querySelector(`[id^="group-${k}."]`) ||
                box.querySelector(`[id^="group-${k}/"]`);
      if (t && t.scrollIntoView) t.scrollIntoView({ block: "nearest", inline: "nearest" });
      focus = null;
    }
  };
  const onClick = (ev) => {
    let t = ev.target;
    while (t && t !== box) {
      const id = t.getAttribute ? t.getAttribute("id") : null;
      if (id && id.startsWith("group-")) {
        ev.preventDefault();
        ev.stopPropagation();
        focus = id.slice(6);
        box.classList.add("dc-busy");
        model.send({ event: "click", key: id.slice(6), shift: !!(ev.shiftKey || ev.altKey) });
        return;
      }
      t = t.parentNode;
    }
  };
  const onMsg = (msg) => { if (msg && msg.event === "done") box.classList.remove("dc-busy"); };
  model.on("change:value", draw);
  model.on("msg:custom", onMsg);
  box.addEventListener("click", onClick);
  draw();
  return () => {
    box.removeEventListener("click", onClick);
    model.off("change:value", draw);
    model.off("msg:custom", onMsg);
  };
}
export default { render };
"""

CSS = """
.dc-graph-canvas [id^="group-"] { cursor: pointer; }
.dc-graph-canvas g.dc-box:hover > path, .dc-graph-canvas g.dc-box:hover > polygon:first-of-type,
.dc-graph-canvas g.dc-box:hover > rect:first-of-type { stroke-width: 2.5; }
.dc-graph-canvas.dc-busy { opacity: 0.6; transition: opacity 0.2s; }
"""


def have_anywidget() -> bool:
    try:
        import anywidget  # noqa: F401
    except ImportError:
        return False
    return True


_CLS = None


def canvas_class():
    """The :class:`GraphCanvas` widget class (defined on first use: anywidget is optional)."""
    global _CLS
    if _CLS is not None:
        return _CLS
    import anywidget
    import traitlets

    class GraphCanvas(anywidget.AnyWidget):
        """Shows ``value`` (an SVG or HTML string); clicks on ``group-<key>`` boxes come back."""
        _esm = ESM
        _css = CSS
        value = traitlets.Unicode("").tag(sync=True)

        def __init__(self, **kw):
            super().__init__(**kw)
            self._box_handlers: list[Callable[[str, bool], None]] = []
            self.on_msg(self._on_front_end_msg)

        def on_box_click(self, fn: Callable[[str, bool], None]) -> None:
            """Call ``fn(key, shift)`` for every click on a box."""
            self._box_handlers.append(fn)

        def _on_front_end_msg(self, _widget, content, _buffers) -> None:
            if not isinstance(content, dict) or content.get("event") != "click":
                return
            key = str(content.get("key") or "")
            try:
                for fn in list(self._box_handlers):
                    fn(key, bool(content.get("shift")))
            finally:
                self.send({"event": "done", "key": key})   # the front end drops its busy mark

    _CLS = GraphCanvas
    return _CLS


def make_canvas(**kw):
    """A :class:`GraphCanvas` where anywidget is installed, else an ``ipywidgets.HTML``."""
    if have_anywidget():
        return canvas_class()(**kw)
    import ipywidgets as W

    return W.HTML(**kw)
