"""Marginalization baseline for token t+2 (Mehra et al. App. A.1, eq. 6), batched.

    p(x_{t+2} | x_<=t) = sum_y p(x_{t+2} | x_<=t, y) p(y | x_<=t)

over y in the top-``top_p`` nucleus of p(x_{t+1} | x_<=t), renormalised over that set. The
base model needs p(. | x_<=t, y) for every (t, y) pair; instead of one forward pass per pair
we append all candidates of a chunk of positions after the sequence and run ONE pass with a
custom 4-D attention mask: candidate (t, y) sits at position t+1, sees tokens 0..t of the
sequence and itself only. Each chunk re-runs the T sequence tokens (cheaper and more robust
than sharing a KV cache across chunks) and holds ``chunk`` candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from multitoken.pipeline.eval.metrics import nucleus


@dataclass
class MarginalOutput:
    logq: torch.Tensor  # [P, V] marginal log-distribution of token t+2 for each requested t
    nucleus_size: torch.Tensor  # [P] candidates y used at each position
    nucleus_mass: torch.Tensor  # [P] p(x_{t+1}) mass they hold (< top_p when capped)


def candidate_mask(seq_len: int, cand_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask for [sequence, candidates] # cand_pos [C] -> [1, 1, T + C, T + C].

    Sequence rows are causal; candidate c (placed after position cand_pos[c]) sees sequence
    tokens 0..cand_pos[c] and itself, never another candidate.
    """
    c = cand_pos.shape[0]
    n = seq_len + c
    allowed = torch.zeros(n, n, dtype=torch.bool, device=cand_pos.device)
    allowed[:seq_len, :seq_len] = torch.ones(seq_len, seq_len, dtype=torch.bool, device=cand_pos.device).tril()
    cols = torch.arange(seq_len, device=cand_pos.device)
    allowed[seq_len:, :seq_len] = cols[None, :] <= cand_pos[:, None]  # [C, T]
    idx = torch.arange(seq_len, n, device=cand_pos.device)
    allowed[idx, idx] = True
    mask = torch.zeros(n, n, dtype=dtype, device=cand_pos.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def _next_probs(backbone, ids: torch.Tensor, cand_tok: torch.Tensor, cand_pos: torch.Tensor) -> torch.Tensor:
    """Base-model p(. | x_<=t, y) for each candidate # ids [T], cand [C] -> [C, V]."""
    seq_len = ids.shape[0]
    tokens = torch.cat([ids, cand_tok])[None]  # [1, T + C]
    positions = torch.cat([torch.arange(seq_len, device=ids.device), cand_pos + 1])[None]  # [1, T + C]
    dtype = backbone.embeddings.weight.dtype
    mask = candidate_mask(seq_len, cand_pos, dtype if dtype.is_floating_point else torch.float32)
    out = backbone.decoder(input_ids=tokens, attention_mask=mask, position_ids=positions)
    hidden = out.last_hidden_state[0, seq_len:]  # [C, H], already final-normed
    return torch.softmax(backbone.logits(hidden).float(), dim=-1)


@torch.no_grad()
def marginal_second_token(
    backbone, ids: torch.Tensor, positions: torch.Tensor, *, top_p: float = 0.99,
    max_candidates: int | None = 256, chunk: int = 256, p1_logp: torch.Tensor | None = None,
) -> MarginalOutput:
    """Marginal distribution of token t+2 at each t in ``positions`` # ids [T], positions [P].

    ``p1_logp`` [P, V] (the base model's next-token log-probs at ``positions``) is computed
    when not given. ``max_candidates`` caps the nucleus (the mass actually covered is reported).
    """
    if p1_logp is None:
        hidden = backbone.decoder(input_ids=ids[None]).last_hidden_state[0, positions]  # [P, H]
        p1_logp = torch.log_softmax(backbone.logits(hidden).float(), -1)
    p1 = p1_logp.exp()  # [P, V]
    cand, prob, size = nucleus(p1, top_p, max_candidates)  # [P, K], [P, K], [P]
    keep = prob > 0
    row = torch.arange(len(positions), device=ids.device)[:, None].expand_as(cand)[keep]  # [N]
    tok, weight = cand[keep], prob[keep]  # [N]
    q = torch.zeros(len(positions), p1.shape[-1], dtype=torch.float32, device=ids.device)
    for start in range(0, tok.shape[0], chunk):
        sl = slice(start, start + chunk)
        p2 = _next_probs(backbone, ids, tok[sl], positions[row[sl]]).mul_(weight[sl, None].float())  # [C, V]
        q.index_add_(0, row[sl], p2)
    mass = prob.sum(-1)  # [P]
    logq = (q / mass[:, None]).clamp_min(1e-30).log()  # renormalised over the nucleus
    return MarginalOutput(logq=logq, nucleus_size=size, nucleus_mass=mass)
