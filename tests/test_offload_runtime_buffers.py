"""offload_activations never frees a buffer the runtime keeps.

The runtime's multi-output gathers (``wait_allgather_many``, ``gather_persistent_many``,
``gather_persistent_wait``) return lists; the graph reads their items through ``getitem``, whose
target is ``operator.getitem``, not a ``dc`` op. An item saved for backward is the runtime's
gathered (or persistent) buffer: offloading it would ``resize_(0)`` that buffer under the
runtime, and the next graph would read freed memory. The pass decides by source (through getitem
and views) and by storage. CPU only: the graph is built by hand, with real tensors as its values.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from deepcompile.passes.offload_activations import OffloadActivationsParams, candidates, offload_activations
from deepcompile.passes.registry import PassContext
from deepcompile.runtime import ops

N = 512  # 512 x 512 float32: 1 MiB per tensor


def _t():
    return torch.randn(N, N)


def _graph(op_name: str, through_view: bool):
    """forward graph: an item of ``dc.<op_name>`` and a fresh ``mm`` both saved for backward."""
    ops.ensure_registered()
    op = getattr(torch.ops.dc, op_name).default
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = _t()
    first = x if op_name == "wait_allgather_many" else [x, x]
    gathered = g.call_function(op, (first, [0, 1]))
    gathered.meta["val"] = [_t(), _t()]
    item = g.call_function(operator.getitem, (gathered, 0))
    item.meta["val"] = gathered.meta["val"][0]
    other = g.call_function(operator.getitem, (gathered, 1))
    other.meta["val"] = gathered.meta["val"][1]
    saved_item = item
    if through_view:  # a view of the item: the same storage, one more hop to the source
        saved_item = g.call_function(torch.ops.aten.view.default, (item, [N * N]))
        saved_item.meta["val"] = item.meta["val"].view(N * N)
    mm = g.call_function(torch.ops.aten.mm.default, (x, item))
    mm.meta["val"] = _t()
    mm2 = g.call_function(torch.ops.aten.mm.default, (mm, other))
    mm2.meta["val"] = _t()
    out = g.output((mm2, saved_item, mm))
    out.meta["user_visible_output_idxs"] = [0]  # outputs from index 1 on are saved for backward
    return fx.GraphModule(torch.nn.Module(), g), saved_item, mm


def _ctx():
    return PassContext(graph_id=0, kind="forward", params=OffloadActivationsParams(min_mb=0.5),
                       param_meta={}, world_size=2, rank=0)


@pytest.mark.parametrize("op_name", ["wait_allgather_many", "gather_persistent_many", "gather_persistent_wait"])
def test_saved_item_of_a_runtime_gather_is_not_offloaded(op_name):
    gm, item, mm = _graph(op_name, through_view=False)
    picked, _ = candidates(gm, _ctx())
    assert item not in picked, f"the saved {item.name} (an item of dc.{op_name}) was chosen for offload"
    assert picked == [mm], f"the fresh activation should still be offloaded: {[n.name for n in picked]}"
    gm = offload_activations(gm, _ctx())
    offloaded = [n.args[0] for n in gm.graph.nodes if n.target is torch.ops.dc.offload_activation.default]
    assert offloaded == [mm], [n.name for n in offloaded]


def test_view_of_a_runtime_item_is_not_offloaded():
    """A view is not offloaded anyway (it does not own its storage); the check holds with it too."""
    gm, item, mm = _graph("wait_allgather_many", through_view=True)
    picked, _ = candidates(gm, _ctx())
    assert item not in picked and picked == [mm], [n.name for n in picked]


def test_a_runtime_item_reaching_the_offload_is_refused():
    """The offload step itself asserts its input is not a runtime output."""
    from deepcompile.passes import offload_activations as mod

    gm, item, _ = _graph("wait_allgather_many", through_view=False)
    with pytest.raises(AssertionError, match="runtime"):
        mod.offload_nodes(gm, [item], _ctx())
