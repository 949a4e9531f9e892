"""torch's fused optimizer kernel for the flat shards, where the user left the kernel to torch.

Why. With ``fused`` and ``foreach`` both unset, torch steps Adam and AdamW on CUDA with its
multi-tensor (foreach) kernels: about a dozen passes over the parameters, gradients and moments,
plus a group-sized temporary (``_foreach_sqrt``, what ``optim_chunks`` bounds). Its fused kernel
(``torch._fused_adamw_``) reads each element's parameter, gradient and two moments once and writes
three back. The shards deepcompile hands the optimizer are fp32 CUDA tensors, which the fused
kernels take. On 2 H200s at the Llama-3-8B shape (4.0 G fp32 elements per rank) the foreach step
is 90 ms of GPU time per step, where the fused kernel's 28 bytes per element at the device's
bandwidth are ~25 ms.

What changes: each eligible param group gets ``fused=True`` before the first step (the state is
created lazily, so its ``step`` counters are made where the fused kernel wants them). The math is
torch's Adam/AdamW/SGD, the same formula, in one kernel: results agree with the foreach step to
rounding, not bitwise. A group where the user chose (``fused`` or ``foreach`` set, or
``differentiable``) is left as it is; config ``optimizer_fused: false`` leaves every group.
``_step_supports_amp_scaling`` stays as the optimizer set it: a GradScaler unscales the gradients
itself, as it does for the foreach step.
"""
from __future__ import annotations

import torch

from deepcompile.runtime.optim_chunks import torch_kind

# torch optimizers with a fused CUDA kernel, their step a loop over param groups (torch 2.11, 2.13)
FUSED = ("Adam", "AdamW", "SGD")


def why_not(opt: torch.optim.Optimizer, group: dict) -> str | None:
    """Why ``group`` of ``opt`` cannot step with the fused kernel (None: it can)."""
    if torch_kind(opt, FUSED) is None:
        return f"{type(opt).__name__} has no fused kernel in torch (only {', '.join(FUSED)})"
    if group.get("differentiable"):
        return "differentiable=True"
    if group.get("foreach"):
        return "foreach=True"
    bad = [p for p in group["params"] if not (p.is_cuda and p.dtype in (torch.float32, torch.float16, torch.bfloat16))]
    if bad:
        p = bad[0]
        return f"a parameter on {p.device} of {p.dtype} (the fused kernels take CUDA floating-point tensors)"
    return None


def install(opt: torch.optim.Optimizer, setting) -> list[int]:
    """Set ``fused=True`` on the param groups of ``opt`` that may take it; returns their indices.

    ``setting`` (config ``optimizer_fused``): ``"auto"``, the groups where the user left both
    ``fused`` and ``foreach`` unset and the kernel takes the parameters; ``True``, every group, or
    a ValueError naming the group that cannot; ``False``, none."""
    if setting is False:
        return []
    out = []
    for i, g in enumerate(opt.param_groups):
        if not g["params"] or g.get("fused"):
            continue
        reason = why_not(opt, g)
        if setting is True and reason is not None:
            raise ValueError(f"optimizer_fused: true, but param group {i} cannot use torch's fused kernel: "
                             f"{reason}; set optimizer_fused to 'auto' (fused where it can) or false")
        if reason is None and (setting is True or (g.get("fused") is None and g.get("foreach") is None)):
            g["fused"] = True
            out.append(i)
    return out
