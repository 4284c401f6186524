"""Weight dtypes by name (the ``--dtype`` choices)."""

from __future__ import annotations

import torch

from multitoken.base.errors import UsageError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}", f"use one of {', '.join(DTYPES)}")
    return DTYPES[name]
