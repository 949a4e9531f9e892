"""Row-aligned, padded parameter shards and how tracing sees them.

Design decision (docs/architecture.md, "how tracing sees a sharded parameter")
------------------------------------------------------------------
Each parameter of the user's model is replaced by an ``nn.Parameter`` holding this rank's rows
of it: ``ceil(d0 / world)`` rows along dim 0, the last ranks zero-padded (``shard_layout``), so
the shard has the parameter's number of dimensions and its shape past dim 0. The module
sees the full-shape value through a ``torch.nn.utils.parametrize`` parametrization whose
getter is the custom op ``torch.ops.dc.unshard(shard, id)``:

* ``model.parameters()`` yields exactly the shards, the tensors the optimizer must update;
* Dynamo traces the getter like any other code, so every captured graph contains one
  ``unshard`` node per parameter access with the shard as a graph input: the graph *before*
  the ``zero3`` pass is the model's math on full-shape values, and the pass visibly lowers each
  ``unshard`` into ``allgather_param`` / ``wait_allgather`` / ``release_param``;
* the autograd formula of ``unshard`` is ``shard_grad`` (a reduce-scatter), which the pass lowers
  to the bucketed ``reduce_grads`` (one runtime call per reduce bucket; ``reduce_grad`` for a
  gradient called on its own);
* nothing in torch's tracing is patched: the internal touches are one node tag on the joint graph
  (``aot_compat.tag_unshard_for_recompute``) so the partitioner re-gathers in backward instead of
  saving full parameters between forward and backward, and a leaner getter on the class
  parametrize made for each module (``nn_compat.direct_parametrization_getter``: it calls
  ``Unshard.forward`` on the shard directly, where parametrize's own property made Dynamo inline
  three module calls at every access).

Why rows, not a flat range of ``ceil(numel / world)`` elements: a
user's loop asks the parameters questions. nanoGPT and most recipes put ``p.dim() >= 2`` in
the weight-decay group; every flat shard would be 1-D, so that group would come out empty and
training would differ silently. Row shards answer ``dim()``/``ndim``/``len(shape)`` as the unsharded
parameter does without any lie, and they are still one contiguous range of the flattened
parameter, so the runtime gathers and reduce-scatters them as flat ranges. The layout is also
exactly DTensor ``Shard(0)`` (torch.chunk's uneven split): ``deepcompile.checkpoint`` wraps
shards as DTensors (``DTensor.from_local``) only when saving, so ``torch.distributed.checkpoint``
reshards and writes original shapes. Cost: up to ``world - 1`` padded rows per parameter instead
of ``world - 1`` elements, and a parameter of fewer rows than ranks lives on the first ranks only
(FSDP2 makes the same trade).

Weighed and rejected: the shard *as* a DTensor parameter, as FSDP2 and SimpleFSDP
do, which would also make torch's own ``clip_grad_norm_`` global. Against it: the optimizer's
foreach/fused kernels would run through DTensor dispatch every step (host time, which the
host-bound step cannot spare); Dynamo and AOTAutograd would trace a tensor subclass at every
parameter access (compile time, and a graph before our pass that already carries DTensor
redistributions); the C++ runtime registers and writes gradients into plain tensors. Clipping
is instead one all-reduce in ``deepcompile.clip_grad_norm_``, with torch's public function
routed there for our parameters by ``initialize`` (``clip.route_clip_grad_norm``).

Rejected alternatives for tracing:

* patching fake-tensor creation so empty parameters look full-size (the reference design):
  about twenty internal touch points that broke on each torch release;
* freed storage with intact metadata (FSDP1/2 style): ``model.parameters()`` would return
  full-shape tensors with no storage, not what the optimizer must update, and Dynamo must then
  be taught that those tensors are special;
* DTensor parametrization (SimpleFSDP): sound, but the graph before our pass would already carry
  DTensor collectives we do not control, and it pulls the DTensor stack into every trace.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from deepcompile.compat import nn as nn_compat
from deepcompile.runtime import ops


class Unshard(nn.Module):
    """Parametrization: shard (1-D, padded) -> full-shape parameter, via ``dc::unshard``."""

    def __init__(self, meta: ops.ParamMeta):
        super().__init__()
        self.pid = meta.id
        self.meta = meta
        # inside a block traced once (nested.wrap): the id as a 0-d CPU tensor, an input of the
        # traced body rather than a constant of it, and the full shape and dtype the int form
        # reads from the runtime's parameter registry by id
        self.pid_t: torch.Tensor | None = None
        self.full: tuple[list[int], torch.dtype] | None = None

    def use_tensor_id(self) -> None:
        m = self.meta
        self.pid_t = torch.tensor(self.pid, dtype=torch.int64)
        self.pid_t._dc_pid = self.pid  # read back from the Dynamo graph's inputs (nested.input_ids)
        self.full = (list(m.shape), m.gather_dtype)

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        if self.pid_t is None:
            return torch.ops.dc.unshard(shard, self.pid)
        return torch.ops.dc.unshard_block(shard, self.pid_t, *self.full)


@dataclass
class ShardedParam:
    meta: ops.ParamMeta
    shard: nn.Parameter
    names: list[str] = field(default_factory=list)  # every name the parameter has (tied weights)
    valid_rows: int = 0  # this rank's rows that are real rows of the parameter (the rest pad)


def shard_layout(shape: tuple[int, ...], world: int) -> tuple[int, tuple[int, ...]]:
    """(numel of each rank's shard, the shard's shape) for a parameter of ``shape``.

    Shards are split along dim 0, ``ceil(d0 / world)`` rows per rank, zero rows padding the
    last ranks (torch.chunk's split, as DTensor ``Shard(0)`` and FSDP2 lay it out). A 0-d
    parameter is one row of one element.
    """
    rows, rest = (shape[0], tuple(shape[1:])) if len(shape) else (1, ())
    c0 = -(-rows // world)
    row = 1
    for d in rest:
        row *= d
    return c0 * row, (c0, *rest)


def valid_rows(shape: tuple[int, ...], world: int, rank: int) -> int:
    """How many of this rank's shard rows hold real (unpadded) rows of the parameter."""
    rows = shape[0] if len(shape) else 1
    c0 = -(-rows // world)
    return max(0, min(c0, rows - rank * c0))


def shard_tensor(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's rows of ``full`` (dim 0, zero-padded to ``ceil(d0 / world)`` rows)."""
    chunk, shape = shard_layout(tuple(full.shape), world)
    flat = full.detach().reshape(-1)
    out = torch.zeros(shape, dtype=full.dtype, device=full.device)
    lo, hi = rank * chunk, min((rank + 1) * chunk, flat.numel())
    if hi > lo:
        out.view(-1)[: hi - lo].copy_(flat[lo:hi])
    return out


def _check_same_on_all_ranks(table: list[tuple[str, tuple[int, ...], str]], group) -> None:
    world = dist.get_world_size(group)
    if world == 1:
        return
    # the runtime's reduce path (config reduce_pack) decides which collectives a rank issues:
    # ranks that differ would wait on each other forever
    pack = ops.C.reduce_pack() if ops.C.is_initialized() else None
    tables: list = [None] * world
    dist.all_gather_object(tables, (table, pack), group=group)
    for r, (_, e) in enumerate(tables):
        if e != tables[0][1]:
            raise ValueError(
                f"deepcompile: config reduce_pack is {tables[0][1]!r} on rank 0 and {e!r} on rank {r}. It changes "
                "which collectives a rank issues, so ranks that differ would wait on each other forever: "
                "give every rank the same config.")
    tables = [t for t, _ in tables]
    ref = tables[0]
    for r, t in enumerate(tables):
        if len(t) != len(ref):
            raise ValueError(
                f"deepcompile: rank {r} has {len(t)} parameters, rank 0 has {len(ref)}. "
                "Every rank must build the same model before deepcompile.initialize."
            )
        for a, b in zip(ref, t):
            if a != b:
                raise ValueError(
                    f"deepcompile: parameter '{b[0]}' differs across ranks: rank 0 has "
                    f"{a[0]} {list(a[1])} {a[2]}, rank {r} has {b[0]} {list(b[1])} {b[2]}. "
                    "Shards must match on every rank; build the same model on each rank."
                )


def shard_module(module: nn.Module, *, group, device: torch.device,
                 gather_dtype: torch.dtype | None, registry: dict[int, ops.ParamMeta],
                 first_id: int = 0) -> list[ShardedParam]:
    """Replace every parameter of ``module`` by this rank's shard, in place, and enter each
    parameter's metadata in ``registry`` (the runtime state's ``params``) and the C++ runtime.

    Returns the sharded parameters in a deterministic order (first appearance), which is the
    same on every rank, so parameter ids agree across ranks.
    """
    C = ops.ensure_registered()
    world, rank = dist.get_world_size(group), dist.get_rank(group)

    by_tensor: dict[int, ShardedParam] = {}
    owners: list[tuple[nn.Module, str, int]] = []
    order: list[ShardedParam] = []
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in list(mod._parameters.items()):
            if p is None:
                continue
            full_name = f"{mod_name}.{attr}" if mod_name else attr
            sp = by_tensor.get(id(p))
            if sp is None:
                pid = first_id + len(order)
                gdt = gather_dtype if (gather_dtype is not None and p.is_floating_point()) else p.dtype
                chunk, shard_shape = shard_layout(tuple(p.shape), world)
                meta = ops.ParamMeta(
                    id=pid, name=full_name, shape=tuple(p.shape), numel=p.numel(),
                    chunk=chunk, dtype=p.dtype, gather_dtype=gdt,
                    requires_grad=p.requires_grad, shard_shape=shard_shape,
                )
                shard = nn.Parameter(shard_tensor(p.to(device), world, rank),
                                     requires_grad=p.requires_grad)
                sp = ShardedParam(meta=meta, shard=shard,
                                  valid_rows=valid_rows(tuple(p.shape), world, rank))
                by_tensor[id(p)] = sp
                order.append(sp)
            if full_name not in sp.names:
                sp.names.append(full_name)
            owners.append((mod, attr, by_tensor[id(p)].meta.id))

    _check_same_on_all_ranks(
        [(sp.meta.name, sp.meta.shape, str(sp.meta.dtype)) for sp in order], group)

    for sp in order:
        registry[sp.meta.id] = sp.meta
        C.register_param(sp.meta.id, sp.meta.name, sp.shard, list(sp.meta.shape),
                         sp.meta.gather_dtype)
    by_id = {sp.meta.id: sp for sp in order}
    for mod, attr, pid in owners:
        if parametrize.is_parametrized(mod, attr):
            continue  # a module reached twice through named_modules(remove_duplicate=False)
        mod._parameters[attr] = by_id[pid].shard
        parametrize.register_parametrization(mod, attr, Unshard(by_id[pid].meta), unsafe=True)
        nn_compat.direct_parametrization_getter(mod, attr)
    return order
