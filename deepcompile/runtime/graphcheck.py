"""Ranks that compiled different graphs: found when the graphs are compiled, named by parameter.

Every rank must issue the same collectives in the same order. A forward that differs by rank (a
module that runs only on rank 0, a branch on the rank) gives the ranks graphs that gather and
reduce different parameters; run as they are, one rank waits for a collective the other never
issues, until a timeout that names neither the graph nor the parameter. So each compiled graph's
collective sequence (which parameters are gathered, kept whole or reduced, in graph order) is
compared across ranks right after the passes that insert it:

* each rank posts ``"<digest> <op:pid ...>"`` for the graph under a key that names the graph the
  same way on every rank: the pass list's step, the graph's kind and Dynamo's compile id (the code
  object's frame id and its compile count; the backend's graph id where Dynamo's is absent, as in
  the trace-once re-compile, whose graphs every rank traced the same way);
* it then reads what the other ranks posted under that key, *without waiting* for ranks that have
  not posted yet, and compares digests. Of two ranks whose graphs differ, the one that posts second
  sees the difference, so it is always found. Not waiting matters: ranks may compile different
  numbers of graphs legitimately (one rank recompiles for a new input shape the other has
  already compiled for), and a rank waiting for a graph another rank never compiles would hang;
  by the same token the exchange is not a collective of the model's process group, where it
  could be matched against another rank's gather exactly when the ranks differ.

On a difference the rank that found it builds the message from the posted sequences (the
parameters only some ranks use, or the first position where the orders part), leaves it under
the sequence check's abort key (:mod:`deepcompile.runtime.seqcheck`) and raises it. The other
ranks raise the same message within a wait slice: the runtime reads that key while it waits in a
collective, the step's sequence check reads it, and so does this check at every compile. The
rank that found it raises after a short grace (a few wait slices, bounded by
``collective_timeout_s``), so the others read the message before its exit closes the connections
their collectives wait on.

Cost in a normal run: one store ``set``, two ``check`` and one ``multi_get`` per compiled graph,
nothing per step.
"""
from __future__ import annotations

import hashlib
import time

_COLLECTIVE_OPS = {  # ops that start a collective for the parameters they name (args[1])
    "allgather_param", "allgather_params", "gather_persistent", "gather_persistent_many",
    "gather_persistent_start", "unshard", "reduce_grad", "reduce_grads", "shard_grad",
}


def collective_sequence(gm) -> list[tuple[str, int]]:
    """``(op name, parameter id)`` for every parameter each collective-starting ``dc`` op names,
    in graph order."""
    seq = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or getattr(n.target, "namespace", None) != "dc":
            continue
        name = n.target._schema.name.split("::")[-1] if hasattr(n.target, "_schema") else str(n.target)
        if name not in _COLLECTIVE_OPS or len(n.args) < 2:
            continue
        ids = n.args[1] if isinstance(n.args[1], (list, tuple)) else [n.args[1]]
        seq.extend((name, int(i)) for i in ids if isinstance(i, int))
    return seq


def encode(seq: list[tuple[str, int]]) -> str:
    body = " ".join(f"{op}:{pid}" for op, pid in seq)
    return f"{hashlib.sha1(body.encode()).hexdigest()[:16]} {body}".rstrip()


def decode(value: bytes) -> tuple[str, list[tuple[str, int]]]:
    digest, *items = value.decode().split()
    return digest, [(op, int(pid)) for op, pid in (it.rsplit(":", 1) for it in items)]


def _graph_key(graph_id: int) -> str:
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
    except (ImportError, AttributeError, RuntimeError):
        cid = None
    if cid is not None and getattr(cid, "frame_id", None) is not None:
        return f"f{cid.frame_id}.{cid.frame_compile_id}"
    return f"g{graph_id}"


def _param_name(pid: int) -> str:
    from deepcompile.runtime import state

    m = state.current().params.get(pid) if state.active() else None
    return m.name if m is not None else f"parameter id {pid}"


def _names(pids, limit: int = 8) -> str:
    names = [_param_name(p) for p in sorted(pids)]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


def mismatch_message(where: str, posted: dict[int, list[tuple[str, int]]]) -> str:
    """The error for ranks whose collective sequences (``posted``: rank -> sequence) differ."""
    uses = {r: {pid for _, pid in s} for r, s in posted.items()}
    everyone = set.intersection(*uses.values())
    lines = []
    for r in sorted(posted):
        only = uses[r] - everyone
        if only:
            lines.append(f"rank {r} also uses {_names(only)}")
    if not lines:  # the same parameters: the order or the kind of collective differs
        ranks = sorted(posted)
        a = ranks[0]
        for b in ranks[1:]:
            sa, sb = posted[a], posted[b]
            if sa == sb:
                continue
            i = next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), min(len(sa), len(sb)))
            def at(s):
                return f"{s[i][0]} of {_param_name(s[i][1])!r}" if i < len(s) else "nothing"
            lines.append(f"collective {i}: rank {a} issues {at(sa)}, rank {b} {at(sb)}")
            break
    ranks = ", ".join(str(r) for r in sorted(posted))
    return (f"deepcompile: the ranks compiled different collective sequences for {where} (ranks {ranks}): "
            + "; ".join(lines) + ". Every rank must run the same forward, using every parameter on every "
            "rank in the same order (deepcompile gathers and reduces parameters by the graph each rank "
            "compiled, so a rank-dependent forward would wait for collectives the other ranks never issue). "
            "Use every parameter on every rank (e.g. run the branch everywhere and scale its output by 0 "
            "where it is not wanted), or leave the module that differs by rank out of deepcompile.")


class GraphCheck:
    """Compares each compiled graph's collective sequence across ranks (see the module docstring)."""

    def __init__(self, store, prefix: str, abort_key: str, rank: int, world: int, timeout_s: float,
                 grace_s: float = 3.0):
        self.store, self.prefix, self.abort_key = store, prefix, abort_key
        self.rank, self.world, self.timeout_s = rank, world, float(timeout_s)
        self.grace_s = min(float(grace_s), self.timeout_s)
        self.checked = 0

    @classmethod
    def create(cls, seq) -> "GraphCheck | None":
        """The check beside a :class:`~deepcompile.runtime.seqcheck.SequenceCheck` (its store,
        its key prefix and abort key); None without one or on one rank."""
        if seq is None or seq.world == 1:
            return None
        return cls(seq.store, seq.prefix + "graphs/", seq.prefix + "abort", seq.rank, seq.world, seq.timeout_s)

    def _raise_posted_abort(self) -> None:
        if self.store.check([self.abort_key]):
            raise RuntimeError(self.store.get(self.abort_key).decode())

    def compiled(self, graph_id: int, kind: str, step: int, gm) -> None:
        """Post this rank's collective sequence for the graph just compiled and compare it with
        what the other ranks posted for the same graph; raise on a difference."""
        self._raise_posted_abort()
        seq = collective_sequence(gm)
        key = f"{self.prefix}s{step}/{kind}/{_graph_key(graph_id)}/r"
        mine = encode(seq)
        self.store.set(key + str(self.rank), mine)
        self.checked += 1
        others = [key + str(r) for r in range(self.world) if r != self.rank]
        if self.store.check(others):
            present = others
        else:
            present = [k for k in others if self.store.check([k])]
        if not present:
            return
        values = self.store.multi_get(present)
        digest = mine.split(" ", 1)[0]
        if all(v.split(b" ", 1)[0].decode() == digest for v in values):
            return
        posted = {self.rank: seq}
        for k, v in zip(present, values):
            posted[int(k.rsplit("r", 1)[1])] = decode(v)[1]
        msg = mismatch_message(f"graph {graph_id} {kind}", posted)
        try:
            self.store.set(self.abort_key, msg)
        except Exception:  # noqa: BLE001 - the store is gone: the message is raised here anyway
            pass
        # the others raise it from their waits: let them read it before this rank's exit closes
        # the connections they wait on
        time.sleep(self.grace_s)
        raise RuntimeError(msg)
