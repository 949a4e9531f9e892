"""The plan cache: a re-run of the same job skips the warm-up, the profiling step and
the planner, and compiles the planned passes at step 0.

The default plan spends its first steps deciding: step 0 traces and runs the graphs as Python,
step 1 is profiled, then the planner picks pass parameters from the agreed profile and step 2
compiles them. All of that is a function of things that do not change between two runs of the
same job, so the first run stores its agreed profile and its plan, and a re-run that finds them
compiles the planned passes with the final compiler at step 0 (one Dynamo trace, one AOTAutograd
trace, and with warm Inductor caches Inductor's FX graph cache hits).

**The key** (:func:`PlanCache.key_parts`) is everything the plan depends on: the first Dynamo
graph's code and its inputs' shapes, strides and dtypes (the micro-batch, the shards' sizes); the
whole config (pass lists and hand-set parameters, memory limit, stages, buckets, accumulation), with
``plan_cache``, ``collective_timeout_s``, ``progress`` and ``aot_cache`` left out; the world size and the shard
group's; the process group's backend; the device's name and capacity; the optimizer's class and options that
change its state (amsgrad, foreach, fused...); the ``DEEPCOMPILE_*`` switches that change the
collectives; torch's version and a digest of deepcompile's own source. Later Dynamo graphs
(graph breaks) are compared when they compile: one that differs from the stored run's loses its
profile (planned as without one) and the entry is deleted.

**Ranks agree** before anything is compiled: the first graph's compile does one
``all_gather_object`` of (key, hit or why not, plan digest) on the model's group; the plan is taken
from the cache only if every rank found the same entry, else every rank runs the default plan.
Every rank reaches that point (every rank compiles graph 0 at step 0), so it cannot deadlock.

**The memory limit** is checked again at the hit: the stored plan's predicted peak must fit the
limit computed now (configured limit or 90% of capacity, lowered to what is free), and a plan that
was made under a limit lowered by memory in use is re-planned when at least 10% more is free now.

**Files**: one JSON file per rank (``plan-<key>-r<rank>of<world>.json``: its own memory timeline
is per rank), written atomically (``record.writer.atomic_write``); a corrupt, truncated or foreign file
is ignored with a warning. Where: config ``plan_cache``: ``true`` (default) under Inductor's cache
directory (``$TORCHINDUCTOR_CACHE_DIR``, else ``<tmp>/torchinductor_<user>``, as torch computes it),
in ``deepcompile_plans/``, so clearing Inductor's cache clears the plans too; a path: that
directory; ``false``: off. Each store keeps the directory to the newest ``MAX_FILES`` entry files
(the oldest written go first) and removes temp files of writes that crashed.

Not cached: plans that offload optimizer state (``offload_optimizer`` sizes itself from the
optimizer's state, which exists only after the first optimizer step), runs whose dims became
dynamic before the planned compile, and anything but the default-plan shape (one profiling step,
the planned compile as the last scheduled one).

**AOTAutograd's cache** (config ``aot_cache``): a hit compiles the stored plan at step 0 with
AOTAutograd's cache on, salted with this entry's key and ``aot_nonce`` (a fresh token per stored
plan). The planning run seeds that entry itself from its trace-once compile
(``backend.Backend._seed_aot_cache``), so the first re-run already skips the trace.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import tempfile
import time
import warnings
import weakref

FORMAT = 1
LOG = logging.getLogger("deepcompile")
MORE_FREE = 1.10  # a plan made under a limit lowered by used memory is redone when this much more is free
MAX_FILE_BYTES = 512 << 20

_SOURCE_DIGEST: str | None = None
_NOT_PLAN_DIRS = ("report", "record", "widgets", "models")
_NOT_PLAN_FILES = ("cli.py", "__main__.py", "checkpoint.py")


def default_dir() -> str:
    """``$DEEPCOMPILE_PLAN_CACHE_DIR`` if set (where, not whether: the test suite gives each test its
    own), else Inductor's cache directory, as torch computes it (2.11, 2.13: ``torch._inductor.
    runtime.cache_dir_utils.default_cache_dir``), with our sub-directory. Re-computed here rather
    than imported: it is a private module, and these two lines are all it does."""
    if os.environ.get("DEEPCOMPILE_PLAN_CACHE_DIR"):
        return os.environ["DEEPCOMPILE_PLAN_CACHE_DIR"]
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not base:
        import getpass

        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
        base = os.path.join(tempfile.gettempdir(), "torchinductor_" + user)
    return os.path.join(base, "deepcompile_plans")


def link_settings() -> dict:
    """NCCL's settings from the environment (all ``NCCL_*`` but its logging): they choose the
    transport (``NCCL_P2P_DISABLE=1`` sends NVLink traffic through host memory), so the links a
    plan was priced on; a plan is never reused over other links."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_") and not k.startswith("NCCL_DEBUG")}


def source_digest() -> str:
    """A digest of deepcompile's Python source that can change a plan: a changed pass, planner,
    profiler or runtime must not reuse a plan made by the old code (the version string does not
    move during development). The report, record, widgets, CLI, checkpoint code and the bundled
    models are left out (a model's code reaches the key through its Dynamo graph)."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        h = hashlib.sha256()
        for dirpath, dirnames, files in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__"
                                 and not (dirpath == root and d in _NOT_PLAN_DIRS))
            for f in sorted(files):
                if f.endswith(".py") and not (dirpath == root and f in _NOT_PLAN_FILES):
                    p = os.path.join(dirpath, f)
                    h.update(os.path.relpath(p, root).encode())
                    with open(p, "rb") as fh:
                        h.update(fh.read())
        _SOURCE_DIGEST = h.hexdigest()[:16]
    return _SOURCE_DIGEST


def graph_digest(gm, example_inputs) -> str:
    """The Dynamo graph's code and its inputs' metadata (shape, stride, dtype, device type)."""
    import torch

    # rank r runs on cuda:r, and Dynamo writes the device of a tensor it creates into the code
    # (``device(type='cuda', index=1)``): on 2 H200s every rank's key differed and every warm
    # re-run missed ("rank 1: another key"). The index is the rank's own, not part of the job.
    code = re.sub(r"index=\d+", "index=_", gm.code)
    code = re.sub(r"(['\"](?:cuda|xpu|hpu|mps)):\d+(['\"])", r"\1\2", code)
    h = hashlib.sha256(code.encode())
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            h.update(repr((tuple(x.shape), tuple(x.stride()), str(x.dtype), x.device.type,
                           bool(x.requires_grad))).encode())
        else:
            h.update(repr((type(x).__name__, str(x))).encode())
    return h.hexdigest()[:32]


def _optimizer_facts(model) -> dict:
    opt = model.dc_state.runtime.optimizer_state.opt
    if opt is None:
        return {}
    groups = getattr(opt, "dc_user_param_groups", None) or opt.param_groups
    # options that change the state's size or the step's temporaries; not lr, betas, decay
    return {"class": f"{type(opt).__module__}.{type(opt).__qualname__}",
            "groups": [[len(g["params"])] + sorted((k, v) for k, v in g.items()
                                                   if k != "params" and (isinstance(v, bool) or v is None))
                       for g in groups]}


# files kept in a plan directory: a job's entry is one file per rank, so this is a few hundred
# jobs; beyond it the least recently written go (a plan is cheap to make again, a disk that fills
# up under Inductor's cache directory is not)
MAX_FILES = 512
STALE_TMP_S = 3600.0  # a temp file this old is a crashed write


def prune(directory: str, keep: int = MAX_FILES, protect: tuple[str, ...] = ()) -> list[str]:
    """Delete the oldest ``plan-*.json`` files (and the graph versions stored beside the
    AOTAutograd cache, ``aotgraphs-*.json``) beyond ``keep`` (by modification time) and temp
    files of writes that never finished; never a file in ``protect``. Returns what was deleted.
    Best effort: another rank or job may delete or write beside us."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    now, plans, gone = time.time(), [], []
    for n in names:
        path = os.path.join(directory, n)
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            continue
        # record.writer.atomic_write's temp file (``.NAME.tmpPID``) of a write that never finished
        if n.startswith((".plan-", ".aotgraphs-")) and ".tmp" in n and now - mtime > STALE_TMP_S:
            gone.append(path)
        elif n.startswith(("plan-", "aotgraphs-")) and n.endswith(".json") and path not in protect:
            plans.append((mtime, path))
    plans.sort()
    n_keep = max(keep - len(protect), 0)
    gone += [p for _, p in plans[:max(len(plans) - n_keep, 0)]]
    deleted = []
    for path in gone:
        try:
            os.unlink(path)
            deleted.append(path)
        except OSError:
            pass
    return deleted


class PlanCache:
    """One model's plan cache: decides hit or miss at the first graph's compile (every rank alike),
    applies a hit, stores the plan after a miss. ``hit`` is read by the backend and the model."""

    def __init__(self, model, directory: str):
        self._model = weakref.ref(model)
        self.dir = directory
        self.hit = False
        self.decided = False
        self.key: str | None = None
        self.parts: dict = {}
        self.graphs: list[str] = []      # this run's Dynamo graph digests, in compile order (step 0)
        self.expected: list[str] = []    # the stored run's (on a hit)
        self.path: str | None = None
        self.why: str = ""               # why it missed (for the record)
        self.stored: str | None = None
        self.warnings: list[str] = []    # what this cache warned about, on this rank
        # names this plan in AOTAutograd's cache (backend._plan_salt): made fresh by the run that
        # plans, kept in its entry; a re-plan makes another, so an AOTAutograd entry compiled for
        # one plan is never found under another
        self.aot_nonce: str | None = None

    def _warn(self, msg: str, stacklevel: int) -> None:
        self.warnings.append(msg)
        warnings.warn(msg, stacklevel=stacklevel + 1)

    @classmethod
    def create(cls, model) -> "PlanCache | None":
        """None when the config turns the cache off or its plan is not the default-plan shape
        (a profiling step, then the planned compile as the last scheduled re-compile)."""
        cfg = model.dc_config
        setting = getattr(cfg, "plan_cache", True)
        if setting is False or not cfg.plan or cfg.zero_stage != 3 or cfg.profile_step is None or not cfg.schedule:
            return None
        if cfg.schedule[-1].step <= cfg.profile_step:
            return None
        return cls(model, default_dir() if setting is True else os.path.abspath(os.path.expanduser(str(setting))))

    # ------------------------------------------------------------------ key
    def key_parts(self, first_graph: str) -> dict:
        import torch
        import torch.distributed as dist

        from deepcompile.version import __version__
        from deepcompile.plan.device_memory import local_memory

        model = self._model()
        cfg = model.dc_config.to_dict()
        for k in ("plan_cache", "collective_timeout_s", "progress", "aot_cache"):
            cfg.pop(k, None)
        device = model._dc_device()
        cap, _ = local_memory(device, model.dc_config.device_memory_gib)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        return {"format": FORMAT, "graph0": first_graph, "config": cfg,
                "world": dist.get_world_size(model.dc_state.group), "shard_world": dist.get_world_size(model.dc_state.shard_group),
                "backend": str(dist.get_backend(model.dc_state.group)), "device": name, "capacity_bytes": int(cap),
                "optimizer": _optimizer_facts(model), "links": link_settings(),
                "torch": torch.__version__, "deepcompile": __version__, "source": source_digest()}

    def files(self) -> str:
        """This entry's files, ``{rank}`` standing for the rank: what ``model.dc_plan["cache"]`` names,
        the same on every rank (the plan is; tests compare it across ranks)."""
        import torch.distributed as dist

        w = dist.get_world_size(self._model().dc_state.group)
        return os.path.join(self.dir, f"plan-{self.key}-r{{rank}}of{w}.json")

    def file_for(self, key: str) -> str:
        model = self._model()
        import torch.distributed as dist

        r, w = dist.get_rank(model.dc_state.group), dist.get_world_size(model.dc_state.group)
        return os.path.join(self.dir, f"plan-{key}-r{r}of{w}.json")

    # ------------------------------------------------------------------ the backend's hook
    def on_graph(self, backend, graph_id: int, gm, example_inputs) -> None:
        """Called by the backend for every Dynamo graph compiled while its step is 0, before it
        picks a compiler: the first decides (collective), the others are recorded or checked."""
        digest = graph_digest(gm, example_inputs)
        if not self.decided:
            self._decide(backend, digest)
        if not self.hit:
            self.graphs.append(digest)
            return
        if graph_id < len(self.expected) and digest != self.expected[graph_id]:
            # every rank compiles the same graph here and sees the same difference: no agreement needed
            dropped = [k for k in list(backend.profile.graphs) if k[0] == graph_id]
            for k in dropped:
                backend.profile.graphs.pop(k, None)
            self._warn(f"deepcompile plan cache: Dynamo graph {graph_id} differs from the stored run's "
                       f"({self.path}); it is compiled with the cached plan but without its profile, and the "
                       "entry is deleted so that the next run plans afresh", stacklevel=2)
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _decide(self, backend, digest: str) -> None:
        import torch.distributed as dist

        t0 = time.perf_counter()
        model = self._model()
        self.decided = True
        self.aot_nonce = secrets.token_hex(8)  # this run's, unless a stored plan is applied below
        entry, why, fits = None, "", ""
        try:
            self.parts = self.key_parts(digest)
            self.key = hashlib.sha256(json.dumps(self.parts, sort_keys=True, default=str).encode()).hexdigest()[:24]
            self.path = self.file_for(self.key)
            entry, why = self._load(self.path)
            if entry is not None:
                fits = self._fits(model, entry["plan"])
        except Exception as ex:  # noqa: BLE001 - this rank must still reach the agreement below, or the others hang
            entry, why = None, f"lookup failed ({type(ex).__name__}: {ex})"
            self._warn(f"deepcompile plan cache: {why}; planning afresh", stacklevel=3)
        mine = (self.key, entry["digest"] if entry is not None and not fits else None, why or fits)
        every = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(model.dc_state.group) > 1:
            every = [None] * dist.get_world_size(model.dc_state.group)
            dist.all_gather_object(every, mine, group=model.dc_state.group)
        ok = all(e[0] == every[0][0] and e[1] is not None and e[1] == every[0][1] for e in every)
        if not ok:
            reasons = [f"rank {r}: {e[2] or ('another key' if e[0] != every[0][0] else 'another plan')}"
                       for r, e in enumerate(every) if e[1] is None or e[0] != every[0][0] or e[1] != every[0][1]]
            self.why = "; ".join(reasons)
            if entry is not None or any(e[1] is not None for e in every):
                # some rank had a usable entry and another not: worth saying (a lost file, a changed rank)
                self._warn(f"deepcompile plan cache: not every rank has the stored plan ({self.why}); every "
                           "rank profiles and plans afresh", stacklevel=3)
            else:
                LOG.info("deepcompile plan cache: miss (%s)", self.why)
            return
        self._apply(backend, model, entry, time.perf_counter() - t0)

    def _fits(self, model, plan: dict) -> str:
        """'' when the stored plan still fits the memory limit computed now, else why not."""
        from deepcompile.plan.memory import GIB
        from deepcompile.plan.device_memory import DEFAULT_LIMIT_FRACTION, local_memory
        from deepcompile.plan.planner import ALLOCATOR_SLACK

        cfg = model.dc_config
        cap, avail = local_memory(model._dc_device(), cfg.device_memory_gib)
        lim = cfg.memory_limit_gib * GIB if cfg.memory_limit_gib else DEFAULT_LIMIT_FRACTION * cap
        now = min(lim, avail)
        peak = int(plan["chosen"]["peak_bytes"])
        if peak > now + ALLOCATOR_SLACK:
            return (f"the stored plan's predicted peak {peak / GIB:.2f} GiB is above the limit now "
                    f"({now / GIB:.2f} GiB)")
        was = int(plan["limit_bytes"])
        if "lowered" in str(plan.get("limit_source", "")) and now > MORE_FREE * was:
            return (f"the stored plan was made under {was / GIB:.2f} GiB (memory in use then), "
                    f"{now / GIB:.2f} GiB is free now")
        return ""

    def _load(self, path: str) -> tuple[dict | None, str]:
        """(entry, '') or (None, why not); a file that is there but unreadable warns."""
        from deepcompile.passes import PASSES, zero3
        from deepcompile.passes.registry import PassEntry, lowering_index, make_params
        from deepcompile.profile.profiler import Profile

        if not os.path.exists(path):
            return None, "no stored plan"
        try:
            if os.path.getsize(path) > MAX_FILE_BYTES:
                raise ValueError(f"{os.path.getsize(path)} bytes, more than a plan")
            with open(path) as f:
                e = json.load(f)
            if not isinstance(e, dict) or e.get("format") != FORMAT or e.get("key") != self.key:
                raise ValueError("another format or key")
            planned = [PassEntry(name=str(p["name"]), params=dict(p["params"])) for p in e["planned"]]
            for p in planned:
                if p.name not in PASSES:
                    raise ValueError(f"unknown pass {p.name!r}")
                make_params(p)   # validated now, not half-way through the compile
            names = [p.name for p in planned]
            if zero3.NAME not in names[lowering_index(names, zero3.NAME):][:1]:
                raise ValueError(f"the planned pass list does not start with {zero3.NAME}")
            prof = Profile.from_records(e["profile"])
            prof.step = int(e.get("profile_step", -1))
            prof.memory = e.get("memory")
            plan = e["plan"]
            int(plan["chosen"]["peak_bytes"]), int(plan["limit_bytes"])
            if not isinstance(e["graphs"], list) or not isinstance(e["digest"], str):
                raise ValueError("no graph list or digest")
            chunk = e.get("chunk_mb")
            chunk = None if chunk is None else float(chunk)
            nonce = e.get("aot_nonce")
            if nonce is not None and not (isinstance(nonce, str) and nonce.isalnum() and len(nonce) <= 64):
                raise ValueError(f"aot_nonce {nonce!r} is not a short alphanumeric string")
        except Exception as ex:  # noqa: BLE001 - anything wrong with the file: ignore it, say so
            self._warn(f"deepcompile plan cache: ignoring {path}: {type(ex).__name__}: {ex} "
                       "(corrupt or written by another version); planning afresh", stacklevel=4)
            return None, f"unreadable stored plan ({type(ex).__name__})"
        return {"planned": planned, "profile": prof, "plan": plan, "graphs": list(e["graphs"]),
                "digest": e["digest"], "chunk_mb": chunk, "written_utc": e.get("written_utc"),
                "aot_nonce": nonce}, ""

    def _apply(self, backend, model, entry: dict, seconds: float) -> None:
        """Compile the stored plan from now on: the backend's passes and profile, the model's
        plan (its record entry says it came from this file), the optimizer's chunks."""
        self.hit = True
        self.expected = entry["graphs"]
        self.aot_nonce = entry.get("aot_nonce")  # None: an entry from before it (the pass list names the plan)
        backend.passes = entry["planned"]
        backend.profile = entry["profile"]
        chunks = model.dc_state.optim_chunks
        if chunks is not None and model.dc_config.optimizer_chunk_mb == "auto":
            chunks.set_chunk_mb(entry["chunk_mb"] or 0.0)
        plan = dict(entry["plan"])
        plan["cache"] = {"hit": True, "file": self.files(), "key": self.key, "planned_at_step": plan.get("step")}
        plan["step"], plan["seconds"] = 0, round(seconds, 3)
        plan["why"] = f"from the plan cache ({self.files()}): " + str(plan.get("why", ""))
        model.dc_state.plan = plan
        backend.add_phase("planner", seconds, 0)
        LOG.info("deepcompile plan cache: hit %s", self.path)

    # ------------------------------------------------------------------ after a miss
    def store(self, model, planned: list, dynamic_changed: bool = False) -> None:
        """Write this rank's entry after the planner ran (the planned compile is the last one)."""
        from deepcompile.passes import PASSES

        plan = model.dc_plan
        b = model.dc_backend
        why = None
        if self.hit or not self.decided or plan is None or self.key is None:
            why = "nothing planned here, or no key"
        elif model.dc_state.step != model.dc_config.schedule[-1].step:
            why = "not the last scheduled compile"
        elif dynamic_changed:
            why = "dims became dynamic before the planned compile"
        elif uncached := [e.name for e in planned if not PASSES[e.name].plan_cacheable]:
            why = f"the plan runs {', '.join(uncached)}, whose parameters a later run's step 0 cannot reuse"
        elif b.profile is None or not self.graphs:
            why = "no profile or no graph"
        if why is not None:
            if plan is not None and not self.hit:
                plan["cache"] = {"hit": False, "why": self.why, "stored": None, "not_stored": why}
            return
        prof = b.profile
        planned_d = [{"name": e.name, "params": dict(e.params)} for e in planned]
        records = prof.to_records()
        chunks = model.dc_state.optim_chunks
        chunk = plan["chosen"].get("optimizer_chunk_mb") if chunks is not None else None
        digest = hashlib.sha256(json.dumps([planned_d, records, chunk], sort_keys=True, default=str).encode()
                                ).hexdigest()[:24]
        entry = {"format": FORMAT, "key": self.key, "key_parts": self.parts, "graphs": self.graphs,
                 "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "profile": records, "profile_step": prof.step, "memory": prof.memory,
                 "plan": {k: v for k, v in plan.items() if k != "cache"}, "planned": planned_d,
                 "chunk_mb": chunk, "digest": digest, "aot_nonce": self.aot_nonce}
        try:
            from deepcompile.record.writer import atomic_write

            os.makedirs(self.dir, exist_ok=True)
            # dumps, not dump: json.dump streams through the pure-Python encoder (CPython's C
            # encoder serves one-shot dumps only); a 16-layer entry took ~1 s that way on the H200 host
            atomic_write(self.path, json.dumps(entry).encode())
        except (OSError, TypeError, ValueError) as ex:
            self._warn(f"deepcompile plan cache: could not write {self.path}: {ex}; the next run plans "
                       "afresh (config plan_cache: a writable directory, or false)", stacklevel=3)
            plan["cache"] = {"hit": False, "why": self.why, "stored": None, "not_stored": str(ex)}
            return
        self.stored = self.path
        plan["cache"] = {"hit": False, "why": self.why, "stored": self.files(), "key": self.key}
        pruned = prune(self.dir, protect=(self.path,))
        if pruned:
            LOG.info("deepcompile plan cache: removed %d old entries from %s", len(pruned), self.dir)
