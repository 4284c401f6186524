"""Dynamic multi-token perplexity PPL_d (DynaMo §3.3.2, App. C.4) at given eps_b values.

How a step is scored (teacher forcing on the reference text x):
1. The cursor t starts at the first position of a sequence; heads 1..n at t give p_i(x_{t+i})
   (one full-sequence pass yields them at every position).
2. The step's order m is the decoding engine's own dynamic decision
   (``decoding.dynamo.dynamic_propose`` with the sweep's settings, greedy, the reference
   context x_<=t as the repetition-penalty history): it depends on the model's joint grid only,
   never on the reference tokens, exactly as during generation. m is capped by the tokens left.
3. The step scores the reference n-gram under the heads' full distributions at temperature 1:
   log p(x_{t+1:t+m}) = sum_{i<=m} log p_i(x_{t+i}). (The thresholded top-k grid would give
   reference tokens outside it zero mass, i.e. infinite perplexity, so it decides m only.)
4. The cursor moves to t+m. PPL_d = exp(-sum of step scores / tokens scored); the mean tokens
   per step is tokens scored / steps. eps_b = 1 gives PPL_1 over the walked tokens.
Only the first ``dynamic_tokens`` tokens are walked (each step builds a k^n grid).

The walk reads only the heads' top-k: the candidates (top-k ids and tempered probabilities, as
``dynamo.head_candidates`` makes them) of every position of a batch's rows are made in one call
per head from the stored top-k, so the steps of every row and eps_b do no tensor work at all.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.dynamo import Candidates, dynamic_propose, head_candidates


class DynamicPPL:
    """Collects per-head top-k and reference log-probs, then walks each sequence per eps_b."""

    def __init__(self, eps_b, model, decode_cfg=None, table=None, budget: int = 4096):
        self.eps_b = list(eps_b)
        self.n = model.n_future
        self.cfg = decode_cfg or DecodeConfig(mode="dynamic")
        self.k = min(self.cfg.sampling.top_k or 50, model.backbone.vocab_size)
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
        if not tops or self.full:
            return
        rows = min(ids.shape[0], -(-(self.budget - self.walked) // ids.shape[1]))  # the rows the budget reaches
        cands = [self._candidates(vals[:rows], idx[:rows]) for vals, idx, _ in tops]  # heads x [rows][T]
        for b in range(rows):
            row = ids[b].cpu()
            for e in self.eps_b:
                self._walk(row, [c[b] for c in cands], [r[b] for _, _, r in tops], e)
            self.walked += row.numel()

    def _candidates(self, vals: torch.Tensor, idx: torch.Tensor) -> list[list[Candidates]]:
        """Every position's candidates for one head # [R, T, k] -> R x T: one top-k call over the
        stored top-k (re-sorted as the proposal sorts them), ids mapped back to the vocabulary."""
        temperature = self.cfg.sampling.grid_temperature
        r, t, k = vals.shape
        flat = head_candidates(vals.reshape(r * t, k), k, temperature)
        ids = idx.reshape(r * t, k).numpy()
        out = [Candidates(ids[j][c.ids], c.probs) for j, c in enumerate(flat)]
        return [out[b * t:(b + 1) * t] for b in range(r)]

    def _walk(self, row: torch.Tensor, cands, ref, eps_b: float) -> None:
        from dataclasses import replace

        cfg = replace(self.cfg, eps_b=eps_b)
        seen = np.zeros(self.vocab, dtype=bool)
        t, last = 0, row.numel() - 1  # the last position has no target left
        acc = self.sums[eps_b]
        seen[int(row[0])] = True
        while t < last:
            n = min(self.n, last - t)
            at = [cands[i][t] for i in range(n)]
            m = dynamic_propose(at, n, cfg, self.table, seen, None).order if n > 1 else 1
            acc[0] -= float(sum(ref[i][t] for i in range(m)))
            acc[1] += m
            acc[2] += 1
            seen[row[t + 1: t + m + 1].numpy()] = True
            t += m

    def report(self) -> list[dict]:
        rows = []
        for e in self.eps_b:
            nll, tokens, steps = self.sums[e]
            rows.append({"eps_b": e, "ppl_d": math.exp(nll / tokens) if tokens else float("nan"),
                         "tokens_per_step": tokens / steps if steps else float("nan"), "tokens": tokens, "steps": steps})
        return rows
