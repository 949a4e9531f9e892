"""The graph view's clickable canvas: an ``anywidget`` that shows the SVG and sends clicks back.

The front end is a few lines of ES module shipped inside this file (anywidget sends it to the
browser through the kernel's comm), so it works without network access in JupyterLab, Notebook 7
and VS Code. A click on an element with ``id="group-<key>"`` (every box the graph view draws)
sends ``{"event": "click", "key": <key>, "shift": <shift or alt held>}`` to Python, where
:meth:`GraphCanvas.on_box_click` callbacks run (the Inspector calls
``InspectorModel.click_graph``), then ``{"event": "done"}`` goes back (the picture is dimmed
meanwhile). Tests send the same message with ``canvas._handle_custom_msg({...}, [])``.

The picture sits in a viewport without scroll bars: it opens fitted (the whole graph, or its
width when fitting would make it unreadable), with Fit / fit-width / − / + / 1:1 buttons,
ctrl+wheel zoom at the cursor and drag to move (a plain wheel scrolls the page). A
``.dc-graph-legend`` element in ``value`` is shown above the viewport (not zoomed with the
picture), and the moves listed in the picture's ``data-dc-moves`` (the graph view's diff of a
prefetch) are drawn as dashed arrows from the box a collective left to the box it is issued in.

Without anywidget installed, :func:`make_canvas` returns a plain ``ipywidgets.HTML`` (no clicks;
the module dropdown and its expand / collapse button remain).
"""
from __future__ import annotations

from typing import Callable

ESM = r"""
const SVGNS = "http://www.w3.org/2000/svg";
function render({ model, el }) {
  const box = document.createElement("div");
  box.className = "dc-graph-canvas";
  const bar = document.createElement("div");
  bar.className = "dc-zoom-bar";
  const legend = document.createElement("div");
  legend.className = "dc-legend-holder";
  const view = document.createElement("div");   // the viewport: no scroll bars, the picture is fitted / zoomed / dragged
  view.className = "dc-viewport";
  box.append(bar, legend, view);
  el.appendChild(box);
  let focus = null;      // the key clicked last: brought back into view after the redraw
  let mode = "auto";     // "auto" (fit, or fit width when fitting makes it unreadable), "fit", "width", "manual"
  let scale = 1, natW = 0, natH = 0, svg = null, dragged = false;
  const esc = (s) => (window.CSS && CSS.escape) ? CSS.escape(s) : s.replace(/["\\]/g, "\\$&");
  const button = (label, title, fn) => {
    const b = document.createElement("button");
    b.textContent = label; b.title = title; b.className = "dc-zoom-btn";
    b.addEventListener("click", (ev) => { ev.preventDefault(); fn(); });
    bar.appendChild(b);
    return b;
  };
  const zoomLabel = document.createElement("span");
  zoomLabel.className = "dc-zoom-label";
  // at most 640 px (and 75% of the window) high: with the toolbar and legend it stays inside the
  // inspector's 720 px box, so that box never scrolls around the viewport
  const maxH = () => Math.max(240, Math.min(640, Math.round(window.innerHeight * 0.75)));
  const apply = (s, keepCenter) => {
    if (!svg || !natW) return;
    const cx = view.scrollLeft + view.clientWidth / 2, cy = view.scrollTop + view.clientHeight / 2;
    const old = scale;
    scale = Math.max(0.05, Math.min(4, s));
    svg.style.width = `${natW * scale}px`;
    svg.style.height = `${natH * scale}px`;
    view.style.height = `${Math.min(natH * scale, maxH()) + 2}px`;
    if (keepCenter) {
      view.scrollLeft = cx * scale / old - view.clientWidth / 2;
      view.scrollTop = cy * scale / old - view.clientHeight / 2;
    }
    zoomLabel.textContent = `${Math.round(scale * 100)}%`;
  };
  const fit = (m) => {
    if (!svg || !natW) return;
    const w = Math.max(100, view.clientWidth || box.clientWidth || 800);
    const sw = Math.min(1.5, w / natW), sh = Math.min(1.5, maxH() / natH);
    let s = m === "width" ? sw : Math.min(sw, sh);
    if (m === "auto" && s < 0.5) s = Math.min(1, sw);   // a tall graph: fit its width, drag to move along it
    apply(s, false);
  };
  button("Fit", "fit the whole graph in view", () => { mode = "fit"; fit("fit"); });
  button("↔", "fit the width", () => { mode = "width"; fit("width"); });
  button("−", "zoom out (or ctrl + wheel)", () => { mode = "manual"; apply(scale / 1.25, true); });
  button("+", "zoom in (or ctrl + wheel)", () => { mode = "manual"; apply(scale * 1.25, true); });
  button("1:1", "natural size", () => { mode = "manual"; apply(1, true); });
  bar.appendChild(zoomLabel);
  const hint = document.createElement("span");
  hint.className = "dc-zoom-hint";
  hint.textContent = "drag to move · ctrl+wheel to zoom";
  bar.appendChild(hint);

  // moved collectives (data-dc-moves on the picture): an arrow from the box it left to the box
  // it is issued in now, drawn in the picture's own coordinates, so it zooms with it
  const drawMoves = () => {
    if (!svg) return;
    const old = svg.querySelector("g.dc-move-arrows");
    if (old) old.remove();
    const raw = svg.getAttribute("data-dc-moves");
    if (!raw) return;
    let moves;
    try { moves = JSON.parse(raw); } catch (e) { return; }
    const ctm = svg.getScreenCTM();
    if (!ctm || !svg.getBoundingClientRect().width) return;
    const inv = ctm.inverse();
    const pt = (x, y) => { const p = svg.createSVGPoint(); p.x = x; p.y = y; return p.matrixTransform(inv); };
    const find = (k) => svg.querySelector(`[id="group-${esc(k)}"]`);
    const layer = document.createElementNS(SVGNS, "g");
    layer.setAttribute("class", "dc-move-arrows");
    const defs = document.createElementNS(SVGNS, "defs");
    defs.innerHTML = '<marker id="dcmove" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" ' +
                     'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#457b9d"/></marker>';
    layer.appendChild(defs);
    const seen = {};
    for (const m of moves) {
      const a = find(m.from), b = find(m.to);
      if (!a || !b || a === b) continue;
      const k = `${m.from}\u0000${m.to}`;
      const n = (seen[k] = (seen[k] || 0) + 1);
      const ra = a.getBoundingClientRect(), rb = b.getBoundingClientRect();
      const p0 = pt(ra.left, ra.top + ra.height / 2), p1 = pt(rb.left, rb.top + rb.height / 2);
      const bend = Math.max(12, Math.min(30, p0.x - 4)) + 6 * (n - 1);
      const x = Math.max(2 + 3 * (n - 1), Math.min(p0.x, p1.x) - bend);   // inside the picture's left edge
      const path = document.createElementNS(SVGNS, "path");
      path.setAttribute("d", `M${p0.x},${p0.y} C${x},${p0.y} ${x},${p1.y} ${p1.x},${p1.y}`);
      path.setAttribute("fill", "none");
      path.setAttribute("stroke", "#457b9d");
      path.setAttribute("stroke-width", "2");
      path.setAttribute("stroke-dasharray", "6,3");
      path.setAttribute("marker-end", "url(#dcmove)");
      path.setAttribute("class", "dc-move-arrow");
      path.setAttribute("data-node", m.node);
      const t = document.createElementNS(SVGNS, "title");
      t.textContent = "moved: " + m.label;
      path.appendChild(t);
      layer.appendChild(path);
    }
    svg.appendChild(layer);
  };

  const draw = () => {
    const tmp = document.createElement("div");
    tmp.innerHTML = model.get("value");
    legend.replaceChildren(...tmp.querySelectorAll(".dc-graph-legend"));
    view.replaceChildren(...tmp.childNodes);
    box.classList.remove("dc-busy");
    svg = view.querySelector("svg");
    natW = natH = 0;
    if (svg) {   // its natural size from its attributes (graphviz writes pt), so a hidden view can fit later
      const len = (a, vb) => {
        const v = svg.getAttribute(a) || "";
        const x = parseFloat(v);
        if (!isNaN(x) && !v.endsWith("%")) return v.endsWith("pt") ? x * 96 / 72 : x;
        return vb || 0;
      };
      const vb = svg.viewBox && svg.viewBox.baseVal;
      natW = len("width", vb && vb.width);
      natH = len("height", vb && vb.height);
      svg.style.display = "block";
      if (mode === "manual") apply(scale, false); else fit(mode);
    }
    drawMoves();
    if (focus !== null) {
      const k = esc(focus);
      const t = view.querySelector(`[id="group-${k}"]`) || view.querySelector(`[id^="group-${k}."]`) ||
                view.querySelector(`[id^="group-${k}/"]`);
      if (t) {   // into view within the viewport only (no page scroll)
        const rv = view.getBoundingClientRect(), rt = t.getBoundingClientRect();
        if (rt.top < rv.top || rt.bottom > rv.bottom) view.scrollTop += rt.top - rv.top - 20;
        if (rt.left < rv.left || rt.right > rv.right) view.scrollLeft += rt.left - rv.left - 20;
      }
      focus = null;
    }
  };
  // drag to move the picture (the viewport has no scroll bars); a drag is not a click
  let drag = null;
  const onDown = (ev) => {
    if (ev.button !== 0) return;
    drag = { x: ev.clientX, y: ev.clientY, sl: view.scrollLeft, st: view.scrollTop };
    dragged = false;
  };
  const onMove = (ev) => {
    if (!drag) return;
    const dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
    if (Math.abs(dx) + Math.abs(dy) > 4) dragged = true;
    if (dragged) { view.scrollLeft = drag.sl - dx; view.scrollTop = drag.st - dy; view.classList.add("dc-dragging"); }
  };
  const onUp = () => { drag = null; view.classList.remove("dc-dragging"); };
  const onWheel = (ev) => {
    if (!(ev.ctrlKey || ev.metaKey) || !svg) return;   // a plain wheel scrolls the page, not the picture
    ev.preventDefault();
    mode = "manual";
    const rv = view.getBoundingClientRect();
    const px = view.scrollLeft + ev.clientX - rv.left, py = view.scrollTop + ev.clientY - rv.top;
    const old = scale;
    apply(scale * (ev.deltaY < 0 ? 1.15 : 1 / 1.15), false);
    view.scrollLeft = px * scale / old - (ev.clientX - rv.left);
    view.scrollTop = py * scale / old - (ev.clientY - rv.top);
  };
  const onClick = (ev) => {
    if (dragged) { dragged = false; ev.preventDefault(); ev.stopPropagation(); return; }
    let t = ev.target;
    while (t && t !== view) {
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
  // drawn while hidden (another tab): fit and draw the arrows once it has a size
  let sized = false;
  const ro = (typeof ResizeObserver !== "undefined") ? new ResizeObserver(() => {
    if (!svg || !view.clientWidth) return;
    if (!sized || mode !== "manual") { sized = true; if (mode !== "manual") fit(mode); drawMoves(); }
  }) : null;
  if (ro) ro.observe(view);
  model.on("change:value", draw);
  model.on("msg:custom", onMsg);
  view.addEventListener("click", onClick, true);
  view.addEventListener("mousedown", onDown);
  window.addEventListener("mousemove", onMove);
  window.addEventListener("mouseup", onUp);
  view.addEventListener("wheel", onWheel, { passive: false });
  draw();
  return () => {
    if (ro) ro.disconnect();
    view.removeEventListener("click", onClick, true);
    view.removeEventListener("mousedown", onDown);
    window.removeEventListener("mousemove", onMove);
    window.removeEventListener("mouseup", onUp);
    view.removeEventListener("wheel", onWheel);
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
.dc-graph-canvas .dc-viewport { overflow: hidden; position: relative; border: 1px solid #ddd; cursor: grab;
  max-width: 100%; user-select: none; -webkit-user-select: none; }
.dc-graph-canvas .dc-viewport.dc-dragging { cursor: grabbing; }
.dc-graph-canvas .dc-zoom-bar { display: flex; gap: 4px; align-items: center; margin: 2px 0; font: 11px sans-serif; }
.dc-graph-canvas .dc-zoom-btn { min-width: 26px; padding: 0 6px; height: 20px; font-size: 11px; cursor: pointer; }
.dc-graph-canvas .dc-zoom-label { min-width: 40px; text-align: right; color: #555; }
.dc-graph-canvas .dc-zoom-hint { color: #888; margin-left: 8px; }
.dc-graph-canvas .dc-move-arrow:hover { stroke-width: 3.5; }
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
