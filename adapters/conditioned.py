"""Token-conditioned replicated heads: replicated final-layer heads that also read token t+1.

A replicated head i (i >= 2) must guess token t+i without knowing token t+1, which the base
model (head 1) is about to choose in the same pass; most of its errors follow from that. Here
head i's layer input is the trunk output plus a learned projection of the embedding of token
t+1: the text's own next token when training (teacher forcing), and the base model's argmax at
t+1 when decoding, computed in the same pass before the head layers run (in greedy decoding,
exactly the token that will be committed there). This is the draft conditioning of Hydra and
EAGLE (a draft reads the token before it), kept to one token so that every head still runs in
the verification pass itself: no extra forward, no sequential drafting. The projections start
at zero, so untrained (or loaded from plain replicated heads) they are replicated heads.

Sampled decoding stays exact (verification does not depend on how drafts were made); its
drafts are conditioned on the base's argmax, not on the sampled token. DynaMo's dynamic mode
defers the head layers until t+1 is sampled and conditions them on it (docs/decoding.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base import Features, head_dtype
from .registry import register_head
from .replicated import ReplicatedConfig, ReplicatedHeads


@dataclass
class ConditionedConfig(ReplicatedConfig):
    head_type: str = "conditioned"  # n_future and init as replicated heads


class ConditionedHeads(ReplicatedHeads):
    needs_next_tokens = True

    def __init__(self, config: ConditionedConfig, backbone):
        super().__init__(config, backbone)
        width = backbone.hidden_size
        self.next_proj = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(config.n_future - 1))
        for proj in self.next_proj:
            nn.init.zeros_(proj.weight)  # starts as a replicated head
        self.next_proj.to(device=backbone.device, dtype=head_dtype(backbone))

    def hidden(self, index: int, feats: Features, cache=None) -> torch.Tensor:
        if index == 0:
            return feats.base
        if feats.next_ids is None:
            raise ValueError("conditioned heads read Features.next_ids (the token at t+1); the pipeline fills it")
        emb = self.backbone.embeddings(feats.next_ids)  # [B, T, H]
        inp = feats.trunk + self.next_proj[index - 1](emb.to(feats.trunk.dtype))  # [B, T, H]
        return self.run_head_layer(self.layers[index - 1], inp, feats, cache)


register_head("conditioned", ConditionedConfig, ConditionedHeads)
