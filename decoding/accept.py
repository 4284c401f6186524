"""Verification of drafts by the base model: one function per rule, one signature.

``accept(drafts, draft_probs, target_probs, sampler) -> Verdict``
- drafts [g] token ids proposed for positions 1..g after the last committed token,
- draft_probs [g, V] the distributions they were drawn from (q; None for greedy drafts),
- target_probs [g + 1, V] the base model's (processed) distributions after the last committed
  token and after each draft: row i judges draft i, row g gives the bonus token.
The verdict is how many drafts are kept and the token that follows them (the bonus token, or
the replacement of the first rejected draft), which is final.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    """How many drafts are kept and the token after them, as 0-d long tensors on the target's
    device: deciding them never waits for the device. ``host()`` reads both (one transfer); the
    loop reads them together with the drafts instead (``packed``)."""

    accepted_t: torch.Tensor  # [] long
    next_token_t: torch.Tensor  # [] long

    @property
    def packed(self) -> torch.Tensor:
        """[accepted, next_token] # [2] long on the device."""
        return torch.stack([self.accepted_t, self.next_token_t])

    def host(self) -> tuple[int, int]:
        accepted, next_token = self.packed.tolist()
        return accepted, next_token

    @property
    def accepted(self) -> int:
        return self.host()[0]

    @property
    def next_token(self) -> int:
        return self.host()[1]


def _leading_true(ok: torch.Tensor) -> torch.Tensor:
    """Length of the run of True at the start of ``ok`` [g] # -> [] long, on ``ok``'s device."""
    return ok.long().cumprod(0).sum()


def _row(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """x[i] for a 0-d device index # [R, V] -> [V] (index_select: no host read of ``i``)."""
    return x.index_select(0, i.reshape(1))[0]


def greedy_accept(drafts, draft_probs, target_probs, sampler) -> Verdict:
    """Keep drafts while they equal the base model's argmax; then the base argmax."""
    best = target_probs.argmax(-1)  # [g + 1]
    m = _leading_true(drafts == best[: drafts.numel()])
    return Verdict(m, _row(best[:, None], m)[0])


def speculative_accept(drafts, draft_probs, target_probs, sampler) -> Verdict:
    """Leviathan et al.: keep draft i with probability min(1, p_i(d)/q_i(d)); at the first
    rejection draw from norm(max(0, p_i - q_i)); if all are kept draw the bonus from p_g.
    The emitted tokens are then distributed exactly as the target (Leviathan et al.).
    Branch-free on the device: the residual of every row is formed, row m is drawn from."""
    if sampler.greedy:
        return greedy_accept(drafts, draft_probs, target_probs, sampler)
    g = drafts.numel()
    rows = torch.arange(g, device=drafts.device)
    p = target_probs[rows, drafts].double()  # [g]
    q = draft_probs[rows, drafts].double()  # [g] > 0: each draft was drawn from its q
    m = _leading_true(sampler.uniform(g) * q < p)  # u < p/q without dividing
    target = target_probs.double()  # [g + 1, V]
    residual = (target[:g] - draft_probs.double()).clamp_(min=0)  # [g, V]
    mass = residual.sum(-1, keepdim=True)  # [g, 1]
    # p == q up to rounding: rejection had probability ~0, draw from p
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-300), target[:g])
    return Verdict(m, sampler.draw(_row(torch.cat([residual, target[g:]]), m)))


def typical_accept(drafts, draft_probs, target_probs, sampler, eps: float = 0.09, delta: float = 0.3,
                   rule_probs=None) -> Verdict:
    """Medusa's typical acceptance: keep draft i if p_i(d) > min(eps, delta * exp(-H(p_i)));
    the token after the kept drafts is drawn from the target (argmax when greedy). Lossy.
    Medusa's p is softmax(logits / T) over the whole vocabulary (its sampling has no top-k):
    ``rule_probs`` [g(+1), V] is that distribution (with the repetition penalty, as every
    target here), the loop passes it; it defaults to ``target_probs``."""
    g = drafts.numel()
    p = (target_probs if rule_probs is None else rule_probs)[:g].double()  # [g, V]
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # [g]
    bound = torch.clamp(delta * torch.exp(-entropy), max=eps)
    m = _leading_true(p[torch.arange(g, device=drafts.device), drafts] > bound)
    return Verdict(m, sampler.draw(_row(target_probs, m)))


def typical_rule(eps: float, delta: float):
    """``typical_accept`` with its thresholds bound, in the common signature (plus the
    whole-vocabulary distribution its rule reads: ``wants_rule_probs``)."""
    if not (0 < eps <= 1 and delta > 0 and math.isfinite(delta)):
        raise ValueError("typical acceptance needs 0 < eps <= 1 and delta > 0")

    def accept(d, q, p, s, rule_probs=None):
        return typical_accept(d, q, p, s, eps=eps, delta=delta, rule_probs=rule_probs)

    accept.wants_rule_probs = True
    return accept
