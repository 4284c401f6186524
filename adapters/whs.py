"""Weighted-hidden-states heads (Mehra et al. eq. 5).

Head n's input is ``softmax(W_s^n / T) . Z^{1:L-1}``: a learned convex combination of every
trunk layer's output (T = 0.1, weights initialised equal), fed to a replicated layer and the
shared final norm + unembedding. By default heads 2..n use it and head 1 stays the base path;
``all_heads`` is the paper's variant where head 1 also reads the weighted states (through a
copy of the final layer), so head 1 is then NOT the base model any more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .base import Features, head_dtype
from .layers import INITS
from .registry import register_head
from .layer_heads import LayerHeads
from multitoken.base.errors import UsageError


@dataclass
class WHSConfig:
    head_type: str = "whs"
    n_future: int = field(default=3, metadata={"help": "tokens predicted per position (head 1 = the base model)"})
    init: str = field(default="copy", metadata={"help": "head layers start as copies of the final layer or random", "choices": INITS})
    temperature: float = field(default=0.1, metadata={"help": "softmax temperature T of the layer weights"})
    init_weight: float = field(default=0.1, metadata={"help": "initial value of every layer weight (equal weights)"})
    all_heads: bool = field(default=False, metadata={"help": "head 1 also reads weighted states (head 1 then differs from the base)"})

    def validate(self) -> None:
        if self.init not in INITS:
            raise UsageError(f"unknown init {self.init!r}", f"use one of {', '.join(INITS)}")
        if not self.temperature > 0:
            raise UsageError(f"temperature must be > 0, got {self.temperature}")


class WHSHeads(LayerHeads):
    needs_layer_states = True

    def __init__(self, config: WHSConfig, backbone):
        self.first = 0 if config.all_heads else 1  # index of the first head reading weighted states
        super().__init__(config, backbone, config.n_future - self.first)
        self.head1_is_base = not config.all_heads
        n_states = backbone.num_layers - 1  # Z^{1:L-1}: outputs of the trunk layers
        # One weight vector per WHS head, all entries equal: the initial mix is the plain mean.
        init = torch.full((len(self.layers), n_states), float(config.init_weight), dtype=head_dtype(backbone))
        self.layer_weights = nn.Parameter(init.to(backbone.device))

    @property
    def first_layer_head(self) -> int:
        return self.first

    def mixing(self, head: int) -> torch.Tensor:
        """softmax(W_s / T) for WHS head ``head`` (0-based among WHS heads) # [L-1]."""
        return torch.softmax(self.layer_weights[head].float() / self.config.temperature, dim=-1)

    def weighted_input(self, head: int, feats: Features) -> torch.Tensor:
        """sum_l softmax(W/T)_l Z_l # (L-1) x [B, T, H] -> [B, T, H]."""
        weights = self.mixing(head).to(feats.layer_states[0].dtype)
        mixed = weights[0] * feats.layer_states[0]
        for w, z in zip(weights[1:], feats.layer_states[1:]):
            mixed = mixed + w * z  # accumulate: no [L-1, B, T, H] stack
        return mixed

    def hidden(self, index: int, feats: Features, cache=None) -> torch.Tensor:
        if index < self.first:
            return feats.base  # head 1 is the original final layer, run by the pipeline
        head = index - self.first
        return self.run_head_layer(self.layers[head], self.weighted_input(head, feats), feats, cache)


register_head("whs", WHSConfig, WHSHeads)
