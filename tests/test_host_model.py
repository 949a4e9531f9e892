"""The host model follows the machine: the profiling step's host micro-benchmark (GPU only) is
recorded in the profile, agreed across ranks, and scales profile.host.HOST_US by its ratio to
the reference host's (HOST_REF); on a CPU profile host_model stays None."""
from __future__ import annotations

import pytest

from deepcompile.plan import estimate as E
from deepcompile.profile.profiler import GraphProfile, NodeProfile, Profile
from deepcompile.record import schema as S


def _gpu_profile(host: dict | None) -> Profile:
    p = Profile(graphs={(0, "forward"): GraphProfile(0, "forward", [NodeProfile("mm", 1.0, 0, 0, 4)])},
                hardware="NVIDIA H200")
    p.host = host
    return p


def test_cpu_profile_has_no_host_model_with_or_without_a_benchmark():
    p = _gpu_profile({"dispatch_us": 3.0, "python_us": 0.05})
    p.hardware = "cpu"
    assert E.host_model(p) is None and E.host_calibration(p) is None


def test_scaled_by_the_benchmark_over_the_reference(monkeypatch):
    # no reference for HOST_US's host: HOST_US as it is, and the calibration says why
    monkeypatch.setattr(E, "HOST_REF", {"dispatch_us": None, "python_us": None})
    p = _gpu_profile({"dispatch_us": 3.0, "python_us": 0.05})
    assert E.host_model(p) is E.HOST_US
    assert "no reference micro-benchmark" in E.host_calibration(p)["note"]
    assert E.host_model(_gpu_profile(None)) is E.HOST_US
    # a host whose launches take 0.75x and whose Python takes 0.5x the reference's
    monkeypatch.setattr(E, "HOST_REF", {"dispatch_us": 4.0, "python_us": 0.1})
    h = E.host_model(p)
    assert h["node"] == pytest.approx(E.HOST_US["node"] * 0.5)
    for k in ("matmul", "kernel", "reduce_grad", "allgather_params", "end_backward"):
        assert h[k] == pytest.approx(E.HOST_US[k] * 0.75), k
    cal = E.host_calibration(p)
    assert (cal["python"], cal["dispatch"]) == (0.5, 0.75) and "x0.75" in cal["note"]
    # a measurement far outside any machine's range is bounded, not believed
    p.host = {"dispatch_us": 4000.0, "python_us": 0.1}
    assert E.host_calibration(p)["dispatch"] == E.HOST_SCALE_BOUNDS[1]


def test_the_estimate_follows_the_scaled_host(monkeypatch):
    """A host-bound graph (launches slower than its kernels) takes the host's pace: half the
    launch cost, about half the graph's time."""
    nodes = [{"name": "x", "op": "placeholder", "target": "x", "args": [], "scope": "", "shape": [4, 4],
              "dtype": "float32"}]
    for i in range(50):
        nodes.append({"name": f"mm{i}", "op": "call_function", "target": "aten.mm.default",
                      "args": [{"node": "x"}, {"node": "x"}], "scope": "", "shape": [4, 4], "dtype": "float32"})
    lat = {n["name"]: 0.1 for n in nodes}
    monkeypatch.setattr(E, "HOST_REF", {"dispatch_us": 4.0, "python_us": 0.1})
    ends = {}
    for d in (4.0, 2.0):
        h = E.host_model(_gpu_profile({"dispatch_us": d, "python_us": 0.1}))
        ev, _ = E.estimate(nodes, 0, "forward", lat, host_us=h)
        ends[d] = max(e["end_us"] for e in ev if e["stream"] == "host")
    assert ends[2.0] == pytest.approx((ends[4.0] - 50 * E.HOST_US["node"]) / 2 + 50 * E.HOST_US["node"], rel=1e-6)


def test_the_record_keeps_the_calibration():
    p = _gpu_profile({"dispatch_us": 3.25, "python_us": 0.0625, "n": 2000, "reps": 5, "device": "NVIDIA H200"})
    recs = p.to_records()
    S.check_profile("profile.json.gz", {"graphs": recs})
    assert Profile.from_records({"graphs": recs}).host == p.host
    recs[0]["host"]["dispatch_us"] = -1.0
    with pytest.raises(S.RecordError, match=r"graphs\[0\]\.host\.dispatch_us"):
        S.check_profile("profile.json.gz", {"graphs": recs})


def test_host_benchmark_runs():
    from deepcompile.profile.host import host_benchmark

    b = host_benchmark("cpu", n=200, reps=3)
    assert b["dispatch_us"] > 0 and b["python_us"] > 0 and b["device"] == "cpu"


def _agree_host(rank: int, world: int):
    from deepcompile.profile.agree import agree

    p = _gpu_profile({"dispatch_us": 3.0 + rank, "python_us": 0.1 * (2 - rank), "device": "x"})
    n = p.graphs[(0, "forward")].nodes[0]
    n.latency_ms, n.mem_after_bytes, n.peak_bytes, n.out_bytes = 1.0 + rank, 10 * (2 - rank), 7, 4
    a = agree(p)
    n = a.graphs[(0, "forward")].nodes[0]
    return a.host, (n.latency_ms, n.mem_after_bytes, n.peak_bytes, n.out_bytes)


def test_ranks_agree_on_the_slowest_host():
    """The host numbers are agreed beside the nodes' measurements: neither overwrites the other
    (on 2 H200s the nodes' values were once read from the host's reduced tensor: IndexError)."""
    from tests.dist_utils import run_ranks

    (a, na), (b, nb) = run_ranks(_agree_host, 2, timeout=120)
    assert a == b and a["dispatch_us"] == 4.0 and a["python_us"] == 0.2 and a["device"] == "x"
    assert na == nb == (1.0, 20, 7, 4)  # latency: the smaller; memory: the larger


def test_the_report_says_how_the_host_model_was_calibrated(tmp_path, monkeypatch):
    from deepcompile.record.writer import RunRecorder
    from deepcompile.report.html import _section_ops
    from deepcompile.record.reader import read_run

    with RunRecorder(tmp_path / "r", 0, 1, {"compiler": "eager"}) as rec:
        rec.profile(_gpu_profile({"dispatch_us": 3.0, "python_us": 0.05}).to_records())
    monkeypatch.setattr(E, "HOST_REF", {"dispatch_us": 4.0, "python_us": 0.1})
    html = _section_ops(read_run(tmp_path / "r"), [], [], {})
    assert "host model: HOST_US scaled to this host" in html and "x0.75" in html


def test_measured_dc_ops_replace_their_entries(monkeypatch):
    """The profiling step's own host time of a dc op (dispatcher + runtime, the median call)
    replaces that op's HOST_US entry; ops charged per parameter keep the scaled constant."""
    monkeypatch.setattr(E, "HOST_REF", {"dispatch_us": None, "python_us": None})
    p = _gpu_profile({"dispatch_us": 3.0, "python_us": 0.05,
                      "ops_us": {"reduce_grad": 41.5, "gather_persistent_many": 900.0, "release_param": 0.8}})
    h = E.host_model(p)
    assert h["reduce_grad"] == 41.5 and h["release_param"] == 0.8
    assert h["gather_persistent_many"] == E.HOST_US["gather_persistent_many"]   # per-parameter: not replaced
    assert h["matmul"] == E.HOST_US["matmul"]
    S.check_profile("p", {"graphs": p.to_records()})


def _agree_ops(rank: int, world: int):
    from deepcompile.profile.agree import agree

    p = _gpu_profile({"dispatch_us": 3.0, "python_us": 0.1, "ops_us": {"reduce_grad": 40.0 + rank,
                                                                       "not_a_host_kind": 5.0}})
    return agree(p).host


def test_ranks_agree_on_measured_ops():
    from tests.dist_utils import run_ranks

    a, b = run_ranks(_agree_ops, 2, timeout=120)
    assert a == b and a["ops_us"] == {"reduce_grad": 41.0}


def test_stalled_node_latencies_are_replaced_by_their_family_median():
    """A profiling step on GPU can charge a node with another rank's spin (40 ms, or several):
    2 H200s measured a ``convert_element_type`` at 654 ms among siblings at 0.03 ms, and the
    predicted step went from 45 to 192 ms. Such a node takes its family's median; a node that is
    merely slower than its family, or a family too small to judge, keeps what was measured."""
    from deepcompile.profile.agree import drop_stalls
    from deepcompile.profile.profiler import GraphProfile, NodeProfile, Profile

    conv = [NodeProfile(f"convert_element_type_{i}", 0.03, 0, 0, 0) for i in range(10)]
    conv[4].latency_ms = 654.7      # a stall
    conv[7].latency_ms = 0.5        # slower, but below STALL_MIN_MS: kept
    mm = [NodeProfile(f"mm_{i}", 40.0, 0, 0, 0) for i in range(3)]   # long, but only 3: kept
    prof = Profile(graphs={(0, "forward"): GraphProfile(0, "forward", conv + mm)})
    found = drop_stalls(prof)
    assert [f[1] for f in found] == ["convert_element_type_4"], found
    assert conv[4].latency_ms == 0.03 and conv[7].latency_ms == 0.5
    assert all(m.latency_ms == 40.0 for m in mm)


def test_a_stall_is_judged_among_ops_of_its_own_kind_and_size_not_its_name():
    """Names do not say the op: a re-traced Llama forward names its gate and up matmuls
    ``getitem_85``/``getitem_86``. Judged among the graph's real getitems they look 100x too slow
    and would be priced at a getitem's median: the cost model would lose two of a block's seven
    matmuls.
    The vocabulary's matmul, 30x the block matmuls, is the only one of its size: kept too."""
    from deepcompile.profile.agree import drop_stalls
    from deepcompile.profile.profiler import GraphProfile, NodeProfile, Profile

    getitems = [NodeProfile(f"getitem_{i}", 0.03, 0, 0, 64, "<built-in function getitem>") for i in range(20)]
    mm = "aten.mm.default"
    gate_up = [NodeProfile(f"getitem_{85 + i}", 3.0, 0, 0, 1 << 20, mm) for i in range(4)]
    blocks = [NodeProfile(f"mm_{i}", 0.4, 0, 0, 1 << 18, mm) for i in range(8)]
    vocab = NodeProfile("mm_99", 13.0, 0, 0, 1 << 26, mm)
    stalled = NodeProfile("mm_9", 40.0, 0, 0, 1 << 18, mm)     # a block matmul charged with a spin
    prof = Profile(graphs={(0, "forward"): GraphProfile(0, "forward", getitems + gate_up + blocks + [vocab, stalled])})
    found = drop_stalls(prof)
    assert [f[1] for f in found] == ["mm_9"], found
    assert all(n.latency_ms == 3.0 for n in gate_up) and vocab.latency_ms == 13.0
    assert stalled.latency_ms == 0.4
