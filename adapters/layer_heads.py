"""Heads that are transformer layers (replicated and whs): head i+1 runs ``layers[i]``, a layer of
the same class as the base model's final one, then the shared final norm."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .base import Features, HeadAdapter
from .layers import new_layer_like_final


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
    # memory does not grow with n; the recomputed layer is small beside the head's unembedding,
    # which dominates what a head costs.
    checkpoint_layers = True

    def run_head_layer(self, layer: nn.Module, inp: torch.Tensor, feats: Features, cache=None) -> torch.Tensor:
        """One head layer plus the shared final norm # [B, T, H] -> [B, T, H]."""
        if self.checkpoint_layers and cache is None and torch.is_grad_enabled():
            out = checkpoint(self.backbone.run_layer, layer, inp, feats.ctx, use_reentrant=False)
        else:
            out = self.backbone.run_layer(layer, inp, feats.ctx, cache)
        return self.backbone.final_norm(out)
