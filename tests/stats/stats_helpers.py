"""Shared helpers for the stats tests: corpora written to tmp dirs and brute-force counts."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np

from multitoken.base.data import DataConfig, iter_documents
from multitoken.stats.format import decode
from multitoken.stats.job import BuildConfig, build

PYTHIA_TOKENIZER = str(Path(__file__).resolve().parents[1] / "assets" / "pythia_tokenizer")


def zipf_docs(n_docs: int, vocab: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Documents of Zipf-distributed ids (repeats, like text), lengths 0..max_len."""
    rng = np.random.default_rng(seed)
    return [((rng.zipf(1.3, size=int(rng.integers(0, max_len + 1))) - 1) % vocab).tolist() for _ in range(n_docs)]


def write_jsonl_ids(path: Path, docs: list[list[int]], column: str = "input_ids") -> Path:
    with open(path, "w") as fh:
        for d in docs:
            fh.write(json.dumps({column: d}) + "\n")
    return path


def write_parquet_ids(path: Path, docs: list[list[int]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": pa.array(docs, type=pa.list_(pa.int64()))}), path)
    return path


def brute_counts(docs, order: int) -> dict[int, collections.Counter]:
    """n-gram Counters per order, each document separately (the reference)."""
    out = {}
    for k in range(1, order + 1):
        c = collections.Counter()
        for d in docs:
            d = list(d)
            c.update(tuple(d[i:i + k]) for i in range(len(d) - k + 1))
        out[k] = c
    return out


def stats_counts(out: Path, order: int, vocab: int) -> dict[int, dict]:
    """The n-gram counts a stats dir holds, as dicts like ``brute_counts``."""
    res = {1: {(i,): int(c) for i, c in enumerate(np.load(out / "counts1.npy")) if c}}
    for k in range(2, order + 1):
        keys, counts = np.load(out / f"keys{k}.npy"), np.load(out / f"counts{k}.npy")
        assert np.all(np.diff(keys.astype(np.float64)) > 0) or keys.size < 2, "keys must be strictly increasing"
        res[k] = {tuple(t): int(c) for t, c in zip(decode(keys, k, vocab).tolist(), counts)}
    return res


def corpus_docs(data: DataConfig, tokenizer=None, vocab_size=None) -> list[np.ndarray]:
    return [ids for _, ids in iter_documents(data, tokenizer, vocab_size=vocab_size)]


def build_ids(tmp: Path, data: str, name: str, vocab: int, **kw) -> Path:
    """Build stats of an id corpus with the Pythia tokenizer's fingerprint and vocab ``vocab``."""
    out = tmp / name
    data_kw = {k: kw.pop(k) for k in ("column", "max_tokens") if k in kw}
    cfg = BuildConfig(out=str(out), tokenizer=PYTHIA_TOKENIZER, vocab_size=vocab, **kw)
    build(cfg, DataConfig(data=data, **data_kw), log=lambda *_: None)
    return out


def arrays_equal(a: Path, b: Path, order: int) -> None:
    names = ["counts1"] + [f"{x}{k}" for k in range(2, order + 1) for x in ("keys", "counts")]
    for name in names:
        np.testing.assert_array_equal(np.load(a / f"{name}.npy"), np.load(b / f"{name}.npy"), err_msg=name)
    ma, mb = (json.loads((p / "meta.json").read_text()) for p in (a, b))
    assert ma["ngram_totals"] == mb["ngram_totals"] and ma["distinct"] == mb["distinct"]
