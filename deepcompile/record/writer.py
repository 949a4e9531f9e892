"""Writing a run record (layout and schema: :mod:`deepcompile.record.schema`).

The training side creates one :class:`RunRecorder` per rank::

    rec = RunRecorder("runs/x", rank, world, config)
    model.dc_backend.observers.append(rec.graph_version)   # before the first forward
    for step in ...:
        ...
        rec.step(step, time_s, loss.item())                 # one appended line, flushed
    rec.close()

Graphs are written once, at compile time (one gzip file per version plus a small index).
A step is one ``write`` + ``flush`` of a JSON line, so a reader can follow a live run and the
steps that are not being recorded pay nothing. Files other than ``steps.jsonl`` are written to a
temporary name and renamed, so a reader never sees half of them.
"""
from __future__ import annotations

import datetime as _dt
import gzip
import json
import os
import platform
import re
import socket
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Iterable

from deepcompile.record import schema as S


def atomic_write(path: Path | str, data: bytes) -> None:
    """Write a file whole or not at all: a temp file beside it (``.NAME.tmpPID``) renamed over
    it, so a reader never sees half a file and a failed write leaves none behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json(path: Path, obj: Any, *, compress: bool | None = None) -> None:
    path = Path(path)
    raw = json.dumps(obj, separators=(",", ":") if compress or path.suffix == ".gz" else None,
                     indent=None if path.suffix == ".gz" else 1).encode()
    if compress or (compress is None and path.suffix == ".gz"):
        raw = gzip.compress(raw, compresslevel=5, mtime=0)
    atomic_write(path, raw)


def environment(rank: int, world: int) -> dict:
    import torch

    devices: list[str] = []
    if torch.cuda.is_available():
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count() or 0,
        "cuda": torch.version.cuda or "",
        "devices": devices,
        "world_size": int(world),
        "rank": int(rank),
        "argv": list(sys.argv),
    }


def memory_stats(reset_peak: bool = False) -> dict:
    """Bytes allocated / reserved / peak on this rank's device (CUDA), or the process' resident
    set on CPU (allocated = reserved = current RSS, peak = max RSS). ``reset_peak`` (CUDA): start
    the allocator's peak again after reading it, so the next read is that step's own peak."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out = {"allocated": int(torch.cuda.memory_allocated()),
               "reserved": int(torch.cuda.memory_reserved()),
               "peak": int(torch.cuda.max_memory_allocated())}
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()
        return out
    from deepcompile.profile.host import resident_bytes

    rss = resident_bytes()
    peak = rss
    try:
        import resource

        peak = max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    except (ImportError, OSError):
        pass
    return {"allocated": rss, "reserved": rss, "peak": int(peak)}


def _step_split(mem: dict):
    """(by_category, how) of this step's peak, or None (no deepcompile model in this process)."""
    if "torch" not in sys.modules:   # a reader's or a test's recorder: no model can be training
        return None
    try:
        from deepcompile.profile.memory_split import step_split
    except ImportError:
        return None
    try:
        return step_split(mem)
    except Exception as e:  # noqa: BLE001 - bookkeeping must never stop the user's training loop
        global _SPLIT_WARNED
        if not _SPLIT_WARNED:
            _SPLIT_WARNED = True
            import warnings

            warnings.warn(f"deepcompile: this step's memory split by category failed ({type(e).__name__}: {e}); "
                          "steps.jsonl gets no split from now on errors like this", stacklevel=2)
        return None


_SPLIT_WARNED = False


LAUNCHER_ENV = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                "CUDA_VISIBLE_DEVICES", "PYTHONPATH", "OMP_NUM_THREADS")


def launch_command(world: int | None = None, *, argv: list[str] | None = None, launcher: str | None = None,
                   relaunch: list[str] | None = None) -> dict:
    """How this process was started, to start the run again (the inspector's Run): ``argv``
    (``sys.argv``), ``orig_argv`` (the interpreter's own command line, with ``-m``), ``cwd``,
    ``executable``, ``world_size``, the launcher (``torchrun``, ``deepcompile demo`` or ``none``)
    and its environment variables, and ``relaunch``: the argv that runs it again from ``cwd``,
    or None with ``why_not`` (a multi-node torchrun job, an interactive session).

    ``relaunch`` of a torchrun job is ``python -m torch.distributed.run --nproc-per-node=N``
    and the script's command line; of the demo, the demo's own command line (the caller passes
    it as ``relaunch``; a re-run needs a new ``--out``)."""
    env = {k: os.environ[k] for k in LAUNCHER_ENV if k in os.environ}
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    orig = list(getattr(sys, "orig_argv", []) or [])
    if launcher is None:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ else "none"
    argv = list(argv if argv is not None else sys.argv)
    cmd = {"argv": argv, "orig_argv": orig, "cwd": os.getcwd(), "executable": sys.executable,
           "world_size": int(world), "launcher": launcher, "env": env}
    script = list(relaunch) if relaunch is not None else _script_argv(argv, orig)
    why = ""
    if relaunch is not None:
        pass
    elif script is None:
        why = "started from an interactive session or python -c (no script to run again)"
    elif launcher == "torchrun":
        local = int(env.get("LOCAL_WORLD_SIZE", world) or world)
        if local != world:
            why = (f"a multi-node torchrun job ({world} ranks, {local} on this node): start it again on "
                   "every node with the same torchrun command")
        else:
            script = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={local}"] + script[1:]
    elif launcher == "none" and world > 1:
        why = (f"{world} ranks started by an unknown launcher (no torchrun environment): start it again "
               "the way it was started")
    cmd["relaunch"] = None if why else script
    if why:
        cmd["why_not"] = why
    return cmd


def _script_argv(argv: list[str], orig: list[str]) -> list[str] | None:
    """``[python, script-or--m-module, args...]`` that runs this program again, or None."""
    if not argv or argv[0] in ("", "-c"):
        return None
    if orig and "-m" in orig[1:]:   # python [opts] -m module args: keep the module form
        i = orig.index("-m", 1)
        mod = orig[i + 1] if i + 1 < len(orig) else ""
        path = mod.replace(".", os.sep)
        # sys.argv[0] of ``-m mod`` is mod's file (argv given by the caller may be another program's)
        if mod and (argv[0].endswith(path + ".py") or argv[0].endswith(os.path.join(path, "__main__.py"))):
            return [sys.executable, "-m", mod] + argv[1:]
    if argv[0].endswith("__main__.py"):   # sys.argv of ``python -m pkg`` seen in a spawned child
        return [sys.executable, "-m", os.path.basename(os.path.dirname(argv[0]))] + argv[1:]
    return [sys.executable] + argv


def version_fields(v: Any) -> dict:
    """A graph version (``backend.GraphVersion``, an equivalent dict or object) as a dict of its
    fields, shallow: its nodes are plain dicts, lists and strings already, and ``dataclasses.asdict``
    would deep-copy every node before JSON reads them once (0.13-0.2 s of step 2 at 32 layers on
    2 H200s, under py-spy)."""
    if isinstance(v, dict):
        return v
    if is_dataclass(v):
        return {f.name: getattr(v, f.name) for f in fields(v)}
    return dict(vars(v))


class RunRecorder:
    """Writes this rank's part of a run record. Rank 0 also writes the manifest and config."""

    def __init__(self, run_dir: str | os.PathLike, rank: int = 0, world: int = 1, config: Any = None,
                 *, env: dict | None = None, command: dict | None = None):
        self.run_dir = Path(run_dir)
        self.rank, self.world = int(rank), int(world)
        self.dir = self.run_dir / S.rank_dir_name(rank)
        (self.dir / S.GRAPHS_DIR).mkdir(parents=True, exist_ok=True)
        self._index: list[dict] = []
        self._seq: dict[tuple[int, str], int] = {}
        self._profile: dict[tuple[int, str], dict] = {}
        self._events: list[dict] = []
        self._samples: list[dict] = []
        self.closed = False
        if config is not None and hasattr(config, "to_dict"):
            config = config.to_dict()
        self.config = config
        self.created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        # how the run was started (launch_command), so that it can be run again; rank 0's goes in
        # the manifest (``reader.run_command``)
        self.command = command if command is not None else launch_command(self.world)
        if self.rank == 0:
            self._manifest("running")
            write_json(self.run_dir / S.CONFIG, config if config is not None else {})
        write_json(self.dir / S.ENVIRONMENT, env or environment(rank, world))
        write_json(self.dir / S.GRAPHS_DIR / S.GRAPH_INDEX, [])
        self._steps = open(self.dir / S.STEPS, "a", encoding="utf-8")

    def _manifest(self, status: str, reason: str | None = None) -> None:
        from deepcompile.version import __version__

        m = {"format_version": S.FORMAT_VERSION, "tool": f"deepcompile {__version__}",
             "created": self.created, "world_size": self.world, "ranks": list(range(self.world)),
             "status": status}
        if self.command:
            m["command"] = self.command
        if reason:
            m["reason"] = str(reason)
        write_json(self.run_dir / S.MANIFEST, m)

    # ------------------------------------------------------------------ graphs
    def graph_version(self, v: Any) -> None:
        """Record one graph version (a ``backend.GraphVersion`` or an equivalent dict).

        Usable directly as a backend observer: ``model.dc_backend.observers.append(rec.graph_version)``.
        """
        d = version_fields(v)
        gid, kind, after = int(d["graph_id"]), str(d["kind"]), str(d["after"])
        seq = self._seq.get((gid, kind), 0)
        self._seq[(gid, kind)] = seq + 1
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", after)
        fname = f"g{gid}-{kind}-{seq:02d}-{safe}.json.gz"
        nodes = list(d.get("nodes") or [])
        write_json(self.dir / S.GRAPHS_DIR / fname,
                   {"graph_id": gid, "kind": kind, "after": after, "nodes": nodes})
        self._index.append({"graph_id": gid, "kind": kind, "after": after, "seq": seq, "file": fname,
                            "node_count": len(nodes), "notes": [str(n) for n in d.get("notes") or []],
                            "seconds": float(d.get("seconds") or 0.0)})
        write_json(self.dir / S.GRAPHS_DIR / S.GRAPH_INDEX, self._index)

    __call__ = graph_version

    # ------------------------------------------------------------------ steps
    def step(self, step: int, time_s: float, loss: float | None = None, mem: dict | None = None,
             **extra: Any) -> None:
        """Append one step line (flushed). ``mem``: {allocated, reserved, peak} bytes; measured
        here when omitted. Where a deepcompile model trains in this process, the step's peak is
        split by memory category too (``mem.by_category``, how in ``mem.split``:
        :func:`deepcompile.profile.memory_split.step_split`, microseconds, no device sync), so a live
        view plots each step's memory by category from the first step on."""
        m = {k: int(v) for k, v in (mem if mem is not None else memory_stats(reset_peak=True)).items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)}
        given = (mem or {}).get("by_category")
        split = ((given, str((mem or {}).get("split") or "given by the caller")) if isinstance(given, dict)
                 else _step_split(m))
        if split is not None:
            m["by_category"], m["split"] = {k: int(v) for k, v in split[0].items()}, split[1]
        rec = {"step": int(step), "time_s": float(time_s),
               "loss": None if loss is None else float(loss), "mem": m}
        rec.update(extra)
        self._steps.write(json.dumps(rec) + "\n")
        self._steps.flush()

    # ------------------------------------------------------------------ profile / schedule / memory
    def profile(self, graphs: dict | Iterable[dict]) -> None:
        """Record per-node profiles: one or more ``{graph_id, kind, nodes: [{name, latency_ms,
        mem_after_bytes, peak_bytes, out_bytes}], hardware}``; a later profile of the same graph
        replaces the earlier one."""
        for g in ([graphs] if isinstance(graphs, dict) else graphs):
            self._profile[(int(g["graph_id"]), str(g["kind"]))] = dict(g)
        self._write_checked(S.PROFILE, {"graphs": list(self._profile.values())}, S.check_profile)

    def schedule(self, events: Iterable[dict], *, replace: bool = False) -> None:
        """Record schedule events ``{graph_id, kind, node, stream, start_us, end_us, source}``."""
        if replace:
            self._events = []
        self._events.extend(dict(e) for e in events)
        self._write_checked(S.SCHEDULE, {"events": self._events}, S.check_schedule)

    def memory(self, samples: Iterable[dict], *, replace: bool = False) -> None:
        """Record memory timeline samples ``{t_us | node_index, allocated_bytes, reserved_bytes}``."""
        if replace:
            self._samples = []
        self._samples.extend(dict(s) for s in samples)
        self._write_checked(S.MEMORY, {"samples": self._samples}, S.check_memory)

    def memory_timeline(self, timeline: dict) -> None:
        """Record the measured memory timeline of the profiled step (``model.dc_profile.memory``,
        :func:`deepcompile.profile.memory_split.take_memory_timeline`): samples by category and its
        peak, replacing any samples written before."""
        self._samples = list(timeline.get("samples") or [])
        self._write_checked(S.MEMORY, dict(timeline), S.check_memory)

    def model(self, model: Any) -> None:
        """Everything a trained ``DeepCompileModel`` has to record beyond graphs and steps: the
        agreed profile, this rank's measured memory timeline and the planner's choice (each where
        it exists). Call it once training (or at least the profiling step) is done."""
        prof = getattr(model, "dc_profile", None)
        if prof is not None:
            self.profile(prof.to_records())
            if getattr(prof, "memory", None):
                self.memory_timeline(prof.memory)
        if getattr(model, "dc_plan", None):
            self.plan(model.dc_plan)

    def plan(self, plan: dict) -> None:
        """Record the planner's choice (``model.dc_plan``, :mod:`deepcompile.plan.planner`): the
        pass parameters it chose and why (predicted step time and peak of the chosen plan and of
        the runner-up, the memory limit and the capacity it used), as ``plan.json`` in this rank's
        directory; ``deepcompile inspect`` prints its summary line."""
        if not isinstance(plan, dict) or "chosen" not in plan:
            raise ValueError("RunRecorder.plan: expected model.dc_plan (a dict with 'chosen'), got "
                             f"{type(plan).__name__}")
        S.check_plan(str(self.dir / S.PLAN), plan)
        write_json(self.dir / S.PLAN, plan)

    def _write_checked(self, name: str, obj: dict, check) -> None:
        """Validate with the reader's own schema check before writing: a record we write is
        always one we can read back."""
        path = self.dir / name
        check(str(path), obj)
        write_json(path, obj)

    # ------------------------------------------------------------------ end
    def close(self, failed: bool = False, *, status: str | None = None, reason: str | None = None) -> None:
        """End this rank's part; rank 0 writes the manifest's final ``status`` (``complete``,
        ``failed`` or ``interrupted``, from ``failed`` when not given) and the ``reason``."""
        if self.closed:
            return
        self.closed = True
        self._steps.close()
        if self.rank == 0:
            self._manifest(status or ("failed" if failed else "complete"), reason)

    def __enter__(self) -> "RunRecorder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)


def finalize_manifest(run_dir: str | os.PathLike, status: str, reason: str) -> bool:
    """The launcher's word on how a run ended, for when rank 0 could not write it (killed,
    terminated, interrupted): a manifest still saying ``running`` becomes ``status`` with
    ``reason``. Returns whether it was rewritten; a finished manifest is left as rank 0 wrote it."""
    path = Path(run_dir) / S.MANIFEST
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(m, dict) or m.get("status") != "running":
        return False
    m["status"], m["reason"] = status, str(reason)
    write_json(path, m)
    return True
