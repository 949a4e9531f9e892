"""Inspector responsiveness on a 32-layer Llama-style model (not a timed test: a benchmark).

Measures, with the graph view's model (``widgets.graph_view.GraphModel``, the same code the
notebook widget calls):

* time to first render of the collapsed forward and backward graphs after ``zero3``
  (a fresh model: grouping + graphviz layout + decoration; target < 2 s each);
* time to expand one decoder layer (target < 200 ms), from a cold layout cache (the user has
  the collapsed picture, then clicks a layer), and to expand another, identical layer (its inside
  is then a cache hit: the per-module layouts are cached by structural signature);
* time to expand the ``inputs`` box (hundreds of placeholders: too many for graphviz in one
  level, so that level switches to the order-based layout);
* time to render the diff of two passes (input vs zero3, zero3 vs prefetch-style hoisting);
* the same with the built-in order-based layout (no graphviz), for comparison.

Every graphviz timing starts from an empty layout cache unless it says otherwise. The numbers of
the previous result file (``--out``) are kept under ``"previous"`` for before/after comparison.

The graphs are synthesised in the record's serialize format (``deepcompile.record.graph``):
per layer RMSNorm, q/k/v/o projections, rotary embedding, attention, RMSNorm, SwiGLU MLP,
residual adds; ``zero3`` versions add allgather/wait/release per parameter (and reduce_grad in
the backward, where, as AOTAutograd does, most nodes carry no module scope).

    python benchmarks/inspector.py [--layers 32] [--repeat 3] [--model [--record DIR]] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PARAMS = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


class G:
    def __init__(self):
        self.nodes: list[dict] = []
        self.count: dict[str, int] = {}

    def add(self, target: str, args: list, scope: str = "", shape=None, op="call_function", param=None,
            name=None) -> str:
        base = name or target.split(".")[-1]
        k = self.count.get(base, 0)
        self.count[base] = k + 1
        nm = base if k == 0 else f"{base}_{k}"
        n = {"name": nm, "op": op, "target": target if op != "placeholder" else nm,
             "args": [{"node": a} if isinstance(a, str) and a in self._names else a for a in args],
             "shape": shape or [4, 2048, 4096], "dtype": "bfloat16", "scope": scope}
        if param is not None:
            n["param"] = param
        self.nodes.append(n)
        self._names.add(nm)
        return nm

    _names: set = set()


def _pid(layer: int, j: int) -> int:
    return layer * len(PARAMS) + j + 1


def forward(layers: int, zero3: bool, hoist: int = 0) -> list[dict]:
    g = G()
    g._names = set()
    x = g.add("tokens", [], op="placeholder", shape=[4, 2048])
    shards = {}
    for i in range(layers):
        for j, p in enumerate(PARAMS):
            shards[(i, j)] = g.add(f"primals_{_pid(i, j)}", [], op="placeholder", shape=[4096 * 4096 // 2])
    emb = g.add("aten.embedding", [x], "embed_tokens")
    h = emb

    def weight(i, j):
        scope = f"layers.{i}.{PARAMS[j]}"
        if not zero3:
            return shards[(i, j)], None
        ag = g.add("dc.allgather_param", [shards[(i, j)], _pid(i, j)], scope + ".weight.0", param=_pid(i, j))
        w = g.add("dc.wait_allgather", [ag, _pid(i, j)], scope + ".weight.0", shape=[4096, 4096], param=_pid(i, j))
        return w, (ag, w)

    def release(i, j, w):
        if zero3:
            g.add("dc.release_param", [w, _pid(i, j)], f"layers.{i}.{PARAMS[j]}.weight.0", param=_pid(i, j))

    for i in range(layers):
        L = f"layers.{i}"
        w, _ = weight(i, 0)
        t = g.add("aten.pow", [h, 2], f"{L}.input_layernorm")
        t = g.add("aten.mean", [t, [-1], True], f"{L}.input_layernorm")
        t = g.add("aten.add", [t, 1e-6], f"{L}.input_layernorm")
        t = g.add("aten.rsqrt", [t], f"{L}.input_layernorm")
        t = g.add("aten.mul", [h, t], f"{L}.input_layernorm")
        n1 = g.add("aten.mul", [t, w], f"{L}.input_layernorm")
        release(i, 0, w)
        qkv = []
        for j in (1, 2, 3):
            w, _ = weight(i, j)
            wt = g.add("aten.t", [w], f"{L}.{PARAMS[j]}")
            qkv.append(g.add("aten.mm", [n1, wt], f"{L}.{PARAMS[j]}"))
            release(i, j, w)
        q, k, v = (g.add("aten.view", [a, [4, 2048, 32, 128]], f"{L}.self_attn") for a in qkv)
        for a in (q, k):
            c = g.add("aten.mul", [a, "cos"], f"{L}.self_attn.rotary_emb")
            s = g.add("aten.slice", [a, -1, 0, 64], f"{L}.self_attn.rotary_emb")
            s2 = g.add("aten.neg", [s], f"{L}.self_attn.rotary_emb")
            s3 = g.add("aten.cat", [[s2, s], -1], f"{L}.self_attn.rotary_emb")
            g.add("aten.add", [c, s3], f"{L}.self_attn.rotary_emb")
        att = g.add("aten._scaled_dot_product_flash_attention", [q, k, v], f"{L}.self_attn")
        att = g.add("aten.view", [att, [4, 2048, 4096]], f"{L}.self_attn")
        w, _ = weight(i, 4)
        wt = g.add("aten.t", [w], f"{L}.self_attn.o_proj")
        o = g.add("aten.mm", [att, wt], f"{L}.self_attn.o_proj")
        release(i, 4, w)
        h = g.add("aten.add", [h, o], L)
        w, _ = weight(i, 5)
        t = g.add("aten.pow", [h, 2], f"{L}.post_attention_layernorm")
        t = g.add("aten.mean", [t, [-1], True], f"{L}.post_attention_layernorm")
        t = g.add("aten.rsqrt", [t], f"{L}.post_attention_layernorm")
        n2 = g.add("aten.mul", [h, t, w], f"{L}.post_attention_layernorm")
        release(i, 5, w)
        outs = []
        for j in (6, 7):
            w, _ = weight(i, j)
            wt = g.add("aten.t", [w], f"{L}.{PARAMS[j]}")
            outs.append(g.add("aten.mm", [n2, wt], f"{L}.{PARAMS[j]}", shape=[4, 2048, 11008]))
            release(i, j, w)
        a = g.add("aten.silu", [outs[0]], f"{L}.mlp.act_fn", shape=[4, 2048, 11008])
        m = g.add("aten.mul", [a, outs[1]], f"{L}.mlp", shape=[4, 2048, 11008])
        w, _ = weight(i, 8)
        wt = g.add("aten.t", [w], f"{L}.mlp.down_proj")
        d = g.add("aten.mm", [m, wt], f"{L}.mlp.down_proj")
        release(i, 8, w)
        h = g.add("aten.add", [h, d], L)
    t = g.add("aten.mul", [h, 1.0], "norm")
    out = g.add("aten.mm", [t, "lm_head"], "lm_head", shape=[4, 2048, 32000])
    g.add("output", [[out]], op="output")
    nodes = g.nodes
    if hoist:  # prefetch-style: move each allgather_param `hoist` gathers earlier
        ags = [i for i, n in enumerate(nodes) if n["target"] == "dc.allgather_param"]
        order = list(range(len(nodes)))
        for k in range(hoist, len(ags)):
            src, dst = ags[k], ags[k - hoist]
            order.remove(src)
            order.insert(order.index(dst), src)
        nodes = [nodes[i] for i in order]
    return nodes


def backward(layers: int, zero3: bool) -> list[dict]:
    g = G()
    g._names = set()
    grad = g.add("tangents_1", [], op="placeholder")
    saved = [g.add(f"saved_{i}", [], op="placeholder") for i in range(layers * 6)]
    shards = {(i, j): g.add(f"primals_{_pid(i, j)}", [], op="placeholder", shape=[4096 * 4096 // 2])
              for i in range(layers) for j in range(len(PARAMS))}
    h = g.add("aten.mm", [grad, "lm_head"], "")
    grads_out = []
    for i in reversed(range(layers)):
        for j in reversed(range(len(PARAMS))):
            scope = f"layers.{i}.{PARAMS[j]}.weight.0"
            if zero3:
                ag = g.add("dc.allgather_param", [shards[(i, j)], _pid(i, j)], scope, param=_pid(i, j))
                w = g.add("dc.wait_allgather", [ag, _pid(i, j)], scope, shape=[4096, 4096], param=_pid(i, j))
            else:
                w = shards[(i, j)]
            s = saved[i * 6 + j % 6]
            if PARAMS[j].endswith("layernorm"):
                a = g.add("aten.mul", [h, w])
                b = g.add("aten.mul", [a, s])
                c = g.add("aten.sum", [b, [-1], True])
                d = g.add("aten.mul", [c, -0.5])
                e = g.add("aten.pow", [s, 3])
                f = g.add("aten.mul", [d, e])
                dw = g.add("aten.sum", [g.add("aten.mul", [h, s]), [0, 1]], shape=[4096])
                h = g.add("aten.add", [a, f])
            else:
                wt = g.add("aten.t", [w])
                dx = g.add("aten.mm", [h, wt])
                st = g.add("aten.t", [s])
                dw = g.add("aten.mm", [st, h], shape=[4096, 4096])
                if PARAMS[j] == "mlp.up_proj":
                    sg = g.add("aten.sigmoid", [s])
                    one = g.add("aten.rsub", [sg, 1])
                    dx = g.add("aten.mul", [dx, g.add("aten.mul", [sg, one])])
                if PARAMS[j] == "self_attn.q_proj":
                    dx = g.add("aten._scaled_dot_product_flash_attention_backward", [dx, s, s, s])
                h = g.add("aten.add", [h, dx])
            if zero3:
                g.add("dc.release_param", [w, _pid(i, j)], scope, param=_pid(i, j))
                g.add("dc.reduce_grad", [dw, _pid(i, j)], scope, param=_pid(i, j))
                grads_out.append(None)
            else:
                grads_out.append(dw)
    if zero3:
        g.add("dc.end_backward", [], "")
    g.add("output", [[x for x in grads_out if x]], op="output")
    return g.nodes


def make_record(layers: int):
    from deepcompile.record.reader import GraphRecord, RunRecord

    fin, fz = forward(layers, False), forward(layers, True)
    fp = forward(layers, True, hoist=2)
    bin_, bz = backward(layers, False), backward(layers, True)
    graphs = [GraphRecord(0, "forward", "input", 0, fin), GraphRecord(0, "forward", "zero3", 1, fz),
              GraphRecord(0, "forward", "prefetch", 2, fp),
              GraphRecord(0, "backward", "input", 0, bin_), GraphRecord(0, "backward", "zero3", 1, bz)]
    man = {"format_version": 1, "world_size": 2, "ranks": [0, 1], "status": "complete"}
    return RunRecord(Path("."), man, {}, 0, {"torch": "", "python": "", "hostname": ""}, graphs, [], None, None, None)


def record_from_model(layers: int, out: Path):
    """A real record: the embedded GPT with ``layers`` blocks through deepcompile.initialize on one
    gloo rank (aot_eager, zero3 + prefetch), one step; returns the RunRecord."""
    import torch

    import deepcompile
    from deepcompile.models import GPT, GPTConfig
    from deepcompile.record.reader import read_run
    from deepcompile.record.writer import RunRecorder

    with _one_gloo_rank():
        torch.manual_seed(0)
        cfg = GPTConfig(n_layer=layers)
        model, opt = deepcompile.initialize(GPT(cfg), lambda ps: torch.optim.SGD(ps, lr=1e-3),
                                            {"compiler": "aot_eager", "passes": ["zero3", "prefetch"]})
        with RunRecorder(out, 0, 1, model.dc_config) as rec:
            model.dc_backend.observers.append(rec.graph_version)
            x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
            loss = model(x, x)
            loss.backward()
            rec.step(1, 0.0, float(loss))
    return read_run(out, 0)


def profiled_record_from_model(layers: int, out: Path) -> Path:
    """A record a what-if can answer: the embedded GPT with ``layers`` blocks under the default
    ZeRO-3 plan (zero3 at step 0, step 1 profiled, step 2 planned and re-compiled) on one gloo
    rank (aot_eager), with its profile and plan (``RunRecorder.model``)."""
    import torch

    import deepcompile
    from deepcompile.models import GPT, GPTConfig
    from deepcompile.record.writer import RunRecorder

    with _one_gloo_rank():
        torch.manual_seed(0)
        cfg = GPTConfig(n_layer=layers)
        model, opt = deepcompile.initialize(GPT(cfg), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                            {"compiler": "aot_eager"})
        with RunRecorder(out, 0, 1, model.dc_config) as rec:
            model.dc_backend.observers.append(rec.graph_version)
            for step in range(3):
                t0 = time.perf_counter()
                x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
                loss = model(x, x)
                loss.backward()
                opt.step()
                opt.zero_grad()
                rec.step(step, time.perf_counter() - t0, loss.item())
            rec.model(model)
    return out


@contextlib.contextmanager
def _one_gloo_rank():
    """A one-rank gloo process group for the duration (the records are built on CPU)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, repeat: int) -> tuple[float, list[float]]:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def bench(layers: int, repeat: int, use_dot: bool | None, rec=None, source: str = "synthetic Llama-style") -> dict:
    from deepcompile.report import level_layout as L
    from deepcompile.widgets.graph_view import GraphModel

    rec = rec or make_record(layers)
    res: dict = {"layout": "graphviz dot (nested, per module)" if use_dot is not False else "built-in order-based",
                 "graphs": source}
    cold = L.LEVEL_CACHE.clear

    def model(kind):
        g = GraphModel(rec, use_dot=use_dot)
        g.set_kind(kind)
        g.set_pass("zero3")
        return g

    for kind in ("forward", "backward"):
        nodes = len(rec.versions(0, kind)[-1].nodes)

        def first():
            cold()
            return model(kind).render()

        med, ts = timed(first, repeat)
        r = first()
        g = model(kind)
        keys = g.group_keys()
        layer = next(k for k in keys if k.endswith(".15"))
        prefix = layer[: -len("15")]
        others = [prefix + str(i) for i in range(16, layers) if prefix + str(i) in keys]

        def expand():  # the collapsed picture is on screen (its layout cached); a click on one layer
            cold()
            g.collapse_all()
            g._cache.clear()
            g.render()
            g.expand(layer)
            h, m = L.LEVEL_CACHE.hits, L.LEVEL_CACHE.misses
            t0 = time.perf_counter()
            r = g.render()
            return time.perf_counter() - t0, r, L.LEVEL_CACHE.hits - h, L.LEVEL_CACHE.misses - m

        ets = [expand()[0] for _ in range(repeat)]
        _, rx, eh, em = expand()
        boxes_expanded = len(rx.groups)

        def expand_other(other):  # then another, identical layer: its inside is laid out already
            g.collapse_all()
            g.expand(other)
            g._cache.clear()
            t0 = time.perf_counter()
            g.render()
            return time.perf_counter() - t0

        expand()
        h2, m2 = L.LEVEL_CACHE.hits, L.LEVEL_CACHE.misses
        ots = [expand_other(o) for o in others[:repeat]]   # a new layer each time: the top level is not cached
        h3, m3 = L.LEVEL_CACHE.hits, L.LEVEL_CACHE.misses

        def expand_inputs():
            cold()
            g.collapse_all()
            g._cache.clear()
            g.render()
            g.expand("inputs")
            t0 = time.perf_counter()
            r = g.render()
            return time.perf_counter() - t0, r

        its = [expand_inputs()[0] for _ in range(repeat)]
        big = expand_inputs()[1]

        def diff():
            cold()
            g.collapse_all()
            g._cache.clear()
            g.select_passes("input", "zero3")
            return g.render()

        dmed, dts = timed(diff, repeat)
        d = diff().diff
        out = {"nodes": nodes, "boxes_collapsed": len(r.groups), "first_render_s": med, "first_render_all_s": ts,
               "expand_one_layer_s": statistics.median(ets), "expand_all_s": ets,
               "boxes_after_expand": boxes_expanded,
               "expand_another_layer_s": statistics.median(ots), "expand_another_all_s": ots,
               "expand_inputs_s": statistics.median(its), "boxes_after_expand_inputs": len(big.groups),
               "diff_input_vs_zero3_s": dmed, "diff_all_s": dts,
               "diff_counts": {k: d[k] for k in ("added", "removed", "moved")}}
        if use_dot is not False:
            out["layout_cache"] = {"expand_one_layer": {"hits": eh, "misses": em},
                                   "expand_another_layer": {"hits": (h3 - h2) / max(1, len(ots)),
                                                            "misses": (m3 - m2) / max(1, len(ots))}}
        if kind == "forward":
            def diff2():
                cold()
                g._cache.clear()
                g.select_passes("zero3", "prefetch")
                return g.render()

            pmed, pts = timed(diff2, repeat)
            out["diff_zero3_vs_prefetch_s"] = pmed
            d2 = diff2().diff or {}
            out["diff_zero3_vs_prefetch_counts"] = {k: d2.get(k, 0) for k in ("added", "removed", "moved")}
        res[kind] = out
    return res


def whatif_bench(run_dir: str, repeat: int) -> dict:
    """Seconds of ``plan.whatif.predict_run`` on a record (target < 2 s per edit): the first call
    (reads the record and rebuilds its graphs, then cached), an edit of explicit parameters
    (each a new value, so no cached prediction answers it), every planned value "auto" under a
    new memory limit (the planner prices its whole grid once per record), and again under another
    limit (the grid's prices reused)."""
    from deepcompile.plan.whatif import WhatIfError, clear_cache, predict_run

    def plan(pf, fuse, keep):
        return [{"name": "zero3"}, {"name": "prefetch", "params": {"budget_mb": pf, "fuse_mb": fuse}},
                {"name": "selective_unshard", "params": {"budget_mb": keep}}]
    clear_cache()
    out: dict = {"record": str(run_dir),
                 "note": "*_s: wall seconds; *_cpu_s: this process's CPU seconds (the honest figure on a shared, "
                         "oversubscribed machine: see load_average)"}

    def timed_call(key, *args, **kw):
        t0, c0 = time.perf_counter(), time.process_time()
        r = predict_run(*args, **kw)
        out[key + "_s"] = round(time.perf_counter() - t0, 3)
        out[key + "_cpu_s"] = round(time.process_time() - c0, 3)
        return r
    try:
        w = timed_call("first", run_dir, plan(512, 128, 64))
    except WhatIfError as e:
        return dict(out, error=str(e))
    edits, cpu = [], []
    for i in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        predict_run(run_dir, plan(100.0 + 37 * i, 0 if i % 2 else 64, 16.0 * i))
        edits.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    out["edit_s"] = round(statistics.median(edits), 3)
    out["edit_cpu_s"] = round(statistics.median(cpu), 3)
    out["edit_s_all"] = [round(x, 3) for x in edits]
    auto = plan("auto", "auto", "auto")
    a = timed_call("auto_new_limit", run_dir, auto, memory_limit_gib=w.peak_bytes / 2 ** 30 * 1.5)
    timed_call("auto_other_limit", run_dir, auto, memory_limit_gib=w.peak_bytes / 2 ** 30 * 0.99)
    out.update(step_ms=w.step_ms, peak_gib=round(w.peak_bytes / 2 ** 30, 3), auto_step_ms=a.step_ms,
               auto_params={k: v for k, v in a.params.items() if k in a.auto},
               load_average=os.getloadavg()[0])
    return out


def _previous(path: Path) -> dict | None:
    """The headline numbers of an earlier result file (for before/after)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if "runs" not in old:
        return None
    keep = ("nodes", "boxes_collapsed", "first_render_s", "expand_one_layer_s", "diff_input_vs_zero3_s")
    return {"created": old.get("created"), "runs": [
        {"graphs": r["graphs"], "layout": r["layout"], **{k: {f: r[k][f] for f in keep if f in r[k]}
                                                          for k in ("forward", "backward")}}
        for r in old["runs"]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model", action="store_true",
                    help="also time a real record: the embedded GPT with --layers blocks through the backend")
    ap.add_argument("--record", default=None,
                    help="with --model: reuse this run directory (written by an earlier --model run) instead of "
                         "building a new record (~20-90 s)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "inspector_cpu.json"))
    ap.add_argument("--whatif-model", default=None, metavar="DIR",
                    help="also time the what-if on a profiled record of the embedded GPT with --layers blocks "
                         "(the default ZeRO-3 plan, 3 steps), built in DIR unless DIR already holds one")
    ap.add_argument("--whatif", action="append", default=None, metavar="RECORD",
                    help="time plan.whatif.predict_run on this record (repeatable; default: every "
                         "benchmarks/results/*dc_default_record); 'none' skips it")
    a = ap.parse_args()
    from deepcompile.report.level_layout import have_dot

    previous = _previous(Path(a.out))

    import subprocess
    dotv = ""
    if have_dot():
        dotv = subprocess.run(["dot", "-V"], capture_output=True, text=True, timeout=10).stderr.strip()
    result = {
        "benchmark": "inspector graph view", "layers": a.layers, "repeat": a.repeat,
        "machine": {"hostname": socket.gethostname(), "platform": platform.platform(),
                    "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version(), "graphviz": dotv},
        "targets": {"first_render_s": 2.0, "expand_one_layer_s": 0.2},
        "previous": previous,
        "runs": [bench(a.layers, a.repeat, None), bench(a.layers, a.repeat, False)],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if a.model:
        import tempfile

        t0 = time.perf_counter()
        if a.record and (Path(a.record) / "manifest.json").exists():
            from deepcompile.record.reader import read_run

            rec = read_run(a.record, 0)
            result["model_record"] = str(a.record)
        else:
            rec = record_from_model(a.layers, Path(a.record) if a.record else
                                    Path(tempfile.mkdtemp(prefix="dc-bench-")) / "run")
            result["model_record_build_s"] = time.perf_counter() - t0
        src = f"embedded GPT, {a.layers} blocks, through the backend (zero3, prefetch)"
        result["runs"] += [bench(a.layers, a.repeat, None, rec, src), bench(a.layers, a.repeat, False, rec, src)]
    wi = a.whatif if a.whatif is not None else sorted(
        str(p) for p in (REPO / "benchmarks" / "results").glob("*dc_default_record"))
    wi = [w for w in wi if w != "none"]
    if a.whatif_model:
        d = Path(a.whatif_model)
        if not (d / "manifest.json").exists():
            t0 = time.perf_counter()
            profiled_record_from_model(a.layers, d)
            result["whatif_model_build_s"] = round(time.perf_counter() - t0, 1)
        wi.append(str(d))
    result["whatif"] = [whatif_bench(w, a.repeat) for w in wi]
    result["targets"]["whatif_edit_s"] = 2.0
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    for w in result["whatif"]:
        print(f"[what-if · {w['record']}] " + (w.get("error") or (
            f"first {w['first_s']:.2f} s ({w['first_cpu_s']:.2f} CPU), edit {w['edit_s']:.2f} s "
            f"({w['edit_cpu_s']:.2f}), auto under a new limit {w['auto_new_limit_s']:.2f} s "
            f"({w['auto_new_limit_cpu_s']:.2f}), under another {w['auto_other_limit_s']:.2f} s "
            f"({w['auto_other_limit_cpu_s']:.2f}) (load average {w['load_average']:.1f})")))
    for run in result["runs"]:
        print(f"[{run['graphs']} · {run['layout']}]")
        for kind in ("forward", "backward"):
            r = run[kind]
            line = (f"  {kind:8} {r['nodes']:5} nodes -> {r['boxes_collapsed']} boxes: first render "
                    f"{r['first_render_s'] * 1e3:7.1f} ms, expand one layer {r['expand_one_layer_s'] * 1e3:7.1f} ms "
                    f"({r['boxes_after_expand']} boxes), another {r['expand_another_layer_s'] * 1e3:6.1f} ms, "
                    f"inputs {r['expand_inputs_s'] * 1e3:6.1f} ms ({r['boxes_after_expand_inputs']} boxes), "
                    f"diff input/zero3 {r['diff_input_vs_zero3_s'] * 1e3:7.1f} ms {r['diff_counts']}")
            if "diff_zero3_vs_prefetch_s" in r:
                line += (f", diff zero3/prefetch {r['diff_zero3_vs_prefetch_s'] * 1e3:7.1f} ms "
                         f"{r['diff_zero3_vs_prefetch_counts']}")
            print(line)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
