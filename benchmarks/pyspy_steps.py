#!/usr/bin/env python
"""Read a py-spy speedscope file of a zero3.py run (benchmarks/pyspy_compile.sh): for each rank's
main thread, the seconds of each warm-up step's forward, backward and optimizer step, and where
they went (the innermost deepcompile function on the stack | the leaf frame); then each other
thread's stretches inside deepcompile code (the autograd thread runs the backward on CUDA).

    python benchmarks/pyspy_steps.py FILE.json.gz [--steps 4] [--top 12]

Samples are taken every 1/rate s (py-spy -r, 100 Hz in pyspy_compile.sh; idle stacks kept). py-spy
reads no stack while Dynamo runs a frame (those samples are missing), so the step-0 forward here
is shorter than the step's wall time by about Dynamo's phase.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json

def _statements() -> dict[int, str]:
    """train_steps' line numbers in this checkout's zero3.py -> fwd / bwd / opt (the profile must
    come from the same zero3.py)."""
    import os

    src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero3.py")).read().splitlines()
    start = next(i for i, ln in enumerate(src) if ln.startswith("def train_steps"))
    out: dict[int, str] = {}
    for i in range(start, len(src)):
        if i > start and src[i].startswith("def "):
            break
        for kind, text in (("fwd", "out = model(input_ids=x"), ("bwd", "loss.backward()"), ("opt", "opt.step()")):
            if text in src[i] and kind not in out.values():
                out[i + 1] = kind
    return out


STATEMENTS = _statements()


def _label(fs):
    dc = [f for f in fs if "/deepcompile/" in f.get("file", "")]
    inner = f"{dc[-1]['name']}:{dc[-1].get('line')}" if dc else "-"
    leaf = fs[-1] if fs else {"name": "-", "file": "", "line": 0}
    return inner, f"{leaf['name']}:{leaf.get('file', '').split('/')[-1]}:{leaf.get('line')}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args(argv)
    d = json.load(gzip.open(a.file) if a.file.endswith(".gz") else open(a.file))
    fr = d["shared"]["frames"]
    profs = d["profiles"]
    ranks = [q for q in profs if any(fr[i]["name"] == "train_steps" for s in q["samples"][:: max(1, len(q["samples"]) // 200)] for i in s)]
    for q in ranks:
        dt = q["weights"][0] if q["weights"] else 0.01
        segs, step, prev, cur = collections.defaultdict(list), -1, None, None
        for s in q["samples"]:
            fs = [fr[i] for i in s]
            tl = [f for f in fs if f["name"] == "train_steps"]
            if tl:
                kind = STATEMENTS.get(tl[0].get("line"), "other")
                if kind == "fwd" and prev != "fwd":
                    step += 1
                prev, cur = kind, (step, kind)
            if cur is not None and cur[0] <= a.steps:
                segs[cur].append(fs)
        print(f"### {q['name']}")
        for (st, kind), lst in sorted(segs.items()):
            print(f"== step {st} {kind}: {len(lst) * dt:.2f} s sampled")
            c = collections.Counter(_label(fs) for fs in lst)
            for (inner, leaf), n in c.most_common(a.top):
                print(f"   {n * dt:6.2f}  {inner[:60]:60s} | {leaf[:70]}")
        pid = q["name"].split()[1]
        for t in profs:
            if t is q or not t["name"].startswith(f"Process {pid} "):
                continue
            blocks, curb = [], None
            for s in t["samples"]:
                fs = [fr[i] for i in s]
                if any("/deepcompile/" in f.get("file", "") for f in fs):
                    if curb is None:
                        curb = []
                        blocks.append(curb)
                    curb.append(fs)
                else:
                    curb = None
            for b in blocks:
                if len(b) * dt < 0.2:
                    continue
                print(f"-- {t['name'][:60]}: {len(b) * dt:.2f} s in deepcompile code")
                for (inner, leaf), n in collections.Counter(_label(fs) for fs in b).most_common(4):
                    print(f"   {n * dt:6.2f}  {inner[:60]:60s} | {leaf[:70]}")


if __name__ == "__main__":
    main()
