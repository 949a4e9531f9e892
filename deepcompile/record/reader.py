"""Reading and validating a run record.

Every problem (a missing file, a truncated gzip or JSON file, a hand-edited file that fails the
schema, a record from a newer format version) raises :class:`RecordError` whose message names
the file; nothing here lets a deep traceback escape. A partially written last line of
``steps.jsonl`` (a live run mid-write) is skipped.
"""
from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepcompile.record import schema as S
from deepcompile.record.schema import RecordError

__all__ = ["RecordError", "RunRecord", "GraphRecord", "read_run", "load_json"]


def load_json(path: Path, *, optional: bool = False) -> Any:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if optional:
            return None
        raise RecordError(f"{path}: file is missing (is this a complete deepcompile run record?)") from None
    except IsADirectoryError:
        raise RecordError(f"{path}: expected a file, found a directory") from None
    except OSError as e:
        raise RecordError(f"{path}: cannot be read: {e.strerror or e}") from None
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
            raise RecordError(f"{path}: truncated or corrupt gzip file ({e or type(e).__name__})") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RecordError(f"{path}: not UTF-8 text (corrupt file?)") from None
    except json.JSONDecodeError as e:
        what = "truncated" if e.pos >= len(raw.rstrip()) - 1 else "invalid"
        raise RecordError(f"{path}: {what} JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


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


def read_steps(path: Path) -> tuple[list[dict], int]:
    """Parsed ``steps.jsonl`` lines; a partial last line (live writer) is skipped and counted."""
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        raise RecordError(f"{path}: file is missing (is this a complete deepcompile run record?)") from None
    except OSError as e:
        raise RecordError(f"{path}: cannot be read: {e.strerror or e}") from None
    lines = text.split("\n")
    out, skipped = [], 0
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        last = i == len(lines)  # no newline after it yet: may be mid-write
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if last:
                skipped += 1
                continue
            raise RecordError(f"{path}: line {i} is not valid JSON ({e.msg})") from None
        out.append(S.check_step(str(path), i, obj))
    return out, skipped


def read_run(run_dir: str | Path, rank: int = 0, *, load_graphs: bool = True) -> RunRecord:
    """Read and validate the record of ``run_dir`` as seen by ``rank``."""
    root = Path(run_dir)
    if not root.exists():
        raise RecordError(f"{root}: no such run directory")
    if not root.is_dir():
        raise RecordError(f"{root}: not a directory (expected a deepcompile run directory)")
    mpath = root / S.MANIFEST
    if not mpath.exists():
        raise RecordError(f"{mpath}: file is missing; {root} is not a deepcompile run record")
    manifest = S.check_manifest(str(mpath), load_json(mpath))
    if rank not in manifest["ranks"]:
        raise RecordError(f"{mpath}: rank {rank} is not in this record (ranks {manifest['ranks']})")
    cpath = root / S.CONFIG
    config = load_json(cpath)
    if not isinstance(config, dict):
        raise RecordError(f"{cpath}: expected a JSON object")
    rdir = root / S.rank_dir_name(rank)
    if not rdir.is_dir():
        raise RecordError(f"{rdir}: rank directory is missing")
    epath = rdir / S.ENVIRONMENT
    env = S.check_environment(str(epath), load_json(epath))
    ipath = rdir / S.GRAPHS_DIR / S.GRAPH_INDEX
    index = S.check_graph_index(str(ipath), load_json(ipath))
    graphs = []
    for e in index:
        nodes: list[dict] = []
        if load_graphs:
            gpath = rdir / S.GRAPHS_DIR / e["file"]
            g = S.check_graph(str(gpath), load_json(gpath))
            if (g["graph_id"], g["kind"], g["after"]) != (e["graph_id"], e["kind"], e["after"]):
                raise RecordError(f"{gpath}: holds graph {g['graph_id']}/{g['kind']}/{g['after']} but "
                                  f"{ipath} says {e['graph_id']}/{e['kind']}/{e['after']}")
            nodes = g["nodes"]
        graphs.append(GraphRecord(e["graph_id"], e["kind"], e["after"], e["seq"], nodes,
                                  list(e.get("notes") or []), float(e.get("seconds") or 0.0), e["file"]))
    steps, skipped = read_steps(rdir / S.STEPS)

    def opt(name, check):
        p = rdir / name
        obj = load_json(p, optional=True)
        return None if obj is None else check(str(p), obj)

    return RunRecord(root, manifest, config, rank, env, graphs, steps,
                     opt(S.PROFILE, S.check_profile), opt(S.SCHEDULE, S.check_schedule),
                     opt(S.MEMORY, S.check_memory), skipped)


def read_all_steps(run_dir: str | Path, manifest: dict) -> dict[int, list[dict]]:
    """Steps of every rank (the per-rank memory columns differ)."""
    out = {}
    for r in manifest["ranks"]:
        p = Path(run_dir) / S.rank_dir_name(r) / S.STEPS
        out[r] = read_steps(p)[0] if p.exists() else []
    return out
