"""Replicated final-layer heads (Mehra et al. §3, DynaMo §3.1 "T3").

The backbone is layers[:-1]; head 1 IS the original final layer (so it reproduces the base
model exactly); heads 2..n are new layers of the same class fed the same trunk output,
initialised as copies of the final layer (DynaMo "(C)") or randomly (Mehra et al.). The final
norm and the unembedding are the base model's, shared and frozen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import Features
from .layer_heads import LayerHeads
from .layers import INITS
from .registry import register_head
from multitoken.base.errors import UsageError


@dataclass
class ReplicatedConfig:
    head_type: str = "replicated"
    n_future: int = field(default=3, metadata={"help": "tokens predicted per position (head 1 = the base model)"})
    init: str = field(default="copy", metadata={"help": "heads 2..n start as copies of the final layer or random", "choices": INITS})

    def validate(self) -> None:
        if self.init not in INITS:
            raise UsageError(f"unknown init {self.init!r}", f"use one of {', '.join(INITS)}")


class ReplicatedHeads(LayerHeads):
    def __init__(self, config: ReplicatedConfig, backbone):
        super().__init__(config, backbone, config.n_future - 1)

    def hidden(self, index: int, feats: Features, cache=None) -> torch.Tensor:
        if index == 0:
            return feats.base  # the original final layer, run by the pipeline
        return self.run_head_layer(self.layers[index - 1], feats.trunk, feats, cache)


register_head("replicated", ReplicatedConfig, ReplicatedHeads)
