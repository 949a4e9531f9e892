"""Cross-rank agreement of the profile: every rank's measurements combined element-wise before any
pass or planner reads them (a rank that decided differently would issue different collectives and
deadlock the job), graphs that ranks profiled differently dropped, and stalled node latencies (the
other rank's profiler spin absorbed by a wait) replaced by their op family's median.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from deepcompile.profile import sustained
from deepcompile.profile.profiler import GraphProfile, Profile
from deepcompile.vocab.links import CommModel, ReplicateLink


def _signature(g: GraphProfile) -> str:
    """The profiled graph's structure: its node names in order (a hash, small to exchange).
    Names follow the ops, so graphs traced from the same code with the same shapes' kind (all
    static, or the same dims symbolic) match; a static graph and a symbolic one do not."""
    import hashlib

    return hashlib.sha1("\n".join(n.name for n in g.nodes).encode()).hexdigest()


HOST_KEYS = ("dispatch_us", "python_us")   # Profile.host's measured numbers (agreed)


STALL_FACTOR = 20.0   # a node this many times its op family's median ...
STALL_MIN_MS = 2.0    # ... and at least this long is a stall, not the op's own time


def drop_stalls(profile: Profile) -> list[tuple]:
    """Replace stalled node latencies by their op family's median; returns what was replaced.

    The GPU profiling step parks each rank's compute stream in a spin kernel now and then
    (``profiler._GpuLead``); a collective runs only when both ranks reach it, so a wait (or the node
    that first meets the collective's stream dependency) can absorb the other rank's spin, or
    several. On 2 H200s (953M Llama, 16 layers) one profiling step had six waits at ~40 ms
    (SPIN_MS), one at 144 ms and a ``convert_element_type`` at 654 ms, where the forward's other
    1,756 nodes summed to 35 ms: the cost model predicted 161-192 ms for a 43 ms step. A node is
    taken as stalled when it is ``STALL_FACTOR`` times the median of its op family (the same op
    and the same output size: every cast of a same-shaped weight) in the same graph and at least
    ``STALL_MIN_MS``; families of fewer than 4 nodes are left as measured. The family is the op
    (``NodeProfile.op``), not the name: a re-traced graph names ops freely (a Llama's gate and up
    matmuls can be ``getitem_85``/``getitem_86``), and by name those matmuls would be stalled
    getitems, priced at a getitem's microseconds instead of their milliseconds. The size keeps
    one large op (the vocabulary's matmul) out of the family of the model's smaller ones. Records
    without the op fall back to the name without its trailing number. Runs on the agreed values,
    so every rank replaces the same nodes."""
    import re
    import statistics

    fam = re.compile(r"_\d+$")
    out = []
    for key, g in profile.graphs.items():
        by: dict[tuple, list] = {}
        for n in g.nodes:
            by.setdefault((n.op or fam.sub("", n.name), n.out_bytes), []).append(n)
        for name, ns in by.items():
            if len(ns) < 4:
                continue
            med = statistics.median(n.latency_ms for n in ns)
            for n in ns:
                if n.latency_ms >= STALL_MIN_MS and n.latency_ms > STALL_FACTOR * med:
                    out.append((key, n.name, round(n.latency_ms, 3), round(med, 4)))
                    n.latency_ms = med
    if out:
        import logging

        logging.getLogger("deepcompile").info(
            "profiler: %d node latencies looked stalled (the other rank's profiler spin) and were replaced by "
            "their op family's median, e.g. %s", len(out), out[:3])
    return out


def agree(profile: Profile, group=None) -> Profile:
    """Every rank's measurements combined element-wise, so all ranks decide alike: memory by
    the maximum, node latencies by the minimum (see below).

    Graphs are matched by key and structure. Ranks can profile different graphs for the same
    model: with per-rank dynamic padding one rank may run a static graph while another runs a
    symbolic one, or recompile during the step (a new graph id). Those graphs are dropped from the
    profile on every rank, with a warning: the passes plan them as they do without a profile, and
    every rank still decides alike. The communication model and the optimizer's time are always
    agreed."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        drop_stalls(profile)
        sustained.apply(profile)
        return profile
    mine = {k: _signature(g) for k, g in profile.graphs.items()}
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    keys = sorted(k for k in every[0] if all(e.get(k) == every[0][k] for e in every))
    dropped = sorted({k for e in every for k in e} - set(keys))
    if dropped:
        import warnings

        warnings.warn(
            f"deepcompile profiler: ranks profiled different graphs for {dropped} (graph id, kind): "
            "different input shapes per rank (dynamic padding), or a recompile during the profiling "
            "step on some ranks. Those graphs are planned without a node-level profile on every rank; "
            "the communication model is still measured. Pad to lengths every rank sees in the "
            "profiling step to profile them.", stacklevel=2)
        for k in dropped:
            profile.graphs.pop(k, None)
    # Latencies are agreed by their MINIMUM (carried negated through the one MAX all-reduce),
    # memory by its maximum. A node's work is the same on every rank, but on GPU a rank's
    # wait can absorb the *other* rank's profiler spin (_GpuLead parks each rank's compute stream
    # at its own moments, and a collective runs only when both ranks reach it): 2 H200s, 953M
    # Llama, one profiling step had 29 nodes at ~40 ms (SPIN_MS) and one at 654 ms on the slower
    # rank, and the maximum made the predicted step 192 ms against a measured 43.
    flat = [x for k in keys for n in profile.graphs[k].nodes
            for x in (-n.latency_ms, float(n.mem_after_bytes), float(n.peak_bytes), float(n.out_bytes))]
    flat.append(float(profile.optimizer_peak_bytes))
    flat.append(float(profile.optimizer_ms))
    flat.append(float((profile.sustained or {}).get("ratio") or 1.0))   # the most slowed rank's clock
    backend = dist.get_backend(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend) else torch.device("cpu")
    t = torch.tensor(flat, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    vals = t.cpu().tolist()
    i = 0
    ratio = vals.pop()
    if profile.sustained or ratio != 1.0:
        profile.sustained = dict(profile.sustained or {}, ratio=round(ratio, 4))
    profile.optimizer_ms = vals.pop()
    profile.optimizer_peak_bytes = int(vals.pop())
    if profile.host:   # every rank measures it on a GPU (or none does): the slowest host's pace
        from deepcompile.profile.host import HOST_US

        # a fixed list of op names on every rank (the tensor's length must match): HOST_US's kinds
        names = sorted(HOST_US)
        mine = profile.host.get("ops_us") or {}
        h = torch.tensor([float(profile.host.get(k) or 0.0) for k in HOST_KEYS]
                         + [float(mine.get(k) or 0.0) for k in names], dtype=torch.float64, device=dev)
        dist.all_reduce(h, op=dist.ReduceOp.MAX, group=group)
        hv = h.cpu().tolist()   # not `vals`: the nodes' agreed values are read from it below
        profile.host = dict(profile.host, **{k: round(v, 4) for k, v in zip(HOST_KEYS, hv)})
        if any(hv[len(HOST_KEYS):]):   # decided on the agreed values: every rank alike
            profile.host["ops_us"] = {k: round(v, 3) for k, v in zip(names, hv[len(HOST_KEYS):]) if v > 0}
    for k in keys:
        for n in profile.graphs[k].nodes:
            n.latency_ms, n.mem_after_bytes, n.peak_bytes, n.out_bytes = (
                -vals[i], int(vals[i + 1]), int(vals[i + 2]), int(vals[i + 3]))
            i += 4
    if profile.comm is not None:
        c = torch.tensor([profile.comm.alpha_us, 1.0 / profile.comm.bytes_per_us], dtype=torch.float64, device=dev)
        dist.all_reduce(c, op=dist.ReduceOp.MAX, group=group)
        a, inv_b = c.cpu().tolist()
        profile.comm = CommModel(alpha_us=a, bytes_per_us=1.0 / inv_b,
                                 copy_bytes_per_us=profile.comm.copy_bytes_per_us)
    if profile.replicate is not None:  # every rank has one under mesh.shard, none without
        rc = profile.replicate.comm
        c = torch.tensor([rc.alpha_us, 1.0 / rc.bytes_per_us], dtype=torch.float64, device=dev)
        dist.all_reduce(c, op=dist.ReduceOp.MAX, group=group)
        a, inv_b = c.cpu().tolist()
        profile.replicate = ReplicateLink(CommModel(alpha_us=a, bytes_per_us=1.0 / inv_b,
                                                    copy_bytes_per_us=rc.copy_bytes_per_us),
                                          profile.replicate.shard_world)
    drop_stalls(profile)   # on the agreed values: every rank replaces the same nodes
    sustained.apply(profile)   # (after: a stall is judged against its family's profiled latencies)
    return profile
