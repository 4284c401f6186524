"""Metric primitives shared by ``multitoken eval`` and ``multitoken sweep``.

Everything here is a small pure function (tensors or token lists in, numbers out) so each
metric can be checked against a hand-computed value. Conventions:

- a head ``i`` (1-based) at position t predicts token t+i; its target exists iff t+i < T.
- PPL_n (DynaMo eq. 4) is exp of the mean NLL over the positions whose target exists; the
  paper writes 1/T in front of a sum of T-n terms, we divide by the number of terms so that
  PPL_1 is the ordinary perplexity.
- PPL_1:n scores the n-gram x_{t+1..t+n} under the heads' factorisation
  p(x_{t+1:t+n}) = prod_i p_i(x_{t+i}) (independent heads, DynaMo §3.1), over the positions
  where all n targets exist, normalised per token (1 / (n * count)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def perplexity(sum_nll: float, count: int) -> float:
    return math.exp(sum_nll / count) if count else float("nan")


def nucleus(probs: torch.Tensor, top_p: float = 0.99, max_size: int | None = None):
    """Smallest top set holding ``top_p`` of the mass, capped at ``max_size`` tokens.

    probs [N, V] -> (ids [N, K], probs [N, K] with 0 outside each row's set, size [N]).
    K is the largest set size in the batch (rows pad with zero-probability entries).
    """
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [N, V]
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each entry
    keep = before < top_p  # [N, V]: keep entries until top_p is reached (the crossing one included)
    size = keep.sum(-1)  # [N]
    if max_size is not None:
        size = size.clamp(max=max_size)
    width = int(size.max())
    cols = torch.arange(width, device=probs.device)
    inside = cols[None, :] < size[:, None]  # [N, K]
    return order[:, :width], torch.where(inside, sorted_p[:, :width], 0.0), size


def kl_divergence(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim from log-probabilities # [..., V] -> [...]."""
    return (logp.exp() * (logp - logq)).sum(-1)


def expected_accept_length(accs: Sequence[float]) -> float:
    """1 + sum_k prod_{i<=k} acc_i: expected tokens per step when draft i is kept only if
    drafts 1..i-1 were (the 1 is the token the base model itself emits every step)."""
    total, run = 1.0, 1.0
    for a in accs:
        run *= a
        total += run
    return total


def distinct_n(tokens: Sequence[int], n: int) -> float:
    """Unique n-grams / n-grams of one sequence (Li et al. 2016); 0 for a sequence shorter than n."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def repetition_rate(tokens: Sequence[int], n: int = 4) -> float:
    """Share of n-grams that repeat an earlier n-gram of the same sequence (Welleck et al.
    2019, seq-rep-n = 1 - distinct-n); 0 for a sequence shorter than n."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def mean_ci(values: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """Mean and a two-sided Student-t confidence interval over independent runs."""
    vals = [float(v) for v in values if not math.isnan(float(v))]
    n = len(vals)
    if n == 0:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0}
    mean = sum(vals) / n
    if n == 1:
        return {"mean": mean, "lo": mean, "hi": mean, "n": 1}
    from scipy.special import stdtrit  # Student-t quantile (what scipy.stats.t.ppf calls), a third of its import

    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    half = float(stdtrit(n - 1, 0.5 + level / 2)) * sd / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n}
