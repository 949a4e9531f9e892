"""The graph view's detail panel: moved collectives, the selected node's detail, the legend.

:class:`GraphDetailMixin`, a base class of :class:`~deepcompile.widgets.graph_view.GraphModel`,
reads the shown version (and the one it is diffed against): :meth:`~GraphDetailMixin.moves` lists
what the prefetch pass recorded on each collective it issued earlier (``"moved"`` on the
record's node, *from -> to*, with the boxes of the picture holding both ends),
:meth:`~GraphDetailMixin.node_detail` what the panel shows of one node (shape, dtype, bytes,
latency measured or estimated, source line, module scope, parameters, move) and
:meth:`~GraphDetailMixin.legend` the colour scale of the picture (min and max in units, or the
colours of the op kinds, and the diff chips).
"""
from __future__ import annotations

import html
from collections import Counter

from deepcompile.plan import estimate as E
from deepcompile.report import graph_groups as L
from deepcompile.vocab.memory import fmt_bytes

from .graph_groups import effective_scope, key_chains
from .graph_render import DIFF_COLORS, DIFF_SYMBOLS, RAMP_STOPS, _ramp, fmt_us


class GraphDetailMixin:
    """Moves, node detail and legend of :class:`~deepcompile.widgets.graph_view.GraphModel`."""

    def param_names(self) -> dict[int, str]:
        """Parameter id -> its name (from the scope the record gives its gather nodes)."""
        if getattr(self, "_pnames", None) is None:
            out: dict[int, str] = {}
            for v in self.rec.graphs:
                for n in v.nodes:
                    if "param" in n and n.get("scope") and E.comm_kind(n) in ("allgather_param", "wait_allgather"):
                        out.setdefault(int(n["param"]), L._PARAM_SUFFIX.sub("", n["scope"]))
            self._pnames = out
        return self._pnames

    def moves(self, _shown: tuple | None = None) -> list[dict]:
        """The collectives the shown version issues earlier than before (the prefetch pass's
        ``"moved"`` record), in graph order: ``{"node", "target", "params", "param_names", "from",
        "to", "first_use": {id: node}, "earlier", "bytes", "from_key", "to_key", "key"}``:
        ``from_key`` / ``to_key``: the boxes of the current picture holding the node it was issued
        after and the one it is issued after now (boxes group by module, not by position, so the
        collective's own box, ``key``, is its parameters' module wherever it is issued)."""
        if _shown is None:
            nodes, _ = self._nodes_and_status()
            chains, _ = key_chains(nodes, self.expanded, self.pscopes)
        else:   # (nodes, chains) the render already has
            nodes, chains = _shown
        where = {n["name"]: c[-1] for n, c in zip(nodes, chains)}
        vs = self.versions()
        cur = {n["name"] for n in vs[self.version].nodes} if vs else set()
        names = self.param_names()
        out = []
        for n in nodes:
            m = n.get("moved")
            if not m or n["name"] not in cur or m.get("earlier", 0) <= 0:
                continue
            pids = [int(p) for p in m.get("params", [])]
            out.append({"node": n["name"], "target": n["target"], "params": pids,
                        "param_names": [names.get(p, str(p)) for p in pids],
                        "from": m.get("from"), "to": m.get("to"),
                        "first_use": {int(k): v for k, v in m.get("first_use", {}).items()},
                        "earlier": int(m.get("earlier", 0)), "bytes": int(m.get("bytes", 0)),
                        "from_key": where.get(m.get("from") or "", "inputs"),
                        "to_key": where.get(m.get("to") or "", "inputs"), "key": where[n["name"]]})
        return out

    def node_detail(self, name: str) -> dict | None:
        """What the detail panel shows for node ``name`` of the current picture (None: not in it):
        ``name, op, target, version, status`` (diff: added/removed/moved or None), ``shape,
        dtype, bytes, bytes_label, latency_us, latency_label, latency_source`` ("measured": the
        record's profile or schedule; "estimated": the cost model), ``scope`` (module), ``box``
        (its box in the picture), ``source`` (user source line or None), ``params``
        (``[{"id", "name"}]``), ``moved`` (the move record with ``first_use`` keyed by int id, or
        None), ``inputs`` and ``users`` (node names)."""
        nodes, status = self._nodes_and_status()
        idx = next((i for i, n in enumerate(nodes) if n["name"] == name), None)
        if idx is None:
            return None
        n = nodes[idx]
        chains, _ = key_chains(nodes, self.expanded, self.pscopes)
        t = self.timings.get((self.graph_id, self.kind, name))
        source = "measured"
        if t is None:
            source = "estimated"
            key = (self.graph_id, self.kind, self.version, self.compare)
            if getattr(self, "_lat", (None,))[0] != key:
                self._lat = (key, self.node_latency_us(nodes))
            t = self._lat[1].get(name) if n["op"] not in ("placeholder", "get_attr", "output") else None
        pids: list[int] = []
        m = n.get("moved")
        if m and m.get("params"):
            pids = [int(p) for p in m["params"]]
        elif n.get("params"):
            pids = [int(p) for p in n["params"]]
        elif "param" in n:
            pids = [int(n["param"])]
        names = self.param_names()
        moved = None
        if m:
            moved = dict(m, first_use={int(k): v for k, v in m.get("first_use", {}).items()})
        b = int(m["bytes"]) if m and m.get("bytes") else E.node_bytes(n)   # a collective: the bytes it gathers
        vs = self.versions()
        return {"name": name, "op": n["op"], "target": n["target"], "version": vs[self.version].after,
                "status": status.get(name), "shape": n.get("shape"), "dtype": n.get("dtype"),
                "bytes": b, "bytes_label": fmt_bytes(b),
                "latency_us": t, "latency_label": fmt_us(t) if t is not None else "—",
                "latency_source": source if t is not None else None,
                "model": self.node_error_us([n]).get(name) if self.color_by == "error" else None,
                "scope": effective_scope(n, self.pscopes), "box": chains[idx][-1], "source": n.get("source"),
                "params": [{"id": p, "name": names.get(p, str(p))} for p in pids], "moved": moved,
                "inputs": E.inputs_of(n), "users": [u["name"] for u in nodes if name in E.inputs_of(u)]}

    def node_detail_html(self, name: str | None = None) -> str:
        """:meth:`node_detail` of ``name`` (default: the selected node) as a small HTML table."""
        name = self.selected_node if name is None else name
        d = self.node_detail(name) if name else None
        if d is None:
            return '<div class="dc-node-detail empty">no node selected</div>' if not name else (
                f'<div class="dc-node-detail empty">{html.escape(name)} is not in this graph version</div>')
        e = html.escape
        rows = [("node", f"{d['name']} · {d['target']}" + (f" · <b>{d['status']}</b>" if d["status"] else "")),
                ("shape", f"{d['shape']} {d['dtype'] or ''}"), ("output", d["bytes_label"]),
                ("latency", d["latency_label"] + (f" ({d['latency_source']})" if d["latency_source"] else "")),
                ("module", d["scope"] or "—"), ("source", d["source"] or "—")]
        if d.get("model"):
            mo = d["model"]
            rows.append(("cost model", f"predicted {fmt_us(mo['predicted_us'])}, measured {fmt_us(mo['measured_us'])}"))
        if d["params"]:
            rows.append(("params", ", ".join(f"{p['id']} {p['name']}" for p in d["params"])))
        m = d["moved"]
        if m:
            fu = ", ".join(f"{p}: {u}" for p, u in m["first_use"].items())
            rows.append(("moved", (f"{m.get('from') or 'top'} → {m.get('to') or 'top'}, {m.get('earlier', 0)} nodes earlier"
                                   if m.get("earlier", 0) > 0 else f"not moved (issued after {m.get('to') or 'top'})")
                         + f"; first used at {fu}"))
        body = "".join(f'<tr><th style="text-align:left;padding-right:8px">{e(k)}</th><td>'
                       f'{v if k == "node" else e(str(v))}</td></tr>' for k, v in rows)
        return f'<table class="dc-node-detail" style="font:12px Helvetica,Arial,sans-serif">{body}</table>'

    def _box_totals(self, nodes: list[dict], chains: list[list[str]]) -> dict[str, float]:
        """Colour metric total per box shown (leaf boxes, not inputs/outputs), or {} for "kind"."""
        metric, _ = self._metric(nodes)
        if metric is None:
            return {}
        members: dict[str, list[int]] = {}
        for i, c in enumerate(chains):
            if nodes[i]["op"] not in ("placeholder", "get_attr", "output"):
                members.setdefault(c[-1], []).append(i)
        return {k: metric(idx) for k, idx in members.items()}

    def legend(self) -> dict:
        """The colour scale of the current picture. Latency / memory: ``{"mode", "title", "unit",
        "min", "max", "min_label", "max_label", "stops"}`` (box totals; ``min``/``max`` in µs or
        bytes; ``stops``: the colours from min to max; latency ``"source"``: measured or
        estimated). Kind: ``{"mode": "kind", "items": [(label, colour)]}``. With a diff, ``"diff"``:
        the chips, ``[{"status", "symbol", "color", "count"}]``."""
        nodes, status = self._nodes_and_status()
        chains, _ = key_chains(nodes, self.expanded, self.pscopes)
        return self._legend(nodes, status, chains)

    def _legend(self, nodes, status, chains) -> dict:
        lg: dict
        if self.color_by in ("latency", "memory", "error"):
            tot = self._box_totals(nodes, chains)
            lo, hi = (min(tot.values()), max(tot.values())) if tot else (0.0, 0.0)
            fmt = fmt_bytes if self.color_by == "memory" else fmt_us
            title = {"latency": "latency per box", "memory": "output bytes per box",
                     "error": "cost model error per box, |measured − predicted|"}[self.color_by]
            lg = {"mode": self.color_by, "unit": "bytes" if self.color_by == "memory" else "µs", "title": title,
                  "min": lo, "max": hi, "min_label": fmt(lo), "max_label": fmt(hi),
                  "stops": [_ramp(x) for x in RAMP_STOPS]}
            if self.color_by == "latency":
                have = sum(1 for n in nodes if (self.graph_id, self.kind, n["name"]) in self.timings)
                lg["source"] = "measured" if have >= len(nodes) // 2 and have else "estimated"
                lg["title"] += f" ({lg['source']})"
            if self.color_by == "error":
                n_cmp = len(self.node_error_us(nodes))
                lg["compared"] = n_cmp
                lg["title"] += (f" ({n_cmp} nodes compared)" if n_cmp else
                                " (no measured step in this record to compare with)")
        else:
            kinds = sorted({c for n in nodes if (c := E.comm_kind(n))})
            lg = {"mode": "kind", "items": [("compute", L.COMPUTE_COLOR), ("inputs/outputs", L.IO_COLOR)]
                  + [(k, L.comm_color(k)) for k in kinds]}
        if status:
            cnt = Counter(status.values())
            lg["diff"] = [{"status": st, "symbol": DIFF_SYMBOLS[st], "color": DIFF_COLORS[st], "count": cnt[st]}
                          for st in ("added", "removed", "moved")]
        return lg
