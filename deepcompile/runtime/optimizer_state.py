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

A *streamed* step (``plan(None, streamed=True)``) never holds all the state on the device: the
step's peak would otherwise be shards + gradients + all of the state, which is what stops a model
whose state alone is larger than the limit (the 8B Llama on 2 ranks: 30 GiB of AdamW moments
beside 30 GiB of fp32 shards and gradients). For the step's duration the optimizer's
``param_groups`` become a view (:class:`_StreamedGroups`) whose iteration brings each group's
state back just before the optimizer reads it, starts the next group's copy beside that group's
kernels, and sends the group's state out right after them; a group's device copy is freed one
group later, once its copy out has run beside the next group's step. So about three groups' worth
of state is on the device at once, and the copies in both directions overlap each other and the
step's kernels. The chunk size is the optimizer's param groups as :mod:`runtime.optim_chunks` cuts
them (the planner sets it). Adam creates its state in its first step: a streamed step sends each
group's new state out as it goes, so the state is never all on the device at once, even then.
The hook into the iteration is the one place torch's optimizers are relied on beyond their public
API: their ``step`` reads each group's state while iterating ``param_groups`` (checked in torch
2.11 and 2.13 for Adam and AdamW, single-tensor, foreach and fused). A state dict (a checkpoint)
brings all the state back to the device, as for the resident step: under a limit that the state
cannot fit in beside the shards and gradients, that transient is over the limit (not the device).

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
        self.streamed = False                # state comes back group by group inside the step (see the module doc)
        self._pos: dict[int, tuple[int, int]] = {}   # id(param) -> (user group, index): the state's keys
        self._sent: list[tuple[tuple, torch.Tensor]] = []     # sent out during this streamed step, in order
        self._copying: list[list[tuple[tuple, torch.Tensor]]] = []   # groups whose copy out may still run
        self._hooks: list = []
        self.stats = {"steps_offloaded": 0, "last_offloaded_bytes": 0, "graph_reloads": 0, "late_reloads": 0,
                      "released_bytes": 0, "kept_on_device_bytes": 0, "streamed_steps": 0}

    # ------------------------------------------------------------ wiring
    def attach(self, opt: torch.optim.Optimizer, is_boundary: Callable[[], bool] | None = None) -> None:
        self.detach()
        self.opt = opt
        self.is_boundary = is_boundary or (lambda: True)
        self._hooks = [opt.register_step_pre_hook(lambda *_: self.before_step()),
                       opt.register_step_post_hook(lambda *_: self.after_step()),
                       # a checkpoint must see the real values, not freed storage
                       opt.register_state_dict_pre_hook(lambda *_: self.bring_back()),
                       opt.register_load_state_dict_pre_hook(lambda *_: self.bring_back())]

    def detach(self) -> None:
        if self.offloaded:
            self.bring_back()
        for h in self._hooks:
            h.remove()
        if self.opt is not None:
            _unwrap(self.opt)
        self._hooks, self.opt, self.target, self.room, self.defer = [], None, 0, None, False
        self.streamed = False
        self.stats = {k: 0 for k in self.stats}

    def plan(self, nbytes: int | None, streamed: bool = False) -> None:
        """Bytes of state to keep on the host between steps (``None``: all of it). Takes effect
        at the end of the next optimizer step. ``streamed`` (with ``None``): the step itself
        brings the state back group by group (see the module doc)."""
        if streamed and nbytes is not None:
            raise ValueError("a streamed optimizer step keeps all of the state on the host: plan(None, streamed=True)")
        self.target = None if nbytes is None else max(0, int(nbytes))
        self.streamed = bool(streamed)
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
    def before_step(self) -> None:
        if not self.streamed or self.opt is None:
            self.bring_back()
            return
        opt = self.opt
        _unwrap(opt)   # a step that raised last time left its view behind
        groups = getattr(opt, "dc_user_param_groups", None) or opt.param_groups
        self._pos = {id(p): (gi, pi) for gi, g in enumerate(groups) for pi, p in enumerate(g["params"])}
        self._sent, self._copying = [], []
        opt.param_groups = _StreamedGroups(opt.param_groups, self)

    def after_step(self) -> None:
        if self.streamed and self.opt is not None:
            _unwrap(self.opt)
            return
        self.send_out()

    def _group_state(self, group: dict) -> list[tuple[tuple, torch.Tensor]]:
        out = []
        for p in group["params"]:
            pos, st = self._pos.get(id(p)), self.opt.state.get(p)
            if pos is None or not st:
                continue
            for name in sorted(st):
                v = st[name]
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    out.append((("opt", pos[0], pos[1], name), v))
        return out

    def _enter(self, k: int, groups: list[dict]) -> None:
        """Group ``k`` is next: its state must be on the device; group ``k + 1``'s starts coming."""
        for key, t in self._group_state(groups[k]):
            self.engine.wait(t, key)
        if k + 1 < len(groups):
            for key, t in self._group_state(groups[k + 1]):
                p = self.engine.find(t, key)
                if p is not None and p.state == "offloaded":
                    self.engine.reload(t, key)

    def _leave(self, group: dict) -> None:
        """The optimizer has queued ``group``'s kernels: send its state out (the copy waits for
        them), and free the previous group's device copy (its copy ran beside these kernels)."""
        sent = [(key, t) for key, t in self._group_state(group)
                if self.engine.find(t, key) is None and self.engine.offload(t, key, defer_free=True)]
        self._sent.extend(sent)
        self._copying.append(sent)
        while len(self._copying) > 1:
            for key, t in self._copying.pop(0):
                self.engine.release(t, key)

    def _finish(self) -> None:
        for chunk in self._copying:
            for key, t in chunk:
                self.engine.release(t, key)
        self._copying = []
        self.offloaded, self._sent = self._sent, []
        self._next_release = self._next_reload = 0
        self.stats["steps_offloaded"] += 1
        self.stats["streamed_steps"] += 1
        self.stats["last_offloaded_bytes"] = self.offloaded_bytes()

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

    def host_views(self) -> dict[int, torch.Tensor]:
        """{id(state tensor): the host copy it is} for the offloaded state the device does not hold
        (see ``CopyEngine.host_view``): what a checkpoint reads without bringing the state back to
        the device."""
        out = {}
        for key, t in self.offloaded:
            v = self.engine.host_view(t, key)
            if v is not None:
                out[id(t)] = v
        return out

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


class _StreamedGroups(list):
    """The optimizer's param groups for the duration of one streamed step (the same dicts, in
    order): iterating them brings each group's state in before the optimizer reads it and sends it
    out after. An iteration that stops early (torch's capturable check reads the first group
    only) only brings state in, which the full iteration then finds there."""

    def __init__(self, groups: list, owner: OptimizerStateOffload):
        super().__init__(groups)
        self.base = groups
        self.owner = owner

    def __iter__(self):
        groups = list(list.__iter__(self))
        for k, g in enumerate(groups):
            self.owner._enter(k, groups)
            yield g
            self.owner._leave(g)
        self.owner._finish()


def _unwrap(opt: torch.optim.Optimizer) -> None:
    if isinstance(opt.param_groups, _StreamedGroups):
        opt.param_groups = opt.param_groups.base


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
