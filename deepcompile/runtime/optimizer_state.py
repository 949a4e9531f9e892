"""Optimizer-state offload: the optimizer's state tensors (Adam's moments) spend forward and
backward in host memory, as much of them as the plan asks; the optimizer math stays on the device.

One step's lifecycle:

* ``optimizer.step()`` ends: a post-step hook copies the planned state tensors out (side stream,
  pinned memory) and frees their device storage, or, once the pass has a profile (``defer``),
  only starts the copies: ``dc.release_optimizer_state`` at points of the forward frees them,
  in order and only as much as the rest of the step needs, each after its own copy (see
  ``CopyEngine.offload``); what is never freed needs no copy back;
* forward and backward run without them;
* in the backward that ends the accumulation window, ``dc.reload_optimizer_state`` (placed by the
  ``offload_optimizer`` pass at several points of backward) starts the copies back for as much of
  the state as fits now: ``room`` minus the memory allocated at that point minus what the rest of
  backward still needs (the op's reserve, from the profile). The copies overlap the remaining
  backward compute;
* ``optimizer.step()`` begins: a pre-step hook makes compute wait for the copies (starting any the
  graph did not start, so a graph without the op is still correct, only slower).

The plan is a byte count set by the pass at compile time (``None``: everything); which tensors
make it up is decided when the state exists (Adam creates it in its first step), largest first.
The master weights are the optimizer's parameters (this rank's shard) and stay on the device:
ZeRO-3 gathers from them in every forward and backward.
"""
from __future__ import annotations

from typing import Callable

import torch

from deepcompile.runtime.offload import CopyEngine

MIB = 2 ** 20


class OptimizerStateOffload:
    """The offload of one optimizer's state through ``engine`` (the runtime state's copy engine;
    None: one of its own)."""

    def __init__(self, engine: CopyEngine | None = None):
        self.engine = engine if engine is not None else CopyEngine()
        self.opt: torch.optim.Optimizer | None = None
        self.target: int | None = 0          # bytes to offload; None = all
        self.room: int | None = None         # device bytes the step may use (limit - headroom); None: unknown
        self.defer = False                   # free the device copies lazily, from the forward's release points
        self.memory_now: Callable[[], int] = _allocated
        self.offloaded: list[tuple[tuple, torch.Tensor]] = []
        # both walk ``offloaded`` in order: where the next release / reload call starts, so a
        # step's dozens of graph points look at each tensor once, not once per point
        self._next_release = self._next_reload = 0
        self.is_boundary: Callable[[], bool] = lambda: True
        self._hooks: list = []
        self.stats = {"steps_offloaded": 0, "last_offloaded_bytes": 0, "graph_reloads": 0, "late_reloads": 0,
                      "released_bytes": 0, "kept_on_device_bytes": 0}

    # ------------------------------------------------------------ wiring
    def attach(self, opt: torch.optim.Optimizer, is_boundary: Callable[[], bool] | None = None) -> None:
        self.detach()
        self.opt = opt
        self.is_boundary = is_boundary or (lambda: True)
        self._hooks = [opt.register_step_pre_hook(lambda *_: self.bring_back()),
                       opt.register_step_post_hook(lambda *_: self.send_out()),
                       # a checkpoint must see the real values, not freed storage
                       opt.register_state_dict_pre_hook(lambda *_: self.bring_back()),
                       opt.register_load_state_dict_pre_hook(lambda *_: self.bring_back())]

    def detach(self) -> None:
        if self.offloaded:
            self.bring_back()
        for h in self._hooks:
            h.remove()
        self._hooks, self.opt, self.target, self.room, self.defer = [], None, 0, None, False
        self.stats = {k: 0 for k in self.stats}

    def plan(self, nbytes: int | None) -> None:
        """Bytes of state to keep on the host between steps (``None``: all of it). Takes effect
        at the end of the next optimizer step."""
        self.target = None if nbytes is None else max(0, int(nbytes))
        if not self.target and nbytes is not None:
            self.defer = False

    # ------------------------------------------------------------ what there is
    def state_tensors(self) -> list[tuple[tuple, torch.Tensor]]:
        """(key, tensor) for every offloadable state tensor, in a fixed order (scalars such as
        Adam's ``step`` stay where they are)."""
        if self.opt is None:
            return []
        out = []
        # keyed by the user's groups: during step() param_groups is the chunk view
        # (runtime.optim_chunks), which leaves the user's list in ``dc_user_param_groups``; a
        # tensor sent out in the post-step hook is found again by the same key from the graph
        # and from a state_dict() hook
        groups = getattr(self.opt, "dc_user_param_groups", None) or self.opt.param_groups
        for gi, group in enumerate(groups):
            for pi, p in enumerate(group["params"]):
                st = self.opt.state.get(p, {})
                for name in sorted(st):
                    v = st[name]
                    if isinstance(v, torch.Tensor) and v.numel() > 1:
                        out.append((("opt", gi, pi, name), v))
        return out

    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.state_tensors())

    def offloaded_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.offloaded)

    def resident_bytes(self) -> int:
        """State bytes on the device during forward and backward under the current plan."""
        return self.total_bytes() - self.offloaded_bytes()

    def choose(self) -> list[tuple[tuple, torch.Tensor]]:
        items = self.state_tensors()
        if self.target is None:
            return items
        ranked = sorted(range(len(items)), key=lambda i: (-items[i][1].numel() * items[i][1].element_size(), i))
        chosen, acc = [], 0
        for i in ranked:
            if acc >= self.target:
                break
            chosen.append(i)
            acc += items[i][1].numel() * items[i][1].element_size()
        return [items[i] for i in sorted(chosen)]

    # ------------------------------------------------------------ the step's lifecycle
    def send_out(self) -> None:
        if self.target == 0:
            return
        moved = []
        for key, t in self.choose():
            if self.engine.offload(t, key, defer_free=self.defer):
                moved.append((key, t))
        self.offloaded = moved
        self._next_release = self._next_reload = 0
        self.stats["steps_offloaded"] += 1
        self.stats["last_offloaded_bytes"] = self.offloaded_bytes()

    def reload_from_graph(self, reserve_bytes: int = -1) -> None:
        """``dc.reload_optimizer_state``: in the backward that ends the accumulation window (the
        others leave the state on the host), start the copies back for the next offloaded
        tensors, in order, as many as fit in ``room - allocated now - reserve_bytes``
        (``reserve_bytes`` -1, or no known room: all of them). Several calls along backward bring
        the state back progressively, as backward frees the memory for it."""
        if not self.offloaded or not self.is_boundary():
            return
        free = None if (reserve_bytes < 0 or self.room is None) else self.room - self.memory_now() - reserve_bytes
        started = False
        while self._next_reload < len(self.offloaded):
            key, t = self.offloaded[self._next_reload]
            p = self.engine.find(t, key)
            if p is not None and p.state == "offloaded":
                if free is not None:
                    if p.nbytes > free:
                        break  # keep the order: the next call finds more room
                    free -= p.nbytes
                self.engine.reload(t, key)
                started = True
            self._next_reload += 1
        if started:
            self.stats["graph_reloads"] += 1

    def release_from_graph(self, reserve_bytes: int = -1) -> None:
        """``dc.release_optimizer_state``: free the device copies of deferred offloads, in
        order, until ``reserve_bytes`` more fit beside what is allocated now under ``room``
        (-1, or no known room: free them all)."""
        need = None if (reserve_bytes < 0 or self.room is None) else self.memory_now() + reserve_bytes - self.room
        while self._next_release < len(self.offloaded) and (need is None or need > 0):
            key, t = self.offloaded[self._next_release]
            p = self.engine.find(t, key)
            if p is not None and p.state == "copying":
                self.engine.release(t, key)
                self.stats["released_bytes"] += p.nbytes
                if need is not None:
                    need -= p.nbytes
            self._next_release += 1

    def bring_back(self) -> None:
        late = False
        for key, t in self.offloaded:
            p = self.engine.find(t, key)
            if p is not None and p.state == "offloaded":
                late = True
            if p is not None and p.state == "copying":
                self.stats["kept_on_device_bytes"] += p.nbytes
            self.engine.wait(t, key)
        if late:
            self.stats["late_reloads"] += 1
        self.offloaded = []
        self._next_release = self._next_reload = 0


def _allocated() -> int:
    """Device bytes allocated now: the caching allocator's counter, which is exact at launch
    time (its blocks are stream-ordered), so no synchronisation is needed. 0 without CUDA (the
    state lives in host memory there: nothing to fit)."""
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def graph_ops(manager: Callable[[], OptimizerStateOffload]) -> dict:
    """{schema: kernel} of the graph's optimizer-state ops, acting on ``manager()`` (the current
    runtime state's, resolved at each call), defined with the offload engine's ops (runtime/offload.py)."""
    def reload_optimizer_state(anchor: torch.Tensor, reserve_bytes: int) -> None:
        manager().reload_from_graph(reserve_bytes)

    def release_optimizer_state(anchor: torch.Tensor, reserve_bytes: int) -> None:
        manager().release_from_graph(reserve_bytes)

    return {
        "reload_optimizer_state(Tensor(a!) anchor, int reserve_bytes) -> ()": reload_optimizer_state,
        "release_optimizer_state(Tensor(a!) anchor, int reserve_bytes) -> ()": release_optimizer_state,
    }
