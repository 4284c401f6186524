"""Weights must be finite: the one check every writer and reader of weights runs.

A NaN or inf weight never recovers (every later product with it is NaN too), and decoding with
it fails silently (a NaN head is never accepted, so it falls back to one token per forward).
So the trainer stops at the first non-finite loss or weight, heads and checkpoints are checked
before they are written, and every reader refuses non-finite tensors with one line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from multitoken.base.errors import CheckpointError


def non_finite(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> tuple[str, int, int] | None:
    """``(name, non-finite count, size)`` of the first floating tensor holding NaN or inf, else
    None. One device read for all tensors while they are clean (the common case)."""
    items = [(n, t) for n, t in (tensors.items() if isinstance(tensors, Mapping) else tensors)
             if t.is_floating_point() and t.numel()]
    if not items:
        return None
    flags = torch.stack([torch.isfinite(t).all() for _, t in items])
    if bool(flags.all()):
        return None
    name, t = items[int((~flags).nonzero()[0])]
    return name, int((~torch.isfinite(t)).sum()), t.numel()


def describe(found: tuple[str, int, int]) -> str:
    """``heads.1.w holds 45,440 non-finite values (NaN or inf) of 45,440``."""
    name, bad, total = found
    return f"{name} holds {bad:,} non-finite values (NaN or inf) of {total:,}"


def check_finite(tensors, where: str, fix: str) -> None:
    """Refuse (CheckpointError) the tensors read from or written to ``where`` if any is NaN/inf."""
    found = non_finite(tensors)
    if found is not None:
        raise CheckpointError(f"{where}: {describe(found)}", fix)
