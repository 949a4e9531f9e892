"""Input dimensions that vary (dynamic padding), agreed across ranks, so that graphs are compiled
once with those dimensions symbolic instead of once per length and once per rank.

Why: with per-rank dynamic padding (Hugging Face's ``DataCollatorWithPadding`` pads each rank's
batch to its own longest sequence) every rank sees different lengths. Left to Dynamo, each rank
compiles a static graph for its first length and a symbolic one at its second (automatic dynamic
shapes), at its own moment: at the profiling step one rank ran a static graph and another a
symbolic one, their profiles differed and the default plan died in ``agree``. And every
scheduled re-compile (``torch._dynamo.reset()``, which also forgets automatic-dynamic state)
compiled static and then symbolic again.

What: the model's forward records the sizes of its tensor inputs (top level and one level into
lists, tuples and dicts: ``model(**batch)``). At the optimizer steps right before the profiling
step and before each scheduled re-compile (the same step on every rank, so a collective is safe
there), ranks exchange what they saw; a dimension that took two sizes on any rank, or differs
between ranks, is dynamic for everyone from then on, and every later call marks it on its
inputs (``torch._dynamo.maybe_mark_dynamic``) before Dynamo sees them. All ranks then compile the same
symbolic graph at the same step, and new lengths reuse it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _tensors(args, kwargs):
    """(key, tensor) for the tensor inputs of one call, one container level deep."""
    def walk(prefix, v, depth):
        if isinstance(v, torch.Tensor):
            yield prefix, v
        elif depth == 0 and isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                yield from walk(prefix + (i,), x, 1)
        elif depth == 0 and isinstance(v, dict):
            for k, x in v.items():
                yield from walk(prefix + (str(k),), x, 1)
    for i, a in enumerate(args):
        yield from walk(("arg", i), a, 0)
    for k, a in kwargs.items():
        yield from walk(("kwarg", str(k)), a, 0)


class DynamicDims:
    def __init__(self):
        self.seen: dict[tuple, list[set[int]]] = {}    # (key, ndim) -> per dim: up to 2 sizes seen
        self.dynamic: dict[tuple, set[int]] = {}       # (key, ndim) -> dims agreed dynamic
        self.changed = False                           # dims were added since the last take_changed()

    def observe(self, args, kwargs) -> None:
        """Record this call's input sizes and mark the agreed dynamic dims on its tensors."""
        for key, t in _tensors(args, kwargs):
            k = (key, t.dim())
            sizes = self.seen.get(k)
            if sizes is None:
                sizes = self.seen[k] = [set() for _ in range(t.dim())]
            for d, s in enumerate(t.shape):
                if len(sizes[d]) < 2:
                    sizes[d].add(int(s))
            dims = self.dynamic.get(k)
            if dims:
                # ``torch._dynamo.maybe_mark_dynamic`` (public API; torch 2.11 and 2.13): trace these
                # dims symbolically on the next compile instead of specialising on the first size and
                # recompiling at the second, yet still specialise where the model's code needs a size.
                torch._dynamo.maybe_mark_dynamic(t, sorted(dims))

    def agree(self, group=None) -> dict:
        """Union every rank's observations (collective on ``group``); a dimension that took
        two sizes anywhere becomes dynamic on every rank. Returns the agreed dims."""
        mine = {k: [sorted(s) for s in sizes] for k, sizes in self.seen.items()}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            every: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, mine, group=group)
        else:
            every = [mine]
        union: dict[tuple, list[set[int]]] = {}
        for seen in every:
            for k, sizes in seen.items():
                u = union.setdefault(k, [set() for _ in sizes])
                for d, s in enumerate(sizes):
                    u[d].update(s)
        for k, sizes in union.items():
            dims = {d for d, s in enumerate(sizes) if len(s) > 1}
            if dims - self.dynamic.get(k, set()):
                self.dynamic[k] = self.dynamic.get(k, set()) | dims
                self.changed = True
        return {k: sorted(v) for k, v in self.dynamic.items()}

    def take_changed(self) -> bool:
        """Whether dims became dynamic since the last call (compiled graphs may be static there)."""
        changed, self.changed = self.changed, False
        return changed

    def at_step_end(self, config, step: int, group=None) -> None:
        """Called after optimizer step ``step`` on every rank: agree before the next step if it
        profiles or re-compiles (the only steps where every rank compiles anew together)."""
        nxt = step + 1
        if nxt == config.profile_step or config.passes_at(nxt) is not config.passes_at(step):
            self.agree(group)
