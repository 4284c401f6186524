"""Fixtures of the training tests: a learnable corpus and an untrained heads dir on the tiny Llama."""

from __future__ import annotations

import pytest

from .train_helpers import make_heads_dir, phrase_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return phrase_corpus(tmp_path_factory.mktemp("corpus") / "phrases.jsonl")


@pytest.fixture(scope="module")
def heads_dir(tiny_llama_dir, tmp_path_factory):
    return make_heads_dir(tiny_llama_dir, tmp_path_factory.mktemp("heads") / "untrained")
