"""AOTAutograd's cache, seeded by the trace-once compile, so that the first re-run of a plan hits.

A re-run that hits the plan cache compiles the stored plan at step 0 through AOTAutograd with its
cache on (``inductor_compile(aot_cache_salt=...)``); a hit skips Dynamo's backend work, the joint
trace, the partition and our passes. The run that *made* the plan compiled its final graphs by
trace once, outside AOTAutograd, so it stores no entry of its own, and the first re-run would pay
the whole trace again (about twice the time of a re-run that hits).

So the planning run's warm-up compile (step 0) goes through AOTAutograd with the cache on, under
the salt the re-run will use: AOTAutograd computes the re-run's key, misses (the salt names a
plan not made yet) and, for a lazily compiled backward, builds the closure that saves an entry
once the forward and the backward carry an FX graph cache key (``_cache_autograd_info`` returns
it; the backward's first compile calls it, and with the warm-up's Python graphs it saves
nothing: ``_should_save_cache`` wants Inductor's keys). After the trace-once compile, the warm-up
forward's callable is given the final forward's key and the closure is called with the final
backward: torch's own code builds and saves the entry. The runtime metadata, wrappers and
partition facts are the warm-up's, which are the ones the final graphs run under in this run
(trace once re-points AOTAutograd's callables and keeps everything else).

Checked: torch 2.13 (here: ``graph_compile._cache_autograd_info(aot_config, flat_args,
compiled_fw_func, compiled_bw_func, ..., fw_metadata, ..., bw_module, ...)`` returning
``(try_save_cache_entry, entry)``; the closure's arguments ``(compiled_bw_func, bw_module,
fw_metadata, aot_config)``, as ``CompiledFunction``'s lazy backward calls it) and torch 2.11 (the
GPU machines: run, not read; the entry saved, and the re-run hit it). Anything else
(another signature, a bundled cache, an eagerly compiled backward): nothing is seeded, and the
re-run stores the entry itself.
"""
from __future__ import annotations

import torch


class AotSeed:
    """One Dynamo graph's pending AOTAutograd entry (see above)."""

    def __init__(self, save, compiled_fw, bw_module, fw_metadata, aot_config):
        self.save, self.compiled_fw = save, compiled_fw
        self.bw_module, self.fw_metadata, self.aot_config = bw_module, fw_metadata, aot_config


class aot_seed_recorder:
    """Context around a warm-up compile: collects an ``AotSeed`` per AOTAutograd graph compiled in
    it (``seeds``), or says why none can be (``why``)."""

    def __init__(self):
        self.seeds: list[AotSeed] = []
        self.why: str | None = None
        self._restore = None

    def __enter__(self):
        import inspect

        try:
            from torch._functorch._aot_autograd import graph_compile as gc_mod
            from torch._functorch._aot_autograd.autograd_cache import should_bundle_autograd_cache
            orig = gc_mod._cache_autograd_info
            sig = inspect.signature(orig)
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            self.why = f"this torch has no _cache_autograd_info to hook ({type(e).__name__})"
            return self
        missing = {"aot_config", "compiled_fw_func", "compiled_bw_func", "fw_metadata", "bw_module"} - set(sig.parameters)
        if missing:
            self.why = f"_cache_autograd_info has no {sorted(missing)} here"
            return self
        if should_bundle_autograd_cache():
            self.why = "AOTAutograd's cache is bundled (it would keep the warm-up's own graphs)"
            return self

        def hooked(*args, **kwargs):
            out = orig(*args, **kwargs)
            try:
                a = sig.bind(*args, **kwargs).arguments
                save = out[0] if isinstance(out, tuple) else None
                if save is None or a["compiled_bw_func"] is not None:
                    self.why = "the backward was compiled with the forward (no lazy save to take over)"
                elif getattr(a["aot_config"], "cache_info", None) is None:
                    self.why = "AOTAutograd computed no cache key for the warm-up compile"
                else:
                    self.seeds.append(AotSeed(save, a["compiled_fw_func"], a["bw_module"], a["fw_metadata"],
                                              a["aot_config"]))
            except Exception as e:  # noqa: BLE001 - seeding is an optimization; the compile goes on
                self.why = f"{type(e).__name__}: {e}"
            return out

        gc_mod._cache_autograd_info = hooked
        self._restore = (gc_mod, orig)
        return self

    def __exit__(self, *exc):
        if self._restore is not None:
            mod, orig = self._restore
            mod._cache_autograd_info = orig
        return False


def aot_seed_save(seed: AotSeed, fw, bw, tracing_context) -> str | None:
    """Save the AOTAutograd entry of ``seed`` for the compiled final forward ``fw`` and backward
    ``bw`` (Inductor's, each with its FX graph cache key). None when saved, else why not."""
    from torch._dynamo.utils import counters

    keys = [getattr(f, "_fx_graph_cache_key", None) for f in (fw, bw)]
    if None in keys:
        return "a final graph has no FX graph cache key (Inductor's cache was bypassed for it)"
    # what make_entry reads off the compiled forward the closure holds (the warm-up's callable,
    # which keeps running: it gets them for the save only)
    attrs = {"_fx_graph_cache_key": keys[0], "_fx_graph_cache_debug_lines": getattr(fw, "_fx_graph_cache_debug_lines", []),
             "guards_expr": getattr(fw, "guards_expr", None)}
    try:
        for attr, value in attrs.items():
            setattr(seed.compiled_fw, attr, value)
    except AttributeError:
        return f"the warm-up forward ({type(seed.compiled_fw).__name__}) takes no attributes"
    saved = counters["aot_autograd"]["autograd_cache_saved"]
    try:
        with torch._guards.tracing(tracing_context):  # the guards expression reads its shape env
            seed.save(bw, seed.bw_module, seed.fw_metadata, seed.aot_config)
    except Exception as e:  # noqa: BLE001 - the re-run stores the entry itself
        return f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        for attr in attrs:
            seed.compiled_fw.__dict__.pop(attr, None)
    if counters["aot_autograd"]["autograd_cache_saved"] == saved:
        return "AOTAutograd did not save the entry (see torch's log for the reason)"
    return None
