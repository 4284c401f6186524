"""Incremental forward passes for decoding: explicit KV caches for the backbone and every head layer.

``MultiTokenModel.step(new_ids, caches)`` runs only the new tokens: the trunk and the original
final layer read and extend the backbone cache; each head layer (replicated / WHS heads) reads and
extends its own cache. Every cache always covers the same positions, so one ``LayerContext``
(mask, positions, rotary) serves all of them, and cropping removes the same suffix everywhere.
Everything goes through ``Backbone.run_layer`` / ``layer_context``: no patched transformers code.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from multitoken.adapters.base import Features
from multitoken.pipeline.model.backbone import LayerContext
from multitoken.pipeline.model.unembed_plan import LINEAR, TRANSPOSED, apply, plan_for


def _new_cache():
    from transformers import DynamicCache

    return DynamicCache()


@dataclass
class DecodeCaches:
    """KV caches of one decoding run. ``length`` = positions held by every cache.

    A head layer keeps the final layer's index (it is built as its replica), so it writes to that
    slot of its *own* cache; that cache's other slots stay empty, hence ``length`` is tracked here.
    """

    backbone: object
    heads: list = field(default_factory=list)
    length: int = 0

    def crop(self, remove: int) -> None:
        """Drop the last ``remove`` positions (rejected drafts) from every cache."""
        if remove <= 0:
            return
        for cache in (self.backbone, *self.heads):
            cache.crop(-remove)  # transformers 5: a negative count removes that many positions
        self.length -= remove


def new_caches(model) -> DecodeCaches:
    return DecodeCaches(backbone=_new_cache(), heads=[_new_cache() for _ in range(model.heads.num_head_layers)])


def unembed(bb, rows: torch.Tensor) -> torch.Tensor:
    """Logits of ``rows`` [B, R, H] # -> [B, R, V], in the form the backbone's unembedding plan
    measured cheaper for B * R rows (``unembed_plan.py``: F.linear, or on the CPU (W x^T)^T for
    a plain Linear; one row always through the module). Neither form is bit-identical to
    1-row calls for R > 1 (nor is the other): the logits agree to float rounding, which is all
    the greedy argmax of a model's own forward can promise."""
    head = bb.unembedding
    flat = rows.reshape(-1, rows.shape[-1])  # [B * R, H]
    if plan_for(head, flat).form(flat.shape[0]) == LINEAR:
        return head(rows)  # the module itself, as transformers computes logits
    return apply(head, flat, TRANSPOSED).reshape(*rows.shape[:-1], -1)


class StepOutput:
    """One incremental pass over T new tokens. Distributions are computed on demand, and only the
    rows the decoder reads are unembedded: the base after every position (verification reads all
    of them, argmax decoding the last) and the layer heads at one position (the anchor the next
    proposal starts from, known only after acceptance). When one call over the base and head
    rows at every position costs no more than two calls (the unembedding plan: on an
    accelerator always; on the CPU measured per shape, dtype and threads) they go in one call;
    otherwise the base rows go first and the head rows at the anchor in a second call.
    Log-softmax only for rows read. ``model_s`` accumulates the time spent here (model time, not
    decoding logic), read by ``clock`` (the loop's, which synchronises an accelerator when
    profiling); ``unembed_rows`` counts rows per call made here (one-position heads, Medusa and
    CP, unembed their single row inside the adapter, per head or per CP expert: not counted)."""

    clock = staticmethod(time.perf_counter)

    def __init__(self, model, feats: Features, hiddens: dict[int, torch.Tensor], first: int = 0):
        self.model = model
        self.feats = feats
        self.hiddens = hiddens  # head index -> [B, T, H] normalised (layer heads only)
        self.first = first  # positions before it are never read: no logits for them (a prompt's)
        self.model_s = 0.0
        self.unembed_rows: Counter = Counter()  # rows per unembedding call -> calls
        self._base = self._logits = None
        self._head_logits: dict[int, dict[int, torch.Tensor]] = {}  # position -> head -> [B, V]

    @property
    def length(self) -> int:
        return self.feats.base.shape[1]

    def base_logits(self) -> torch.Tensor:
        """Base (head 1) logits after positions first..T-1 # [B, T - first, V]: all argmax
        decoding reads."""
        if self._logits is None:
            self._unembed_base()
        return self._logits

    def _unembed(self, rows: torch.Tensor) -> torch.Tensor:
        """One unembedding call, timed and counted # [B, R, H] -> [B, R, V]."""
        start = self.clock()
        logits = unembed(self.model.backbone, rows)
        self.model_s += self.clock() - start
        self.unembed_rows[rows.shape[0] * rows.shape[1]] += 1
        return logits

    def _unembed_base(self) -> None:
        """The base rows, with every head's rows in the same call when that is the cheaper plan."""
        heads, t = sorted(self.hiddens), self.length - self.first
        plan = plan_for(self.model.backbone.unembedding, self.feats.base)
        if not heads or not plan.joint(t * (1 + len(heads)), t, len(heads)):
            self._logits = self._unembed(self.feats.base[:, self.first:])  # [B, T - first, V]
            return
        read = [self.feats.base] + [self.hiddens[i] for i in heads]  # (1 + L) x [B, T, H]
        parts = self._unembed(torch.cat([h[:, self.first:] for h in read], dim=1)).split(t, dim=1)
        self._logits = parts[0]
        for pos in range(self.first, self.length):
            self._head_logits[pos] = {i: part[:, pos - self.first] for i, part in zip(heads, parts[1:])}

    def _head_row(self, index: int, pos: int) -> torch.Tensor:
        """Logits of layer head ``index`` at ``pos`` # [B, V]; the first read at ``pos``
        unembeds every layer head there in one call."""
        if self._logits is None:
            self._unembed_base()  # the base is always read first; this may bring the heads along
        if pos not in self._head_logits:
            heads = sorted(self.hiddens)
            logits = self._unembed(torch.cat([self.hiddens[i][:, pos:pos + 1] for i in heads], dim=1))  # [B, L, V]
            self._head_logits[pos] = {i: logits[:, j] for j, i in enumerate(heads)}
        return self._head_logits[pos][index]

    def base_log_probs(self) -> torch.Tensor:
        """Base (head 1) log-distribution after positions first..T-1 # [B, T - first, V] float32."""
        if self._base is None:
            logits = self.base_logits()
            start = self.clock()
            self._base = torch.log_softmax(logits.float(), dim=-1)
            self.model_s += self.clock() - start
        return self._base

    def head_log_probs(self, index: int, pos: int) -> torch.Tensor:
        """Log-distribution of head ``index`` at position ``pos`` # [B, V] float32. Head 0 is the
        base path unless an adapter replaces it on purpose (WHS ``all_heads``)."""
        if pos < self.first:
            raise ValueError(f"position {pos} was not kept: this pass computes logits from position {self.first} on")
        if index == 0 and index not in self.hiddens:
            return self.base_log_probs()[:, pos - self.first]
        if index in self.hiddens:
            logits = self._head_row(index, pos)
        start = self.clock()
        if index in self.hiddens:
            out = torch.log_softmax(logits.float(), dim=-1)
        else:  # one-position heads (Medusa, CP) read only this position's base hidden state
            f = self.feats
            sliced = Features(f.trunk[:, pos:pos + 1], f.base[:, pos:pos + 1], (), f.ctx)
            out = self.model.heads.log_probs(index, sliced)[:, 0]
        self.model_s += self.clock() - start
        return out

    def anchor_hidden(self, pos: int) -> torch.Tensor:
        """Base hidden state at ``pos`` (what CP experts condition on) # [B, H]."""
        return self.feats.base[:, pos]


def _layer_context(bb, hidden: torch.Tensor, caches: DecodeCaches):
    """Mask, positions and rotary for the T new tokens after ``caches.length`` cached ones
    (batch 1, no padding). One token attends to everything: no mask. Several tokens under SDPA
    get the boolean causal mask transformers' builder would return ([1, 1, T, past + T], True =
    attend), built directly: the generic builder is a measurable share of a small model's
    verification step. Other attention kernels go through the builder."""
    past, t = caches.length, hidden.shape[1]
    if t > 1 and bb.config._attn_implementation != "sdpa":
        return bb.layer_context(hidden, None, caches.backbone)
    position_ids = torch.arange(past, past + t, device=hidden.device).unsqueeze(0)  # [1, T]
    mask = None
    if t > 1:
        keys = torch.arange(past + t, device=hidden.device)
        mask = (keys[None, :] <= position_ids[0, :, None])[None, None]  # [1, 1, T, past + T]
    rotary = bb.rotary_emb(hidden, position_ids=position_ids)
    return LayerContext(mask=mask, position_ids=position_ids, position_embeddings=rotary)


def _run_layers(model, hidden: torch.Tensor, ctx, caches: DecodeCaches, heads_upto: int | None):
    """The backbone's layers, then the head layers up to ``heads_upto`` # -> (Features, {head: [B, T, H]})."""
    bb, heads = model.backbone, model.heads
    states = []
    for layer in bb.layers[:-1]:
        hidden = bb.run_layer(layer, hidden, ctx, caches.backbone)
        if heads.needs_layer_states:
            states.append(hidden)
    base = bb.final_norm(bb.run_layer(bb.layers[-1], hidden, ctx, caches.backbone))  # [B, T, H]
    feats = Features(trunk=hidden, base=base, layer_states=tuple(states), ctx=ctx)
    hiddens = {}
    for index in range(heads.n_future if heads_upto is None else min(heads_upto, heads.n_future)):
        slot = heads.layer_slot(index)
        if slot is not None:  # layer heads attend over the sequence: run them on every new position
            hiddens[index] = heads.hidden(index, feats, cache=caches.heads[slot])
    return feats, hiddens


@torch.no_grad()
def step(model, new_ids: torch.Tensor, caches: DecodeCaches, heads_upto: int | None = None,
         read_from: int = 0) -> StepOutput:
    """Run ``new_ids`` [B, T] after the ``caches.length`` cached positions; extend every cache.
    ``heads_upto``: run only heads < heads_upto (e.g. 1 for plain one-token decoding: no head
    layer runs); a run must use the same value throughout, its head caches cover those heads only.
    ``read_from``: the first position whose distributions will be read (a prompt's last)."""
    bb = model.backbone
    hidden = bb.embeddings(new_ids)  # [B, T, H]
    ctx = _layer_context(bb, hidden, caches)
    with bb.masked_gqa(ctx, hidden.device):  # a multi-token pass reads grouped KV heads in place
        feats, hiddens = _run_layers(model, hidden, ctx, caches, heads_upto)
    caches.length += new_ids.shape[1]
    return StepOutput(model, feats, hiddens, first=read_from)
