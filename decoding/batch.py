"""Batched decoding: B prompts in one loop, every row exactly what it would be decoded alone.

``generate_batch(model, prompts, cfg, seeds=...)`` runs any mode (``ar``, ``dynamic``,
``speculative``, ``typical``) with any drafter over rows of different prompt lengths that accept
different numbers of drafts, back off to different orders and finish at different times.
``generate(model, prompts, cfg)`` (the package's entry point) takes one prompt or many.

What is shared, what is per row:
- One forward pass per step for all live rows (``model.step`` with per-row lengths): prompts
  are left-padded, each step's tokens right-aligned, so a row's anchor and its rejected drafts
  sit at the end of the step. The KV caches keep one slot axis and mask per row the slots that
  hold none of its tokens (``pipeline/model/ragged.py``; positions count a row's own tokens only,
  so rotary is right per row). Rejected drafts are forgotten per row: the suffix all rows reject
  is cropped, the rest masked; holes are gathered away only when they make the slot axis 1.5x the
  longest row. Why masking over per-step compaction: a compaction gathers every K and V slot of
  every layer (as many bytes as one step's attention reads), while a hole costs only its own
  slot's share of later reads. Measured (``scripts/bench_cache_layout.py``: embedded model and
  heads, B = 8 ragged prompts, 128 tokens): the masked axis reads 1.10x (speculative), 1.01x
  (typical, dynamic) the slots of a compact one, while compacting every step would copy about
  as many slots again as it reads (~2x the cache traffic).
- Everything a row decides is decided by the same functions as batch 1 (proposal, acceptance,
  sampling, DynaMo's ``dynamic_propose``), on that row's slice of the step (``RowView``), with its
  own state: context mask, ``torch.Generator`` and numpy generator seeded with the row's seed.
  Hence the property the tests check: row b of a batch equals ``generate(model, prompt_b, cfg
  with seed = seeds[b])`` token for token, greedy or sampled (up to float rounding of the batched
  matmuls, which a greedy argmax or a seeded draw crosses only at an exact tie).
- Host reads stay one per step for the whole batch: the committed ids of every row in one
  transfer (a greedy ``ar`` step takes the argmax of all rows in one call), every row's verdict
  and drafts in one, and DynaMo's top-k of every row's heads in one (``head_candidates`` over
  [B * n, V]); the grids are then built on the host per row.
- A finished row (end of sequence or budget) leaves the batch before the next forward pass
  (``DecodeCaches.keep_rows``): it costs nothing afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .config import DecodeConfig, check_context
from .dynamic import always_backs_off, dynamic_propose, head_candidates, heads_needed
from .loop import DecodeResult, RunState, _acceptor, _eos_ids, generate as generate_one, stats_order_cap
from .accept import greedy_accept, speculative_accept
from .proposal import Drafts, independent_drafts, joint_drafts, pick_drafter
from .sampling import Sampler, penalised_logits, rows_seen
from .sparse_step import prepare_kernel
from .timing import clock_for
from .trace import Trace
from multitoken.pipeline.base.errors import UsageError


class RowView:
    """One row of a batched ``StepOutput``, shaped as a batch-1 pass ([1, ...]): the proposal and
    acceptance functions read it unchanged. Reads at the row's anchor go through the batched
    per-anchor methods, so all rows' heads there are computed in one call."""

    def __init__(self, out, row: int, anchors: tuple[int, ...]):
        self.out, self.row, self.anchors = out, row, anchors
        self.first, self.hiddens, self.clock = out.first, out.hiddens, out.clock

    @property
    def model_s(self) -> float:
        return self.out.model_s

    @model_s.setter
    def model_s(self, value: float) -> None:
        self.out.model_s = value

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.row:self.row + 1]

    def base_logits(self) -> torch.Tensor:
        return self._rows(self.out.base_logits())

    def base_log_probs(self) -> torch.Tensor:
        return self._rows(self.out.base_log_probs())

    def _head_row(self, index: int, pos: int) -> torch.Tensor:
        if pos == self.anchors[self.row]:
            return self._rows(self.out.anchor_head_logits(index, self.anchors))
        return self._rows(self.out._head_row(index, pos))

    def head_log_probs(self, index: int, pos: int) -> torch.Tensor:
        if pos == self.anchors[self.row]:
            return self._rows(self.out.anchor_head_log_probs(index, self.anchors))
        return self._rows(self.out.head_log_probs(index, pos))

    def anchor_hidden(self, pos: int) -> torch.Tensor:
        return self._rows(self.out.anchor_hidden(pos))


@dataclass
class Row:
    """One sequence of the batch: its prompt, decoding state and trace."""

    index: int  # in the caller's list
    prompt: list[int]
    run: RunState
    trace: Trace
    out_ids: list[int] = field(default_factory=list)
    anchor: int = 0
    forced: int | None = None
    done: bool = False
    commit: list[int] = field(default_factory=list)
    drafts: Drafts | None = None

    def emit(self, tokens: list[int], eos: set[int], on_tokens) -> bool:
        """Commit final tokens (as ``loop.generate``'s emit); True when the row is over."""
        cfg = self.run.cfg
        tokens = tokens[: cfg.max_new_tokens - len(self.out_ids)]
        if cfg.stop_at_eos:
            stop = next((i for i, t in enumerate(tokens) if t in eos), None)
            tokens = tokens if stop is None else tokens[: stop + 1]
        self.out_ids.extend(tokens)
        self.run.mark(tokens)
        if on_tokens and tokens:
            on_tokens(self.index, tokens)
        self.done = len(self.out_ids) >= cfg.max_new_tokens or (cfg.stop_at_eos and bool(tokens) and tokens[-1] in eos)
        return self.done


class HeadWidth:
    """``dynamic_propose``'s head scores when every head it reads comes precomputed
    (``candidates=``): only the count and the vocabulary width are read (a meta tensor: no memory)."""

    def __init__(self, n: int, vocab: int):
        self.n, self.row = n, torch.empty(vocab, device="meta")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i:
            raise IndexError("head scores past the precomputed candidates were read")
        return self.row


def prompt_rows(prompts, attention_mask: torch.Tensor | None = None) -> list[list[int]]:
    """Token lists from a list of prompts (lists or 1-D tensors) or a padded [B, T] tensor with
    its attention mask (either padding side)."""
    if isinstance(prompts, torch.Tensor):
        ids = prompts.reshape(-1, prompts.shape[-1]).cpu()
        mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.reshape(ids.shape).bool().cpu()
        return [row[m].tolist() for row, m in zip(ids, mask)]
    return [torch.as_tensor(p, dtype=torch.long).reshape(-1).tolist() for p in prompts]


def is_batch(prompts, attention_mask=None) -> bool:
    """Several prompts (or one given with an attention mask / as a list of lists)."""
    if isinstance(prompts, torch.Tensor):
        return attention_mask is not None or (prompts.dim() == 2 and prompts.shape[0] > 1)
    return len(prompts) > 0 and not isinstance(prompts[0], (int, np.integer)) and not (
        isinstance(prompts[0], torch.Tensor) and prompts[0].dim() == 0)


def generate(model, prompts, cfg: DecodeConfig | None = None, *, seeds=None, attention_mask=None, **kwargs):
    """One prompt (list of ids or [1, T] tensor) -> ``DecodeResult`` (``loop.generate``); several
    (a list of id lists, or a [B, T] tensor with ``attention_mask``) -> a list of them, one per
    row, each equal to that row decoded alone with seed ``seeds[b]`` (default: ``cfg.seed``)."""
    if is_batch(prompts, attention_mask):
        return generate_batch(model, prompts, cfg, seeds=seeds, attention_mask=attention_mask, **kwargs)
    return generate_one(model, prompts, cfg, **kwargs)


def _left_pad(seqs: list[torch.Tensor], width: int, device) -> torch.Tensor:
    """Rows right-aligned in a [B, width] tensor (pads, id 0, first: masked by the caches)."""
    out = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    for row, seq in enumerate(seqs):
        out[row, width - seq.numel():] = seq
    return out


@torch.inference_mode()
def generate_batch(model, prompts, cfg: DecodeConfig | None = None, *, seeds=None, attention_mask=None, table=None,
                   on_tokens=None, drafter=None, acceptor=None, profile: bool = False) -> list[DecodeResult]:
    """Decode every prompt (see the module doc). ``on_tokens(row, tokens)`` streams final tokens
    per row; ``seeds[b]`` seeds row b's generators (default ``cfg.seed`` for all)."""
    cfg = cfg or DecodeConfig()
    vocab = model.backbone.vocab_size
    cfg.validate(vocab_size=vocab, n_heads=model.n_future, max_order=stats_order_cap(cfg, model.n_future, table, False))
    cfg = cfg.resolved()
    prompts = prompt_rows(prompts, attention_mask)
    if not prompts:
        raise UsageError("no prompts were given", "pass at least one prompt")
    seeds = [cfg.seed] * len(prompts) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != len(prompts):
        raise UsageError(f"{len(seeds)} seeds for {len(prompts)} prompts", "pass one seed per prompt")
    for ids in prompts:
        if not ids:
            raise UsageError("a prompt is empty", "pass at least one token per prompt")
        check_context(len(ids), cfg.max_new_tokens, model.backbone.config.max_position_embeddings)
    device = model.backbone.device
    speculative = cfg.mode in ("speculative", "typical")
    drafter = drafter or (pick_drafter(cfg.drafter, model.heads, table) if speculative else None)
    acceptor = acceptor or _acceptor(cfg)
    eos = _eos_ids(model)
    cap = stats_order_cap(cfg, model.n_future, table, drafter is joint_drafts)
    order = cap or cfg.order(model.n_future)
    heads_read = 1 if cfg.mode == "dynamic" and always_backs_off(cfg) else order
    argmax_only = cfg.greedy and acceptor in (greedy_accept, speculative_accept)
    wants_rule = getattr(acceptor, "wants_rule_probs", False) and not cfg.greedy
    draft_cfg = replace(cfg, static_threshold=False, adaptive_threshold=False)
    rows = [_new_row(b, ids, replace(cfg, seed=seed), model, table, vocab, device, draft_cfg, cap, profile, len(prompts))
            for b, (ids, seed) in enumerate(zip(prompts, seeds))]
    unembed_rows = rows[0].trace.unembed_rows
    for row in rows[1:]:
        row.trace.unembed_rows = unembed_rows  # calls serve the whole batch: one count, shared
    clock = clock_for(device, profile)
    batch = list(rows)  # the rows in the caches and in ``out``, in batch order

    def forward(new: torch.Tensor, read_from: int, lengths: list[int] | None):
        start = clock()
        result = model.step(new, caches, heads_upto=heads_read, read_from=read_from, lengths=lengths)
        result.clock, result.unembed_rows = clock, unembed_rows
        spent = clock() - start
        for row in batch:
            row.trace.model_s += spent
            row.trace.forward_passes += 1
        return result

    def finish(row: Row) -> None:
        row.trace.wall_s = clock() - t0

    if cfg.mode == "dynamic" or drafter is joint_drafts:
        prepare_kernel(cfg, table, order)
    t0 = clock()
    caches = model.new_caches()
    width = max(len(p) for p in prompts)
    lengths = [len(p) for p in prompts]
    ids = _left_pad([torch.tensor(p) for p in prompts], width, "cpu").to(device)
    out = forward(ids, width - 1, lengths if min(lengths) < width else None)
    for row in rows:
        row.trace.prefill_s, row.anchor = row.trace.model_s, width - 1
    while True:
        live = [j for j, row in enumerate(batch) if not row.done]
        if not live:  # the last verification finished every row
            break
        anchors = tuple(row.anchor for row in batch)
        if cfg.mode == "dynamic":
            _propose_dynamic(out, batch, live, anchors, order, cfg, table, vocab)
        else:
            _propose_speculative(out, batch, live, anchors, order, speculative, drafter, device)
        for j in live:
            row = batch[j]
            row.trace.model_s += out.model_s
        out.model_s = 0.0
        for j in live:
            if batch[j].emit(batch[j].commit, eos, on_tokens):
                finish(batch[j])
        keep = [j for j in live if not batch[j].done]
        if not keep:
            break
        if len(keep) < len(batch):
            caches.keep_rows(keep)  # finished rows leave before the next pass
            batch = [batch[j] for j in keep]
        caches.compact_if_sparse()
        out, new = _step(forward, batch, device)
        with_drafts = [j for j, row in enumerate(batch) if row.drafts.tokens.numel()]
        if with_drafts:
            _accept(out, batch, with_drafts, caches, acceptor, cfg, argmax_only, wants_rule, eos, on_tokens, finish, new)
    results = []
    tok = model.backbone.tokenizer
    for row in rows:
        row.trace.new_tokens = len(row.out_ids)
        row.trace.dynamic_kernel = row.run.kernels
        text = tok.decode(row.out_ids, skip_special_tokens=True) if tok is not None else ""
        results.append(DecodeResult(row.out_ids, text, row.trace, row.prompt))
    return results


def _new_row(index, ids, cfg, model, table, vocab, device, draft_cfg, cap, profile, batch_size) -> Row:
    sampler = Sampler(cfg.greedy, cfg.temperature, cfg.top_k, cfg.seed, penalty=cfg.penalty, device=device)
    seen = torch.zeros(vocab, dtype=torch.bool, device=device)
    seen[torch.tensor(ids, device=device)] = True
    run = RunState(model, cfg, sampler, table, seen, None if cfg.greedy else np.random.default_rng(cfg.seed), vocab)
    run.draft_cfg = draft_cfg
    run.seen_host = np.zeros(vocab, dtype=bool)  # its host mirror from the host ids: no device read
    run.seen_host[ids] = True
    trace = Trace(mode=cfg.mode, prompt_tokens=len(ids), repetition_penalty=cfg.penalty, stats_order_cap=cap or 0,
                  device=str(device), synchronised=profile, batch_size=batch_size)
    return Row(index, list(ids), run, trace)


def _propose_dynamic(out, batch, live, anchors, order, cfg, table, vocab) -> None:
    """DynaMo for every live row: the top-k of the heads each reads, for all rows in one top-k
    call and one host transfer; then each row's grid and back-off on the host."""
    m = heads_needed(cfg, order)
    k = min(cfg.top_k, vocab)
    temperature = cfg.temperature if cfg.temperature > 0 else 1.0
    scores = torch.stack([_anchor_scores(out, i, anchors) for i in range(m)], dim=1)  # [B, m, V]
    index = torch.tensor(live, dtype=torch.long, device=scores.device)
    cands = head_candidates(scores.index_select(0, index).reshape(len(live) * m, -1), k, temperature)
    for slot, j in enumerate(live):
        row = batch[j]
        choice = dynamic_propose(HeadWidth(order, vocab), cfg, table, row.run.seen_array(), row.run.rng,
                                 candidates=cands[slot * m:(slot + 1) * m])
        row.commit, row.drafts = choice.tokens, Drafts.empty(scores.device)
        row.trace.orders[choice.order] += 1
        row.trace.backoffs.update(choice.backed_off)
        row.run.kernels.update(choice.kernels)


def _anchor_scores(out, i: int, anchors: tuple[int, ...]) -> torch.Tensor:
    """Head i's scores at every row's anchor # [B, V], as ``HeadScores`` reads them: raw logits
    for the base and layer heads, log-probs from one-position heads."""
    if i in out.hiddens:
        return out.anchor_head_logits(i, anchors)
    if i == 0:
        return out._at(out.base_logits(), tuple(a - out.first for a in anchors))[:, 0]
    return out.anchor_head_log_probs(i, anchors)


def _propose_speculative(out, batch, live, anchors, order, speculative, drafter, device) -> None:
    """The next token of every live row (from the base, or forced by the last verification;
    read in one transfer), then each row's drafts."""
    need = [j for j in live if batch[j].forced is None]
    if need:
        for j, token in zip(need, _next_tokens(out, batch, need, anchors)):
            batch[j].forced = token
    gs = {j: min(order - 1, batch[j].run.cfg.max_new_tokens - len(batch[j].out_ids) - 1) if speculative else 0 for j in live}
    if drafter is joint_drafts:
        _joint_candidates(out, batch, [j for j in live if gs[j] > 0], anchors, gs)
    cfg = batch[live[0]].run.cfg
    argmaxes = None
    if drafter is independent_drafts and cfg.greedy and cfg.penalty == 1 and max(gs.values()) > 0:
        # greedy drafts without a penalty are each head's argmax at the anchor: all rows per head at once
        argmaxes = torch.stack([out.anchor_head_log_probs(i, anchors).argmax(-1) for i in range(1, max(gs.values()) + 1)], 1)
    for j in live:
        row = batch[j]
        row.commit, row.forced = [row.forced], None
        g = gs[j]
        if argmaxes is not None:
            drafts = Drafts(argmaxes[j, :g], None)
        else:
            drafts = drafter(RowView(out, j, anchors), row.anchor, row.commit[0], g, row.run) if g > 0 else Drafts.empty(device)
        if drafts.tokens.device != device:  # a custom drafter's host tensors: moved once
            drafts = Drafts(drafts.tokens.to(device), None if drafts.probs is None else drafts.probs.to(device))
        row.drafts = drafts


def _joint_candidates(out, batch, rows: list[int], anchors, gs: dict[int, int]) -> None:
    """The joint drafter's top-k of heads 1..g for every drafting row in one top-k call and one
    host transfer (``RunState.candidates``; ``joint_drafts`` takes them instead of reading)."""
    if not rows:
        return
    cfg = batch[rows[0]].run.cfg
    g = max(gs[j] for j in rows)
    k = min(cfg.draft_k, cfg.top_k, batch[rows[0]].run.vocab_size)
    temperature = cfg.temperature if cfg.temperature > 0 else 1.0
    scores = torch.stack([_anchor_scores(out, i, anchors) for i in range(1, g + 1)], dim=1)  # [B, g, V]
    index = torch.tensor(rows, dtype=torch.long, device=scores.device)
    cands = head_candidates(scores.index_select(0, index).reshape(len(rows) * g, -1), k, temperature)
    for slot, j in enumerate(rows):
        batch[j].run.candidates = cands[slot * g:slot * g + gs[j]]


def _next_tokens(out, batch, need: list[int], anchors) -> list[int]:
    """A token from the base's target after each row's anchor: greedy takes every row's argmax
    in one call; sampling draws per row from its own generator. One host read either way."""
    logits = out.base_logits()  # [B, T - first, V]
    picked = out._at(logits, tuple(a - out.first for a in anchors))[:, 0]  # [B, V]
    index = torch.tensor(need, dtype=torch.long, device=logits.device)
    rows = picked.index_select(0, index)  # [R, V]
    sampler = batch[need[0]].run.sampler
    if sampler.greedy:
        seen = torch.stack([batch[j].run.seen for j in need])
        return penalised_logits(rows, seen, sampler.penalty).argmax(-1).tolist()
    return torch.stack([batch[j].run.sampler.sample(rows[s], batch[j].run.seen) for s, j in enumerate(need)]).tolist()


def _step(forward, batch, device):
    """One pass over every row's committed tokens and drafts, right-aligned; anchors move to
    each row's last committed token."""
    seqs = [torch.cat([torch.tensor(row.commit, dtype=torch.long, device=device), row.drafts.tokens]) for row in batch]
    lengths = [s.numel() for s in seqs]
    width = max(lengths)
    if all(not row.drafts.tokens.numel() for row in batch):  # host ids only: one copy to the device
        new = _left_pad([torch.tensor(row.commit) for row in batch], width, "cpu").to(device)
    else:
        new = _left_pad(seqs, width, device)
    for row, n in zip(batch, lengths):
        row.anchor = width - n + len(row.commit) - 1
    return forward(new, min(row.anchor for row in batch), lengths if min(lengths) < width else None), new


def _accept(out, batch, with_drafts, caches, acceptor, cfg, argmax_only, wants_rule, eos, on_tokens, finish, new) -> None:
    """Verify every row's drafts; one host read for all verdicts and drafts; forget each row's
    rejected drafts."""
    anchors = tuple(row.anchor for row in batch)
    if argmax_only and cfg.penalty == 1:
        packs = _greedy_verdicts(out, batch, with_drafts, new)
    else:
        packs = []
        for j in with_drafts:
            row = batch[j]
            view = RowView(out, j, anchors)
            target, rule = _verify_rows(view, row, cfg, argmax_only, wants_rule)
            verdict = acceptor(row.drafts.tokens, row.drafts.probs, target, row.run.sampler, **rule)
            packs.append(torch.cat([verdict.packed, row.drafts.tokens]))
    host = torch.cat(packs).tolist()
    remove = [0] * len(batch)
    start = 0
    for j, pack in zip(with_drafts, packs):
        row = batch[j]
        accepted, forced, *drafted = host[start:start + pack.numel()]
        start += pack.numel()
        row.trace.accepted_lengths[accepted] += 1
        remove[j] = len(drafted) - accepted
        row.anchor += accepted
        row.forced = forced
        if row.emit(drafted[:accepted], eos, on_tokens):
            finish(row)
    caches.crop_rows(remove)


def _greedy_verdicts(out, batch, with_drafts, new: torch.Tensor) -> list[torch.Tensor]:
    """``greedy_accept`` for every row at once (no repetition penalty): the base argmax after
    every slot of the step in one call; a row's drafts are its last g slots (right-aligned), kept
    while each equals the argmax after the slot before it. Per row [accepted, next, drafts...]
    as ``Verdict.packed`` + drafts, still on the device."""
    best = out.base_logits().argmax(-1)  # [B, T - first]
    width, first = new.shape[1], out.first
    index = torch.tensor(with_drafts, dtype=torch.long, device=best.device)
    g = torch.tensor([batch[j].drafts.tokens.numel() for j in with_drafts], device=best.device)  # [R]
    best, tokens = best.index_select(0, index), new.index_select(0, index)  # [R, T - first], [R, T]
    match = tokens[:, first + 1:] == best[:, :-1]  # [R, T - first - 1]: slot s + 1 equals the argmax after slot s
    slots = torch.arange(first, width - 1, device=best.device)  # the judged slot of each column
    start = width - 1 - g  # [R] the slot whose argmax judges the first draft (the anchor)
    ok = match | (slots[None, :] < start[:, None])  # columns before a row's window pass through
    accepted = ok.long().cumprod(1).sum(1) - (start - first)  # [R]
    nxt = best.gather(1, (start - first + accepted)[:, None])[:, 0]  # the argmax after the last kept draft
    return [torch.cat([torch.stack([accepted[r], nxt[r]]), batch[j].drafts.tokens]) for r, j in enumerate(with_drafts)]


def _verify_rows(view, row: Row, cfg, argmax_only: bool, wants_rule: bool):
    """``loop.generate``'s verify_rows for one row: the base's targets after its anchor and
    after each draft # [g + 1, V], plus typical's whole-vocabulary rows."""
    run, drafts = row.run, row.drafts.tokens
    logits = view.base_logits()[0, row.anchor - view.first:]  # [g + 1, V]
    seen = rows_seen(run.seen, drafts, logits.shape[0]) if cfg.penalty != 1 else run.seen
    if argmax_only:
        return penalised_logits(logits, seen, cfg.penalty), {}
    rule = {"rule_probs": run.sampler.full(logits[:-1], seen[:-1] if seen.dim() == 2 else seen)} if wants_rule else {}
    return run.sampler.target(logits, seen), rule
