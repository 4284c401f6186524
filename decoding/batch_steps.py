"""The per-step work of batched decoding (``batch.py``): each row's proposal and verdict through
the batch-1 functions on its slice of the step (``RowView``), with every host read made once for
the whole batch (the committed ids, the verdicts, DynaMo's and the joint drafter's top-k), and
greedy verification / drafts for all rows in one call where no repetition penalty applies."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .dynamo import dynamic_propose, head_candidates, heads_needed
from .loop import RunState
from .proposal import Drafts, independent_drafts, joint_drafts
from .sampling import penalised_logits, rows_seen
from .trace import Trace


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


def propose_dynamic(out, batch, live, anchors, order, cfg, table, vocab) -> None:
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


def propose_speculative(out, batch, live, anchors, order, speculative, drafter, device) -> None:
    """The next token of every live row (from the base, or forced by the last verification;
    read in one transfer), then each row's drafts."""
    need = [j for j in live if batch[j].forced is None]
    if need:
        for j, token in zip(need, next_tokens(out, batch, need, anchors)):
            batch[j].forced = token
    gs = {j: min(order - 1, batch[j].run.cfg.max_new_tokens - len(batch[j].out_ids) - 1) if speculative else 0 for j in live}
    if drafter is joint_drafts:
        _joint_candidates(out, batch, [j for j in live if gs[j] > 0], anchors, gs)
    cfg = batch[live[0]].run.cfg
    argmaxes = None
    if drafter is independent_drafts and cfg.greedy and cfg.penalty == 1 and max(gs.values()) > 0:
        # greedy drafts without a penalty are each head's argmax at the anchor: all rows per head at once
        argmaxes = torch.stack([_anchor_scores(out, i, anchors).argmax(-1) for i in range(1, max(gs.values()) + 1)], 1)
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


def next_tokens(out, batch, need: list[int], anchors) -> list[int]:
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


def accept_all(out, batch, with_drafts, caches, acceptor, cfg, argmax_only, wants_rule, eos, on_tokens, finish, new) -> None:
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

