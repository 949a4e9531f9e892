"""The Steps tab's model: time, loss and memory per step and rank of a (possibly live) run.

:class:`StepsModel` reads ``steps.jsonl`` of every rank; :meth:`StepsModel.poll` re-reads only
files that changed, so following a live run is cheap. Its plotly figure shows step time (the y
range follows the steady steps; a compile step far above is annotated), loss, and memory per step
(the step's peak by category where the writer split it, else the process memory per rank).
"""
from __future__ import annotations

from pathlib import Path

from deepcompile.record import schema as S
from deepcompile.record.reader import RecordError, load_json, read_steps

RANK_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"]


class StepsModel:
    """Per-rank step lines of a (possibly live) run, re-read when the files change."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.steps: dict[int, list[dict]] = {}
        self.status = "unknown"
        self.error: str | None = None
        self._sig: dict[int, tuple] = {}
        self.ranks: list[int] = []
        self.config: dict | None = None   # the run's config: which steps compile or profile

    def poll(self) -> bool:
        """Re-read what changed; True when anything did."""
        changed = False
        mpath = self.run_dir / S.MANIFEST
        try:
            m = load_json(mpath, optional=True, root=self.run_dir)
            if m is None:
                self.error = f"{mpath}: no record yet"
                return False
            m = S.check_manifest(str(mpath), m)
        except RecordError as e:
            self.error = str(e)
            return False
        self.error = None
        if self.config is None:
            try:
                cfg = load_json(self.run_dir / S.CONFIG, optional=True, root=self.run_dir)
            except RecordError:
                cfg = None
            self.config = cfg if isinstance(cfg, dict) else None
        if m["status"] != self.status:
            self.status, changed = m["status"], True
        self.ranks = list(m["ranks"])
        for r in self.ranks:
            p = self.run_dir / S.rank_dir_name(r) / S.STEPS
            try:
                st = p.stat()
            except OSError:
                continue
            sig = (st.st_size, st.st_mtime_ns)
            if self._sig.get(r) == sig:
                continue
            try:
                self.steps[r] = read_steps(p, root=self.run_dir)[0]
            except RecordError as e:
                self.error = str(e)
                continue
            self._sig[r] = sig
            changed = True
        return changed

    @property
    def live(self) -> bool:
        return self.status == "running"

    def n_steps(self) -> int:
        return max((len(v) for v in self.steps.values()), default=0)

    def by_category(self, step: dict) -> dict | None:
        """A step line's peak by memory category, where the writer records it
        (``mem.by_category``: :func:`deepcompile.profile.memory_split.step_split`)."""
        m = step.get("mem") or {}
        for k in ("by_category", "peak_by_category"):
            d = m.get(k) if isinstance(m, dict) else None
            if isinstance(d, dict) and d:
                return {c: v for c, v in d.items() if isinstance(v, (int, float))}
        return None

    def split_how(self, rank: int | None = None) -> str | None:
        """How the shown rank's latest step split its peak (``mem.split``), or None."""
        r = rank if rank is not None else (self.ranks[0] if self.ranks else min(self.steps, default=0))
        for s in reversed(self.steps.get(r, [])):
            how = (s.get("mem") or {}).get("split")
            if isinstance(how, str):
                return how
        return None

    @staticmethod
    def category_name(cat: str) -> str:
        """Legend name: the remainder of the peak is said to be one."""
        return "activations (remainder of the peak)" if cat == "activations" else cat.replace("_", " ")

    def figure(self):
        """Step time (ms), loss, and memory per step as it is written: each step's peak by
        category (stacked, the shown rank) where the steps carry it, else allocated / peak per rank.
        The y range of step time follows the steady steps; a compile step far above is annotated."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        from deepcompile.record.steps import special_steps
        from deepcompile.report import style as F

        # per step the writer logs process memory (the allocator's high-water mark on GPU, the resident
        # set on CPU): another quantity than the run's peak (memory_view), so titled as such
        shown = self.ranks[0] if self.ranks else (min(self.steps) if self.steps else 0)
        has_cat = any(self.by_category(s) for s in self.steps.get(shown, []))
        # the step's peak by category where the writer split it (memory_split.step_split), else the
        # process memory per step: on GPU the allocator's high-water mark, on CPU the resident set
        mem_title = (f"memory per step by category (rank {shown})" if has_cat else "process memory per step")
        fig = make_subplots(rows=1, cols=3, subplot_titles=("step time (ms)", "loss", mem_title),
                            specs=[[{}, {}, {"secondary_y": True}]])
        allmax = 0
        steady: list[float] = []
        for r, ss in sorted(self.steps.items()):
            c = RANK_COLORS[r % len(RANK_COLORS)]
            xs = [s["step"] for s in ss]
            ts = [s["time_s"] * 1e3 for s in ss]
            # the steady steps: not the compile, the profiled step or a re-compile (the steps every
            # view's median leaves out; a profiled run re-compiles at step 3, seconds long)
            special = special_steps(ss, self.config)
            steady += [t for s, t in zip(ss, ts) if s.get("step") not in special] or (ts[2:] if len(ts) > 2 else ts)
            fig.add_trace(go.Scatter(x=xs, y=ts, name=f"rank {r} time", mode="lines+markers",
                                     line=dict(color=c), legendgroup=f"r{r}",
                                     hovertemplate="step %{x}: %{y:.1f} ms<extra>rank " + str(r) + "</extra>"), row=1, col=1)
            fig.add_trace(go.Scatter(x=xs, y=[s.get("loss") for s in ss], name=f"rank {r} loss", mode="lines+markers",
                                     line=dict(color=c), legendgroup=f"r{r}", showlegend=False), row=1, col=2)
            allmax = max([allmax] + [max([v for v in (s.get("mem") or {}).values() if isinstance(v, (int, float))],
                                         default=0) for s in ss])
        cat_steps = [(s["step"], self.by_category(s)) for s in self.steps.get(shown, [])]
        cat_steps = [(k, d) for k, d in cat_steps if d]
        # on the CPU the steps carry the training state's categories and the process's resident set:
        # two quantities hundreds of times apart, so the resident set gets its own axis (right) and
        # the categories' axis is scaled to their stack
        process_apart = bool(cat_steps) and not any("activations" in d for _, d in cat_steps)
        stack_max = max((sum(v for c, v in d.items() if c != "offloaded") for _, d in cat_steps), default=0)
        unit, div = F.byte_unit(stack_max if process_apart else allmax)
        if process_apart and stack_max < 1 << 20:   # a small model's training state: KiB, not slivers of MiB
            unit, div = "KiB", 1024.0
        punit, pdiv = F.byte_unit(allmax)
        if cat_steps:
            cats = list(dict.fromkeys(c for _, d in cat_steps for c in d))
            for cat in cats:
                if cat == "offloaded":
                    continue   # host memory: not part of the device's peak the bars stack up to
                name = self.category_name(cat)
                fig.add_trace(go.Bar(x=[k for k, _ in cat_steps], y=[d.get(cat, 0) / div for _, d in cat_steps],
                                     name=name, marker_color=F.CATEGORY_COLORS.get(cat), legendgroup="mem",
                                     meta={"category": cat},
                                     hovertemplate="step %{x}: %{y:.1f} " + unit + "<extra>" + name + "</extra>"),
                              row=1, col=3)
            peaks = [(s["step"], (s.get("mem") or {}).get("peak")) for s in self.steps.get(shown, [])]
            if process_apart:
                # CPU: no allocator peak to split; the resident set is another quantity, drawn as a line
                fig.add_trace(go.Scatter(x=[k for k, v in peaks if v], y=[v / pdiv for _, v in peaks if v],
                                         name=f"rank {shown} process resident set (right axis)", mode="lines+markers",
                                         line=dict(color="#333", dash="dot"), legendgroup="mem",
                                         hovertemplate="step %{x}: %{y:.1f} " + punit + "<extra>resident set</extra>"),
                              row=1, col=3, secondary_y=True)
            fig.update_layout(barmode="stack")
        for r, ss in sorted(self.steps.items()):
            if cat_steps and r == shown:
                continue
            c = RANK_COLORS[r % len(RANK_COLORS)]
            xs = [s["step"] for s in ss]
            for key, dash in (("allocated", "solid"), ("reserved", "dot"), ("peak", "dash")):
                u, dv = (punit, pdiv) if process_apart else (unit, div)
                ys = [((s.get("mem") or {}).get(key) or 0) / dv for s in ss]
                if any(ys):
                    fig.add_trace(go.Scatter(x=xs, y=ys, name=f"rank {r} {key}" + (" (right axis)" if process_apart else ""),
                                             mode="lines+markers", line=dict(color=c, dash=dash), legendgroup=f"r{r}",
                                             hovertemplate="step %{x}: %{y:.1f} " + u + "<extra>rank " + str(r)
                                             + " " + key + "</extra>"), row=1, col=3, secondary_y=process_apart)
        fig.update_yaxes(title_text=(f"training state, {unit}" if process_apart else unit), row=1, col=3,
                         secondary_y=False)
        if process_apart:
            fig.update_yaxes(title_text=f"process, {punit}", row=1, col=3, secondary_y=True, showgrid=False)
        fig.update_xaxes(title_text="step", dtick=1 if self.n_steps() <= 20 else None)
        if steady:
            # the range follows the steady steps' 95th percentile: on a shared machine one stalled
            # step (1.7 s among ~30 ms steps in a CI run of the browser test) must not flatten the rest
            q = sorted(steady)[int(0.95 * (len(steady) - 1))] if len(steady) >= 20 else max(steady)
            top = q * 1.3
            allt = [s["time_s"] * 1e3 for ss in self.steps.values() for s in ss]
            if allt and max(allt) > 3 * top:   # a compile step: keep the steady steps readable
                fig.update_yaxes(range=[0, top], row=1, col=1)
                slow = sum(t > top for t in steady)
                fig.add_annotation(text=f"step 1 (compile): {max(allt) / 1e3:.1f} s, above the range"
                                        + (f"; {slow} slower step(s) above it too" if slow else ""),
                                   xref="x domain", yref="y domain", x=0, y=1, showarrow=False, xanchor="left",
                                   font=dict(size=10))
        live = " (live)" if self.live else ""
        fig.update_layout(title=dict(text=f"steps · {self.status}{live} · {self.n_steps()} step(s)", font=dict(size=13)),
                          height=340, margin=dict(l=10, r=10, t=60, b=30), legend=dict(orientation="h", y=-0.25))
        return fig

    def memory_signature(self, rank: int) -> tuple | None:
        """(size, mtime) of the rank's memory timeline file: the live view re-reads it when it changes."""
        try:
            st = (self.run_dir / S.rank_dir_name(rank) / S.MEMORY).stat()
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns
