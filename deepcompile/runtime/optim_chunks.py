"""A bounded optimizer-step peak: the user's param groups stepped in chunks of about N MiB.

Why. torch's foreach optimizers run their multi-tensor kernels once per param group, and some of
those kernels allocate a whole group's worth of temporaries at once: ``_multi_tensor_adam``
(Adam and AdamW, torch/optim/adam.py, checked in 2.11 and 2.13) computes
``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)``, one new tensor per parameter of
the group, before it updates any of them (plus ``torch._foreach_neg(grads)`` under ``maximize``
and ``torch._foreach_add(grads, params)`` for Adam's non-decoupled weight decay). With one group of
a 953M model's fp32 shards on 2 ranks that is 1.78 GiB on top of the shards, the gradients and the
state: the step's peak, and FSDP2's. Stepping the same group as several groups with identical
options bounds that temporary by the largest chunk; every element is updated by the same kernel
with the same scalars (bias corrections are per parameter, from its own ``step``), so the result
is bitwise identical. ``fused=True`` (``_fused_adam``: one fused kernel per device/dtype list, no
list-sized temporaries) and ``foreach=False`` (``_single_tensor_adam``: ``exp_avg_sq.sqrt()`` one
parameter at a time) gain nothing; chunking them is harmless (same math, a few more Python calls).

Design: the user's view never changes. ``optimizer.param_groups`` stays the user's groups
(state_dict, load_state_dict, DCP's get/set_state_dict, LR schedulers, ``add_param_group`` and
deepcompile.checkpoint all see exactly what they saw before); only for the duration of
``optimizer.step()`` the attribute is swapped for a list of chunk groups, built at that moment
from the current groups (a shallow copy of each group's options with a slice of its ``params``),
and swapped back in ``finally``. So an option the user or a scheduler changes between steps
(``lr``, ``weight_decay``, a tensor ``lr``) reaches every chunk by construction, and a
``load_state_dict`` that replaces the group dicts is picked up at the next step. An option the
optimizer itself writes into a group during the step (none of torch's do in 2.11/2.13) is copied
back to the user's group when every chunk of it agrees. The state is keyed by parameter, which
the chunks share, so ``optimizer.state`` is the same either way.

Rejected: splitting ``param_groups`` for good (the user-visible state dict would change shape and
every scheduler would have to be told), and a subclass swapped in (isinstance-visible, and
``type(opt)`` is what deepcompile.checkpoint calls).

The swap wraps the instance's ``step`` as a bound method (``types.MethodType``): torch's
LRScheduler re-wraps ``optimizer.step`` through ``step.__func__``, which a plain function lacks.
The step hooks (``register_step_pre_hook``/``post_hook``) run inside, on the chunked view;
runtime.optimizer_state keys its tensors by the user's groups, which the swap leaves in
``optimizer.dc_user_param_groups`` for the step's duration.
"""
from __future__ import annotations

import types
from typing import Iterable

import torch

MIB = 2 ** 20

# torch optimizers whose step() is a loop over param_groups with per-group options only: the
# ones that can be chunked. LBFGS reads param_groups[0] alone; SparseAdam has no foreach path.
_CHUNKABLE = ("Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "ASGD",
              "Adadelta", "Rprop")


def torch_kind(opt: torch.optim.Optimizer, names) -> str | None:
    """The name of the first class of ``opt``'s MRO that is torch's own optimizer among ``names``
    (a user's subclass of AdamW is an AdamW), or None."""
    return next((c.__name__ for c in type(opt).__mro__
                 if c.__module__.startswith("torch.optim") and c.__name__ in names), None)


def chunkable(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` is one of torch's per-group optimizers (its step can run on chunk groups)."""
    return torch_kind(opt, _CHUNKABLE) is not None


def split(sizes: list[int], chunk_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of ``sizes`` (bytes, in parameter order), each of at most
    ``chunk_bytes`` unless one parameter alone is larger; ``chunk_bytes <= 0``: one range."""
    if chunk_bytes <= 0 or not sizes:
        return [(0, len(sizes))]
    out, start, acc = [], 0, 0
    for i, s in enumerate(sizes):
        if i > start and acc + s > chunk_bytes:
            out.append((start, i))
            start, acc = i, 0
        acc += s
    out.append((start, len(sizes)))
    return out


def largest_chunk(groups: list[list[int]], chunk_bytes: int) -> int:
    """Bytes of the largest chunk ``split`` makes of any group (the foreach temporaries' bound)."""
    return max((sum(g[a:b]) for g in groups for a, b in split(g, chunk_bytes)), default=0)


def count_chunks(groups: list[list[int]], chunk_bytes: int) -> int:
    return sum(len(split(g, chunk_bytes)) for g in groups if g)


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def group_sizes(opt: torch.optim.Optimizer) -> list[list[int]]:
    """Each user group's parameter bytes, in order (what the chunks are cut from)."""
    return [[_nbytes(p) for p in g["params"]] for g in opt.param_groups]


def _resolved_foreach(group: dict) -> bool:
    """Whether torch runs this group's step with its multi-tensor (foreach) kernels: explicit
    ``foreach``, else torch's default (``_default_to_fused_or_foreach``: foreach where every
    parameter is on a device with foreach kernels, CUDA here, and not differentiable)."""
    if group.get("fused"):
        return False
    fe = group.get("foreach")
    if fe is not None:
        return bool(fe)
    from deepcompile.compat import nn as nn_compat

    return nn_compat.default_foreach(list(group["params"]), bool(group.get("differentiable", False)))


def temp_factor(opt: torch.optim.Optimizer) -> float:
    """State-sized copies of a whole group that the step allocates at once (0: none that grow with
    the group). Adam/AdamW under foreach: 1 (``_foreach_sqrt`` of ``exp_avg_sq``), +1 under
    ``maximize`` (``_foreach_neg(grads)``), +1 for Adam's non-decoupled weight decay without
    ``maximize`` (``_foreach_add(grads, params)``). Other optimizers: 0 (the planner then predicts
    no gain and chunks only by hand): counting less than is there errs on the safe side, the
    measured peak keeps the rest."""
    if not chunkable(opt) or not isinstance(opt, torch.optim.Adam):
        return 0.0
    best = 0.0
    for g in opt.param_groups:
        if not g["params"] or not _resolved_foreach(g):
            continue
        f = 1.0
        if g.get("maximize"):
            f += 1.0
        elif g.get("weight_decay") and not (isinstance(opt, torch.optim.AdamW) or g.get("decoupled_weight_decay")):
            f += 1.0
        best = max(best, f)
    return best


class OptimizerChunks:
    """Steps ``opt`` in chunk groups of at most ``chunk_bytes`` (0: as the user's groups)."""

    def __init__(self, opt: torch.optim.Optimizer, chunk_bytes: int = 0):
        if not chunkable(opt):
            raise TypeError(f"deepcompile: optimizer_chunk_mb: {type(opt).__name__} is not one of torch's "
                            f"per-group optimizers ({', '.join(_CHUNKABLE)}), so its step cannot be split into "
                            "chunk groups; set optimizer_chunk_mb to 0 or 'auto'")
        self.opt = opt
        self.chunk_bytes = max(0, int(chunk_bytes))
        self.last_chunks = 0   # chunk groups the last step ran (0 before any)
        self._cache: dict = {}
        inner = opt.step   # the bound class step (with its hooks), or whatever wrapped it before us

        def step(this, *args, **kwargs):
            return self._step(inner, *args, **kwargs)

        step._dc_chunked = True
        opt.step = types.MethodType(step, opt)

    def set_chunk_mb(self, mb: float) -> None:
        self.chunk_bytes = max(0, int(float(mb) * MIB))

    def _ranges(self, params: list) -> list[tuple[int, int]]:
        key = (self.chunk_bytes, tuple(id(p) for p in params))
        r = self._cache.get(key)
        if r is None:
            if len(self._cache) > 64:
                self._cache.clear()
            r = self._cache[key] = split([_nbytes(p) for p in params], self.chunk_bytes)
        return r

    def chunk_groups(self, groups: Iterable[dict]) -> tuple[list[dict], list[tuple[dict, dict]]]:
        """The chunk view of ``groups`` and (user group, chunk) pairs for copying back."""
        view, owners = [], []
        for g in groups:
            params = g["params"]
            ranges = self._ranges(params)
            if len(ranges) == 1:
                view.append(g)  # the user's own dict: nothing to copy
                continue
            for a, b in ranges:
                c = dict(g)
                c["params"] = params[a:b]
                view.append(c)
                owners.append((g, c))
        return view, owners

    def _step(self, inner, *args, **kwargs):
        opt = self.opt
        if self.chunk_bytes <= 0:
            self.last_chunks = len(opt.param_groups)
            return inner(*args, **kwargs)
        user = opt.param_groups
        view, owners = self.chunk_groups(user)
        self.last_chunks = len(view)
        if not owners:
            return inner(*args, **kwargs)
        opt.param_groups = view
        opt.dc_user_param_groups = user   # for the step hooks that key by the user's groups (optimizer_state)
        try:
            return inner(*args, **kwargs)
        finally:
            opt.param_groups = user
            del opt.dc_user_param_groups
            _copy_back(owners)


def _copy_back(owners: list[tuple[dict, dict]]) -> None:
    """Options the optimizer wrote into chunk groups during the step, back into the user's group
    when every chunk of it holds the same new value (torch's own optimizers write none)."""
    by_user: dict[int, list] = {}
    for g, c in owners:
        by_user.setdefault(id(g), [g]).append(c)
    for g, *cs in by_user.values():
        for k, v in cs[0].items():
            if k == "params" or (k in g and g[k] is v):
                continue
            if all(k in c and c[k] is v for c in cs[1:]):
                g[k] = v


def install(opt: torch.optim.Optimizer, setting) -> OptimizerChunks | None:
    """The chunker for ``opt`` under the config's ``optimizer_chunk_mb``: a number of MiB sets it
    (0: off); ``"auto"`` installs it off, for the planner to set, where ``opt`` can be chunked."""
    if setting == "auto":
        return OptimizerChunks(opt, 0) if chunkable(opt) else None
    mb = float(setting)
    if mb <= 0:
        return None
    return OptimizerChunks(opt, int(mb * MIB))
