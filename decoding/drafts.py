"""Chain proposers (``proposal.py`` gives their one signature): the base's next token and a
chain of drafts after it (``chain``; ``ar`` drafts nothing), or DynaMo's 1..n final tokens
(``dynamo``).

The chain drafters share one signature too: ``draft(heads, first, g, row, run) -> Drafts`` (up to
``g`` drafts after the committed token ``first``, with the distributions they were drawn from);
``heads`` are the row's head scores at its anchor (``RowHeads``). The plan names the drafter
(``DecodePlan.drafter``); two draft every row of a step at once: ``joint`` (every row's top-k in
one read) and ``argmax`` (each head's argmax for every row in one call); so does ``eagle3``'s drafter, one
pass per draft step for all rows over a KV cache of its own (``Eagle3Chains``, below).
"""

from __future__ import annotations

import numpy as np
import torch

from .dynamo.step import dynamic_propose, first_token, joint_cells, sample_index
from .proposal import Drafts, Proposal, RowHeads, anchor_argmax, anchor_scores, chain_step, draw_draft, next_tokens
from .sampling import Candidates, head_candidates


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
    """DynaMo's step (Alg. 1): each row's 1..n final tokens from its heads' joint, no drafts:
    the outer product of the heads' marginals, or the conditional joint (``conditional_dynamo``)."""
    cfg, plan = run.cfg, run.plan
    if plan.defer_heads or plan.joint == "conditional" and plan.drafter == "eagle3":
        return conditional_dynamo(run)
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


def _record(row, choice) -> list[int]:
    """A DynaMo step's choice in the row's trace # -> its tokens."""
    row.trace.orders[choice.order] += 1
    row.trace.backoffs.update(choice.backed_off)
    row.trace.dynamic_kernel.update(choice.kernels)
    return choice.tokens


def conditional_dynamo(run):
    """DynaMo over conditional drafts (``dynamo.step.Prefix``): every row draws t+1 from the
    base's top-k (one read for the batch), then all rows go order by order, each order's
    conditionals for every row still going read at once (``_HeadConditionals``,
    ``_Eagle3Conditionals``)."""
    cfg, plan = run.cfg, run.plan
    k, temperature = min(cfg.sampling.top_k, run.vocab), cfg.sampling.grid_temperature
    eagle = Eagle3Chains(run) if plan.drafter == "eagle3" else None

    def propose(out, rows, anchors, live) -> Proposal:
        prefixes = [first_token(c[0], cfg, rows[j].seen_host, rows[j].rng)
                    for j, c in zip(live, candidates_of(out, live, anchors, range(1), k, temperature))]
        drafter = (_HeadConditionals(out, rows, anchors, live, prefixes, run) if eagle is None
                   else _Eagle3Conditionals(eagle, out, rows, anchors, live, prefixes))
        while going := [s for s, p in enumerate(prefixes) if p.wants(plan.order, cfg)]:
            for s, cand in zip(going, drafter.next(going, prefixes)):
                prefixes[s].extend(cand, cfg, run.table, rows[live[s]].seen_host, rows[live[s]].rng)
        commits = [_record(rows[j], p.choice()) for j, p in zip(live, prefixes)]
        return chain_step(commits, [run.no_drafts] * len(live), run.device)
    return propose


class _HeadConditionals:
    """Conditioned heads' conditionals: the pass deferred their layers (``plan.defer_heads``),
    which run here on every row's t+1 at once (``out.condition``); every head's top-k is read in
    one more transfer (a head reads token t+1 only: t+3's conditional is the same for any t+2)."""

    def __init__(self, out, rows, anchors, live, prefixes, run):
        cfg = run.cfg
        tokens = torch.zeros(len(rows), dtype=torch.long)  # rows not live: any token (they leave)
        tokens[live] = torch.tensor([p.tokens[0] for p in prefixes])
        out.condition(tokens.to(run.device))
        self.cands = candidates_of(out, live, anchors, range(1, run.plan.order), min(cfg.sampling.top_k, run.vocab),
                                   cfg.sampling.grid_temperature)  # per live row: heads 2..n

    def next(self, going: list[int], prefixes) -> list[Candidates]:
        """The top-k for the token after each going row's prefix (live slots ``going``)."""
        return [self.cands[s][len(prefixes[s].tokens) - 1] for s in going]


class _Eagle3Conditionals:
    """The eagle3 drafter's conditionals: every live row catches up and reads its t+1 in one
    pass (``Eagle3Chains.catch_up``), then each later order is one drafter step for all rows,
    the going ones on their last token (the others ride along on token 0 in a slot past their
    text, which the next catch-up writes again), and one read of the going rows' top-k."""

    def __init__(self, chains: Eagle3Chains, out, rows, anchors, live, prefixes):
        self.chains, self.out, self.run, self.heads = chains, out, chains.run, chains.heads
        self.logits, self.hidden = chains.catch_up(out, rows, anchors, [(j, p.tokens[0], 1) for j, p in zip(live, prefixes)])
        self.ctx = [chains.done[rows[j].index] for j in live]  # the step reading token x_{m} sits at ctx + m - 2

    def next(self, going: list[int], prefixes) -> list[Candidates]:
        run, dev, m = self.run, self.run.device, len(prefixes[going[0]].tokens)  # the going rows' prefix length
        if m > 1:
            start = run.clock()
            tokens = torch.zeros(len(prefixes), 1, dtype=torch.long)
            tokens[going, 0] = torch.tensor([prefixes[s].tokens[-1] for s in going])
            at = torch.tensor([[c + m - 2] for c in self.ctx], dtype=torch.long, device=dev)  # [R, 1]
            logits, self.hidden = self.heads.step(self.hidden, tokens.to(dev), self.chains.cache, at, span=max(self.ctx) + m - 1)
            self.logits = logits[:, 0]
            self.out.model_s += run.clock() - start  # the drafter's passes are model time
        cfg = run.cfg
        index = torch.tensor(going, dtype=torch.long, device=dev)
        cands = head_candidates(self.logits.index_select(0, index), min(cfg.sampling.top_k, self.logits.shape[-1]),
                                cfg.sampling.grid_temperature)  # draft ids
        ids = self.heads.to_target(torch.from_numpy(np.stack([c.ids for c in cands])).to(dev)).cpu().numpy()
        return [Candidates(i, c.probs) for i, c in zip(ids, cands)]


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
# add a slot at the next position (the layer's own pre-norm output and the previous draft),
# which the next catch-up overwrites, so the cache holds the text alone. This is the computation
# the training-time test trains (step i at position t+i-1 sees the first-step slots up to t and
# its own chain's later slots), which ``tests/decoding/test_eagle3.py`` checks against ``log_probs``.
#
# Rows are batched: one ``DraftCache`` holds every drafting row, slot s of a row its position s
# (``adapters/eagle3_layer.py``), so rows that kept different counts need no holes: the catch-up
# runs every row's new positions left-aligned in one pass (a shorter row's pad slots lie past
# its text, written again before any query of it reads them), then each draft step is one pass
# for all rows. A row whose chain is shorter (its budget's end) rides along and draws nothing
# more: its generator sees exactly the draws of its run alone. A row that drafts nothing this
# step never drafts again (its budget is spent), so it leaves the cache. No host read: the
# text's ids and the slots are the host's (copied to the device), the drafts and their q stay on
# the device until the verifier's one read per step.


class Eagle3Chains:
    """The eagle3 drafter as a chain's ``draft_rows(out, rows, anchors, jobs, run) -> [Drafts]``
    (the signature below): the rows of the jobs (j, first, g) catch up together, then draft
    their g tokens after ``first`` with one drafter pass per draft step for all of them."""

    def __init__(self, run):
        self.run, self.heads = run, run.model.heads
        self.cache = self.heads.new_cache()  # every drafting row's; cache row r is row ``order[r]``
        self.order: list[int] = []  # the caller's row index of each cache row
        self.done: dict[int, int] = {}  # the caller's row index -> text positions its cache row holds

    def __call__(self, out, rows, anchors, jobs, run) -> list[Drafts]:
        logits, hidden = self.catch_up(out, rows, anchors, jobs)  # [R, Vd], [R, 1, H]
        start, dev = run.clock(), run.device
        gs = [g for *_, g in jobs]
        ctx = [self.done[rows[j].index] for j, *_ in jobs]  # step i + 2 sits at position ctx + i
        contexts = [torch.tensor([first], dtype=torch.long, device=dev) for _, first, _ in jobs]  # the penalty's [1 + i]
        drafts, probs = [[] for _ in jobs], [[] for _ in jobs]
        for i in range(max(gs)):
            tok = self._pick(logits, [rows[j] for j, *_ in jobs], contexts, [g > i for g in gs], drafts, probs)  # [R]
            if i + 1 < max(gs):  # step i + 2, reading step i + 1's output and its draft
                at = torch.tensor([[c + i] for c in ctx], dtype=torch.long, device=dev)  # [R, 1]
                logits, hidden = self.heads.step(hidden, tok[:, None], self.cache, at, span=max(ctx) + i + 1)
                logits = logits[:, 0]
        out.model_s += run.clock() - start  # the drafter's passes are model time
        return [Drafts(torch.stack(d), torch.stack(q) if q else None) for d, q in zip(drafts, probs)]

    def _rows(self, index: list[int]) -> None:
        """Cache rows for the caller's rows ``index``, in that order: the others leave, a new one starts empty."""
        if index != self.order:
            self.cache.keep_rows([self.order.index(i) if i in self.order else -1 for i in index])
            self.done = {i: self.done.get(i, 0) for i in index}
            self.order = list(index)

    def catch_up(self, out, rows, anchors, jobs):
        """Every job's row (j, first, _) extended over the positions ``out`` kept up to ``anchors[j]``
        (its last kept slot), ``first`` the token after it, in one drafter pass # -> the first draft
        step at each anchor: logits [R, Vd], pre-norm output [R, 1, H]."""
        run, heads, dev = self.run, self.heads, self.run.device
        self._rows([rows[j].index for j, *_ in jobs])
        texts = [rows[j].prompt + rows[j].out_ids for j, *_ in jobs]  # each row's text up to its anchor's token
        dones = [self.done[i] for i in self.order]
        news = [len(text) - done for text, done in zip(texts, dones)]  # the positions the last pass kept
        for (j, *_), new, done, text in zip(jobs, news, dones, texts):
            if not 0 < new <= anchors[j] + 1:
                raise RuntimeError(f"the eagle3 drafter holds {done} positions of a {len(text)}-token text: "
                                   "a step kept no trunk states for the rest")
        start, width = run.clock(), max(news)
        # left-aligned: row r's new positions, then pads (the anchor's state, token 0) at the slots after them
        cols = [[anchors[j] + 1 - new + min(t, new - 1) for t in range(width)] for (j, *_), new in zip(jobs, news)]
        tokens = [text[done + 1:] + [first] + [0] * (width - new)
                  for text, done, (_, first, _), new in zip(texts, dones, jobs, news)]
        at = torch.tensor([[done + t for t in range(width)] for done in dones], dtype=torch.long, device=dev)  # [R, W]
        fused = heads.fuse(out.feats.layer_states, torch.tensor([j for j, *_ in jobs], device=dev),
                           torch.tensor(cols, dtype=torch.long, device=dev))  # [R, W, H]
        logits, hidden = heads.step(fused, torch.tensor(tokens, dtype=torch.long, device=dev), self.cache, at,
                                    span=max(dones) + width)  # [R, W, Vd], [R, W, H]
        for i, text in zip(self.order, texts):
            self.done[i] = len(text)
        rows_at, last = torch.arange(len(jobs), device=dev), torch.tensor([n - 1 for n in news], device=dev)
        out.model_s += run.clock() - start  # the drafter's passes are model time
        return logits[rows_at, last], hidden[rows_at, last][:, None]

    def _pick(self, logits: torch.Tensor, rows, contexts, drawing: list[bool], drafts, probs) -> torch.Tensor:
        """Each drawing row's next draft from the drafter's logits over its draft vocabulary
        # [R, Vd] -> tokens [R] (0 where a row draws no more), appended to ``drafts`` / ``probs``:
        greedy without a penalty the argmax; else drawn like any head's draft, by the row's own
        sampler, from the distribution over the whole vocabulary (probability 0 outside the draft one)."""
        plan, heads = self.run.plan, self.heads
        if plan.argmax_only:
            tok = heads.to_target(logits.argmax(-1))  # [R]
            for r in (r for r, on in enumerate(drawing) if on):
                drafts[r].append(tok[r])
            return tok
        logp = heads.target_log_probs(logits)  # [R, V]
        toks = []
        for r, row in enumerate(rows):
            if not drawing[r]:
                toks.append(torch.zeros((), dtype=torch.long, device=logits.device))
                continue
            t, q = draw_draft(logp[r], row, contexts[r], plan)
            drafts[r].append(t)
            if q is not None:
                probs[r].append(q)
            contexts[r] = torch.cat([contexts[r], t.reshape(1)])
            toks.append(t)
        return torch.stack(toks)


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
