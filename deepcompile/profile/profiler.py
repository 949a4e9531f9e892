"""The measured profile: one iteration of each rewritten graph, node by node.

A profiling step runs every graph through :class:`ProfilingInterpreter` instead of its compiled
code. That *is* the training step (its outputs and gradients are used), so nothing runs twice,
and the interpreter frees each value after its last use exactly like the compiled graph, so a
model that trains does not run out of memory while being profiled. Per node it records latency
(on GPU the stream time between two CUDA events around the node, read after the whole graph has
run; on CPU a monotonic timer), memory allocated after it and the peak during it (the CUDA
allocator on GPU; on CPU the bytes of the tensors the interpreter holds), and its output size.
Events rather than a synchronize per node: with a sync on each side the wall time of a node is
mostly the interpreter's Python and the sync itself, not the GPU work (the nodes of a ~60 ms
Llama step summed to 15 s), and a device-wide sync serialises the collectives' streams.

A micro-benchmark times allgather and reduce-scatter by message size on the actual process
group and fits the alpha-beta :class:`~deepcompile.vocab.links.CommModel`.

Profiles are agreed across ranks (element-wise maximum) before any pass reads them: a rank
that decided differently would issue different collectives and deadlock the job.

The same walk records this rank's **memory timeline** of the profiled step (not agreed: it is
per rank), split into ``vocab.memory.MEMORY_CATEGORIES``: after every node, the parameter shards
and their gradients (the model's shards and their ``.grad``), the optimizer state on the device
(``runtime.optimizer_state``), the gathered parameters alive (the runtime's transient gathers and
kept copies), what is offloaded to the host, and as activations everything else: on GPU the
allocator's total minus the known categories, on CPU the storages the interpreter holds that are
none of those. Its x axis is the step's compute time: the sum of the measured node latencies so
far (the interpreter's own overhead and the GPU spins are not in it). See
:func:`track_memory` and :func:`take_memory_timeline`.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx

from deepcompile.compat import c10d as c10d_compat
from deepcompile.compat import nn as nn_compat
from deepcompile.vocab.links import CommModel, ReplicateLink


@dataclass
class NodeProfile:
    name: str
    latency_ms: float
    mem_after_bytes: int
    peak_bytes: int
    out_bytes: int


@dataclass
class GraphProfile:
    graph_id: int
    kind: str
    nodes: list[NodeProfile]

    def by_name(self) -> dict[str, NodeProfile]:
        return {n.name: n for n in self.nodes}


@dataclass
class Profile:
    graphs: dict[tuple[int, str], GraphProfile] = field(default_factory=dict)
    comm: CommModel | None = None
    hardware: str = ""
    step: int = -1
    optimizer_ms: float = 0.0   # the profiling step's optimizer.step(), measured (part of a step)
    optimizer_peak_bytes: int = 0  # the allocator's peak during that optimizer.step() (CUDA; 0: not measured)
    memory: dict | None = None   # this rank's memory timeline of the step (take_memory_timeline); not agreed
    # the host micro-benchmark of the profiling step (profile.host.host_benchmark; GPU only): what
    # plan.estimate.host_model scales HOST_US by; agreed (the slowest rank's)
    host: dict | None = None
    # hybrid sharding (mesh.shard): the replicate group's all-reduce, measured apart from ``comm``
    # (the shard group's gathers and reduce-scatters); None without replicas
    replicate: ReplicateLink | None = None

    def get(self, graph_id: int, kind: str) -> GraphProfile | None:
        return self.graphs.get((graph_id, kind))

    def to_records(self) -> list[dict]:
        comm = None if self.comm is None else dict(self.comm.__dict__)
        rep = {} if self.replicate is None else {"replicate": self.replicate.to_dict()}
        return [{"graph_id": g.graph_id, "kind": g.kind, "hardware": self.hardware, "comm": comm, **rep,
                 "optimizer_ms": self.optimizer_ms, "optimizer_peak_bytes": self.optimizer_peak_bytes,
                 **({"host": dict(self.host)} if self.host else {}),
                 "nodes": [dict(n.__dict__) for n in g.nodes]} for g in self.graphs.values()]

    @classmethod
    def from_records(cls, records: list[dict] | dict) -> "Profile":
        """Rebuild a profile from the run record's ``profile.json.gz`` (what ``to_records`` wrote)."""
        if isinstance(records, dict):
            records = records.get("graphs", [])
        prof = cls()
        for r in records:
            nodes = [NodeProfile(n["name"], float(n.get("latency_ms") or 0.0), int(n.get("mem_after_bytes") or 0),
                                 int(n.get("peak_bytes") or 0), int(n.get("out_bytes") or 0)) for n in r["nodes"]]
            prof.graphs[(int(r["graph_id"]), r["kind"])] = GraphProfile(int(r["graph_id"]), r["kind"], nodes)
            prof.hardware = str(r.get("hardware") or "")
            if r.get("comm"):
                prof.comm = CommModel(**r["comm"])
            if r.get("replicate"):
                prof.replicate = ReplicateLink.from_dict(r["replicate"])
            prof.optimizer_ms = float(r.get("optimizer_ms") or 0.0)
            prof.optimizer_peak_bytes = int(r.get("optimizer_peak_bytes") or 0)
            if r.get("host"):
                prof.host = dict(r["host"])
        return prof


def _bytes(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(_bytes(x) for x in v)
    return 0


def _storages(v, out: dict) -> None:
    if isinstance(v, torch.Tensor) and v.device.type != "meta":
        try:
            st = v.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
        except RuntimeError:
            pass
    elif isinstance(v, (list, tuple)):
        for x in v:
            _storages(x, out)


class _HeldEnv(dict):
    """The interpreter's environment that keeps a running total of the bytes of the distinct
    storages it holds, updated as values enter and leave. Summing over the whole environment at
    every node instead was quadratic in the graph's size (3 of a 16-layer model's 5 s profiling
    step on the CPU). A storage resized in place while held (a CPU activation offload) keeps the
    size it entered with: the CPU's "device memory" is an approximation anyway."""

    def __init__(self, items, classify=None):
        super().__init__()
        self.refs: dict[int, list] = {}   # data_ptr -> [values holding it, nbytes, category]
        self.total = 0
        # bytes by what a storage is (``classify(data_ptr)``, decided when it enters): the memory
        # timeline's split of what the interpreter holds
        self.classify = classify
        self.by_kind: dict[str, int] = {}
        for k, v in items:
            self[k] = v

    def _update(self, v, step: int) -> None:
        seen: dict = {}
        _storages(v, seen)
        for ptr, nbytes in seen.items():
            r = self.refs.get(ptr)
            if r is None:
                if step < 0:
                    continue
                kind = self.classify(ptr) if self.classify is not None else "other"
                r = self.refs[ptr] = [0, nbytes, kind]
                self.total += nbytes
                self.by_kind[kind] = self.by_kind.get(kind, 0) + nbytes
            r[0] += step
            if r[0] <= 0:
                self.total -= r[1]
                self.by_kind[r[2]] -= r[1]
                del self.refs[ptr]

    def __setitem__(self, k, v) -> None:
        if k in self:
            self._update(dict.__getitem__(self, k), -1)
        dict.__setitem__(self, k, v)
        self._update(v, +1)

    def __delitem__(self, k) -> None:
        self._update(dict.__getitem__(self, k), -1)
        dict.__delitem__(self, k)


class _GpuLead:
    """Keep the GPU behind the interpreter, so that CUDA events time kernels, not Python.

    Run node by node, the host needs tens of microseconds per node, more than most of a step's
    kernels take on the GPU. A starved GPU runs each node's kernels as they arrive and the
    events around a node then measure the interpreter's dispatch: the nodes of a 76 ms
    (compiled, 2 H200s) step summed to 257 ms. So the profiler parks the compute stream in a
    spin kernel (``nn_compat.gpu_spin``) at the start of each graph, and again whenever it sees
    that the stream has nearly caught up (an event from ``CHECK_EVERY`` nodes back has already
    run): the queued nodes then run back to back and their events time only them. A spin sits
    between one node's end event and the next node's start event, so no node is charged for it.
    The spins cost the profiling step only GPU time that would have been idle.
    """
    SPIN_MS = 40.0
    CHECK_EVERY = 16
    _cycles_per_ms: float | None = None

    @classmethod
    def cycles_per_ms(cls) -> float:
        if cls._cycles_per_ms is None:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            nn_compat.gpu_spin(1000)  # warm the kernel up
            a.record()
            nn_compat.gpu_spin(2_000_000)
            b.record()
            b.synchronize()
            cls._cycles_per_ms = 2_000_000 / max(a.elapsed_time(b), 1e-3)
        return cls._cycles_per_ms

    @classmethod
    def spin(cls) -> None:
        nn_compat.gpu_spin(int(cls.SPIN_MS * cls.cycles_per_ms()))


class ProfilingInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        # a GPU step has initialised CUDA before its first graph runs; a CPU model on a GPU host
        # has not, and CUDA events would time nothing of its CPU work
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.records: list[NodeProfile] = []
        self._events: list[tuple[NodeProfile, torch.cuda.Event, torch.cuda.Event]] = []
        self.memory = _MEMORY.sources()   # None: no model to split the memory by (no timeline)
        self._mem: list[dict] = []         # per record: bytes by category after the node
        self._gathered: set[int] = set()   # storages that dc gather ops returned (CPU split)
        self._known: dict | None = None    # the categories read only at dc ops (see _split)

    def _keep_gpu_behind(self) -> None:
        k = len(self._events)
        if k == 0 or (k % _GpuLead.CHECK_EVERY == 0
                      and self._events[k - _GpuLead.CHECK_EVERY][1].query()):
            _GpuLead.spin()

    def boxed_run(self, args_list):
        if self.cuda:  # the allocator counts device memory; no environment walk needed
            return super().boxed_run(args_list)
        classify = None
        if self.memory is not None:
            shards, gathered = self.memory.shard_ptrs(), self._gathered

            def classify(ptr: int) -> str:
                return "shard" if ptr in shards else "gathered" if ptr in gathered else "other"
        env = _HeldEnv(zip([n for n in self.graph.nodes if n.op == "placeholder"], args_list), classify)
        args_list.clear()
        return self.run(initial_env=env)

    def _held(self) -> int:
        if isinstance(self.env, _HeldEnv):
            return self.env.total
        seen: dict = {}
        for v in self.env.values():
            _storages(v, seen)
        return sum(seen.values())

    def call_function(self, target, args, kwargs):
        if not self.cuda or not str(target).startswith("dc."):
            return super().call_function(target, args, kwargs)
        # a dc op's own host time (dispatcher + runtime; on CUDA its waits are stream waits, and
        # the GPU is kept behind, so no host blocking is in it): the host model's measured entry
        t0 = time.perf_counter()
        out = super().call_function(target, args, kwargs)
        HOST_OPS.setdefault(str(target).split(".")[1], []).append((time.perf_counter() - t0) * 1e6)
        return out

    def run_node(self, n: fx.Node):
        if n.op in ("placeholder", "output", "get_attr"):
            return super().run_node(n)
        if self.cuda:
            # The allocator counts at launch, so its host-side stats are exact without a sync.
            # Resetting peaks is a constant-time C++ call; the readers are not (memory_allocated()
            # and max_memory_allocated() each build and flatten the whole stats dict), so read
            # both counters from one nested dict. After the reset peak == current, hence no
            # "before" read: peak already covers it.
            self._keep_gpu_behind()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = super().run_node(n)
            end.record()
            st = torch.cuda.memory_stats_as_nested_dict()["allocated_bytes"]["all"]
            rec = NodeProfile(n.name, 0.0, int(st["current"]), int(st["peak"]), _bytes(out))
            self._events.append((rec, start, end))  # latency filled by finish()
        else:
            before = self._held()
            t0 = time.perf_counter()
            out = super().run_node(n)
            dt = (time.perf_counter() - t0) * 1e3
            ob = _bytes(out)
            after = before + ob  # the interpreter frees dead inputs after this node returns
            rec = NodeProfile(n.name, dt, after, after, ob)
        self.records.append(rec)
        if self.memory is not None:
            if not self.cuda and _is_gather(n):
                seen: dict = {}
                _storages(out, seen)
                self._gathered.update(seen)   # classified as gathered when the env takes them
            self._mem.append(self._split(n, rec))
        return out

    def _split(self, n: fx.Node, rec: NodeProfile) -> dict:
        """Bytes by category after the node (device categories sum to ``allocated``).

        Shards, gradients, optimizer state and offloaded bytes change only in dc ops (a reduce
        bucket lands, state is released or reloaded), so they are read again only there (and at
        a graph's first node): each read walks every parameter, which per node cost a 16-layer
        model's profiling step seconds of host time. The gathered bytes are read at every node
        (one runtime call): a gathered buffer is freed when the graph drops its last use."""
        m = self.memory
        t = str(n.target)
        if self._known is None or (t.startswith("dc.") and t.split(".")[1] not in _GATHER_FAMILY):
            self._known = {"parameter_shards": m.shard_bytes(), "gradients": m.grad_bytes(),
                           "optimizer_state": m.state_bytes(), "offloaded": m.offloaded_bytes(),
                           "reduce": () if self.cuda else tuple(m.reduce_storages())}
        k = self._known
        cats = {"parameter_shards": k["parameter_shards"], "gathered": m.gathered_bytes(),
                "gradients": k["gradients"], "optimizer_state": k["optimizer_state"]}
        if self.cuda:
            cats["activations"] = max(0, rec.mem_after_bytes - sum(cats.values()))
        else:
            env = self.env if isinstance(self.env, _HeldEnv) else None
            held = env.by_kind if env is not None else {}
            # a gathered value the graph holds is alive in the runtime too: the larger of the two
            cats["gathered"] = max(cats["gathered"], held.get("gathered", 0))
            other = held.get("other", 0)
            if env is not None and k.get("reduce"):
                # a gradient handed to reduce_grad is still in the environment until the node
                # returns (and while a later node uses it): counted once, as a gradient
                for ptr in k["reduce"]:
                    r = env.refs.get(ptr)
                    if r is not None and r[2] == "other":
                        other -= r[1]
            cats["activations"] = max(0, other)
        cats["offloaded"] = k["offloaded"]
        return cats

    def finish(self) -> list[NodeProfile]:
        """The node records, with CUDA latencies read from their events (one sync for the graph)."""
        if self._events:
            torch.cuda.synchronize()
            for rec, start, end in self._events:
                rec.latency_ms = start.elapsed_time(end)
            self._events.clear()
        if self.memory is not None and self._mem:
            _MEMORY.add_graph(self.module, self.records, self._mem)
            self._mem = []
        return self.records


# ---------------------------------------------------------------------------- memory timeline
_GATHER_OPS = {"wait_allgather", "wait_allgather_many", "gather_persistent", "gather_persistent_many",
               "gather_persistent_wait", "unshard"}


# dc ops that only gather or release full parameters: shards, gradients, optimizer state and
# offloaded bytes are as they were (the gathered bytes are read at every node anyway), so the
# profiling step does not walk every parameter again at each of them (three per parameter per
# graph: the walk grew with depth squared, 1.3 s of a 16-layer profiling step, 4.1 s at 32)
_GATHER_FAMILY = _GATHER_OPS | {"allgather_param", "allgather_params", "gather_persistent_start", "release_param"}


def _is_gather(n: fx.Node) -> bool:
    """A dc op whose output is a gathered (full) parameter."""
    t = str(n.target)
    return t.startswith("dc.") and t.split(".")[1] in _GATHER_OPS


def _distinct_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (views of one buffer count it once: the
    gradients of a fused reduce-scatter can share one)."""
    seen: dict = {}
    for t in tensors:
        _storages(t, seen)
    return sum(seen.values())


class MemorySources:
    """Where the training state's bytes are, readable at any point of a step: the model's
    parameter shards and their ``.grad``, the optimizer state on the device (its storages: state
    offloaded by ``offload_optimizer`` has none), the gathered parameters alive in the runtime
    (transient gathers by parameter id, and the kept copies), and the host bytes offloaded."""

    def __init__(self, model):
        self._model = weakref.ref(model)
        b = model.dc_backend
        self.gathered_by_id = {pid: m.chunk * b.world_size * torch.empty((), dtype=m.gather_dtype).element_size()
                               for pid, m in b.param_meta.items()}

    def _shards(self) -> list:
        m = self._model()
        return [sp.shard for sp in m.dc_sharded] if m is not None else []

    def shard_ptrs(self) -> set[int]:
        seen: dict = {}
        _storages(self._shards(), seen)
        return {p for p, n in seen.items() if n}

    def shard_bytes(self) -> int:
        return _distinct_bytes(self._shards())

    def grad_bytes(self) -> int:
        """The shards' ``.grad`` and the gradient memory the runtime holds (reduce buckets filling,
        reduce-scatters in flight with their outputs, HSDP all-reduces, ZeRO-1 accumulations),
        distinct storages: without the runtime's part, the allocator's rest on GPU filed the
        buckets under "activations" (and the CPU split did not count them at all)."""
        seen: dict = {}
        _storages([s.grad for s in self._shards() if s.grad is not None], seen)
        seen.update(self.reduce_storages())
        return sum(seen.values())

    @staticmethod
    def reduce_storages() -> dict[int, int]:
        """data_ptr -> bytes of the storages the runtime holds for gradients (one runtime call)."""
        from deepcompile.runtime import ops

        C = ops.C
        if C is None or not C.is_initialized() or not hasattr(C, "reduce_storages"):
            return {}
        return {int(p): int(n) for p, n in C.reduce_storages()}

    def state_bytes(self) -> int:
        from deepcompile.runtime import optimizer_state

        return _distinct_bytes(t for _, t in optimizer_state.MANAGER.state_tensors())

    def gathered_bytes(self) -> int:
        from deepcompile.runtime import ops

        C = ops.C
        if C is None or not C.is_initialized():
            return 0
        return sum(self.gathered_by_id.get(int(i), 0) for i in C.live_gathered()) + int(C.persistent_bytes())

    @staticmethod
    def offloaded_bytes() -> int:
        from deepcompile.runtime.offload import ENGINE

        return sum(p.nbytes for ps in ENGINE.pending.values() for p in ps if p.state == "offloaded")


class _StepMemory:
    """The profiled step's memory samples, graph by graph in the order they ran."""

    def __init__(self):
        self._sources: MemorySources | None = None
        self.graphs: list[tuple] = []   # (graph module ref, records, per-record categories)

    def sources(self) -> MemorySources | None:
        s = self._sources
        return s if s is not None and s._model() is not None else None

    def add_graph(self, gm, records: list[NodeProfile], cats: list[dict]) -> None:
        self.graphs.append((weakref.ref(gm), list(records), cats))


_MEMORY = _StepMemory()
# dc op name -> host microseconds of each call in the profiling step (CUDA; ProfilingInterpreter)
HOST_OPS: dict[str, list[float]] = {}


def take_host_ops() -> dict[str, float]:
    """The profiling step's median host time per dc op (CUDA), and forget them."""
    ops = dict(HOST_OPS)
    HOST_OPS.clear()
    return {k: round(sorted(v)[len(v) // 2], 3) for k, v in sorted(ops.items()) if v}


def track_memory(model) -> None:
    """Split the memory of ``model``'s profiling steps by category (``api.initialize`` calls it;
    the model is held weakly)."""
    _MEMORY._sources = MemorySources(model)
    _MEMORY.graphs = []


class _StepSplit:
    """Every step's memory peak by category, without the profiler: microseconds a step (a few
    runtime calls and dict reads; no device sync, no walk over the parameters after the first
    step). The profiled step's timeline splits memory node by node; this splits each step's
    *peak* as the step ends (``RunRecorder.step`` writes it in ``steps.jsonl``):

    - ``parameter_shards``: the shards' bytes (exact; constant, read once);
    - ``optimizer_state``: the state on the device during forward and backward (exact: read when
      the optimizer's state changes shape), ``offloaded``: the state ``offload_optimizer`` keeps
      on the host (exact, its last step's count; offloaded activations are not counted);
    - ``gathered``: the runtime's high-water mark of live gathered parameters this step (exact;
      the kept copies are in it, gathered at the forward's top);
    - ``gradients``: every trainable shard's gradient (as at the optimizer step) plus the
      runtime's reduce buckets and reduce-scatters in flight at their high-water mark (an upper
      bound: some buckets have become ``.grad`` by then);
    - ``activations``: the remainder of the allocator's peak (CUDA, ``max_memory_allocated``
      reset every step), at least 0: the activations, the temporaries and the optimizer's. The
      high-water marks of different categories need not fall at the same moment, so this is
      the rest, not a measurement of its own. On the CPU there is no allocator peak without the
      profiler: the known categories are written and ``activations`` is not."""

    def __init__(self, sources: "MemorySources"):
        self.src = sources
        self._shards: int | None = None
        self._grads: int | None = None
        self._state: tuple | None = None   # ((id(opt), len(opt.state)), bytes)

    def _state_bytes(self) -> tuple[int, int]:
        from deepcompile.runtime import optimizer_state

        mgr = optimizer_state.MANAGER
        opt = mgr.opt
        key = (id(opt), len(opt.state) if opt is not None else 0)
        if self._state is None or self._state[0] != key:
            self._state = (key, self.src.state_bytes() + self.src_offloaded_state(mgr))
        off = int(mgr.stats.get("last_offloaded_bytes", 0)) if mgr.offloaded else 0
        return max(0, self._state[1] - off), off

    @staticmethod
    def src_offloaded_state(mgr) -> int:
        # state_bytes counts storages on the device: offloaded state has none (add it back, so
        # the total is the state's size whether or not it is out when first read)
        return int(mgr.stats.get("last_offloaded_bytes", 0)) if mgr.offloaded else 0

    def split(self, peak: int, cuda: bool) -> dict | None:
        from deepcompile.runtime import ops

        m = self.src._model()
        C = ops.C
        if m is None or C is None or not C.is_initialized() or not hasattr(C, "take_step_peaks"):
            return None
        if self._shards is None:
            shards = self.src._shards()
            self._shards = _distinct_bytes(shards)
            self._grads = sum(s.numel() * s.element_size() for s in shards if s.requires_grad)
        gathered, reducing = (int(x) for x in C.take_step_peaks())
        state, off = self._state_bytes()
        cats = {"parameter_shards": self._shards, "gathered": gathered, "gradients": self._grads + reducing,
                "optimizer_state": state}
        if cuda:
            cats["activations"] = max(0, int(peak) - sum(cats.values()))
        cats["offloaded"] = off
        return {k: int(cats[k]) for k in _CATEGORY_ORDER if k in cats}


_CATEGORY_ORDER = ("parameter_shards", "gathered", "gradients", "optimizer_state", "activations", "offloaded")
STEP_SPLIT_HOW = {
    "cuda": "the step's allocator peak (max_memory_allocated, reset every step) split: shards, optimizer state, "
            "offloaded exact; gathered and the reduce buckets at their high-water marks this step (runtime "
            "counters); gradients = every shard's gradient + the buckets' high-water mark; activations = the "
            "remainder of the peak (at least 0)",
    "cpu": "the training state's categories (shards, optimizer state, offloaded exact; gathered and the reduce "
           "buckets at their high-water marks this step); activations are not measured on the CPU without the "
           "profiler (the process's resident set is the step's 'peak')",
}


def step_split(mem: dict) -> tuple[dict, str] | None:
    """This step's peak by category and how it was split (``STEP_SPLIT_HOW``), from the memory
    of the model ``track_memory`` follows; None without one. Reads and resets the runtime's
    per-step high-water marks: call it once per step, as the step ends (``RunRecorder.step``)."""
    src = _MEMORY.sources()
    if src is None:
        return None
    if getattr(src, "step_split", None) is None:
        src.step_split = _StepSplit(src)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    d = src.step_split.split(int(mem.get("peak") or 0), cuda)
    return None if d is None else (d, STEP_SPLIT_HOW["cuda" if cuda else "cpu"])


def take_memory_timeline(compiled: dict, step: int = -1, optimizer_ms: float = 0.0,
                         optimizer_peak_bytes: int = 0) -> dict | None:
    """The memory timeline of the profiling step that just ended (None without one), in the
    record's ``memory.json.gz`` form (``record.schema``), and forget it. ``compiled``: the
    backend's (graph_id, kind) -> graph module, naming the graphs that ran; the optimizer step
    adds one last sample (its measured peak on GPU; on CPU what it holds: shards, gradients, state)."""
    from deepcompile.vocab.memory import DEVICE_CATEGORIES, MEMORY_CATEGORIES

    graphs, _MEMORY.graphs = _MEMORY.graphs, []
    src = _MEMORY.sources()
    if not graphs or src is None:
        return None
    key_of = {id(gm): k for k, gm in compiled.items()}
    samples, t = [], 0.0
    for ref, records, cats in graphs:
        gm = ref()
        gid, kind = key_of.get(id(gm), (-1, "forward")) if gm is not None else (-1, "forward")
        for i, (rec, c) in enumerate(zip(records, cats)):
            t += rec.latency_ms
            alloc = sum(c[k] for k in DEVICE_CATEGORIES)
            samples.append({"t_ms": round(t, 6), "graph_id": int(gid), "kind": kind, "node": rec.name,
                            "node_index": i, "by_category": {k: int(c[k]) for k in MEMORY_CATEGORIES},
                            "allocated_bytes": int(alloc), "peak_bytes": int(max(alloc, rec.peak_bytes)),
                            "source": "measured"})
    # optimizer.step(): shards, gradients and all of the state on the device; the rest of its
    # measured peak (CUDA) is the optimizer's temporaries and what the loop still holds
    c = {"parameter_shards": src.shard_bytes(), "gathered": src.gathered_bytes(), "gradients": src.grad_bytes(),
         "optimizer_state": src.state_bytes(), "offloaded": src.offloaded_bytes()}
    known = sum(c[k] for k in DEVICE_CATEGORIES if k != "activations")
    c["activations"] = max(0, int(optimizer_peak_bytes) - known)
    t += float(optimizer_ms)
    alloc = known + c["activations"]
    samples.append({"t_ms": round(t, 6), "graph_id": -1, "kind": "optimizer", "node": "optimizer.step",
                    "node_index": 0, "by_category": {k: int(c[k]) for k in MEMORY_CATEGORIES},
                    "allocated_bytes": int(alloc), "peak_bytes": int(alloc), "source": "measured"})
    top = max(samples, key=lambda s: s["peak_bytes"])
    at = dict(top["by_category"])
    at["activations"] += top["peak_bytes"] - top["allocated_bytes"]   # the node's own temporaries
    where = ("optimizer.step()" if top["kind"] == "optimizer"
             else f"graph {top['graph_id']} {top['kind']}, node {top['node']}")
    return {"source": "measured", "step": int(step), "categories": list(MEMORY_CATEGORIES),
            "device": "cuda allocator" if torch.cuda.is_available() and torch.cuda.is_initialized()
            else "cpu (profiling interpreter + training state)",
            "samples": samples,
            "peak": {"bytes": int(top["peak_bytes"]), "where": where, "t_ms": top["t_ms"],
                     "by_category": at, "source": "measured"}}


def profiled_callable(gm: fx.GraphModule, sink) -> callable:
    """A boxed callable that runs ``gm`` under the profiler and hands the node records to ``sink``."""
    def run(args):
        interp = ProfilingInterpreter(gm)
        out = interp.boxed_run(args)
        sink(interp.finish())
        return out
    run._boxed_call = True
    return run


def _signature(g: GraphProfile) -> str:
    """The profiled graph's structure: its node names in order (a hash, small to exchange).
    Names follow the ops, so graphs traced from the same code with the same shapes' kind (all
    static, or the same dims symbolic) match; a static graph and a symbolic one do not."""
    import hashlib

    return hashlib.sha1("\n".join(n.name for n in g.nodes).encode()).hexdigest()


HOST_KEYS = ("dispatch_us", "python_us")   # Profile.host's measured numbers (agreed)


STALL_FACTOR = 20.0   # a node this many times its op family's median ...
STALL_MIN_MS = 2.0    # ... and at least this long is a stall, not the op's own time


def drop_stalls(profile: Profile) -> list[tuple]:
    """Replace stalled node latencies by their op family's median; returns what was replaced.

    The GPU profiling step parks each rank's compute stream in a spin kernel now and then
    (:class:`_GpuLead`); a collective runs only when both ranks reach it, so a wait (or the node
    that first meets the collective's stream dependency) can absorb the other rank's spin, or
    several. On 2 H200s (953M Llama, 16 layers) one profiling step had six waits at ~40 ms
    (SPIN_MS), one at 144 ms and a ``convert_element_type`` at 654 ms, where the forward's other
    1,756 nodes summed to 35 ms: the cost model predicted 161-192 ms for a 43 ms step. A node is
    taken as stalled when it is ``STALL_FACTOR`` times the median of its op family (its name
    without the trailing number: every ``convert_element_type_*``) in the same graph and at least
    ``STALL_MIN_MS``; families of fewer than 4 nodes are left as measured. Runs on the agreed
    values, so every rank replaces the same nodes."""
    import re
    import statistics

    fam = re.compile(r"_\d+$")
    out = []
    for key, g in profile.graphs.items():
        by: dict[str, list] = {}
        for n in g.nodes:
            by.setdefault(fam.sub("", n.name), []).append(n)
        for name, ns in by.items():
            if len(ns) < 4:
                continue
            med = statistics.median(n.latency_ms for n in ns)
            for n in ns:
                if n.latency_ms >= STALL_MIN_MS and n.latency_ms > STALL_FACTOR * med:
                    out.append((key, n.name, round(n.latency_ms, 3), round(med, 4)))
                    n.latency_ms = med
    if out:
        import logging

        logging.getLogger("deepcompile").info(
            "profiler: %d node latencies looked stalled (the other rank's profiler spin) and were replaced by "
            "their op family's median, e.g. %s", len(out), out[:3])
    return out


def agree(profile: Profile, group=None) -> Profile:
    """Every rank's measurements combined element-wise, so all ranks decide alike: memory by
    the maximum, node latencies by the minimum (see below).

    Graphs are matched by key and structure. Ranks can profile different graphs for the same
    model: with per-rank dynamic padding one rank may run a static graph while another runs a
    symbolic one, or recompile during the step (a new graph id). Those graphs are dropped from the
    profile on every rank, with a warning: the passes plan them as they do without a profile, and
    every rank still decides alike. The communication model and the optimizer's time are always
    agreed."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        drop_stalls(profile)
        return profile
    mine = {k: _signature(g) for k, g in profile.graphs.items()}
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    keys = sorted(k for k in every[0] if all(e.get(k) == every[0][k] for e in every))
    dropped = sorted({k for e in every for k in e} - set(keys))
    if dropped:
        import warnings

        warnings.warn(
            f"deepcompile profiler: ranks profiled different graphs for {dropped} (graph id, kind): "
            "different input shapes per rank (dynamic padding), or a recompile during the profiling "
            "step on some ranks. Those graphs are planned without a node-level profile on every rank; "
            "the communication model is still measured. Pad to lengths every rank sees in the "
            "profiling step to profile them.", stacklevel=2)
        for k in dropped:
            profile.graphs.pop(k, None)
    # Latencies are agreed by their MINIMUM (carried negated through the one MAX all-reduce),
    # memory by its maximum. A node's work is the same on every rank, but on GPU a rank's
    # wait can absorb the *other* rank's profiler spin (_GpuLead parks each rank's compute stream
    # at its own moments, and a collective runs only when both ranks reach it): 2 H200s, 953M
    # Llama, one profiling step had 29 nodes at ~40 ms (SPIN_MS) and one at 654 ms on the slower
    # rank, and the maximum made the predicted step 192 ms against a measured 43.
    flat = [x for k in keys for n in profile.graphs[k].nodes
            for x in (-n.latency_ms, float(n.mem_after_bytes), float(n.peak_bytes), float(n.out_bytes))]
    flat.append(float(profile.optimizer_peak_bytes))
    flat.append(float(profile.optimizer_ms))
    backend = dist.get_backend(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend) else torch.device("cpu")
    t = torch.tensor(flat, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    vals = t.cpu().tolist()
    i = 0
    profile.optimizer_ms = vals.pop()
    profile.optimizer_peak_bytes = int(vals.pop())
    if profile.host:   # every rank measures it on a GPU (or none does): the slowest host's pace
        from deepcompile.profile.host import HOST_US

        # a fixed list of op names on every rank (the tensor's length must match): HOST_US's kinds
        names = sorted(HOST_US)
        mine = profile.host.get("ops_us") or {}
        h = torch.tensor([float(profile.host.get(k) or 0.0) for k in HOST_KEYS]
                         + [float(mine.get(k) or 0.0) for k in names], dtype=torch.float64, device=dev)
        dist.all_reduce(h, op=dist.ReduceOp.MAX, group=group)
        hv = h.cpu().tolist()   # not `vals`: the nodes' agreed values are read from it below
        profile.host = dict(profile.host, **{k: round(v, 4) for k, v in zip(HOST_KEYS, hv)})
        if any(hv[len(HOST_KEYS):]):   # decided on the agreed values: every rank alike
            profile.host["ops_us"] = {k: round(v, 3) for k, v in zip(names, hv[len(HOST_KEYS):]) if v > 0}
    for k in keys:
        for n in profile.graphs[k].nodes:
            n.latency_ms, n.mem_after_bytes, n.peak_bytes, n.out_bytes = (
                -vals[i], int(vals[i + 1]), int(vals[i + 2]), int(vals[i + 3]))
            i += 4
    if profile.comm is not None:
        c = torch.tensor([profile.comm.alpha_us, 1.0 / profile.comm.bytes_per_us], dtype=torch.float64, device=dev)
        dist.all_reduce(c, op=dist.ReduceOp.MAX, group=group)
        a, inv_b = c.cpu().tolist()
        profile.comm = CommModel(alpha_us=a, bytes_per_us=1.0 / inv_b,
                                 copy_bytes_per_us=profile.comm.copy_bytes_per_us)
    if profile.replicate is not None:  # every rank has one under mesh.shard, none without
        rc = profile.replicate.comm
        c = torch.tensor([rc.alpha_us, 1.0 / rc.bytes_per_us], dtype=torch.float64, device=dev)
        dist.all_reduce(c, op=dist.ReduceOp.MAX, group=group)
        a, inv_b = c.cpu().tolist()
        profile.replicate = ReplicateLink(CommModel(alpha_us=a, bytes_per_us=1.0 / inv_b,
                                                    copy_bytes_per_us=rc.copy_bytes_per_us),
                                          profile.replicate.shard_world)
    drop_stalls(profile)   # on the agreed values: every rank replaces the same nodes
    return profile



def benchmark_comm(group=None, device=None, sizes=None, reps: int = 3) -> CommModel:
    """Time allgather by output size on the real process group; fit latency + bytes/bandwidth."""
    world = dist.get_world_size(group)

    def run(nbytes, device):
        n = max(world, nbytes // 2 // world * world)
        out = torch.empty(n, dtype=torch.bfloat16, device=device)
        inp = torch.ones(n // world, dtype=torch.bfloat16, device=device)
        return float(out.numel() * out.element_size()), lambda: c10d_compat.all_gather_single(out, inp, group)

    return _fit_collective(run, device, sizes, reps)


def benchmark_allreduce(group, device=None, sizes=None, reps: int = 3) -> CommModel:
    """Time ``all_reduce`` by buffer size on ``group`` (hybrid sharding's replicate group: the
    gradient all-reduce across replicas); fit latency + bytes/bandwidth, bytes being the reduced
    buffer's. Measured apart from the shard group's gathers because across nodes the two links
    differ by an order of magnitude (NVLink within a node, the network between)."""
    def run(nbytes, device):
        # the reduce dtype of the runtime's default (fp32 gradients)
        buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        return float(buf.numel() * buf.element_size()), lambda: dist.all_reduce(buf, group=group)

    return _fit_collective(run, device, sizes, reps)


def _fit_collective(run, device, sizes, reps: int) -> CommModel:
    """Time ``run(nbytes, device)``'s collective at each size (median of ``reps`` after a warm-up)
    and fit ``alpha + bytes / bandwidth`` by least squares."""
    device = device or torch.device("cpu")
    if sizes is None:
        top = 64 << 20 if device.type == "cuda" else 4 << 20
        sizes = [1 << k for k in range(16, top.bit_length())]
    xs, ys = [], []
    for nbytes in sizes:
        x, fn = run(nbytes, device)
        times = []
        for r in range(reps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r:
                times.append((time.perf_counter() - t0) * 1e6)
        xs.append(x)
        ys.append(sorted(times)[len(times) // 2])
        del fn
    if device.type == "cuda" and xs:
        # its buffers (up to 64 MiB) are no part of the training step's memory: the allocator's
        # peak starts again without them (the step's peak is read after this, steps.jsonl)
        torch.cuda.reset_peak_memory_stats()
    # least squares y = alpha + x / beta
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs) or 1.0
    slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx, 1e-12)
    alpha = max(my - slope * mx, 0.0)
    copy_bw = 2e6 if device.type == "cuda" else 5e3
    return CommModel(alpha_us=alpha, bytes_per_us=1.0 / slope, copy_bytes_per_us=copy_bw)
