"""Load a backbone, attach heads, train, save/load, evaluate; and the ``multitoken`` CLI.

Names are imported lazily, so that importing the package loads nothing heavy.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Backbone": "model.backbone",
    "BackboneConfig": "model.loading",
    "LoraSpec": "model.loading",
    "load_backbone": "model.loading",
    "load_tokenizer": "multitoken.base.tokenizer",
    "tokenizer_fingerprint": "multitoken.base.tokenizer",
    "DataConfig": "multitoken.base.data",
    "iter_documents": "multitoken.base.data",
    "ARCHITECTURES": "model.backbone",
    "convert_llama2c": "sources.llama2c",
    "MultiTokenModel": "model.model",
    "load_model": "sources.assets",
    "default_base": "multitoken.embedded",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = _EXPORTS[name]  # multitoken.base / .embedded: the bottom floor's own packages
        return getattr(importlib.import_module(module if module.startswith("multitoken.") else f".{module}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
