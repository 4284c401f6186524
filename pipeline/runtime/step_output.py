"""What one incremental pass hands the decoder: ``StepOutput`` computes distributions on demand
(only the rows the decoder reads are unembedded), and ``unembed``, the one unembedding call."""

from __future__ import annotations

import time
from collections import Counter

import torch

from multitoken.adapters.base import Features
from multitoken.kernels import gemv_rows
from multitoken.kernels.cpu_linear import is_argmax_head
from multitoken.pipeline.runtime.unembed_costs import LINEAR, TRANSPOSED, apply, costs_for


def unembed(bb, rows: torch.Tensor) -> torch.Tensor:
    """Logits of ``rows`` [B, R, H] # -> [B, R, V], in the form the backbone's unembedding costs
    measured cheaper for B * R rows (``unembed_costs.py``: F.linear, or on the CPU (W x^T)^T for
    a plain Linear; one row always through the module). Neither form is bit-identical to
    1-row calls for R > 1 (nor is the other): the logits agree to float rounding, which is all
    the greedy argmax of a model's own forward can promise."""
    head = bb.unembedding
    flat = rows.reshape(-1, rows.shape[-1])  # [B * R, H]
    if costs_for(head, flat).form(flat.shape[0]) == LINEAR:
        # the module itself, as transformers computes logits, on the rows flattened: matmul folds
        # contiguous rows into this same product, but a batch's slice of positions into a bmm
        # against the weight expanded (copied) once per batch row
        return head(flat).reshape(*rows.shape[:-1], -1)
    return apply(head, flat, TRANSPOSED).reshape(*rows.shape[:-1], -1)


class StepOutput:
    """One incremental pass over T new tokens. Distributions are computed on demand, and only the
    rows the decoder reads are unembedded: the base after every position (verification reads all
    of them, argmax decoding the last) and the layer heads at one position (the anchor the next
    proposal starts from, known only after acceptance). When one call over the base and head
    rows at every position costs no more than two calls (the unembedding's costs: on an
    accelerator always; on the CPU measured per shape, dtype and threads) they go in one call;
    otherwise the base rows go first and the head rows at the anchor in a second call.
    Log-softmax only for rows read. ``model_s`` accumulates the time spent here (model time, not
    decoding logic), read by ``clock`` (the loop's, which synchronises an accelerator when
    profiling); ``unembed_rows`` counts rows per call made here (one-position heads, Medusa and
    CP, unembed their single row inside the adapter, per head or per CP expert: not counted)."""

    def __init__(self, model, feats: Features, hiddens: dict[int, torch.Tensor], first: int = 0, clock=None,
                 draft: torch.nn.Module | None = None):
        self.model = model
        self.draft = draft  # layer heads' rows over a draft vocabulary (draft_vocab.py); None: the whole one
        self.clock = clock or time.perf_counter  # the decoder's (it synchronises an accelerator when profiling)
        self.feats = feats
        self.hiddens = hiddens  # head index -> [B, T, H] normalised (layer heads only)
        self.first = first  # positions before it are never read: no logits for them (a prompt's)
        self.model_s = 0.0
        self.unembed_rows: Counter = Counter()  # rows per unembedding call -> calls
        self._base = self._logits = self._argmax = None
        self._head_logits: dict[int, dict[int, torch.Tensor]] = {}  # position -> head -> [B, V]
        self._head_argmax: dict[tuple, dict[int, torch.Tensor] | None] = {}  # anchors -> head -> [B] (None: not screened)
        self._deferred = None  # the head layers a pass left to ``condition`` (tokens [B] -> hiddens)

    def defer(self, run_heads) -> None:
        """The pass left its head layers to ``condition`` (``step(defer_heads=True)``)."""
        self._deferred = run_heads

    def condition(self, tokens: torch.Tensor) -> None:
        """Run the head layers the pass deferred, reading ``tokens`` [B] (long) as the token
        after each row's last position (DynaMo's sampled t+1), and extend their caches: from
        here the heads' distributions at that position are conditioned on it. Once per pass."""
        if self._deferred is None:
            raise RuntimeError("this pass ran its heads already (condition needs step(defer_heads=True), once)")
        start = self.clock()
        self.hiddens, self._deferred = self._deferred(tokens), None
        self.model_s += self.clock() - start

    @property
    def length(self) -> int:
        return self.feats.base.shape[1]

    def base_logits(self) -> torch.Tensor:
        """Base (head 1) logits after positions first..T-1 # [B, T - first, V]: all argmax
        decoding reads."""
        if self._logits is None:
            self._unembed_base()
        return self._logits

    def base_argmax(self) -> torch.Tensor:
        """The base's argmax after positions first..T-1 # [B, T - first] long: all greedy decoding
        without a repetition penalty reads. Where the unembedding screens it (the rows kernel,
        ``PackedLinear.argmax``: the same argmax, bit for bit, mostly from an int8 copy) no logits
        are made; otherwise the logits' argmax."""
        if self._argmax is None:
            if self._logits is None:
                self._argmax = self._screen(self.model.backbone.unembedding, self.feats.base[:, self.first:])
            if self._argmax is None:
                self._argmax = _first_max(self.base_logits())
        return self._argmax

    def _screen(self, unembedding: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor | None:
        """The argmax of ``unembedding``'s logits of ``rows`` [B, R, H] # -> [B, R] token ids,
        through its argmax screen (the rows kernel's), timed, and counted as a call over the whole
        vocabulary (``_unembed``'s rule); None where it has none, or where the unembedding's
        measured costs find the logits cheaper for this many rows."""
        if not is_argmax_head(unembedding):
            return None
        whole = unembedding is self.model.backbone.unembedding  # a draft vocabulary's has no measured costs
        if whole and not costs_for(unembedding, rows).screens(rows.shape[0] * rows.shape[1]):
            return None
        start = self.clock()
        best = unembedding.argmax(rows)
        self.model_s += self.clock() - start
        if best is not None and whole:
            self.unembed_rows[rows.shape[0] * rows.shape[1]] += 1
        return best

    def _unembed(self, rows: torch.Tensor, draft: bool = False) -> torch.Tensor:
        """One unembedding call, timed and counted # [B, R, H] -> [B, R, V]; ``draft``: head
        rows, over the draft vocabulary when there is one (not counted: not the whole matrix)."""
        start = self.clock()
        if draft and self.draft is not None:
            logits = self.draft(rows)
        else:
            logits = unembed(self.model.backbone, rows)
            self.unembed_rows[rows.shape[0] * rows.shape[1]] += 1
        self.model_s += self.clock() - start
        return logits

    def _unembed_base(self) -> None:
        """The base rows, with every head's rows in the same call when that costs no more."""
        heads, t = sorted(self.hiddens), self.length - self.first
        costs = costs_for(self.model.backbone.unembedding, self.feats.base)
        b = self.feats.base.shape[0]  # a call unembeds every batch row: the costs price b x rows
        if not heads or self.draft is not None or not costs.one_call(b * t * (1 + len(heads)), b * t, b * len(heads)):
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
        if self._logits is None and self._argmax is None:
            self._unembed_base()  # the base is always read first; this may bring the heads along
        if pos not in self._head_logits:
            heads = sorted(self.hiddens)
            logits = self._unembed(torch.cat([self.hiddens[i][:, pos:pos + 1] for i in heads], dim=1), draft=True)  # [B, L, V]
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

    def anchor_head_argmax(self, index: int, anchors: tuple[int, ...]) -> torch.Tensor:
        """Layer head ``index``'s argmax at each row's anchor # [B] long (greedy drafts read no
        more): every layer head's in one screened call where their unembedding has the argmax
        screen (the rows kernel), else the logits' argmax."""
        if anchors not in self._head_argmax:
            self._head_argmax[anchors] = self._screened_heads(anchors)
        found = self._head_argmax[anchors]
        return found[index] if found is not None else self.anchor_head_logits(index, anchors).argmax(-1)

    def _screened_heads(self, anchors: tuple[int, ...]) -> dict[int, torch.Tensor] | None:
        if len(set(anchors)) == 1 and anchors[0] in self._head_logits:
            return None  # their logits came with the base's call: read those
        heads = sorted(self.hiddens)
        rows = torch.cat([self.at(self.hiddens[i], anchors) for i in heads], dim=1)  # [B, L, H]
        best = self._screen(self.draft if self.draft is not None else self.model.backbone.unembedding, rows)  # [B, L]
        return None if best is None else {i: best[:, j] for j, i in enumerate(heads)}

    # Batched decoding: every row reads its heads at its own anchor --------------------------
    def at(self, x: torch.Tensor, anchors: tuple[int, ...]) -> torch.Tensor:
        """Row b of ``x`` [B, T, ...] at position anchors[b] # -> [B, 1, ...]."""
        if len(set(anchors)) == 1:
            return x[:, anchors[0]:anchors[0] + 1]
        index = torch.tensor(anchors, dtype=torch.long, device=x.device)
        return x[torch.arange(x.shape[0], device=x.device), index][:, None]

    def anchor_head_logits(self, index: int, anchors: tuple[int, ...]) -> torch.Tensor:
        """Layer head ``index``'s logits at each row's anchor # [B, V]; the first read unembeds
        every layer head there in one call."""
        if len(set(anchors)) == 1:  # one position for every row: the per-position path (it reuses the base's call)
            return self._head_row(index, anchors[0])
        key = ("logits", anchors)
        if key not in self._head_logits:
            heads = sorted(self.hiddens)
            logits = self._unembed(torch.cat([self.at(self.hiddens[i], anchors) for i in heads], dim=1), draft=True)  # [B, L, V]
            self._head_logits[key] = {i: logits[:, j] for j, i in enumerate(heads)}
        return self._head_logits[key][index]

    def anchor_head_log_probs(self, index: int, anchors: tuple[int, ...]) -> torch.Tensor:
        """``head_log_probs`` with each row at its own anchor # [B, V] float32."""
        if index == 0 and index not in self.hiddens:
            base = self.base_log_probs()
            return self.at(base, tuple(a - self.first for a in anchors))[:, 0]
        if index in self.hiddens:
            logits = self.anchor_head_logits(index, anchors)
        start = self.clock()
        if index in self.hiddens:
            out = torch.log_softmax(logits.float(), dim=-1)
        else:  # one-position heads: every row's anchor in one call
            f = self.feats
            sliced = Features(self.at(f.trunk, anchors), self.at(f.base, anchors), (), f.ctx)
            out = self.model.heads.log_probs(index, sliced)[:, 0]
        self.model_s += self.clock() - start
        return out


def _first_max(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax # [..., V] -> [...] long: max's indices (argmax's: the first maximum, a row's
    first NaN where it has one; its CPU reduction runs several times faster than argmax's), through
    the kernels' ``rows_max_index`` where they take the logits (the same indices, each row read
    once in vectors: kernels/rows_max.cpp)."""
    if (logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and logits.is_contiguous()
            and logits.numel() and (lib := gemv_rows.library()) is not None):
        return lib.rows_max_index(logits)
    return logits.max(-1).indices
