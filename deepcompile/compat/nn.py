"""torch.nn, torch.optim and torch.cuda shims: a parametrization's getter, the optimizers' foreach
default, the profiler's GPU spin (torch 2.11 on the GPU machines, 2.13 here; each function names
what it relies on)."""
from __future__ import annotations

import torch


def direct_parametrization_getter(mod, attr: str) -> None:
    """Make ``mod.<attr>`` call the parametrization's ``forward`` on the original directly.

    The property ``torch.nn.utils.parametrize.register_parametrization`` installs runs
    ``ParametrizationList.__call__`` (a module call), ``self[0]`` (a ``ModuleList`` index), the
    parametrization's module call and a ``hasattr`` that misses (it looks for a second
    parametrization) at every access. Dynamo inlines all of that at every access of every layer:
    it doubled the Dynamo trace of a 16-layer CPU Llama. This
    getter reads the same original and calls the same (single) parametrization, held in the
    list's ``__dict__`` so that ``deepcopy`` copies it with the list; the setter is kept.

    Internal: the property lives on the class parametrize made for this module alone
    (``_inject_new_class``, 2.11 and 2.13); it is replaced there and nowhere else. The getter
    reads everything through ``self``, so it stays right for any module of that class."""
    from torch.nn.utils import parametrize

    cls = type(mod)
    prop = cls.__dict__.get(attr)
    plist = mod.parametrizations[attr]
    if not (parametrize.is_parametrized(mod, attr) and isinstance(prop, property) and len(plist) == 1
            and plist.is_tensor):
        raise RuntimeError(f"deepcompile: {cls.__name__}.{attr} is not a single parametrization of one tensor "
                           "as torch.nn.utils.parametrize installs it; this torch version is not supported")
    plist.__dict__["dc_parametrization"] = plist[0]

    def unsharded(self, _name=attr):
        p = self.parametrizations[_name]
        return p.dc_parametrization.forward(p.original)

    setattr(cls, attr, property(unsharded, prop.fset))


def default_foreach(params: list, differentiable: bool = False) -> bool:
    """Whether torch's optimizers pick their foreach (multi-tensor) kernels for ``params`` when the
    group says neither ``foreach`` nor ``fused``: ``torch.optim.optimizer._default_to_fused_or_foreach``
    (private; same signature and meaning in 2.11 and 2.13: foreach where every parameter is a plain
    Tensor/Parameter on a device with foreach kernels, CUDA, and not differentiable). Where this
    torch lacks it: CUDA parameters only, its rule in those versions."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # pragma: no cover - a torch that moved it
        return not differentiable and bool(params) and all(p.device.type == "cuda" for p in params)
    return bool(_default_to_fused_or_foreach(params, differentiable, use_fused=False)[1])


def gpu_spin(cycles: int) -> None:
    """Enqueue a kernel that spins for ``cycles`` GPU clock cycles on the current stream.

    The profiler parks the compute stream with it so that its CUDA events time kernels, not the
    interpreter (``profile.profiler._GpuLead``). ``torch.cuda._sleep`` is private (it backs
    torch's own stream tests) and has the same signature in 2.11 and 2.13.
    """
    torch.cuda._sleep(int(cycles))
