"""Graph passes, one per file. Importing this package registers them all."""
from deepcompile.passes.registry import PASSES, PassContext, make_params, normalize_entry, register_pass
from deepcompile.passes import offload_activations, offload_optimizer, prefetch, recompute_activations, selective_unshard, zero3, zero12  # noqa: F401  (registers)

__all__ = ["PASSES", "PassContext", "make_params", "normalize_entry", "register_pass"]
