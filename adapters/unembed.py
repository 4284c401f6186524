"""Target log-probabilities through the shared, frozen unembedding, chunk by chunk.

Every head ends in ``log_softmax(U h)[x]``. U is the base model's frozen output matrix, so the
only gradient the backward pass needs is d/dh = (onehot(x) - softmax(U h)) U. ``FrozenUnembed``
computes it in the forward pass, while the chunk's [C, V] logits exist anyway, and keeps only
that [C, H] result: two matmuls per chunk, no [C, V] tensor kept for backward and nothing
recomputed. If U is trainable (or not a plain Linear) the chunk is checkpointed instead.

The top-1 / top-5 hit counts take a top-k over every chunk's [C, V] logits, a good part of a
step: ``hits_counted(False)`` leaves them out (hits None, no rates in the metrics) on steps
whose metrics nobody reads; every head type's loss honours it.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

TOPK = 5
_COUNTING = contextvars.ContextVar("multitoken_hits_counted", default=True)


@contextlib.contextmanager
def hits_counted(on: bool):
    """Within: whether losses count top-1 / top-5 hits (``counting()``)."""
    token = _COUNTING.set(on)
    try:
        yield
    finally:
        _COUNTING.reset(token)


def counting() -> bool:
    return _COUNTING.get()


def _hits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[top-1 hits, top-5 hits] # logits [C, V], target [C] -> [2] (zeros when not counting)."""
    if not counting():
        return torch.zeros(2, dtype=torch.long, device=logits.device)
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

    h [N, H], target [N] (all real tokens) -> (logp [N] float32, hits [2] long | None when not
    ``counting()``).
    """
    parts, hits = [], torch.zeros(2, dtype=torch.long, device=h.device)
    for start in range(0, h.shape[0], chunk):
        logp, chunk_hits = _chunk(unembed, h[start:start + chunk], target[start:start + chunk])
        parts.append(logp)
        hits = hits + chunk_hits
    hits = hits if counting() else None
    if not parts:
        return h.new_zeros(0, dtype=torch.float32), hits
    return torch.cat(parts), hits
