"""Target log-probabilities through the shared, frozen unembedding, chunk by chunk.

Every head ends in ``log_softmax(U h)[x]``. U is the base model's frozen output matrix, so the
only gradient the backward pass needs is d/dh = (onehot(x) - softmax(U h)) U. ``FrozenUnembed``
computes it in the forward pass, while the chunk's [C, V] logits exist anyway, and keeps only
that [C, H] result: two matmuls per chunk, no [C, V] tensor kept for backward and nothing
recomputed. If U is trainable (or not a plain Linear) the chunk is checkpointed instead. The
softmax's element-wise passes (max, exp, sum, scale, less the one-hot) run in float32 on a few
rows at a time, written back over the logits in their own dtype: each block's passes stay in
the core's cache, and no [C, V] float32 tensor is made.

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
# Rows per block of the softmax on a CPU: their float32 copy (4 x V x 4 bytes) stays in a core's
# cache through every pass, instead of a [C, V] tensor streamed from memory once per pass; on a
# GPU the whole chunk is one block (one launch per op)
BLOCK_ROWS = 4
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


def softmax_less_onehot(logits: torch.Tensor, target: torch.Tensor, dtype: torch.dtype, rows: int):
    """log softmax(logits)[target] in float32 and softmax - onehot(target) in ``dtype``, the
    softmax taken in float32 ``rows`` rows at a time # logits [C, V], target [C] -> (logp [C],
    [C, V]; written over ``logits`` where the dtypes agree)."""
    C, V = logits.shape
    out = logits if logits.dtype == dtype else torch.empty_like(logits, dtype=dtype)
    logp = logits.new_empty(C, dtype=torch.float32)
    n = max(min(rows, C), 1)
    buf = None if logits.dtype == torch.float32 else logits.new_empty(n, V, dtype=torch.float32)
    minus_one = logits.new_full((n, 1), -1.0, dtype=torch.float32)
    for s in range(0, C, n):
        e = min(s + n, C)
        block = logits[s:e] if buf is None else buf[:e - s].copy_(logits[s:e])  # [b, V] float32
        at = target[s:e, None]
        top = block.amax(-1, keepdim=True)  # [b, 1]
        picked = block.gather(-1, at)
        block.sub_(top).exp_()
        total = block.sum(-1, keepdim=True)
        logp[s:e] = (picked - top - total.log()).squeeze(-1)
        block.div_(total).scatter_add_(-1, at, minus_one[:e - s])
        if buf is not None or out is not logits:
            out[s:e].copy_(block)
    return logp, out


class FrozenUnembed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, target, weight, bias):
        logits = F.linear(h, weight, bias)  # [C, V]
        hits = _hits(logits, target)
        rows = BLOCK_ROWS if h.device.type == "cpu" else h.shape[0]
        logp, less = softmax_less_onehot(logits, target, weight.dtype, rows)  # less: p - onehot [C, V]
        ctx.save_for_backward(-(less @ weight))  # d logp / dh  [C, H]
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
