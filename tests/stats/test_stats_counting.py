"""Counts equal a brute-force Counter, whatever the input format, chunking or process count."""

from __future__ import annotations

import numpy as np
import pytest
from ..conftest import fixture_path
from .stats_helpers import (
    PYTHIA_TOKENIZER, arrays_equal, brute_counts, build_ids, corpus_docs, stats_counts, write_jsonl_ids,
    write_parquet_ids, zipf_docs,
)

from multitoken.base.data import DataConfig
from multitoken.stats.counting import ChunkBuilder, count_chunk, merge_runs, sorted_unique_counts
from multitoken.stats.job import BuildConfig, build


def test_chunking_never_joins_documents_and_never_double_counts():
    docs = zipf_docs(60, vocab=7, max_len=40, seed=1)
    builder = ChunkBuilder(order=3, chunk_tokens=13)  # long documents split over many chunks
    chunks = [c for i, d in enumerate(docs) for c in builder.add(i, np.array(d, np.int64))]
    chunks.append(builder.take())
    uni = np.zeros(7, np.uint64)
    runs = {2: [], 3: []}
    for c in chunks:
        counted = count_chunk(*c, 3, 7)
        uni += counted.unigrams
        for k in (2, 3):
            runs[k].append(counted.runs[k])
    want = brute_counts(docs, 3)
    assert {(i,): int(c) for i, c in enumerate(uni) if c} == dict(want[1])
    for k in (2, 3):
        keys, counts = merge_runs(runs[k])
        got = {tuple(np.unravel_index(int(x), (7,) * k)): int(c) for x, c in zip(keys, counts)}
        assert got == dict(want[k])


def test_sorted_unique_counts_and_merge_is_associative():
    rng = np.random.default_rng(0)
    a, b, c = (sorted_unique_counts(rng.integers(0, 50, 200).astype(np.uint64)) for _ in range(3))
    left = merge_runs([merge_runs([a, b]), c])
    right = merge_runs([a, merge_runs([b, c])])
    flat = merge_runs([c, a, b])
    for x, y in ((left, right), (left, flat)):
        np.testing.assert_array_equal(x[0], y[0])
        np.testing.assert_array_equal(x[1], y[1])
    assert int(flat[1].sum()) == 600


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_id_corpus_counts_equal_brute_force(tmp_path, fmt):
    docs = zipf_docs(300, vocab=50, max_len=120, seed=2) + [[]]
    write = write_parquet_ids if fmt == "parquet" else write_jsonl_ids
    data = write(tmp_path / f"ids.{fmt}", docs)
    out = build_ids(tmp_path, str(data), "stats", 50, order=3, memory_mb=4)
    want = brute_counts(docs, 3)
    got = stats_counts(out, 3, 50)
    for k in (1, 2, 3):
        assert got[k] == dict(want[k]), f"order {k}"


@pytest.mark.parametrize("name", ["pile_dummy/train_00.jsonl.zst", "pile_dummy"])
def test_text_corpus_counts_equal_brute_force(tmp_path, name):
    from multitoken.base.tokenizer import load_tokenizer

    data = DataConfig(data=str(fixture_path(*name.split("/"))))
    tok = load_tokenizer(PYTHIA_TOKENIZER)
    out = tmp_path / "stats"
    build(BuildConfig(out=str(out), tokenizer=PYTHIA_TOKENIZER, order=3), data, log=lambda *_: None)
    docs = corpus_docs(data, tok)
    assert sum(len(d) for d in docs) > 1000
    want = brute_counts(docs, 3)
    got = stats_counts(out, 3, len(tok))
    for k in (1, 2, 3):
        assert got[k] == dict(want[k]), f"order {k}"


def test_token_budget_and_order_two(tmp_path):
    text = fixture_path("tinyshakespeare", "input.txt")
    data = DataConfig(data=str(text), max_tokens=5000)
    out = tmp_path / "s"
    build(BuildConfig(out=str(out), tokenizer=PYTHIA_TOKENIZER, order=2), data, log=lambda *_: None)
    from multitoken.base.tokenizer import load_tokenizer

    docs = corpus_docs(data, load_tokenizer(PYTHIA_TOKENIZER))
    assert sum(len(d) for d in docs) == 5000
    got = stats_counts(out, 2, 50277)
    want = brute_counts(docs, 2)
    assert got[1] == dict(want[1]) and got[2] == dict(want[2])
    assert not (out / "keys3.npy").exists()


def test_two_processes_and_shards_match_one(tmp_path):
    docs = zipf_docs(400, vocab=300, max_len=200, seed=3)
    data = str(write_jsonl_ids(tmp_path / "ids.jsonl", docs))
    one = build_ids(tmp_path, data, "one", 300)
    two = build_ids(tmp_path, data, "two", 300, num_proc=2, memory_mb=4)
    arrays_equal(one, two, 3)


def test_pruning_keeps_only_frequent_ngrams(tmp_path):
    docs = zipf_docs(200, vocab=40, max_len=80, seed=4)
    data = str(write_jsonl_ids(tmp_path / "ids.jsonl", docs))
    out = build_ids(tmp_path, data, "pruned", 40, min_count=(1, 3, 5))
    want = brute_counts(docs, 3)
    got = stats_counts(out, 3, 40)
    assert got[2] == {k: v for k, v in want[2].items() if v >= 3}
    assert got[3] == {k: v for k, v in want[3].items() if v >= 5}
    import json

    meta = json.loads((out / "meta.json").read_text())
    assert meta["ngram_totals"]["3"] == sum(want[3].values())  # totals are before pruning
    assert meta["min_counts"] == {"1": 1, "2": 3, "3": 5}
