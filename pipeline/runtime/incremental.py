"""Incremental forward passes for decoding: explicit KV caches for the backbone and every head layer.

``MultiTokenModel.step(new_ids, caches)`` runs only the new tokens: the trunk and the original
final layer read and extend the backbone cache; each head layer (replicated / WHS heads) reads and
extends its own cache. Every cache always covers the same positions, so one ``LayerContext``
(mask, positions, rotary) serves all of them, and cropping removes the same suffix everywhere.
Everything goes through ``Backbone.run_layer`` / ``layer_context``: no patched transformers code.
On the CPU's lean path each cache is a ``kv_cache.GrowingCache`` (written in place, no copy of the
cache per step), elsewhere transformers' ``DynamicCache``: both behind the same interface.

Batches (``decoding.engine``): rows of different lengths share the slot axis; ``DecodeCaches.valid``
marks per row which slots hold its tokens (None: every slot, every row: the batch-1 fast path).
``pipeline/runtime/ragged.py`` explains the layout and why holes are masked, not compacted per step.
Batched trees: ``step`` takes a tree per row (``attend`` [B, T, T], ``offsets`` [B, T]).
After a step ``DecodeCaches.keep`` keeps each row's accepted slots (the rest of its step become
holes, or are cropped), ``keep_rows`` the rows still decoding: all decoding asks of the caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from multitoken.adapters.base import Features
from multitoken.pipeline.model.attention import takes_sdpa_masks
from multitoken.pipeline.model.backbone import LayerContext
from multitoken.pipeline.runtime import ragged
from multitoken.pipeline.runtime.kv_cache import GrowingCache, GrowingLayer
from multitoken.pipeline.runtime.step_output import StepOutput


def _new_cache(bb):
    """A layer's KV cache for ``bb``: written in place (``kv_cache.GrowingCache``) where its layers
    run their lean forward on the CPU, the case its bits are checked for; else transformers' own."""
    if bb.lean.runs_on(bb.device):
        return GrowingCache()
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
    length: int = 0  # slots (positions when no row has holes)
    valid: np.ndarray | None = None  # [B, length] bool, host: slot holds a token of the row (None: all)
    compactions: int = 0  # gathers done (``ragged.should_compact``)
    draft: torch.nn.Module | None = None  # the layer heads' unembedding over a draft vocabulary (None: all of it)

    def keep(self, start: int, slots: list[list[int]]) -> None:
        """The one primitive decoding uses after a step: row b keeps the step's slots
        ``start + slots[b]`` (its committed tokens and its kept path, in order, from its first
        slot of the step) and forgets its other slots there. One row without holes: a prefix is
        cropped, a tree path compacted in place; several rows: a prefix is kept by masking the
        rest (holes), other paths are gathered to the front of the step."""
        if len(slots) == 1 and self.valid is None:
            return self._keep_path(start, slots[0])
        width = self.length - start
        if all(s == list(range(s[0], s[0] + len(s))) for s in slots):
            self._crop_rows([width - 1 - s[-1] for s in slots])
        else:
            self._keep_paths(start, slots)
        self._compact_if_sparse()

    def _crop(self, remove: int) -> None:
        """Drop the last ``remove`` positions (rejected drafts) from every cache."""
        if remove <= 0:
            return
        for cache in (self.backbone, *self.heads):
            cache.crop(-remove)  # transformers 5: a negative count removes that many positions
        self.length -= remove
        if self.valid is not None:
            self.valid = self.valid[:, : self.length]

    # Ragged rows (batched decoding; ragged.py) ------------------------------------------------
    def row_lengths(self, rows: int) -> list[int]:
        """Tokens held per row (its next position)."""
        return [self.length] * rows if self.valid is None else self.valid.sum(1).tolist()

    def _crop_rows(self, remove: list[int]) -> None:
        """Forget the last ``remove[b]`` slots of row b (its rejected drafts, right after the step
        that fed them): the suffix every row drops is cropped, the rest become holes."""
        if len(set(remove)) == 1 and self.valid is None:
            return self._crop(remove[0])
        valid = self._valid_array(len(remove))
        for row, r in enumerate(remove):
            if r > 0:
                valid[row, self.length - r:] = False
        self.valid = valid
        self._crop(ragged.trailing_holes(valid))
        self._settle()

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only batch rows ``rows``, in that order (finished rows leave: they cost nothing afterwards)."""
        device = next((layer.keys.device for layer in self.backbone.layers if getattr(layer, "keys", None) is not None), "cpu")
        index = torch.tensor(rows, dtype=torch.long).to(device)  # one copy to the device for every layer
        for cache in (self.backbone, *self.heads):
            for layer in cache.layers:  # a growing layer keeps its rows in place; others take a gather
                if isinstance(layer, GrowingLayer):
                    layer.keep_rows(rows)
                elif getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
                    layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        if self.valid is not None:
            self.valid = self.valid[rows]
            lead = ragged.leading_holes(self.valid)  # left pads only the dropped rows needed
            if lead:
                for cache in (self.backbone, *self.heads):
                    ragged.map_layers(cache, lambda x: x[:, :, lead:])
                self.valid, self.length = self.valid[:, lead:], self.length - lead
            self._settle()
        self._compact_if_sparse()

    def _compact_if_sparse(self) -> None:
        """Gather every row's tokens to the end of a slot axis as long as the longest row, when
        holes have made it much longer (``ragged.should_compact``)."""
        if self.valid is None or not ragged.should_compact(self.valid):
            return
        index, self.valid = ragged.compact_index(self.valid)
        for cache in (self.backbone, *self.heads):
            device = next((layer.keys.device for layer in cache.layers if getattr(layer, "keys", None) is not None), None)
            if device is not None:
                ragged.map_layers(cache, ragged.gather_slots(torch.from_numpy(index).to(device)))
        self.length = self.valid.shape[1]
        self.compactions += 1
        self._settle()

    def _valid_array(self, rows: int) -> np.ndarray:
        return np.ones((rows, self.length), dtype=bool) if self.valid is None else self.valid.copy()

    def _settle(self) -> None:
        """No holes left: back to the unmasked layout (batch 1's fast path)."""
        if self.valid is not None and self.valid.all():
            self.valid = None

    @torch.no_grad()
    def _keep_path(self, start: int, rows: list[int]) -> None:
        """One row without holes: keep positions [0, start) and ``start + rows`` (in that order)
        in every cache, forget the rest (a tree's accepted path, compacted in place); a prefix
        0..m-1 is a plain crop."""
        m = len(rows)
        if rows == list(range(m)):
            self._crop(self.length - start - m)
            return
        index = torch.tensor(rows, dtype=torch.long) + start  # [m]
        for cache in (self.backbone, *self.heads):
            for layer in cache.layers:
                if not getattr(layer, "is_initialized", False) or layer.keys is None or layer.keys.numel() == 0:
                    continue  # a head cache's unused slots
                sel = index.to(layer.keys.device)
                # the right side is gathered first (a copy): overlapping slots are safe
                layer.keys[..., start:start + m, :] = layer.keys.index_select(-2, sel)
                layer.values[..., start:start + m, :] = layer.values.index_select(-2, sel)
                layer.keys, layer.values = layer.keys[..., :start + m, :], layer.values[..., :start + m, :]
        self.length = start + m

    @torch.no_grad()
    def _keep_paths(self, start: int, paths: list[list[int]]) -> None:
        """Batched trees: row b keeps the step's slots ``start + paths[b]`` (its accepted path,
        in order) as its first ``len(paths[b])`` slots after ``start``; its other slots there
        become holes, and the suffix that is a hole in every row is cropped. One gather over
        the step's slots per cache layer, right after the step that fed them."""
        index, kept = ragged.path_index(paths)  # [B, M], [B, M]
        width = index.shape[1]
        for cache in (self.backbone, *self.heads):
            device = next((layer.keys.device for layer in cache.layers if getattr(layer, "keys", None) is not None), None)
            if device is not None:
                ragged.map_layers(cache, _gather_step(start, torch.from_numpy(index).to(device)))
        valid = self._valid_array(len(paths))[:, :start + width]
        valid[:, start:] = kept
        self.valid, self.length = valid, start + width
        self._settle()


def _gather_step(start: int, index: torch.Tensor):
    """``fn`` for ``ragged.map_layers``: keys/values [B, heads, S, d] -> [B, heads, start + M, d],
    the slots after ``start`` replaced by row b's slots ``start + index[b]`` (gathered first, a
    copy: overlapping slots are safe)."""
    gather = ragged.gather_slots(index)

    def fn(x: torch.Tensor) -> torch.Tensor:
        m = index.shape[1]
        x[:, :, start:start + m] = gather(x[:, :, start:])
        return x[:, :, :start + m]
    return fn


def new_caches(model, draft: torch.nn.Module | None = None) -> DecodeCaches:
    bb = model.backbone
    return DecodeCaches(backbone=_new_cache(bb), heads=[_new_cache(bb) for _ in range(model.heads.num_head_layers)], draft=draft)


def _tree_context(bb, hidden: torch.Tensor, caches: DecodeCaches, attend: torch.Tensor, offsets: torch.Tensor):
    """The context of T new tokens that see the cached positions and, among themselves, only
    ``attend`` [T, T] (True = row t sees token s), at positions ``caches.length + offsets`` [T]."""
    past, t = caches.length, hidden.shape[1]
    attend = attend.to(hidden.device)
    full = torch.cat([torch.ones(t, past, dtype=torch.bool, device=hidden.device), attend], dim=1)  # [T, past + T]
    position_ids = (offsets.to(hidden.device) + past).unsqueeze(0)  # [1, T]
    return bb.explicit_context(hidden, full, position_ids)


def _layer_context(bb, hidden: torch.Tensor, caches: DecodeCaches, lengths: list[int] | None = None):
    """Mask, positions and rotary for the T new tokens after ``caches.length`` cached ones
    (batch 1, no padding). One token attends to everything: no mask. Several tokens under SDPA
    get the boolean causal mask transformers' builder would return ([1, 1, T, past + T], True =
    attend), built directly: the generic builder is a measurable share of a small model's
    verification step. Other attention kernels go through the builder."""
    past, t = caches.length, hidden.shape[1]
    if caches.valid is not None or (lengths is not None and min(lengths) < t):
        return ragged.ragged_context(bb, hidden, caches.valid, past, ragged.step_valid(lengths or [t] * hidden.shape[0], t))
    if t > 1 and not takes_sdpa_masks(bb.config):
        return bb.layer_context(hidden, None, caches.backbone)
    position_ids = torch.arange(past, past + t, device=hidden.device).unsqueeze(0)  # [1, T]
    mask = None
    if t > 1:
        keys = torch.arange(past + t, device=hidden.device)
        mask = (keys[None, :] <= position_ids[0, :, None])[None, None]  # [1, 1, T, past + T]
    rotary = bb.rotary_emb(hidden, position_ids=position_ids)
    return LayerContext(mask=mask, position_ids=position_ids, position_embeddings=rotary)


def _run_backbone(model, hidden: torch.Tensor, ctx, caches: DecodeCaches) -> Features:
    """The backbone's layers and final norm over the new positions # -> Features."""
    bb, states = model.backbone, []
    every = model.heads.needs_layer_states
    norm = bb.final_norm
    if (ran := bb.lean.run_rows(bb.layers, hidden, ctx, caches.backbone, every, norm)) is not None:  # one op, one sequence
        outs, base = ran  # base: the final norm's output where the op applied it
        return Features(trunk=outs[-2], base=norm(outs[-1]) if base is None else base,
                        layer_states=tuple(outs[:-1]) if every else (), ctx=ctx)
    for layer in bb.layers[:-1]:
        hidden = bb.run_layer(layer, hidden, ctx, caches.backbone)
        if model.heads.needs_layer_states:
            states.append(hidden)
    base = norm(bb.run_layer(bb.layers[-1], hidden, ctx, caches.backbone))  # [B, T, H]
    return Features(trunk=hidden, base=base, layer_states=tuple(states), ctx=ctx)


def _run_heads(model, feats: Features, caches: DecodeCaches, heads_upto: int | None) -> dict[int, torch.Tensor]:
    """The head layers up to ``heads_upto`` # -> {head: [B, T, H]}."""
    heads, hiddens = model.heads, {}
    for index in range(heads.n_future if heads_upto is None else min(heads_upto, heads.n_future)):
        slot = heads.layer_slot(index)
        if slot is not None:  # layer heads attend over the sequence: run them on every new position
            hiddens[index] = heads.hidden(index, feats, cache=caches.heads[slot])
    return hiddens


def _conditioned_heads(model, feats: Features, new_ids: torch.Tensor, caches: DecodeCaches, heads_upto: int | None):
    """The head layers of a pass that deferred them (``step(defer_heads=True)``), as a function
    of token t+1 after its last position # tokens [B] -> {head: [B, T, H]}: every earlier
    position reads the step's own next token (settled text), the last reads ``tokens``."""
    def run(tokens: torch.Tensor) -> dict[int, torch.Tensor]:
        feats.next_ids = torch.cat([new_ids[:, 1:], tokens.reshape(-1, 1).to(new_ids.device)], dim=1)  # [B, T]
        with model.backbone.masked_gqa(feats.ctx, new_ids.device):
            return _run_heads(model, feats, caches, heads_upto)
    return run


def next_ids(new_ids: torch.Tensor, base_argmax: torch.Tensor, first: int) -> torch.Tensor:
    """Token t+1 after each new position # [B, T]: the step's own next token before ``first``
    (a prompt's, known), the base model's argmax from ``first`` on (``base_argmax`` [B, T - first]):
    in greedy decoding the very token committed there."""
    return torch.cat([new_ids[:, 1:first + 1], base_argmax], dim=1)


@torch.no_grad()
def step(model, new_ids: torch.Tensor, caches: DecodeCaches, heads_upto: int | None = None,
         read_from: int = 0, lengths: list[int] | None = None, attend: torch.Tensor | None = None,
         offsets: torch.Tensor | None = None, clock=None, defer_heads: bool = False) -> StepOutput:
    """Run ``new_ids`` [B, T] after the ``caches.length`` cached positions; extend every cache.
    ``heads_upto``: run only heads < heads_upto (e.g. 1 for plain one-token decoding: no head
    layer runs); a run must use the same value throughout, its head caches cover those heads only.
    ``read_from``: the first position whose distributions will be read (a prompt's last); the
    positions before it are settled: heads that read token t+1 take it from ``new_ids`` there,
    and the base's argmax from ``read_from`` on (``next_ids``).
    ``lengths``: tokens per row, right-aligned in ``new_ids`` (the rest are pads; None: all T).
    ``attend`` [T, T] bool and ``offsets`` [T] long (both or neither): which new tokens each new
    token sees and their positions after the cached ones (a candidate tree: ancestors and
    depth; batch size 1); or [B, T, T] and [B, T]: a tree per row, its nodes its last
    ``lengths[b]`` slots (``ragged.tree_context``); None = causal, consecutive.
    ``defer_heads``: heads that read token t+1 do not run in the pass; the caller names the
    token after the last position (DynaMo's sampled t+1) through ``StepOutput.condition``, which
    runs them and extends their caches (it must, before the next step)."""
    bb = model.backbone
    hidden = bb.embeddings(new_ids)  # [B, T, H]
    if attend is not None and attend.dim() == 3:  # per-row trees (batched), right-aligned after pads
        ctx = ragged.tree_context(bb, hidden, caches.valid, caches.length,
                                  ragged.step_valid(lengths or [new_ids.shape[1]] * new_ids.shape[0], new_ids.shape[1]),
                                  attend, offsets)
    elif attend is not None:
        ctx = _tree_context(bb, hidden, caches, attend, offsets)
    else:
        ctx = _layer_context(bb, hidden, caches, lengths)
    with bb.masked_gqa(ctx, hidden.device):  # a multi-token pass reads grouped KV heads in place
        feats = _run_backbone(model, hidden, ctx, caches)
        out = StepOutput(model, feats, {}, first=read_from, clock=clock, draft=caches.draft)
        conditioned = model.heads.needs_next_tokens and heads_upto != 1
        if conditioned and defer_heads:
            out.defer(_conditioned_heads(model, feats, new_ids, caches, heads_upto))
        else:
            if conditioned:  # the head layers read token t+1: base logits first
                feats.next_ids = next_ids(new_ids, out.base_argmax(), read_from)
                out.model_s = 0.0  # unembedded inside the step: in the caller's time of the step already
            out.hiddens = _run_heads(model, feats, caches, heads_upto)
    if caches.valid is not None or (lengths is not None and min(lengths) < new_ids.shape[1]):
        new_valid = ragged.step_valid(lengths or [new_ids.shape[1]] * new_ids.shape[0], new_ids.shape[1])
        caches.valid = np.concatenate([caches._valid_array(new_ids.shape[0]), new_valid], axis=1)
    caches.length += new_ids.shape[1]
    return out
