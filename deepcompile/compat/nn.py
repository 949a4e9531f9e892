"""torch.nn, torch.optim and torch.cuda shims: a parametrization's getter, the optimizers' foreach
default, the profiler's GPU spin. Checked against torch 2.11 (GPU machines) and 2.13 (CI)."""
from __future__ import annotations

import torch


def direct_parametrization_getter(mod, attr: str) -> None:
    """Make ``mod.<attr>`` call its parametrization's ``forward`` on the original directly: the
    property ``register_parametrization`` installs makes two module calls, an index and a missing
    ``hasattr`` per access, all inlined by Dynamo (twice a 16-layer CPU Llama's trace). The one
    parametrization sits in the list's ``__dict__`` (``deepcopy`` copies it). The property is replaced
    on the class made for ``mod`` alone (``_inject_new_class``); the setter is kept."""
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
    """Whether torch's optimizers pick foreach kernels for ``params`` when the group sets neither
    ``foreach`` nor ``fused``: the private ``torch.optim.optimizer._default_to_fused_or_foreach``
    (foreach for plain CUDA tensors, not differentiable); without it, that rule."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # pragma: no cover - a torch without it
        return not differentiable and bool(params) and all(p.device.type == "cuda" for p in params)
    return bool(_default_to_fused_or_foreach(params, differentiable, use_fused=False)[1])


def gpu_spin(cycles: int) -> None:
    """Enqueue a kernel spinning ``cycles`` GPU clock cycles on the current stream, with which the
    profiler parks the compute stream so its CUDA events time kernels, not the interpreter
    (``profile.profiler._GpuLead``): ``torch.cuda._sleep``, private, backs torch's stream tests."""
    torch.cuda._sleep(int(cycles))
