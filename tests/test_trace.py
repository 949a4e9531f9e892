"""Mapping a profiler trace to the measured schedule (streams, graph ids, overlap)."""
from deepcompile.profile.trace import overlap_summary, schedule_from_trace


def _op(name, ts, dur, tid=1):
    return {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def _launch(corr, ts, cat="cuda_runtime"):
    return {"cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": 1, "args": {"correlation": corr}}


def _kernel(corr, name, ts, dur, stream):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream, "args": {"correlation": corr}}


def test_gpu_trace_maps_kernels_to_graphs_streams_and_ops():
    trace = {"traceEvents": [
        _op("CompiledFunction", 0, 100),
        _op("dc::allgather_param", 10, 10), _op("record_param_comms", 11, 5), _launch(1, 12, "cuda_driver"),
        _op("aten::mm", 30, 10), _launch(2, 31),
        _op("CompiledFunctionBackward", 200, 100),
        _op("dc::reduce_grad", 210, 10), _launch(3, 211, "cuda_driver"),
        _op("aten::mm", 230, 5), _launch(4, 231),
        _op("Optimizer.step", 400, 50), _launch(5, 401),
        _kernel(1, "ncclDevKernel_AllGather_RING_LL", 1000, 50, 20),
        _kernel(2, "nvjet_gemm", 1030, 40, 7),           # overlaps the allgather for 20 us
        _kernel(3, "ncclDevKernel_ReduceScatter_Sum", 1200, 30, 20),
        _kernel(4, "nvjet_gemm", 1240, 10, 7),            # after the reduce: no overlap
        _kernel(5, "multi_tensor_apply_kernel", 1300, 10, 7),  # optimizer: not in a graph
    ]}
    ev = schedule_from_trace(trace)
    assert [(e["graph_id"], e["kind"], e["stream"], e["node"]) for e in ev] == [
        (0, "forward", "allgather", "dc::allgather_param"),
        (0, "forward", "compute", "aten::mm"),
        (0, "backward", "reduce", "dc::reduce_grad"),
        (0, "backward", "compute", "aten::mm"),
    ]
    assert ev[0]["start_us"] == 0.0 and all(e["source"] == "measured" for e in ev)
    s = overlap_summary(ev)
    assert s["comm_busy_us"] == 80 and s["comm_overlapped_us"] == 20
    assert abs(s["overlap_fraction"] - 0.25) < 1e-9


def test_cpu_trace_uses_leaf_host_ops():
    trace = {"traceEvents": [
        _op("CompiledFunction", 0, 100),
        _op("dc::wait_allgather", 10, 20),
        _op("aten::addmm", 40, 30), _op("aten::mm", 45, 10),  # addmm's child is the leaf
    ]}
    ev = schedule_from_trace(trace)
    assert [(e["stream"], e["node"]) for e in ev] == [("allgather", "dc::wait_allgather"), ("compute", "aten::mm")]


def test_profile_round_trip_and_cost_model_prediction():
    from deepcompile.plan.cost_model import predict
    from deepcompile.vocab.links import CommModel
    from deepcompile.profile.profiler import GraphProfile, NodeProfile, Profile

    def n(name, target, args=(), shape=(1024,), dtype="float32", op="call_function"):
        return {"name": name, "op": op, "target": target, "args": [{"node": a} for a in args],
                "shape": None if shape is None else list(shape), "dtype": dtype, "scope": ""}

    nodes = [n("x", "x", op="placeholder"), n("shard", "shard", op="placeholder", shape=(512,)),
             n("ag", "dc.allgather_param", ["shard"], shape=(0,)), n("mm0", "aten.mm.default", ["x"]),
             n("w", "dc.wait_allgather", ["ag"]), n("mm1", "aten.mm.default", ["x", "w"]),
             n("rel", "dc.release_param", ["w"], shape=None, dtype=None), n("output", "output", ["mm1"], op="output")]
    prof = Profile(graphs={(0, "forward"): GraphProfile(0, "forward", [
        NodeProfile("mm0", 0.5, 0, 0, 4096), NodeProfile("mm1", 0.25, 0, 0, 4096)])},
        comm=CommModel(alpha_us=100.0, bytes_per_us=1e3, copy_bytes_per_us=1e3), hardware="test")
    back = Profile.from_records(prof.to_records())
    assert back.graphs[(0, "forward")].nodes == prof.graphs[(0, "forward")].nodes and back.comm == prof.comm
    p = predict([{"graph_id": 0, "kind": "forward", "after": "prefetch", "nodes": nodes}], back)
    # allgather of 4 KiB: 100 us + 4.096 us, issued at t=0 and overlapped by mm0 (500 us);
    # mm1 then runs 250 us: the step is compute-bound at ~0.75 ms (+0.5 us issue overhead)
    assert abs(p["step_ms"] - 0.7505) < 0.01, p["step_ms"]
    ag = next(e for e in p["events"] if e["stream"] == "allgather")
    assert ag["start_us"] == 0 and abs(ag["end_us"] - 104.096) < 1e-3
    assert p["peak_bytes"] >= 3 * 4096  # x, the gathered weight and an output alive together


def test_measured_events_name_their_graph_nodes():
    """The k-th top-level call of an op in a graph is its k-th node with that target: measured
    bars carry the node's name (dc ops always, aten ops where the graph runs as written)."""
    trace = {"traceEvents": [
        _op("CompiledFunction", 0, 100),
        _op("dc::wait_allgather", 10, 5),
        _op("aten::addmm", 20, 20), _op("aten::mm", 25, 10),   # a child: not a graph node of its own
        _op("dc::wait_allgather", 50, 5),
        _op("aten::addmm", 60, 20),
    ]}
    nodes = [{"name": "w0", "op": "call_function", "target": "dc.wait_allgather"},
             {"name": "lin0", "op": "call_function", "target": "aten.addmm"},
             {"name": "w1", "op": "call_function", "target": "dc.wait_allgather"},
             {"name": "lin1", "op": "call_function", "target": "aten.addmm"}]
    ev = schedule_from_trace(trace, {(0, "forward"): nodes}, exact_aten=True)
    assert [(e["node"], e.get("op")) for e in ev] == [
        ("w0", "dc::wait_allgather"), ("lin0", "aten::mm"), ("w1", "dc::wait_allgather"), ("lin1", "aten::addmm")]
    # under Inductor only the dc ops are named (its kernels are not the graph's aten nodes)
    ev = schedule_from_trace(trace, {(0, "forward"): nodes}, exact_aten=False)
    assert [e["node"] for e in ev] == ["w0", "aten::mm", "w1", "aten::addmm"]
