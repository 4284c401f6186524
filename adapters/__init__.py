"""Multi-token head adapters: one head type per module, registered by name.

Importing this package registers the built-in types; ``registry`` looks them up.
"""

from .base import Features, HeadAdapter, LossOutput
from .registry import build_head, config_from_dict, get_head, make_config, register_head, registered_heads

# The built-in head types register themselves on import (registry.BUILTIN lists them, for
# code that imports a submodule without this __init__).
from . import conditioned, cp, eagle3, medusa, replicated, whs  # noqa: E402,F401

__all__ = [
    "Features", "HeadAdapter", "LossOutput", "build_head", "config_from_dict", "get_head",
    "make_config", "register_head", "registered_heads",
]
