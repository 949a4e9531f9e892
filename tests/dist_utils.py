"""Run a function on N real ranks (separate processes, gloo or NCCL) with a hard timeout.

A rank that raises, dies or hangs fails the test with that rank's traceback; nothing hangs.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import traceback
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world, port, backend, out_dir, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    path = Path(out_dir) / f"rank{rank}.pkl"
    # a rank killed by a signal (a segfault in native code) leaves no result: its Python stack
    # (every thread's) goes to a file the parent puts into the failure message
    import faulthandler

    fault = open(Path(out_dir) / f"rank{rank}.fault", "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(fault, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(rank)
        if backend is not None:
            dist.init_process_group(backend, rank=rank, world_size=world)
            if backend == "gloo":
                # no rank starts (and may finish and exit) before every rank's gloo mesh is
                # connected: a rank still connecting to one that exited fails its init with
                # "connectFullMesh failed ... Connection closed by peer" (seen in CI)
                dist.barrier()
        result = fn(rank, world, *args)
        path.write_bytes(pickle.dumps(("ok", result)))
        if backend is not None:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        path.write_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        os._exit(1)


def run_ranks(fn, world: int, *args, backend: str | None = "gloo", timeout: float = 300.0):
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return the per-rank results."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_child, args=(fn, r, world, port, backend, d, args)) for r in range(world)]
        for p in procs:
            p.start()
        import time

        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        for r in range(world):
            f = Path(d) / f"rank{r}.pkl"
            if not f.exists():
                fault = Path(d) / f"rank{r}.fault"
                stack = fault.read_text(errors="replace").strip() if fault.exists() else ""
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})"
                              + (f"\n{stack}" if stack else ""))
                results.append(None)
                continue
            status, val = pickle.loads(f.read_bytes())
            if status == "error":
                errors.append(f"rank {r}: {val}")
            results.append(val)
        if hung:
            raise AssertionError(f"ranks {hung} did not finish within {timeout:.0f}s (killed)\n" + "\n".join(errors))
        if errors:
            raise AssertionError("\n".join(errors))
        return results
