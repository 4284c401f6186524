"""Fixtures of the training tests: a learnable corpus and an untrained heads dir on the tiny Llama."""

from __future__ import annotations

import pytest

from ..conftest import build_tiny_llama
from .train_helpers import make_heads_dir, phrase_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return phrase_corpus(tmp_path_factory.mktemp("corpus") / "phrases.jsonl")


@pytest.fixture(scope="module")
def heads_dir(tiny_llama_dir, tmp_path_factory):
    return make_heads_dir(tiny_llama_dir, tmp_path_factory.mktemp("heads") / "untrained")


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    """A tiny Llama with a tied unembedding, like SmolLM2."""
    return build_tied_llama(tmp_path_factory.mktemp("tied_llama"))


def build_tied_llama(out, change=None):
    """The tiny Llama of ``tied_llama_dir`` in ``out``, ``change(model)`` applied before it is saved."""
    from transformers import LlamaForCausalLM

    out = build_tiny_llama(out, hidden=64, seed=3)
    model = LlamaForCausalLM.from_pretrained(out)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    if change is not None:
        change(model)
    model.save_pretrained(out)
    return out
