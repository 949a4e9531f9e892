"""Background jobs: the CLI demo (or a script under torchrun) as a subprocess in its own process
group, its output streamed line by line, progress from its ``step k/N`` lines, cancellable.

Nothing here blocks the caller: :meth:`Job.start` returns at once, a daemon thread reads the
output; :meth:`Job.cancel` kills the whole process group (the ranks the launcher spawned too).
The kernel never dies with the job: the job is a separate session (``start_new_session``).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import deepcompile

STEP_RE = re.compile(r"^\s*step\s+(\d+)\s*/\s*(\d+)")
# The source checkout deepcompile runs from (an editable install), or None when it is installed
# from a wheel: a job then runs in the caller's folder, with the environment as it is.
_ROOT = Path(deepcompile.__file__).resolve().parents[1]
REPO_ROOT = _ROOT if (_ROOT / "pyproject.toml").is_file() else None


def fmt_value(v) -> str:
    """A pass parameter value as the CLI's ``--pass-param`` reads it (JSON where it can be)."""
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return repr(v)  # "256.0": stays a float for float parameters
    return json.dumps(v)


def demo_command(out: str | os.PathLike, *, passes: Iterable[str] | None = ("zero3",),
                 pass_params: dict[str, dict] | None = None, ranks: int = 2, steps: int = 20,
                 compiler: str | None = None, batch: int | None = None, seed: int | None = None,
                 cpu: bool = False, python: str | None = None, model: str | None = None,
                 profile_step: int | None = None) -> list[str]:
    """The argv of ``python -m deepcompile demo`` with the given passes and parameter values
    (``model``: a ``package.module:factory`` to train instead of the built-in GPT;
    ``profile_step``: the step profiled node by node, so the record holds a profile).
    ``passes=None``: the demo's default plan (zero3, step 1 profiled, then the planned passes)."""
    argv = [python or sys.executable, "-m", "deepcompile", "demo", "--out", str(out),
            "--ranks", str(int(ranks)), "--steps", str(int(steps))]
    passes = list(passes) if passes is not None else []
    if passes:
        argv += ["--passes", ",".join(passes)]
    if compiler:
        argv += ["--compiler", compiler]
    if batch is not None:
        argv += ["--batch", str(int(batch))]
    if seed is not None:
        argv += ["--seed", str(int(seed))]
    if cpu:
        argv.append("--cpu")
    if model:
        argv += ["--model", model]
    if profile_step is not None:
        argv += ["--profile-step", str(int(profile_step))]
    for name in passes:
        for k, v in (pass_params or {}).get(name, {}).items():
            argv += ["--pass-param", f"{name}.{k}={fmt_value(v)}"]
    return argv


def script_command(script: str | os.PathLike, *, ranks: int = 2, args: Iterable[str] = ()) -> list[str]:
    """``torchrun --nproc-per-node=N script args...`` (through ``python -m torch.distributed.run``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={int(ranks)}",
            str(script), *map(str, args)]


def job_env(extra: dict | None = None) -> dict:
    """The environment for a job: this process's, with the deepcompile checkout (if any) importable."""
    env = dict(os.environ)
    pp = env.get("PYTHONPATH", "")
    if REPO_ROOT is not None and str(REPO_ROOT) not in pp.split(os.pathsep):
        env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + pp if pp else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class Job:
    """One background process (group). Callbacks run on the reader thread."""

    def __init__(self, argv: list[str], *, cwd: str | os.PathLike | None = None, env: dict | None = None,
                 out_dir: str | os.PathLike | None = None,
                 on_line: Callable[[str], None] | None = None,
                 on_exit: Callable[["Job"], None] | None = None):
        self.argv = list(argv)
        self.cwd = str(cwd or REPO_ROOT or os.getcwd())
        self.env = env if env is not None else job_env()
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.on_line = on_line
        self.on_exit = on_exit
        self.lines: list[str] = []
        self.step = 0
        self.total: int | None = None
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.cancelled = False
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ state
    @property
    def running(self) -> bool:
        return self.proc is not None and not self._done.is_set()

    @property
    def status(self) -> str:
        if self.proc is None:
            return "not started"
        if not self._done.is_set():
            return "running"
        if self.cancelled:
            return "cancelled"
        return "finished" if self.returncode == 0 else f"failed (exit code {self.returncode})"

    @property
    def progress(self) -> float:
        return 0.0 if not self.total else min(1.0, self.step / self.total)

    def feed(self, line: str) -> None:
        """Take one output line (also used by tests): progress from ``step k/N`` lines."""
        line = line.rstrip("\n")
        self.lines.append(line)
        if len(self.lines) > 5000:
            del self.lines[:1000]
        m = STEP_RE.match(line)
        if m:
            self.step, self.total = int(m.group(1)), int(m.group(2))
        if self.on_line is not None:
            try:
                self.on_line(line)
            except Exception:  # a broken display must not kill the reader
                pass

    # ------------------------------------------------------------ control
    def start(self) -> "Job":
        if self.proc is not None:
            raise RuntimeError("job already started")
        self.started_at = time.time()
        self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                     bufsize=1, start_new_session=True)
        self._thread = threading.Thread(target=self._read, name="deepcompile-job", daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                self.feed(line)
        finally:
            self.returncode = self.proc.wait()
            self.ended_at = time.time()
            self._done.set()
            if self.on_exit is not None:
                try:
                    self.on_exit(self)
                except Exception:
                    pass

    def cancel(self, grace: float = 5.0) -> None:
        """Terminate the job's process group (SIGTERM, then SIGKILL after ``grace`` seconds)."""
        if self.proc is None or self._done.is_set():
            return
        self.cancelled = True
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # ranks spawned by the launcher may outlive it briefly: sweep the group once more
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until the job ends (or ``timeout``); returns the exit code (None: still running)."""
        if self.proc is None:
            raise RuntimeError("job not started")
        self._done.wait(timeout)
        return self.returncode

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.lines[-n:])


# --------------------------------------------------------------------------- re-launching a recorded command
class RelaunchError(ValueError):
    """A record's command cannot be re-launched (none recorded, or it does not name its output)."""


def _recorded_parts(recorded) -> tuple[list[str], str | None, int | None, bool]:
    """(argv, cwd, world size, launched by torchrun) of what ``record.reader.run_command`` gives:
    an argv list, or a dict with ``argv`` (and ``cwd``, ``world_size``, ``launcher``/``torchrun``)."""
    if isinstance(recorded, dict) and "relaunch" in recorded:   # record.writer.launch_command's dict
        if not recorded.get("relaunch"):
            raise RelaunchError("this run cannot be launched again from here: "
                                + (recorded.get("why_not") or "its record holds no command to run again"))
        return (list(recorded["relaunch"]), recorded.get("cwd") or None, recorded.get("world_size"),
                recorded.get("launcher") == "torchrun")
    if isinstance(recorded, dict):
        argv = recorded.get("argv") or recorded.get("command") or []
        cwd = recorded.get("cwd")
        world = recorded.get("world_size") or recorded.get("nproc_per_node")
        launcher = str(recorded.get("launcher") or "")
        torchrun = bool(recorded.get("torchrun")) or "torchrun" in launcher or "torch.distributed" in launcher
    else:
        argv, cwd, world, torchrun = recorded, None, None, False
    if isinstance(argv, str):
        import shlex

        argv = shlex.split(argv)
    if not isinstance(argv, (list, tuple)) or not argv or not all(isinstance(a, str) for a in argv):
        raise RelaunchError(f"the recorded command {recorded!r:.200} is not an argument list")
    return list(argv), (str(cwd) if cwd else None), (int(world) if isinstance(world, int) and world > 0 else None), torchrun


def is_demo_command(argv: list[str]) -> bool:
    """``python -m deepcompile demo ...`` (or ``deepcompile demo``)."""
    for i, a in enumerate(argv[:-1]):
        if a == "deepcompile" and argv[i + 1] == "demo" and (i == 0 or argv[i - 1] == "-m"):
            return True
        if a.endswith("/deepcompile") and argv[i + 1] == "demo":
            return True
    return False


def relaunch_command(recorded, old_out: str | os.PathLike, new_out: str | os.PathLike, *,
                     ranks: int | None = None) -> tuple[list[str], str | None]:
    """(argv, cwd) re-running a user's recorded command with its run directory ``old_out``
    replaced by ``new_out``. A rank's recorded ``sys.argv`` (``script.py args``) goes back under
    ``torchrun --nproc-per-node=<world>``. RelaunchError when the command does not name
    ``old_out`` among its arguments: re-running it would write over the record shown."""
    argv, cwd, world, torchrun = _recorded_parts(recorded)
    base = cwd or os.getcwd()
    old = os.path.normpath(os.path.abspath(os.path.join(base, os.fspath(old_out))))
    new = os.path.abspath(os.fspath(new_out))
    out, hits = [], 0
    for a in argv:
        key, eq, val = a.partition("=") if a.startswith("-") else ("", "", a)
        if val and os.path.normpath(os.path.abspath(os.path.join(base, val))) == old:
            out.append(f"{key}={new}" if eq else new)
            hits += 1
        else:
            out.append(a)
    if not hits:
        raise RelaunchError(
            f"the recorded command ({' '.join(argv)[:300]}) does not name this run's directory {old_out} among its "
            "arguments, so a re-launch would write over this record: run the script yourself with another output "
            "directory")
    head = os.path.basename(out[0])
    if "torch.distributed.run" in out[:4] and not any(a.startswith(("--standalone", "--rdzv", "--master", "--nnodes"))
                                                       for a in out):
        # one node: a rendezvous of its own (a fixed default port may be taken by another job)
        i = out.index("torch.distributed.run") + 1
        out = out[:i] + ["--standalone"] + out[i:]
    if out[0].endswith(".py"):   # a rank's sys.argv: the script and its arguments
        n = ranks or world or 1
        out = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={int(n)}"] + out
               if (torchrun or n > 1) else [sys.executable] + out)
    elif head.startswith("python") or head == "torchrun":
        pass
    return out, cwd
