"""A constant causal mask handed to scaled_dot_product_attention becomes is_causal=True
(deepcompile/passes/causal_mask.py), and nothing else does.

The models build their mask inside the forward as Hugging Face's do under torch.compile
(``arange`` comparisons into a bool or float ``[b, 1, L, S]`` tensor). Each check compares the
compiled output with eager: a wrong rewrite (a padding mask, a sliding window, a mask written in
place, dropped) changes the output well beyond the tolerance."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_utils import run_ranks

SDPA = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)


class Attention(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, mask):
        b, L, d = x.shape
        q, k, v = self.qkv(x).view(b, L, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.proj(o.transpose(1, 2).reshape(b, L, d))


class TinyLM(nn.Module):
    """``kind``: the mask's form (bool; float with finfo.min; float with -inf). ``window``: a
    sliding window on top of causal. ``poke``: one allowed entry cleared in place after the mask
    is built (``m[..., 2, 0] = False``)."""

    def __init__(self, kind: str = "bool", window: int | None = None, poke: bool = False, layers: int = 2):
        super().__init__()
        self.kind, self.window, self.poke = kind, window, poke
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList([Attention() for _ in range(layers)])
        self.head = nn.Linear(32, 64)

    def forward(self, ids, labels, attention_mask=None):
        b, L = ids.shape
        q_idx = torch.arange(L, device=ids.device)[None, None, :, None]
        kv_idx = torch.arange(L, device=ids.device)[None, None, None, :]
        m = kv_idx <= q_idx
        if self.window is not None:
            m = m & (kv_idx > q_idx - self.window)
        if self.poke:
            m[:, :, 2, 0] = False
        if attention_mask is not None:
            m = m & attention_mask[:, None, None, :].bool()
        m = m.expand(b, 1, L, L)
        if self.kind == "float":
            m = torch.zeros(m.shape, device=ids.device).masked_fill(~m, torch.finfo(torch.float32).min)
        elif self.kind == "inf":
            m = torch.where(m, 0.0, float("-inf"))
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x, m)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _sdpa_calls(gm) -> list:
    """Every SDPA call of ``gm`` and of the nested-region bodies it holds: (attn_mask, is_causal)."""
    out = []
    for g in [gm, *[m for m in gm.children() if isinstance(m, torch.fx.GraphModule)]]:
        for n in g.graph.nodes:
            if n.op == "call_function" and n.target in SDPA:
                out.append((n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None),
                            n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False)))
    return out


def _compile(model, *args, dynamic=False, **kw):
    """Compile ``model`` with a backend that runs the rewrite, then aot_eager; returns the output,
    the rewritten graph's SDPA calls and the rewrite's notes."""
    from deepcompile.passes.causal_mask import restore_causal_sdpa

    seen = {}

    def backend(gm, example_inputs):
        seen["notes"] = restore_causal_sdpa(gm)
        seen["calls"] = _sdpa_calls(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=True)(*args, **kw)
    return out, seen["calls"], seen["notes"]


def _batch(b=2, L=12):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (b, L), generator=g), torch.randint(0, 64, (b, L), generator=g)


@pytest.mark.parametrize("kind", ["bool", "float", "inf"])
@pytest.mark.parametrize("nested_regions", [False, True])
def test_causal_mask_becomes_is_causal(kind, nested_regions):
    from deepcompile.compile import nested

    torch.manual_seed(0)
    model = TinyLM(kind)
    ids, labels = _batch()
    ref = model(ids, labels)
    if nested_regions:
        assert nested.wrap(model) == 2
    try:
        out, calls, notes = _compile(model, ids, labels)
    finally:
        if nested_regions:
            nested.unwrap(model)
    assert calls and all(m is None and c is True for m, c in calls), calls
    assert any("2 scaled_dot_product_attention call(s) given is_causal=True" in n for n in notes), notes
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def _not_rewritten(model, *args, why: str, dynamic=False, **kw):
    ref = model(*args, **kw)
    out, calls, notes = _compile(model, *args, dynamic=dynamic, **kw)
    assert calls and all(m is not None and c is False for m, c in calls), calls
    assert any("left as they are" in n and why in n for n in notes), notes
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nested_regions", [False, True])
def test_padding_mask_from_an_input_is_kept(nested_regions):
    from deepcompile.compile import nested

    torch.manual_seed(0)
    ids, labels = _batch()
    pad = torch.ones_like(ids)
    pad[0, -4:] = 0  # right padding: every row still sees its first token
    model = TinyLM("float")
    if nested_regions:
        assert nested.wrap(model) == 2
    try:
        _not_rewritten(model, ids, labels, attention_mask=pad, why="depends on the graph input")
    finally:
        if nested_regions:
            nested.unwrap(model)


def test_sliding_window_is_kept():
    torch.manual_seed(0)
    _not_rewritten(TinyLM("bool", window=4), *_batch(), why="not the causal mask")


def test_mask_written_in_place_is_kept():
    """The mask's ancestors alone evaluate to the causal mask; the in-place write after them makes
    it another one."""
    torch.manual_seed(0)
    _not_rewritten(TinyLM("bool", poke=True), *_batch(), why="writes into it in place")


def test_dynamic_shapes_are_kept():
    torch.manual_seed(0)
    _not_rewritten(TinyLM("bool"), *_batch(), why="graph input", dynamic=True)


def test_query_and_key_lengths_that_differ_are_kept():
    """A prefix of P keys before the L queries: a lower-right causal mask, not the L == S one."""
    P = 3

    class Prefix(nn.Module):
        def forward(self, q, k, v):
            L, S = q.shape[-2], k.shape[-2]
            m = torch.arange(S)[None, :] <= torch.arange(L)[:, None] + P
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 8, generator=g)
    k, v = torch.randn(2, 1, 2, 5 + P, 8, generator=g)
    _not_rewritten(Prefix(), q, k, v, why="query length 5 != key length 8")


def _train(rank, world, kind):
    import deepcompile

    torch.manual_seed(0)
    model = TinyLM(kind)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    # the default trace (decoder blocks as nested regions); aot_eager: the rewrite is what is tested
    dc_model, opt = deepcompile.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1),
                                           {"compiler": "aot_eager", "passes": ["zero3"], "plan_cache": False})
    losses, ref_losses = [], []
    for s in range(3):
        g = torch.Generator().manual_seed(100 + s)  # every rank the same batch: the mean gradient is its own
        ids, labels = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
        loss = dc_model(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        r = ref(ids, labels)
        r.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(r.item())
    full = deepcompile.full_state_dict(dc_model)
    notes = [n for v in dc_model.dc_graphs if v.kind == "dynamo" for n in v.notes if n.startswith("causal_mask")]
    fwd = [v for v in dc_model.dc_graphs if v.kind == "forward"][-1]
    attn = [n for n in fwd.nodes if "scaled_dot_product" in str(n.get("target"))]
    return dict(losses=losses, ref_losses=ref_losses, notes=notes, attn=attn,
                diff={k: (full[k].float() - v.float()).abs().max().item() for k, v in ref.state_dict().items()})


@pytest.mark.parametrize("kind", ["float"])
def test_zero3_training_matches_eager(kind):
    """2 gloo ranks, ZeRO-3 through deepcompile.initialize: the attention runs causal without the
    mask, and losses and parameters after 3 SGD steps match the eager model's."""
    for r in run_ranks(_train, 2, kind, timeout=600):
        assert r["notes"] and "is_causal=True" in r["notes"][0], r["notes"]
        # aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask=...)
        assert r["attn"] and all("attn_mask" not in str(n.get("kwargs")) and n["args"][4] is True
                                 for n in r["attn"]), r["attn"]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=1e-6)
        assert r["ref_losses"][-1] < r["ref_losses"][0]
        assert max(r["diff"].values()) < 1e-5, r["diff"]


def test_hugging_face_llama():
    """transformers' Llama (sdpa) under a whole-model capture: its materialized causal mask is
    dropped and the loss is unchanged."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=64,
                                   use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=ids, labels=ids).loss

    out, calls, notes = _compile(lambda i: model(input_ids=i, labels=i).loss, ids)
    assert len(calls) == 2 and all(m is None and c is True for m, c in calls), (calls, notes)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def _tiny_llama(transformers, seq: int):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=seq,
                                   use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_hugging_face_llama_seq_8192():
    """On the GPU at seq 8192: the graph's devices are CUDA, the mask is evaluated on the CPU once
    (a 64 MB bool mask; the rewrite's whole time is bounded), the attention runs causal and the
    loss matches eager's."""
    import re
    import time

    transformers = pytest.importorskip("transformers")
    seq = 8192
    model = _tiny_llama(transformers, seq).cuda()
    ids = torch.randint(0, 128, (1, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    ref = model(input_ids=ids, labels=ids).loss
    t0 = time.perf_counter()
    out, calls, notes = _compile(lambda i: model(input_ids=i, labels=i).loss, ids)
    print(f"compile + step {time.perf_counter() - t0:.1f} s; {notes}")
    assert len(calls) == 2 and all(m is None and c is True for m, c in calls), (calls, notes)
    m = re.search(r"(\d+) evaluation\(s\) and (\d+) check\(s\) in ([\d.]+) s", notes[0])
    assert m and int(m.group(1)) == 1 and int(m.group(2)) == 1 and float(m.group(3)) < 10.0, notes
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_a_mask_built_on_cuda_is_evaluated_on_the_cpu():
    """Whatever device the graph builds its mask on (an argument, a keyword, ``.to``, ``.cuda()``),
    the compile-time evaluation runs on the CPU: no GPU memory or stream is touched at compile time."""
    from deepcompile.passes.causal_mask import _ancestors, _evaluate

    import operator

    g = torch.fx.Graph()  # as Dynamo records it on a GPU (this torch may have no CUDA)
    cuda0 = torch.device("cuda", 0)
    a = g.call_function(torch.arange, (6,), {"device": cuda0})
    q = g.call_method("to", (g.call_function(operator.getitem, (a, (slice(None), None))), "cuda:0"))
    kv = g.call_method("cuda", (g.call_function(torch.arange, (6,), {"device": "cuda"}),))
    kv = g.call_function(operator.getitem, (kv, (None, slice(None))))
    out = g.call_method("to", (g.call_function(operator.le, (kv, q)), cuda0))
    g.output(out)
    v = _evaluate(_ancestors(out), {})
    assert v.device.type == "cpu" and torch.equal(v, torch.ones(6, 6, dtype=torch.bool).tril())
