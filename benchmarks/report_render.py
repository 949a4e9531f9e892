"""Time ``render_report`` on a 16-layer model's record (CPU only, no GPU needed).

Builds the record by really tracing a 16-layer GPT (n_embd 256, 8 heads; the embedded
nanoGPT-shaped decoder, standing in for a Llama-style stack of identical blocks) through the
deepcompile backend on one gloo rank for two steps, then renders the report several times with
graphviz ``dot`` (when installed) and with the built-in fallback layout.

    python benchmarks/report_render.py [--out benchmarks/results/report_render_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
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
    from deepcompile.record import estimate
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep-html", default=None, help="copy the rendered reports to PATH.{dot,fallback}.html")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "report_render_cpu.json"))
    a = ap.parse_args()

    from deepcompile.record.reader import read_run
    from deepcompile.report import graph_layout as L
    from deepcompile.report.html import render_report

    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        build_s = build_record(run, a.layers)
        rec = read_run(run)
        versions = {f"{v.graph_id}/{v.kind}/{v.after}": len(v.nodes) for v in rec.graphs}
        results = {}
        modes = [("dot", True)] if L.have_dot() else []
        modes.append(("fallback", False))
        for name, dot in modes:
            orig = L.have_dot
            L.have_dot = (lambda: dot)
            times = []
            try:
                for _ in range(a.repeat):
                    t = time.perf_counter()
                    out = render_report(run, Path(d) / f"report-{name}.html")
                    times.append(time.perf_counter() - t)
                if a.keep_html:
                    shutil.copy(out, Path(a.keep_html).with_suffix(f".{name}.html"))
                n_dot = out.read_text().count('class="graph dot"')
            finally:
                L.have_dot = orig
            results[name] = {"seconds": [round(x, 3) for x in times], "median_s": round(statistics.median(times), 3),
                             "html_bytes": out.stat().st_size,
                             "graphs_drawn_by_dot": n_dot}
            print(f"render_report ({name}): median {statistics.median(times):.2f} s over {a.repeat} "
                  f"runs, {out.stat().st_size / 1e6:.2f} MB", flush=True)
    dot_version = ""
    if shutil.which("dot"):
        dot_version = subprocess.run(["dot", "-V"], capture_output=True, text=True).stderr.strip()
    import torch

    doc = {
        "benchmark": "report_render", "layers": a.layers, "model": "deepcompile.models.GPT n_embd=256 n_head=8",
        "graph_versions": versions, "record_build_s": round(build_s, 2), "results": results,
        "target_s": 10.0,
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
