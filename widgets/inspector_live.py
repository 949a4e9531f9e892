"""The Inspector's Steps tab and its live following of a run being written.

A mixin of :class:`~deepcompile.widgets.inspector.Inspector`: it uses the inspector's ``W``
(ipywidgets), ``model``, ``job``, ``_lock``, ``_plot``, ``open``, ``_render_header`` and
``_runs_table``. A daemon thread polls the shown run's ``steps.jsonl`` (every ``live_interval``
while the run is live, else ``poll_interval``), counts each new step at once (the Steps tab's note
and the header), re-draws the steps figure at most every ``steps_plot_s`` while the run is live
(a re-draw costs the kernel and the browser every step's points again: on a small machine, CPU
the run it shows needs), and reloads the record when it appears, completes, or (at most every
``reload_every_s``) gains graphs or a newly measured step's timeline (the Schedule tab then shows
it).
"""
from __future__ import annotations

import html
import threading
import time

from deepcompile.record import schema as S
from deepcompile.record.reader import RecordError, load_json

from .timeline_view import memory_view, peak_label, view_figure, view_peak

esc = html.escape


class LiveStepsMixin:
    """The Steps tab and the polling of :class:`~deepcompile.widgets.inspector.Inspector`."""

    steps_plot_s = 2.0         # while a run is live, the steps figure is re-drawn at most this often
    _steps_plotted = 0.0       # time.monotonic() of the last re-draw by the poller
    _steps_stale = False       # steps arrived since that re-draw

    def _build_steps_tab(self):
        """The Steps tab's widgets (``st_*``); returns the tab."""
        W = self.W
        self.st_out = W.Output()
        self.st_out.add_class("dc-steps")
        self.st_note = W.HTML()
        self.st_mem = W.Output()               # the latest measured step's memory timeline, live
        self.st_mem.add_class("dc-live-memory")
        steps_tab = W.VBox([self.st_note, self.st_out, self.st_mem])
        return steps_tab

    def _index_signature(self):
        """(size, mtime) of the rank's graph index and of its schedule: a live run adds graphs, and
        rewrites the schedule at each sampled step (the latest measured step's timeline)."""
        m = self.model
        if m.run_dir is None:
            return None
        sig = []
        for path in (m.run_dir / f"rank{m.rank}" / "graphs" / "index.json", m.run_dir / f"rank{m.rank}" / S.SCHEDULE):
            try:
                st = path.stat()
            except OSError:
                sig.append(None)
                continue
            sig.append((st.st_size, st.st_mtime_ns))
        return tuple(sig) if sig[0] is not None else None

    def _render_steps(self, note_only: bool = False) -> None:
        st = self.model.steps
        if st is None:
            return
        if st.error and not st.steps:
            self.st_note.value = f"<div style='font-size:12px;color:#b00020'>{esc(st.error)}</div>"
            return
        following = self._poller is not None and self._poller.is_alive() and st.live
        n = st.n_steps()
        wait = ""
        if st.live and n == 0:   # the first step compiles: say so instead of an empty plot
            job = self.model.jobs.get(st.run_dir)
            since = f" ({time.time() - job.started_at:.0f} s since start)" if job and job.started_at else ""
            wait = (f"; step 1 is compiling the graphs{since}: {self._graphs_so_far()} graph version(s) "
                    "recorded so far; steps appear as each one ends")
        how = st.split_how(self.model.rank)
        how = (f"<div class='dc-split-note' style='font-size:11px;color:#555'>memory per step, by category: "
               f"{esc(how)}</div>") if how else ""
        self.st_note.value = (f"<div class='dc-steps-note' style='font-size:12px'>{st.status}; {n} step(s)"
                              + (f"; following live, every {self._interval():g} s" if following else "") + wait
                              + "</div>" + how)
        if note_only:
            self._render_live_memory()
            return
        self._plot(self.st_out, st.figure())
        self._render_live_memory()

    def _graphs_so_far(self) -> int:
        m = self.model
        try:
            idx = load_json(m.run_dir / S.rank_dir_name(m.rank) / S.GRAPHS_DIR / S.GRAPH_INDEX, optional=True,
                            root=m.run_dir)
        except RecordError:
            return 0
        return len(idx) if isinstance(idx, list) else 0

    def _render_live_memory(self, force: bool = False) -> None:
        """The latest measured step's memory timeline by category, re-read when its file changes
        (the profiling step writes it while the job runs on)."""
        m = self.model
        st = m.steps
        if st is None:
            return
        sig = st.memory_signature(m.rank)
        if sig is None:
            if self._mem_sig is not None:
                self.st_mem.outputs = ()
            self._mem_sig = None
            return
        if sig == self._mem_sig and not force:
            return
        self._mem_sig = sig
        view = m.view if m.view is not None and not st.live else memory_view(m.run_dir, m.rank)[0]
        if view and (view.get("measured") or {}).get("samples"):
            try:
                self._plot(self.st_mem, view_figure(view, title=f"latest measured step: memory by category "
                                                                f"(peak {peak_label(view_peak(view))})"))
            except Exception:
                self.st_mem.outputs = ()

    def follow(self) -> None:
        """Poll the shown run's steps (and its record until complete) every ``poll_interval`` s,
        on a daemon thread: the kernel stays free."""
        if self._poller is not None and self._poller.is_alive():
            return
        self._stop.clear()
        self._poller = threading.Thread(target=self._poll_loop, name="deepcompile-inspector-poll", daemon=True)
        self._poller.start()

    def stop(self) -> None:
        """Stop following (the job, if any, keeps running; see :meth:`cancel`)."""
        self._stop.set()

    def _interval(self) -> float:
        """Seconds between polls: ``live_interval`` while a run is being written or a job runs."""
        st = self.model.steps
        live = (st is not None and st.live) or (self.job is not None and self.job.running)
        return self.live_interval if live else self.poll_interval

    def _poll_loop(self) -> None:
        while not self._stop.wait(self._interval()):
            try:
                self.poll_once()
            except Exception:  # keep polling; the message shows on the next render
                pass

    def poll_once(self) -> bool:
        """One polling round (what the thread does): re-read the steps and show new ones at once;
        then reload the record when it appears or completes, or (while it is written) when graphs
        were added, at most every ``reload_every_s``: a reload lays out graphs, which must not
        hold back the steps. True when something changed."""
        m = self.model
        if m.run_dir is None or m.steps is None:
            return False
        before = m.steps.status
        changed = m.steps.poll()
        if changed or m.steps.live or self._steps_stale:
            with self._lock:   # the steps first: each one is counted as soon as its line is written
                now = time.monotonic()
                stale = self._steps_stale or changed
                plot = stale and (not m.steps.live or now - self._steps_plotted >= self.steps_plot_s)
                self._render_steps(note_only=not plot)
                self._steps_stale = stale and not plot
                if plot:
                    self._steps_plotted = now
                if changed:
                    self._render_header()   # the header counts from the same steps, at the same poll
                    self.p_runs.value = self._runs_table()
        isig = self._index_signature()
        new_graphs = isig is not None and isig != getattr(self, "_index_sig", None)
        finished = before != m.steps.status and m.steps.status in ("complete", "failed", "interrupted")
        due = time.time() - self._last_reload >= self.reload_every_s
        if (m.run_dir / S.MANIFEST).exists() and (finished or (isig is not None and new_graphs and due)
                                                  or (m.record is None and isig is not None and due)):
            self._index_sig = isig
            self._last_reload = time.time()
            self.open(m.run_dir)
            return True
        return changed
