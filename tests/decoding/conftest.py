"""Decoding fixtures: MultiTokenModels of every head type on the tiny backbones, and a model with
a vocabulary small enough to enumerate (exact distributions for chi-square tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from multitoken.adapters.registry import registered_heads
from multitoken.pipeline.model.backbone import Backbone
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.model.model import MultiTokenModel

HEAD_OPTIONS = {"cp": {"rank": 3}, "replicated": {"init": "random"}, "conditioned": {"init": "random"}, "whs": {"init": "random"}}


def attach(backbone, head_type: str, n_future: int = 3, seed: int = 0) -> MultiTokenModel:
    """Untrained heads, perturbed so that drafts differ from the base (and from each other)."""
    torch.manual_seed(seed)
    model = MultiTokenModel.attach(backbone, {"head_type": head_type, "n_future": n_future, **HEAD_OPTIONS.get(head_type, {})})
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_backbones(tiny_neox_dir, tiny_llama_dir) -> dict:
    return {arch: load_backbone(BackboneConfig(base=str(d))) for arch, d in (("gpt_neox", tiny_neox_dir), ("llama", tiny_llama_dir))}


# Heads with a score per head at every position (trees, DynaMo, per-head reads): eagle3 drafters
# are scored by their own autoregressive steps and draft chains only (tests/decoding/test_eagle3.py)
@pytest.fixture(params=[h for h in registered_heads() if h != "eagle3"])
def head_type(request) -> str:
    return request.param


@pytest.fixture(params=registered_heads())
def chain_head_type(request) -> str:
    """Every head type: each drafts chains (eagle3 with its own drafter)."""
    return request.param


@pytest.fixture(params=["gpt_neox", "llama"])
def arch(request) -> str:
    return request.param


def build_small_vocab(out: Path, vocab: int = 4, seed: int = 1, scale: float = 8.0) -> Backbone:
    """A random 2-layer Llama over ``vocab`` tokens with peaked (low-entropy) distributions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=None)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # random init is near-uniform: make the test distributions uneven
    model.save_pretrained(out)
    model = LlamaForCausalLM.from_pretrained(out).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return Backbone(model, None, str(out), BackboneConfig(base=str(out)))


@pytest.fixture(scope="session")
def small_vocab_backbone(tmp_path_factory) -> Backbone:
    return build_small_vocab(tmp_path_factory.mktemp("small_vocab"))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and the CI machine is shared): restore afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class RatioTable:
    """A co-occurrence table stand-in: mask = ratio(x1, x2(, x3)) ** alpha, from a fixed array
    (order 2) or a cheap hash of the ids (any order)."""

    def __init__(self, ratio: np.ndarray | None = None):
        self.ratio = ratio

    def mask(self, cands, alpha: float = 1.0):
        if self.ratio is not None:
            return self.ratio[np.ix_(*cands)] ** alpha
        grid = sum(np.asarray(c).reshape([-1 if a == i else 1 for a in range(len(cands))]) * (7 + 6 * i)
                   for i, c in enumerate(cands))
        return (0.5 + (grid % 11) / 5.0) ** alpha
