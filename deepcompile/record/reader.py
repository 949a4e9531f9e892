"""Reading and validating a run record.

Every problem (a missing file, a truncated gzip or JSON file, a hand-edited file that fails the
schema, a record from a newer format version) raises :class:`RecordError` whose message names
the file; nothing here lets a deep traceback escape. A partially written last line of
``steps.jsonl`` (a live run mid-write) is skipped.

Records are shared (people send each other run folders), so a record is untrusted input. Reading
one never leaves its folder and never hangs:

* every file is reached by a path built from fixed names plus, for graphs, the index's ``file``
  field, which must be a plain file name (no ``/``, ``..`` or absolute path); the real path
  (symlinks resolved) must lie inside the run folder;
* a file must be a regular file: FIFOs, devices, sockets and directories are refused from their
  ``stat`` before any ``open`` (an ``open`` of a FIFO blocks until a writer appears), and the
  ``open`` itself is non-blocking and re-checked with ``fstat`` in case the file was swapped;
* every file is read up to :class:`Limits` ``max_file_bytes`` (on disk, and again after gzip
  inflation, which is done in bounded chunks so a gzip bomb costs at most that much), the record
  as a whole up to ``max_total_bytes``; and the JSON values of one read are counted (at C speed,
  before parsing) against ``max_values``: text like ``[{"a":1},...]`` costs ~25x its size in
  Python objects (~100 bytes a value), so bytes alone do not bound the memory;
* JSON's ``NaN``/``Infinity`` are accepted (a diverged run logs them as losses) but numbers too
  large for the report's arithmetic, over-deep nesting and wrong-typed fields are refused by the
  schema (:mod:`deepcompile.record.schema`) with the key path.

Measured on a 32-layer GPT's record (one rank, ZeRO-3, graphs, schedule and memory timeline):
~5 MiB inflated in all, largest file 1.2 MiB, ~0.45 M JSON values, ~25 MiB as Python objects.
The defaults (64 MiB a file, 256 MiB and 8 M values a read) leave room for several times that
(more pass versions, a profile, a longer or larger model), and bound a hostile record to well
under a GiB. ``DEEPCOMPILE_RECORD_MAX_FILE_MB`` and ``DEEPCOMPILE_RECORD_MAX_TOTAL_MB`` raise
them for the CLI and the inspector, ``limits=`` for one call.
"""
from __future__ import annotations

import json
import os
import stat
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepcompile.record import schema as S
from deepcompile.record.schema import RecordError

__all__ = ["RecordError", "RunRecord", "GraphRecord", "Limits", "read_run", "load_json", "memory_view",
           "run_command", "read_plan"]

MiB = 1 << 20


def _env_mb(name: str, default_mb: int) -> int:
    v = os.environ.get(name)
    if not v:
        return default_mb * MiB
    try:
        mb = float(v)
    except ValueError:
        raise RecordError(f"{name}={v!r}: expected a number of MiB, e.g. {name}={default_mb * 4}") from None
    if not (mb > 0 and mb < 1 << 40):
        raise RecordError(f"{name}={v!r}: expected a positive number of MiB")
    return int(mb * MiB)


@dataclass(frozen=True)
class Limits:
    """How much one read may cost. ``max_file_bytes``: any one file, on disk and inflated;
    ``max_total_bytes``: all files of one :func:`read_run` together (inflated)."""
    max_file_bytes: int = 64 * MiB
    max_total_bytes: int = 256 * MiB

    @classmethod
    def default(cls) -> "Limits":
        return cls(_env_mb("DEEPCOMPILE_RECORD_MAX_FILE_MB", 64), _env_mb("DEEPCOMPILE_RECORD_MAX_TOTAL_MB", 256))

    @property
    def max_values(self) -> int:
        """JSON values allowed in one read: a real record has one per 11-19 bytes."""
        return max(4096, self.max_total_bytes // 32)


class _Budget:
    """The files one read has consumed, against ``limits.max_total_bytes``."""

    def __init__(self, limits: Limits):
        self.limits, self.used, self.values = limits, 0, 0

    def take_values(self, path: Path, raw: bytes) -> None:
        # every JSON value but the first follows a ',' or opens after '[' / '{' / ':': an upper
        # bound on the objects json.loads would build, counted before building any
        self.values += raw.count(b",") + raw.count(b"[") + raw.count(b"{")
        if self.values > self.limits.max_values:
            raise RecordError(
                f"{path}: the record holds more than {self.limits.max_values} JSON values (refused: that many "
                "would cost gigabytes of memory; if it is genuine, raise DEEPCOMPILE_RECORD_MAX_TOTAL_MB)")

    def take(self, path: Path, n: int) -> None:
        self.used += n
        if self.used > self.limits.max_total_bytes:
            raise RecordError(
                f"{path}: the record exceeds {self.limits.max_total_bytes / MiB:.0f} MiB in all (refused; if it is "
                "genuine, raise DEEPCOMPILE_RECORD_MAX_TOTAL_MB)")


def _mb(n: int) -> str:
    return f"{n / MiB:.4g} MiB"


def _too_big(path: Path, what: str, limits: Limits) -> RecordError:
    return RecordError(f"{path}: {what} is larger than the {_mb(limits.max_file_bytes)} limit for one record file "
                       "(refused; if it is genuine, raise DEEPCOMPILE_RECORD_MAX_FILE_MB)")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file" if not stat.S_ISREG(mode) else "another regular file"


def _inside(real: str, root_real: str) -> bool:
    return real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep)


def plain_name(file: str, where: str, name: Any) -> str:
    """``name`` if it is one plain file name (what the writer produces), else :class:`RecordError`."""
    bad = (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
           or "\x00" in name or os.path.isabs(name) or (os.altsep is not None and os.altsep in name))
    if bad:
        raise RecordError(f"{file}: {where}: {name!r:.80} is not a plain file name (refused: a record may only "
                          "name files inside its own folder)")
    return name


def read_bytes(path: str | os.PathLike, *, root: str | os.PathLike | None = None, optional: bool = False,
               limits: Limits | None = None, budget: _Budget | None = None) -> bytes | None:
    """The bytes of one record file (inflated when it ends in ``.gz``), or None when ``optional``
    and missing. Refuses, with :class:`RecordError`: a path whose real location is outside
    ``root`` (default: the file's own directory), anything but a regular file, and files or
    inflations over the limits."""
    path = Path(path)
    limits = limits or Limits.default()
    root_real = os.path.realpath(root if root is not None else path.parent)
    real = os.path.realpath(path)
    if not _inside(real, root_real):
        how = "is a symlink that leads" if os.path.islink(path) else "resolves to a place"
        raise RecordError(f"{path}: {how} outside the run directory {root_real} ({real}); refused")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        if optional:
            return None
        raise RecordError(f"{path}: file is missing (is this a complete deepcompile run record?)") from None
    except OSError as e:
        raise RecordError(f"{path}: cannot be read: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise RecordError(f"{path}: expected a file, found a directory")
    if not stat.S_ISREG(st.st_mode):
        raise RecordError(f"{path}: is {_kind(st.st_mode)}, not a regular file; refused")
    if st.st_size > limits.max_file_bytes:
        raise _too_big(path, f"the file ({_mb(st.st_size)})", limits)
    # O_NONBLOCK: should a FIFO have been swapped in since the stat, open returns at once
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except OSError as e:
        raise RecordError(f"{path}: cannot be read: {e.strerror or e}") from None
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise RecordError(f"{path}: changed while being opened (now {_kind(fst.st_mode)}); refused")
        chunks, n = [], 0
        while n <= limits.max_file_bytes:
            b = os.read(fd, min(1 << 20, limits.max_file_bytes + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
    except OSError as e:
        raise RecordError(f"{path}: cannot be read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > limits.max_file_bytes:
        raise _too_big(path, "the file", limits)
    if path.suffix == ".gz":
        raw = _inflate(path, raw, limits)
    if budget is not None:
        budget.take(path, len(raw))
        budget.take_values(path, raw)
    return raw


def _inflate(path: Path, data: bytes, limits: Limits) -> bytes:
    """gunzip ``data`` (every member), stopping as soon as the output passes the file limit."""
    out, n, rest = [], 0, data
    try:
        while rest:
            d = zlib.decompressobj(wbits=31)  # gzip header
            buf = rest
            while True:
                want = limits.max_file_bytes + 1 - n  # >= 1: 0 would mean "no limit"
                chunk = d.decompress(buf, want)
                out.append(chunk)
                n += len(chunk)
                if n > limits.max_file_bytes:
                    raise RecordError(
                        f"{path}: {_mb(len(data))} of gzip data inflates to more than {_mb(limits.max_file_bytes)}, "
                        "the limit for one record file (refused, having inflated no more than that; if it is "
                        "genuine, raise DEEPCOMPILE_RECORD_MAX_FILE_MB)")
                if d.eof:
                    break
                buf = d.unconsumed_tail
                if not buf and len(chunk) < want:  # no input left and no output pending
                    raise EOFError("compressed data ended before the end-of-stream marker")
            rest = d.unused_data.lstrip(b"\x00")  # gzip allows zero padding between members
    except zlib.error as e:
        raise RecordError(f"{path}: truncated or corrupt gzip file ({e})") from None
    except EOFError as e:
        raise RecordError(f"{path}: truncated or corrupt gzip file ({e})") from None
    return b"".join(out)


def _decode_json(path: Path, raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RecordError(f"{path}: not UTF-8 text (corrupt file?)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        what = "truncated" if e.pos >= len(text.rstrip()) - 1 else "invalid"
        raise RecordError(f"{path}: {what} JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise RecordError(f"{path}: JSON nested too deeply (corrupt or hostile file)") from None
    except ValueError as e:  # e.g. an integer literal longer than Python's int conversion limit
        raise RecordError(f"{path}: invalid JSON: {e}") from None


def load_json(path: str | os.PathLike, *, optional: bool = False, root: str | os.PathLike | None = None,
              limits: Limits | None = None, budget: _Budget | None = None) -> Any:
    """One record file, parsed (see :func:`read_bytes` for what is refused)."""
    path = Path(path)
    limits = limits or Limits.default()
    budget = budget or _Budget(limits)
    raw = read_bytes(path, root=root, optional=optional, limits=limits, budget=budget)
    return None if raw is None else _decode_json(path, raw)


@dataclass
class GraphRecord:
    graph_id: int
    kind: str
    after: str
    seq: int
    nodes: list[dict]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    file: str = ""


@dataclass
class RunRecord:
    path: Path
    manifest: dict
    config: dict
    rank: int
    environment: dict
    graphs: list[GraphRecord]
    steps: list[dict]
    profile: dict | None
    schedule: dict | None
    memory: dict | None
    skipped_lines: int = 0

    @property
    def graph_ids(self) -> list[int]:
        return sorted({g.graph_id for g in self.graphs})

    def versions(self, graph_id: int, kind: str | None = None) -> list[GraphRecord]:
        """The versions of one graph in pass order (``input`` first), optionally of one kind."""
        return [g for g in self.graphs if g.graph_id == graph_id and (kind is None or g.kind == kind)]

    def kinds(self, graph_id: int) -> list[str]:
        out: list[str] = []
        for g in self.graphs:
            if g.graph_id == graph_id and g.kind not in out:
                out.append(g.kind)
        return out


def read_steps(path: str | os.PathLike, *, root: str | os.PathLike | None = None, limits: Limits | None = None,
               budget: _Budget | None = None) -> tuple[list[dict], int]:
    """Parsed ``steps.jsonl`` lines; a partial last line (live writer) is skipped and counted."""
    path = Path(path)
    limits = limits or Limits.default()
    raw = read_bytes(path, root=root, limits=limits, budget=budget or _Budget(limits))
    text = raw.decode("utf-8", errors="replace")
    lines = text.split("\n")
    out, skipped = [], 0
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        last = i == len(lines)  # no newline after it yet: may be mid-write
        try:
            if len(line) > 1 << 16:  # a step line is ~150 bytes; refuse before parsing a giant one
                raise ValueError(f"{len(line)} characters long")
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if last:
                skipped += 1
                continue
            raise RecordError(f"{path}: line {i} is not valid JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:
            raise RecordError(f"{path}: line {i} is not a valid step ({e or type(e).__name__})") from None
        out.append(S.check_step(str(path), i, obj))
    return out, skipped


def _root(run_dir: str | os.PathLike) -> Path:
    root = Path(run_dir)
    try:
        st = os.stat(root)
    except FileNotFoundError:
        raise RecordError(f"{root}: no such run directory") from None
    except OSError as e:
        raise RecordError(f"{root}: cannot be read: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise RecordError(f"{root}: not a directory (expected a deepcompile run directory)")
    return root


def read_run(run_dir: str | os.PathLike, rank: int = 0, *, load_graphs: bool = True,
             limits: Limits | None = None) -> RunRecord:
    """Read and validate the record of ``run_dir`` as seen by ``rank``."""
    root = _root(run_dir)
    limits = limits or Limits.default()
    budget = _Budget(limits)

    def load(p: Path, optional: bool = False):
        return load_json(p, optional=optional, root=root, limits=limits, budget=budget)

    mpath = root / S.MANIFEST
    if not os.path.lexists(mpath):
        raise RecordError(f"{mpath}: file is missing; {root} is not a deepcompile run record")
    manifest = S.check_manifest(str(mpath), load(mpath))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank not in manifest["ranks"]:
        raise RecordError(f"{mpath}: rank {rank!r} is not in this record (ranks {manifest['ranks']})")
    cpath = root / S.CONFIG
    config = S.check_config(str(cpath), load(cpath))
    rdir = root / S.rank_dir_name(rank)
    if not os.path.isdir(rdir):
        raise RecordError(f"{rdir}: rank directory is missing")
    epath = rdir / S.ENVIRONMENT
    env = S.check_environment(str(epath), load(epath))
    ipath = rdir / S.GRAPHS_DIR / S.GRAPH_INDEX
    index = S.check_graph_index(str(ipath), load(ipath))
    graphs, seen = [], set()
    for i, e in enumerate(index):
        name = plain_name(str(ipath), f"[{i}].file", e["file"])
        if name in seen:
            raise RecordError(f"{ipath}: [{i}].file: {name!r} is listed twice")
        seen.add(name)
        nodes: list[dict] = []
        if load_graphs:
            gpath = rdir / S.GRAPHS_DIR / name
            g = S.check_graph(str(gpath), load(gpath))
            if (g["graph_id"], g["kind"], g["after"]) != (e["graph_id"], e["kind"], e["after"]):
                raise RecordError(f"{gpath}: holds graph {g['graph_id']}/{g['kind']}/{g['after']} but "
                                  f"{ipath} says {e['graph_id']}/{e['kind']}/{e['after']}")
            nodes = g["nodes"]
        graphs.append(GraphRecord(e["graph_id"], e["kind"], e["after"], e["seq"], nodes,
                                  list(e.get("notes") or []), float(e.get("seconds") or 0.0), name))
    steps, skipped = read_steps(rdir / S.STEPS, root=root, limits=limits, budget=budget)

    def opt(name, check):
        p = rdir / name
        obj = load(p, optional=True)
        return None if obj is None else check(str(p), obj)

    return RunRecord(root, manifest, config, rank, env, graphs, steps,
                     opt(S.PROFILE, S.check_profile), opt(S.SCHEDULE, S.check_schedule),
                     opt(S.MEMORY, S.check_memory), skipped)


def read_all_steps(run_dir: str | os.PathLike, manifest: dict, *, limits: Limits | None = None) -> dict[int, list[dict]]:
    """Steps of every rank (the per-rank memory columns differ); a rank without a steps file has none."""
    root = _root(run_dir)
    limits = limits or Limits.default()
    budget = _Budget(limits)
    out = {}
    for r in manifest["ranks"]:
        p = root / S.rank_dir_name(r) / S.STEPS
        out[r] = read_steps(p, root=root, limits=limits, budget=budget)[0] if os.path.lexists(p) else []
    return out


# --------------------------------------------------------------------------- one memory truth
def _as_record(run: RunRecord | str | os.PathLike, rank: int) -> RunRecord:
    return run if isinstance(run, RunRecord) else read_run(run, rank, load_graphs=False)


def read_plan(run: RunRecord | str | os.PathLike, rank: int = 0) -> dict | None:
    """This rank's ``plan.json`` (the planner's choice, ``RunRecorder.plan``), validated; None
    when the run was not planned."""
    rec = _as_record(run, rank)
    p = rec.path / S.rank_dir_name(rec.rank) / S.PLAN
    obj = load_json(p, optional=True, root=rec.path)
    return None if obj is None else S.check_plan(str(p), obj)


def _fmt(n: float) -> str:
    from deepcompile.vocab.memory import fmt_bytes

    return fmt_bytes(n)


def memory_view(run: RunRecord | str | os.PathLike, rank: int = 0) -> dict:
    """The one memory truth of a run, for every view that shows memory (``deepcompile inspect``,
    the report, the inspector, Predict)::

        {"categories": MEMORY_CATEGORIES,
         "measured":  None | {"source": "measured", "label", "step", "device", "samples": [...],
                              "peak": {"bytes", "where", "t_ms", "by_category", "source"}},
         "predicted": None | {"source": "predicted", "label", "by_category", "where",
                              "peak": {"bytes", "where", "by_category", "source"}},
         "peak":      None | {"bytes", "source", "label", "where", "by_category"},
         "process":   {"label", "by_rank": {rank: bytes}},
         "trained":   None | {"bytes", "step", "label", "source": "measured"}}

    ``measured`` is the profiled step's timeline (``memory.json.gz``, samples with
    ``by_category``; x axis ``t_ms``: the step's compute time); ``predicted`` the chosen plan's
    peak by category (``plan.json``). ``peak`` is *the* peak of the run: measured when the run
    has a timeline, else predicted, with its label; show this one number wherever a peak is
    shown. ``process`` is what ``steps.jsonl`` logs per step, which is another quantity: the
    allocator's high-water mark per step on GPU (whole step, optimizer included), the process's
    resident set on CPU (the Python process, not the training state); label it as such.
    ``trained`` (GPU only): the last step's allocator peak, the measured peak of the plan that
    trains, which the prediction is checked against (``predicted["error_vs_trained"]``).

    A record from before the timeline (its memory samples carry no categories: the naive
    per-graph estimate, activations only) has no ``measured`` part."""
    from deepcompile.vocab.memory import categories_at_peak

    rec = _as_record(run, rank)
    cats = list(S.MEMORY_CATEGORIES)
    out: dict = {"categories": cats, "measured": None, "predicted": None, "peak": None}
    mem = rec.memory or {}
    samples = [s for s in mem.get("samples") or [] if "by_category" in s and "t_ms" in s]
    if samples:
        peak = mem.get("peak")
        if not peak:   # written without one: the largest sample
            top = max(samples, key=lambda s: s.get("peak_bytes", s["allocated_bytes"]))
            peak = {"bytes": top.get("peak_bytes", top["allocated_bytes"]), "t_ms": top["t_ms"],
                    "where": f"graph {top.get('graph_id')} {top.get('kind')}, node {top.get('node')}",
                    "by_category": top["by_category"], "source": "measured"}
        step = mem.get("step")
        # the timeline's step counts optimizer steps from 0 (the config's profile_step); a label
        # numbers steps as the step lines, the Steps tab and the report do (from the record's first)
        first = min((s["step"] for s in rec.steps if isinstance(s.get("step"), int)), default=1)
        label = (f"measured peak (profiled step{'' if not isinstance(step, int) else f' {first + step}'}, rank {rec.rank}, "
                 f"{mem.get('device') or 'profiler'})")
        out["measured"] = {"source": "measured", "label": label, "step": step, "device": mem.get("device"),
                           "samples": samples, "peak": dict(peak, source="measured")}
    plan = read_plan(rec)
    pm = (plan or {}).get("chosen", {}).get("memory")
    if pm:
        by, where = categories_at_peak(pm)
        by = {k: int(v) for k, v in (pm.get("by_category") or by).items()}
        where = pm.get("peak_at") or where
        pk = {"bytes": int(pm.get("peak") or sum(v for k, v in by.items() if k != "offloaded")),
              "where": where, "by_category": by, "source": "predicted"}
        out["predicted"] = {"source": "predicted", "label": f"predicted peak of the chosen plan (plan.json, {where})",
                            "by_category": by, "where": where, "peak": pk}
    best = out["measured"] or out["predicted"]
    if best is not None:
        p = best["peak"]
        out["peak"] = {"bytes": int(p["bytes"]), "source": best["source"], "label": best["label"],
                       "where": p.get("where", ""), "by_category": dict(p.get("by_category") or {})}
    by_rank = {}
    try:
        for r, ss in read_all_steps(rec.path, rec.manifest).items():
            by_rank[r] = max(((s.get("mem") or {}).get("peak", 0) for s in ss), default=0)
    except RecordError:
        by_rank = {rec.rank: max(((s.get("mem") or {}).get("peak", 0) for s in rec.steps), default=0)}
    dev = str(mem.get("device") or "")
    what = ("the allocator's high-water mark per step (GPU; the whole step, optimizer included)" if dev.startswith("cuda")
            else "the process's resident set per step (CPU; the whole Python process, not the training state)"
            if dev.startswith("cpu") else "per step: the allocator's high-water mark on GPU (optimizer included), "
            "the process's resident set on CPU")
    out["process"] = {"label": f"process memory, steps.jsonl: {what}",
                      "by_rank": by_rank}
    # On GPU the steps' peaks are the allocator's, per step: the last step's is the measured peak of
    # the plan that trains (the profiled step ran the profiling plan, node by node), the number the
    # plan's prediction is checked against.
    out["trained"] = None
    last = next((s for s in reversed(rec.steps) if (s.get("mem") or {}).get("peak")), None)
    if dev.startswith("cuda") and last is not None:
        b = int(last["mem"]["peak"])
        out["trained"] = {"bytes": b, "step": last["step"], "source": "measured",
                          "label": f"measured allocator peak of the last step ({last['step']}, steps.jsonl): the plan "
                                   "that trains"}
        if out["predicted"] is not None and b > 0:
            out["predicted"]["error_vs_trained"] = round(out["predicted"]["peak"]["bytes"] / b - 1.0, 4)
    return out


def format_peak(view: dict) -> str:
    """``memory_view``'s one peak as one line: bytes, label, where, and the categories."""
    p = view.get("peak")
    if not p:
        return "memory peak: none recorded (no profiling step and no plan)"
    cats = ", ".join(f"{k} {_fmt(v)}" for k, v in p["by_category"].items() if v)
    return f"memory peak: {_fmt(p['bytes'])}, {p['label']}, at {p['where']}" + (f" [{cats}]" if cats else "")


def run_command(run: RunRecord | str | os.PathLike) -> dict | None:
    """How the run was started (``writer.launch_command``: argv, cwd, executable, world_size,
    launcher and its env, ``relaunch`` or ``why_not``), or None when the record does not say
    (a record written without this field)."""
    if isinstance(run, RunRecord):
        m = run.manifest
    else:
        root = _root(run)
        mpath = root / S.MANIFEST
        m = S.check_manifest(str(mpath), load_json(mpath, root=root))
    c = m.get("command")
    return dict(c) if isinstance(c, dict) else None
