"""Run a function on N real ranks (separate processes, gloo or NCCL) with a hard timeout.

A rank that raises, dies or hangs fails the test with that rank's traceback; nothing hangs.

Gloo ranks start from a fork server that has imported torch and deepcompile once (importing them
is 6-9 s a process on the CI's 2 cores, and the suite starts ranks a few hundred times). Each rank
is a fresh fork of that untouched server, given the test's environment. Three things fall back to
a spawned interpreter: NCCL ranks (the GPU tests, as before), an environment that differs from the
server's in a variable torch may read at import (``TORCH*``, ``OMP_*``, ...: only ``DEEPCOMPILE_*``,
pytest's own variables and ``TORCHINDUCTOR_CACHE_DIR`` may differ, all read at use), and
``start="spawn"``.
Forked ranks share the server's string-hash seed; a test that must see ranks with different seeds
(set orders that differ between ranks, as under torchrun) passes ``start="spawn"``.
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


_PRELOAD = ["torch", "torch.distributed", "deepcompile", "tests.dist_utils"]
_SERVER: dict = {}  # the fork server's environment and directory, from its start


def _may_differ(key: str) -> bool:
    # Inductor reads its cache directory at each use (cache_dir_utils.cache_dir, 2.11 and 2.13)
    return key.startswith(("DEEPCOMPILE_", "PYTEST_")) or key == "TORCHINDUCTOR_CACHE_DIR"


def _start_method(backend: str | None, start: str | None) -> str:
    if start is not None:
        return start
    if backend == "nccl":
        return "spawn"
    env, cwd = dict(os.environ), os.getcwd()
    if not _SERVER:
        mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
        _SERVER.update(env=env, cwd=cwd)  # the server starts with the first ranks, from this state
        return "forkserver"
    old = _SERVER["env"]
    same = cwd == _SERVER["cwd"] and all(
        env.get(k) == old.get(k) for k in set(env) | set(old) if not _may_differ(k))
    return "forkserver" if same else "spawn"


def _child(fn, rank, world, port, backend, out_dir, args, env=None):
    if env is not None:  # a fork of the server: the test's environment, not the server's
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    path = Path(out_dir) / f"rank{rank}.pkl"
    # a rank killed by a signal (a segfault in native code) leaves no result: its Python stack
    # (every thread's) goes to a file the parent puts into the failure message. The rank's stderr
    # goes there too: native code that aborts says why only on stderr ("terminate called after
    # throwing ...", a gloo or OpenMP assertion), which pytest's capture of a passing parent drops
    import faulthandler

    fault = open(Path(out_dir) / f"rank{rank}.fault", "w")  # noqa: SIM115 - open until the process ends
    os.dup2(fault.fileno(), 2)
    faulthandler.enable(fault, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(rank)
        if backend is not None:
            # the store is the parent's (run_ranks): a rank that ends first, rank 0 included,
            # does not take it from the others (as under torchrun's agent or the demo's launcher)
            import datetime

            store = dist.TCPStore("127.0.0.1", port, world, False, datetime.timedelta(seconds=120))
            dist.init_process_group(backend, store=store, rank=rank, world_size=world)
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


def run_ranks(fn, world: int, *args, backend: str | None = "gloo", timeout: float = 300.0,
              start: str | None = None):
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return the per-rank results.
    ``start``: "spawn" for fresh interpreters (see the module's docstring), else chosen here."""
    method = _start_method(backend, start)
    ctx = mp.get_context(method)
    env = dict(os.environ) if method == "forkserver" else None
    port = free_port()
    store = None
    if backend is not None:
        # hosted here, not by rank 0: a rank that reads the abort message a failing rank 0 left
        # in the store must still find the store when rank 0 has already exited ("Connection
        # reset by peer" in test_hangs, once the ranks started together from the fork server)
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, world, True, datetime.timedelta(seconds=timeout),
                              wait_for_workers=False)
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_child, args=(fn, r, world, port, backend, d, args, env))
                 for r in range(world)]
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
                stack = fault.read_text(errors="replace").strip()[-20000:] if fault.exists() else ""
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
