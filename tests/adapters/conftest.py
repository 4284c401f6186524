"""Fixtures for head-adapter contract tests: tiny backbones (both architectures) and a small
configuration of every registered head type."""

from __future__ import annotations

import pytest
import torch

from multitoken.adapters.registry import make_config, registered_heads

# Per-type options that keep the tests fast and meaningful (e.g. CP with several experts).
SMALL_OPTIONS = {"cp": {"rank": 3}}


def small_config(head_type: str, n_future: int = 3, **options):
    return make_config(head_type, n_future=n_future, **{**SMALL_OPTIONS.get(head_type, {}), **options})


@pytest.fixture(scope="session")
def tiny_backbone(tiny_model_dir):
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone

    return load_backbone(BackboneConfig(base=str(tiny_model_dir)))


@pytest.fixture(params=registered_heads())
def head_type(request) -> str:
    return request.param


def random_ids(backbone, batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(backbone.vocab_size, 500), (batch, length), generator=g)
