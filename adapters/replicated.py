"""Replicated final-layer heads (Mehra et al. §3, DynaMo §3.1 "T3").

The backbone is layers[:-1]; head 1 IS the original final layer (so it reproduces the base
model exactly); heads 2..n are new layers of the same class fed the same trunk output,
initialised as copies of the final layer (DynaMo "(C)") or randomly (Mehra et al.). The final
norm and the unembedding are the base model's, shared and frozen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .base import Features, HeadAdapter
from .layers import INITS, new_layer_like_final
from .registry import register_head
from multitoken.pipeline.base.errors import UsageError


@dataclass
class ReplicatedConfig:
    head_type: str = "replicated"
    n_future: int = field(default=3, metadata={"help": "tokens predicted per position (head 1 = the base model)"})
    init: str = field(default="copy", metadata={"help": "heads 2..n start as copies of the final layer or random", "choices": INITS})

    def validate(self) -> None:
        if self.init not in INITS:
            raise UsageError(f"unknown init {self.init!r}", f"use one of {', '.join(INITS)}")


class LayerHeads(HeadAdapter):
    """Shared by replicated and whs: ``layers[i - 1]`` is head i+1's transformer layer."""

    def __init__(self, config, backbone, n_layers: int):
        super().__init__(config, backbone)
        self.layers = nn.ModuleList([new_layer_like_final(backbone, config.init) for _ in range(n_layers)])

    first_layer_head = 1  # head index run by layers[0] (WHS "all heads": 0)

    @property
    def num_head_layers(self) -> int:
        return len(self.layers)

    def layer_slot(self, index: int) -> int | None:
        slot = index - self.first_layer_head
        return slot if 0 <= slot < len(self.layers) else None

    def copied_parameter_names(self) -> set[str]:
        if self.config.init != "copy":
            return set()
        return {name for name, _ in self.named_parameters() if name.startswith("layers.")}

    # Training recomputes each head layer in backward instead of keeping its activations, so
    # memory does not grow with n; a layer forward costs ~1% of the head's unembedding.
    checkpoint_layers = True

    def run_head_layer(self, layer: nn.Module, inp: torch.Tensor, feats: Features, cache=None) -> torch.Tensor:
        """One head layer plus the shared final norm # [B, T, H] -> [B, T, H]."""
        if self.checkpoint_layers and cache is None and torch.is_grad_enabled():
            out = checkpoint(self.backbone.run_layer, layer, inp, feats.ctx, use_reentrant=False)
        else:
            out = self.backbone.run_layer(layer, inp, feats.ctx, cache)
        return self.backbone.final_norm(out)


class ReplicatedHeads(LayerHeads):
    def __init__(self, config: ReplicatedConfig, backbone):
        super().__init__(config, backbone, config.n_future - 1)

    def hidden(self, index: int, feats: Features, cache=None) -> torch.Tensor:
        if index == 0:
            return feats.base  # the original final layer, run by the pipeline
        return self.run_head_layer(self.layers[index - 1], feats.trunk, feats, cache)


register_head("replicated", ReplicatedConfig, ReplicatedHeads)
