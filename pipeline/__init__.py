"""Load a backbone, attach heads, train, save/load, evaluate; and the ``multitoken`` CLI.

Names are imported lazily so that ``import multitoken.pipeline.base.errors`` stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Backbone": "model.backbone",
    "BackboneConfig": "model.backbone",
    "LoraSpec": "model.backbone",
    "load_backbone": "model.backbone",
    "load_tokenizer": "base.tokenizer",
    "tokenizer_fingerprint": "base.tokenizer",
    "DataConfig": "base.data",
    "iter_documents": "base.data",
    "ARCHITECTURES": "model.backbone",
    "convert_llama2c": "model.llama2c",
    "MultiTokenModel": "model.model",
    "load_model": "model.assets",
    "default_base": "embedded",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
