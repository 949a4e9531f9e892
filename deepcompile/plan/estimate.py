"""A naive, order-based estimate of a graph's schedule and memory, from the record's node lists.

Without a profile it needs no hardware and no run, only the serialized graph, and exists so
that a record always has a schedule and a memory timeline to show (marked ``source:
"predicted"``) before a profiler has measured anything; with one (``latency_us``, ``comm``) it
is the engine of the cost model (``plan.cost_model.predict``). Assumptions:
compute ops run in graph order on the compute stream at a fixed bandwidth; ``allgather_param``
starts on the allgather stream when issued and ``wait_allgather`` blocks compute until it ends;
``reduce_grad`` runs on the reduce stream; a tensor is freed after its last user, a gathered
parameter at its ``release_param``; graph inputs stay allocated throughout.
"""
from __future__ import annotations

from typing import Any, Iterable

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8,
               "double": 8, "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "int8": 1,
               "uint8": 1, "bool": 1, "complex64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}

COMPUTE_BYTES_PER_US = 4_000.0     # ~4 GB/s effective, a laptop-CPU-ish order of magnitude
COMM_BYTES_PER_US = 1_000.0        # ~1 GB/s
OP_OVERHEAD_US = 2.0
GETITEM = ("getitem", "_operator.getitem", "operator.getitem")

from deepcompile.profile.host import HOST_US  # noqa: E402
from deepcompile.vocab.ops import op_class  # noqa: E402  (op classes: the profiler files ops by them too)
from deepcompile.vocab.links import HOST_BYTES_PER_US  # noqa: E402  (the host link optimizer offload copies over)

GPU_NAMES = ("nvidia", "tesla", "geforce", "quadro", "amd", "radeon", "instinct")


# The host micro-benchmark (``deepcompile.profile.host.host_benchmark``) on the host HOST_US
# describes: ``host_model`` scales HOST_US by this host's values over these. None: not measured
# there yet (HOST_US's host is no longer available; the next GPU run that re-derives HOST_US
# records it here from the same host), and HOST_US is used as it is.
HOST_REF: dict = {"dispatch_us": None, "python_us": None}
# dc ops whose HOST_US entry is the op's own host time, nothing per parameter: where the profiling
# step measured them (``Profile.host["ops_us"]``: each call's dispatcher + runtime time, the median;
# the same C++ code the compiled step calls), the measurement replaces the entry
HOST_MEASURED = ("reduce_grad", "allgather_param", "wait_allgather", "wait_allgather_many", "release_param",
                 "end_backward")
HOST_SCALE_BOUNDS = (0.25, 4.0)   # a ratio outside is a measurement gone wrong (a loaded host), not a machine


def host_calibration(profile: Any) -> dict | None:
    """How the profile's host differs from HOST_US's: ``{"python": r, "dispatch": r, "bench",
    "ref", "note"}`` with the ratios of the profiling step's micro-benchmark (``Profile.host``)
    to ``HOST_REF`` (1.0 where either is missing, said in ``note``), or None for a profile that
    has no host model (CPU, synthetic)."""
    hw = str(getattr(profile, "hardware", "") or "").lower()
    if not any(k in hw for k in GPU_NAMES):
        return None
    bench = getattr(profile, "host", None) or {}
    out, missing = {"bench": dict(bench), "ref": dict(HOST_REF)}, []
    lo, hi = HOST_SCALE_BOUNDS
    for k, key in (("python", "python_us"), ("dispatch", "dispatch_us")):
        b, r = bench.get(key), HOST_REF.get(key)
        if isinstance(b, (int, float)) and isinstance(r, (int, float)) and b > 0 and r > 0:
            out[k] = round(min(hi, max(lo, float(b) / float(r))), 4)
        else:
            out[k] = 1.0
            missing.append(key)
    out["note"] = ("HOST_US as measured (" + ("no micro-benchmark in this profile" if not bench else
                   "no reference micro-benchmark for HOST_US's host: estimate.HOST_REF") + ")" if missing else
                   f"HOST_US scaled to this host: wrapper Python x{out['python']:.2f}, launches x{out['dispatch']:.2f}")
    return out


def host_model(profile: Any) -> dict | None:
    """``HOST_US`` where the profile was measured on a GPU (``Profile.hardware`` is the CUDA
    device's name; its launches are asynchronous, so the host's time is a floor of its own),
    scaled to the profile's host (:func:`host_calibration`: the profiling step's micro-benchmark
    over ``HOST_REF``; "node", the wrapper's Python, by the Python ratio, every other entry by
    the launch ratio); None on the CPU, where an op's measured latency already includes its
    launch, and for synthetic profiles."""
    cal = host_calibration(profile)
    if cal is None:
        return None
    measured = {k: float(v) for k, v in ((cal["bench"].get("ops_us") or {}).items())
                if k in HOST_MEASURED and isinstance(v, (int, float)) and v > 0}
    if cal["python"] == 1.0 and cal["dispatch"] == 1.0 and not measured:
        return HOST_US
    out = {k: v * (cal["python"] if k == "node" else cal["dispatch"]) for k, v in HOST_US.items()}
    out.update(measured)
    return out


def _numel(shape: Any) -> int:
    if not isinstance(shape, list):
        return 0
    if shape and all(isinstance(s, list) for s in shape):
        return sum(_numel(s) for s in shape)
    n = 1
    for s in shape:
        if not isinstance(s, int):
            return 0  # symbolic size: unknown
        n *= s
    return n


def node_bytes(n: dict) -> int:
    """Bytes of a node's output (0 when unknown); tuple outputs counted as float32."""
    return _numel(n.get("shape")) * DTYPE_BYTES.get(n.get("dtype") or "", 4)


def _refs(a: Any, out: list[str]) -> list[str]:
    if isinstance(a, dict):
        if set(a) == {"node"}:
            out.append(a["node"])
        else:
            for v in a.values():
                _refs(v, out)
    elif isinstance(a, list):
        for v in a:
            _refs(v, out)
    return out


def inputs_of(n: dict) -> list[str]:
    return _refs([n.get("args"), n.get("kwargs")], [])


INPUTS = "_inputs"  # a node dict's inputs_of, where its maker has them at hand (plan.runner.model_nodes)


def inputs_by_name(nodes: list[dict]) -> dict[str, list[str]]:
    """``inputs_of`` of every node, by name: computed once per graph (the estimate asks it of
    each node several times, and the what-if prices the same graphs many times over)."""
    return {n["name"]: n[INPUTS] if INPUTS in n else _refs([n.get("args"), n.get("kwargs")], []) for n in nodes}


def comm_kind(n: dict) -> str | None:
    t = n.get("target", "")
    return t[3:] if n.get("op") == "call_function" and t.startswith("dc.") else None


def moved_bytes(n: dict, size: dict[str, int]) -> int:
    """Bytes an op reads and writes unfused: its output and every node input (``size`` by name)."""
    return size[n["name"]] + sum(size.get(r, 0) for r in inputs_of(n))


def memory_bound_rate(nodes: list[dict], latency_us: dict) -> float | None:
    """Bytes per microsecond at which ``nodes``' profiled memory-bound ops ran, or None.

    A compiled graph can hold compute nodes the profiled graph did not; the estimate costs those
    at this rate (aggregate, so large nodes set it rather than launch-bound small ones; matmuls
    and attention left out, their time is not bytes), not at the laptop-CPU constant, which on a
    GPU makes one unmatched large node cost tens of ms. Views cost nothing either way."""
    size = {n["name"]: node_bytes(n) for n in nodes}
    b = us = 0.0
    for n in nodes:
        if (n["op"] == "call_function" and n["name"] in latency_us
                and op_class(n.get("target", "")) == "other"):
            b += moved_bytes(n, size)
            us += latency_us[n["name"]]
    return b / us if b > 0 and us > 0 else None


def fused_us(nodes: list[dict], rate: float, ins: dict[str, list[str]] | None = None) -> dict[str, float]:
    """Microseconds of every pointwise/reduction ("other") node once Inductor has fused them.

    Inductor fuses chains of such ops into kernels that read their inputs once and write only
    what something else needs, so a node costs the bytes that cross a kernel's boundary: what
    it reads from a graph input, a matmul, attention or a collective, and what it writes if a
    graph output or such an op uses it (views are looked through; they are no kernel). On the
    953M Llama on an H200 the node-by-node profile of these ops was 23.3 ms, this 4.9 ms, and
    a trace of the compiled step 3.1 ms of Inductor kernels. Kernel launch is
    charged once per written output. ``ins``: ``inputs_by_name(nodes)`` where the caller has it."""
    ins = ins if ins is not None else inputs_by_name(nodes)
    f = _Fusion(nodes, ins)
    out: dict[str, float] = {}
    for n in nodes:
        name = n["name"]
        if f.cls[name] != "other" or n["op"] != "call_function":
            continue
        reads = sum(f.size.get(r, 0) for r in dict.fromkeys(ins[name])
                    if r in f.by_name and f.cls.get(f.base(r)) != "other")
        writes = f.size[name] if f.written(name) else 0
        out[name] = (OP_OVERHEAD_US if writes else 0.0) + (reads + writes) / rate
    return out


class _Fusion:
    """One graph as Inductor's fusion sees it (``fused_us``, ``unmaterialized_bytes``): each
    node's class, its users, and whether its value crosses a kernel boundary (is written)."""

    def __init__(self, nodes: list[dict], ins: dict[str, list[str]]):
        self.ins = ins
        self.by_name = {n["name"]: n for n in nodes}
        self.size = {n["name"]: node_bytes(n) for n in nodes}
        self.cls = {n["name"]: ("input" if n["op"] in ("placeholder", "get_attr") else
                                "output" if n["op"] == "output" else
                                "view" if n.get("target") in GETITEM else op_class(n.get("target", "")))
                    for n in nodes}
        self.users: dict[str, list[str]] = {}
        for n in nodes:
            for r in ins[n["name"]]:
                self.users.setdefault(r, []).append(n["name"])

    def base(self, name: str) -> str:
        while self.cls.get(name) == "view":
            src = [r for r in self.ins[name] if r in self.by_name]
            if not src:
                break
            name = src[0]
        return name

    def written(self, name: str) -> bool:
        """A user outside pointwise/reduction ops (a matmul, attention, a collective, the graph's
        output) reads it, directly or through views: the value leaves its kernel."""
        for u in self.users.get(name, []):
            c = self.cls.get(u)
            if c == "view":
                if self.written(u):
                    return True
            elif c != "other":
                return True
        return False

    def readers(self, name: str) -> list[str]:
        """Every node that reads the value, through views."""
        out = []
        for u in self.users.get(name, []):
            out.append(u)
            if self.cls.get(u) == "view":
                out += self.readers(u)
        return out


def unmaterialized_bytes(nodes: list[dict], order: list[str]) -> list[int]:
    """Per node of ``order`` (the profiled graph's node names, in the order it ran), the bytes
    the node-by-node profile held there for values a fused compile never writes: a pointwise or
    reduction op's output that only such ops read (``fused_us``'s unwritten values), from the
    node that makes it to its last reader. The profile runs each op alone, so it holds every one
    of them; Inductor computes them inside the kernel that reads them. On the Llama-3-8B shape at
    8k context the profile's peak is in the backward of the cross-entropy over the 128256-wide
    logits, and counting those values puts the planned peak 15% over the measured one."""
    f = _Fusion(nodes, inputs_by_name(nodes))
    at = {name: i for i, name in enumerate(order)}
    delta = [0] * (len(order) + 1)
    for n in nodes:
        name = n["name"]
        if n["op"] != "call_function" or f.cls[name] != "other" or name not in at or f.written(name):
            continue
        b = f.size[name]
        ends = [at[u] for u in f.readers(name) if u in at]
        if b <= 0 or not ends:
            continue
        delta[at[name]] += b
        delta[max(ends) + 1] -= b
    out, held = [], 0
    for d in delta[:-1]:
        held += d
        out.append(held)
    return out


def unmaterialized_by_graph(profile, nodes: dict) -> dict:
    """``unmaterialized_bytes`` of every profiled graph that ``nodes`` ((graph id, kind) -> the
    graph's node dicts, the version the profile measured) has: what ``facts_from_profile`` takes."""
    return {k: unmaterialized_bytes(nodes[k], [n.name for n in g.nodes])
            for k, g in profile.graphs.items() if k in nodes}


def estimate(nodes: list[dict], graph_id: int, kind: str, latency_us: dict | None = None,
             comm: Any = None, rate: float | None = None, fused: bool = False,
             fused_cost: dict[str, float] | None = None, host_us: dict | None = None,
             replicate: Any = None) -> tuple[list[dict], list[dict]]:
    """(schedule events, memory samples by node index) for one graph version.

    ``latency_us`` (node name -> measured microseconds) and ``comm`` (a CommModel) replace the
    fixed bandwidth assumptions where a profile exists: that is the cost model's prediction.
    ``rate``: bytes/us for compute nodes without a latency (default: ``memory_bound_rate`` of
    ``nodes`` and ``latency_us``). ``fused``: the graph is compiled by Inductor, so pointwise
    and reduction ops cost what ``fused_us`` says instead of their unfused profiled latency.
    ``fused_cost``: that dict where the caller has it (the passes after zero3 move and replace
    only collectives, so a graph's fused costs hold for every re-plan of it: the what-if
    computes them once per record); nodes it lacks are costed as without it.
    ``host_us`` (``HOST_US``; GPU profiles): the host's launch time per op; a kernel cannot start
    before the host has launched it, so a host-bound graph takes the host's time (an event on
    the "host" stream spans it).
    """
    by_name = {n["name"]: n for n in nodes}
    size = {n["name"]: node_bytes(n) for n in nodes}
    ins = inputs_by_name(nodes)
    last_use: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for r in ins[n["name"]]:
            last_use[r] = i
    waits_of: dict[str, list[dict]] = {}
    unpacked: dict[str, int] = {}  # a multi-output op -> bytes of the values its getitems take out
    for m in nodes:
        if m.get("target") in ("dc.wait_allgather", "dc.wait_allgather_many", "dc.gather_persistent_wait"):
            for r in ins[m["name"]]:
                waits_of.setdefault(r, []).append(m)
        if m.get("target") in GETITEM:
            for r in ins[m["name"]]:
                unpacked[r] = unpacked.get(r, 0) + size[m["name"]]

    if rate is None:
        rate = memory_bound_rate(nodes, latency_us) if latency_us else None
    rate = rate or COMPUTE_BYTES_PER_US
    if not fused:
        fused_cost = {}
    elif fused_cost is None:
        fused_cost = fused_us(nodes, rate, ins)

    def comm_us(nbytes: float) -> float:
        return comm.allgather_us(nbytes) if comm is not None else OP_OVERHEAD_US + nbytes / COMM_BYTES_PER_US
    events: list[dict] = []
    samples: list[dict] = []
    t = 0.0
    # One queue for the gathers and the reduce-scatters: the runtime issues both on one process
    # group, whose collectives NCCL runs in issue order on one stream (gloo: in order on its
    # thread). A gather issued after a reduce starts when the reduce ends. Two free-running
    # clocks (one per kind) priced a backward that gathers again as if its gathers and its
    # reduces shared nothing: 2 H200s over host memory (NCCL_P2P_DISABLE), plan without kept
    # parameters, predicted 96.8 ms against 117.9 measured (-18%); one queue: 130.5 (+11%, the
    # same side as every other plan's error there). ``comm_free``: when the queue is free.
    comm_free = 0.0
    # hybrid sharding (``replicate``: a vocab.links.ReplicateLink): each bucket's all-reduce across
    # replicas starts when its reduce-scatter ends, on its own stream at its own link's speed
    rep_free = 0.0
    ag_end: dict[Any, float] = {}
    live: dict[str, int] = {}
    baseline = 0
    peak = 0

    def ev(name, stream, a, b):
        events.append({"graph_id": graph_id, "kind": kind, "node": name, "stream": stream,
                       "start_us": round(a, 3), "end_us": round(b, 3), "source": "predicted"})

    def issue(name: str, t: float, nbytes: float) -> float:
        # Issuing a collective takes the compute stream 0.5 us, and, where a profile exists, the
        # time its memory traffic takes there: hidden under compute it is still not free, its
        # kernels write (allgather) or read (reduce) its bytes in the device memory the compute
        # kernels beside it also need (at the profiled memory-bound rate).
        d = 0.5 + (nbytes / rate if comm is not None else 0.0)
        ev(name, "compute", t, t + d)
        return t + d

    h = 0.0  # the host's clock: when it has launched everything so far
    outs: dict[str, int] = {}
    if host_us is not None:
        for m in nodes:
            if m.get("target") in GETITEM:
                for r in ins[m["name"]]:
                    outs[r] = outs.get(r, 0) + 1

    for i, n in enumerate(nodes):
        name, op = n["name"], n["op"]
        c = comm_kind(n)
        if host_us is not None and op == "call_function" and n.get("target") not in GETITEM:
            cls = "comm" if c else op_class(n.get("target", ""))
            if cls != "view":
                h += host_us["node"]
                if c:
                    h += host_us.get(c, 0.0)
                    if c == "reduce_grads":  # one add_grad per gradient it hands over
                        h += host_us.get("per_grad", 0.0) * len((n.get("args") or [None, []])[1] or [])
                    if c in ("gather_persistent", "gather_persistent_many", "allgather_params"):
                        h += host_us["per_param"] * outs.get(name, 1)
                    elif c == "gather_persistent_start":  # (a handle: its parameters are its ids)
                        h += host_us["per_param"] * _n_ids(n)
                elif cls in ("matmul", "attention"):
                    h += host_us[cls]
                elif not fused or fused_cost.get(name, 0.0) >= OP_OVERHEAD_US:
                    h += host_us["kernel"]  # a kernel of its own (fused: the ops that write an output)
                t = max(t, h)  # the GPU cannot run what the host has not launched
        if op in ("placeholder", "get_attr"):
            baseline += size[name]
        elif c == "gather_persistent_start" and kind == "backward":
            ev(name, "compute", t, t + 0.1)  # kept since the forward: nothing to gather
        elif c in ("allgather_param", "allgather_params", "gather_persistent_start"):
            # gather_persistent_start: a group of kept parameters (selective_unshard.group_mb),
            # issued near the top, on the allgather stream in issue order like prefetch's;
            # its gather_persistent_wait blocks compute until it ends (a later micro-batch finds
            # them kept, which this per-graph estimate does not know apart from the first)
            ws = waits_of.get(name, [])
            nbytes = sum(unpacked.get(w["name"]) or node_bytes(w) for w in ws) if ws else size[name]
            start = max(t, comm_free)
            end = start + comm_us(nbytes)
            ev(name, "allgather", start, end)
            comm_free = end
            ag_end[name] = end
            live[name] = nbytes  # the gathered buffers exist from the issue on
            t = issue(name, t, nbytes)
        elif c in ("gather_persistent", "gather_persistent_many"):
            # kept parameters: one collective in the forward, waited at once; the backward finds
            # them in the runtime's cache (as do later micro-batches, which this per-graph
            # estimate does not know apart from the first)
            if kind == "backward":
                ev(name, "compute", t, t + 0.1)
            else:
                nbytes = unpacked.get(name, size[name])
                start = max(t, comm_free)
                end = start + comm_us(nbytes)
                ev(name, "allgather", start, end)
                comm_free = end
                ev(name, "compute", t, max(end, t + 0.1))  # the wait: compute stalls until it ends
                t = max(t, end)
            if name not in unpacked:
                live[name] = size[name]  # (the getitems of a multi-output one hold its values)
        elif c in ("wait_allgather", "wait_allgather_many", "gather_persistent_wait"):
            # wait_allgather_many: one wait for a whole coalesced group (prefetch); its getitems
            # take out the members' values, each released on its own (a kept group's, never)
            src = next((r for r in ins[name] if r in ag_end), None)
            start = t
            t = max(t, ag_end.get(src, t))
            ev(name, "compute", start, max(t, start + 0.1))
            mine = unpacked.get(name, size[name]) if c != "wait_allgather" else size[name]
            if src in live:  # hand this parameter's share of the buffer to the wait
                live[src] = max(0, live[src] - mine)
                if not live[src]:
                    live.pop(src)
            if name not in unpacked:
                live[name] = size[name]
        elif c in ("reduce_grad", "reduce_grads"):  # (reduce_grads: a bucket's gradients at once)
            nbytes = sum(size.get(r, 0) for r in ins[name])
            start = max(t, comm_free)
            end = start + comm_us(nbytes)
            ev(name, "reduce", start, end)
            comm_free = end
            if replicate is not None:
                r0 = max(end, rep_free)
                rep_free = r0 + replicate.allreduce_us(nbytes)
                ev(name, "replicate", r0, rep_free)
            t = issue(name, t, nbytes)
        elif c == "end_backward":
            # the backward ends when the last reduce has: the reduce stream's own timeline, not
            # the profiled wait (which also timed the profiler's own synchronisation)
            ev(name, "compute", t, max(t, comm_free, rep_free, t + 0.1))
            t = max(t, comm_free, rep_free)
        elif c == "release_param":
            for r in ins[name]:
                live.pop(r, None)
        elif op == "call_function" or op == "call_module" or op == "call_method":
            if n.get("target") in GETITEM or op_class(n.get("target", "")) == "view":
                d = 0.0  # unpacks a multi-output op's result / makes a view: no kernel
            elif name in fused_cost:
                d = fused_cost[name]
            elif latency_us is not None and name in latency_us:
                d = latency_us[name]
            else:
                d = OP_OVERHEAD_US + moved_bytes(n, size) / rate
            ev(name, "compute", t, t + d)
            t += d
            live[name] = size[name]
        # free what is dead after this node (not gathered params: release_param frees those)
        for r in ins[name]:
            if last_use.get(r) == i and r in live and comm_kind(by_name[r]) != "wait_allgather":
                live.pop(r, None)
        alloc = baseline + sum(live.values())
        peak = max(peak, alloc)
        samples.append({"node_index": i, "node": name, "graph_id": graph_id, "kind": kind,
                        "allocated_bytes": int(alloc), "reserved_bytes": int(peak),
                        "source": "predicted"})
    if host_us is not None and h > 0:
        ev("host launches", "host", 0.0, h)
    return events, samples


def _n_ids(n: dict) -> int:
    """How many parameter ids a multi-parameter runtime op's node names (its second argument)."""
    args = n.get("args") or []
    ids = args[1] if len(args) > 1 else None
    return len(ids) if isinstance(ids, list) else 1


def static_costs(profile: Any, versions: list[dict], base: dict, fused: bool) -> tuple:
    """(latency_us, rate, fused_cost) of ``base`` (one graph's version, ``versions`` all of
    that graph's): what ``estimate_versions`` derives per graph from the profile. The passes
    after zero3 change only collectives, so these hold for every re-plan of ``base``; the
    what-if computes them once per record and hands them in as ``static``."""
    gp = profile.get(base["graph_id"], base["kind"]) if profile is not None else None
    lat, rate = matched_latency_us(gp, versions, base) if gp is not None else (None, None)
    r = rate or (memory_bound_rate(base["nodes"], lat) if lat else None) or COMPUTE_BYTES_PER_US
    return lat, r, (fused_us(base["nodes"], r) if fused else None)


def estimate_versions(versions: Iterable[Any], profile: Any = None, fused: bool = False,
                      static: dict | None = None) -> tuple[list[dict], list[dict]]:
    """Estimate the *last* version of every (graph_id, kind) among ``versions``
    (GraphVersion objects or dicts), skipping Dynamo's pre-split graphs. With a
    ``deepcompile.profile.profiler.Profile`` the estimate uses measured latencies and the
    measured communication model. ``fused``: those versions are compiled by Inductor (see
    ``estimate``). ``static``: (graph_id, kind) -> ``static_costs`` of the graph the last
    version was planned from (else derived here)."""
    last: dict[tuple[int, str], Any] = {}
    every: dict[tuple[int, str], list] = {}
    for v in versions:
        d = v if isinstance(v, dict) else vars(v)
        if d["kind"] != "dynamo":
            last[(d["graph_id"], d["kind"])] = d
            every.setdefault((d["graph_id"], d["kind"]), []).append(d)
    events, samples = [], []
    for (gid, kind), d in sorted(last.items(), key=lambda kv: (kv[0][0], kv[0][1] != "forward")):
        lat, comm, rate, fcost = None, None, None, None
        if static is not None and (gid, kind) in static:
            lat, rate, fcost = static[(gid, kind)]
        elif profile is not None:
            gp = profile.get(gid, kind)
            if gp is not None:
                lat, rate = matched_latency_us(gp, every[(gid, kind)], d)
        if profile is not None:
            comm = profile.comm
            if kind == "backward" and (gid, "forward") in last:
                lat = {**(lat or {}), **recomputed_latency_us(profile.get(gid, "forward"), every[(gid, "forward")],
                                                              last[(gid, "forward")], d)}
        e, s = estimate(d["nodes"], gid, kind, lat, comm, rate, fused, fcost, host_model(profile),
                        replicate=getattr(profile, "replicate", None))
        events += e
        samples += s
    return events, samples


def profiled_version(gp: Any, versions: list[dict]) -> dict | None:
    """Among ``versions`` of one (graph_id, kind), in the order they were compiled, the one the
    profile ``gp`` measured: the first that has a node of every profiled name (the profile
    leaves out placeholders and the output; None when the record lacks it). The first, because
    a later re-compile can reuse every one of those names for other ops; a version before the
    profiled one that has them all is the same trace, before a pass that added nothing."""
    names = {x.name for x in gp.nodes}
    return next((v for v in versions if names <= {n["name"] for n in v["nodes"]}), None)


def matched_latency_us(gp: Any, versions: list[dict], final: dict) -> tuple[dict[str, float], float | None]:
    """The profiled latencies (us) that belong to ``final``'s nodes, by node name, and the
    profiled graph's ``memory_bound_rate``.

    The final graph is traced anew at the re-compile (under Inductor's decompositions), so a
    name can stand for another op than in the profiled graph (its ``add`` may be a ``permute``):
    a latency is taken only where the profiled graph's node of that name has the same target.
    Without the profiled graph (a record that lacks it) every name is trusted."""
    lat = {x.name: x.latency_ms * 1e3 for x in gp.nodes}
    profiled = profiled_version(gp, versions)
    if profiled is None:
        return lat, None
    target = {n["name"]: n.get("target") for n in profiled["nodes"]}
    return ({n["name"]: lat[n["name"]] for n in final["nodes"]
             if n["name"] in lat and target.get(n["name"]) == n.get("target")},
            memory_bound_rate(profiled["nodes"], lat))


def recomputed_latency_us(gp_forward: Any, forward_versions: list[dict], forward: dict,
                          backward: dict) -> dict[str, float]:
    """{backward node name: profiled µs} for the nodes ``recompute_activations`` copied from the
    forward (``recompute_of``): each runs what its forward node ran, which the profile measured
    in the forward; the backward's profile never saw it (its name there, if any, is another op's).
    Taken where the forward node has a latency and the same target."""
    if gp_forward is None:
        return {}
    lat, _ = matched_latency_us(gp_forward, forward_versions, forward)
    target = {n["name"]: n.get("target") for n in forward["nodes"]}
    return {n["name"]: lat[n["recompute_of"]] for n in backward["nodes"]
            if n.get("recompute_of") in lat and target.get(n["recompute_of"]) == n.get("target")}




def offload_ms(offloaded: int, overlap_ms: float, streamed: bool = False) -> float:
    """What offloading ``offloaded`` bytes of optimizer state adds to a step. The copies out run
    after the optimizer step, under the next forward: only what exceeds the compute shows. The
    copies back are counted whole: the planner asks ``offload_optimizer`` for
    ``final_reload: fit``, so what backward could not take back under the limit comes back in the
    optimizer step's pre-hook, exposed. (With the end-of-backward reload of everything, the 953M
    Llama on 2 H200s peaked at 9.46 GiB against a 9.07 GiB limit: the end of backward holds the
    gradients, and the state came back beside them.)"""
    copy_ms = offloaded / HOST_BYTES_PER_US / 1e3
    if streamed:
        # (``offload_optimizer.step`` 'streamed') every byte comes in and goes out inside the
        # optimizer step, the two directions beside each other and beside the step's kernels,
        # which take far less than the copies: the step lasts about one direction's copy
        return copy_ms
    return copy_ms + max(0.0, copy_ms - overlap_ms)
