"""deepcompile: a compiler for sharded (ZeRO) training of ordinary PyTorch models.

Importing it patches nothing in torch: ``initialize`` routes ``torch.nn.utils.clip_grad_norm_``
to the global norm for deepcompile's parameters (``deepcompile.clip.route_clip_grad_norm``).
"""
from deepcompile.api import DeepCompileModel, destroy, full_state_dict, initialize, load_full_state_dict
from deepcompile.checkpoint import get_state_dict, load_checkpoint, save_checkpoint, set_state_dict
from deepcompile.clip import clip_grad_norm_
from deepcompile.config import Config
from deepcompile.params import ConfigError

__all__ = ["Config", "ConfigError", "DeepCompileModel", "destroy", "initialize", "full_state_dict",
           "load_full_state_dict", "clip_grad_norm_", "get_state_dict", "set_state_dict",
           "save_checkpoint", "load_checkpoint"]
from deepcompile.version import __version__  # noqa: E402
