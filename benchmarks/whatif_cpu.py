"""The what-if's predictions on the CPU, against runs that measure them.

Runs the CPU demo (2 gloo ranks) with its default plan, then once per edit with that edit's pass
values (what the inspector's Run launches), and predicts every edit from the default plan's record
(``plan.whatif.predict_run``, what the inspector's Passes tab shows). Each run in its own
processes, one after the other. ``--repeats R`` runs that sequence R times: on a shared 2-core
machine one run's steady median of the same plan moved 15-25 ms between invocations minutes
apart, so a row's measured step is the median of the R runs' steady steps pooled, and its
prediction the median of the R default-plan records' predictions.

    python benchmarks/whatif_cpu.py --steps 40 --repeats 3 --out benchmarks/results/whatif_vs_measured_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

PASSES = "zero3,prefetch,selective_unshard"
# (label, --pass-param values the run gets, the same values as the what-if's pass list)
EDITS = [
    ("selective_unshard 0, prefetch budget 0", {"selective_unshard.budget_mb": 0, "prefetch.budget_mb": 0}),
    ("selective_unshard 0.25 MiB, prefetch budget 0", {"selective_unshard.budget_mb": 0.25, "prefetch.budget_mb": 0}),
    ("selective_unshard 0, prefetch 64 MiB", {"selective_unshard.budget_mb": 0, "prefetch.budget_mb": 64}),
    ("selective_unshard 0, prefetch 64 MiB unfused", {"selective_unshard.budget_mb": 0, "prefetch.budget_mb": 64,
                                                        "prefetch.fuse_mb": 0}),
    ("selective_unshard 0, prefetch 0 unfused", {"selective_unshard.budget_mb": 0, "prefetch.budget_mb": 0,
                                                  "prefetch.fuse_mb": 0}),
]


def demo(out: str, steps: int, params: dict | None) -> None:
    cmd = [sys.executable, "-m", "deepcompile", "demo", "--cpu", "--ranks", "2", "--steps", str(steps), "--out", out]
    if params is not None:
        cmd += ["--passes", PASSES]
        for k, v in params.items():
            cmd += ["--pass-param", f"{k}={v}"]
    print(" ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)


def passes_of(params: dict) -> list[dict]:
    """The what-if's pass list for a run's --pass-param values: every pass of PASSES, its edited
    values, and the declared defaults for the rest (what the run compiled)."""
    import dataclasses

    from deepcompile.passes import PASSES as REG

    out = []
    for name in PASSES.split(","):
        full = dataclasses.asdict(REG[name].params_cls())
        full.update({k.split(".", 1)[1]: v for k, v in params.items() if k.split(".", 1)[0] == name})
        out.append({"name": name, "params": full})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=1, help="run the default plan and every edit this many times")
    ap.add_argument("--out", default=None, help="JSON to write (default: print only)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: at least 1")

    from deepcompile.plan.whatif import own_passes, predict_run
    from deepcompile.record.reader import read_run
    from deepcompile.record.steps import steady_median_ms, steady_ms

    work = tempfile.mkdtemp(prefix="whatif_cpu_")
    t0 = time.time()
    bases, runs = [], {}   # runs: label -> (run directories, the what-if's pass list)
    for r in range(args.repeats):
        base = os.path.join(work, f"base{r}")
        demo(base, args.steps, None)
        bases.append(base)
        runs.setdefault("recorded plan", ([], own_passes(base)))[0].append(base)
        for i, (label, params) in enumerate(EDITS):
            d = os.path.join(work, f"edit{i}_{r}")
            demo(d, args.steps, params)
            runs.setdefault(label, ([], passes_of(params)))[0].append(d)
    rows = []
    for label, (dirs, passes) in runs.items():
        steady, run_ms = [], []
        for d in dirs:
            rec = read_run(d)
            run_ms.append(round(steady_median_ms(rec.steps, rec.config)[0], 2))
            steady += steady_ms(rec.steps, rec.config)
        steady.sort()
        measured = statistics.median(steady)
        ws = [predict_run(b, passes) for b in bases]
        w = sorted(ws, key=lambda x: x.step_ms)[len(ws) // 2]
        # the fastest tenth of the steady steps beside the median: on a busy 2-core machine a step
        # with many collectives waits for the scheduler at some of them (the spread shows how much)
        rows.append({"edit": label, "measured_ms": round(measured, 2), "runs_ms": run_ms, "steady_steps": len(steady),
                     "fastest_tenth_ms": round(steady[len(steady) // 10], 2) if steady else None,
                     "predicted_ms": round(w.step_ms, 2), "model_ms": round(w.model_step_ms, 2),
                     "calibration_ms": None if w.calibration is None else round(w.calibration, 2),
                     "error": round(w.step_ms / measured - 1, 4), "passes": passes})
    result = {"benchmark": "whatif_cpu", "device": f"CPU ({platform.processor() or platform.machine()}, "
                                                   f"{os.cpu_count()} cores), 2 gloo ranks",
              "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]), "steps": args.steps,
              "repeats": args.repeats,
              "seconds": round(time.time() - t0, 1), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{'edit':<48}{'measured':>10}{'fastest 10%':>13}{'predicted':>11}{'error':>8}  runs")
    for r in rows:
        print(f"{r['edit']:<48}{r['measured_ms']:>8.1f}ms{r['fastest_tenth_ms']:>11.1f}ms"
              f"{r['predicted_ms']:>9.1f}ms{100 * r['error']:>+7.1f}%  {' '.join(f'{x:.1f}' for x in r['runs_ms'])}")


if __name__ == "__main__":
    main()
