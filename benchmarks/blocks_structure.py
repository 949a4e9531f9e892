"""How much Inductor would lower with and without deepcompile.blocks, per depth.

Runs the tiny GPT of tests/workloads.py on one gloo rank on CPU under a config (default: the
default ZeRO-3 plan, compiler inductor) for a few steps with ``compile_fx_inner`` replaced by a
stub that counts the FX nodes handed to it and runs the graph as FX code: Dynamo, AOTAutograd,
the passes, the region split and the driver run for real, Inductor's codegen does not. Prints
one JSON line per (layers, blocks on/off): compile calls, nodes lowered, regions, losses.

    python benchmarks/blocks_structure.py --layers 8 16 32
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(n_layer: int, config: dict, steps: int) -> dict:
    sys.path.insert(0, REPO)
    import torch.distributed as dist
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor import compile_fx as cfx

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29700 + os.getpid() % 1000),
                      RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    calls = []

    def stub(gm, inputs, **kw):
        calls.append(sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output")))
        return make_boxed_func(gm.forward)

    cfx.compile_fx_inner = stub
    import deepcompile
    from tests import workloads as W

    model, opt = deepcompile.initialize(W.make_model(n_layer=n_layer), W.make_optimizer,
                                        {"zero_stage": 3, **config})
    losses = []
    for s in range(steps):
        x, y = W.global_batch(s, 0, 1)
        loss = model(x[:W.LOCAL_BATCH], y[:W.LOCAL_BATCH])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"layers": n_layer, "blocks": model.dc_backend.blocks, "config": config, "compile_calls": len(calls),
            "nodes_lowered": sum(calls), "losses": losses,
            "graphs": [{k: v for k, v in e.items() if k not in ("seconds", "labels")} for e in model.dc_state.runtime.block_compiles]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--config", default='{"compiler": "inductor"}', help="deepcompile config (JSON)")
    ap.add_argument("--steps", type=int, default=3, help="3 reaches the default plan's final compile")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a.layers[0], json.loads(a.config), a.steps)))
        return
    for n in a.layers:
        for on in ("1", "0"):  # one process each: Dynamo and the process group start fresh
            env = dict(os.environ, OMP_NUM_THREADS="1")
            cfg = json.dumps({**json.loads(a.config), "blocks": on == "1"})
            r = subprocess.run([sys.executable, __file__, "--child", "--layers", str(n), "--config", cfg,
                                "--steps", str(a.steps)], env=env, capture_output=True, text=True, timeout=1800)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            print(line[-1] if line else json.dumps({"layers": n, "blocks": on == "1", "error": r.stderr[-2000:]}),
                  flush=True)


if __name__ == "__main__":
    main()
