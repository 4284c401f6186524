"""``multitoken train`` with eagle3 drafter heads: the draft vocabulary is the data's ranking, set
on the drafter before training, recorded beside the heads, kept through a resume, never re-ranked
over heads trained on another one."""

from __future__ import annotations

import json

import pytest
import torch

from multitoken.base.data import DataConfig
from multitoken.base.errors import UsageError
from multitoken.pipeline.model.draft_vocab import DRAFT_VOCAB_FILE, ranked_ids, read_ranking
from multitoken.pipeline.train import train as train_mod
from multitoken.pipeline.train.train import train

from .train_helpers import head_state, load_trained, make_heads_dir, phrase_corpus, train_cfg

SIZE = 32  # fewer than the phrase corpus's distinct tokens: the ranking decides which it holds


@pytest.fixture(scope="module")
def drafter_dir(tiny_llama_dir, tmp_path_factory):
    return make_heads_dir(tiny_llama_dir, tmp_path_factory.mktemp("eagle3") / "untrained", head_type="eagle3",
                          draft_vocab_size=SIZE)


def _ranked(heads_dir) -> torch.Tensor:
    record = read_ranking(heads_dir, 512)
    return ranked_ids(record, record["size"], 512).sort().values


def test_the_drafter_trains_over_the_datas_ranking_and_loads_with_it(tiny_llama_dir, drafter_dir, corpus, tmp_path):
    out = tmp_path / "trained"
    untrained = load_trained(tiny_llama_dir, drafter_dir)
    assert torch.equal(untrained.heads.t2d.nonzero().squeeze(-1), torch.arange(SIZE))  # attach's placeholder ids
    train(train_cfg(drafter_dir, out, max_steps=8), DataConfig(data=str(corpus)))
    record = json.loads((out / DRAFT_VOCAB_FILE).read_text())
    config = json.loads((out / "heads_config.json").read_text())
    assert record["size"] == SIZE and len(record["tokens"]) > SIZE and "draft_vocab_sha256" in config
    model = load_trained(tiny_llama_dir, out)
    heads, ids = model.heads, _ranked(out)
    assert torch.equal(heads.t2d.nonzero().squeeze(-1), ids) and torch.equal(heads.to_target(torch.arange(SIZE)), ids)
    assert set(ids.tolist()) == set(record["tokens"][:SIZE])  # the data's most frequent tokens
    # set before training, not after: the lm_head left the base's rows it starts from
    start = model.backbone.unembedding.weight[ids]
    assert (heads.draft_head.weight - start).abs().max() > 1e-3
    lp = model.head_logits(torch.tensor([record["tokens"][:12]]), last_only=False)[1]
    assert torch.isinf(lp[..., ~heads.t2d]).all() and torch.isfinite(lp[..., heads.t2d]).all()


def test_a_resumed_run_sets_the_vocabulary_again_and_ends_with_the_same_drafter(tiny_llama_dir, drafter_dir, corpus,
                                                                                tmp_path, monkeypatch):
    """Checkpoints keep parameters only (not d2t / t2d): the resumed run ranks the data again and
    sets the vocabulary before the checkpoint's weights load, as the uninterrupted run did."""
    data = DataConfig(data=str(corpus))
    kw = dict(max_steps=6, save_every=3)
    train(train_cfg(drafter_dir, tmp_path / "a", **kw), data)
    real, calls = train_mod.train_step, []

    def dies_in_step_five(*a, **k):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(train_mod, "train_step", dies_in_step_five)
    with pytest.raises(KeyboardInterrupt):
        train(train_cfg(drafter_dir, tmp_path / "b", **kw), data)
    monkeypatch.setattr(train_mod, "train_step", real)
    train(train_cfg(drafter_dir, tmp_path / "b", resume=True, **kw), data)
    a, b = head_state(load_trained(tiny_llama_dir, tmp_path / "a")), head_state(load_trained(tiny_llama_dir, tmp_path / "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "a" / DRAFT_VOCAB_FILE).read_bytes() == (tmp_path / "b" / DRAFT_VOCAB_FILE).read_bytes()


def test_trained_heads_are_not_re_ranked_on_other_data(tiny_llama_dir, drafter_dir, corpus, tmp_path):
    data = DataConfig(data=str(corpus))
    first = tmp_path / "first"
    train(train_cfg(drafter_dir, first, max_steps=2), data)
    again = tmp_path / "again"
    train(train_cfg(first, again, max_steps=2), data)  # the same data ranks the same: training goes on
    assert torch.equal(_ranked(again), _ranked(first))
    other = phrase_corpus(tmp_path / "other.jsonl", seed=9)  # other phrases, other tokens
    with pytest.raises(UsageError, match="draft over another vocabulary") as err:
        train(train_cfg(first, tmp_path / "refused", max_steps=2), DataConfig(data=str(other)))
    assert "--draft-vocab 0" in err.value.fix and not (tmp_path / "refused").exists()
    kept = tmp_path / "kept"
    train(train_cfg(first, kept, max_steps=2, draft_vocab=0), DataConfig(data=str(other)))
    heads = load_trained(tiny_llama_dir, kept).heads
    assert torch.equal(heads.t2d.nonzero().squeeze(-1), _ranked(first)) and not (kept / DRAFT_VOCAB_FILE).exists()
