"""Op names and classes as the cost model and the profiler file them: an FX target's own name,
and whether it is a matmul, attention, a dc runtime op (communication), a view or anything else."""
from __future__ import annotations

import functools

# Ops that only make a new view of their input's memory: no kernel, in eager or compiled code.
# The final graph is traced again (under Inductor's decompositions), so it has views the
# profiled graph did not (``t`` becomes ``permute``); pricing those by the bytes they "move"
# cost tens of ms on the 953M Llama.
VIEW_OPS = {"view", "_unsafe_view", "reshape", "permute", "t", "transpose", "expand", "unsqueeze", "squeeze",
            "slice", "select", "alias", "as_strided", "detach", "split", "split_with_sizes", "unbind",
            "view_as", "unflatten", "flatten", "_reshape_alias", "narrow"}
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_scaled_mm"}


def op_name(target: str) -> str:
    """``aten.addmm.default`` -> ``addmm`` (the op's own name; a substring test would file
    ``convert_element_type`` under convolutions)."""
    parts = str(target).split(".")
    return parts[1] if len(parts) >= 2 else parts[0]


@functools.lru_cache(maxsize=8192)  # a few hundred distinct targets, asked once per node per estimate
def op_class(target: str) -> str:
    """matmul, attention, communication, view or other (pointwise, reductions, copies)."""
    target = str(target)
    if target.startswith("dc."):
        return "communication"
    name = op_name(target)
    if "attention" in name or "flash" in name:
        return "attention"
    if name in MATMUL_OPS:
        return "matmul"
    return "view" if name in VIEW_OPS else "other"
