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
