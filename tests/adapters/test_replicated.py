"""Replicated final-layer heads: copy-init heads start as the base model, random-init do not."""

from __future__ import annotations

import pytest
import torch

from multitoken.adapters.registry import make_config
from multitoken.base.errors import UsageError
from multitoken.pipeline.model.model import MultiTokenModel

from .conftest import random_ids


def test_copy_init_heads_start_as_the_final_layer(tiny_backbone):
    model = MultiTokenModel.attach(tiny_backbone, make_config("replicated", n_future=3, init="copy"))
    logits = model.head_logits(random_ids(tiny_backbone), last_only=False)
    assert torch.equal(logits[1], logits[0]) and torch.equal(logits[2], logits[0])
    groups = model.head_parameter_groups()
    assert groups["new"] == [] and len(groups["copied"]) == len(model.head_parameters())
    # Fresh modules, not aliases: training one head must not move another.
    assert model.heads.layers[0] is not model.heads.layers[1]
    assert model.heads.layers[0] is not tiny_backbone.layers[-1]


def test_random_init_heads_differ(tiny_backbone):
    torch.manual_seed(0)
    model = MultiTokenModel.attach(tiny_backbone, {"head_type": "replicated", "n_future": 2, "init": "random"})
    logits = model.head_logits(random_ids(tiny_backbone), last_only=False)
    assert not torch.allclose(logits[1], logits[0])
    assert model.head_parameter_groups()["copied"] == []


def test_bad_options_are_usage_errors():
    with pytest.raises(UsageError, match="init"):
        make_config("replicated", init="zeros")
    with pytest.raises(UsageError, match="rank"):
        make_config("replicated", rank=2)
    with pytest.raises(UsageError, match="registered|use one of"):
        make_config("nope")


def test_layer_checkpointing_gives_the_same_gradients(tiny_backbone):
    torch.manual_seed(0)
    model = MultiTokenModel.attach(tiny_backbone, make_config("replicated", n_future=2, init="random"))
    ids = random_ids(tiny_backbone, seed=5)
    grads = []
    for flag in (True, False):
        model.heads.checkpoint_layers = flag
        model.zero_grad()
        model.compute_loss(ids).per_head[1].backward()
        grads.append([p.grad.clone() for p in model.head_parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
