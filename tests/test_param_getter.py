"""A sharded parameter's getter (``nn_compat.direct_parametrization_getter``): one ``dc.unshard``
per access, traced in the owning module's scope (no parametrization module calls for Dynamo to
inline), and a deep copy's getter reads its own shard."""
from __future__ import annotations

import copy

from tests.dist_utils import run_ranks


def _check(rank, world):
    import deepcompile
    from deepcompile.sharding import Unshard
    from tests import workloads as w

    model, opt = deepcompile.initialize(w.make_model(), w.make_optimizer,
                                        {"compiler": "aot_eager", "passes": ["zero3"], "plan_cache": False})
    w.rank_step(model, opt, rank, world, 0)
    # the traced forward: each access is one unshard node whose module stack ends at the owner,
    # never at a ParametrizationList or the Unshard module (what parametrize's property called)
    fwd = [v for v in model.dc_graphs if v.kind == "forward" and v.after == "input"][0]  # before zero3
    scopes = sorted({n["scope"] for n in fwd.nodes if n["target"] in ("dc.unshard", "dc.unshard_block")})
    mods = {name for name, _ in model.module.named_modules()}
    owners = [s.rsplit(".", 2)[0] if s.count(".") >= 2 else "" for s in scopes]
    lin = model.module.blocks[0].attn.qkv
    twin = copy.deepcopy(lin)
    u = twin.parametrizations["weight"].dc_parametrization
    own = (isinstance(u, Unshard) and u is twin.parametrizations["weight"][0]
           and u is not lin.parametrizations["weight"].dc_parametrization and twin.parametrizations["weight"].original.shape
           == lin.parametrizations["weight"].original.shape)
    return dict(scopes=scopes, known=[o in mods for o in owners], own=own)


def test_each_access_is_one_unshard_in_its_owners_scope():
    for r in run_ranks(_check, 2, timeout=300):
        assert r["own"], r
        # the record keeps an access's scope as <owner module>.<attr>.0 (report.graph_groups reads
        # the module back); a parametrization module in the stack would add a level
        assert r["scopes"] and all(r["known"]), r["scopes"]
        assert not any("parametrizations" in s or "dc_parametrization" in s for s in r["scopes"]), r["scopes"]
