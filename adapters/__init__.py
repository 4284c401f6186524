"""Multi-token head adapters: one head type per module, registered by name.

Importing this package registers the built-in types; ``registry`` looks them up.
"""

from .base import Features, HeadAdapter, LossOutput
from .registry import build_head, config_from_dict, get_head, make_config, register_head, registered_heads

__all__ = [
    "Features", "HeadAdapter", "LossOutput", "build_head", "config_from_dict", "get_head",
    "make_config", "register_head", "registered_heads",
]
