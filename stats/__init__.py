"""Token co-occurrence statistics (unigram, bigram, trigram counts) and fast mask lookup.

``CooccurrenceTable`` (a stats dir, memory-mapped, checked against a tokenizer) is exported
lazily, so that importing one stats module does not load the others.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"CooccurrenceTable": "table", "BuildConfig": "job"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
