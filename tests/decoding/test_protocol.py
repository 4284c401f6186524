"""The model the package ships satisfies the protocol decoding reads it through."""

from __future__ import annotations

import torch

from multitoken.decoding.protocol import Backbone, Caches, DecodingModel, StepResult

from .conftest import attach


def test_multitoken_model_is_a_decoding_model(tiny_backbones, head_type):
    model = attach(tiny_backbones["llama"], head_type, n_future=2)
    assert isinstance(model, DecodingModel) and isinstance(model.backbone, Backbone)
    caches = model.new_caches()
    assert isinstance(caches, Caches)
    out = model.step(torch.tensor([[1, 2, 3]]), caches)
    assert isinstance(out, StepResult)
    assert out.base_logits().shape == (1, 3, model.backbone.vocab_size)
    assert out.anchor_head_log_probs(1, (2,)).shape == (1, model.backbone.vocab_size)


def test_an_object_without_step_is_not_one():
    class NoStep:
        backbone = heads = None
        n_future = 2

        def new_caches(self):
            return None

    assert not isinstance(NoStep(), DecodingModel)
