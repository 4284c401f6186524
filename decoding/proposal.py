"""Proposals: where the tokens fed in the next forward pass come from. One signature per kind.

``draft(out, anchor, first, g, run) -> Drafts``: up to ``g`` speculative drafts for the positions
after ``first`` (the token already decided for the anchor's next position), with the
distributions they were drawn from. ``out`` is the last ``StepOutput``; ``anchor`` the position in
it whose head distributions predict ``first``, ``first+1``, ...; ``run`` the ``RunState`` of the
loop (config, sampler, stats table, context).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .dynamo import Candidates, head_candidates, joint_cells, sample_index
from .sampling import with_tokens
from multitoken.base.errors import UsageError


@dataclass
class Drafts:
    tokens: torch.Tensor  # [g] int64 on the target's device
    probs: torch.Tensor | None  # [g, V] the q each draft was drawn from (None: greedy drafts)

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> "Drafts":
        return Drafts(torch.zeros(0, dtype=torch.long, device=device), None)


class HeadScores:
    """The n heads' scores at ``anchor``, each read on first use # i -> [V]: raw logits where the
    step has them (the base and layer heads: DynaMo reads only their top-k, so no log-softmax
    over the vocabulary), log-probs from one-position heads (Medusa, CP), which make them so."""

    def __init__(self, out, anchor: int, n: int):
        self.out, self.anchor, self.n, self.cache = out, anchor, n, {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self.cache:
            out, pos = self.out, self.anchor
            if i in out.hiddens:
                self.cache[i] = out._head_row(i, pos)[0]
            elif i == 0:
                self.cache[i] = out.base_logits()[0, pos - out.first]
            else:
                self.cache[i] = out.head_log_probs(i, pos)[0]
        return self.cache[i]


def _draw(logp: torch.Tensor, run, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft from a head's scores (raw logits or log-probs: the same distribution), processed
    like the target # [V] -> (id [], q [V]).
    ``context`` [j] (on the device): the tokens between the committed context and this draft
    (``first`` and the earlier drafts), penalised like the context, as the verification row
    judging it does. Greedy drafts have no q: greedy verification compares tokens only."""
    seen = with_tokens(run.seen, context) if run.sampler.penalty != 1 else run.seen
    return run.sampler.draft(logp, seen)


def _pack(tokens: list[torch.Tensor], probs: list[torch.Tensor | None], device) -> Drafts:
    """Drafts from 0-d device ids (stacked where they are: no host round trip)."""
    if not tokens:
        return Drafts.empty(device)
    probs = [q for q in probs if q is not None]
    return Drafts(torch.stack(tokens), torch.stack(probs) if probs else None)


def independent_drafts(out, anchor: int, first: int, g: int, run) -> Drafts:
    """Head i+1 drafts token t+i+1 on its own (the heads ignore ``first``). Layer heads draft
    from their raw logits: the target's processing (top-k first) makes the distribution, so no
    log-softmax over the vocabulary is spent per head."""
    context = torch.tensor([first], dtype=torch.long, device=run.seen.device)  # [1 + i]
    scores = HeadScores(out, anchor, g + 1)
    tokens, probs = [], []
    for i in range(1, g + 1):
        tok, q = _draw(scores[i], run, context)
        tokens.append(tok)
        probs.append(q)
        context = torch.cat([context, tok.reshape(1)])
    return _pack(tokens, probs, run.seen.device)


def cp_drafts(out, anchor: int, first: int, g: int, run) -> Drafts:
    """CP experts, sequentially (the CP-heads paper, eqs. 11-13): the expert weights are updated by every
    token already chosen, ``first`` included, before the next token is drawn."""
    heads = run.model.heads
    e = out.anchor_hidden(anchor)  # [1, H]
    prefix = torch.tensor([[first]], dtype=torch.long, device=e.device)  # [1, 1 + i]
    clock = getattr(out, "clock", time.perf_counter)
    tokens, probs = [], []
    for _ in range(g):
        start = clock()
        logp = heads.conditional_log_probs(e, prefix)[0]  # [V]
        out.model_s += clock() - start
        tok, q = _draw(logp, run, prefix[0])
        tokens.append(tok)
        probs.append(q)
        prefix = torch.cat([prefix, tok.reshape(1, 1)], 1)
    return _pack(tokens, probs, e.device)


def joint_drafts(out, anchor: int, first: int, g: int, run) -> Drafts:
    """Drafts from DynaMo's co-occurrence-masked joint (eq. 6) conditioned on ``first``:
    J(x2..x_{g+1} | first) ~ prod_i p_i(x_i) * ratio(first, x2, ...)^alpha_c over the heads' top-k,
    with the repetition penalty, drawn axis by axis (each draft's q is its conditional).
    No thresholds: they exist to back off, and here the verifier already guards the output.
    Without a table this is the independent drafter."""
    cfg = run.cfg
    k = min(cfg.draft_k, cfg.top_k, run.vocab_size)  # a draft outside the target's top-k is always rejected
    temperature = cfg.temperature if cfg.temperature > 0 else 1.0
    cands = [Candidates(np.array([first]), np.ones(1, dtype=np.float32))]
    ready, run.candidates = getattr(run, "candidates", None), None  # a batch reads every row's top-k at once
    if ready is not None and len(ready) >= g:
        cands += ready[:g]
    else:
        heads = HeadScores(out, anchor, g + 1)
        rows = torch.stack([heads[i] for i in range(1, g + 1)])  # [g, V] raw logits: only their top-k is read
        cands += head_candidates(rows, k, temperature)  # one top-k call, one host transfer
    cells = joint_cells(cands, run.draft_cfg, run.table, run.seen_array())
    run.kernels[cells.kernel] += 1
    grid = cells.dense()[0]  # [k]*g: the marginals below sum it whole, as ever
    tokens, marginals = [], []
    for axis in range(1, g + 1):
        marginal = grid.reshape(grid.shape[0], -1).sum(-1, dtype=np.float64)  # [k]
        if not marginal.sum() > 0:
            break
        if run.sampler.greedy:  # greedy verification reads the drafts only, not their q
            i = int(marginal.argmax())
        else:  # drawn on the host from the host grid (seeded numpy): no device read per axis
            i = sample_index(marginal, run.rng)
            marginals.append(marginal / marginal.sum())
        tokens.append(int(cands[axis].ids[i]))
        grid = grid[i]
    device = run.seen.device
    return Drafts(torch.tensor(tokens, dtype=torch.long, device=device), _draft_q(cands, marginals, run))


def _draft_q(cands: list[Candidates], marginals: list[np.ndarray], run) -> torch.Tensor | None:
    """The conditionals the drafts were drawn from, on the target's device # [j, V] float32:
    each axis's [k] marginal scattered to its candidate ids (one copy of each to the device)."""
    if not marginals:
        return None
    j, device = len(marginals), run.sampler.device
    ids = torch.from_numpy(np.stack([c.ids for c in cands[1:j + 1]])).to(device)  # [j, k]
    q = torch.zeros(j, run.vocab_size, dtype=torch.float64, device=device)
    return q.scatter_(1, ids, torch.from_numpy(np.stack(marginals)).to(device)).float()


DRAFTERS = {"independent": independent_drafts, "cp": cp_drafts, "joint": joint_drafts}


def pick_drafter(name: str, heads, table=None):
    """``auto``: CP heads draft sequentially; other heads from the masked joint when a
    co-occurrence table is at hand (it raises acceptance), else independently."""
    sequential = getattr(heads, "supports_sequential_drafts", False)
    if name == "auto":
        name = "cp" if sequential else "joint" if table is not None else "independent"
    if name == "cp" and not sequential:
        raise UsageError(f"--drafter cp needs cp heads, these are {heads.config.head_type!r}", "use --drafter independent or joint")
    return DRAFTERS[name]
