"""Host offload: pinned host buffers, copy streams, and the graph ops that use them.

A tensor is offloaded by copying it to a host buffer and then *freeing its storage*
(``untyped_storage().resize_(0)``) while the tensor object, its shape and its place in autograd
or in the optimizer's state stay as they were; reloading re-allocates the storage and copies the
bytes back. Nothing else that holds the tensor has to know. This is the same trick FSDP uses for
unsharded parameters, and it keeps every graph's tensor metadata (device, shape, strides) intact,
so Inductor and AOTAutograd see nothing unusual.

On CUDA the copies run on two side streams (device-to-host, host-to-device) into pinned memory,
ordered by events: an offload waits for the compute that produced the tensor, its storage goes
back to the caching allocator only when the copy is done (``record_stream``), and compute waits
for a reload only where the value is next used. On the CPU (gloo) there is no device memory to
save: the same code path copies to a separate host buffer synchronously, which keeps the
numerics and the lifetimes testable.

Graph ops (Python custom ops in the ``dc`` namespace, fake impls included). Each takes the tensor
it acts on as a mutated argument: that orders it after the tensor's producer and before its later
readers in FX and Inductor, and no output is needed.

* ``dc.offload_activation(t, after, id)``  forward, after ``t``'s last forward use: start the copy
  out. ``after`` are the outputs of ``t``'s forward readers: Inductor computes a pointwise reader
  lazily, and only an extern kernel's *inputs* are sure to be materialised before it runs, so
  without them the copy could overtake a fused kernel that still reads ``t``
* ``dc.reload_activation(t, id)``    backward, ahead of the first use: start the copy back
* ``dc.wait_activation(t, id)``      backward, at the first use: compute waits for the copy
* ``dc.drop_activation(t, after)``   forward, after ``t``'s last forward use: free its storage with
  no copy (``passes/recompute.py``: backward computes the value again); ``after`` as for offload
* ``dc.release_optimizer_state(anchor, reserve_bytes)``  forward: free the device copies of
  optimizer state whose copy out was started after the last step (deferred), in order, until
  ``reserve_bytes`` for the rest of the step fit beside what is allocated
* ``dc.reload_optimizer_state(anchor, reserve_bytes)``  backward: start bringing offloaded optimizer
  state back, as much as fits beside ``reserve_bytes`` for the rest of backward (-1: all; see
  :mod:`deepcompile.runtime.optimizer_state`)
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

_lib: torch.library.Library | None = None


class OffloadError(RuntimeError):
    pass


def pinned_supported() -> bool:
    """Whether page-locked host memory can be allocated here (CUDA build with a device)."""
    if not torch.cuda.is_available():
        return False
    try:
        torch.empty(1, pin_memory=True)
        return True
    except RuntimeError:
        return False


@dataclass
class _Pending:
    ref: weakref.ref              # the offloaded storage (freed meanwhile); compiled code may hand
                                  # us a different tensor object over it at reload, so match storages
    host: torch.Tensor
    nbytes: int
    d2h_done: object = None       # CUDA event, or None on CPU
    h2d_done: object = None
    state: str = "offloaded"      # (copying ->) offloaded -> reloading -> resident


@dataclass
class CopyEngine:
    """Streams, host buffers and in-flight copies for one process."""
    pools: dict = field(default_factory=dict)        # nbytes -> [(host buffer, event it is free after)]
    pending: dict = field(default_factory=dict)      # key -> list[_Pending]
    stats: dict = field(default_factory=lambda: {"offloads": 0, "reloads": 0, "skipped": 0,
                                                 "offloaded_bytes": 0, "peak_host_bytes": 0,
                                                 "drops": 0, "drops_skipped": 0, "dropped_bytes": 0})
    host_bytes: int = 0
    _streams: dict = field(default_factory=dict)

    # ---------------------------------------------------------------- buffers and streams
    def _stream(self, device: torch.device, which: str):
        key = (which, device.index)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=device)
        return self._streams[key]

    def _host_buffer(self, t: torch.Tensor):
        """A host buffer for ``t``'s storage, and the event its previous copy-back recorded
        (None for a new buffer): the next copy into it must wait for that event."""
        nbytes = t.untyped_storage().nbytes()
        pool = self.pools.setdefault(nbytes, [])
        if pool:
            return pool.pop()
        cuda = t.device.type == "cuda"
        try:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        except RuntimeError as e:
            raise OffloadError(
                f"deepcompile offload: cannot allocate {nbytes / 2**20:.1f} MiB of pinned host memory "
                f"({e}). Pinned memory needs a CUDA build with a working driver and enough lockable "
                "host memory (ulimit -l); remove the offload pass or lower what it offloads.") from e
        self.host_bytes += nbytes
        self.stats["peak_host_bytes"] = max(self.stats["peak_host_bytes"], self.host_bytes)
        return buf, None

    def release_buffers(self) -> None:
        self.pools.clear()
        self.pending.clear()
        self.host_bytes = 0

    # ---------------------------------------------------------------- copies
    @staticmethod
    def offloadable(t: torch.Tensor) -> bool:
        """Only a tensor that owns its whole storage can have it freed: freeing a storage that
        other views share would destroy them."""
        st = t.untyped_storage()
        return (st.nbytes() > 0 and t.storage_offset() == 0 and t.is_contiguous()
                and st.nbytes() == t.numel() * t.element_size())

    def drop(self, t: torch.Tensor) -> bool:
        """Free ``t``'s storage with no copy (its value is recomputed before it is read again).
        On CUDA the block goes back to the caching allocator for the current stream, after the
        kernels already queued there that read it, as FSDP frees unsharded parameters. Returns
        False (and leaves ``t`` alone) when ``t`` shares its storage with other tensors."""
        if not self.offloadable(t):
            self.stats["drops_skipped"] += 1
            return False
        self.stats["dropped_bytes"] += t.untyped_storage().nbytes()
        t.untyped_storage().resize_(0)
        self.stats["drops"] += 1
        return True

    def offload(self, t: torch.Tensor, key, defer_free: bool = False) -> bool:
        """Copy ``t`` out and free its storage. Returns False (and leaves ``t`` alone) when
        ``t`` shares its storage with other tensors.

        ``defer_free`` (CUDA): start the copy but keep the device storage until :meth:`release`.
        Freed at once, a block the copy still reads goes back to the allocator tied to the copy's
        event; an allocation that needs it before the copy ends makes the allocator wait for
        *every* outstanding copy (its out-of-memory path synchronises all events): on the 2-GPU
        offload benchmark that leaves the forward idle for most of the 65 ms copy of the
        optimizer state.
        Released later, in order and only as the memory is needed, compute waits for just the
        copies it needs; and a tensor never released needs no copy back."""
        if not self.offloadable(t):
            self.stats["skipped"] += 1
            return False
        self._prune(key)
        st = t.untyped_storage()
        nbytes = st.nbytes()
        host, free_after = self._host_buffer(t)
        src = t.detach().view(-1).view(torch.uint8)
        if t.device.type == "cuda":
            s = self._stream(t.device, "d2h")
            s.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(s):
                if free_after is not None:
                    s.wait_event(free_after)  # the buffer's last copy back must have read it
                host.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(s)
            if not defer_free:
                t.record_stream(s)  # the allocator must not hand the freed block out before the copy ends
        else:
            host.copy_(src)
            ev = None
        if defer_free:  # (on the CPU too, where the copy is already done: the same lifecycle, testable)
            state = "copying"
        else:
            st.resize_(0)
            state = "offloaded"
        self.pending.setdefault(key, []).append(_Pending(weakref.ref(st), host, nbytes, d2h_done=ev, state=state))
        self.stats["offloads"] += 1
        self.stats["offloaded_bytes"] += nbytes
        return True

    def find(self, t: torch.Tensor, key) -> _Pending | None:
        st = t.untyped_storage()
        for p in self.pending.get(key, []):
            if p.ref() is st:
                return p
        return None

    def host_view(self, t: torch.Tensor, key) -> torch.Tensor | None:
        """``t``'s value where only the host has it (offloaded and freed on the device): its host
        buffer seen with ``t``'s dtype and shape, once the copy out has ended; None where the
        device still holds the bytes."""
        p = self.find(t, key)
        if p is None or p.state != "offloaded":
            return None
        if p.d2h_done is not None:
            p.d2h_done.synchronize()
        return p.host.view(t.dtype).view(t.shape)

    def release(self, t: torch.Tensor, key) -> None:
        """Free the device storage of a deferred offload (:meth:`offload` with ``defer_free``).
        The current stream waits for the copy first, so the block, which belongs to that stream,
        is reusable at once and safely: no ``record_stream``, no allocator-wide wait."""
        p = self.find(t, key)
        if p is None or p.state != "copying":
            return
        if p.d2h_done is not None:
            torch.cuda.current_stream(t.device).wait_event(p.d2h_done)
        t.untyped_storage().resize_(0)
        p.state = "offloaded"

    def reload(self, t: torch.Tensor, key) -> None:
        """Re-allocate ``t``'s storage and start copying its bytes back (no-op if not offloaded).

        On CUDA the storage is allocated on the current stream and written on the host-to-device
        stream; ``record_stream`` on that stream keeps the allocator from handing the block out
        again before the copy ends, whether or not :meth:`wait` runs before the tensor is freed
        (a backward that raises, or a saved tensor autograd drops unread)."""
        p = self.find(t, key)
        if p is None or p.state != "offloaded":
            return
        st = t.untyped_storage()
        st.resize_(p.nbytes)
        dst = t.detach().view(-1).view(torch.uint8)
        if t.device.type == "cuda":
            s = self._stream(t.device, "h2d")
            # the new block may still be read by compute issued before it was freed: wait for it
            s.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(s):
                s.wait_event(p.d2h_done)
                dst.copy_(p.host, non_blocking=True)
                p.h2d_done = torch.cuda.Event()
                p.h2d_done.record(s)
            t.record_stream(s)  # the copy writes the block: it is not reused before the copy ends
        else:
            dst.copy_(p.host)
        p.state = "reloading"
        self.stats["reloads"] += 1

    def wait(self, t: torch.Tensor, key) -> None:
        """Make the current stream wait for ``t``'s reload (starting it if nobody did)."""
        p = self.find(t, key)
        if p is None:
            return
        if p.state == "copying":
            # never released: the bytes are still on the device; only the copy out (which reads
            # them) must end before anyone writes them
            if p.d2h_done is not None:
                torch.cuda.current_stream(t.device).wait_event(p.d2h_done)
            p.h2d_done = p.d2h_done   # the host buffer is free once that copy is done
            self._retire(key, p)
            return
        if p.state == "offloaded":
            self.reload(t, key)
        if p.h2d_done is not None:
            torch.cuda.current_stream(t.device).wait_event(p.h2d_done)
        self._retire(key, p)

    def _retire(self, key, p: _Pending) -> None:
        p.state = "resident"
        self.pending[key].remove(p)
        self.pools.setdefault(p.nbytes, []).append((p.host, p.h2d_done))

    def _prune(self, key) -> None:
        """Entries whose storage died without a reload (forward without backward): recycle."""
        live = []
        for p in self.pending.get(key, []):
            if p.ref() is None:
                # a reload whose wait never ran may still read the host buffer: free after its copy
                done = p.h2d_done if p.state == "reloading" else p.d2h_done
                self.pools.setdefault(p.nbytes, []).append((p.host, done))
            else:
                live.append(p)
        self.pending[key] = live


# -------------------------------------------------------------------- graph ops
def activation_ops(engine: Callable[[], CopyEngine]) -> dict:
    """{schema: kernel} of the activation offload ops, acting on ``engine()`` (the copy engine of
    the current runtime state, resolved at each call: ``runtime.ops`` hands it in)."""
    def offload_activation(t: torch.Tensor, after: list[torch.Tensor], aid: int) -> None:
        engine().offload(t, ("act", aid))

    def reload_activation(t: torch.Tensor, aid: int) -> None:
        engine().reload(t, ("act", aid))

    def wait_activation(t: torch.Tensor, aid: int) -> None:
        engine().wait(t, ("act", aid))

    def drop_activation(t: torch.Tensor, after: list[torch.Tensor]) -> None:
        engine().drop(t)

    return {
        "offload_activation(Tensor(a!) t, Tensor[] after, int id) -> ()": offload_activation,
        "reload_activation(Tensor(a!) t, int id) -> ()": reload_activation,
        "wait_activation(Tensor(a!) t, int id) -> ()": wait_activation,
        "drop_activation(Tensor(a!) t, Tensor[] after) -> ()": drop_activation,
    }


def define_ops(defs: dict) -> None:
    """Define the ``dc`` offload ops, ``defs`` being {schema: kernel} (idempotent; called by
    ``ops.ensure_registered`` with :func:`activation_ops` and the optimizer-state manager's)."""
    global _lib
    if _lib is not None:
        return
    from deepcompile.compat import fx as fx_compat

    lib = torch.library.Library("dc", "FRAGMENT")
    for schema, fn in defs.items():
        name = schema.split("(")[0]
        lib.define(schema, tags=(torch.Tag.cudagraph_unsafe,))  # host logic per call: never inside a CUDA graph
        lib.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"dc::{name}", lambda *a, **k: None, lib=lib)
        fx_compat.mark_side_effect(getattr(torch.ops.dc, name).default)
    _lib = lib
