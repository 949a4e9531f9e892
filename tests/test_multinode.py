"""Two "nodes" on one machine: two torchrun invocations (``--nnodes 2 --node-rank 0/1
--nproc-per-node 2``) meet through the c10d rendezvous on 127.0.0.1 and train one 4-rank job with
hybrid sharding over the nodes (``mesh.shard = 2``: each node's two ranks shard the model, the two
nodes replicate it), which must match the unsharded reference (tolerance:
tests/test_zero3_parity.py's).

Every wait is bounded: the rendezvous (join_timeout), the process group (its timeout), each
torchrun (a subprocess deadline). On failure or timeout both launchers get SIGTERM (torchrun
stops its workers), then SIGKILL, and any worker still alive is killed by the pid it reported.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from tests.dist_utils import free_port
from tests.workloads import train_reference

STEPS = 3
DEADLINE_S = 420

SCRIPT = textwrap.dedent("""
    import datetime, os, sys
    import torch, torch.distributed as dist
    out = sys.argv[1]
    open(os.path.join(out, f"pid{os.environ['RANK']}"), "w").write(str(os.getpid()))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    import deepcompile
    from tests.workloads import LOCAL_BATCH, global_batch, make_model, make_optimizer
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {"compiler": "aot_eager", "passes": ["zero3"]}
    config.update(eval(sys.argv[2]))
    model, opt = deepcompile.initialize(make_model(), make_optimizer, config)
    losses = []
    for s in range(int(sys.argv[3])):
        x, y = global_batch(s, 0, world)
        sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        loss = model(x[sl], y[sl]); loss.backward(); opt.step(); opt.zero_grad()
        losses.append(loss.item())
    full = deepcompile.full_state_dict(model)
    where = {k: os.environ[k] for k in ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")}
    shard_numel = sum(p.numel() for p in model.parameters())
    torch.save({"losses": losses, "state": full, "env": where, "shard_numel": shard_numel},
               os.path.join(out, f"rank{rank}.pt"))
    deepcompile.destroy(model)
    dist.destroy_process_group()
""")


def _launch(node_rank: int, port: int, script, out, config: str, log, env):
    cmd = [sys.executable, "-m", "torch.distributed.run",
           "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "dc-multinode",
           "--rdzv-conf", "join_timeout=120,last_call_timeout=5", "--max-restarts", "0",
           "--monitor-interval", "1", str(script), str(out), config, str(STEPS)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=env["PYTHONPATH"].split(os.pathsep)[0])


def _stop(procs, out) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)  # torchrun stops its workers on SIGTERM
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)
    for f in out.glob("pid*"):  # workers orphaned by a killed launcher
        try:
            os.kill(int(f.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def run_two_nodes(tmp_path, config: str = "{}"):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "GROUP_RANK"):
        env.pop(k, None)
    port = free_port()
    logs = [open(tmp_path / f"node{n}.log", "w") for n in (0, 1)]
    procs = []
    try:
        for n in (0, 1):
            procs.append(_launch(n, port, script, out, config, logs[n], env))
        deadline = time.monotonic() + DEADLINE_S
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        codes = [p.poll() for p in procs]
        _stop(procs, out)
        for f in logs:
            f.close()
    text = "\n".join(f"--- node {n} ---\n" + (tmp_path / f"node{n}.log").read_text()[-4000:] for n in (0, 1))
    assert codes == [0, 0], f"torchrun exit codes {codes} (None: still running after {DEADLINE_S}s, killed)\n{text}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def test_two_torchrun_nodes_match_the_unsharded_reference(tmp_path):
    results = run_two_nodes(tmp_path, '{"mesh": {"shard": 2}}')
    # four workers from two launchers, two each
    where = sorted((r["env"]["GROUP_RANK"], r["env"]["LOCAL_RANK"]) for r in results)
    assert where == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], where
    assert all(r["env"]["WORLD_SIZE"] == "4" and r["env"]["LOCAL_WORLD_SIZE"] == "2" for r in results)
    ref_losses, ref_state = train_reference(4, STEPS, 1)
    mean = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref_losses, dtype=mean.dtype), rtol=1e-5, atol=1e-6)
    for r in results:
        assert set(r["state"]) == set(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")
    # sharded within a node (2 ranks): each holds ceil(d0 / 2) rows of every parameter
    from tests.workloads import make_model

    full = {id(p): p for p in make_model().parameters()}.values()
    want = sum(-(-p.shape[0] // 2) * (p[0].numel() if p.dim() > 1 else 1) if p.dim() else 1 for p in full)
    assert all(r["shard_numel"] == want for r in results), ([r["shard_numel"] for r in results], want)
