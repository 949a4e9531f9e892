"""benchmarks/trace_streams.py reads a profiler trace into per-stream busy time and strips."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import trace_streams as T  # noqa: E402


def test_streams_are_labelled_and_measured(tmp_path):
    ev = [  # compute 0-10 ms and 20-30 ms; a copy out 10-20 ms while compute is idle
        {"ph": "X", "cat": "kernel", "name": "gemm", "tid": 7, "ts": 1000, "dur": 10000},
        {"ph": "X", "cat": "kernel", "name": "gemm", "tid": 7, "ts": 21000, "dur": 10000},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "tid": 21, "ts": 11000, "dur": 10000},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather", "tid": 17, "ts": 1000, "dur": 2500},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "tid": 1, "ts": 9000, "dur": 12000},
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    res = T.analyse(T.load(str(path)), bin_ms=10)
    s = res["streams"]
    assert {v["label"] for v in s.values()} == {"compute", "d2h", "nccl"}
    assert abs(s[7]["busy_ms"] - 20.0) < 1e-9 and abs(res["span_ms"] - 30.0) < 1e-9
    assert T.strip(s[7]["occupancy"]) == "# #" and T.strip(s[21]["occupancy"]) == " # "
    assert res["waits"][0]["ms"] == 12.0
    assert "d2h" in T.report(res, 10)


def test_predict_offline_on_the_committed_h200_dump(tmp_path, capsys):
    """The cost model re-run on a committed GPU run's graphs and profile (no GPU needed): fused
    kernels predict less than the node-by-node profile, the classes add up to the step, and
    the trace's kernels are filed by kind (cuDNN attention is not a matmul)."""
    import predict_offline as P

    res = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    ev = [{"ph": "X", "cat": "kernel", "name": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "tid": 7,
           "ts": 0, "dur": 3000},
          {"ph": "X", "cat": "kernel", "name": "nvjet_hsh_256x128_2x1_v_bz_coopA_NNT", "tid": 7, "ts": 3000, "dur": 6000},
          {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "tid": 17, "ts": 0, "dur": 9000}]
    trace = tmp_path / "t.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    assert P.main([str(res / "zero3_h200_2gpu_dc_default_record"),
                   "--result", str(res / "zero3_h200_2gpu_graphs.json"),
                   "--trace", str(trace), "--trace-steps", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    fused, unfused = out["fused"], out["unfused"]
    assert 0 < fused["step_ms"] < unfused["step_ms"]
    for p in (fused, unfused):
        assert abs(sum(p["by_class_ms"].values()) - p["step_ms"]) < 0.05 * p["step_ms"]
    assert fused["by_class_ms"]["matmul"] == unfused["by_class_ms"]["matmul"] > 0
    assert out["measured_step_ms"] > 0 and out["error_fused"] == round(fused["step_ms"] / out["measured_step_ms"] - 1, 3)
    assert out["traced_gpu_ms_per_step"] == {"attention": 3.0, "matmul": 6.0, "communication": 9.0,
                                             "busy_without_communication": 9.0}


def test_memory_peak_replays_the_history_and_names_what_is_live_there(tmp_path):
    """benchmarks/memory_peak.py: the peak of an allocator history is the bytes live before the
    recording plus the replayed allocations, counted down at the free *request* (as the
    allocator's counter is); what is live there is grouped by its allocating site (the first
    frame outside torch; backward when autograd's backward is on the stack)."""
    import pickle

    import memory_peak as M

    def frame(f, line, name):
        return {"filename": f, "line": line, "name": name}
    gather = [frame("/x/torch/_ops.py", 1, "__call__"), frame("/r/deepcompile/runtime/ops.py", 40, "gather")]
    grad = [frame("/r/model.py", 9, "mlp"), frame("/x/torch/autograd/function.py", 3, "backward")]
    ev = [{"action": "alloc", "addr": 1, "size": 100, "frames": gather},
          {"action": "alloc", "addr": 2, "size": 300, "frames": grad},
          {"action": "free_requested", "addr": 1, "size": 100},
          {"action": "alloc", "addr": 3, "size": 50, "frames": gather},    # 10 + 300 + 50: not the peak
          {"action": "free_completed", "addr": 1, "size": 100},
          {"action": "free_requested", "addr": 2, "size": 300},
          {"action": "free_requested", "addr": 3, "size": 50}]
    snap = {"device_traces": [ev], "dc_bench": {"allocated_at_start": 10, "fb_peak": 410}}
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap))
    res = M.analyse(pickle.loads(path.read_bytes()), top=5)
    assert res["replayed_peak_gib"] * M.G == 410 == res["measured_fb_peak_gib"] * M.G
    assert res["peak_event"] == 1 and res["peak_at"]["phase"] == "backward"
    live = {(r["phase"], r["site"]): r["bytes"] for r in res["live"]}
    assert live == {("backward", "model.py:9:mlp"): 300, ("forward/other", "ops.py:40:gather"): 100}
