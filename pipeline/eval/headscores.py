"""Per-head scores of a reference sequence without materialising [B, T, V] log-probs.

Evaluation needs, per head, only the log-prob of each reference target, whether it is in the
top 1 / top 5, and (for PPL_d) the top-k. For heads whose distribution is one softmax over the
shared unembedding (every adapter except CP) these come from the logits chunk by chunk
(unembedding + log-softmax of ``chunk`` rows at a time), so a [B, T, V] tensor never exists:
with a 50k vocabulary those allocations, not the arithmetic, dominated evaluation time. One
top-k pass serves top-1, top-5 and the proposal's top-k. Other heads go through ``log_probs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from multitoken.adapters.base import HeadAdapter
from multitoken.decoding.trees import MAX_RANKS as RANKS


@dataclass
class HeadScores:
    lp: torch.Tensor  # [B, S] log p_i(x_{t+i+1}) for the S = T - i - 1 positions with a target
    top1: torch.Tensor  # [B, S] bool
    top5: torch.Tensor  # [B, S] bool
    top_vals: torch.Tensor | None = None  # [B, T, k] top-k log-probs at every position
    top_ids: torch.Tensor | None = None  # [B, T, k]
    rank_hits: torch.Tensor | None = None  # [B, S, R] bool: the target is the head's rank-r guess (tree shapes)


def single_softmax(heads) -> bool:
    """True when every head's distribution is softmax(unembedding(hidden))."""
    return type(heads).log_probs is HeadAdapter.log_probs


def _targets(ids: torch.Tensor, offset: int) -> torch.Tensor:
    """ids shifted left by ``offset``, zero-padded # [B, T] -> [B, T]."""
    tgt = torch.zeros_like(ids)
    tgt[:, : ids.shape[1] - offset] = ids[:, offset:]
    return tgt


def _score_rows(logp: torch.Tensor, target: torch.Tensor, k: int | None):
    """log-probs [C, V], target [C] -> (lp [C], top1 [C], top5 [C], top-k vals, top-k idx,
    rank hits [C, R])."""
    lp = logp.gather(-1, target[:, None]).squeeze(-1)
    kk = max(5, RANKS, k or 0)
    vals, idx = logp.topk(min(kk, logp.shape[-1]), dim=-1)  # [C, kk], sorted: one pass serves all
    hit = idx[:, :5] == target[:, None]
    top = (vals[:, :k], idx[:, :k]) if k else (None, None)
    return lp, hit[:, 0], hit.any(-1), *top, idx[:, :RANKS] == target[:, None]


@torch.no_grad()
def score_head(model, i: int, feats, ids: torch.Tensor, k: int | None = None, chunk: int = 128) -> HeadScores:
    """Scores of head ``i`` (0-based, predicting token t+i+1) on ids [B, T].

    ``chunk`` = 128 rows: a [128, 50k] float32 block (26 MB) stays under glibc's mmap
    threshold, so blocks are reused instead of freshly page-faulted (larger blocks spend their
    extra time in the kernel, mapping and faulting fresh pages)."""
    heads, bb = model.heads, model.backbone
    B, T = ids.shape
    generic = single_softmax(heads)
    source = heads.hidden(i, feats) if generic else heads.log_probs(i, feats)  # [B, T, H] or [B, T, V]
    rows = source.reshape(B * T, source.shape[-1])
    target = _targets(ids, i + 1).reshape(-1)  # [B*T]
    parts = []
    for start in range(0, B * T, chunk):
        block = rows[start:start + chunk]
        block = torch.log_softmax(bb.logits(block).float(), -1) if generic else block  # [C, V]
        parts.append(_score_rows(block, target[start:start + chunk], k))
    lp, t1, t5, vals, idx, ranks = (torch.cat(p) if p[0] is not None else None for p in zip(*parts))
    S = T - i - 1
    shape = lambda x: x.reshape(B, T, *x.shape[1:])  # noqa: E731
    return HeadScores(shape(lp)[:, :S], shape(t1)[:, :S], shape(t5)[:, :S],
                      shape(vals) if vals is not None else None, shape(idx) if idx is not None else None,
                      shape(ranks)[:, :S])


@torch.no_grad()
def logp_at(model, i: int, feats, b: int, pos: torch.Tensor) -> torch.Tensor:
    """Head ``i``'s full log-distribution at positions ``pos`` of sequence b # -> [P, V]."""
    heads = model.heads
    if single_softmax(heads):
        h = heads.hidden(i, feats)[b, pos]  # [P, H]
        return torch.log_softmax(model.backbone.logits(h).float(), -1)
    return heads.log_probs(i, feats)[b, pos]
