"""Chain proposers (``proposal.py`` gives their one signature): the base's next token and a
chain of drafts after it (``chain``; ``ar`` drafts nothing), or DynaMo's 1..n final tokens
(``dynamo``).

The chain drafters share one signature too: ``draft(heads, first, g, row, run) -> Drafts`` (up to
``g`` drafts after the committed token ``first``, with the distributions they were drawn from);
``heads`` are the row's head scores at its anchor (``RowHeads``). The plan names the drafter
(``DecodePlan.drafter``); two draft every row of a step at once: ``joint`` (every row's top-k in
one read) and ``argmax`` (each head's argmax for every row in one call); ``eagle3``'s drafter
keeps a KV cache per row (``Eagle3Chains``, below).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .dynamo.step import Candidates, dynamic_propose, head_candidates, joint_cells, sample_index
from .proposal import Drafts, Proposal, RowHeads, anchor_argmax, anchor_scores, chain_step, draw_draft, next_tokens


def candidates_of(out, rows: list[int], anchors, heads: range, k: int, temperature: float) -> list[list[Candidates]]:
    """Top-k of ``heads`` at each of ``rows``'s anchors, for all rows in one top-k call and one
    host transfer # -> per row, one ``Candidates`` per head."""
    scores = torch.stack([anchor_scores(out, i, anchors) for i in heads], dim=1)  # [B, m, V]
    index = torch.tensor(rows, dtype=torch.long, device=scores.device)
    m = len(heads)
    flat = head_candidates(scores.index_select(0, index).reshape(len(rows) * m, -1), k, temperature)
    return [flat[s * m:(s + 1) * m] for s in range(len(rows))]


# DynaMo ------------------------------------------------------------------------------------
def dynamo(run):
    """DynaMo's step (Alg. 1): each row's 1..n final tokens from its heads' joint, no drafts."""
    cfg, plan = run.cfg, run.plan
    m = plan.heads_read  # the heads DynaMo's first order reads (one where every order backs off unread)
    k, temperature = min(cfg.sampling.top_k, run.vocab), cfg.sampling.grid_temperature

    def propose(out, rows, anchors, live) -> Proposal:
        commits = []
        for j, cand in zip(live, candidates_of(out, live, anchors, range(m), k, temperature)):
            row = rows[j]
            choice = dynamic_propose(cand, plan.order, cfg, run.table, row.seen_host, row.rng)
            commits.append(choice.tokens)
            row.trace.orders[choice.order] += 1
            row.trace.backoffs.update(choice.backed_off)
            row.trace.dynamic_kernel.update(choice.kernels)
        return chain_step(commits, [run.no_drafts] * len(live), run.device)
    return propose


# Chains ------------------------------------------------------------------------------------
def _pack(tokens: list[torch.Tensor], probs: list[torch.Tensor | None], device) -> Drafts:
    """Drafts from 0-d device ids (stacked where they are: no host round trip)."""
    if not tokens:
        return Drafts.empty(device)
    probs = [q for q in probs if q is not None]
    return Drafts(torch.stack(tokens), torch.stack(probs) if probs else None)


def independent_drafts(heads: RowHeads, first: int, g: int, row, run) -> Drafts:
    """Head i+1 drafts token t+i+1 on its own (the heads ignore ``first``)."""
    context = torch.tensor([first], dtype=torch.long, device=row.seen.device)  # [1 + i]
    tokens, probs = [], []
    for i in range(1, g + 1):
        tok, q = draw_draft(heads[i], row, context, run.plan)
        tokens.append(tok)
        probs.append(q)
        context = torch.cat([context, tok.reshape(1)])
    return _pack(tokens, probs, row.seen.device)


def cp_drafts(heads: RowHeads, first: int, g: int, row, run) -> Drafts:
    """CP experts, sequentially (the CP-heads paper, eqs. 11-13): the expert weights are updated
    by every token already chosen, ``first`` included, before the next token is drawn."""
    e = heads.hidden()  # [1, H]
    prefix = torch.tensor([[first]], dtype=torch.long, device=e.device)  # [1, 1 + i]
    tokens, probs = [], []
    for _ in range(g):
        start = run.clock()
        logp = run.model.heads.conditional_log_probs(e, prefix)[0]  # [V]
        heads.out.model_s += run.clock() - start
        tok, q = draw_draft(logp, row, prefix[0], run.plan)
        tokens.append(tok)
        probs.append(q)
        prefix = torch.cat([prefix, tok.reshape(1, 1)], 1)
    return _pack(tokens, probs, e.device)


def joint_drafts(heads: RowHeads, first: int, g: int, row, run) -> Drafts:
    """Drafts from DynaMo's co-occurrence-masked joint (eq. 6) conditioned on ``first``:
    J(x2..x_{g+1} | first) ~ prod_i p_i(x_i) * ratio(first, x2, ...)^alpha_c over the heads'
    top-k, with the repetition penalty, drawn axis by axis (each draft's q is its conditional).
    No thresholds: they exist to back off, and here the verifier already guards the output.
    Without a table this is the independent drafter."""
    cfg = run.cfg
    top = heads.cands
    if top is None:  # a draft outside the target's top-k is always rejected: k <= top_k
        rows = torch.stack([heads[i] for i in range(1, g + 1)])  # [g, V] raw logits: only their top-k is read
        top = head_candidates(rows, min(cfg.speculation.draft_k, cfg.sampling.top_k, run.vocab), cfg.sampling.grid_temperature)
    cands = [Candidates(np.array([first]), np.ones(1, dtype=np.float32))] + list(top[:g])
    cells = joint_cells(cands, run.draft_cfg, run.table, row.seen_host)
    row.trace.dynamic_kernel[cells.kernel] += 1
    grid = cells.dense()[0]  # [k]*g: the marginals below sum it whole
    tokens, marginals = [], []
    for axis in range(1, g + 1):
        marginal = grid.reshape(grid.shape[0], -1).sum(-1, dtype=np.float64)  # [k]
        if not marginal.sum() > 0:
            break
        if run.plan.greedy:  # greedy verification reads the drafts only, not their q
            i = int(marginal.argmax())
        else:  # drawn on the host from the host grid (seeded numpy): no device read per axis
            i = sample_index(marginal, row.rng)
            marginals.append(marginal / marginal.sum())
        tokens.append(int(cands[axis].ids[i]))
        grid = grid[i]
    q = None
    if marginals:  # each axis's [k] marginal scattered to its candidate ids (one copy each)
        ids = torch.from_numpy(np.stack([c.ids for c in cands[1:len(marginals) + 1]])).to(run.device)  # [j, k]
        q = torch.zeros(len(marginals), run.vocab, dtype=torch.float64, device=run.device)
        q = q.scatter_(1, ids, torch.from_numpy(np.stack(marginals)).to(run.device)).float()
    return Drafts(torch.tensor(tokens, dtype=torch.long, device=run.device), q)


# EAGLE-3 ------------------------------------------------------------------------------------
# The drafter (``adapters/eagle3.py``) runs autoregressively after each pass,
# from the fused trunk states of the tokens that pass kept, with a KV cache of its own.
#
# A row's drafter cache holds one slot per position t of the row's text: the drafter's first step
# there (``fc`` of the three aux layers' states at t, and the embedding of token t+1). Each step a
# row first catches up over the positions the last pass kept (the prompt after the prompt's pass;
# the commit and the accepted drafts after a verification, which end at its anchor), each with
# the token after it: the text's, then the token decided after the anchor (the chain's
# ``first``). The catch-up's last slot *is* the first draft step at the anchor; steps 2..g each
# add a slot at the next position (the layer's own pre-norm output and the previous draft) and
# are cropped after drafting, so the cache holds the text alone. This is the computation the
# training-time test trains (step i at position t+i-1 sees the first-step slots up to t and its
# own chain's later slots), which ``tests/decoding/test_eagle3.py`` checks against ``log_probs``.
#
# One cache per row, the drafter run row by row: rows keep different counts each step, and a
# cache per row needs no holes and makes a row's drafts exactly those of its run alone
# (correctness first; batching the rows' drafter passes with a slot mask is left). No host read:
# the text's ids are the host's (copied to the device), the drafts and their q stay on the device
# until the verifier's one read per step.


@dataclass
class _RowDrafter:
    cache: object  # the drafter's ``DraftCache``
    done: int = 0  # text positions the cache holds


class Eagle3Chains:
    """The eagle3 drafter as a chain's ``draft_rows(out, rows, anchors, jobs, run) -> [Drafts]``
    (the signature above): row j of job (j, first, g) catches up, then drafts g tokens after ``first``."""

    def __init__(self, run):
        self.run, self.heads = run, run.model.heads
        self.rows: dict[int, _RowDrafter] = {}  # the caller's row index -> its drafter state

    def __call__(self, out, rows, anchors, jobs, run) -> list[Drafts]:
        self.forget(rows)
        return [self._row(out, j, anchors[j], first, g, rows[j]) for j, first, g in jobs]

    def forget(self, rows) -> None:
        """Drop the caches of rows no longer in ``rows`` (finished)."""
        live = {row.index for row in rows}
        for index in [i for i in self.rows if i not in live]:
            del self.rows[index]

    def catch_up(self, out, j: int, anchor: int, first: int, row):
        """Row j's drafter cache extended over the positions ``out`` kept up to ``anchor`` (its
        last kept slot), ``first`` the token after it # -> (its state, the first draft step's
        logits [1, new, Vd] and pre-norm output [1, new, H]: the anchor's is the last)."""
        run, heads = self.run, self.heads
        state = self.rows.setdefault(row.index, _RowDrafter(heads.new_cache()))
        text = row.prompt + row.out_ids  # the row's text up to the anchor's token
        new = len(text) - state.done  # the positions the last pass kept, ending at the anchor
        if not 0 < new <= anchor + 1:
            raise RuntimeError(f"the eagle3 drafter holds {state.done} positions of a {len(text)}-token text: "
                               "a step kept no trunk states for the rest")
        start = run.clock()
        states = [s[j:j + 1, anchor + 1 - new:anchor + 1] for s in out.feats.layer_states]  # (L-1) x [1, new, H]
        tokens = torch.tensor([text[state.done + 1:] + [first]], dtype=torch.long, device=run.device)  # [1, new]
        positions = torch.arange(state.done, len(text), device=run.device)[None]  # [1, new]
        logits, hidden = heads.step(heads.fuse(states), tokens, state.cache, positions)  # [1, new, Vd], [1, new, H]
        state.done = len(text)
        out.model_s += run.clock() - start  # the drafter's passes are model time
        return state, logits, hidden

    def _row(self, out, j: int, anchor: int, first: int, g: int, row) -> Drafts:
        """Row j's g drafts; ``anchor`` its last kept slot in ``out``, ``first`` the token after it."""
        run, heads = self.run, self.heads
        state, logits, hidden = self.catch_up(out, j, anchor, first, row)
        start = run.clock()
        context = torch.tensor([first], dtype=torch.long, device=run.device)  # [1 + i]: the penalty's context
        drafts, probs = [], []
        for i in range(g):
            tok, q = self._pick(logits[0, -1], row, context)
            drafts.append(tok)
            probs.append(q)
            if i + 1 < g:  # step i + 2 at position len(text) + i, reading step i + 1's output and its draft
                context = torch.cat([context, tok.reshape(1)])
                at = torch.full((1, 1), state.done + i, dtype=torch.long, device=run.device)
                logits, hidden = heads.step(hidden[:, -1:], tok.reshape(1, 1), state.cache, at)
        state.cache.crop(state.done)  # the chain's own slots go: the cache holds the text
        out.model_s += run.clock() - start  # the drafter's passes are model time
        probs = [q for q in probs if q is not None]
        return Drafts(torch.stack(drafts), torch.stack(probs) if probs else None)

    def _pick(self, logits: torch.Tensor, row, context: torch.Tensor):
        """A draft from the drafter's logits over its draft vocabulary # [Vd] -> (target id [],
        q [V] | None): greedy without a penalty its argmax; else drawn like any head's draft
        from its distribution over the whole vocabulary (probability 0 outside the draft one)."""
        if self.run.plan.argmax_only:
            return self.heads.to_target(logits.argmax(-1)), None
        return draw_draft(self.heads.target_log_probs(logits), row, context, self.run.plan)


# A step's drafting rows: ``draft_rows(out, rows, anchors, jobs, run) -> [Drafts]``, one per job
# (j, first, g): row j drafts g tokens after ``first``.
def _row_by_row(draft):
    """A chain drafter run on each drafting row in turn."""
    def draft_rows(out, rows, anchors, jobs, run) -> list[Drafts]:
        drafts = []
        for j, first, g in jobs:
            d = draft(RowHeads(out, j, anchors, g + 1), first, g, rows[j], run)
            if d.tokens.device != run.device:  # a custom drafter's host tensors: moved once
                d = Drafts(d.tokens.to(run.device), None if d.probs is None else d.probs.to(run.device))
            drafts.append(d)
        return drafts
    return draft_rows


def _joint_rows(out, rows, anchors, jobs, run) -> list[Drafts]:
    """Joint drafts, every drafting row's top-k read at once."""
    cfg = run.cfg
    k, t = min(cfg.speculation.draft_k, cfg.sampling.top_k, run.vocab), cfg.sampling.grid_temperature
    cands = candidates_of(out, [j for j, _, _ in jobs], anchors, range(1, max(g for *_, g in jobs) + 1), k, t)
    return [joint_drafts(RowHeads(out, j, anchors, g + 1, cand), first, g, rows[j], run)
            for (j, first, g), cand in zip(jobs, cands)]


def _argmax_rows(out, rows, anchors, jobs, run) -> list[Drafts]:
    """Greedy drafts without a penalty: each head's argmax at the anchors, every row per head at once."""
    best = torch.stack([anchor_argmax(out, i, anchors) for i in range(1, max(g for *_, g in jobs) + 1)], 1)  # [B, g]
    return [Drafts(best[j, :g], None) for j, _, g in jobs]


DRAFT_ROWS = {"independent": _row_by_row(independent_drafts), "cp": _row_by_row(cp_drafts), "joint": _joint_rows,
              "argmax": _argmax_rows}  # the plan's drafter -> how it drafts a step's rows


def chain(run, custom=None):
    """The base's next token (or the one the last verification decided) and a chain of drafts
    after it by the plan's drafter (``custom``: a caller's chain drafter); none without one (``ar``)."""
    plan = run.plan
    draft_rows = (None if plan.drafter is None else _row_by_row(custom) if plan.drafter == "custom"
                  else Eagle3Chains(run) if plan.drafter == "eagle3" else DRAFT_ROWS[plan.drafter])

    def propose(out, rows, anchors, live) -> Proposal:
        need = [j for j in live if rows[j].forced is None]
        if need:
            for j, token in zip(need, next_tokens(out, rows, need, anchors, plan)):
                rows[j].forced = token
        firsts = [rows[j].forced for j in live]
        drafts = [run.no_drafts] * len(live)
        gs = [min(plan.order - 1, rows[j].budget - 1) if draft_rows else 0 for j in live]
        drafting = [s for s, g in enumerate(gs) if g > 0]
        if drafting:
            jobs = [(live[s], firsts[s], gs[s]) for s in drafting]
            for s, d in zip(drafting, draft_rows(out, rows, anchors, jobs, run)):
                drafts[s] = d
        for j in live:
            rows[j].forced = None
        return chain_step([[f] for f in firsts], drafts, run.device)
    return propose
