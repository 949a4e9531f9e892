"""deepcompile under torchrun: the process group comes from the launcher's environment."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist, deepcompile
    from tests.workloads import global_batch, make_model, make_optimizer, LOCAL_BATCH
    assert not dist.is_initialized()
    model, opt = deepcompile.initialize(make_model(), make_optimizer, {"compiler": "aot_eager"})
    rank, world = dist.get_rank(), dist.get_world_size()
    for s in range(3):
        x, y = global_batch(s, 0, world)
        sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        loss = model(x[sl], y[sl]); loss.backward(); opt.step(); opt.zero_grad()
    sd = deepcompile.full_state_dict(model)
    deepcompile.destroy(model)
    print(f"RANK {rank}/{world} backend={dist.get_backend()} loss={loss.item():.4f} keys={len(sd)}", flush=True)
    dist.destroy_process_group()
""")


def test_torchrun_creates_the_process_group(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(script)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=repo)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # the two ranks share stdout, so their lines may interleave: parse records, not lines
    found = re.findall(r"RANK (\d)/2 backend=(\w+) loss=([\d.]+) keys=(\d+)", out.stdout)
    assert sorted(f[0] for f in found) == ["0", "1"], out.stdout
    assert all(f[1] == "gloo" for f in found)
    assert found[0][3] == found[1][3]  # same state-dict keys on both ranks
    assert found[0][2] != found[1][2]  # different data per rank, same model
