"""Nothing hangs: the per-step collective sequence check and the graph-node names of timeouts.

Two ways a job would hang or die without a Python error, without these checks:

* a rank that never joins a collective (it raised and stayed alive, is stuck in user code, or runs
  a different forward) blocked every other rank until the process group's timeout (30 minutes);
* a rank that skips a backward runs ahead into the next forward, and gloo matches its allgathers
  against the other ranks' reduce-scatters (``EnforceNotMet ... collective mismatch``, an abort).

The runtime (``csrc/runtime.cpp``) bounds every host wait by ``collective_timeout_s`` and names the
collective and the op it is in. This module adds the two things it cannot do alone:

* :func:`register_nodes` tells the runtime which FX graph node calls each op (``op:id`` ->
  ``"wait_allgather_3 of graph 0 forward"``), so a timeout names the node. It runs once per
  compile; the runtime reads the table only when it builds an error message.
* :class:`SequenceCheck` runs at every optimizer step (the optimizer's step pre-hook): each rank
  posts how many collectives it issued since the last step in the c10d store and waits until all
  ranks have posted. Equal counts pass; unequal counts fail on every rank with one message saying
  which rank is behind. The store is a channel of its own, so the check can never be matched
  against a collective of the model (a check collective on the model's process group would be,
  exactly when the sequences differ). It costs one store ``set`` and one ``multi_get`` per step
  when the ranks arrive together, and nothing per op. While a rank waits in a collective for
  longer than a second, the runtime reads the same keys: a rank that already reached the check of
  this step skipped collectives, and both stop at once with that message instead of at the timeout.

Keys (``<prefix>`` is unique per process group and ``initialize`` call):
``<prefix>p<k % 2>/r<rank>`` = ``"<k> <count>"`` (two slots, so the store does not grow with the
step count: a rank cannot post check k+2 before every rank has finished reading check k), and
``<prefix>abort`` = the first failure message, which every waiting rank raises.
"""
from __future__ import annotations

import itertools
import time

import torch.distributed as dist

_INIT_COUNT = itertools.count()

_FUSED = {"allgather_params", "gather_persistent_many", "wait_allgather_many", "gather_persistent_start",
          "gather_persistent_wait"}  # the runtime names these by their first id


def _parse(value: bytes) -> tuple[int, ...]:
    """A posted count, ``b"<k> <count>"`` -> ``(k, count)``."""
    return tuple(int(x) for x in value.decode().split())


def _op_key(node) -> str | None:
    target = node.target
    ns = getattr(target, "namespace", None)
    if ns != "dc" or node.op != "call_function":
        return None
    name = target._schema.name.split("::")[-1] if hasattr(target, "_schema") else str(target)
    if len(node.args) < 2:
        return None
    ident = node.args[1]
    if name in _FUSED:
        ident = ident[0] if isinstance(ident, (list, tuple)) and ident else None
    if not isinstance(ident, int):
        return None
    return f"{name}:{ident}"


def register_nodes(graph_id: int, kind: str, gm) -> None:
    """Record which node of this graph calls each runtime op (in the runtime state's ``op_nodes``)
    and push the merged table to the runtime; nothing without a runtime state."""
    from deepcompile.runtime import state

    if not state.active():
        return
    nodes = state.current().op_nodes
    table: dict[str, str] = {}
    for node in gm.graph.nodes:
        key = _op_key(node)
        if key is not None:
            table.setdefault(key, node.name)
        if node.op == "call_function" and str(node.target) == "dc.reduce_grads.default":
            for ident in node.args[1]:  # the runtime enters it once per gradient, with its id
                if isinstance(ident, int):
                    table.setdefault(f"reduce_grads:{ident}", node.name)
    nodes[(graph_id, kind)] = table
    merged: dict[str, list[str]] = {}
    for (gid, k), t in sorted(nodes.items()):
        for key, name in t.items():
            label = f"{name} of graph {gid} {k}"
            merged.setdefault(key, []).append(label)
            merged.setdefault(f"{key}:{k}", []).append(label)  # the runtime knows the phase it is in
    from deepcompile.runtime import ops

    if ops.C is not None and ops.C.is_initialized():
        ops.C.set_node_names({k: " or ".join(v) for k, v in merged.items()})


class SequenceCheck:
    """The per-optimizer-step collective count check (see the module docstring)."""

    def __init__(self, store, prefix: str, rank: int, world: int, timeout_s: float):
        self.store, self.prefix = store, prefix
        self.rank, self.world, self.timeout_s = rank, world, float(timeout_s)

    @classmethod
    def create(cls, group, timeout_s: float) -> "SequenceCheck | None":
        """The check for ``group``, wired into the runtime; None where no c10d store is reachable
        (the runtime's timeout still applies)."""
        from deepcompile.compat import c10d as c10d_compat
        from deepcompile.runtime import ops

        store = c10d_compat.default_store()
        if store is None:
            return None
        name = getattr(group, "group_name", None) or "world"
        prefix = f"deepcompile/seq/{name}/{next(_INIT_COUNT)}/"
        ops.C.set_seq_store(store, prefix)
        return cls(store, prefix, dist.get_rank(group), dist.get_world_size(group), timeout_s)

    def _key(self, k: int, rank: int) -> str:
        return f"{self.prefix}p{k % 2}/r{rank}"

    def _abort(self, msg: str) -> None:
        try:
            self.store.set(self.prefix + "abort", msg)
        except Exception:  # noqa: BLE001 - the store is gone; the message is raised anyway
            pass
        raise RuntimeError(msg)

    def check(self) -> None:
        """Post this rank's count for the step and wait for every rank's (``collective_timeout_s``)."""
        from deepcompile.runtime import ops

        k, issued = ops.C.begin_check()
        if self.world == 1:
            return
        keys = [self._key(k, r) for r in range(self.world)]
        self.store.set(keys[self.rank], f"{k} {issued}")
        abort = self.prefix + "abort"
        t0 = time.monotonic()
        # From check 2 on every rank's key of this slot exists (each posted check k-2 before
        # check k-1, which this rank passed): one multi_get per poll, not a check first (a store
        # round trip per step). The first pause is short: the ranks' hosts arrive
        # within a fraction of a millisecond of each other when the step is host-bound, and
        # every pause of this rank's host lengthens its step.
        exist = k >= 2
        pause = 0.0001
        while True:
            if exist or self.store.check(keys):
                vals = [_parse(v) for v in self.store.multi_get(keys)]
                if all(v[0] == k for v in vals):
                    break
            if self.store.check([abort]):
                raise RuntimeError(self.store.get(abort).decode())
            if time.monotonic() - t0 > self.timeout_s:
                posted = {r: v for r, v in enumerate(self._read(keys)) if v is not None and v[0] == k}
                missing = [r for r in range(self.world) if r not in posted]
                self._abort(
                    f"deepcompile: rank {self.rank} timed out after {self.timeout_s:g} s at optimizer step {k}'s "
                    f"collective sequence check: rank(s) {missing} did not reach optimizer.step() (they raised "
                    "and stayed alive, are stuck in user code, or wait in a collective the others did not "
                    "issue). collective_timeout_s sets this limit")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        counts = [v[1] for v in vals]
        if len(set(counts)) > 1:
            most = max(counts)
            behind = [r for r, c in enumerate(counts) if c < most]
            lead = counts.index(most)
            who = ", ".join(f"rank {r} issued {counts[r]}" for r in behind)
            raise RuntimeError(
                f"deepcompile: collective sequence mismatch in optimizer step {k}: rank(s) {behind} behind: "
                f"{who} collectives this step, rank {lead} issued {most}. A rank skipped a backward (or ran "
                "a different forward); every rank must run the same forward and backward before optimizer.step()")

    def _read(self, keys: list[str]) -> list:
        out = []
        for key in keys:
            try:
                out.append(_parse(self.store.get(key)) if self.store.check([key]) else None)
            except Exception:  # noqa: BLE001
                out.append(None)
        return out
