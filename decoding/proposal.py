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

from .dynamic import joint_grid, top_candidates


@dataclass
class Drafts:
    tokens: torch.Tensor  # [g] int64
    probs: torch.Tensor | None  # [g, V] the q each draft was drawn from (None: greedy drafts)

    @staticmethod
    def empty() -> "Drafts":
        return Drafts(torch.zeros(0, dtype=torch.long), None)


def _draw(logp: torch.Tensor, run) -> tuple[int, torch.Tensor]:
    """A draft from a head's log-distribution, processed like the target # [V] -> (id, q [V])."""
    q = run.sampler.target(logp)
    return run.sampler.draw(q), q


def _pack(tokens: list[int], probs: list[torch.Tensor]) -> Drafts:
    if not tokens:
        return Drafts.empty()
    return Drafts(torch.tensor(tokens, dtype=torch.long), torch.stack(probs))


def independent_drafts(out, anchor: int, first: int, g: int, run) -> Drafts:
    """Head i+1 drafts token t+i+1 on its own (the heads ignore ``first``)."""
    tokens, probs = [], []
    for i in range(1, g + 1):
        tok, q = _draw(out.head_log_probs(i, anchor)[0], run)
        tokens.append(tok)
        probs.append(q)
    return _pack(tokens, probs)


def cp_drafts(out, anchor: int, first: int, g: int, run) -> Drafts:
    """CP experts, sequentially (seed 000 eqs. 11-13): the expert weights are updated by every
    token already chosen, ``first`` included, before the next token is drawn."""
    heads = run.model.heads
    e = out.anchor_hidden(anchor)  # [1, H]
    prefix = torch.tensor([[first]], dtype=torch.long, device=e.device)  # [1, 1]
    tokens, probs = [], []
    for _ in range(g):
        start = time.perf_counter()
        logp = heads.conditional_log_probs(e, prefix)[0]  # [V]
        out.model_s += time.perf_counter() - start
        tok, q = _draw(logp, run)
        tokens.append(tok)
        probs.append(q)
        prefix = torch.cat([prefix, prefix.new_tensor([[tok]])], 1)
    return _pack(tokens, probs)


def joint_drafts(out, anchor: int, first: int, g: int, run) -> Drafts:
    """Drafts from DynaMo's joint grid (masked, thresholded) conditioned on ``first``: the grid's
    slice at ``first`` is drawn axis by axis, each draft's q being that slice's conditional."""
    cfg = run.cfg
    k = min(cfg.top_k or 50, run.vocab_size)
    temperature = cfg.temperature if cfg.temperature > 0 else 1.0
    cands = [top_candidates(out.head_log_probs(i, anchor)[0], k, temperature) for i in range(g + 1)]
    hit = np.flatnonzero(cands[0].ids == first)
    if hit.size == 0:  # the grid has nothing to say after a token outside head 1's top-k
        return independent_drafts(out, anchor, first, g, run)
    grid = joint_grid(cands, cfg, run.table, run.seen)[hit[0]]  # [k]*g
    tokens, probs = [], []
    for axis in range(1, g + 1):
        marginal = grid.reshape(grid.shape[0], -1).sum(-1)  # [k]
        if not marginal.sum() > 0:
            break
        q = torch.zeros(run.vocab_size, dtype=torch.float64)
        q[torch.from_numpy(cands[axis].ids)] = torch.from_numpy(marginal / marginal.sum())
        i = int(marginal.argmax()) if run.sampler.greedy else int(torch.multinomial(q[torch.from_numpy(cands[axis].ids)], 1, generator=run.sampler.gen))
        tokens.append(int(cands[axis].ids[i]))
        probs.append(q.float())
        grid = grid[i]
    return _pack(tokens, probs)


DRAFTERS = {"independent": independent_drafts, "cp": cp_drafts, "joint": joint_drafts}


def pick_drafter(name: str, heads):
    """``auto``: CP heads draft sequentially, every other type independently."""
    if name == "auto":
        name = "cp" if hasattr(heads, "conditional_log_probs") else "independent"
    if name == "cp" and not hasattr(heads, "conditional_log_probs"):
        from multitoken.pipeline.errors import UsageError

        raise UsageError(f"--drafter cp needs cp heads, these are {heads.config.head_type!r}", "use --drafter independent or joint")
    return DRAFTERS[name]
