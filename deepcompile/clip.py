"""Gradient clipping over sharded gradients: the global norm, identical on every rank.

Each rank holds only its rows of every gradient, so ``torch.nn.utils.clip_grad_norm_`` run as
it is would compute each rank's own norm and clip every rank by a different factor. :func:`clip_grad_norm_` reduces the
per-rank partial norms (a sum of ``|g|^p`` or a max for ``inf``) across the group, so every
rank clips by the same, correct coefficient. ``deepcompile`` routes the plain torch call here
when it is given deepcompile parameters (``route_clip_grad_norm``, installed by ``deepcompile.initialize``).

With gradient accumulation the gradients are complete only after the backward that ends an
accumulation window (ZeRO-1 has not even reduced them before it): on the other micro-batches
clipping does nothing and returns ``None``; at the window's end it clips the accumulated
gradient, as a plain loop that clips once before each real ``optimizer.step()`` does.
"""
from __future__ import annotations

import math
import torch
import torch.distributed as dist


def _owner(p: torch.Tensor):
    ref = getattr(p, "_dc_owner", None)
    return ref() if ref is not None else None


def is_dc_param(p) -> bool:
    return isinstance(p, torch.Tensor) and getattr(p, "_dc_owner", None) is not None


def clip_grad_norm_(model_or_params, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor | None:
    """Clip the gradients of a deepcompile model by their global norm; returns that norm.

    ``model_or_params``: the model returned by ``deepcompile.initialize`` or its parameters
    (``model.parameters()``, as passed to torch's function). Collective: every rank calls it.
    Returns the total norm (the same 0-d tensor on every rank), or ``None`` on a micro-batch
    that does not end an accumulation window (nothing is clipped there).
    """
    # the model deepcompile.initialize returned (its sharded parameters' list), found by what it
    # holds: clip sits below the API and does not import it
    if isinstance(model_or_params, torch.nn.Module) and hasattr(model_or_params, "dc_state"):
        model, params = model_or_params, [sp.shard for sp in model_or_params.dc_state.sharded]
    else:
        params = [model_or_params] if isinstance(model_or_params, torch.Tensor) else list(model_or_params)
        owners = {id(o): o for o in (_owner(p) for p in params) if o is not None}
        strangers = [i for i, p in enumerate(params) if not is_dc_param(p)]
        if len(owners) != 1 or strangers:
            raise ValueError(
                "deepcompile.clip_grad_norm_: pass the model returned by deepcompile.initialize (or its "
                f"parameters); got parameters of {len(owners)} deepcompile models and {len(strangers)} "
                "parameters deepcompile does not own. Clip each model's gradients separately.")
        model = next(iter(owners.values()))
    norm_type = float(norm_type)
    if math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"deepcompile.clip_grad_norm_: norm_type must be positive or inf, got {norm_type}")
    if not model.dc_state.next_is_boundary():
        return None
    return _clip(model, params, float(max_norm), norm_type, error_if_nonfinite, foreach)


def _clip(model, params: list[torch.Tensor], max_norm: float, norm_type: float,
          error_if_nonfinite: bool, foreach: bool | None) -> torch.Tensor:
    group = model.dc_state.shard_group  # replicas (HSDP) hold the same shards: count each once
    metas = {id(sp.shard): sp for sp in model.dc_state.sharded}
    seen: set[int] = set()
    grads = []
    for p in params:
        if id(p) in seen or p.grad is None:
            continue
        seen.add(id(p))
        # padded rows hold zeros; leave them out anyway, so a non-zero pad can never count
        rows = metas[id(p)].valid_rows if id(p) in metas else p.shape[0]
        if rows > 0:  # a rank may hold only padding of a parameter with fewer rows than ranks:
            grads.append(p.grad[:rows])  # torch has no infinity norm of an empty tensor
    device = model._dc_device()
    if grads:
        local = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach).to(device, torch.float32)
    else:
        local = torch.zeros((), device=device, dtype=torch.float32)
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local
    else:
        part = local.pow(norm_type)
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
        total = part.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"deepcompile.clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
            f"{total.item()}; set error_if_nonfinite=False to clip anyway")
    real = [p for p in params if p.grad is not None]
    if real:
        torch.nn.utils.clip_grads_with_norm_(real, max_norm, total, foreach)
    return total


_CLIP_ROUTED = False


def route_clip_grad_norm() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` correct on deepcompile parameters.

    Why a patch: each rank holds only its rows of every gradient (plain tensors, not DTensors:
    see sharding.py), so torch's function would clip each rank by its own partial norm, silently
    wrong and different on every rank. Parameters that deepcompile owns are routed to
    ``deepcompile.clip_grad_norm_`` (the global norm, one all-reduce); any other call goes to
    torch's function unchanged. We replace the public module attributes
    (``torch.nn.utils.clip_grad_norm_`` and ``torch.nn.utils.clip_grad.clip_grad_norm_``, the
    same function in 2.11 and 2.13): code that looks the function up at call time, as
    nanoGPT, Hugging Face's Trainer and Accelerate do, gets the right norm. ``import deepcompile``
    patches nothing: ``deepcompile.initialize`` installs the route (once per process; later calls
    do nothing), so ``from torch.nn.utils import clip_grad_norm_`` after ``initialize`` gets it
    too; a name bound before that still holds torch's function (the README says to call
    ``deepcompile.clip_grad_norm_`` in such code).
    """
    global _CLIP_ROUTED
    if _CLIP_ROUTED:
        return
    import functools

    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad_mod

    original = clip_grad_mod.clip_grad_norm_

    @functools.wraps(original)
    def routed(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(is_dc_param(p) for p in params):
            return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)

    routed.__dc_original__ = original
    nn_utils.clip_grad_norm_ = routed
    clip_grad_mod.clip_grad_norm_ = routed
    _CLIP_ROUTED = True
