"""Diagnostic: which gathered buffers outlive the forward on NCCL, and for how long."""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from tests.dist_utils import run_ranks


def work(rank, world, compiler):
    import deepcompile
    from deepcompile.runtime import ops
    from tests.workloads import make_model, make_optimizer, global_batch
    model, opt = deepcompile.initialize(make_model(), make_optimizer, {"compiler": compiler})
    out = []
    for s in range(4):
        x, y = global_batch(s, 0, world, "cuda")
        torch.cuda.synchronize()
        m0 = torch.cuda.memory_allocated()
        loss = model(x[:2], y[:2])
        torch.cuda.synchronize()
        m1 = torch.cuda.memory_allocated()
        live = [model.dc_state.runtime.params[i].name for i in ops.C.live_gathered()]
        t0 = time.monotonic()
        while ops.C.live_gathered() and time.monotonic() - t0 < 3:
            time.sleep(0.005)
        out.append((s, m1 - m0, live, round(time.monotonic() - t0, 3), len(ops.C.live_gathered())))
        loss.backward(); opt.step(); opt.zero_grad()
    return out


if __name__ == "__main__":
    for compiler in ("aot_eager", "inductor"):
        for r in run_ranks(work, 2, compiler, backend="nccl", timeout=300)[:1]:
            for row in r:
                print(compiler, row)
