"""Turning log-distributions into the distributions decoding samples from, and drawing from them."""

from __future__ import annotations

import torch


def processed_probs(logp: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """softmax(logp / T) restricted to the top-k (0 = whole vocabulary) # [..., V] -> [..., V].

    This is the *target* of ar / speculative sampling: lossless modes reproduce exactly it, and
    drafts from the heads are processed the same way (their q).
    """
    scaled = logp / temperature
    if 0 < top_k < logp.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.softmax(scaled, dim=-1)


class Sampler:
    """Greedy (argmax) or seeded multinomial draws; one object per decoding run."""

    def __init__(self, greedy: bool, temperature: float, top_k: int, seed: int = 0):
        self.greedy = greedy
        self.temperature = temperature
        self.top_k = top_k
        self.gen = torch.Generator().manual_seed(seed)

    def target(self, logp: torch.Tensor) -> torch.Tensor:
        """The distribution a token is drawn from # [..., V] log-probs -> [..., V] probs."""
        if self.greedy:
            return torch.softmax(logp, dim=-1)  # argmax is all greedy reads; keep real probs for traces
        return processed_probs(logp, self.temperature, self.top_k)

    def draw(self, probs: torch.Tensor) -> int:
        """One token from ``probs`` [V] (argmax when greedy)."""
        if self.greedy:
            return int(probs.argmax())
        return int(torch.multinomial(probs.float().cpu(), 1, generator=self.gen))

    def uniform(self, n: int) -> torch.Tensor:
        return torch.rand(n, generator=self.gen, dtype=torch.float64)
