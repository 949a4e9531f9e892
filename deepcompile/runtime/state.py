"""The runtime state of this process: one :class:`RuntimeState`, created by
``deepcompile.initialize`` and dropped by ``deepcompile.destroy``.

It holds what the dc ops, the passes and the profiler share about the model the runtime serves
now: the parameter registry (id -> :class:`ParamMeta`), the gradient buckets' layout the backward
replays, the optimizer-state offload manager and the host-offload copy engine it stands on, the
node names a collective timeout reports, and the profiling step's host-time and memory samples.
A second ``initialize`` replaces it with a fresh one (the first model's parameters are no longer
reachable); the C++ runtime (``ops.C``) has its own per-process state, re-initialised alongside.

Who reaches it how: the entry points create and drop it (:func:`install`, :func:`drop`); the model
wrapper keeps a reference to its own; passes get it in their context (``PassContext.runtime``).
The one scoped global is :func:`current`, for code that runs inside torch ops and cannot be handed
anything: the fake impls and kernels of the ``dc`` ops, the profiling interpreter, the record's
scope names (as torchtitan's simple_fsdp reaches its mesh from inside its parametrization).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from deepcompile.runtime.offload import CopyEngine
from deepcompile.runtime.optimizer_state import OptimizerStateOffload


@dataclass(frozen=True)
class ParamMeta:
    id: int
    name: str               # the first name the parameter has in the user's model
    shape: tuple[int, ...]  # full shape
    numel: int
    chunk: int              # shard numel (row-aligned: ceil(d0 / world) rows, see sharding.shard_layout)
    dtype: torch.dtype      # dtype of the shard (master weights)
    gather_dtype: torch.dtype  # dtype the parameter is gathered and computed in
    requires_grad: bool
    shard_shape: tuple[int, ...] | None = None  # (ceil(d0 / world), *shape[1:]); None: (chunk,)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.shard_shape if self.shard_shape is not None else (self.chunk,)


@dataclass(frozen=True)
class ReduceLayout:
    """What the backward pass must know of the runtime's gradient buckets to call it once per
    bucket (``dc.reduce_grads``, passes/zero3.py ``group_reduces``): the pass replays the
    runtime's bucket fill (``Runtime::add_grad``) in graph order to find where each flush happens."""
    bucket_elems: int                   # config reduce_bucket_size (Runtime bucket_elems_)
    reduce_dtype: torch.dtype | None    # config mixed_precision.reduce_dtype; None: unknown (offline)
    # the runtime copies every gradient as it arrives (ZeRO-1 sums between accumulation
    # boundaries, or set_copy_grads): holding them for a batched call would keep the originals
    # alive beside the copies, so each gradient gets its own call
    copies_each: bool = False
    # config blocks: the final graphs are compiled as block regions, so a call never spans a
    # block boundary (passes/zero3.group_reduces, blocks.cut_at_blocks)
    by_block: bool = False


@dataclass
class RuntimeState:
    """Everything the process's runtime knows of the model it serves (see the module docstring)."""
    # id -> ParamMeta of every registered parameter (sharding.shard_module fills it); the fake
    # impls read full shapes and dtypes from it
    params: dict[int, ParamMeta] = field(default_factory=dict)
    # the gradient buckets' layout the backward's reduce grouping replays; None until initialize sets it
    reduce_layout: ReduceLayout | None = None
    # host offload: pinned buffers, copy streams, in-flight copies (activations and optimizer state)
    offload: CopyEngine = field(default_factory=CopyEngine)
    # the optimizer's state tensors kept on the host between steps (offload_optimizer plans it)
    optimizer_state: OptimizerStateOffload = None  # type: ignore[assignment]  # built on ``offload``
    # (graph_id, kind) -> {"op:id": node name}: which node issues each collective, so a collective
    # timeout names it (runtime.seqcheck pushes the merged table to the C++ runtime)
    op_nodes: dict[tuple[int, str], dict[str, str]] = field(default_factory=dict)
    # the model wrapper it serves (api.DeepCompileModel), held weakly; None: none attached
    model: weakref.ref | None = None
    # the profiling step's samples: dc op name -> host microseconds of each call (CUDA), and the
    # memory split by category (profile.memory_split.StepMemory; set by profile.memory_split.track_memory)
    host_ops: dict[str, list[float]] = field(default_factory=dict)
    step_memory: object | None = None
    # config blocks (compile.blocks): one entry per graph compiled as block regions (regions, how
    # many compiled and how many reused an identical block's artifact, seconds), and the regions
    # of each driver loaded from AOTAutograd's cache: the compile breakdown and the tests read them
    block_compiles: list[dict] = field(default_factory=list)
    blocks_loaded: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.optimizer_state is None:
            self.optimizer_state = OptimizerStateOffload(self.offload)

    def served_model(self):
        """The model wrapper this state serves, or None (none attached, or collected)."""
        return self.model() if self.model is not None else None

    def close(self) -> None:
        """Let go of what the state holds: the optimizer's hooks and offloaded state (brought
        back first), the pinned host buffers, the registry and the profiling samples."""
        self.optimizer_state.detach()
        self.offload.release_buffers()
        self.params.clear()
        self.op_nodes.clear()
        self.host_ops.clear()
        self.step_memory = None
        self.block_compiles.clear()
        self.blocks_loaded.clear()
        self.model = None


_STATE: RuntimeState | None = None


def install(state: RuntimeState) -> RuntimeState:
    """Make ``state`` this process's runtime state (``deepcompile.initialize``); the previous one,
    if any, is closed first."""
    global _STATE
    if _STATE is not None and _STATE is not state:
        _STATE.close()
    _STATE = state
    return state


def drop() -> None:
    """Close and forget this process's runtime state (``deepcompile.destroy``, a failed initialize)."""
    global _STATE
    if _STATE is not None:
        _STATE.close()
    _STATE = None


def active() -> bool:
    """Whether this process has a runtime state (``deepcompile.initialize`` ran, no destroy since)."""
    return _STATE is not None


def current() -> RuntimeState:
    """This process's runtime state; a RuntimeError naming ``deepcompile.initialize`` without one."""
    if _STATE is None:
        raise RuntimeError(
            "deepcompile: no runtime state in this process: call deepcompile.initialize(model, make_optimizer, "
            "config) first (after deepcompile.destroy(model) a model must be initialised again)")
    return _STATE
