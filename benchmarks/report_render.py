"""Time ``render_report`` on a 16-layer model's record (CPU only, no GPU needed).

Builds the record by really tracing a 16-layer GPT (n_embd 256, 8 heads; the embedded
nanoGPT-shaped decoder, standing in for a Llama-style stack of identical blocks) through the
deepcompile backend on one gloo rank for two steps, then renders the report several times with
graphviz ``dot`` (when installed) and with the built-in fallback layout. Each timed render starts
cold (``level_layout.LEVEL_CACHE`` emptied: every layout made again); ``warm_s`` is one more
render with the layouts of the previous one cached (a second report from the same process).
``--layers 16 32`` times several depths; ``before`` in the JSON keeps the numbers of the old
cluster layout (labelled edges, one graphviz run per picture, no module levels), measured with
this script on the same machine before the report moved to the per-module layout.

    python benchmarks/report_render.py [--layers 16 32] [--out benchmarks/results/report_render_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_record(run_dir: Path, n_layer: int) -> float:
    import torch
    import torch.distributed as dist

    import deepcompile
    from deepcompile.models import GPT, GPTConfig
    from deepcompile.plan import estimate
    from deepcompile.record.writer import RunRecorder

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    c = GPTConfig(n_layer=n_layer, n_embd=256, n_head=8, block_size=64)
    model, opt = deepcompile.initialize(GPT(c), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                        {"compiler": "aot_eager"})
    rec = RunRecorder(run_dir, 0, 1, model.dc_config)
    model.dc_backend.observers.append(rec.graph_version)
    for step in (1, 2):
        x = torch.randint(0, c.vocab_size, (2, c.block_size))
        t = time.perf_counter()
        loss = model(x, (x * 7 + 3) % c.vocab_size)
        loss.backward()
        opt.step()
        opt.zero_grad()
        rec.step(step, time.perf_counter() - t, loss.item())
    ev, sm = estimate.estimate_versions(model.dc_graphs)
    rec.schedule(ev)
    rec.memory(sm)
    rec.close()
    dist.destroy_process_group()
    return time.perf_counter() - t0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


BEFORE = {   # the old cluster layout (commit fd1d955), this script on the machine below, 2026-11-21
    "layout": "one graphviz cluster graph per version with edge-count labels; no module levels",
    "16": {"dot": {"seconds": [0.496, 0.888, 0.501], "median_s": 0.501, "html_bytes": 2698827},
           "fallback": {"seconds": [0.21, 0.524, 0.214], "median_s": 0.214, "html_bytes": 2028851}},
    "32": {"dot": {"seconds": [5.618, 3.962, 3.349], "median_s": 3.962, "html_bytes": 5308428},
           "fallback": {"seconds": [0.88, 0.388, 1.0], "median_s": 0.88, "html_bytes": 3977730}},
    # the 2-core machine is shared, so single runs drift: old and new render_report alternated five
    # times on the same two records in one sitting (cold; medians, seconds)
    "interleaved_medians_s": {
        "old": {"16/dot": 0.525, "16/fallback": 0.338, "32/dot": 3.85, "32/fallback": 0.593},
        "new": {"16/dot": 0.669, "16/fallback": 0.635, "32/dot": 1.293, "32/fallback": 1.03}},
}


def time_report(run: Path, d: Path, repeat: int, keep_html: str | None) -> dict:
    import subprocess as sp

    from deepcompile.report import level_layout as L
    from deepcompile.report.html import render_report

    results = {}
    modes = [("dot", True)] if L.have_dot() else []
    modes.append(("fallback", False))
    real_run = sp.run
    calls = []

    def counting(cmd, *args, **kw):
        if cmd and cmd[0] == "dot":
            calls.append(1)
        return real_run(cmd, *args, **kw)

    for name, dot in modes:
        orig = L.have_dot
        L.have_dot = (lambda: dot)
        L.subprocess.run = counting
        times = []
        try:
            for _ in range(repeat):
                L.LEVEL_CACHE.clear()
                calls.clear()
                t = time.perf_counter()
                out = render_report(run, d / f"report-{name}.html")
                times.append(time.perf_counter() - t)
            n_proc, n_layouts = len(calls), len(L.LEVEL_CACHE)
            t = time.perf_counter()
            render_report(run, d / f"report-{name}-warm.html")
            warm = time.perf_counter() - t
            if keep_html and name == modes[0][0]:
                shutil.copy(out, keep_html)
            text = out.read_text()
        finally:
            L.have_dot = orig
            L.subprocess.run = real_run
        m = re.search(r"<script type='application/json' id='dc-levels'>(.*?)</script>", text, re.S)
        lv = json.loads(m.group(1)) if m else {"s": [], "v": []}
        results[name] = {"seconds": [round(x, 3) for x in times], "median_s": round(statistics.median(times), 3),
                         "warm_s": round(warm, 3), "html_bytes": out.stat().st_size,
                         "levels_json_bytes": len(m.group(1)) if m else 0,
                         "pictures": text.count('<svg class="graph '),
                         "pictures_drawn_by_dot": text.count('<svg class="graph dot'),
                         "module_levels": sum(len(v) for v in lv["v"]), "level_skeletons": len(lv["s"]),
                         "graphviz_layouts": n_layouts, "graphviz_processes": n_proc}
        print(f"render_report ({name}): median {statistics.median(times):.2f} s over {repeat} cold runs, "
              f"warm {warm:.2f} s, {out.stat().st_size / 1e6:.2f} MB, {results[name]['module_levels']} module "
              f"levels in {len(lv['s'])} skeletons, {n_layouts} graphviz layouts in {n_proc} processes", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[16], help="model depths to time (default 16)")
    ap.add_argument("--repeat", type=int, default=3, help="cold renders per layout (median reported)")
    ap.add_argument("--keep-html", default=None,
                    help="copy the first depth's report (graphviz layout when installed) to this path")
    ap.add_argument("--records", default=None,
                    help="keep the traced records in DIR/run<layers> and reuse them when present")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "report_render_cpu.json"))
    a = ap.parse_args()

    from deepcompile.record.reader import read_run

    runs = {}
    with tempfile.TemporaryDirectory() as d:
        for k, n in enumerate(a.layers):
            run = Path(a.records or d) / f"run{n}"
            build_s = None
            if not (run / "manifest.json").exists():
                build_s = round(build_record(run, n), 2)
            rec = read_run(run)
            versions = {f"{v.graph_id}/{v.kind}/{v.after}#{v.seq}": len(v.nodes) for v in rec.graphs}
            print(f"{n} layers: {len(versions)} graph versions, {sum(versions.values())} nodes", flush=True)
            runs[str(n)] = {"graph_versions": versions, "record_build_s": build_s,
                            "results": time_report(run, Path(d), a.repeat, a.keep_html if k == 0 else None)}
    dot_version = ""
    if shutil.which("dot"):
        dot_version = subprocess.run(["dot", "-V"], capture_output=True, text=True).stderr.strip()
    import torch

    doc = {
        "benchmark": "report_render", "layers": a.layers, "model": "deepcompile.models.GPT n_embd=256 n_head=8",
        "layout": "per-module levels (module_pictures.module_levels): collapsed top level per version, every module's "
                  "inside pre-rendered (skeleton + strings), graphviz once per distinct level text, in <= workers "
                  "processes",
        "runs": runs, "before": BEFORE, "target_s": 10.0,
        "machine": {"hostname": socket.gethostname(), "cpu": cpu_name(),
                    "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__, "graphviz": dot_version},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
