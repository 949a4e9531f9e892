"""deepcompile: a compiler for sharded (ZeRO) training of ordinary PyTorch models."""
from deepcompile.api import DeepCompileModel, destroy, full_state_dict, initialize, load_full_state_dict
from deepcompile.checkpoint import get_state_dict, set_state_dict
from deepcompile.config import Config
from deepcompile.params import ConfigError

__all__ = ["Config", "ConfigError", "DeepCompileModel", "destroy", "initialize", "full_state_dict",
           "load_full_state_dict", "get_state_dict", "set_state_dict"]
__version__ = "0.1.0"
