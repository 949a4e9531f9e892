"""The profiled step's memory, split by category (``vocab.memory.MEMORY_CATEGORIES``).

Where the training state's bytes are at any point of a step (:class:`MemorySources`): the
parameter shards and their gradients (the model's shards and their ``.grad``, and the gradient
memory the runtime holds), the optimizer state on the device (the runtime state's
optimizer-state manager), the gathered parameters alive (the runtime's transient gathers and kept
copies), and what is offloaded to the host; on GPU activations are the allocator's total minus
the known categories, on CPU the storages the profiling interpreter holds that are none of those.

From them: the profiling step's **memory timeline** (:func:`take_memory_timeline`, node by node,
the profiling interpreter sampling each node; per rank, not agreed), and every step's peak split
by category as the step ends (:func:`step_split`, no profiler). The samples live in the runtime
state (``step_memory``, set by :func:`track_memory`).
"""
from __future__ import annotations

import weakref

import torch
import torch.fx as fx

from deepcompile.vocab.memory import MEMORY_CATEGORIES


def storages(v, out: dict) -> None:
    """Add each storage under ``v`` (a tensor, or lists and tuples of them) to ``out``: data_ptr -> bytes."""
    if isinstance(v, torch.Tensor) and v.device.type != "meta":
        try:
            st = v.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
        except RuntimeError:
            pass
    elif isinstance(v, (list, tuple)):
        for x in v:
            storages(x, out)


_GATHER_OPS = {"wait_allgather", "wait_allgather_many", "gather_persistent", "gather_persistent_many",
               "gather_persistent_wait", "unshard"}


# dc ops that only gather or release full parameters: shards, gradients, optimizer state and
# offloaded bytes are as they were (the gathered bytes are read at every node anyway), so the
# profiling step does not walk every parameter again at each of them (three per parameter per
# graph: the walk grew with depth squared, 1.3 s of a 16-layer profiling step, 4.1 s at 32)
GATHER_FAMILY = _GATHER_OPS | {"allgather_param", "allgather_params", "gather_persistent_start", "release_param"}


def is_gather(n: fx.Node) -> bool:
    """A dc op whose output is a gathered (full) parameter."""
    t = str(n.target)
    return t.startswith("dc.") and t.split(".")[1] in _GATHER_OPS


def distinct_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (views of one buffer count it once: the
    gradients of a fused reduce-scatter can share one)."""
    seen: dict = {}
    for t in tensors:
        storages(t, seen)
    return sum(seen.values())


class MemorySources:
    """Where the training state's bytes are, readable at any point of a step: the model's
    parameter shards and their ``.grad``, the optimizer state on the device (its storages: state
    offloaded by ``offload_optimizer`` has none), the gathered parameters alive in the runtime
    (transient gathers by parameter id, and the kept copies), and the host bytes offloaded."""

    def __init__(self, model, runtime):
        self._model = weakref.ref(model)
        self.runtime = runtime   # runtime.state.RuntimeState: the optimizer state and the offloaded bytes
        b = model.dc_backend
        self.gathered_by_id = {pid: m.chunk * b.world_size * torch.empty((), dtype=m.gather_dtype).element_size()
                               for pid, m in b.param_meta.items()}

    def _shards(self) -> list:
        m = self._model()
        return [sp.shard for sp in m.dc_state.sharded] if m is not None else []

    def shard_ptrs(self) -> set[int]:
        seen: dict = {}
        storages(self._shards(), seen)
        return {p for p, n in seen.items() if n}

    def shard_bytes(self) -> int:
        return distinct_bytes(self._shards())

    def grad_bytes(self) -> int:
        """The shards' ``.grad`` and the gradient memory the runtime holds (reduce buckets filling,
        reduce-scatters in flight with their outputs, HSDP all-reduces, ZeRO-1 accumulations),
        distinct storages: without the runtime's part, the allocator's rest on GPU filed the
        buckets under "activations" (and the CPU split did not count them at all)."""
        seen: dict = {}
        storages([s.grad for s in self._shards() if s.grad is not None], seen)
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
        return distinct_bytes(t for _, t in self.runtime.optimizer_state.state_tensors())

    def gathered_bytes(self) -> int:
        from deepcompile.runtime import ops

        C = ops.C
        if C is None or not C.is_initialized():
            return 0
        return sum(self.gathered_by_id.get(int(i), 0) for i in C.live_gathered()) + int(C.persistent_bytes())

    def offloaded_bytes(self) -> int:
        pending = self.runtime.offload.pending
        return sum(p.nbytes for ps in pending.values() for p in ps if p.state == "offloaded")


class StepMemory:
    """The profiled step's memory samples, graph by graph in the order they ran, and where the
    training state's bytes are (the runtime state's ``step_memory``)."""

    def __init__(self, sources: MemorySources):
        self._sources: MemorySources | None = sources
        self.graphs: list[tuple] = []   # (graph module ref, records, per-record categories)

    def sources(self) -> MemorySources | None:
        s = self._sources
        return s if s is not None and s._model() is not None else None

    def add_graph(self, gm, records: list, cats: list[dict]) -> None:
        self.graphs.append((weakref.ref(gm), list(records), cats))


def track_memory(runtime, model) -> None:
    """Split the memory of ``model``'s profiling steps by category, in ``runtime`` (its runtime
    state; ``api.initialize`` calls it; the model is held weakly)."""
    runtime.step_memory = StepMemory(MemorySources(model, runtime))


def current_step_memory() -> StepMemory | None:
    """The step memory of this process's runtime state (None without a state or a tracked model)."""
    from deepcompile.runtime import state

    return state.current().step_memory if state.active() else None


def current_sources() -> MemorySources | None:
    """Where the tracked model's bytes are (None: no model to split the memory by)."""
    sm = current_step_memory()
    return sm.sources() if sm is not None else None


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
        mgr = self.src.runtime.optimizer_state
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
            self._shards = distinct_bytes(shards)
            self._grads = sum(s.numel() * s.element_size() for s in shards if s.requires_grad)
        gathered, reducing = (int(x) for x in C.take_step_peaks())
        state, off = self._state_bytes()
        cats = {"parameter_shards": self._shards, "gathered": gathered, "gradients": self._grads + reducing,
                "optimizer_state": state}
        if cuda:
            cats["activations"] = max(0, int(peak) - sum(cats.values()))
        cats["offloaded"] = off
        return {k: int(cats[k]) for k in MEMORY_CATEGORIES if k in cats}


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
    src = current_sources()
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
    from deepcompile.vocab.memory import DEVICE_CATEGORIES

    sm = current_step_memory()
    if sm is None:
        return None
    graphs, sm.graphs = sm.graphs, []
    src = sm.sources()
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
