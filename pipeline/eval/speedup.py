"""Speculative-decoding speed-up theory (speculative sampling, Leviathan et al. 2023).

With acceptance rate ``a`` (expected probability a draft token is accepted), ``g`` draft
tokens per step and ``c`` the cost of one draft call relative to one base-model call:

    E[tokens per step]     = (1 - a^(g+1)) / (1 - a)
    wall-time improvement  = (1 - a^(g+1)) / ((1 - a) (g c + 1))
    operations increase    = (1 - a) (g c_hat + g + 1) / (1 - a^(g+1))

``c_hat`` is the draft's arithmetic cost per token relative to the base model's. At a = 1
the geometric sum is g + 1 (the limit), handled explicitly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


def expected_tokens(a: float, g: int) -> float:
    """Expected tokens emitted per base-model call # = max(Geom(1 - a), g + 1) in mean."""
    _check(a, g)
    if a == 1.0:
        return float(g + 1)
    return (1.0 - a ** (g + 1)) / (1.0 - a)


def walltime_improvement(a: float, g: int, c: float = 0.0) -> float:
    return expected_tokens(a, g) / (g * c + 1.0)


def operations_factor(a: float, g: int, c_hat: float = 0.0) -> float:
    return (g * c_hat + g + 1.0) / expected_tokens(a, g)


def acceptance_from_tokens(tokens_per_step: float, g: int, tol: float = 1e-10) -> float:
    """Invert ``expected_tokens`` for ``a`` (bisection; it increases with a), so a measured
    tokens-per-forward can be set against the theory."""
    if not 1.0 <= tokens_per_step <= g + 1:
        raise ValueError(f"tokens per step {tokens_per_step} outside [1, {g + 1}]")
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, g) < tokens_per_step else (lo, mid)
    return (lo + hi) / 2


@dataclass
class SpeedupRow:
    a: float
    g: int
    c: float
    c_hat: float
    tokens_per_step: float
    speed: float
    operations: float


def speedup_row(a: float, g: int, c: float = 0.0, c_hat: float = 0.0) -> SpeedupRow:
    return SpeedupRow(a, g, c, c_hat, expected_tokens(a, g), walltime_improvement(a, g, c), operations_factor(a, g, c_hat))


def draft_cost_ratio(model) -> float:
    """c for multi-token heads: one draft's cost relative to one base forward, estimated as the
    head parameters per draft over the base model's parameters (FLOPs per token scale with them)."""
    g = max(model.n_future - 1, 1)
    heads = sum(p.numel() for p in model.heads.parameters())
    base = sum(p.numel() for p in model.backbone.causal_lm.parameters())
    return heads / g / base


def theory_from_tokens(tokens_per_step: float, g: int, c: float = 0.0) -> dict:
    """The acceptance a a measured tokens-per-step implies (clamped to [1, g + 1]) and what the
    formulas then predict for the wall time and the operations (c_hat = c)."""
    if g < 1:
        return asdict(SpeedupRow(0.0, 0, c, c, 1.0, 1.0, 1.0))
    a = acceptance_from_tokens(min(max(tokens_per_step, 1.0), g + 1.0), g)
    return asdict(speedup_row(a, g, c, c))


def _check(a: float, g: int) -> None:
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {a}")
    if g < 0:
        raise ValueError(f"draft length must be >= 0, got {g}")
