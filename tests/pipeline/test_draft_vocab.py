"""Draft vocabularies (draft_vocab.py): the ranking record, the size a run takes, the sub-matrix
unembedding, and what a decoding step's head rows read."""

from __future__ import annotations

import pytest
import torch

from multitoken.base.errors import CheckpointError, UsageError
from multitoken.kernels import cpu_linear
from multitoken.pipeline.model.draft_vocab import (DRAFT_VOCAB_FILE, DraftUnembedding, ranking_record,
                                                   read_ranking, resolve_size)
from multitoken.pipeline.model.model import MultiTokenModel

from ..conftest import rank_odd_tokens


def test_ranking_is_most_frequent_first_ties_by_id_unseen_left_out():
    counts = torch.tensor([0, 5, 2, 5, 0, 9])
    record = ranking_record(counts, 3, "test")
    assert record["tokens"] == [5, 1, 3, 2]
    assert record["counts"] == [9, 5, 5, 2]
    assert record["size"] == 3 and record["vocab_size"] == 6


def test_size_defaults_to_the_record_and_zero_means_the_whole_vocabulary():
    record = ranking_record(torch.arange(10), 4, "test")
    assert resolve_size(None, record, 10) == 4
    assert resolve_size(None, None, 10) == 0
    assert resolve_size(0, record, 10) == 0
    assert resolve_size(6, record, 10) == 6
    assert resolve_size(10, None, 10) == 0  # the whole vocabulary needs no ranking
    with pytest.raises(UsageError, match="needs the heads' token ranking"):
        resolve_size(6, None, 10)
    with pytest.raises(UsageError, match=">= 0"):
        resolve_size(-1, record, 10)


@pytest.mark.parametrize("raw, message", [
    ('{"tokens": [1, 2]}', "size must be an integer >= 0, got None"),
    ('{"tokens": [1, 2], "size": 1.5}', "size must be an integer >= 0, got 1.5"),  # was truncated to 1
    ('{"tokens": [1, 2], "size": "2"}', "size must be an integer >= 0, got '2'"),
    ('{"tokens": [1, 2], "size": true}', "size must be an integer >= 0, got True"),
    ('{"tokens": [1, 2], "size": -1}', "size must be an integer >= 0, got -1"),
    ('{"tokens": ["a"], "size": 1}', "tokens must be a list of integer token ids"),
    ('{"tokens": [1, 2.0], "size": 1}', "tokens must be a list of integer token ids"),
    ('{"tokens": [1, 10], "size": 1}', "token id 10 is outside the base's vocabulary [0, 10)"),
    ('{"tokens": [1, -1], "size": 1}', "token id -1 is outside the base's vocabulary [0, 10)"),
    ('{"tokens": [3, 1, 3], "size": 2}', "tokens lists 1 id(s) twice"),
    ('{"tokens": [3, 1], "counts": [5], "size": 2}', "counts must hold one integer per token"),
    ('[1, 2]', "holds a JSON list, not an object"),
    ('{"tokens": [1, ', "is not valid JSON"),
])
def test_a_damaged_record_is_named(tmp_path, raw, message):
    assert read_ranking(tmp_path) is None
    (tmp_path / DRAFT_VOCAB_FILE).write_text(raw)
    with pytest.raises(CheckpointError) as err:
        read_ranking(tmp_path, 10)
    assert message in str(err.value) and str(err.value).count("\n") == 1, str(err.value)
    (tmp_path / DRAFT_VOCAB_FILE).write_text('{"tokens": [3, 1], "counts": [5, 2], "size": 2}')
    assert read_ranking(tmp_path, 10)["size"] == 2


@pytest.mark.parametrize("bias", [False, True])
def test_draft_logits_are_the_unembedding_rows_and_minus_inf_elsewhere(bias):
    torch.manual_seed(0)
    full = torch.nn.Linear(32, 100, bias=bias)
    ids = torch.tensor([3, 17, 50, 99])
    draft = DraftUnembedding(full, ids, 100)
    rows = torch.randn(2, 3, 32)
    got, ref = draft(rows), full(rows)  # [2, 3, 100]
    outside = torch.ones(100, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(got[..., outside]).all()
    # the same dot products over 32 terms, maybe summed in another order: fp32 rounding
    torch.testing.assert_close(got[..., ids], ref[..., ids], rtol=0, atol=32 * 6e-8 * ref.abs().max().item())
    assert not draft.proj.weight.requires_grad


@pytest.mark.skipif(not cpu_linear.usable(), reason="needs oneDNN's packed linear ops (torch CPU build with mkldnn)")
def test_a_packed_draft_unembedding_computes_the_same_logits():
    torch.manual_seed(1)
    full = torch.nn.Linear(64, 4096, bias=False)
    draft = DraftUnembedding(full, torch.arange(0, 4096, 2), 4096)
    rows = torch.randn(1, 3, 64)
    before = draft(rows)
    assert cpu_linear.pack(draft) == 1
    after = draft(rows)
    assert torch.equal(torch.isneginf(after), torch.isneginf(before))
    keep = ~torch.isneginf(before)
    torch.testing.assert_close(after[keep], before[keep], rtol=0, atol=64 * 6e-8 * before[keep].abs().max().item())


def test_a_step_scores_head_rows_over_the_draft_vocabulary_and_the_base_over_all(tiny_model, tmp_path):
    model = MultiTokenModel.attach(tiny_model.backbone, {"head_type": "replicated", "n_future": 3, "init": "copy"})
    kept = rank_odd_tokens(model, tmp_path, 20)
    ids = torch.tensor([[5, 9, 2, 7, 11]])
    model.prepare_linears()  # as decoding does: the base's logits then do not depend on the rows unembedded with them
    full = model.step(ids, model.new_caches(0), read_from=4)
    part = model.step(ids, model.new_caches(), read_from=4)  # the record's size: 20
    assert torch.equal(part.base_log_probs(), full.base_log_probs())
    for head in (1, 2):
        got, ref = part.head_log_probs(head, 4), full.head_log_probs(head, 4)  # [1, V]
        outside = torch.ones(ref.shape[-1], dtype=torch.bool)
        outside[kept] = False
        assert torch.isneginf(got[0, outside]).all() and torch.isfinite(got[0, kept]).all()
        # renormalised over the kept tokens: the same distribution restricted to them
        torch.testing.assert_close(got[0, kept], torch.log_softmax(ref[0, kept], -1), rtol=0, atol=1e-4)


def test_one_position_heads_and_whole_vocabularies_build_no_draft_unembedding(tiny_model, tmp_path):
    medusa = MultiTokenModel.attach(tiny_model.backbone, {"head_type": "medusa", "n_future": 3})
    rank_odd_tokens(medusa, tmp_path, 20)
    assert medusa.draft_unembedding() is None  # Medusa heads unembed inside their adapter
    replicated = MultiTokenModel.attach(tiny_model.backbone, {"head_type": "replicated", "n_future": 3})
    assert replicated.draft_unembedding() is None  # no heads dir: no ranking, the whole vocabulary
    rank_odd_tokens(replicated, tmp_path, 20)
    replicated.__dict__.pop("_ranking")
    first = replicated.draft_unembedding()
    assert first is not None and first.size == 20 and replicated.draft_unembedding() is first  # built once
    assert replicated.draft_unembedding(0) is None


def test_a_draft_vocabulary_saved_with_the_heads_is_held_to_its_recorded_sha(tiny_model, tmp_path):
    import json

    model = MultiTokenModel.attach(tiny_model.backbone, {"head_type": "replicated", "n_future": 3, "init": "copy"})
    ranking = ranking_record(torch.arange(model.backbone.vocab_size) % 7, 16, "test")
    model.save_heads(tmp_path / "heads", extra={DRAFT_VOCAB_FILE: json.dumps(ranking) + "\n"})
    config = json.loads((tmp_path / "heads" / "heads_config.json").read_text())
    assert len(config["draft_vocab_sha256"]) == 64
    assert read_ranking(tmp_path / "heads")["tokens"] == ranking["tokens"]
    swapped = dict(ranking, tokens=[ranking["tokens"][1], ranking["tokens"][0], *ranking["tokens"][2:]])
    (tmp_path / "heads" / DRAFT_VOCAB_FILE).write_text(json.dumps(swapped) + "\n")  # still a valid record
    with pytest.raises(CheckpointError, match="not the draft vocabulary the heads were saved with"):
        read_ranking(tmp_path / "heads")
