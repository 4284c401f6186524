"""Slow, obviously-correct references the optimised eval code is compared with (the library
computes these quantities chunk by chunk in ``eval.headscores``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def target_logprobs(logp: torch.Tensor, ids: torch.Tensor, offset: int) -> torch.Tensor:
    """Log-probability each position gives the token ``offset`` ahead # [B, T, V] -> [B, T - offset].

    ``logp[:, t]`` is a distribution over token t+offset; the last ``offset`` positions have
    no target inside the sequence and are dropped.
    """
    span = ids.shape[1] - offset
    if span <= 0:
        return logp.new_zeros((ids.shape[0], 0))
    return logp[:, :span].gather(-1, ids[:, offset:, None]).squeeze(-1)


def topk_hits(logp: torch.Tensor, ids: torch.Tensor, offset: int, ks: Sequence[int] = (1, 5)) -> dict[int, torch.Tensor]:
    """For each k, whether the target ``offset`` ahead is among the top k # -> {k: [B, T - offset] bool}."""
    span = ids.shape[1] - offset
    target = ids[:, offset:, None]  # [B, span, 1]
    kmax = min(max(ks), logp.shape[-1])
    top = logp[:, :span].topk(kmax, dim=-1).indices  # [B, span, kmax]
    hit = top == target
    return {k: hit[..., :k].any(-1) for k in ks}
