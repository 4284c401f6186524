"""Dynamic multi-token perplexity PPL_d (DynaMo §3.3.2, App. C.4) at given eps_b values.

How a step is scored (teacher forcing on the reference text x):
1. The cursor t starts at the first position of a sequence; heads 1..n at t give p_i(x_{t+i})
   (one full-sequence pass yields them at every position).
2. The step's order m is the decoding engine's own dynamic decision
   (``decoding.dynamic.dynamic_propose`` with the sweep's settings, greedy, the reference
   context x_<=t as the repetition-penalty history): it depends on the model's joint grid only,
   never on the reference tokens, exactly as during generation. m is capped by the tokens left.
3. The step scores the reference n-gram under the heads' full distributions at temperature 1:
   log p(x_{t+1:t+m}) = sum_{i<=m} log p_i(x_{t+i}). (The thresholded top-k grid would give
   reference tokens outside it zero mass, i.e. infinite perplexity, so it decides m only.)
4. The cursor moves to t+m. PPL_d = exp(-sum of step scores / tokens scored); the mean tokens
   per step is tokens scored / steps. eps_b = 1 gives PPL_1 over the walked tokens.
Only the first ``dynamic_tokens`` tokens are walked (each step builds a k^n grid).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.dynamic import dynamic_propose


class DynamicPPL:
    """Collects per-head top-k and reference log-probs, then walks each sequence per eps_b."""

    def __init__(self, eps_b, model, decode_cfg=None, table=None, budget: int = 4096):
        self.eps_b = list(eps_b)
        self.n = model.n_future
        self.cfg = decode_cfg or DecodeConfig(mode="dynamic")
        self.k = min(self.cfg.top_k or 50, model.backbone.vocab_size)
        self.vocab = model.backbone.vocab_size
        self.table = table
        self.budget = budget
        self.walked = 0
        self.sums = {e: [0.0, 0, 0] for e in self.eps_b}  # eps_b -> [nll, tokens, steps]
        self._top: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    @property
    def full(self) -> bool:
        return self.walked >= self.budget

    def add_head(self, i: int, sc) -> None:
        """Head i's ``HeadScores`` (with top-k): the top-k is all the proposal reads, and the
        reference targets' log-probs score the steps (padded with zeros past the end)."""
        if self.full:
            return
        ref = torch.zeros(sc.top_vals.shape[:2], dtype=torch.float64)  # [B, T]
        ref[:, : sc.lp.shape[1]] = sc.lp.double().cpu()
        self._top.append((sc.top_vals.cpu(), sc.top_ids.cpu(), ref))

    def end_batch(self, ids: torch.Tensor) -> None:
        tops, self._top = self._top, []
        for b in range(ids.shape[0]):
            if self.full or not tops:
                break
            row = ids[b].cpu()
            for e in self.eps_b:
                self._walk(row, [(v[b], x[b]) for v, x, _ in tops], [r[b] for _, _, r in tops], e)
            self.walked += row.numel()

    def _walk(self, row: torch.Tensor, tops, ref, eps_b: float) -> None:
        from dataclasses import replace

        cfg = replace(self.cfg, eps_b=eps_b)
        seen = np.zeros(self.vocab, dtype=bool)
        t, last = 0, row.numel() - 1  # the last position has no target left
        acc = self.sums[eps_b]
        seen[int(row[0])] = True
        while t < last:
            n = min(self.n, last - t)
            logps = [self._sparse(*tops[i], t) for i in range(n)]
            m = dynamic_propose(logps, cfg, self.table, seen, None).order if n > 1 else 1
            acc[0] -= float(sum(ref[i][t] for i in range(m)))
            acc[1] += m
            acc[2] += 1
            seen[row[t + 1: t + m + 1].numpy()] = True
            t += m

    def _sparse(self, vals: torch.Tensor, idx: torch.Tensor, t: int) -> torch.Tensor:
        """A [V] log-distribution with only position t's top-k entries (everything else -inf):
        its top-k, hence the proposal built from it, is that of the full distribution."""
        out = torch.full((self.vocab,), -math.inf)
        out[idx[t]] = vals[t].float()
        return out

    def report(self) -> list[dict]:
        rows = []
        for e in self.eps_b:
            nll, tokens, steps = self.sums[e]
            rows.append({"eps_b": e, "ppl_d": math.exp(nll / tokens) if tokens else float("nan"),
                         "tokens_per_step": tokens / steps if steps else float("nan"), "tokens": tokens, "steps": steps})
        return rows
