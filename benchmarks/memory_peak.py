"""What is live at a step's memory peak, from an allocator history written by
``BENCH_MEMORY_HISTORY`` (``zero3.py``) or any ``torch.cuda.memory._dump_snapshot`` pickle.

The history is replayed event by event (allocations and frees, bytes as the allocator rounds
them); at the highest point the live blocks are grouped by where they were allocated. For code
Inductor generated, the site is the generated line and the source nodes named just above it
(what the FX graph computed there), so a peak reads as graph ops, not buffer numbers; run it where
the generated files still are (the machine that ran) to get those names.

    python benchmarks/memory_peak.py SNAPSHOT.pickle [--top 30] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import linecache
import os
import pickle
import re

G = 2 ** 30
_NODES = re.compile(r"#\s*(Topologically Sorted )?Source Nodes?: \[([^\]]*)\](, Original ATen: \[([^\]]*)\])?")


def _generated(fn: str) -> bool:
    return "torchinductor" in fn  # Inductor's cache directory (TORCHINDUCTOR_CACHE_DIR keeps the name)


def _inductor_site(fn: str, line: int) -> str:
    """The generated line and the nearest source-nodes comment above it."""
    src = linecache.getline(fn, line).strip()
    for back in range(1, 60):
        m = _NODES.search(linecache.getline(fn, line - back))
        if m:
            aten = f" ({m.group(4)})" if m.group(4) else ""
            return f"{src[:60]} <- [{m.group(2)[:90]}]{aten}"
    return src[:100] or f"{os.path.basename(fn)}:{line}"


def site(frames: list) -> tuple[str, str]:
    """(phase, where): phase is backward when autograd's backward is on the stack."""
    names = [f.get("name", "") for f in frames]
    phase = "backward" if any(n == "backward" or n.endswith("_backward") for n in names) else "forward/other"
    for f in frames:
        fn = f.get("filename", "")
        if _generated(fn):
            return phase, "inductor: " + _inductor_site(fn, f.get("line", 0))
    for f in frames:  # the first frame outside torch itself: deepcompile's runtime, the model, the benchmark
        fn = f.get("filename", "")
        if "/torch/" not in fn and fn.endswith(".py"):
            return phase, f"{os.path.basename(fn)}:{f.get('line')}:{f.get('name')}"
    top = frames[0] if frames else {}
    return phase, f"torch {os.path.basename(top.get('filename', '?'))}:{top.get('line')}:{top.get('name')}"


def replay(events: list, start: int) -> dict:
    """Walk the history; the live set (addr -> event index) at the highest allocated point."""
    live: dict = {}
    cur = peak = start
    peak_i, peak_live = -1, {}
    for i, e in enumerate(events):
        a = e.get("action")
        if a == "alloc":
            live[e["addr"]] = i
            cur += e["size"]
            if cur > peak:
                peak, peak_i, peak_live = cur, i, dict(live)
        elif a == "free_requested":  # the allocator's allocated bytes drop here (a stream-used block
            # returns to the pool later, at free_completed, but it is no longer counted as allocated)
            live.pop(e["addr"], None)
            cur -= e["size"]
    return {"peak": peak, "peak_i": peak_i, "live": peak_live}


def analyse(snap: dict, top: int) -> dict:
    meta = snap.get("dc_bench", {})
    dev = next((i for i, t in enumerate(snap["device_traces"]) if t), 0)
    events = snap["device_traces"][dev]
    start = meta.get("allocated_at_start", 0)
    r = replay(events, start)
    groups: dict = collections.defaultdict(lambda: [0, 0, 10 ** 12])
    for addr, i in r["live"].items():
        e = events[i]
        key = site(e.get("frames") or [])
        g = groups[key]
        g[0] += e["size"]
        g[1] += 1
        g[2] = min(g[2], r["peak_i"] - i)
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    peak_site = site(events[r["peak_i"]].get("frames") or []) if r["peak_i"] >= 0 else ("", "")
    return {
        "allocated_at_start_gib": start / G,
        "measured_fb_peak_gib": meta.get("fb_peak", 0) / G if meta else None,
        "replayed_peak_gib": r["peak"] / G,
        "peak_event": r["peak_i"], "events": len(events),
        "peak_at": {"phase": peak_site[0], "site": peak_site[1]},
        "live_in_history_gib": sum(v[0] for _, v in rows) / G,
        "live": [{"phase": k[0], "site": k[1], "bytes": v[0], "gib": round(v[0] / G, 4), "blocks": v[1],
                  "events_before_peak": v[2]} for k, v in rows[:top]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()
    with open(a.snapshot, "rb") as f:
        res = analyse(pickle.load(f), a.top)
    print(f"allocated when the recording began {res['allocated_at_start_gib']:.3f} GiB; peak replayed "
          f"{res['replayed_peak_gib']:.3f} GiB (measured forward/backward peak "
          f"{res['measured_fb_peak_gib'] or 0:.3f}) at event {res['peak_event']} of {res['events']}: "
          f"{res['peak_at']['phase']}, {res['peak_at']['site']}")
    print(f"live at the peak, allocated during the step: {res['live_in_history_gib']:.3f} GiB")
    for r in res["live"]:
        print(f"{r['gib']:8.3f} GiB {r['blocks']:4d} blk {r['events_before_peak']:7d} ev ago  {r['phase']:13s} {r['site']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
