"""The graphs a warm-up compile keeps for trace once, and the callables that hold them.

A Python (warm-up) compile that a scheduled re-compile will follow keeps each partitioned graph
(:class:`Kept`) and hands AOTAutograd a :class:`Slot`: the re-compile runs the new pass list on
copies of the kept graphs, compiles them and re-points the slots (``Backend.retarget``), so that
neither Dynamo's guarded code nor AOTAutograd's wrappers are built again. It may do so only
where the new graphs keep the :func:`signature` AOTAutograd's runtime wrapper was built for;
:class:`Mismatch` says why not, and the backend re-traces.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.fx as fx


class Slot:
    """The callable AOTAutograd's runtime wrapper holds for one compiled graph: an indirection the
    trace-once re-compile re-points at the final compiled code (compile/trace_once.py),
    so that neither Dynamo's guarded code nor AOTAutograd's wrappers need to be built again."""

    # ``fn`` lives in a slot, not in __dict__: torch._dynamo.disable's functools.wraps copies the
    # instance's __dict__ onto its wrapper, and a copied ``fn`` would keep the warm-up graph (and
    # everything it closes over) alive after the re-point
    __slots__ = ("fn", "__dict__", "__weakref__")

    def __init__(self, fn: Callable):
        self.fn = fn
        # AOTAutograd calls compiled graphs with one list of arguments. An instance attribute:
        # AOTAutograd wraps the backward in torch._dynamo.disable, whose functools.wraps copies
        # the instance's __dict__, not its class's attributes
        self._boxed_call = True

    def __call__(self, args):
        return self.fn(args)


@dataclass
class Kept:
    """A partitioned graph kept from the warm-up compile for trace-once (before our passes)."""
    graph_id: int
    kind: str
    traced: Any                  # trace_once.TracedGraph
    slot: Slot
    signature: tuple             # (placeholders, outputs that are None) after the warm-up passes
    dynamo_nodes: list           # the Dynamo graph's serialized nodes (re-recorded at the re-compile)


def signature(gm: fx.GraphModule) -> tuple:
    """What AOTAutograd's runtime wrapper relies on: the number of inputs and, per output, whether
    it is a value or None (zero3 turns gradient outputs into None; the wrapper was built for that)."""
    n_in = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out if isinstance(out, (list, tuple)) else [out]
    return n_in, tuple(o is None for o in out)


class Mismatch(Exception):
    """The kept graphs cannot take the new pass list (retarget falls back to a re-trace)."""
