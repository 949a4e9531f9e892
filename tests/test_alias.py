"""Alias analysis is storage-based: every op that can share storage is seen, and the passes that
free storage (zero3's release, offload_activations) never free a storage that is still read.

The bug this guards: a Hugging Face Llama under aot_eager segfaulted with offload_activations,
which freed ``mm_3`` while ``aten._unsafe_view(mm_3)`` (same storage, no alias annotation in its
schema) was still read later in the forward."""
from __future__ import annotations

import operator
from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from deepcompile.passes.alias import alias_closure, is_view, storage_keys


def _views_fn(x):
    a = x.view(4, 8)
    b = x.reshape(2, 16)
    c = torch.ops.aten._unsafe_view(x, [32])
    d = x.t()
    e = x.transpose(0, 1)
    f = x[:1].expand(3, 8)
    g = torch.ops.aten.alias(x)
    h = x.detach()
    i, j = x.split(2, dim=0)
    k, m = x.chunk(2, dim=1)
    n = x.as_strided((2, 2), (1, 1))
    u = x.unbind(0)
    fresh = x.clone() + 1
    mean = torch.var_mean(x, dim=0)[1]     # an item of a multi-output op with fresh outputs
    return a, b, c, d, e, f, g, h, i, j, k, m, n, u[0], fresh, mean


def _traced(fn, *args, strip_meta=False):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    if strip_meta:
        for n in gm.graph.nodes:
            n.meta.pop("val", None)
    return gm


@pytest.mark.parametrize("strip_meta", [False, True], ids=["fake-storages", "schema-fallback"])
def test_every_storage_sharing_op_is_a_view(strip_meta):
    gm = _traced(_views_fn, torch.randn(4, 8), strip_meta=strip_meta)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    closure = set(alias_closure(x))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    returned = list(out.args[0])
    fresh = returned[-2:]
    for r in returned[:-2]:
        assert r in closure, f"{r.name} ({r.target}) shares x's storage but is not in its alias closure"
        if r.target is not operator.getitem or not strip_meta:
            assert is_view(r) or r.target is operator.getitem, r.name
    # getitem of split/chunk/unbind: the output a graph reads is the item, not the list
    items = [r for r in returned[:-2] if r.target is operator.getitem]
    assert len(items) == 5 and all(is_view(r) for r in items)
    for r in fresh:
        assert r not in closure and not is_view(r), r.name
    # _unsafe_view: no alias annotation in its schema, and still a view
    uv = next(n for n in gm.graph.nodes if n.target is torch.ops.aten._unsafe_view.default)
    assert all(r.alias_info is None for r in uv.target._schema.returns)
    assert is_view(uv)


def test_storage_keys_follow_fake_storages():
    gm = _traced(lambda x: (torch.ops.aten._unsafe_view(x @ x, [16]), (x @ x).clone()), torch.randn(4, 4))
    mm = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    uv = next(n for n in gm.graph.nodes if n.target is torch.ops.aten._unsafe_view.default)
    assert storage_keys(mm[0]) == storage_keys(uv)
    assert not storage_keys(mm[1]) & storage_keys(uv)


def test_release_waits_for_an_unsafe_view_of_the_gathered_parameter():
    """zero3 releases a gathered parameter after the last read of any node over its storage."""
    from deepcompile.passes.zero3 import lower_gathers
    from deepcompile.runtime import ops

    ops.ensure_registered()

    def f(shard, x):
        w = torch.ops.dc.unshard(shard, 7)
        y = x @ w.view(4, 4)                                   # w's last direct use
        u = torch.ops.aten._unsafe_view(w, [4, 4])              # same storage, no annotation
        z = y.sin()
        return z @ u                                             # read after the direct use

    # the fake impl of unshard reads the parameter's registered metadata
    meta = ops.ParamMeta(id=7, name="w", shape=(16,), numel=16, chunk=16, dtype=torch.float32,
                         gather_dtype=torch.float32, requires_grad=True)
    from deepcompile.runtime import state

    fresh = not state.active()
    rt = state.install(state.RuntimeState()) if fresh else state.current()
    saved = rt.params.get(7)
    rt.params[7] = meta
    try:
        gm = make_fx(f, tracing_mode="fake")(torch.randn(16), torch.randn(4, 4))
        ctx = SimpleNamespace(param_meta={7: meta}, notes=[], kind="forward", graph_id=0)
        lower_gathers(gm, ctx)
    finally:
        if fresh:
            state.drop()
        elif saved is None:
            rt.params.pop(7, None)
        else:
            rt.params[7] = saved
    nodes = list(gm.graph.nodes)
    rel = next(i for i, n in enumerate(nodes) if n.target is torch.ops.dc.release_param.default)
    last_mm = max(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default)
    assert rel > last_mm, [n.name for n in nodes]


# ------------------------------------------------------------------ offload_activations
def _model_fn(x, w1, w2):
    mm = x @ w1                                  # saved for backward (sin's derivative reads it)
    s = torch.sin(mm)                            # mm's last direct use ...
    t = torch.tanh(s @ w2) @ w2.t()
    u = torch.ops.aten._unsafe_view(mm, [-1])   # ... but its storage is read here, later
    return t.sum() + (u * 3.0).sum() + s.sum()


def _violations(gm: fx.GraphModule) -> list[str]:
    """Reads, after an offload, of any node over the offloaded storage."""
    nodes = list(gm.graph.nodes)
    out = []
    for off in (n for n in nodes if n.target is torch.ops.dc.offload_activation.default):
        keys = storage_keys(off.args[0])
        assert keys, f"{off.args[0].name} has no fake value to check against"
        group = {n for n in nodes if (storage_keys(n) or frozenset()) & keys}
        later = [n.name for n in nodes[nodes.index(off) + 1:] if n.op == "call_function"
                 and n.target is not torch.ops.dc.offload_activation.default and set(n.all_input_nodes) & group]
        if later:
            out.append(f"{off.args[0].name} freed by {off.name}, read later by {later}")
    return out


def _compile_with_offload(fn, seen):
    """aot_eager with offload_activations (min_mb 0) on the forward and backward graphs. A
    forward whose offloads would free a storage still read is recorded and run without them
    (reading a freed storage segfaults instead of failing the test)."""
    from torch._dynamo.backends.common import aot_autograd

    from deepcompile.compat import aot as aot_compat
    from deepcompile.passes.offload_activations import OffloadActivationsParams, offload_activations
    from deepcompile.runtime import ops

    ops.ensure_registered()
    params = OffloadActivationsParams(min_mb=0.0)
    handoff: dict = {}   # the forward's offload ids, for the backward (PassContext.handoff)

    def compiler(kind):
        def run(gm, inputs):
            ctx = SimpleNamespace(graph_id=990, kind=kind, params=params, profile=None, notes=[], handoff=handoff)
            gm = offload_activations(gm, ctx)
            seen[kind] = gm
            if kind == "forward":
                seen["offloaded"] = [n.args[0].name for n in gm.graph.nodes
                                     if n.target is torch.ops.dc.offload_activation.default]
                seen["violations"] = _violations(gm)
                if seen["violations"]:
                    for n in list(gm.graph.nodes):
                        if n.target is torch.ops.dc.offload_activation.default:
                            gm.graph.erase_node(n)
                    gm.recompile()
            return aot_compat.boxed(gm.forward)
        return run

    torch._dynamo.reset()
    return torch.compile(fn, backend=aot_autograd(fw_compiler=compiler("forward"),
                                                  bw_compiler=compiler("backward")))


def test_offload_never_frees_a_storage_still_read():
    """mm is saved for backward and offloaded; _unsafe_view(mm) is read after mm's last direct
    use, so the offload must come after that read. Then: same loss and gradients as eager."""
    from deepcompile.runtime import state

    fresh = not state.active()   # the offload kernels act on the runtime state's copy engine
    ENGINE = (state.install(state.RuntimeState()) if fresh else state.current()).offload

    torch.manual_seed(0)
    x = torch.randn(64, 32)
    w1, w2 = (torch.randn(32, 32, requires_grad=True) for _ in range(2))
    ref = _model_fn(x, w1, w2)
    ref.backward()
    ref_grads = [w1.grad.clone(), w2.grad.clone()]
    w1.grad = w2.grad = None

    seen: dict = {}
    before = dict(ENGINE.stats)
    loss = _compile_with_offload(_model_fn, seen)(x, w1, w2)
    loss.backward()
    assert not seen["violations"], seen["violations"]
    fw = seen["forward"]
    uv = next(n for n in fw.graph.nodes if n.target is torch.ops.aten._unsafe_view.default)
    assert uv.args[0].name in seen["offloaded"], f"the test needs mm itself offloaded: {seen['offloaded']}"
    assert ENGINE.stats["offloads"] > before["offloads"] and ENGINE.stats["reloads"] > before["reloads"]
    if fresh:
        state.drop()
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close([w1.grad, w2.grad], ref_grads)
    assert any(n.target is torch.ops.dc.wait_activation.default for n in seen["backward"].graph.nodes)


# ------------------------------------------------------------------ the model it was seen on
LLAMA_STEPS = 3


def _llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _llama_batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 256, (2, 16), generator=g)


def _llama_offloaded(rank, world):
    import deepcompile

    model, opt = deepcompile.initialize(
        _llama(), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        {"compiler": "aot_eager", "passes": ["zero3", "prefetch", {"name": "offload_activations", "params": {"min_mb": 0}}]})
    losses = []
    for s in range(LLAMA_STEPS):
        x = _llama_batch(s, rank)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, deepcompile.full_state_dict(model), dict(model.dc_state.runtime.offload.stats)


@pytest.mark.slow
def test_hf_llama_offload_activations_aot_eager_matches_unsharded():
    """Segfaulted before (exit -11 on both ranks): mm_3 freed while _unsafe_view(mm_3) was read."""
    pytest.importorskip("transformers")
    from tests.dist_utils import run_ranks

    ref = _llama()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_losses = []
    for s in range(LLAMA_STEPS):
        per_rank = [ref(input_ids=x, labels=x).loss for x in (_llama_batch(s, r) for r in range(2))]
        (sum(per_rank) / 2).backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append([x.item() for x in per_rank])
    results = run_ranks(_llama_offloaded, 2, timeout=600)
    for rank, (losses, state, stats) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor([x[rank] for x in ref_losses]), rtol=1e-5, atol=1e-6)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")
        assert stats["offloads"] > 0 and stats["offloads"] == stats["reloads"] and stats["skipped"] == 0, stats
