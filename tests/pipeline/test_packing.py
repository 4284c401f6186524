"""Packing documents into fixed-length sequences, and resuming at a saved position."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from multitoken.base.data import DataConfig
from multitoken.base.errors import DataError
from multitoken.base.packing import PackedStream, PackPosition

EOS = 0


@pytest.fixture()
def ids_corpus(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 100, size=int(n)).tolist() for n in rng.integers(1, 30, size=12)]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    return path, docs


def _stream(path, **kw):
    return PackedStream(DataConfig(data=str(path)), None, 8, EOS, vocab_size=100, **kw)


def test_sequences_are_the_documents_joined_by_eos(ids_corpus):
    path, docs = ids_corpus
    flat = np.concatenate([np.array(d + [EOS]) for d in docs])
    seqs = [s for s, _ in itertools.islice(iter(_stream(path, loop=False)), 100)]
    assert len(seqs) == len(flat) // 8
    np.testing.assert_array_equal(np.concatenate(seqs), flat[: 8 * len(seqs)])


def test_resume_from_any_position_gives_the_same_continuation(ids_corpus):
    path, _ = ids_corpus
    full = list(itertools.islice(iter(_stream(path)), 60))  # several epochs
    for k in (1, 5, 17, 33):
        pos = PackPosition.from_dict(json.loads(json.dumps(full[k - 1][1].to_dict())))
        resumed = list(itertools.islice(iter(_stream(path, position=pos)), 60 - k))
        for (a, pa), (b, pb) in zip(full[k:], resumed):
            np.testing.assert_array_equal(a, b)
            assert pa == pb


def test_epochs_restart_after_the_held_out_head(ids_corpus):
    path, docs = ids_corpus
    it = iter(_stream(path))
    held, start = next(it)
    stream = _stream(path, position=start, epoch_start=start)
    seqs = list(itertools.islice(iter(stream), 50))
    assert all(not np.array_equal(s, held) for s, _ in seqs)
    assert seqs[-1][1].epoch >= 1


def test_max_tokens_bounds_each_epoch(ids_corpus):
    path, _ = ids_corpus
    stream = PackedStream(DataConfig(data=str(path), max_tokens=20), None, 8, EOS, vocab_size=100)
    seqs = list(itertools.islice(iter(stream), 6))
    # 20 tokens per epoch -> 2 sequences per epoch, the same two every epoch.
    np.testing.assert_array_equal(seqs[0][0], seqs[2][0])
    np.testing.assert_array_equal(seqs[1][0], seqs[3][0])


def test_too_little_data_is_a_clear_error(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2]}) + "\n")
    with pytest.raises(DataError, match="fewer than 8 tokens"):
        next(iter(_stream(path)))


@pytest.mark.parametrize("doc, offset, valid", [
    (12, 0, True),  # just past the last document: the epoch ends there (a resume then starts the next)
    (11, "len+1", True),  # the end of the last document, its separator included
    (11, "len+2", False), (12, 1, False), (13, 0, False), (10**9, 10**12, False),
])
def test_a_resume_position_must_lie_within_the_data(ids_corpus, doc, offset, valid):
    path, docs = ids_corpus
    if isinstance(offset, str):
        offset = len(docs[doc]) + int(offset.removeprefix("len+"))
    stream = iter(_stream(path, position=PackPosition(0, doc, offset, 0)))
    if valid:
        next(stream)  # wraps to the next epoch and goes on
        return
    with pytest.raises(DataError, match=rf"the data position \(document {doc:,}, token {offset:,}\) lies beyond the data read"):
        next(stream)


def test_a_resume_position_past_the_token_budget_is_refused(ids_corpus):
    path, _ = ids_corpus
    cfg = DataConfig(data=str(path), max_tokens=40)
    stream = PackedStream(cfg, None, 8, EOS, vocab_size=100, position=PackPosition(0, 1, 0, 41))
    with pytest.raises(DataError, match="41 tokens consumed, the epoch holds 40"):
        next(iter(stream))
