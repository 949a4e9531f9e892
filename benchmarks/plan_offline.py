#!/usr/bin/env python
"""The planner, run offline on a recorded run (graphs + agreed profile), without a GPU: which plan
it would choose under a memory limit, every candidate's predicted step and peak, and, with
``--gb-per-s``, under another link speed (the recorded profile's communication model with its
bandwidth replaced: what --slow-links measures on the GPUs). With ``--set``, the what-if of one
pass list instead (``deepcompile.plan.whatif.predict_run``).

    BENCH_GRAPHS=DIR torchrun ... benchmarks/zero3.py --systems dc_default   # a run record in DIR/dc_default
    python benchmarks/plan_offline.py benchmarks/results/zero3_h200_2gpu_dc_default_record \
        --limit-gib 126.9 [--gb-per-s 40] [--optimizer-peak-gib 8.5]
    python benchmarks/plan_offline.py RECORD --set prefetch.budget_mb=0 --set selective_unshard.budget_mb=auto

The machinery (graphs rebuilt from the record, cached per record) is ``deepcompile.plan.whatif``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from deepcompile.plan.memory import GIB  # noqa: E402
from deepcompile.plan.whatif import plan_record as _plan_record  # noqa: E402
from deepcompile.plan.whatif import load_base, predict_base, predict_run, variant  # noqa: E402


def plan_record(record: str, world: int | None = None, limit_gib: float | None = None,
                capacity_gib: float | None = None, gb_per_s: float | None = None, alpha_us: float | None = None,
                optimizer_peak_gib: float | None = None, accumulation: int | None = None,
                compiler: str | None = None):
    """(plan, facts, profile, [(candidate, predicted ms)]) of the planner on ``record``
    (``deepcompile.plan.whatif.plan_record``; this signature is the one tests/test_planner.py uses)."""
    plan, b, seen = _plan_record(record, limit_gib=limit_gib, world=world, capacity_gib=capacity_gib,
                                 gb_per_s=gb_per_s, alpha_us=alpha_us, optimizer_peak_gib=optimizer_peak_gib,
                                 accumulation=accumulation, compiler=compiler)
    return plan, b.facts, b.profile, seen


def _value(v: str):
    try:
        return json.loads(v)
    except ValueError:
        return v


def whatif(a) -> None:
    passes = {"zero3": {}, "prefetch": {}, "selective_unshard": {}}
    for s in a.set:
        key, _, v = s.partition("=")
        name, _, param = key.partition(".")
        if not param or not _:
            raise SystemExit(f"--set {s!r}: expected NAME.KEY=VALUE, e.g. prefetch.budget_mb=0")
        passes.setdefault(name, {})[param] = _value(v)
    entries = [{"name": n, "params": p} for n, p in passes.items()]
    t = time.perf_counter()
    w = predict_run(a.record, entries, rank=a.rank, memory_limit_gib=a.limit_gib)
    print(f"what-if ({time.perf_counter() - t:.2f} s, {w.seconds:.2f} s in predict_run): step {w.step_ms:.1f} ms "
          f"(GPU timeline {w.gpu_ms:.1f}" + (f", host {w.host_ms:.1f}" if w.host_ms else "") + f"), peak "
          f"{w.peak_bytes / GIB:.2f} GiB at the {w.peak_where}")
    print("memory GiB:", {k: round(v / GIB, 3) for k, v in w.memory.items()})
    print("params:", json.dumps({k: v for k, v in w.params.items() if v}))
    for n in w.notes:
        print(" -", n[:300])


def compare(a) -> None:
    """The what-if of each dc system's chosen plan (the result JSON's predicted.plan) on this
    record, beside what that system measured: step, host time, peak."""
    rows = []
    for path in a.compare:
        d = json.loads(open(path).read())
        for name, v in (d.get("systems") or {}).items():
            plan = ((v.get("predicted") or {}).get("plan") or {}).get("chosen") or {}
            params = plan.get("params")
            if not params or not v.get("median_step_s"):
                continue
            entries = [{"name": "zero3"}] + [{"name": n, "params": p} for n, p in params.items()]
            # the run's own measurements where the result has them (its comm model, optimizer
            # step, memory facts), the record's graphs and per-node latencies for the rest
            pred = v["predicted"]
            cm = pred.get("comm_model") or {}
            b = variant(load_base(a.record, a.rank), gb_per_s=cm.get("allgather_gb_per_s"),
                        alpha_us=cm.get("alpha_us"), optimizer_ms=pred.get("optimizer_ms"),
                        facts=pred["plan"].get("facts"))
            w = predict_base(b, entries)
            ms, host = v["median_step_s"] * 1e3, (v.get("host_step_s") or 0) * 1e3
            peak = v.get("peak_mem_gib") or 0
            rows.append({"result": os.path.basename(path), "system": name, "params": params,
                         "measured_step_ms": round(ms, 2), "measured_host_ms": round(host, 2),
                         "predicted_step_ms": w.step_ms, "step_error": round(w.step_ms / ms - 1, 4),
                         "run_predicted_step_ms": plan.get("step_ms"), "measured_peak_gib": round(peak, 3),
                         "predicted_peak_gib": round(w.peak_bytes / GIB, 3),
                         "peak_error": round(w.peak_bytes / GIB / peak - 1, 4) if peak else None,
                         "whatif_s": w.seconds})
            r = rows[-1]
            print(f"{r['result']:40} {name:22} step {ms:6.1f} (host {host:5.1f}) predicted {w.step_ms:6.1f} "
                  f"({r['step_error']:+.1%}; the run's planner said {plan.get('step_ms')}), peak {peak:6.2f} "
                  f"predicted {r['predicted_peak_gib']:6.2f}" + (f" ({r['peak_error']:+.1%})" if peak else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"record": a.record, "rows": rows}, f, indent=1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("record")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=None, help="world size (default: the record's, from its gathers)")
    ap.add_argument("--limit-gib", type=float, default=None, help="memory limit (default 90%% of the capacity)")
    ap.add_argument("--capacity-gib", type=float, default=None, help="device capacity (default: the record's)")
    ap.add_argument("--gb-per-s", type=float, default=None, help="replace the profile's allgather bandwidth")
    ap.add_argument("--alpha-us", type=float, default=None, help="replace the profile's per-collective latency")
    ap.add_argument("--optimizer-peak-gib", type=float, default=None,
                    help="the optimizer step's peak (older records did not measure it)")
    ap.add_argument("--accumulation", type=int, default=None)
    ap.add_argument("--compiler", default=None, help="the final compiler (default: the record's config)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME.KEY=VALUE",
                    help="what-if of zero3+prefetch+selective_unshard with these parameters ('auto': planned)")
    ap.add_argument("--compare", action="append", default=[], metavar="RESULT_JSON",
                    help="what-if of each dc system's chosen plan in a benchmarks/zero3.py result, beside its measurement")
    ap.add_argument("--out", default=None, help="with --compare: write the rows as JSON")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(a)
    if a.set:
        return whatif(a)
    t, c0 = time.perf_counter(), time.process_time()
    plan, b, seen = _plan_record(a.record, rank=a.rank, limit_gib=a.limit_gib, world=a.world,
                                capacity_gib=a.capacity_gib, gb_per_s=a.gb_per_s, alpha_us=a.alpha_us,
                                optimizer_peak_gib=a.optimizer_peak_gib, accumulation=a.accumulation,
                                compiler=a.compiler)
    facts, prof = b.facts, b.profile
    print(f"profile: forward/backward peak {facts.fb_peak / GIB:.2f} GiB at {facts.fb_peak_at}; optimizer step "
          f"{facts.optimizer_peak / GIB:.2f} GiB; gathered parameters {facts.gathered_total / GIB:.2f} GiB; "
          f"comm alpha {prof.comm.alpha_us:.0f} us, {prof.comm.bytes_per_us / 1e3:.0f} GB/s; world {b.world}")
    print(f"{'keep MiB':>10} {'prefetch':>9} {'fuse':>6} {'kept GiB':>9} {'offload':>8} {'peak GiB':>9} {'step ms':>9}")
    for c, ms in sorted(seen, key=lambda x: x[1]):
        print(f"{c.keep_mb:10.1f} {c.prefetch_mb:9.0f} {c.fuse_mb:6.0f} {c.kept / GIB:9.2f} {c.offloaded / GIB:8.2f} "
              f"{c.memory.peak / GIB:9.2f} {ms:9.1f}")
    print(plan.summary_line())
    print("why:", plan.why)
    print(f"planned in {time.perf_counter() - t:.2f} s wall, {time.process_time() - c0:.2f} s CPU ({b.seconds:.2f} s "
          f"reading and rebuilding the record; {len(seen)} of {plan.fitting} fitting plans priced, the rest cut by the "
          "coarse-to-fine search, planner.price)")


if __name__ == "__main__":
    main()
