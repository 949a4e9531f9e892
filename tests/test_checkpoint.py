"""Sharded checkpoints through torch.distributed.checkpoint (DCP), on real gloo ranks.

Saved on 4 ranks after 2 steps, for each ZeRO stage; loaded on 2 and on 1 (resharding) into a
model initialised from another seed; training goes on for 2 steps on the same global batches and
must match the unsharded reference of 4 uninterrupted steps. Right after loading, every parameter,
AdamW moment and step equals the saved one exactly (checked against torch's own
``dcp_to_torch_save`` of the checkpoint, whose keys and shapes must be the model's ``state_dict()``).
A bad entry (a wrong shape on one rank only, a meta tensor) must leave every rank unchanged.

Tolerance: as tests/test_zero3_parity.py (float32, different reduction orders): atol/rtol 1e-4 on
parameters; a lost or stale moment, a wrong row or a missed load moves them by ~lr = 3e-3.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.workloads import LOCAL_BATCH, global_batch, make_optimizer
from tests.workloads import make_model as _make_model

SAVE_WORLD = 4
GLOBAL_ROWS = SAVE_WORLD * LOCAL_BATCH  # every phase trains on the same global batches
STEPS_BEFORE, STEPS_AFTER = 2, 2
STAGES = (1, 2, 3)
SMALL = {"n_layer": 1}  # one block: every code path, a third less compiling on 4+2+1 ranks x 3 stages


def make_model(seed: int = 0):
    return _make_model(seed, **SMALL)


def train_reference(steps: int):
    """One process, no sharding, the 8-row global batches: the uninterrupted run."""
    model = make_model()
    opt = make_optimizer(model.parameters())
    losses = []
    for s in range(steps):
        x, y = global_batch(s, 0, SAVE_WORLD)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _config(stage: int) -> dict:
    return {"compiler": "aot_eager", "zero_stage": stage, "passes": ["zero3" if stage == 3 else "zero12"]}


def _train(model, opt, rank: int, world: int, steps) -> list[float]:
    rows = GLOBAL_ROWS // world
    losses = []
    for s in steps:
        x, y = global_batch(s, 0, SAVE_WORLD)  # global_batch(., ., 4): the 8 rows of the reference
        sl = slice(rank * rows, (rank + 1) * rows)
        loss = model(x[sl], y[sl])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _save_all(rank: int, world: int, root: str):
    """Phase 1 (4 ranks): each stage trains 2 steps and saves with dcp.save."""
    import torch.distributed.checkpoint as dcp

    import deepcompile

    out = {}
    for stage in STAGES:
        model, opt = deepcompile.initialize(make_model(), make_optimizer, _config(stage))
        losses = _train(model, opt, rank, world, range(STEPS_BEFORE))
        msd, osd = deepcompile.get_state_dict(model, opt)
        # each rank offers only its own rows: local tensors are views of the shards
        shard_ptrs = {sp.shard.data_ptr() for sp in model.dc_state.sharded}
        assert all(v.to_local().numel() == 0 or v.to_local().data_ptr() in shard_ptrs
                   for k, v in msd.items() if isinstance(v, torch.distributed.tensor.DTensor))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/zero{stage}",
                 storage_writer=dcp.FileSystemWriter(f"{root}/zero{stage}"))
        out[stage] = {"losses": losses, "full": deepcompile.full_state_dict(model)}
        deepcompile.destroy(model)
    return out


def _snapshot(model, opt):
    return ([sp.shard.detach().clone() for sp in model.dc_state.sharded],
            [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
             for st in opt.state.values()],
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


def _same(a, b) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(eq(p, q) for p, q in zip(x, y))
        return x == y
    return eq(a, b)


def _bad_entries_change_nothing(model, opt, rank: int, world: int, path: str) -> list[str]:
    """set_state_dict with one bad entry raises on every rank and writes nothing anywhere."""
    import torch.distributed.checkpoint as dcp

    import deepcompile

    msgs = []
    before = _snapshot(model, opt)
    msd, osd = deepcompile.get_state_dict(model, opt)
    # values that differ from the live ones, so a partial write would show
    good_model = {k: (v.full_tensor() + 1.0 if isinstance(v, torch.distributed.tensor.DTensor) else v.clone())
                  for k, v in msd.items()}
    key = "blocks.0.attn.qkv.weight"
    bad = dict(good_model)
    if rank == world - 1:  # only the last rank's entry is wrong
        bad[key] = torch.zeros(good_model[key].shape[0] + 1, good_model[key].shape[1])
    with pytest.raises(ValueError) as e:
        deepcompile.set_state_dict(model, opt, bad, None)
    msgs.append(str(e.value))
    assert f"rank {world - 1}" in str(e.value) and key in str(e.value) and "nothing was loaded" in str(e.value)
    assert _same(_snapshot(model, opt), before), "a failed set_state_dict wrote something"

    # a good model state dict with a meta tensor in the optimizer's: the model is not written either
    ckpt_osd = {"state": {fqn: {k: (v.full_tensor() if isinstance(v, torch.distributed.tensor.DTensor) else v.clone())
                                for k, v in st.items()} for fqn, st in osd["state"].items()},
                "param_groups": osd["param_groups"]}
    fqn = next(iter(ckpt_osd["state"]))
    ckpt_osd["state"][fqn]["exp_avg"] = torch.empty(ckpt_osd["state"][fqn]["exp_avg"].shape, device="meta")
    with pytest.raises(ValueError) as e:
        deepcompile.set_state_dict(model, opt, good_model, ckpt_osd)
    msgs.append(str(e.value))
    assert "meta tensor" in str(e.value) and fqn in str(e.value)
    assert _same(_snapshot(model, opt), before), "a failed set_state_dict wrote something"

    # a checkpoint of another model: DCP itself rejects the shape before reading anything
    msd2, osd2 = deepcompile.get_state_dict(model, opt)
    msd2["blocks.0.mlp.fc.weight"] = torch.zeros(3, 3)
    with pytest.raises(dcp.CheckpointException) as e:  # a BaseException
        dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=path)
    msgs.append(str(e.value)[:200])
    assert _same(_snapshot(model, opt), before), "a failed dcp.load wrote something"

    # full tensors keyed like state_dict() load too (each rank takes its rows; tied weights once)
    deepcompile.set_state_dict(model, opt, good_model, None)
    full = deepcompile.full_state_dict(model)
    assert all(torch.equal(full[k], good_model[k]) for k in good_model)
    return msgs


def _load_all(rank: int, world: int, root: str, full_files: dict, warm_step: bool):
    """Phase 2 (2 or 1 ranks): load each stage's checkpoint into a model from another seed, check
    it equals the saved state exactly, then train on."""
    import torch.distributed.checkpoint as dcp

    import deepcompile
    from deepcompile.checkpoint import _rows

    out = {}
    for stage in STAGES:
        path = f"{root}/zero{stage}"
        model, opt = deepcompile.initialize(make_model(seed=7), make_optimizer, _config(stage))
        if warm_step:
            # kept gathered parameters (ZeRO-1/2) and optimizer state exist and must be replaced
            _train(model, opt, rank, world, [99])
            if stage == 3:
                out["bad"] = _bad_entries_change_nothing(model, opt, rank, world, path)
        else:
            assert not opt.state  # get_state_dict creates the state a load fills
        msd, osd = deepcompile.get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path,
                 storage_reader=dcp.FileSystemReader(path))
        deepcompile.set_state_dict(model, opt, msd, osd)

        ref = torch.load(full_files[stage], weights_only=False)
        by_name = {n: sp for sp in model.dc_state.sharded for n in sp.names}
        sps = {id(sp.shard): sp for sp in model.dc_state.sharded}
        for key, sp in by_name.items():
            first, n, _ = _rows(sp, rank)
            want = ref["model"][key].reshape(-1, *sp.shard.shape[1:])[first:first + n]
            assert torch.equal(sp.shard.detach()[:n], want), f"zero{stage} {key}: loaded shard differs"
        for p, st in opt.state.items():
            sp = sps[id(p)]
            first, n, _ = _rows(sp, rank)
            saved = ref["optim"]["state"][sp.meta.name]
            assert set(saved) == set(st), (sp.meta.name, sorted(saved), sorted(st))
            for k, v in st.items():
                if v.shape == p.shape:
                    w = saved[k].reshape(-1, *v.shape[1:])[first:first + n]
                    assert torch.equal(v[:n], w), f"zero{stage} {sp.meta.name}.{k} differs"
                else:
                    assert torch.equal(v, saved[k]), f"zero{stage} {sp.meta.name}.{k}: {v} vs {saved[k]}"
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref["optim"]["param_groups"]]

        losses = _train(model, opt, rank, world, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        out[stage] = {"losses": losses, "full": deepcompile.full_state_dict(model)}
        deepcompile.destroy(model)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = tmp_path_factory.mktemp("dcp")
    results = run_ranks(_save_all, SAVE_WORLD, str(root), timeout=600)
    files = {}
    for stage in STAGES:
        files[stage] = str(root / f"zero{stage}.pt")
        dcp_to_torch_save(str(root / f"zero{stage}"), files[stage])
    return root, results, files


@pytest.fixture(scope="module")
def reference():
    return train_reference(STEPS_BEFORE + STEPS_AFTER)


def test_dcp_to_torch_save_gives_the_models_keys_and_shapes(saved):
    root, results, files = saved
    want = make_model().state_dict()
    for stage in STAGES:
        sd = torch.load(files[stage], weights_only=False)
        assert {k: tuple(v.shape) for k, v in sd["model"].items()} == {k: tuple(v.shape) for k, v in want.items()}
        for k, v in results[0][stage]["full"].items():  # the 4 ranks' shards, put back together
            assert torch.equal(sd["model"][k], v), f"zero{stage} {k}"
        # FSDP2's optimizer layout: FQN-keyed state of full shapes, FQN lists in param_groups
        st = sd["optim"]["state"]
        assert set(st) <= set(want) and "blocks.0.attn.qkv.weight" in st
        assert tuple(st["blocks.0.attn.qkv.weight"]["exp_avg"].shape) == tuple(want["blocks.0.attn.qkv.weight"].shape)
        assert float(st["blocks.0.attn.qkv.weight"]["step"]) == STEPS_BEFORE
        assert set(sd["optim"]["param_groups"][0]["params"]) == set(st)
    # each rank wrote only its own rows: a sharded entry is 4 chunks of dim 0, one per rank's file,
    # together exactly the tensor (DCP keeps one copy of replicated entries such as buffers)
    import torch.distributed.checkpoint as dcp

    for stage in STAGES:
        md = dcp.FileSystemReader(str(root / f"zero{stage}")).read_metadata()
        for fqn in ("model.blocks.0.attn.qkv.weight", "optim.state.blocks.0.attn.qkv.weight.exp_avg"):
            tmd = md.state_dict_metadata[fqn]
            rows = tmd.size[0]
            c0 = -(-rows // SAVE_WORLD)
            assert sorted(tuple(c.offsets) for c in tmd.chunks) == [(r * c0, 0) for r in range(SAVE_WORLD)]
            files_of = {tuple(i.offset): md.storage_data[i].relative_path for i in md.storage_data if i.fqn == fqn}
            assert sorted(files_of.values()) == [f"__{r}_0.distcp" for r in range(SAVE_WORLD)], files_of
        for fqn, tmd in md.state_dict_metadata.items():
            if hasattr(tmd, "chunks"):
                assert sum(c.sizes.numel() for c in tmd.chunks) == tmd.size.numel(), fqn


@pytest.mark.parametrize("world", [2, 1])
def test_resharded_load_continues_training(saved, reference, world):
    root, saved_results, files = saved
    ref_losses, ref_state = reference
    results = run_ranks(_load_all, world, str(root), files, world == 2, timeout=600)
    for stage in STAGES:
        before = torch.tensor([r[stage]["losses"] for r in saved_results]).mean(0)
        after = torch.tensor([r[stage]["losses"] for r in results]).mean(0)
        torch.testing.assert_close(torch.cat([before, after]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for r in results:
            for k, v in ref_state.items():
                torch.testing.assert_close(r[stage]["full"][k], v, rtol=1e-4, atol=1e-4,
                                           msg=lambda m: f"zero{stage} world {world} {k}: {m}")
    if world == 2:
        print("\n".join(results[0]["bad"]))


def _save_hsdp(rank: int, world: int, path: str):
    import torch.distributed.checkpoint as dcp

    import deepcompile

    model, opt = deepcompile.initialize(make_model(), make_optimizer, {**_config(3), "mesh": {"shard": 2}})
    _train(model, opt, rank, world, range(STEPS_BEFORE))
    msd, osd = deepcompile.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(path))
    full = deepcompile.full_state_dict(model)
    deepcompile.destroy(model)
    return full


def _load_plain(rank: int, world: int, path: str):
    import torch.distributed.checkpoint as dcp

    import deepcompile

    model, opt = deepcompile.initialize(make_model(seed=7), make_optimizer, _config(3))
    msd, osd = deepcompile.get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, storage_reader=dcp.FileSystemReader(path))
    deepcompile.set_state_dict(model, opt, msd, osd)
    full = deepcompile.full_state_dict(model)
    deepcompile.destroy(model)
    return full


def test_hybrid_sharded_checkpoint_loads_without_replicas(tmp_path):
    """Saved under HSDP 2x2 (the replicas offer the same chunks; DCP keeps one), loaded on 2
    plain ranks: the same model, exactly."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "hsdp")
    saved = run_ranks(_save_hsdp, 4, path, timeout=600)
    md = dcp.FileSystemReader(path).read_metadata()
    chunks = md.state_dict_metadata["model.blocks.0.attn.qkv.weight"].chunks
    assert sorted(tuple(c.offsets) for c in chunks) == [(0, 0), (48, 0)], chunks  # 96 rows over 2 shards
    loaded = run_ranks(_load_plain, 2, path, timeout=600)
    for k, v in saved[0].items():
        assert torch.equal(loaded[0][k], v), k


class _Scalar(torch.nn.Module):
    """A 0-d parameter (shard rank 0 holds it) next to an ordinary layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lin = torch.nn.Linear(8, 8)
        self.temp = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return (self.lin(x) * self.temp).square().mean()


def _scalar_roundtrip(rank: int, world: int, path: str, save: bool):
    import torch.distributed.checkpoint as dcp

    import deepcompile

    model, opt = deepcompile.initialize(_Scalar(), make_optimizer, _config(3))
    if save:
        for s in range(2):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + rank))).backward()
            opt.step()
            opt.zero_grad()
    msd, osd = deepcompile.get_state_dict(model, opt)
    assert msd["temp"].shape == () and osd["state"]["temp"]["exp_avg"].shape == ()
    if save:
        dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(path))
    else:
        dcp.load({"model": msd, "optim": osd}, storage_reader=dcp.FileSystemReader(path))
        deepcompile.set_state_dict(model, opt, msd, osd)
    full = deepcompile.full_state_dict(model)
    deepcompile.destroy(model)
    return full


def test_zero_dim_parameter_round_trips(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = str(tmp_path / "scalar")
    saved = run_ranks(_scalar_roundtrip, 2, path, True, timeout=300)
    dcp_to_torch_save(path, str(tmp_path / "scalar.pt"))
    sd = torch.load(tmp_path / "scalar.pt", weights_only=False)
    assert sd["model"]["temp"].shape == () and torch.equal(sd["model"]["temp"], saved[0]["temp"])
    assert sd["model"]["temp"].item() != 1.5  # trained
    loaded = run_ranks(_scalar_roundtrip, 1, path, False, timeout=300)
    for k, v in saved[0].items():
        assert torch.equal(loaded[0][k], v), k


def _save_helper(rank: int, world: int, path: str):
    """deepcompile.save_checkpoint on 2 ranks (ZeRO-3), with an extra entry; the arguments it refuses."""
    import deepcompile
    from deepcompile.checkpoint import _is_sharded_state, _rows

    model, opt = deepcompile.initialize(make_model(), make_optimizer, _config(3))
    _train(model, opt, rank, world, range(STEPS_BEFORE))
    with pytest.raises(ValueError, match="thread_count must be an int >= 1, got 0"):
        deepcompile.save_checkpoint(path, model, opt, thread_count=0)
    with pytest.raises(ValueError, match=r"extra must not use the keys \['model'\]"):
        deepcompile.save_checkpoint(path, model, opt, extra={"model": 1})
    deepcompile.save_checkpoint(path, model, opt, thread_count=2, extra={"data_step": torch.tensor(STEPS_BEFORE)})
    moments = {}
    for sp in model.dc_state.sharded:
        first, n, _ = _rows(sp, rank)
        # per-element state (the moments): this rank's real rows; scalars (step): as they are
        moments[sp.meta.name] = (first, n, {k: (v[:n].clone() if _is_sharded_state(v, sp) else v)
                                            for k, v in opt.state[sp.shard].items()})
    full = deepcompile.full_state_dict(model)
    deepcompile.destroy(model)
    return full, moments


def _load_helper(rank: int, world: int, path: str):
    import torch.distributed.checkpoint as dcp

    import deepcompile

    model, opt = deepcompile.initialize(make_model(seed=7), make_optimizer, _config(3))
    deepcompile.load_checkpoint(path, model, opt)
    extra = {"data_step": torch.tensor(-1)}
    dcp.load(extra, checkpoint_id=path)
    moments = {sp.meta.name: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[sp.shard].items()}
               for sp in model.dc_state.sharded}
    full = deepcompile.full_state_dict(model)
    deepcompile.destroy(model)
    return full, moments, int(extra["data_step"])


def test_save_checkpoint_writes_a_file_per_tensor_and_loads_on_one_rank(tmp_path):
    """deepcompile.save_checkpoint (a file per tensor: the writer keeps at most thread_count
    staged tensors alive; see checkpoint.SAVE_THREADS) saved on 2 ranks loads exactly on 1 with
    deepcompile.load_checkpoint: parameters, AdamW moments and step, and the extra entry."""
    import os

    path = str(tmp_path / "helper")
    saved = run_ranks(_save_helper, 2, path, timeout=600)
    data_files = [f for f in os.listdir(path) if f.endswith(".distcp")]
    n_params = len(saved[0][1])
    # per rank: each parameter (and each moment) in a file of its own, not one file per rank
    assert len(data_files) >= 2 * n_params, sorted(data_files)[:8]
    assert any("exp_avg" in st for _, _, st in saved[0][1].values())
    (full, moments, data_step), = run_ranks(_load_helper, 1, path, timeout=600)
    assert data_step == STEPS_BEFORE
    for k, v in saved[0][0].items():
        assert torch.equal(full[k], v), k
    for _, rank_moments in saved:
        for name, (first, n, st) in rank_moments.items():
            assert set(moments[name]) == set(st), (name, sorted(st), sorted(moments[name]))
            for k, v in st.items():
                got = moments[name][k]
                if isinstance(v, torch.Tensor) and v.dim() and v.shape[1:] == got.shape[1:] and got.dim():
                    got = got.narrow(0, first, n)
                assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, (name, k)


def _offloaded_round_trip(rank, world, path):
    import torch.distributed.checkpoint as dcp

    import deepcompile
    from tests.workloads import rank_step

    model, opt = deepcompile.initialize(make_model(), make_optimizer,
                                        {"compiler": "aot_eager", "passes": ["zero3", "offload_optimizer"]})
    mgr = model.dc_state.runtime.optimizer_state
    for s in range(2):
        rank_step(model, opt, rank, world, s)
    away = len(mgr.offloaded)
    msd, osd = deepcompile.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = {k: {n: (v.to_local().clone() if hasattr(v, "to_local") else v) for n, v in d.items()}
             for k, d in osd["state"].items()}
    kept = len(mgr.offloaded)
    rank_step(model, opt, rank, world, 2)   # the state moves on, and is offloaded again
    msd, osd = deepcompile.get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)   # writes into the host copies
    deepcompile.set_state_dict(model, opt, msd, osd)
    loaded = deepcompile.get_state_dict(model, opt)[1]["state"]
    same = all(torch.equal(loaded[k][n].to_local(), v) if isinstance(v, torch.Tensor) and v.dim() else
               (float(loaded[k][n]) == float(v))
               for k, d in saved.items() for n, v in d.items())
    losses = [rank_step(model, opt, rank, world, s) for s in (2, 3)]
    deepcompile.destroy(model)
    return {"away": away, "kept": kept, "same": same, "losses": losses}


def test_offloaded_optimizer_state_saves_from_the_host_and_loads_back(tmp_path):
    """With the optimizer state offloaded between steps, the checkpoint reads it from host memory
    (nothing comes back to the device for the save); dcp.load into a state dict of the live model
    and set_state_dict put the saved state back, and training from it repeats the saved run's
    next steps."""
    import deepcompile  # noqa: F401
    from tests.workloads import rank_step  # noqa: F401

    r = run_ranks(_offloaded_round_trip, 2, str(tmp_path / "ckpt"), timeout=300)
    for x in r:
        assert x["away"] > 0 and x["kept"] == x["away"], x
        assert x["same"], "the loaded optimizer state differs from the saved one"
    # (steps 2 and 3 after the load retrace the run that was saved: same batches, same state)
    again = run_ranks(_plain_steps, 2, timeout=300)
    for x, y in zip(r, again):
        torch.testing.assert_close(torch.tensor(x["losses"]), torch.tensor(y), rtol=1e-5, atol=1e-6)


def _plain_steps(rank, world):
    import deepcompile
    from tests.workloads import rank_step

    model, opt = deepcompile.initialize(make_model(), make_optimizer,
                                        {"compiler": "aot_eager", "passes": ["zero3", "offload_optimizer"]})
    losses = [rank_step(model, opt, rank, world, s) for s in range(4)]
    deepcompile.destroy(model)
    return losses[2:]
