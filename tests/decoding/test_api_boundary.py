"""The Python API's boundary (issue 46): ``DecodeConfig`` settings and ``generate``'s arguments
of the wrong type or range are refused with one UsageError naming them, before anything runs
(they used to raise a TypeError deep inside, or decode something else: 1.5 truncated to 1,
3-D ids flattened, a negative id wrapped around the vocabulary)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multitoken.base.errors import UsageError
from multitoken.decoding.config import DecodeConfig, Sampling
from multitoken.decoding.engine import generate
from multitoken.embedded import EMBEDDED_HEADS
from multitoken.pipeline.model.model import MultiTokenModel


@pytest.mark.parametrize("settings, message", [
    (dict(seed=1.5), "DecodeConfig: seed must be an integer, got 1.5 (float)"),
    (dict(max_new_tokens="5"), "DecodeConfig: max_new_tokens must be an integer, got '5' (str)"),
    (dict(max_new_tokens=4.5), "DecodeConfig: max_new_tokens must be an integer, got 4.5"),
    (dict(top_k=2.5), "DecodeConfig: top_k must be an integer, got 2.5"),
    (dict(greedy="no"), "DecodeConfig: greedy must be True or False, got 'no' (str)"),
    (dict(greedy=1), "DecodeConfig: greedy must be True or False, got 1 (int)"),
    (dict(temperature="0.7"), "DecodeConfig: temperature must be a number, got '0.7'"),
    (dict(n=2.0), "DecodeConfig: n must be an integer or None, got 2.0"),
    (dict(mode=None), "DecodeConfig: mode must be a string, got None"),
    (dict(tree_nodes=1.5), "DecodeConfig: tree_nodes must be an integer or a string, got 1.5"),
    (dict(stop_at_eos="yes"), "DecodeConfig: stop_at_eos must be True or False"),
    (dict(sampling="greedy"), "DecodeConfig: sampling must be a Sampling or a dict of its settings, got 'greedy'"),
    (dict(sampling={"sed": 1}), "DecodeConfig: sampling has no setting 'sed'"),
    (dict(seeed=1), "DecodeConfig has no setting 'seeed'"),
])
def test_a_setting_of_the_wrong_type_is_refused_by_name(settings, message):
    with pytest.raises(UsageError) as err:
        DecodeConfig(**settings)
    assert str(err.value).splitlines()[0] == message or str(err.value).startswith(message), str(err.value)
    assert err.value.fix


def test_a_setting_assigned_later_is_checked_when_validated():
    cfg = DecodeConfig()
    cfg.sampling.top_k = "50"
    with pytest.raises(UsageError, match="DecodeConfig: top_k must be an integer, got '50'"):
        cfg.validate()


def test_numpy_scalars_and_groups_as_dicts_are_taken():
    cfg = DecodeConfig(seed=np.int64(3), temperature=np.float32(0.5), greedy=np.bool_(True), sampling={"top_k": 7})
    assert cfg.sampling.seed == 3 and type(cfg.sampling.seed) is int and type(cfg.sampling.greedy) is bool
    assert cfg.sampling.top_k == 7
    assert DecodeConfig(sampling=Sampling(top_k=5), tree_nodes=8).sampling.top_k == 5


@pytest.fixture(scope="module")
def model():
    return MultiTokenModel.from_pretrained(None, EMBEDDED_HEADS)


@pytest.fixture(scope="module")
def ids(model):
    return model.backbone.tokenizer("Once upon a time", return_tensors="pt").input_ids


CFG = DecodeConfig(max_new_tokens=2, greedy=True)


@pytest.mark.parametrize("call, message", [
    (lambda m, ids: generate(m, ids, {"greedy": True}), "generate: the config must be a DecodeConfig, got {'greedy': True} (dict)"),
    (lambda m, ids: generate(m, ids, CFG, table="stats"), "generate: table must be a co-occurrence table, got 'stats' (str)"),
    (lambda m, ids: generate(None, ids, CFG), "generate: model must be a model with heads (a MultiTokenModel), got None"),
    (lambda m, ids: generate(m, ids.float(), CFG), "generate: input ids must be integers, got a torch.float32 tensor"),
    (lambda m, ids: generate(m, ids[None], CFG), "generate: input ids must be [T] or [B, T], got a 3-D tensor of shape [1, 1, 5]"),
    (lambda m, ids: generate(m, [1.0, 2.5], CFG), "generate: input ids must be integers, got 1.0 (float)"),
    (lambda m, ids: generate(m, [[1, 2], 3], CFG), "generate: a prompt must be a list of token ids, got 3 (int)"),
    (lambda m, ids: generate(m, [[1, 2.5]], CFG), "generate: input ids must be integers, got 2.5 (float)"),
    (lambda m, ids: generate(m, "Once upon", CFG), "generate: prompts must be token ids, got 'Once upon' (str)"),
    (lambda m, ids: generate(m, np.array([1.0, 2.0]), CFG), "generate: input ids must be a 1-D or 2-D array of integers, got a 1-D float64 array"),
    (lambda m, ids: generate(m, [1, 2, 100000], CFG), "generate: token id 100000 is outside the model's vocabulary [0, 512)"),
    (lambda m, ids: generate(m, [1, -3], CFG), "generate: token id -3 is outside the model's vocabulary [0, 512)"),
    (lambda m, ids: generate(m, [[1, 2], [3, 4]], CFG, seeds=[1.5, 2]), "generate: seeds must be integers, got 1.5 (float)"),
    (lambda m, ids: generate(m, ids, CFG, attention_mask=[1, 1]), "generate: attention_mask must be a tensor shaped like the input ids"),
])
def test_a_bad_generate_argument_is_refused_by_name(model, ids, call, message):
    with pytest.raises(UsageError) as err:
        call(model, ids)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n  fix: " in str(err.value) and str(err.value).count("\n") == 1


def test_the_accepted_forms_still_decode_alike(model, ids):
    want = generate(model, ids, CFG).token_ids
    assert generate(model, ids[0].tolist(), CFG).token_ids == want
    assert generate(model, ids[0].numpy(), CFG).token_ids == want
    assert generate(model, ids[0].int(), CFG).token_ids == want
    assert [r.token_ids for r in generate(model, [ids[0].tolist()] * 2, CFG, seeds=[np.int64(0), 1])] == [want, want]
