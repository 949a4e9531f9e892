"""The Inspector's jobs: start a run in the background, follow it, re-run with edited passes.

A mixin of :class:`~deepcompile.widgets.inspector.Inspector`: it uses the inspector's ``model``,
``_lock``, ``_muted``, the Passes tab's ``p_*`` widgets, ``open``, ``render``, ``follow`` and
``_runs_table``. The commands and the processes are :mod:`~deepcompile.widgets.launcher`'s
(:class:`~deepcompile.widgets.launcher.Job`, ``demo_command``, ``script_command``); this module
ties a job to the widgets: its log, progress and Cancel, and the run list switching to its run.
"""
from __future__ import annotations

import html
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from .launcher import Job, RelaunchError, demo_command, job_env, script_command
from .steps_view import StepsModel

if TYPE_CHECKING:
    from .inspector import Inspector

esc = html.escape


class JobsMixin:
    """Launching and re-running jobs from :class:`~deepcompile.widgets.inspector.Inspector`."""

    LOG_TAIL = 200         # the job's last lines shown in the Passes tab's log (all in ``job.lines``)
    log_every_s = 0.5      # the log and the progress bar are updated at most this often

    def run(self, out: str | Path | None = None) -> Job | None:
        """Re-run the job with the passes tab's values (the demo profiles step 1, so what-if works
        on the new run; a script's run re-launches its recorded command). The run list switches
        to the new run at once, and the new run is compared with the one shown before."""
        pm = self.model.passes
        errs = pm.validate()
        if errs:
            self.p_msg.value = "<span style='color:#b00020'>" + esc("; ".join(errs)) + "</span>"
            return None
        try:
            out, argv = self.model.rerun_command(out, steps=self.p_steps.value, ranks=self.p_ranks.value)
        except RelaunchError as e:
            self.p_msg.value = f"<span class='dc-run-refused' style='color:#b00020'>Run: {esc(str(e))}</span>"
            return None
        prev = self.model.run_dir
        job = self.start_job(argv, out, cwd=self.model.rerun_cwd, env=job_env())
        self.p_msg.value += f"<br><span style='font-size:11px'>running {esc(self.model.rerun_note)}</span>"
        self.switch_to(out, compare_with=prev)
        return job

    def switch_to(self, run_dir: str | Path, *, compare_with: str | Path | None = None) -> None:
        """Show ``run_dir`` (the run list selects it; a record still being written is followed)
        and compare it with ``compare_with`` in the Passes tab."""
        run_dir = Path(run_dir)
        if compare_with is not None and Path(compare_with) != run_dir:
            self.model.compare_base = Path(compare_with)
        self._last_reload = 0.0
        self._mem_sig = None
        keep = self.model.passes     # the edited values stay while the new record is not there yet
        self.open(run_dir)
        if self.model.record is None and keep is not None:
            self.model.passes = keep
        self.follow()

    def start_job(self, argv: list[str], out: str | Path, *, cwd: str | Path | None = None, env: dict | None = None) -> Job:
        if self.job is not None and self.job.running:
            raise RuntimeError("a job is already running; cancel it first")
        out = Path(out)
        self.p_cmd.value = f"<code style='font-size:11px'>{esc(' '.join(argv))}</code>"
        self.p_log.outputs = ()
        self.p_progress.value, self.p_progress.max = 0, 1
        self.p_progress.bar_style = ""

        # the log shows the job's last LOG_TAIL lines as one output, re-sent at most every log_every_s:
        # the demo prints a line per step, and appending each (Output.append_stdout re-sends the
        # whole log every time) kept a core of a small machine busy in the kernel and the browser
        lines: list[str] = []
        lk = threading.Lock()
        pending: dict = {"timer": None, "shown": 0.0}

        def show_log() -> None:
            with lk:   # one showing at a time: a timer's older tail never lands after the final one
                if pending["timer"] is not None:
                    pending["timer"].cancel()
                pending["timer"], pending["shown"] = None, time.monotonic()
                tail = lines[-self.LOG_TAIL:]
                more = len(lines) - len(tail)
                text = (f"… {more} earlier line(s) (Inspector.job.lines)\n" if more else "") + "".join(
                    ln + "\n" for ln in tail)
                self.p_log.outputs = ({"output_type": "stream", "name": "stdout", "text": text},) if text else ()
                if self.job is not None and self.job.total:
                    self.p_progress.max = self.job.total
                    self.p_progress.value = self.job.step

        def on_line(line: str) -> None:
            with lk:
                lines.append(line)
                if pending["timer"] is not None:     # a showing is due already
                    return
                wait = pending["shown"] + self.log_every_s - time.monotonic()
                if wait > 0:
                    pending["timer"] = t = threading.Timer(wait, show_log)
                    t.daemon = True
                    t.start()
                    return
            show_log()

        def on_exit(job: Job) -> None:
            show_log()
            self.p_cancel.disabled = True
            self.p_run.disabled = False
            self.p_progress.bar_style = "success" if job.returncode == 0 else "danger"
            self.p_msg.value = f"<span>job {esc(job.status)}: {esc(str(out))}</span>"
            if self.model.run_dir == out:
                self.open(out)
            with self._lock:
                self.p_runs.value = self._runs_table()

        self.job = Job(argv, cwd=cwd, env=env, out_dir=out, on_line=on_line, on_exit=on_exit)
        self.model.jobs[out] = self.job
        self.model.add_run(out)
        self._muted = True
        try:
            self.run_select.options = [str(p) for p in self.model.runs]
            if self.model.run_dir is not None:
                self.run_select.value = str(self.model.run_dir)
        finally:
            self._muted = False
        self.p_cancel.disabled = False
        self.p_run.disabled = True
        self.p_msg.value = f"<span>job running → {esc(str(out))}</span>"
        self.job.start()
        self.p_runs.value = self._runs_table()
        return self.job

    def cancel(self) -> None:
        if self.job is not None:
            self.job.cancel()

    def wait(self, timeout: float | None = 600) -> int | None:
        """Block until the current job ends (then show its run when it is the one opened)."""
        if self.job is None:
            return None
        rc = self.job.wait(timeout)
        if rc is not None and self.model.run_dir == self.job.out_dir:
            time.sleep(0.05)
            self.open(self.job.out_dir)
        return rc

    @classmethod
    def launch(cls, out: str | Path | None = None, *, ranks: int = 2, steps: int = 20,
               passes: Iterable[str] | None = None, pass_params: dict[str, dict] | None = None,
               script: str | Path | None = None, script_args: Iterable[str] = (), compiler: str | None = None,
               cpu: bool = False, batch: int | None = None, poll_interval: float = 1.0,
               cwd: str | Path | None = None, model: str | None = None, profile_step: int | None = 1,
               **kw) -> "Inspector":
        """Start a job in the background and return an Inspector that follows it.

        Without ``script``: the CLI demo (``python -m deepcompile demo``; GPUs when present, else
        gloo on the CPU) training ``model`` (a ``"package.module:factory"`` whose factory returns
        ``(nn.Module, make_batch)``; see ``deepcompile demo --help``) or the built-in GPT;
        ``passes=None`` runs its default plan (zero3, step 1 profiled, then the planned passes),
        a pass list runs those with step ``profile_step`` profiled (so what-if works on the
        record). With ``script``: ``torchrun --nproc-per-node=ranks script script_args`` (the
        script writes its record to ``out``, e.g. from an argument)."""
        out = Path(out) if out is not None else Path(f"runs/inspector-{time.strftime('%Y%m%d-%H%M%S')}")
        if script is None:
            argv = demo_command(out, passes=passes, pass_params=pass_params, ranks=ranks, steps=steps,
                                compiler=compiler, cpu=cpu, batch=batch, model=model,
                                profile_step=profile_step if passes is not None and steps > 1 else None)
        else:
            argv = script_command(script, ranks=ranks, args=script_args)
        self = cls(None, poll_interval=poll_interval, **kw)
        self.model.launch_model = model  # Run re-launches the same model
        self.model.run_dir = self.model.add_run(out)
        self.model.steps = StepsModel(out)
        self.model.error = f"{out}: job starting"
        self.start_job(argv, out, cwd=cwd, env=job_env())
        self.p_steps.value, self.p_ranks.value = steps, ranks
        self.render(full=True)
        self.follow()
        return self
