"""EAGLE-3 drafter heads: three fused trunk states, one decoder layer run step by step.

Head 1 is the base. Head i+1 (i = 1..n-1) is the drafter's i-th step at position t, which
predicts token t+i+1: step 1 reads ``fc`` of three of the base's layer states at t (the
*inputs* of layers ``aux_layers``, as vLLM and llama.cpp extract them) and the embedding of token
t+1; step i > 1 reads the layer's own previous (pre-norm) output and the token step i-1 stands
for. Each step's output goes through ``norm`` and ``draft_head`` (EAGLE-3's ``lm_head``: the
base's own ``lm_head`` is a name of its state dict), which scores a draft vocabulary
of ``draft_vocab_size`` tokens (0: the whole vocabulary); ``d2t`` [Vd] holds target id minus
draft id per draft token and ``t2d`` [V] marks the target ids it covers (EAGLE-3's buffers).

Training (``loss``) is EAGLE-3's training-time test: step i's queries at position t see the
step-1 keys at positions <= t and the keys of steps 2..i at t itself, which is exactly what a
chain of drafts at t sees when drafting from a KV cache (``step``); step i sits at position
t+i-1. Tokens are the text's (teacher forcing), targets the base's own distribution at t+i over
the draft vocabulary (``targets="distill"``, the loss reported as KL(base || draft)) or its
argmax there (``"argmax"``, cross-entropy): the drafter
learns the base as it runs, quantized or LoRA-tuned, with no regenerated text.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .base import Features, HeadAdapter, LossOutput, chunked_cross_entropy, head_dtype, head_metrics, shifted_targets
from .eagle3_layer import DraftCache, Eagle3Layer, LayerShape, RMSNorm, Rotary
from .registry import register_head
from .unembed import counting
from multitoken.base.errors import UsageError

TARGETS = ("distill", "argmax")


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's (2, L//2, L-3), kept inside the states a trunk pass has (inputs of layers 1..L-1)."""
    return sorted(min(max(k, 1), num_layers - 1) for k in (2, num_layers // 2, num_layers - 3))


@dataclass
class Eagle3Config:
    head_type: str = "eagle3"
    n_future: int = field(default=4, metadata={"help": "tokens predicted per position: head 1 = the base, then n-1 draft steps"})
    aux_layers: list[int] | None = field(default=None, metadata={
        "help": "the three base layers whose input states are fused (L: the base's layer count)",
        "default_help": "EAGLE-3's 2 L//2 L-3"})
    draft_vocab_size: int = field(default=0, metadata={"help": "tokens the drafter's lm_head scores (0: the whole vocabulary)"})
    targets: str = field(default="distill", metadata={"help": "train on the base's distribution or its argmax", "choices": TARGETS})

    def validate(self) -> None:
        if self.aux_layers is not None and (len(self.aux_layers) != 3 or not all(
                isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in self.aux_layers)):
            raise UsageError(f"aux_layers must be three layer ids >= 1, got {self.aux_layers!r}", "e.g. aux_layers=[2, 15, 27]")
        if not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 0:
            raise UsageError(f"draft_vocab_size must be an integer >= 0, got {self.draft_vocab_size!r}", "pass 0 for the whole vocabulary")
        if self.targets not in TARGETS:
            raise UsageError(f"unknown targets {self.targets!r}", f"use one of {', '.join(TARGETS)}")


class Eagle3Drafter(HeadAdapter):
    needs_layer_states = True  # the fused states come from three trunk layers
    needs_next_tokens = True  # step 1 reads token t+1
    drafts_autoregressively = True  # decoding runs ``step`` with a cache of its own (decoding/drafts.py), not per-head scores

    def __init__(self, config: Eagle3Config, backbone):
        L, V = backbone.num_layers, backbone.vocab_size
        aux = list(config.aux_layers) if config.aux_layers is not None else default_aux_layers(L)
        if max(aux) > L - 1:
            raise UsageError(f"aux_layers {aux}: this base has {L} layers, the fused states are inputs of layers 1..{L - 1}",
                             f"pass layer ids between 1 and {L - 1}")
        size = config.draft_vocab_size if 0 < config.draft_vocab_size < V else V
        super().__init__(replace(config, aux_layers=aux, draft_vocab_size=0 if size == V else size), backbone)
        self.shape = LayerShape.from_base(backbone.config)
        H = self.shape.width
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = Eagle3Layer(self.shape)
        self.norm = RMSNorm(H, self.shape.eps)
        self.draft_head = nn.Linear(H, size, bias=False)
        self.register_buffer("d2t", torch.zeros(size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        self.rotary = Rotary(self.shape)
        for module in (self.fc, self.midlayer):
            for m in module.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
        self.to(device=backbone.device, dtype=head_dtype(backbone))
        self.set_draft_vocab(torch.arange(size))

    # The draft vocabulary -----------------------------------------------------------------
    @torch.no_grad()
    def set_draft_vocab(self, token_ids) -> None:
        """Score these target ids (any order; e.g. a ``draft_vocab.json`` ranking's first
        ``draft_vocab_size``): fills ``d2t`` / ``t2d`` and starts ``draft_head`` and ``norm`` from the
        base's unembedding rows and final norm (where it is an RMS norm's weight)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique(sorted=True).to(self.d2t.device)  # ascending: d2t >= 0
        if ids.numel() != self.draft_head.out_features or int(ids.min()) < 0 or int(ids.max()) >= self.t2d.numel():
            raise UsageError(f"a draft vocabulary of {self.draft_head.out_features} distinct ids in [0, {self.t2d.numel()}) "
                             f"is needed, got {ids.numel()}", "pass draft_vocab_size ids from the base's vocabulary")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True
        unembed = self.backbone.unembedding.weight.detach()
        self.draft_head.weight.copy_(unembed.index_select(0, ids.to(unembed.device)).to(self.draft_head.weight))
        final = self.backbone.final_norm
        if getattr(final, "bias", None) is None and getattr(final, "weight", None) is not None:
            self.norm.weight.copy_(final.weight.detach().to(self.norm.weight))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids -> the base's token ids # [...] -> [...] (``take``: a 0-d id
        indexes on the device, where ``d2t[id]`` would read it to the host)."""
        return draft_ids + torch.take(self.d2t, draft_ids)

    def target_log_probs(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits as a log-distribution over the whole vocabulary # [..., Vd] -> [..., V]
        (-inf outside the draft vocabulary)."""
        logp = torch.log_softmax(draft_logits.float(), dim=-1)
        out = logp.new_full((*logp.shape[:-1], self.t2d.numel()), float("-inf"))
        ids = self.to_target(torch.arange(logp.shape[-1], device=logp.device))
        return out.index_copy_(-1, ids, logp)

    # Drafting: what the engine calls ------------------------------------------------------
    def fuse(self, layer_states, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> torch.Tensor:
        """``fc`` over the three aux layers' input states # (L-1) x [B, T, H] -> [B, T, H]
        (``layer_states[j]`` is layer j's output = layer j+1's input); with ``rows`` [R] and
        ``cols`` [R, T'], only the states at (rows[r], cols[r, t]) # -> [R, T', H]."""
        _check_served(layer_states, self.backbone.num_layers)
        picked = [layer_states[k - 1] for k in self.config.aux_layers]
        if rows is not None:
            picked = [s[rows[:, None], cols] for s in picked]  # [R, T', H] each
        return self.fc(torch.cat(picked, dim=-1).to(self.fc.weight.dtype))  # [.., 3H] -> [.., H]

    def new_cache(self) -> DraftCache:
        return DraftCache()

    def step(self, hidden: torch.Tensor, token_ids: torch.Tensor, cache: DraftCache, positions: torch.Tensor,
             attend: torch.Tensor | None = None, slots: torch.Tensor | None = None,
             span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter pass over T new slots of each of B rows, written into ``cache``.
        ``hidden`` [B, T, H]: fused states (``fuse``) or the previous step's output; ``token_ids``
        [B, T] the tokens they stand before; ``positions`` [B, T]; ``slots`` [B, T] where they are
        cached (default: at their positions, a chain's slots); ``span`` (host) the slots read,
        [0, span) (default: up to the largest slot, which reads it to the host: the engine
        passes it); ``attend`` [B, T, span] bool (True = sees the slot), default: the slots up to
        the query's position. Returns (draft logits [B, T, Vd], pre-norm hidden [B, T, H])."""
        layer = self.midlayer
        x = layer.attention_input(self.backbone.embeddings(token_ids).to(hidden.dtype), hidden)  # [B, T, 2H]
        cos, sin = self.rotary(x, positions)
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        slots = positions if slots is None else slots
        span = max(cache.length, int(slots.max()) + 1) if span is None else span
        keys, values = cache.write(k, v, slots, span)  # [B, h, span, D]
        if attend is None:
            attend = torch.arange(span, device=positions.device)[None, None, :] <= positions[:, :, None]  # [B, T, span]
        o = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=attend[:, None])
        out = layer.finish(o, hidden)
        return self.draft_head(self.norm(out)), out

    # Training-time test --------------------------------------------------------------------
    def _ttt_step(self, hidden, token_ids, positions, past: list, key_ok):
        """Step len(past)+1 at every position # hidden [B, T, H] -> pre-norm output [B, T, H].
        ``past`` holds the earlier steps' (k, v); ``key_ok`` [B, T] the real tokens."""
        layer = self.midlayer
        x = layer.attention_input(self.backbone.embeddings(token_ids).to(hidden.dtype), hidden)
        cos, sin = self.rotary(x, positions)
        q, k, v = layer.self_attn.qkv(x, cos, sin)  # [B, h, T, D]
        past.append((k, v))
        k1, v1 = past[0]
        T = q.shape[2]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        sees = (causal[None] & key_ok[:, None, :]) | torch.eye(T, dtype=torch.bool, device=q.device)  # [B, T, T]
        scale = q.shape[-1] ** -0.5
        scores = [(q @ k1.transpose(-1, -2) * scale).masked_fill(~sees[:, None], float("-inf"))]  # [B, h, T, T]
        scores += [(q * kj).sum(-1, keepdim=True) * scale for kj, _ in past[1:]]  # [B, h, T, 1]: own earlier steps at t
        p = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)  # [B, h, T, T + i - 1]
        o = p[..., :T] @ v1
        for j, (_, vj) in enumerate(past[1:]):
            o = o + p[..., T + j:T + j + 1] * vj
        return layer.finish(o, hidden)

    def _chain(self, feats: Features, tokens_at):
        """Yield (step i, pre-norm output [B, T, H]) for i = 1..n-1; ``tokens_at(i, prev)`` gives
        step i's tokens [B, T] (``prev``: step i-1's output, None at step 1)."""
        hidden = self.fuse(feats.layer_states)
        B, T = hidden.shape[:2]
        key_ok = _key_validity(feats.ctx, B, T, hidden.device)
        base_pos = torch.arange(T, device=hidden.device).expand(B, T)
        past, prev = [], None
        for i in range(1, self.n_future):
            prev = self._ttt_step(hidden, tokens_at(i, prev), base_pos + (i - 1), past, key_ok)
            yield i, prev
            hidden = prev

    def log_probs(self, index: int, feats: Features, last_only: bool = False) -> torch.Tensor:
        """Greedy chains: step 1 reads token t+1 (``feats.next_ids``), each later step the
        previous step's argmax, as drafting does # -> [B, T, V] ([B, 1, V])."""
        if index == 0:
            return super().log_probs(0, feats, last_only)
        _check_served(feats.layer_states, self.backbone.num_layers)
        if feats.next_ids is None:
            raise ValueError("eagle3 heads read Features.next_ids (the token at t+1); the pipeline fills it")

        def tokens_at(i, prev):
            return feats.next_ids if prev is None else self.to_target(self.draft_head(self.norm(prev)).argmax(-1))

        for i, out in self._chain(feats, tokens_at):
            if i == index:
                out = out[:, -1:] if last_only else out
                return self.target_log_probs(self.draft_head(self.norm(out)))
        raise IndexError(f"head index {index} is out of range for n_future {self.n_future}")

    def hidden(self, index: int, feats: Features, cache=None) -> torch.Tensor:
        if index == 0:
            return feats.base
        raise UsageError("an eagle3 draft step is scored by its own draft_head (lm_head) over a draft vocabulary, not the base's "
                         "unembedding", "read it through log_probs (or the drafter's step)")

    def copied_parameter_names(self) -> set[str]:
        return {"draft_head.weight", "norm.weight"}

    def loss(self, feats: Features, input_ids: torch.Tensor, valid: torch.Tensor, chunk: int,
             skip_constant: bool = False) -> LossOutput:
        """Head 1's cross-entropy (the base), then one term per draft step (training-time test)."""
        per_head, metrics = [None], {}
        if not (skip_constant and torch.is_grad_enabled() and not feats.base.requires_grad):
            ce, m = chunked_cross_entropy(self.backbone.unembedding, feats.base, shifted_targets(input_ids, valid, 1), chunk)
            per_head[0] = ce
            metrics.update(head_metrics(1, ce, m))
        T = input_ids.shape[1]

        def tokens_at(i, _prev):  # the text's token t+i (positions past the end draw no loss)
            return torch.cat([input_ids[:, i:], input_ids.new_zeros(input_ids.shape[0], min(i, T))], dim=1)[:, :T]

        where, best, logq = self._base_targets(feats.base, valid, chunk)
        for i, out in self._chain(feats, tokens_at):
            ok = torch.zeros_like(valid)
            if i < T:
                ok[:, :T - i] = valid[:, :T - i] & valid[:, i:]
            rows = torch.cat([where[:, i:], where[:, :min(i, T)]], dim=1)[:, :T][ok]  # the base's rows at t+i
            loss, m = self._draft_loss(out[ok], None if best is None else best[rows], logq[rows], chunk)
            per_head.append(loss)
            metrics.update(head_metrics(i + 1, loss, m))
        return LossOutput(per_head=per_head, aux=None, metrics=metrics)

    @torch.no_grad()
    def _base_targets(self, base: torch.Tensor, valid: torch.Tensor, chunk: int):
        """The base's targets at every valid position, once per batch: each draft step's are
        these shifted, so the unembedding runs once per position (not once per step, nor again
        when a checkpointed chunk recomputes) # base [B, T, H], valid [B, T] -> (where [B, T]
        long: a position's row, best [N] long | None: the base's argmax over the whole
        vocabulary, logq [N, Vd] float32: its log-distribution over the draft vocabulary).
        ``best`` is None where nothing reads it (distillation targets, hits not counted). A plain
        unembedding gives ``logq`` from its draft-vocabulary rows alone, whether ``best`` is
        taken or not; the whole vocabulary's logits are made only for ``best``."""
        where = valid.long().flatten().cumsum(0).sub(1).view(valid.shape)  # a valid position's row
        rows = base[valid]  # [N, H]
        ids = self.to_target(torch.arange(self.draft_head.out_features, device=base.device))
        unembed = self.backbone.unembedding
        part = _rows_of(unembed, ids) if type(unembed) is nn.Linear else None
        argmax = part is None or counting() or self.config.targets != "distill"
        best, logq = [], []
        for s in range(0, rows.shape[0], chunk):
            if argmax:
                full = self.backbone.logits(rows[s:s + chunk])  # [C, V] (bf16 under autocast)
                # max's indices are argmax's (the first maximum), several times faster on the CPU
                best.append(full.max(-1).indices)
            draft = full.index_select(-1, ids) if part is None else part(rows[s:s + chunk])  # [C, Vd]
            logq.append(torch.log_softmax(draft.float(), dim=-1))
        Vd = self.draft_head.out_features
        best = (torch.cat(best) if best else valid.new_zeros(0, dtype=torch.long)) if argmax else None
        return where.clamp(min=0), best, torch.cat(logq) if logq else base.new_zeros(0, Vd, dtype=torch.float32)

    def _draft_loss(self, rows: torch.Tensor, best: torch.Tensor | None, logq: torch.Tensor, chunk: int):
        """Mean loss of draft rows [N, H] against the base's targets there (``best`` [N], its
        argmax, or None; ``logq`` [N, Vd], its log-distribution over the draft vocabulary), chunk
        by chunk (each chunk's [C, Vd] logits recomputed in backward, not kept), and {top1, top5}:
        the rates of the base's argmax among the drafts' guesses (none when hits are not counted
        or ``best`` is None)."""
        total, hits = rows.new_zeros((), dtype=torch.float32), torch.zeros(2, dtype=torch.long, device=rows.device)
        for s in range(0, rows.shape[0], chunk):
            args = (rows[s:s + chunk], None if best is None else best[s:s + chunk], logq[s:s + chunk])
            grad = torch.is_grad_enabled() and rows.requires_grad
            part, h = checkpoint(self._chunk_loss, *args, use_reentrant=False) if grad else self._chunk_loss(*args)
            total, hits = total + part, hits + h
        n = max(rows.shape[0], 1)
        return total / n, dict(zip(("top1", "top5"), (hits.float() / n).tolist())) if counting() else {}

    def _chunk_loss(self, rows: torch.Tensor, best: torch.Tensor | None, logq: torch.Tensor):
        """Summed loss and [top-1, top-5] hit counts # rows [C, H], best [C], logq [C, Vd]."""
        logp = torch.log_softmax(self.draft_head(self.norm(rows)).float(), dim=-1)  # [C, Vd]
        if self.config.targets == "distill":  # KL(base || draft): the cross-entropy less the base's entropy, 0 at a match
            loss = (logq.exp() * (logq - logp)).sum()
        else:  # the base's argmax where the draft vocabulary holds it
            inside = self.t2d[best]
            loss = -logp.gather(-1, logq.argmax(-1, keepdim=True)).squeeze(-1)[inside].sum()
        if best is None or not counting():  # no argmax taken: no hits to count
            return loss, torch.zeros(2, dtype=torch.long, device=rows.device)
        with torch.no_grad():
            top = self.to_target(logp.topk(min(5, logp.shape[-1]), dim=-1).indices) == best[:, None]  # [C, 5]
            hits = torch.stack([top[:, 0].sum(), top.any(-1).sum()])
        return loss, hits


def _rows_of(unembed: nn.Linear, ids: torch.Tensor):
    """The unembedding's rows ``ids`` alone, as a function # [..., H] -> [..., len(ids)]."""
    weight = unembed.weight.detach().index_select(0, ids)  # [Vd, H]
    bias = None if unembed.bias is None else unembed.bias.detach().index_select(0, ids)
    return lambda rows: F.linear(rows, weight, bias)


def _check_served(layer_states, num_layers: int) -> None:
    """The trunk's layer states are there (the decoding engine's per-head steps keep none)."""
    if len(layer_states) < num_layers - 1:
        raise UsageError("eagle3 heads read three of the trunk's layer states, which this pass did not keep "
                         "(a one-position head score: eagle3 drafts only as a chain)",
                         "decode with --mode speculative or typical and --tree chain, or read log_probs of a full pass")


def _key_validity(ctx, B: int, T: int, device) -> torch.Tensor:
    """Which positions are real tokens # -> [B, T] bool, read from the backbone's mask (None:
    all; else the last query's row, which sees every real key before it)."""
    mask = getattr(ctx, "mask", None)
    if mask is None:
        return torch.ones(B, T, dtype=torch.bool, device=device)
    row = mask[:, 0, -1, -T:]  # [B, T]
    ok = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min
    return ok.expand(B, T).to(device)


register_head("eagle3", Eagle3Config, Eagle3Drafter)
