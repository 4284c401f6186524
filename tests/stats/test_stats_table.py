"""The co-occurrence mask: values match eq. 3/6 computed by hand, absent cells, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from .stats_helpers import PYTHIA_TOKENIZER, brute_counts, build_ids, write_jsonl_ids, zipf_docs

from multitoken.base.errors import CheckpointError, DataError, MismatchError, UsageError
from multitoken.stats.hashindex import HashIndex, PrefixBlockIndex, _fib
from multitoken.stats.table import CooccurrenceTable

V = 30


@pytest.fixture(scope="module")
def docs():
    return zipf_docs(300, vocab=V, max_len=60, seed=11)


@pytest.fixture(scope="module")
def stats(tmp_path_factory, docs):
    tmp = tmp_path_factory.mktemp("table")
    return build_ids(tmp, str(write_jsonl_ids(tmp / "ids.jsonl", docs)), "stats", V, min_count=(1, 1, 2))


def _expected(docs, cands, min_count, absent):
    ref = brute_counts(docs, len(cands))
    n1, nn = sum(ref[1].values()), sum(ref[len(cands)].values())
    grid = np.empty([len(c) for c in cands])
    for idx in np.ndindex(*grid.shape):
        toks = tuple(int(c[i]) for c, i in zip(cands, idx))
        joint = ref[len(cands)].get(toks, 0)
        marg = np.prod([ref[1].get((t,), 0) / n1 for t in toks])
        grid[idx] = absent if joint < min_count or marg == 0 else (joint / nn) / marg
    return grid


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("absent", [0.0, 1.0])
def test_mask_equals_hand_computed_ratio(stats, docs, n, absent):
    rng = np.random.default_rng(n)
    cands = [rng.choice(V, size=k, replace=False) for k in (7, 5, 6)[:n]]
    table = CooccurrenceTable(stats, absent=absent)
    want = _expected(docs, cands, min_count=1 if n == 2 else 2, absent=absent)
    np.testing.assert_allclose(table.ratio(cands), want, rtol=1e-5)
    np.testing.assert_allclose(table.mask(cands, alpha=0.5), want**0.5, rtol=1e-5)
    assert np.all(table.mask(cands, alpha=0.0) == 1.0)  # alpha 0: masking off, absent cells too


def test_torch_in_torch_out(stats):
    table = CooccurrenceTable(stats)
    cands = [torch.tensor([1, 2, 3]), torch.tensor([0, 4]), torch.tensor([5])]
    out = table.mask(cands)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 2, 1) and out.dtype == torch.float32
    np.testing.assert_array_equal(out.numpy(), table.mask([c.numpy() for c in cands]))


def test_fingerprint_mismatch_and_match(stats, stories_dir):
    from multitoken.base.tokenizer import load_tokenizer

    CooccurrenceTable.for_tokenizer(stats, load_tokenizer(PYTHIA_TOKENIZER))
    with pytest.raises(MismatchError, match="tokenizer"):
        CooccurrenceTable.for_tokenizer(stats, load_tokenizer(str(stories_dir)))


def test_bad_candidates_are_clear_errors(stats):
    table = CooccurrenceTable(stats)
    for bad in (np.array([0, V]), np.array([-1, 2]), np.array([2**63 + 1], np.uint64)):
        with pytest.raises(DataError, match="outside the vocabulary"):
            table.mask([np.array([1]), bad])
    with pytest.raises(DataError, match="non-empty"):
        table.mask([np.array([], dtype=np.int64), np.array([1])])
    with pytest.raises(UsageError, match="order-4"):
        table.mask([np.array([1])] * 4)
    with pytest.raises(UsageError, match="alpha"):
        table.mask([np.array([1]), np.array([2])], alpha=-1)


def test_not_a_stats_dir(tmp_path):
    with pytest.raises(CheckpointError, match="not a stats dir"):
        CooccurrenceTable(tmp_path)


@pytest.mark.parametrize("vocab", [50, 5000])
def test_hash_structures_agree_with_binary_search(vocab):
    rng = np.random.default_rng(vocab)
    keys = np.unique(rng.integers(0, vocab**3, 20000).astype(np.uint64))
    counts = rng.integers(1, 1000, keys.size).astype(np.uint32)
    queries = np.concatenate([keys[rng.integers(0, keys.size, 400)], rng.integers(0, vocab**3, 400).astype(np.uint64)])
    pos = np.minimum(np.searchsorted(keys, queries), keys.size - 1)
    want = np.where(keys[pos] == queries, counts[pos], 0)
    np.testing.assert_array_equal(HashIndex(keys, counts).lookup(queries), want)
    prefix, last = queries // np.uint64(vocab), (queries % np.uint64(vocab)).astype(np.int64)
    grid = PrefixBlockIndex(keys, counts, vocab, 3).grid(prefix, last)  # [m, m]; its diagonal is the queries
    np.testing.assert_array_equal(np.diagonal(grid), want)
    bigrams = np.unique(rng.integers(0, vocab**2, 5000).astype(np.uint64))  # order 2: dense prefix table
    q2 = np.concatenate([bigrams[:300], rng.integers(0, vocab**2, 300).astype(np.uint64)])
    pos2 = np.minimum(np.searchsorted(bigrams, q2), bigrams.size - 1)
    grid2 = PrefixBlockIndex(bigrams, np.ones(bigrams.size, np.uint32), vocab, 2).grid(q2 // np.uint64(vocab), (q2 % np.uint64(vocab)).astype(np.int64))
    np.testing.assert_array_equal(np.diagonal(grid2), (bigrams[pos2] == q2).astype(np.uint32))


@pytest.mark.parametrize("order", [2, 3])
def test_grid_long_probe_chains_unseen_prefixes_and_possible(order):
    """Every cell of a grid against a dense reference: a block whose keys crowd a few home
    slots (probe chains of hundreds, many windows), smaller blocks, unseen prefixes, and a
    ``possible`` filter."""
    vocab, rng = 1 << 20, np.random.default_rng(order)
    ids = rng.permutation(vocab)
    home = _fib(ids, np.uint64(64 - 13))                  # homes in an 8192-slot block
    cols = np.concatenate([ids[home < 40][:400], ids[home >= 40][:3000]])
    prefixes = np.unique(rng.integers(0, vocab ** (order - 1), 10)).astype(np.uint64)
    ref = np.zeros((prefixes.size, cols.size), np.uint32)
    ref[0, :400] = rng.integers(1, 1000, 400)             # 400 crowded + ~1200 others: 8192 slots
    for row, density in enumerate([0.4, 0.6, 0.1, 0.01, 0.002, 0.0005]):  # later rows stay unseen
        present = rng.random(cols.size) < density
        ref[row, present] = rng.integers(1, 1000, present.sum())
    p, c = np.nonzero(ref)
    keys = prefixes[p] * np.uint64(vocab) + cols[c].astype(np.uint64)
    srt = np.argsort(keys)
    index = PrefixBlockIndex(keys[srt], ref[p, c][srt], vocab, order)
    shuffle = rng.permutation(cols.size)
    np.testing.assert_array_equal(index.grid(prefixes, cols[shuffle]), ref[:, shuffle])
    possible = (ref > 0) | (rng.random(ref.shape) < 0.3)  # never False where a key is
    np.testing.assert_array_equal(index.grid(prefixes, cols, possible), ref)
    empty = PrefixBlockIndex(np.zeros(0, np.uint64), np.zeros(0, np.uint32), vocab, order)
    assert not empty.grid(prefixes[:3], cols[:5]).any()


def test_fib_hash_spreads_consecutive_ids():
    # frequent tokens have small ids: their home slots in a large block must not clump
    homes = _fib(np.arange(50_000), np.uint64(64 - 18))
    assert np.unique(homes).size > 0.9 * 50_000


def test_count_too_wide_for_a_slot_is_a_clear_error():
    # vocabulary 50 leaves 58 bits per slot for the count
    PrefixBlockIndex(np.array([7], np.uint64), np.array([2**58 - 1], np.uint64), 50, 2)
    with pytest.raises(DataError, match="does not fit"):
        PrefixBlockIndex(np.array([7], np.uint64), np.array([2**58], np.uint64), 50, 2)
