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
