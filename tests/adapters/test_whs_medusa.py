"""WHS (Mehra et al. eq. 5) and Medusa specifics."""

from __future__ import annotations

import pytest
import torch

from multitoken.adapters.registry import make_config
from multitoken.base.errors import UsageError
from multitoken.pipeline.model.model import MultiTokenModel

from .conftest import random_ids


def test_whs_starts_with_equal_layer_weights(tiny_backbone):
    model = MultiTokenModel.attach(tiny_backbone, make_config("whs", n_future=3))
    heads = model.heads
    assert heads.layer_weights.shape == (2, tiny_backbone.num_layers - 1)  # heads 2..n, Z^{1:L-1}
    assert torch.all(heads.layer_weights == 0.1)
    n_states = tiny_backbone.num_layers - 1
    torch.testing.assert_close(heads.mixing(0), torch.full((n_states,), 1.0 / n_states))


def test_whs_input_is_the_weighted_sum_of_trunk_states(tiny_backbone):
    model = MultiTokenModel.attach(tiny_backbone, make_config("whs", n_future=2, temperature=0.5))
    with torch.no_grad():
        model.heads.layer_weights[0] = torch.arange(tiny_backbone.num_layers - 1, dtype=torch.float32)
    ids = random_ids(tiny_backbone)
    feats = model.features(ids)
    hs = tiny_backbone.hidden_states(ids)  # [0] embeddings, [1..L-1] trunk layer outputs
    weights = torch.softmax(torch.arange(tiny_backbone.num_layers - 1, dtype=torch.float32) / 0.5, 0)
    expected = sum(w * h for w, h in zip(weights, hs[1:-1]))
    torch.testing.assert_close(model.heads.weighted_input(0, feats), expected)
    # The weights get gradients from the head loss.
    model.compute_loss(ids).per_head[1].backward()
    assert model.heads.layer_weights.grad is not None and model.heads.layer_weights.grad.abs().sum() > 0


def test_whs_all_heads_variant_replaces_head1(tiny_backbone):
    model = MultiTokenModel.attach(tiny_backbone, make_config("whs", n_future=2, all_heads=True))
    assert not model.heads.head1_is_base and len(model.heads.layers) == 2
    ids = random_ids(tiny_backbone)
    with torch.no_grad():
        base = torch.log_softmax(tiny_backbone.model(ids).logits, -1)
    assert not torch.allclose(model.head_logits(ids, last_only=False)[0], base)
    out = model.compute_loss(ids)
    assert out.per_head[0].requires_grad  # head 1 is a trained head in this variant


def test_whs_rejects_bad_temperature():
    with pytest.raises(UsageError, match="temperature"):
        make_config("whs", temperature=0.0)


def test_medusa_zero_init_heads_equal_head1(tiny_backbone):
    model = MultiTokenModel.attach(tiny_backbone, make_config("medusa", n_future=3))
    ids = random_ids(tiny_backbone)
    feats = model.features(ids)
    for i in (1, 2):
        assert torch.equal(model.heads.hidden(i, feats), feats.base)
    out = model.compute_loss(ids)
    # Every block is W zero-initialised, and W gets a gradient (SiLU'(0) = 1/2 != 0).
    out.per_head[1].backward()
    block = model.heads.blocks[0][0].linear
    assert torch.all(block.weight == 0) and block.weight.grad.abs().sum() > 0
    assert model.heads.blocks[1][0].linear.weight.grad is None  # heads are independent


def test_medusa_blocks_are_distinct_modules(tiny_backbone):
    model = MultiTokenModel.attach(tiny_backbone, make_config("medusa", n_future=3, num_blocks=2))
    linears = [b.linear for seq in model.heads.blocks for b in seq]
    assert len(linears) == 4 and len({id(l.weight) for l in linears}) == 4


def test_parameter_groups_separate_copied_from_new(tiny_backbone):
    whs = MultiTokenModel.attach(tiny_backbone, make_config("whs", n_future=3))
    groups = whs.head_parameter_groups()
    assert any(p is whs.heads.layer_weights for p in groups["new"])
    assert {id(p) for p in groups["copied"]} == {id(p) for p in whs.heads.layers.parameters()}
    medusa = MultiTokenModel.attach(tiny_backbone, make_config("medusa", n_future=3))
    assert medusa.head_parameter_groups()["copied"] == []
