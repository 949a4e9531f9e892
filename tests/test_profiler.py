"""The profiler's CPU memory accounting: the running total equals a walk of what the
interpreter holds, node by node (views and repeated inputs counted once)."""
from __future__ import annotations

import torch
import torch.fx as fx

from deepcompile.profile import profiler as P


def test_running_total_of_held_bytes_matches_a_full_walk():
    def f(x, w):
        y = x @ w
        z = y.relu()
        v = z.view(-1)              # shares z's storage
        a = torch.cat([z, z])       # z twice in one value
        return a.sum() + v.sum()

    gm = fx.symbolic_trace(f)
    checked = []

    class Check(P.ProfilingInterpreter):
        def run_node(self, n):
            out = super().run_node(n)
            seen: dict = {}
            for v in self.env.values():
                P.storages(v, seen)
            checked.append(n.name)
            assert sum(seen.values()) == self.env.total, n.name
            return out

    interp = Check(gm)
    interp.cuda = False
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    out = interp.boxed_run([x, w])
    torch.testing.assert_close(out, f(x, w))
    assert isinstance(interp.env, P._HeldEnv) and len(checked) == len(list(gm.graph.nodes)) - 2  # inputs preset
    # what the records say: inputs (128 + 256 bytes) plus the matmul's output (128) after it
    assert interp.records[0].name == "matmul" and interp.records[0].mem_after_bytes == 512


def _matmul_graph() -> fx.GraphModule:
    """x @ w1 -> relu -> @ w2, with the values a traced graph's nodes carry in meta["val"]."""
    g = fx.Graph()
    x, w1, w2 = g.placeholder("x"), g.placeholder("w1"), g.placeholder("w2")
    mm = g.call_function(torch.ops.aten.mm.default, (x, w1))
    r = g.call_function(torch.ops.aten.relu.default, (mm,))
    mm2 = g.call_function(torch.ops.aten.mm.default, (r, w2))
    g.output(mm2)
    vals = {"x": torch.zeros(64, 32), "w1": torch.zeros(32, 128), "w2": torch.zeros(128, 16)}
    for n in g.nodes:
        if n.op == "placeholder":
            n.meta["val"] = vals[n.name]
    mm.meta["val"], r.meta["val"], mm2.meta["val"] = torch.zeros(64, 128), torch.zeros(64, 128), torch.zeros(64, 16)
    return fx.GraphModule(torch.nn.Module(), g)


def test_the_sustained_clock_scales_only_compute_bound_latencies():
    """The profile's busy-step clock ratio (profile.sustained) scales matmul and attention
    latencies, in agree() on one rank as on many, and nothing else; the measurement picks the
    slowest matmul whose tensors it can make, and on the CPU measures nothing."""
    from deepcompile.profile import sustained
    from deepcompile.profile.agree import agree

    gm = _matmul_graph()
    recs = [P.NodeProfile("mm_default", 1.0, 0, 0, 0, "aten.mm.default"),
            P.NodeProfile("relu_default", 0.5, 0, 0, 0, "aten.relu.default"),
            P.NodeProfile("mm_default_1", 3.0, 0, 0, 0, "aten.mm.default")]
    node, ms = sustained.heaviest_matmul({(0, "forward"): gm}, {(0, "forward"): recs})
    assert (node.name, ms) == ("mm_default_1", 3.0)
    # only what fits the room the step leaves (its inputs and output: 45 KB; the other's 57 KB)
    assert sustained.heaviest_matmul({(0, "forward"): gm}, {(0, "forward"): recs}, 50_000)[0].name == "mm_default_1"
    assert sustained.heaviest_matmul({(0, "forward"): gm}, {(0, "forward"): recs}, 40_000) is None
    gm.graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default)[1].meta.pop("val")
    assert sustained.heaviest_matmul({(0, "forward"): gm}, {(0, "forward"): recs})[0].name == "mm_default"   # unknown shape: skipped
    assert sustained.measure({(0, "forward"): gm}, {(0, "forward"): recs}, torch.device("cpu")) is None

    att = P.NodeProfile("sdpa", 2.0, 0, 0, 0, "aten._scaled_dot_product_flash_attention.default")
    prof = P.Profile(graphs={(0, "forward"): P.GraphProfile(0, "forward", recs + [att])}, hardware="NVIDIA H200",
                     sustained={"ratio": 1.2, "node": "mm_default_1", "burst_ms": 3.0, "sustained_ms": 3.6})
    agree(prof)
    assert [round(n.latency_ms, 6) for n in prof.graphs[(0, "forward")].nodes] == [1.2, 0.5, 3.6, 2.4]
    again = P.Profile.from_records(prof.to_records())   # recorded as scaled, with the ratio: not scaled twice
    assert again.sustained["ratio"] == 1.2 and [n.latency_ms for n in again.graphs[(0, "forward")].nodes] == \
        [n.latency_ms for n in prof.graphs[(0, "forward")].nodes]
