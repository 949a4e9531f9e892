"""Recompute: chosen blocks' saved activations are freed after forward and computed again in
backward, training matches the unsharded reference, the freed bytes are real, and every read
of a dropped value in backward reads its recomputed copy."""
from __future__ import annotations

import warnings

import pytest

from deepcompile.passes import recompute_activations as rc
from tests.test_zero3_parity import STEPS, _compare

RC_ALL = {"name": "recompute_activations", "params": {"blocks": "all"}}


def _nodes(graphs, kind, after):
    return [nodes for _, k, a, nodes in graphs if k == kind and a == after]


def _check_backward(graphs):
    """After recompute, no backward node reads a dropped value's placeholder; the recipes'
    nodes are there; one gather per shard."""
    fw = _nodes(graphs, "forward", "recompute_activations")
    bw = _nodes(graphs, "backward", "recompute_activations")
    assert fw and bw
    for f, b in zip(fw, bw):
        dropped = {n["args"][0]["node"] for n in f if n.get("target") == "dc.drop_activation"}
        assert dropped, "nothing dropped"
        placeholders = {n["name"] for n in b if n["op"] == "placeholder"}
        readers = [n["name"] for n in b if n["op"] == "call_function"
                   and any(isinstance(a, dict) and a.get("node") in dropped & placeholders for a in n.get("args", []))]
        assert not readers, f"backward still reads dropped values: {readers}"
        gathers = [tuple(map(str, n["args"])) for n in b if n.get("target") == "dc.unshard"]
        assert len(gathers) == len(set(gathers)), "a shard is gathered twice in backward"


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_recompute_matches_unsharded(compiler):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = _compare(2, 1, {"compiler": compiler, "passes": [RC_ALL, "zero3", "prefetch"]})
    for r in results:
        st = r["offload_stats"]
        # every step's forward freed the same storages, and nothing refused a drop
        assert st["drops"] > 0 and st["drops"] % STEPS == 0 and st["drops_skipped"] == 0, st
        assert st["dropped_bytes"] > 0
        _check_backward(r["graphs"])


def test_parse_blocks_names_the_bad_entry():
    assert rc.parse_blocks("") == set()
    assert rc.parse_blocks(" 0, 3 ,5") == {0, 3, 5}
    assert rc.parse_blocks("all") == "all"
    with pytest.raises(ValueError, match=r"'x' is not a block index"):
        rc.parse_blocks("0,x")


def test_recompute_must_come_before_zero3():
    from deepcompile.config import Config
    from deepcompile.params import ConfigError

    Config.load({"passes": [RC_ALL, "zero3"]})
    with pytest.raises(ConfigError, match="'recompute_activations' must come before 'zero3'"):
        Config.load({"passes": ["zero3", RC_ALL]})
