"""CUDA graphs for the compute between runtime ops (issue 16).

Why
---
On 2 H200s the default plan's step was host-bound: the GPU needed about 40 ms a step and the
host 32 ms just to issue it (about 1650 kernel launches from Inductor's generated Python, plus
the runtime's ops), so every slow moment of a shared host landed on the step. A CUDA graph issues
a whole run of kernels with one launch. The runtime's ops (gathers, reduce-scatters, waits) stay
outside the graphs: they run host logic every step (buckets, in-flight lists, the collectives on
their own stream), so Inductor cuts each compiled graph into *partitions* at them
(``config.graph_partition``; the ``dc`` ops are tagged ``cudagraph_unsafe``, see
``compat._compile_partitioned``) and each partition becomes one :class:`PartitionGraph` here.

How one partition runs
----------------------
1. **Warm-up cycles** (two steps): the partition runs as Inductor's code, and the data pointer of
   every input is recorded. Inputs whose address changed between the two calls are *copied*
   inputs; they must be small (``COPY_LIMIT``), otherwise the partition stays uncaptured. The
   gradients autograd hands a backward graph and the graph's small inputs (the batch, the
   loss's seed gradient: ``SMALL_COPY``) are copied inputs even if they kept their address, as
   the capture step changes where the allocator puts them. Every other input must keep its
   address: shards, kept gathered parameters, and the outputs of earlier partitions (which live
   in the graph pool).
2. **Capture cycle** (the third step): each partition is captured in the order the step calls
   it, all into one memory pool, on a side stream, then replayed once. The pool's allocator
   hands a partition the memory that is free *at that point of the step*, so partitions share
   memory exactly as Inductor's own buffers would (saved activations stay put until the
   backward frees them, a gradient stays put while the runtime's bucket holds it).
3. **Replay**: every input's address is compared with the captured one (a mismatch runs
   Inductor's code instead, for this call, and is counted); copied inputs are copied into the
   graph's own buffers; the graph is replayed; the outputs are new tensors over the pool's
   memory (they do not own it; the next step's replay writes the same memory).

What keeps a replay from overwriting memory still in use
--------------------------------------------------------
Replaying writes memory that was free at the same point of the capture step. That holds while
every step calls the partitions in the same order (checked per call: the step is the
*cycle* from one call of the first partition to the next) and frees what the capture step freed
by the same point (checked per call: the outputs that had died before a partition was captured
must be dead before it is replayed; the check is a weak reference per output). If either fails,
the rest of that step runs Inductor's code (correct, slower; counted, with a warning naming the
reason). At the start of a step, outputs of the previous step that are still referenced (for
example ``out.logits`` kept in a variable until the next forward) are *invalidated*: reading
them raises an error that says why. Outputs with one element (the loss) are cloned, so a loss
kept across steps is always valid.

Limits: a graph that runs twice in one step (two forwards before one backward) turns the pool
off; graphs with random ops are not captured (``compat``); ``max_memory_allocated`` does not see
the pool after the capture step (:func:`Pool.reserved_bytes` does; the benchmark adds it).
"""
from __future__ import annotations

import logging
import weakref
from collections import Counter
from typing import Any, Callable

import torch

from deepcompile import compat

log = logging.getLogger("deepcompile.cudagraphs")

WARM_CYCLES = 2          # steps run as Inductor's code before the capture step
COPY_LIMIT = 16 << 20    # bytes of copied (moving) inputs a partition may have
# graph inputs up to this size are copied at every replay even when the warm-up saw them keep
# their address: the batch and autograd's seed gradient come from the general allocator, whose
# small blocks are handed out differently once the capture step has run (on 2 H200s the loss's
# seed gradient sat still through the warm-up and moved at the first replay, every step)
SMALL_COPY = 1 << 20


class Pool:
    """The partitions of one compile (forward and backward graphs of one pass schedule), one
    CUDA memory pool, and the step (cycle) they run in."""

    def __init__(self, device: torch.device):
        self.device = device
        self.handle = None
        self.stream: torch.cuda.Stream | None = None
        self.parts: list[PartitionGraph] = []
        self.anchor: PartitionGraph | None = None   # the first partition called: a call starts a cycle
        self.cycle = 0
        self.seq: list[PartitionGraph] = []         # capture order
        self.pos = 0
        self.broken: str | None = None              # why the rest of this cycle runs eagerly
        self.disabled: str | None = None            # why the pool is off for good
        self.handed: list[tuple[Any, Any]] = []     # this cycle's pool outputs: (StorageWeakRef, tensor weakref)
        self.replay_refs: list[list | None] = []    # per seq position: this cycle's output storage refs
        self.produced: set[int] = set()             # warm-up step: storages partitions returned
        self.stats: Counter = Counter()
        self.reasons: Counter = Counter()
        self._warned: set[str] = set()

    # --- the cycle ----------------------------------------------------------------------------

    def mode(self, part: "PartitionGraph") -> str:
        """How ``part`` runs now: 'eager', 'warm', 'capture' or 'replay'."""
        if self.disabled is not None:
            return "eager"
        if self.anchor is None:
            self.anchor = part
        if part is self.anchor:
            self._new_cycle()
        if self.cycle <= WARM_CYCLES + 1:
            if part.last_cycle == self.cycle:
                self.disable(f"partition {part.name} ran twice in one step (two forwards before a "
                             "backward?): one captured graph cannot hold both runs' outputs")
                return "eager"
            part.last_cycle = self.cycle
            return "warm" if self.cycle <= WARM_CYCLES else "capture"
        if self.broken is not None or part.graph is None:
            return "eager"   # an uncaptured partition is not in the captured order either
        if self.pos >= len(self.seq) or self.seq[self.pos] is not part:
            exp = self.seq[self.pos].name if self.pos < len(self.seq) else "the next step"
            self.break_cycle(f"partitions ran in another order than in the capture step "
                             f"({part.name} where {exp} was captured)")
            return "eager"
        return "replay"

    def _new_cycle(self) -> None:
        self.cycle += 1
        if self.cycle >= WARM_CYCLES + 2:   # after the capture step: its outputs, then each replay's
            self._retire_handed()
        self.pos = 0
        self.broken = None
        self.replay_refs = [None] * len(self.seq)
        self.produced = set()

    def _retire_handed(self) -> None:
        """The previous step's outputs: any still referenced is about to be overwritten."""
        for ref, tref in self.handed:
            if ref.expired():
                continue
            t = tref()
            if t is not None:
                compat.invalidate_storage(t, "deepcompile: this tensor was an output of a compiled graph of an "
                                             "earlier step, run as a CUDA graph; the next step's replay reused its "
                                             "memory. Clone it (t.clone()) to keep it across steps, or turn CUDA "
                                             "graphs off (config cuda_graphs: false).")
                self.stats["invalidated"] += 1
            else:  # only a view is left and cannot be marked: run this step as Inductor's code
                self.break_cycle("a view of an earlier step's graph output is still referenced")
        self.handed = []

    def note_outputs(self, outs) -> None:
        for t in (outs if isinstance(outs, (list, tuple)) else [outs]):
            if isinstance(t, torch.Tensor):
                self.produced.add(t.untyped_storage().data_ptr())

    def break_cycle(self, why: str) -> None:
        self.broken = why
        self.reasons[why] += 1
        self._warn(why, "the rest of this step runs without CUDA graphs")

    def disable(self, why: str) -> None:
        self.disabled = why
        self._warn(why, "CUDA graphs are off for this compile")
        for p in self.parts:
            p.release()

    def _warn(self, why: str, what: str) -> None:
        if why not in self._warned:
            self._warned.add(why)
            log.warning("deepcompile: %s: %s", what, why)

    # --- memory -------------------------------------------------------------------------------

    def ensure(self) -> None:
        if self.handle is None:
            self.handle = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device=self.device)

    def reserved_bytes(self) -> int:
        """Device memory the pool holds (reserved for the graphs whatever is live in it)."""
        return compat.pool_reserved_bytes(self.handle) if self.handle is not None else 0

    def summary(self) -> dict:
        captured = sum(1 for p in self.parts if p.graph is not None)
        return {"partitions": len(self.parts), "captured": captured, "cycle": self.cycle,
                "disabled": self.disabled, "pool_bytes": self.reserved_bytes(),
                **dict(self.stats), "reasons": dict(self.reasons)}


class PartitionGraph:
    """One Inductor partition (a boxed callable over a list of inputs) run as a CUDA graph."""

    def __init__(self, fn: Callable, pool: Pool, name: str, mutated: frozenset[int] = frozenset(),
                 graph_inputs: frozenset[int] = frozenset(), tangents: frozenset[int] = frozenset()):
        self.fn = fn
        self.pool = pool
        self.name = name
        self.mutated = mutated
        self.graph_inputs = graph_inputs    # inputs that are the compiled graph's own inputs
        self.tangents = tangents            # ... and of those, the gradients autograd hands the backward
        self.last_cycle = 0
        self.seen: list | None = None       # per input: data_ptr (tensor) or value, first warm call
        self.moving: set[int] = set()       # inputs whose address changes: copied into static buffers
        self.from_parts: set[int] = set()   # inputs that earlier partitions of the step produce
        self.off: str | None = None
        self.graph = None
        self.keys: list = []                # per input: captured data_ptr / value (None for moving)
        self.static: dict[int, torch.Tensor] = {}
        self.outs: list[tuple] = []         # per output: how to rebuild it
        self.n_storages = 0
        self.dead_before: list[tuple[int, int]] = []   # (seq position, storage) dead before capture
        self.seq_pos = -1
        self._cap_refs: list = []           # capture step: weak refs to this partition's pool storages
        self.storage_meta: list = []
        self.aliases_input = False          # an output is a view of an input (the replay keeps the inputs)
        pool.parts.append(self)

    def release(self) -> None:
        self.graph = None
        self.static = {}
        self.off = self.off or "pool off"

    # the generated ``call`` hands each partition one list and drops its own references
    def __call__(self, args: list):
        mode = self.pool.mode(self)   # every call: the first partition's call starts a step
        if mode == "replay":
            return self._replay(args)
        if mode == "warm" and self.off is None:
            self._observe(args)
            out = self.fn(args)
            self.pool.note_outputs(out)
            return out
        if mode == "capture":
            return self._capture(args)
        self.pool.stats["eager_calls"] += 1
        return self.fn(args)

    # --- warm-up: which inputs move ----------------------------------------------------------

    @staticmethod
    def _key(a) -> Any:
        if isinstance(a, torch.Tensor):
            return a.data_ptr()
        if isinstance(a, (list, tuple)):
            return tuple(PartitionGraph._key(x) for x in a)
        if a is None or isinstance(a, (int, float, bool, str)):
            return a
        return ("id", id(a))

    def _observe(self, args: list) -> None:
        keys = [self._key(a) for a in args]
        # an output of an earlier partition of this step lives wherever the allocator put it
        # while the partitions run as code, but in the pool at a fixed address once captured:
        # not a moving input (on 2 H200s every MLP activation between two partitions was
        # taken for one, and those partitions were never captured)
        produced = self.pool.produced
        self.from_parts |= {i for i, a in enumerate(args)
                            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in produced}
        if self.seen is None:
            self.seen = keys
            return
        moving = {i for i, (a, b) in enumerate(zip(self.seen, keys)) if a != b and i not in self.from_parts}
        # what comes from outside the compiled graphs may land anywhere once the capture step has
        # changed what the allocator holds: copy small graph inputs and gradients handed in always.
        # Small ones even where they look like an earlier partition's output: the loss's seed
        # gradient got the freed address of a partition's one-element output (on 2 H200s), and
        # was taken for it
        moving |= {i for i in self.graph_inputs - self.mutated
                   if isinstance(args[i], torch.Tensor)
                   and (compat.tensor_nbytes(args[i]) <= SMALL_COPY
                        or (i in self.tangents and i not in self.from_parts))}
        for i in moving:
            a = args[i]
            if not isinstance(a, torch.Tensor):
                self.off = f"input {i} ({type(a).__name__}) changes between steps"
            elif compat.tensor_nbytes(a) > COPY_LIMIT:
                self.off = (f"input {i} ({tuple(a.shape)}, {a.dtype}, {_what(a)}) moves between steps and is "
                            f"larger than {COPY_LIMIT >> 20} MiB to copy")
            elif i in self.mutated:
                self.off = f"input {i} moves between steps and the partition writes into it"
        if self.off is not None:
            self.pool.reasons[f"{self.name}: {self.off}"] += 1
        self.moving = moving

    # --- capture -----------------------------------------------------------------------------

    def _capture(self, args: list):
        pool = self.pool
        inputs = list(args)
        args.clear()
        if self.off is not None or self.seen is None:
            if self.off is None:
                self.off = "not called in every warm-up step"
            pool.stats["eager_calls"] += 1
            return self.fn(inputs)
        pool.ensure()
        # what the earlier captured partitions handed out and has died by now: must be dead
        # again at this point of every replayed step
        self.seq_pos = len(pool.seq)
        dead = []
        for pos, part in enumerate(pool.seq):
            for s, ref in enumerate(part._cap_refs):
                if ref is not None and ref.expired():
                    dead.append((pos, s))
                    part._cap_refs[s] = None
        self.dead_before = dead
        for i in self.moving:
            a = inputs[i]
            self.static[i] = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
            self.static[i].copy_(a)
        cap_in = [self.static.get(i, a) for i, a in enumerate(inputs)]
        self.keys = [None if i in self.moving else self._key(a) for i, a in enumerate(inputs)]
        in_storages = {}
        for i, a in enumerate(cap_in):
            if isinstance(a, torch.Tensor):
                in_storages.setdefault(a.untyped_storage().data_ptr(), i)
        g = torch.cuda.CUDAGraph()
        cur = torch.cuda.current_stream(pool.device)
        pool.stream.wait_stream(cur)
        try:
            with torch.cuda.stream(pool.stream):
                g.capture_begin(pool=pool.handle, capture_error_mode="thread_local")
                try:
                    outs = self.fn(list(cap_in))
                finally:
                    g.capture_end()
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: run it as code
            cur.wait_stream(pool.stream)
            self.off = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            pool.reasons[f"{self.name}: {self.off}"] += 1
            pool._warn(self.off, f"partition {self.name} runs without a CUDA graph")
            self.static = {}
            pool.stats["eager_calls"] += 1
            return self.fn(inputs)
        cur.wait_stream(pool.stream)
        g.replay()
        self.graph = g
        pool.seq.append(self)
        pool.stats["captures"] += 1
        # how to rebuild each output at a replay: a view of an input, or of a pool storage
        self.outs, storages, refs, result = [], {}, [], []
        for t in (outs if isinstance(outs, (list, tuple)) else [outs]):
            if not isinstance(t, torch.Tensor):
                self.outs.append(("value", t))
                result.append(t)
                continue
            sptr = t.untyped_storage().data_ptr()
            meta = compat.tensor_metadata(t)
            if sptr in in_storages:
                self.outs.append(("input", in_storages[sptr], meta))
                result.append(t)
            elif t.numel() == 1:
                self.outs.append(("clone", None, meta))
                result.append(t.clone())
            else:
                if sptr not in storages:
                    storages[sptr] = len(storages)
                    refs.append(compat.storage_ref(t.untyped_storage()))
                    pool.handed.append((refs[-1], weakref.ref(t)))
                self.outs.append(("pool", storages[sptr], meta))
                result.append(t)
        self.n_storages = len(storages)
        self.storage_meta = [None] * len(storages)
        for kind, s, meta in (o for o in self.outs if o[0] == "pool"):
            self.storage_meta[s] = meta
        self._cap_refs = refs
        self.aliases_input = any(o[0] == "input" for o in self.outs)
        return result

    # --- replay ------------------------------------------------------------------------------

    def _replay(self, args: list):
        pool = self.pool
        keys = self.keys
        key = self._key
        for i, a in enumerate(args):
            k = keys[i]
            if k is not None and (a.data_ptr() if isinstance(a, torch.Tensor) else key(a)) != k:
                pool.stats["moved_input"] += 1
                what = (f" ({tuple(a.shape)}, {a.dtype}, {_what(a)}, "
                        f"{'a graph input' if i in self.graph_inputs else 'made inside the graph'})"
                        if isinstance(a, torch.Tensor) else "")
                pool.break_cycle(f"input {i}{what} of partition {self.name} is not where it was when captured")
                pool.stats["eager_calls"] += 1
                return self.fn(args)
        refs = pool.replay_refs
        for pos, s in self.dead_before:
            r = refs[pos]
            if r is not None and not r[s].expired():
                pool.break_cycle(f"an output that the capture step had freed before partition {self.name} "
                                 "is still referenced")
                pool.stats["eager_calls"] += 1
                return self.fn(args)
        for i, buf in self.static.items():
            buf.copy_(args[i])
        inputs = list(args) if self.aliases_input else args
        args.clear()
        self.graph.replay()
        pool.stats["replays"] += 1
        storages = [compat.storage_from_pointer(m) for m in self.storage_meta]
        out_refs = [compat.storage_ref(s) for s in storages]
        refs[pool.pos] = out_refs
        pool.pos += 1
        result = []
        handed = pool.handed
        first = [True] * len(storages)
        for o in self.outs:
            kind = o[0]
            if kind == "pool":
                t = compat.tensor_from_storage(o[2], storages[o[1]])
                if first[o[1]]:
                    first[o[1]] = False
                    handed.append((out_refs[o[1]], weakref.ref(t)))
                result.append(t)
            elif kind == "value":
                result.append(o[1])
            elif kind == "clone":
                result.append(compat.tensor_from_storage(o[2], compat.storage_from_pointer(o[2])).clone())
            else:
                src = inputs[o[1]] if o[1] not in self.static else self.static[o[1]]
                result.append(src.as_strided(o[2]["size"], o[2]["stride"], o[2]["storage_offset"]))
        return result


def _what(t: torch.Tensor) -> str:
    """Whose memory a moving input is, for the reason that names it (a kept gathered parameter
    should never move with CUDA graphs on: see ``invalidate_persistent(keep_memory)``)."""
    from deepcompile.runtime import ops

    try:
        kept = {v: k for k, v in dict(ops.C.persistent_ptrs()).items()} if ops.C is not None else {}
    except Exception:  # noqa: BLE001 - a diagnostic only
        kept = {}
    pid = kept.get(t.data_ptr())
    if pid is None:
        return "not a kept gathered parameter"
    meta = ops.PARAMS.get(pid)
    return f"kept parameter {meta.name if meta else pid}"


def wrap_partitions(runner, maps: list, mutated_graph_inputs, pool: Pool, label: str,
                    tangent_inputs=()) -> int:
    """Put a :class:`PartitionGraph` around each partition of ``runner`` (Inductor's generated
    ``Runner``). ``tangent_inputs``: which of the graph's inputs are gradients handed to a backward
    graph. Returns how many were wrapped."""
    mutated_graph_inputs = set(mutated_graph_inputs or ())
    tangent_inputs = set(tangent_inputs)
    fns = []
    for i, m in enumerate(maps):
        mapping = list(getattr(m, "input_index_mapping", []) or [])
        mutated = frozenset(j for j, g in enumerate(mapping) if g is not None and g in mutated_graph_inputs)
        graph_in = frozenset(j for j, g in enumerate(mapping) if g is not None)
        tangents = frozenset(j for j, g in enumerate(mapping) if g is not None and g in tangent_inputs)
        fns.append(lambda f, i=i, mutated=mutated, graph_in=graph_in, tangents=tangents:
                   PartitionGraph(f, pool, f"{label}.p{i}", mutated, graph_in, tangents))
    runner.recursively_apply_fns(fns)
    return len(fns)
