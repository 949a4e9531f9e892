"""The run record: written by a real 2-rank demo, read back, and rejected clearly when broken."""
from __future__ import annotations

import gzip
import json
import shutil

import pytest

from deepcompile.record import schema as S
from deepcompile.record.reader import RecordError, read_run
from deepcompile.record.writer import RunRecorder


def test_demo_record_reads_back(demo_run):
    m = json.loads((demo_run / "manifest.json").read_text())
    assert m["format_version"] == S.FORMAT_VERSION == 1
    assert m["status"] == "complete" and m["world_size"] == 2 and m["ranks"] == [0, 1]
    for rank in (0, 1):
        rec = read_run(demo_run, rank)
        assert rec.config["compiler"] == "aot_eager" and rec.config["zero_stage"] == 3
        assert rec.environment["world_size"] == 2 and rec.environment["rank"] == rank
        assert rec.environment["torch"]
        assert [s["step"] for s in rec.steps] == [1, 2, 3]
        assert all(s["time_s"] > 0 and s["mem"]["peak"] > 0 for s in rec.steps)
        assert rec.steps[-1]["loss"] < rec.steps[0]["loss"]
        assert rec.graph_ids == [0]
        assert rec.kinds(0) == ["dynamo", "forward", "backward"]
        for kind in ("forward", "backward"):
            vs = rec.versions(0, kind)
            assert [v.after for v in vs] == ["input", "zero3"]
            assert not any(n["target"].startswith("dc.allgather") for n in vs[0].nodes)
            assert any(n["target"] == "dc.allgather_param" for n in vs[1].nodes)
            assert all({"name", "op", "target", "args", "scope"} <= set(n) for n in vs[1].nodes)
        bw = rec.versions(0, "backward")[-1]
        assert any(n["target"] in ("dc.reduce_grad", "dc.reduce_grads") for n in bw.nodes)
        assert rec.schedule and {e["stream"] for e in rec.schedule["events"]} >= {"compute", "allgather", "reduce"}
        assert rec.memory and rec.memory["samples"]
        assert rec.profile is None  # no profiler yet: the slot stays absent


@pytest.fixture
def copy(demo_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(demo_run, dst)
    return dst


def _err(run, rank=0) -> str:
    with pytest.raises(RecordError) as ei:
        read_run(run, rank)
    return str(ei.value)


def test_truncated_gzip_graph(copy):
    f = sorted((copy / "rank0" / "graphs").glob("g0-forward-01-*.json.gz"))[0]
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    msg = _err(copy)
    assert str(f) in msg and "truncated" in msg


def test_truncated_json(copy):
    f = copy / "rank0" / "graphs" / "index.json"
    f.write_text(f.read_text()[:-20])
    msg = _err(copy)
    assert str(f) in msg and "JSON" in msg


def test_hand_edited_file_fails_schema(copy):
    f = copy / "rank0" / "graphs" / "index.json"
    idx = json.loads(f.read_text())
    idx[1]["kind"] = "sideways"
    f.write_text(json.dumps(idx))
    msg = _err(copy)
    assert str(f) in msg and "[1].kind" in msg and "sideways" in msg

    g = sorted((copy / "rank0" / "graphs").glob("g0-backward-01-*.json.gz"))[0]
    obj = json.loads(gzip.decompress(g.read_bytes()))
    idx[1]["kind"] = "forward"
    f.write_text(json.dumps(idx))
    del obj["nodes"][3]["target"]
    g.write_bytes(gzip.compress(json.dumps(obj).encode()))
    msg = _err(copy)
    assert str(g) in msg and "nodes[3].target" in msg


def test_newer_format_version(copy):
    f = copy / "manifest.json"
    m = json.loads(f.read_text())
    m["format_version"] = S.FORMAT_VERSION + 1
    f.write_text(json.dumps(m))
    msg = _err(copy)
    assert str(f) in msg and "newer" in msg and "upgrade" in msg


@pytest.mark.parametrize("rel", ["rank0/environment.json", "config.json", "rank0/steps.jsonl",
                                 "manifest.json"])
def test_missing_file(copy, rel):
    (copy / rel).unlink()
    msg = _err(copy)
    assert str(copy / rel) in msg and "missing" in msg


def test_bad_steps_line_and_partial_last_line(copy):
    f = copy / "rank1" / "steps.jsonl"
    good = f.read_text()
    f.write_text(good + '{"step": 4, "time_s": 0.1, "lo')  # live writer mid-line
    rec = read_run(copy, 1)
    assert len(rec.steps) == 3 and rec.skipped_lines == 1
    f.write_text('{"step": 1, "time_s": 0.1, "lo\n' + good)  # a broken line that is not the last
    msg = _err(copy, 1)
    assert str(f) in msg and "line 1" in msg
    f.write_text(good + '{"step": "four", "time_s": 0.1}\n')
    msg = _err(copy, 1)
    assert str(f) in msg and "line 4.step" in msg


def test_not_a_run_dir(tmp_path):
    assert "no such run directory" in _err(tmp_path / "nope")
    assert "not a deepcompile run record" in _err(tmp_path)


def test_writer_live_and_slots(tmp_path):
    rec = RunRecorder(tmp_path / "r", 0, 1, {"compiler": "eager"}, env={
        "torch": "x", "python": "3", "hostname": "h", "world_size": 1, "rank": 0, "devices": []})
    rec.graph_version({"graph_id": 0, "kind": "forward", "after": "input", "nodes": [
        {"name": "x", "op": "placeholder", "target": "x", "args": [], "scope": ""}]})
    rec.step(1, 0.5, 2.0, {"allocated": 1, "reserved": 2, "peak": 3})
    live = read_run(tmp_path / "r")  # readable while running
    assert live.manifest["status"] == "running" and len(live.steps) == 1
    rec.profile({"graph_id": 0, "kind": "forward", "hardware": "cpu",
                 "nodes": [{"name": "x", "latency_ms": 0.1, "mem_after_bytes": 4, "peak_bytes": 4, "out_bytes": 4}]})
    with pytest.raises(RecordError, match="stream"):
        rec.schedule([{"graph_id": 0, "kind": "forward", "node": "x", "stream": "warp", "start_us": 0,
                       "end_us": 1, "source": "measured"}])
    rec.schedule([{"graph_id": 0, "kind": "forward", "node": "x", "stream": "compute", "start_us": 0,
                   "end_us": 1, "source": "measured"}], replace=True)
    rec.memory([{"t_us": 0.0, "allocated_bytes": 1, "reserved_bytes": 2}])
    rec.close()
    done = read_run(tmp_path / "r")
    assert done.manifest["status"] == "complete"
    assert done.profile["graphs"][0]["nodes"][0]["latency_ms"] == 0.1
    assert done.schedule["events"][0]["stream"] == "compute"
    assert done.memory["samples"][0]["allocated_bytes"] == 1


def test_estimate_prices_unprofiled_nodes_at_the_profiled_rate():
    from deepcompile.plan.estimate import COMPUTE_BYTES_PER_US, OP_OVERHEAD_US, estimate

    x = {"name": "x", "op": "placeholder", "target": "x", "shape": [1024, 1024], "dtype": "float32"}
    a = {"name": "a", "op": "call_function", "target": "aten.relu", "shape": [1024, 1024], "dtype": "float32",
         "args": [{"node": "x"}]}
    b = {"name": "b", "op": "call_function", "target": "aten.neg", "shape": [1024, 1024], "dtype": "float32",
         "args": [{"node": "a"}]}
    mb = 4 << 20
    events, _ = estimate([x, a, b], 0, "forward", latency_us={"a": 10.0})  # a moved 8 MiB in 10 us
    d = {e["node"]: e["end_us"] - e["start_us"] for e in events}
    assert d["a"] == pytest.approx(10.0)
    assert d["b"] == pytest.approx(OP_OVERHEAD_US + 2 * mb / (2 * mb / 10.0), abs=1e-3)
    assert d["b"] < (2 * mb) / COMPUTE_BYTES_PER_US / 100
    # without a profile the fixed constant still applies
    events, _ = estimate([x, a, b], 0, "forward")
    d = {e["node"]: e["end_us"] - e["start_us"] for e in events}
    assert d["b"] == pytest.approx(OP_OVERHEAD_US + 2 * mb / COMPUTE_BYTES_PER_US, abs=1e-3)
    # unpacking a multi-output op (selective_unshard's gather_persistent_many) moves nothing
    g = {"name": "g", "op": "call_function", "target": "getitem", "shape": [1024, 1024], "dtype": "float32",
         "args": [{"node": "b"}, 0]}
    events, _ = estimate([x, a, b, g], 0, "forward", latency_us={"a": 10.0})
    assert {e["node"]: e["end_us"] - e["start_us"] for e in events}["g"] == pytest.approx(0.0)


def test_estimate_kept_parameters_are_one_collective_waited_at_once():
    from deepcompile.plan.estimate import estimate
    from deepcompile.vocab.links import CommModel

    s1 = {"name": "s1", "op": "placeholder", "target": "s1", "shape": [512], "dtype": "float32"}
    many = {"name": "many", "op": "call_function", "target": "dc.gather_persistent_many",
            "shape": [[1024], [1024]], "dtype": None, "args": [[{"node": "s1"}, {"node": "s1"}], [1, 2]]}
    g0 = {"name": "g0", "op": "call_function", "target": "getitem", "shape": [1024], "dtype": "bfloat16",
          "args": [{"node": "many"}, 0]}
    g1 = {"name": "g1", "op": "call_function", "target": "getitem", "shape": [1024], "dtype": "bfloat16",
          "args": [{"node": "many"}, 1]}
    comm = CommModel(alpha_us=10.0, bytes_per_us=1.0, copy_bytes_per_us=1.0)
    events, samples = estimate([s1, many, g0, g1], 0, "forward", latency_us={}, comm=comm)
    ag = [e for e in events if e["stream"] == "allgather"]
    assert len(ag) == 1 and ag[0]["end_us"] - ag[0]["start_us"] == 10.0 + 4096  # two bf16 params
    compute = [e for e in events if e["stream"] == "compute" and e["node"] == "many"]
    assert compute[0]["end_us"] == ag[0]["end_us"]  # compute waits for it
    # the parameters are counted once (by the getitems), not again as the op's tuple
    assert max(x["allocated_bytes"] for x in samples) == 2048 + 4096
    # in the backward the runtime's cache has them: no collective
    events, _ = estimate([s1, many, g0, g1], 0, "backward", latency_us={}, comm=comm)
    assert not [e for e in events if e["stream"] == "allgather"]


def test_estimate_trusts_a_profiled_name_only_for_the_same_op_and_prices_views_at_nothing():
    """The final graph is traced again, so its ``mm_1`` may be the profiled graph's ``permute_1``'s
    neighbour: a latency follows a name only when the op is the same; views cost nothing."""
    from deepcompile.profile.profiler import GraphProfile, NodeProfile, Profile
    from deepcompile.plan.estimate import estimate_versions

    def node(name, target, args=()):
        return {"name": name, "op": "call_function", "target": target, "shape": [1024, 1024],
                "dtype": "float32", "args": [{"node": a} for a in args]}
    x = {"name": "x", "op": "placeholder", "target": "x", "shape": [1024, 1024], "dtype": "float32"}
    profiled = [x, node("mm", "aten.mm.default", ["x", "x"]), node("add", "aten.add.Tensor", ["mm", "x"])]
    # re-traced: a permute took the name "add", the add became "add_1"
    final = [x, node("mm", "aten.mm.default", ["x", "x"]), node("add", "aten.permute.default", ["mm"]),
             node("add_1", "aten.add.Tensor", ["add", "x"])]
    # as the profiler records it: no placeholders
    prof = Profile(graphs={(0, "forward"): GraphProfile(0, "forward", [
        NodeProfile("mm", 0.5, 0, 0, 0), NodeProfile("add", 0.03, 0, 0, 0)])})
    versions = [{"graph_id": 0, "kind": "forward", "after": "zero3", "step": 0, "nodes": profiled},
                {"graph_id": 0, "kind": "forward", "after": "prefetch", "step": 2, "nodes": final}]
    events, _ = estimate_versions(versions, prof)
    d = {e["node"]: e["end_us"] - e["start_us"] for e in events}
    assert d["mm"] == pytest.approx(500.0)
    assert d["add"] == 0.0                          # the permute: no kernel, not the add's 30 us
    # the unmatched add is priced at the measured rate of memory-bound ops (the add: 12 MiB in
    # 30 us), not at one that includes the matmul's compute-bound 500 us
    assert d["add_1"] == pytest.approx(2.0 + 30.0, rel=1e-3)


def test_estimate_backward_ends_with_its_last_reduce():
    from deepcompile.vocab.links import CommModel
    from deepcompile.plan.estimate import estimate

    g = {"name": "g", "op": "placeholder", "target": "g", "shape": [1 << 20], "dtype": "float32"}
    r = {"name": "r", "op": "call_function", "target": "dc.reduce_grad", "shape": None, "dtype": None,
         "args": [{"node": "g"}]}
    e = {"name": "e", "op": "call_function", "target": "dc.end_backward", "shape": None, "dtype": None,
         "args": [[{"node": "r"}], 0]}
    comm = CommModel(alpha_us=10.0, bytes_per_us=10_000.0, copy_bytes_per_us=1.0)
    # the profiled end_backward (5 ms: it also timed the profiler's synchronisation) is not used
    events, _ = estimate([g, r, e], 0, "backward", latency_us={"e": 5000.0}, comm=comm, rate=1e12)
    reduce_end = next(x["end_us"] for x in events if x["stream"] == "reduce")
    assert reduce_end == pytest.approx(10.0 + (4 << 20) / 10_000.0)
    assert max(x["end_us"] for x in events) == pytest.approx(reduce_end)
    assert next(x for x in events if x["node"] == "e")["end_us"] == pytest.approx(reduce_end)


def test_estimate_queues_gathers_and_reduces_on_one_stream():
    """The runtime issues gathers and reduce-scatters on one process group, whose collectives
    NCCL runs in issue order on one stream: a gather issued after a reduce starts when the reduce
    has ended, and the backward waits for both. (Priced as two free-running streams, a slow-link
    plan that gathers again in backward was predicted 18% under its measured step.)"""
    from deepcompile.vocab.links import CommModel
    from deepcompile.plan.estimate import estimate

    def node(name, target, args, shape=None, op="call_function"):
        return {"name": name, "op": op, "target": target, "shape": shape, "dtype": "float32" if shape else None,
                "args": args}

    nodes = [node("g", "g", [], [1 << 20], op="placeholder"), node("s", "s", [], [1 << 19], op="placeholder"),
             node("r", "dc.reduce_grad", [{"node": "g"}, 0]),
             node("i", "dc.allgather_param", [{"node": "s"}, 1], [0]),
             node("w", "dc.wait_allgather", [{"node": "i"}, 1], [1 << 20]),
             node("e", "dc.end_backward", [[{"node": "r"}], 0])]
    comm = CommModel(alpha_us=10.0, bytes_per_us=10_000.0, copy_bytes_per_us=1.0)
    events, _ = estimate(nodes, 0, "backward", latency_us={}, comm=comm, rate=1e12)
    red = next(x for x in events if x["stream"] == "reduce")
    ag = next(x for x in events if x["stream"] == "allgather")
    one = 10.0 + (4 << 20) / 10_000.0  # 4 MiB each way: the gradient, and the gathered parameter
    assert red["start_us"] < 1.0 and red["end_us"] == pytest.approx(one, abs=0.01)
    assert ag["start_us"] == pytest.approx(red["end_us"], abs=0.01)
    assert ag["end_us"] == pytest.approx(2 * one, abs=0.02)
    wait = next(x for x in events if x["node"] == "w")
    assert wait["end_us"] == pytest.approx(ag["end_us"], abs=0.02)
    assert max(x["end_us"] for x in events) == pytest.approx(2 * one, abs=0.2)


def test_fused_estimate_charges_only_what_crosses_a_kernel():
    """Under Inductor a chain of pointwise ops is one kernel: it reads the matmul's output once
    and writes what the next matmul reads; the intermediate values cost nothing."""
    from deepcompile.plan.estimate import OP_OVERHEAD_US, estimate

    MB = 1 << 20

    def node(name, target, args, shape=(MB // 4,)):
        return {"name": name, "op": "call_function", "target": target, "shape": list(shape),
                "dtype": "float32", "args": [{"node": a} for a in args]}
    x = {"name": "x", "op": "placeholder", "target": "x", "shape": [MB // 4], "dtype": "float32"}
    nodes = [x, node("mm", "aten.mm.default", ["x", "x"]),
             node("a", "aten.mul.Tensor", ["mm", "x"]),      # reads mm and x (outside): 2 MiB
             node("b", "aten.relu.default", ["a"]),           # inside: free
             node("v", "aten.view.default", ["b"]),           # a view: free, looked through
             node("c", "aten.add.Tensor", ["v", "x"]),        # reads x again: 1 MiB, writes 1 MiB (mm2 uses it)
             node("mm2", "aten.mm.default", ["c", "x"]),
             {"name": "output", "op": "output", "target": "output", "args": [[{"node": "mm2"}]]}]
    lat = {"mm": 100.0, "a": 50.0, "b": 50.0, "c": 50.0, "mm2": 100.0}
    rate = 1000.0  # bytes/us
    ev, _ = estimate(nodes, 0, "forward", lat, rate=rate, fused=True)
    d = {e["node"]: e["end_us"] - e["start_us"] for e in ev}
    assert d["mm"] == 100.0 and d["mm2"] == 100.0          # matmuls keep their profiled time
    assert d["a"] == pytest.approx(2 * MB / rate)           # no output leaves the kernel here
    assert d["b"] == 0.0 and d["v"] == 0.0
    assert d["c"] == pytest.approx(OP_OVERHEAD_US + 2 * MB / rate)
    # unfused (aot_eager), every op costs its profiled latency
    ev, _ = estimate(nodes, 0, "forward", lat, rate=rate, fused=False)
    d = {e["node"]: e["end_us"] - e["start_us"] for e in ev}
    assert (d["a"], d["b"], d["c"]) == (50.0, 50.0, 50.0)


def test_hidden_collectives_still_cost_compute_their_memory_traffic():
    from deepcompile.vocab.links import CommModel
    from deepcompile.plan.estimate import estimate

    s = {"name": "s", "op": "placeholder", "target": "s", "shape": [1 << 18], "dtype": "float32"}
    ag = {"name": "ag", "op": "call_function", "target": "dc.allgather_param", "shape": [1 << 20],
          "dtype": "float32", "args": [{"node": "s"}, 0]}
    comm = CommModel(alpha_us=1.0, bytes_per_us=1e6, copy_bytes_per_us=1.0)
    ev, _ = estimate([s, ag], 0, "forward", {}, comm=comm, rate=4096.0)
    on = {e["stream"]: e["end_us"] - e["start_us"] for e in ev if e["node"] == "ag"}
    assert on["allgather"] == pytest.approx(1.0 + (4 << 20) / 1e6, abs=1e-3)  # the collective: alpha + bytes/bw
    # the compute stream: 0.5 us to issue it, and the 4 MiB it writes at 4096 bytes/us
    assert on["compute"] == pytest.approx(0.5 + (4 << 20) / 4096.0)
    # without a profile (no comm model) only the issue is charged
    ev, _ = estimate([s, ag], 0, "forward")
    assert {e["stream"]: e["end_us"] - e["start_us"] for e in ev}["compute"] == pytest.approx(0.5)


def test_the_fast_node_check_accepts_only_what_the_named_check_accepts():
    """``check_nodes`` accepts a node by ``_node_ok`` (no paths) and checks again with paths
    (``_check_node``) only what that does not accept: every node ``_node_ok`` accepts must pass
    ``_check_node``, and a bad node still fails naming its field."""
    import copy
    import itertools

    good = {"name": "mm", "op": "call_function", "target": "aten.mm.default", "scope": "blocks.0",
            "args": [{"node": "x"}, [1, 2.5, "s", True, None, {"k": {"node": "y"}}]],
            "kwargs": {"alpha": 1}, "shape": [[4, "s0"], [2]], "dtype": "torch.float32", "param": 3,
            "recompute_of": "mm_0"}
    deep: list = []
    for _ in range(S.MAX_DEPTH + 2):
        deep = [deep]
    bad_values = [None, True, False, -1, 0, 2 ** 63, -(2 ** 63), 1.5, float("nan"), "s", [], {}, [[-1]],
                  [True], [[2 ** 64]], {"node": 3}, {"node": "n", "x": 1}, deep, [deep], [{"a": deep}],
                  [float("inf")], [{"node": None}]]
    nodes = [good]
    for k, v in itertools.product(list(good), bad_values):
        n = copy.deepcopy(good)
        n[k] = copy.deepcopy(v)
        nodes.append(n)
    for k in good:                      # each field left out
        n = copy.deepcopy(good)
        del n[k]
        nodes.append(n)
    nodes += [[], "node", None, {"name": "only"}]
    accepted = rejected = 0
    for n in nodes:
        try:
            S._check_node("g.json", n, "nodes[0]")
            named_ok = True
        except RecordError as e:
            named_ok = False
            assert "nodes[0]" in str(e), e
        if S._node_ok(n):
            assert named_ok, n
            accepted += 1
        try:
            S.check_nodes("g.json", [good, n])
            assert named_ok, n
        except RecordError as e:
            assert not named_ok and "nodes[1]" in str(e), (n, e)
            rejected += 1
    assert accepted > 10 and rejected > 50, (accepted, rejected)
