"""Token-conditioned heads: replicated heads whose layer also reads token t+1 (the text's own
when known, else the base's argmax)."""

from __future__ import annotations

import torch

from multitoken.adapters.registry import make_config
from multitoken.pipeline.model.model import MultiTokenModel

from .conftest import random_ids


def conditioned(backbone, scale: float = 0.0) -> MultiTokenModel:
    torch.manual_seed(0)
    model = MultiTokenModel.attach(backbone, make_config("conditioned", n_future=3, init="copy"))
    with torch.no_grad():
        for proj in model.heads.next_proj:
            proj.weight.normal_(0.0, scale)
    return model


def test_untrained_projections_make_them_replicated_heads(tiny_backbone):
    ids = random_ids(tiny_backbone)
    got = conditioned(tiny_backbone).head_logits(ids, last_only=False)
    ref = MultiTokenModel.attach(tiny_backbone, make_config("replicated", n_future=3, init="copy")).head_logits(ids, last_only=False)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    groups = conditioned(tiny_backbone).head_parameter_groups()
    assert len(groups["new"]) == 2  # the projections train at the new-weights rate, the layers as copies


def test_a_head_reads_the_next_token_and_nothing_later(tiny_backbone):
    model = conditioned(tiny_backbone, scale=0.2)
    ids = random_ids(tiny_backbone, batch=1, length=10)
    changed = ids.clone()
    changed[0, 6] = (ids[0, 6] + 1) % 500
    a, b = (model.head_logits(x, last_only=False) for x in (ids, changed))
    torch.testing.assert_close(a[0][:, :6], b[0][:, :6])  # the base is causal
    for i in (1, 2):
        torch.testing.assert_close(a[i][:, :5], b[i][:, :5])  # positions before 5 neither see nor read token 6
        assert not torch.allclose(a[i][:, 5], b[i][:, 5], atol=1e-4)  # position 5 reads token 6 as its t+1


def test_unsettled_positions_read_the_base_argmax(tiny_backbone):
    model = conditioned(tiny_backbone, scale=0.2)
    ids = random_ids(tiny_backbone, batch=2, length=8)
    feats = model.features(ids, next_known=3)
    argmax = model.backbone.logits(feats.base).argmax(-1)  # [B, T]
    assert torch.equal(feats.next_ids[:, :3], ids[:, 1:4])
    assert torch.equal(feats.next_ids[:, 3:], argmax[:, 3:])
    assert torch.equal(model.features(ids).next_ids[:, -1], argmax[:, -1])  # default: all but the last known


def test_the_projection_gets_gradients(tiny_backbone):
    model = conditioned(tiny_backbone, scale=0.0)
    model.train()
    model.compute_loss(random_ids(tiny_backbone, seed=3)).per_head[1].backward()
    assert model.heads.next_proj[0].weight.grad.abs().sum() > 0  # zero-initialised, yet it learns
