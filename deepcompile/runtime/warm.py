"""The first collectives, run while step 0 is traced.

On 2 H200s (torch 2.11, NCCL 2.28) the first all-gather and the first reduce-scatter of a job
each held both ranks' host for about 2 s, after both had arrived (py-spy, 32 layers,
``benchmarks/pyspy_compile.sh``, session 23): the step-0 forward's first gather waited 2.0-2.9 s
and the step-0 backward's first reduce-scatter 1.7-1.8 s, a one-time cost of the group's first
use of each collective, not of the transfer. The process group was created eagerly
(``init_process_group(device_id=...)``), so this is not the communicator's creation.

Step 0 spends its first 7-10 s in Dynamo's trace, on the host, with no collective. So a thread
issues one small and one large all-gather and reduce-scatter on each of the runtime's groups as
step 0 starts (an all-reduce on a replicate group), in the dtypes the runtime gathers and
reduces, and waits for them on a stream of its own: the one-time cost is paid while Dynamo
traces. Collectives on one group must be issued in the same order on every rank, so
:meth:`CommWarmup.join` is called before deepcompile issues any collective of its own (the
backend's first call, before the plan cache agrees) and at the end of step 0's forward; the
thread issues nothing after it has been joined.

On by default with NCCL only (config ``warm_collectives``): gloo connects its pairs when the
group is created. A failed warm-up collective is reported when joined, naming the group and the
collective; the training step's own collectives then say what is wrong with the group.
"""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from deepcompile import compat

# output bytes of the two sizes: NCCL picks its protocol by size (LL for small messages, Simple
# for large ones), and each first use is paid once; the large one stays below a layer's gather
SIZES = (64 << 10, 8 << 20)


class CommWarmup:
    """One background thread running the first collectives of ``groups`` (``[(group, kind)]``,
    kind ``"shard"``: all-gather and reduce-scatter; ``"replicate"``: all-reduce)."""

    def __init__(self, groups, device: torch.device, gather_dtype: torch.dtype, reduce_dtype: torch.dtype,
                 timeout_s: float):
        self.groups = [(g, k) for g, k in groups if g is not None and dist.get_world_size(g) > 1]
        self.device = device
        self.gather_dtype, self.reduce_dtype = gather_dtype, reduce_dtype
        self.timeout_s = timeout_s
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.done: list[str] = []          # the collectives that ran, in order
        self.seconds: float | None = None  # the thread's time, start to end
        self.waited_s = 0.0                # what join() waited for (the part not overlapped)

    def start(self) -> None:
        if self.thread is not None or not self.groups:
            return
        self.thread = threading.Thread(target=self._run, name="deepcompile-comm-warmup", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        what = "setup"
        try:
            cuda = self.device.type == "cuda"
            if cuda:
                torch.cuda.set_device(self.device)  # the current device is per thread
                stream = torch.cuda.Stream(self.device)
                ctx = torch.cuda.stream(stream)
            else:
                stream, ctx = None, _Null()
            with ctx:
                for g, kind in self.groups:
                    world = dist.get_world_size(g)
                    for nbytes in SIZES:
                        if kind == "replicate":
                            what = f"all_reduce of {nbytes} B"
                            buf = torch.zeros(max(1, nbytes // 4), dtype=self.reduce_dtype, device=self.device)
                            dist.all_reduce(buf, group=g)
                        else:
                            what = f"all_gather_into_tensor of {nbytes} B"
                            esize = torch.empty((), dtype=self.gather_dtype).element_size()
                            n = max(world, nbytes // esize // world * world)
                            out = torch.empty(n, dtype=self.gather_dtype, device=self.device)
                            compat.all_gather_single(out, torch.zeros(n // world, dtype=self.gather_dtype,
                                                                      device=self.device), g)
                            self.done.append(f"{kind}:{what}")
                            what = f"reduce_scatter_tensor of {nbytes} B"
                            rsize = torch.empty((), dtype=self.reduce_dtype).element_size()
                            m = max(world, nbytes // rsize // world * world)
                            full = torch.zeros(m, dtype=self.reduce_dtype, device=self.device)
                            if cuda:
                                dist.reduce_scatter_tensor(torch.empty(m // world, dtype=self.reduce_dtype,
                                                                       device=self.device), full, group=g)
                            else:  # gloo has no reduce_scatter_tensor on every version: the same pairs
                                dist.all_reduce(full, group=g)
                        self.done.append(f"{kind}:{what}")
                if stream is not None:
                    stream.synchronize()  # the kernels' one-time costs too, not only their launch
        except BaseException as e:  # noqa: BLE001 - reported by join(), on the main thread
            self.error = RuntimeError(f"deepcompile: the first collectives' warm-up failed at {what}: "
                                      f"{type(e).__name__}: {e}")
        finally:
            self.seconds = time.perf_counter() - t0

    def join(self) -> None:
        """Wait for the thread (bounded by the collective timeout); afterwards it issues nothing."""
        t = self.thread
        if t is None:
            return
        t0 = time.perf_counter()
        t.join(self.timeout_s)
        self.waited_s += time.perf_counter() - t0
        if t.is_alive():
            raise RuntimeError(
                f"deepcompile: the first collectives' warm-up did not finish in {self.timeout_s:.0f} s "
                f"(config collective_timeout_s; done: {self.done or 'none'}): a rank did not reach step 0, "
                "or the process group is broken. Set config warm_collectives: false to skip the warm-up")
        self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise err


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def wanted(setting: bool | None, group) -> bool:
    """Config ``warm_collectives``: None (default) means on where the group's backend is NCCL."""
    if setting is not None:
        return bool(setting)
    try:
        return dist.get_backend(group) == "nccl"
    except Exception:  # noqa: BLE001 - no process group: nothing to warm
        return False
