"""How a fused group of parameters is best gathered on gloo (2 ranks, one process each, 3 groups in
flight, ~2 s per variant): one allgather_into_tensor_coalesced (torch's gloo races on its heap with
several of these in flight), one packed _allgather_base (cat the shards, gather, split the result
into the members' buffers: what csrc/runtime.cpp start_allgather_fused does on the host), one
_allgather_base per parameter, and the coalesced call on a gloo group with one worker thread.
Prints microseconds per group.  python benchmarks/gloo_fused_gather.py"""
import datetime as dt
import time

import torch
import torch.distributed as D
import torch.multiprocessing as mp


def worker(rank, port, q):
    torch.set_num_threads(1)
    D.init_process_group("gloo", store=D.TCPStore("127.0.0.1", port, 2, rank == 0), rank=rank,
                         world_size=2, timeout=dt.timedelta(seconds=120))
    pg = D.distributed_c10d._get_default_group()
    o = D.ProcessGroupGloo._Options()
    o._threads = 1
    pg1 = D.new_group([0, 1], backend="gloo", pg_options=o)
    W, res = 2, {}
    for n, c in ((8, 1024), (8, 65536), (32, 4096)):
        ins = [torch.randn(c) for _ in range(n)]
        outs = [torch.empty(W * c) for _ in range(n)]

        def packed():
            pin = torch.cat(ins)
            pout = torch.empty(W * pin.numel())
            return [pg._allgather_base(pout, pin)], pout

        def unpack(pout):
            torch.split_with_sizes_copy(pout.view(W, -1), [c] * n, dim=1, out=[o.view(W, c) for o in outs])

        variants = {
            "coalesced": lambda: ([pg.allgather_into_tensor_coalesced(outs, ins)], None),
            "coalesced_1thread": lambda: ([pg1.allgather_into_tensor_coalesced(outs, ins)], None),
            "packed": packed,
            "per_param": lambda: ([pg._allgather_base(o, i) for o, i in zip(outs, ins)], None),
        }
        for name, fn in variants.items():
            D.barrier()
            t0, it = time.perf_counter(), 0
            while True:
                batch = [fn() for _ in range(3)]
                for works, pout in batch:
                    for w in works:
                        w.wait()
                    if pout is not None:
                        unpack(pout)
                it += 3
                if it % 60 == 0:
                    go = torch.tensor([float(time.perf_counter() - t0 < 2.0)])
                    D.broadcast(go, 0)
                    if go.item() == 0:
                        break
            res[(n, c, name)] = (time.perf_counter() - t0) / it * 1e6
    if rank == 0:
        q.put(res)
    D.barrier()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, 29641, q)) for r in (0, 1)]
    for p in ps:
        p.start()
    res = q.get(timeout=600)
    for p in ps:
        p.join(60)
    for (n, c, name), us in res.items():
        print(f"{n} x {c} elements  {name:18s} {us:8.0f} us/group")
