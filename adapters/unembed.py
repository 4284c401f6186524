"""Target log-probabilities through the shared, frozen unembedding, chunk by chunk.

Every head ends in ``log_softmax(U h)[x]``. U is the base model's frozen output matrix, so the
only gradient the backward pass needs is d/dh = (onehot(x) - softmax(U h)) U. ``FrozenUnembed``
computes it in the forward pass, while the chunk's [C, V] logits exist anyway, and keeps only
that [C, H] result: two matmuls per chunk, no [C, V] tensor kept for backward and nothing
recomputed. If U is trainable (or not a plain Linear) the chunk is checkpointed instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

TOPK = 5


def _hits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[top-1 hits, top-5 hits] # logits [C, V], target [C] -> [2]."""
    top = logits.topk(min(TOPK, logits.shape[-1]), dim=-1).indices == target[:, None]  # [C, 5]
    return torch.stack([top[:, 0].sum(), top.any(-1).sum()])


class FrozenUnembed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, target, weight, bias):
        logits = F.linear(h, weight, bias).float()  # [C, V]
        hits = _hits(logits, target)
        lse = logits.logsumexp(-1)  # [C]
        logp = logits.gather(-1, target[:, None]).squeeze(-1) - lse  # [C]
        probs = logits.sub_(lse[:, None]).exp_()  # reuse the logits buffer: softmax [C, V]
        probs.scatter_add_(-1, target[:, None], torch.full_like(probs[:, :1], -1.0))  # p - onehot
        ctx.save_for_backward(-(probs.to(weight.dtype) @ weight))  # d logp / dh  [C, H]
        ctx.mark_non_differentiable(hits)
        return logp, hits

    @staticmethod
    def backward(ctx, grad_logp, _grad_hits):
        (dlogp_dh,) = ctx.saved_tensors
        return grad_logp[:, None].to(dlogp_dh.dtype) * dlogp_dh, None, None, None


def _plain(unembed: nn.Module, h: torch.Tensor, target: torch.Tensor):
    logits = unembed(h).float()  # [C, V]
    logp = torch.log_softmax(logits, -1).gather(-1, target[:, None]).squeeze(-1)
    with torch.no_grad():
        hits = _hits(logits, target)
    return logp, hits


def _chunk(unembed: nn.Module, h: torch.Tensor, target: torch.Tensor):
    if not (torch.is_grad_enabled() and h.requires_grad):
        with torch.no_grad():
            return _plain(unembed, h, target)
    if type(unembed) is nn.Linear and not unembed.weight.requires_grad:
        bias = unembed.bias
        if bias is not None and bias.requires_grad:
            return checkpoint(_plain, unembed, h, target, use_reentrant=False)
        return FrozenUnembed.apply(h, target, unembed.weight, bias)
    return checkpoint(_plain, unembed, h, target, use_reentrant=False)


def target_log_probs(unembed: nn.Module, h: torch.Tensor, target: torch.Tensor, chunk: int):
    """log softmax(U h)[target] per row, and top-1/top-5 hit counts.

    h [N, H], target [N] (all real tokens) -> (logp [N] float32, hits [2] long).
    """
    parts, hits = [], torch.zeros(2, dtype=torch.long, device=h.device)
    for start in range(0, h.shape[0], chunk):
        logp, chunk_hits = _chunk(unembed, h[start:start + chunk], target[start:start + chunk])
        parts.append(logp)
        hits = hits + chunk_hits
    if not parts:
        return h.new_zeros(0, dtype=torch.float32), hits
    return torch.cat(parts), hits
