"""The contract every head adapter meets, and the loss machinery they share.

A head adapter turns one backbone pass (``Features``) into distributions for tokens
t+1..t+n. Head 1 (index 0) is the base model's own next-token path: its hidden state is
computed by the pipeline (final layer + final norm) and handed over in ``Features.base``.
Adapters hold only their own new weights as submodules; the backbone is kept as a plain
attribute, so ``adapter.state_dict()`` is exactly what a heads dir stores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .unembed import target_log_probs
from multitoken.base.dtypes import resolve_dtype

IGNORE = -100
DEFAULT_CHUNK = 1024  # tokens per unembedding chunk: bounds the [chunk, V] logits alive at once


@dataclass
class Features:
    """What one backbone pass hands to the heads (all [B, T, H])."""

    trunk: torch.Tensor  # output of layers[:-1] = input of the original final layer
    base: torch.Tensor  # head 1's hidden: final_norm(final_layer(trunk)), what the unembedding sees
    layer_states: tuple[torch.Tensor, ...]  # outputs of layers 1..L-1 (only when an adapter asks)
    ctx: object  # backbone.LayerContext: mask / positions to run more layers on the same tokens
    # [B, T] the token at t+1 after each position, for heads that read it (``needs_next_tokens``):
    # the text's own next token where it is known, else the base model's argmax there
    next_ids: torch.Tensor | None = None


@dataclass
class LossOutput:
    """Per-head losses for one batch. ``per_head[i]`` is the mean cross-entropy of the head
    predicting token t+i+1 (unweighted; it may not require grad, e.g. head 1 with a frozen
    backbone, and is None when the caller asked to skip such constant terms). ``aux`` is a
    differentiable auxiliary loss to add with its own weight."""

    per_head: list[torch.Tensor | None]
    aux: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> torch.Tensor:
        """Plain unweighted sum of the computed terms (aux excluded): a convenience, the trainer
        weights its own."""
        return torch.stack([l.float() for l in self.per_head if l is not None]).sum()


def shifted_targets(input_ids: torch.Tensor, valid: torch.Tensor, offset: int) -> torch.Tensor:
    """Targets for a head predicting token t+offset # [B, T] -> [B, T] (IGNORE where absent)."""
    tgt = torch.full_like(input_ids, IGNORE)
    if offset < input_ids.shape[1]:
        ok = valid[:, offset:] & valid[:, :-offset]  # both the source and the target are real tokens
        tgt[:, :-offset] = torch.where(ok, input_ids[:, offset:], IGNORE)
    return tgt


def chunked_cross_entropy(unembed: nn.Module, hidden: torch.Tensor, target: torch.Tensor, chunk: int = DEFAULT_CHUNK):
    """Mean CE of ``unembed(hidden)`` against ``target``, never holding more than ``chunk``
    rows of logits (see ``unembed.target_log_probs``).

    hidden [B, T, H], target [B, T] -> (mean loss [], {"top1", "top5", "count"}; no rates when
    hits are not counted: ``unembed.hits_counted``).
    """
    h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    t = target.reshape(-1)  # [N]
    keep = (t != IGNORE).nonzero().squeeze(-1)
    h, t = h.index_select(0, keep), t.index_select(0, keep)  # only real targets cost an unembedding
    logp, hits = target_log_probs(unembed, h, t, chunk)
    count = max(int(t.shape[0]), 1)
    rates = {} if hits is None else dict(zip(("top1", "top5"), (hits.float() / count).tolist()))
    return -logp.sum() / count, {**rates, "count": int(t.shape[0])}


def head_metrics(head: int, loss: torch.Tensor, m: dict) -> dict[str, float]:
    """``head{i}/loss`` and, where hits were counted, ``head{i}/top1`` / ``top5``."""
    return {f"head{head}/loss": loss.item(), **{f"head{head}/{k}": m[k] for k in ("top1", "top5") if k in m}}


class HeadAdapter(nn.Module):
    """Base class. Subclasses build their modules in ``__init__(config, backbone)`` (shapes and
    initial values only: no I/O, no freezing) and implement ``hidden``; CP-style heads whose
    distribution is not one softmax override ``log_probs`` and ``loss``."""

    needs_layer_states = False  # WHS reads every trunk layer's output
    head1_is_base = True  # False only for variants that replace head 1 on purpose
    # Drafts tokens 2..n one at a time, each conditioned on the ones before
    # (``conditional_log_probs(e, prefix)``, CP's eqs. 11-13); others draft each head independently.
    supports_sequential_drafts = False
    # Reads ``Features.next_ids`` (the token at t+1): the pipeline fills it only for such heads.
    needs_next_tokens = False

    def __init__(self, config, backbone):
        super().__init__()
        self.config = config  # checked by registry.check_config (make_config, build_head)
        self.backbone = backbone  # plain attribute (not an nn.Module): base weights stay out of state_dict

    @property
    def n_future(self) -> int:
        return self.config.n_future

    def hidden(self, index: int, feats: Features, cache=None) -> torch.Tensor:
        """Normalised hidden state of head ``index`` (0-based) # [B, T, H]. ``cache``: when
        decoding, the KV cache of the head's own layer (``layer_slot(index)`` not None), which
        ``feats`` then extends by the new positions only; None otherwise."""
        raise NotImplementedError

    def log_probs(self, index: int, feats: Features, last_only: bool = False) -> torch.Tensor:
        """Log-distribution of token t+index+1 at every position # [B, T, V] ([B, 1, V])."""
        h = self.hidden(index, feats)  # [B, T, H]: layer heads need the whole sequence
        if last_only:
            h = h[:, -1:]
        return torch.log_softmax(self.backbone.logits(h).float(), dim=-1)

    def copied_parameter_names(self) -> set[str]:
        """Names of parameters initialised as copies of base weights (DynaMo trains them at LR_B)."""
        return set()

    # Incremental decoding ---------------------------------------------------------------
    num_head_layers = 0  # transformer layers of the heads' own: each needs a KV cache when decoding

    def layer_slot(self, index: int) -> int | None:
        """Which head layer (and KV cache) head ``index`` runs, or None when it reads one
        position only (base path, Medusa, CP): those need no cache of their own."""
        return None

    def loss(self, feats: Features, input_ids: torch.Tensor, valid: torch.Tensor, chunk: int,
             skip_constant: bool = False) -> LossOutput:
        """Independent heads: one cross-entropy per head, computed head by head.

        ``skip_constant``: under autograd, a head whose hidden state carries no gradient (head 1
        of a frozen base) is not scored (``per_head`` None, no metrics): its unembedding would
        only feed the logs, about a fifth of a heads-only step at n = 3."""
        per_head, metrics = [], {}
        for i in range(self.n_future):
            hidden = self.hidden(i, feats)  # [B, T, H]
            if skip_constant and torch.is_grad_enabled() and not hidden.requires_grad:
                per_head.append(None)
                continue
            tgt = shifted_targets(input_ids, valid, i + 1)  # [B, T]
            ce, m = chunked_cross_entropy(self.backbone.unembedding, hidden, tgt, chunk)
            per_head.append(ce)
            metrics.update(head_metrics(i + 1, ce, m))
        return LossOutput(per_head=per_head, aux=None, metrics=metrics)


def head_dtype(backbone) -> torch.dtype:
    """Heads compute in the backbone's compute dtype (a quantized backbone's too)."""
    return resolve_dtype(backbone.load_config.dtype)
