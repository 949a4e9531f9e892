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

The same walk samples this rank's memory by category after every node (``profile.memory_split``
keeps the samples and builds the step's timeline; its x axis is the step's compute time: the sum
of the measured node latencies so far). The profile's data types (:class:`Profile` and its
graphs and nodes) and the optimizer step's timer (:class:`StepTimer`) live here too; the
communication micro-benchmarks are in ``profile.comm_bench``, the ranks' agreement on the profile
in ``profile.agree``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from deepcompile.compat import nn as nn_compat
from deepcompile.profile import memory_split
from deepcompile.profile.memory_split import storages
from deepcompile.runtime import state
from deepcompile.vocab.links import CommModel, ReplicateLink


@dataclass
class NodeProfile:
    name: str
    latency_ms: float
    mem_after_bytes: int
    peak_bytes: int
    out_bytes: int
    # the node's target ("aten.mm.default"): its op family. A node's name does not say its op:
    # a re-traced graph can name a matmul ``getitem_85``
    op: str = ""


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
    # optimizer state the profiled step kept on the host, streamed through its optimizer.step()
    # (api.initialize: all of it on the device would pass memory_limit_gib): off the device in the
    # measured forward and backward, its copies in optimizer_ms (see resident_optimizer_ms)
    state_streamed_bytes: int = 0
    # the GPU's busy-step clock against the profiled one (profile.sustained.measure: "ratio",
    # "node", "burst_ms", "sustained_ms"); agree() scales the matmul and attention latencies by
    # the ratio, so the recorded latencies are the busy step's. None: not measured (CPU)
    sustained: dict | None = None
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
                 **({"state_streamed_bytes": self.state_streamed_bytes} if self.state_streamed_bytes else {}),
                 **({"sustained": dict(self.sustained)} if self.sustained else {}),
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
                                 int(n.get("peak_bytes") or 0), int(n.get("out_bytes") or 0), str(n.get("op") or ""))
                     for n in r["nodes"]]
            prof.graphs[(int(r["graph_id"]), r["kind"])] = GraphProfile(int(r["graph_id"]), r["kind"], nodes)
            prof.hardware = str(r.get("hardware") or "")
            if r.get("comm"):
                prof.comm = CommModel(**r["comm"])
            if r.get("replicate"):
                prof.replicate = ReplicateLink.from_dict(r["replicate"])
            prof.optimizer_ms = float(r.get("optimizer_ms") or 0.0)
            prof.optimizer_peak_bytes = int(r.get("optimizer_peak_bytes") or 0)
            prof.state_streamed_bytes = int(r.get("state_streamed_bytes") or 0)
            prof.sustained = dict(r["sustained"]) if r.get("sustained") else None
            if r.get("host"):
                prof.host = dict(r["host"])
        return prof


def _bytes(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(_bytes(x) for x in v)
    return 0


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
        storages(v, seen)
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
        # the runtime state's samples: each dc op's host time, and the step memory (None: no model
        # to split the memory by, no timeline)
        rt = state.current() if state.active() else None
        self.host_ops: dict[str, list[float]] = rt.host_ops if rt is not None else {}
        self.step_memory = rt.step_memory if rt is not None else None
        self.memory = self.step_memory.sources() if self.step_memory is not None else None
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
            storages(v, seen)
        return sum(seen.values())

    def call_function(self, target, args, kwargs):
        if not self.cuda or not str(target).startswith("dc."):
            return super().call_function(target, args, kwargs)
        # a dc op's own host time (dispatcher + runtime; on CUDA its waits are stream waits, and
        # the GPU is kept behind, so no host blocking is in it): the host model's measured entry
        t0 = time.perf_counter()
        out = super().call_function(target, args, kwargs)
        self.host_ops.setdefault(str(target).split(".")[1], []).append((time.perf_counter() - t0) * 1e6)
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
            rec = NodeProfile(n.name, 0.0, int(st["current"]), int(st["peak"]), _bytes(out), str(n.target))
            self._events.append((rec, start, end))  # latency filled by finish()
        else:
            before = self._held()
            t0 = time.perf_counter()
            out = super().run_node(n)
            dt = (time.perf_counter() - t0) * 1e3
            ob = _bytes(out)
            after = before + ob  # the interpreter frees dead inputs after this node returns
            rec = NodeProfile(n.name, dt, after, after, ob, str(n.target))
        self.records.append(rec)
        if self.memory is not None:
            if not self.cuda and memory_split.is_gather(n):
                seen: dict = {}
                storages(out, seen)
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
        if self._known is None or (t.startswith("dc.") and t.split(".")[1] not in memory_split.GATHER_FAMILY):
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
            self.step_memory.add_graph(self.module, self.records, self._mem)
            self._mem = []
        return self.records


def take_host_ops() -> dict[str, float]:
    """The profiling step's median host time per dc op (CUDA), from the runtime state, and forget them."""
    if not state.active():
        return {}
    host_ops = state.current().host_ops
    ops = dict(host_ops)
    host_ops.clear()
    return {k: round(sorted(v)[len(v) // 2], 3) for k, v in sorted(ops.items()) if v}


class StepTimer:
    """Milliseconds from construction to ``stop()``: CUDA events on the current stream (the
    kernels' time, as the profiler's node latencies are), wall time on the CPU. The profiling
    step times its ``optimizer.step()`` with it (``Profile.optimizer_ms``, ``optimizer_peak_bytes``)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.peak_bytes = 0  # CUDA: the allocator's peak between construction and stop()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return (time.perf_counter() - self.t0) * 1e3
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        self.peak_bytes = int(torch.cuda.max_memory_allocated())
        return float(self.start.elapsed_time(end))


def profiled_callable(gm: fx.GraphModule, sink) -> callable:
    """A boxed callable that runs ``gm`` under the profiler and hands the node records to ``sink``."""
    def run(args):
        interp = ProfilingInterpreter(gm)
        out = interp.boxed_run(args)
        sink(interp.finish())
        return out
    run._boxed_call = True
    return run


