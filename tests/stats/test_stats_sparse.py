"""The sparse DynaMo step (decoding/dynamo/sparse.py) on random and hand-made tables: the same live cells,
bit for bit, as the dense grid, through the scan and the probe lookups, numpy and numba, and on
the edge cases (no seen cell, one, cells on the grid's border, ties in Otsu)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from .stats_helpers import build_ids, write_jsonl_ids, zipf_docs

from multitoken.decoding.dynamo import sparse
from multitoken.decoding.config import DecodeConfig, numba_available
from multitoken.decoding.dynamo import Candidates, joint_cells
from multitoken.stats.table import CooccurrenceTable

VOCAB = 40
KERNELS = ["numpy", "numba"] if numba_available() else ["numpy"]
SWITCHES = [{}, {"adaptive_threshold": False}, {"blur_kernel": 0}, {"blur_kernel": 1}, {"static_threshold": False},
            {"alpha_c": 0.5}, {"repetition_penalty": 1.0}]


@pytest.fixture(scope="module")
def zipf_table(tmp_path_factory) -> CooccurrenceTable:
    tmp = tmp_path_factory.mktemp("sparse_zipf")
    corpus = write_jsonl_ids(tmp / "c.jsonl", zipf_docs(300, VOCAB, 60, seed=4))
    return CooccurrenceTable(build_ids(tmp, str(corpus), "stats", VOCAB))


def table_of(tmp_path, docs, name="t") -> CooccurrenceTable:
    return CooccurrenceTable(build_ids(tmp_path, str(write_jsonl_ids(tmp_path / f"{name}.jsonl", docs)), name, VOCAB))


def random_cands(rng, order: int, k: int, vocab: int = VOCAB) -> list[Candidates]:
    out = []
    for _ in range(order):
        ids = rng.choice(vocab, k, replace=False).astype(np.int64)
        probs = np.sort(rng.dirichlet(np.full(k, 0.4)).astype(np.float32))[::-1].copy()
        out.append(Candidates(ids, probs))
    return out


def assert_same(cands, cfg, table, seen, kernel, expect_kernel=None):
    ref = joint_cells(cands, replace(cfg, dynamic_kernel="dense"), table, seen)
    got = joint_cells(cands, replace(cfg, dynamic_kernel=kernel), table, seen)
    np.testing.assert_array_equal(got.flat, ref.flat)
    np.testing.assert_array_equal(got.values.view(np.uint32), ref.values.view(np.uint32))  # bit for bit
    if expect_kernel != "any":
        assert got.kernel == (expect_kernel or kernel)
    return ref, got


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("lookup", ["scan", "probe"])
@pytest.mark.parametrize("prefix_map", ["dense", "hash"])
def test_random_grids_match_the_dense_path(zipf_table, monkeypatch, kernel, lookup, prefix_map):
    """Rows scanned or probed; two-token prefixes found through the dense map (small
    vocabularies) or the index's hash table (large ones)."""
    monkeypatch.setattr(sparse, "SCAN_FACTOR", 10**9 if lookup == "scan" else 0)
    monkeypatch.setattr(sparse, "DENSE_PAIRS", 1 << 20 if prefix_map == "dense" else 0)
    zipf_table = CooccurrenceTable(zipf_table.path)  # layouts are cached per table object
    assert (sparse.layout(zipf_table, 3).arrays["dense"].size > 0) == (prefix_map == "dense")
    rng = np.random.default_rng(7)
    seen = rng.random(VOCAB) < 0.2
    live, used = 0, Counter()
    for trial in range(24):
        order, k = 2 + trial % 2, int(rng.integers(2, 15))
        cands = random_cands(rng, order, k)
        for eps in (0.0, 0.3, 0.5, 0.7):
            for switch in SWITCHES:
                cfg = DecodeConfig(mode="dynamic", eps_b=eps, **switch)
                ref, got = assert_same(cands, cfg, zipf_table, seen, kernel, "any")  # dense: no seen cell
                live += ref.flat.size
                used[got.kernel] += 1
    assert live > 1000, "the grids must hold live cells"
    assert used[kernel] > 0.8 * sum(used.values()), used


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("lookup", ["scan", "probe"])
def test_wide_candidate_lists_match_the_dense_path(tmp_path, monkeypatch, kernel, lookup):
    """k up to 300 (a row's hits span several 64-column words of the compiled scan; hash prefix
    map) on a 400-token vocabulary, with ids past it on every axis."""
    monkeypatch.setattr(sparse, "SCAN_FACTOR", 10**9 if lookup == "scan" else 0)
    monkeypatch.setattr(sparse, "DENSE_PAIRS", 0)
    vocab = 400
    corpus = write_jsonl_ids(tmp_path / "w.jsonl", zipf_docs(400, vocab, 200, seed=9))
    table = CooccurrenceTable(build_ids(tmp_path, str(corpus), "wide", vocab))
    rng = np.random.default_rng(3)
    live = 0
    for k, order in ((300, 2), (130, 3), (70, 3)):
        cands = random_cands(rng, order, k, vocab=vocab + 20)
        for eps in (0.0, 0.5):
            for switch in ({}, {"adaptive_threshold": False}):
                ref, _ = assert_same(cands, DecodeConfig(mode="dynamic", eps_b=eps, top_k=k, **switch), table,
                                     np.zeros(vocab + 20, bool), kernel)
                live += ref.flat.size
    assert live > 500, "the grids must hold live cells"


@pytest.mark.parametrize("kernel", KERNELS)
def test_ids_past_the_tables_vocabulary_stay_absent(zipf_table, kernel):
    """Embedding padding (ids >= the tokenizer's vocabulary): absent cells, as the dense mask."""
    rng = np.random.default_rng(1)
    cands = random_cands(rng, 3, 8, vocab=VOCAB + 10)
    assert any((c.ids >= VOCAB).any() for c in cands)
    assert_same(cands, DecodeConfig(mode="dynamic", eps_b=0.0), zipf_table, np.zeros(VOCAB + 10, bool), kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_no_seen_cell_takes_the_dense_path(tmp_path, kernel):
    """No candidate n-gram seen: the mask carries nothing, the grid stays unmasked (dense)."""
    table = table_of(tmp_path, [[0, 1, 2, 3]])
    cands = [Candidates(np.array([5, 6, 7]), np.array([0.5, 0.3, 0.2], np.float32)) for _ in range(3)]
    ref, _ = assert_same(cands, DecodeConfig(mode="dynamic", eps_b=0.0), table, np.zeros(VOCAB, bool), kernel, "dense")
    assert ref.flat.size > 0


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("corner", [0, -1])
def test_one_seen_cell_on_the_border(tmp_path, kernel, corner):
    """A single seen trigram at a grid corner: reflect-101 folds the blur back into the grid."""
    table = table_of(tmp_path, [[3, 4, 5]])
    k = 5
    cands = []
    for tok in (3, 4, 5):
        ids = np.array([t for t in range(10, 10 + k - 1)] + [tok])
        if corner == 0:
            ids = np.roll(ids, 1)
        cands.append(Candidates(ids, np.full(k, 0.2, np.float32)))
    for switch in SWITCHES:
        ref, _ = assert_same(cands, DecodeConfig(mode="dynamic", eps_b=0.5, **switch), table, np.zeros(VOCAB, bool), kernel)
        assert ref.flat.tolist() == [0 if corner == 0 else k**3 - 1]


@pytest.mark.parametrize("kernel", KERNELS)
def test_border_rows_and_otsu_ties(tmp_path, kernel):
    """Equal cells (same counts, flat probabilities) along the grid's edges: Otsu sees tied
    histogram bins and the blur reflects at both borders of every axis."""
    k = 6
    docs = [[a, b, c] for a in (0, 5) for b in (0, 5) for c in range(6)]
    table = table_of(tmp_path, docs)
    cands = [Candidates(np.arange(6), np.full(k, 1 / k, np.float32)) for _ in range(3)]
    for order in (2, 3):
        for eps in (0.0, 0.3):
            for switch in SWITCHES:
                cfg = DecodeConfig(mode="dynamic", eps_b=eps, **switch)
                assert_same(cands[:order], cfg, table, np.zeros(VOCAB, bool), kernel)


def test_sparse_applies_only_where_exact(zipf_table, tmp_path):
    cands = random_cands(np.random.default_rng(0), 3, 5)
    cfg = DecodeConfig(mode="dynamic")
    assert sparse.applies(cands, cfg, zipf_table)
    assert not sparse.applies(cands, replace(cfg, alpha_c=0.0), zipf_table)
    assert not sparse.applies(cands, replace(cfg, blur_kernel=5), zipf_table)
    assert sparse.applies(cands, replace(cfg, blur_kernel=5, adaptive_threshold=False), zipf_table)
    assert not sparse.applies(cands, cfg, None)
    neutral = CooccurrenceTable(zipf_table.path, absent=1.0)  # absent cells non-zero: every cell lives
    assert not sparse.applies(cands, cfg, neutral)
    plain = replace(cfg, static_threshold=False, adaptive_threshold=False)
    got = joint_cells(cands, plain, neutral, np.zeros(VOCAB, bool))
    assert got.kernel == "dense" and got.flat.size == 125
