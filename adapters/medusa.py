"""Medusa heads: per future token, residual blocks ``h <- h + SiLU(W h + b)`` on the
base model's final (normalised) hidden state, then the shared, frozen unembedding.

W and b start at zero, so every head initially predicts exactly what head 1 (the base) does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .base import Features, HeadAdapter, head_dtype
from .registry import register_head
from multitoken.base.errors import UsageError


@dataclass
class MedusaConfig:
    head_type: str = "medusa"
    n_future: int = field(default=3, metadata={"help": "tokens predicted per position (head 1 = the base model)"})
    num_blocks: int = field(default=1, metadata={"help": "residual SiLU blocks per head"})

    def validate(self) -> None:
        if self.num_blocks < 1:
            raise UsageError(f"num_blocks must be >= 1, got {self.num_blocks}")


class ResidualSiLU(nn.Module):
    """``h + SiLU(W h + b)`` with W, b zero-initialised (the block starts as the identity)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + nn.functional.silu(self.linear(h))  # [..., H]


class MedusaHeads(HeadAdapter):
    def __init__(self, config: MedusaConfig, backbone):
        super().__init__(config, backbone)
        width = backbone.hidden_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResidualSiLU(width) for _ in range(config.num_blocks)])
            for _ in range(config.n_future - 1)
        ).to(device=backbone.device, dtype=head_dtype(backbone))

    def hidden(self, index: int, feats: Features, cache=None) -> torch.Tensor:
        if index == 0:
            return feats.base
        return self.blocks[index - 1](feats.base)  # [B, T, H]

    def log_probs(self, index: int, feats: Features, last_only: bool = False) -> torch.Tensor:
        # Medusa reads one position only: slice before the blocks (cheap decoding steps).
        if last_only:
            feats = Features(feats.trunk, feats.base[:, -1:], feats.layer_states, feats.ctx)
        return super().log_probs(index, feats, last_only=False)


register_head("medusa", MedusaConfig, MedusaHeads)
