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
    # A tensor's float32 sum is finite when every element is (NaN and inf propagate), with no
    # [numel] mask allocated; only a sum that is not finite (a NaN, or an overflow) is looked at
    # element by element.
    sums = torch.stack([t.sum(dtype=torch.float32) for _, t in items])
    if bool(torch.isfinite(sums).all()):
        return None
    for (name, t), total in zip(items, sums.tolist()):
        if not torch.isfinite(torch.tensor(total)) and not bool(torch.isfinite(t).all()):
            return name, int((~torch.isfinite(t)).sum()), t.numel()
    return None


def describe(found: tuple[str, int, int]) -> str:
    """``heads.1.w holds 45,440 non-finite values (NaN or inf) of 45,440``."""
    name, bad, total = found
    return f"{name} holds {bad:,} non-finite values (NaN or inf) of {total:,}"


def check_finite(tensors, where: str, fix: str) -> None:
    """Refuse (CheckpointError) the tensors read from or written to ``where`` if any is NaN/inf."""
    found = non_finite(tensors)
    if found is not None:
        raise CheckpointError(f"{where}: {describe(found)}", fix)
