"""Fixtures shared by the pipeline tests."""

from __future__ import annotations

import pytest
import torch

from multitoken.pipeline.model.backbone import BackboneConfig, load_backbone
from multitoken.pipeline.model.model import MultiTokenModel


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    torch.manual_seed(0)
    bb = load_backbone(BackboneConfig(base=str(tiny_llama_dir)))
    return MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 3, "init": "random"})
