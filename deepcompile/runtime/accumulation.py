"""Gradient accumulation in a plain loop: the user's optimizer steps and zeroes its gradients
only every N-th call (config ``gradient_accumulation_steps``), and under ZeRO-1 the runtime
communicates only in the backward that ends a window.
"""
from __future__ import annotations

import types

import torch

from deepcompile.runtime import ops


def wrap_for_accumulation(opt: torch.optim.Optimizer, accumulation: int, sync_only_at_boundary: bool = False
                    ) -> torch.optim.Optimizer:
    """Plain loop, accumulated: ``step()`` / ``zero_grad()`` only act every N-th micro-batch.

    The user's optimizer object is kept (LR schedulers and isinstance checks still work);
    only its bound ``step`` and ``zero_grad`` are wrapped on the instance.
    """
    if accumulation == 1:
        opt.dc_next_is_boundary = lambda: True
        return opt
    inner_step, inner_zero = opt.step, opt.zero_grad
    state = {"micro": 0, "stepped": False}

    def next_is_boundary() -> bool:
        """The backward running next ends an accumulation window (the next step() really steps)."""
        return (state["micro"] + 1) % accumulation == 0

    def set_sync():
        # ZeRO-1: the next backward communicates only if it ends an accumulation window
        if sync_only_at_boundary:
            ops.C.set_grad_sync(next_is_boundary())

    set_sync()

    def step(_opt, *args, **kwargs):
        state["micro"] += 1
        set_sync()
        if state["micro"] % accumulation == 0:
            state["stepped"] = True
            return inner_step(*args, **kwargs)
        return None

    def zero_grad(set_to_none: bool = True):
        if state["stepped"]:
            state["stepped"] = False
            inner_zero(set_to_none=set_to_none)

    # a bound method, as torch's own: LRScheduler re-wraps ``optimizer.step`` through its ``__func__``
    # (torch/optim/lr_scheduler.py, 2.11 and 2.13); a plain function made every scheduler fail
    opt.step, opt.zero_grad = types.MethodType(step, opt), zero_grad
    opt.dc_micro_steps = lambda: state["micro"]
    opt.dc_next_is_boundary = next_is_boundary
    return opt
