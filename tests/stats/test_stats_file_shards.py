"""Map tasks cut by input file: each reads only its own files, and the stats dir is byte-identical
to the cut by documents (every task reads the whole corpus); manual shards cut by files merge
and are checked to tile the files."""

from __future__ import annotations

import filecmp
import json
import shutil
from pathlib import Path

import pytest
from .stats_helpers import PYTHIA_TOKENIZER, build_ids, write_jsonl_ids, write_parquet_ids, zipf_docs

from multitoken.base.manifest import MANIFEST
from multitoken.base.data import DataConfig
from multitoken.base.errors import DataError, UsageError
from multitoken.stats.job import BuildConfig, make_job, merge
from multitoken.stats.sharding import assign_shards, check_tiling, file_shard
from multitoken.stats.shard import Shard, count_shard, list_runs, shard_dir

VOCAB = 50000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Five files (jsonl and parquet, one of them empty) of Zipf ids."""
    root = tmp_path_factory.mktemp("files") / "corpus"
    root.mkdir()
    docs = zipf_docs(250, vocab=VOCAB, max_len=300, seed=11)
    write_jsonl_ids(root / "a.jsonl", docs[:40])
    write_parquet_ids(root / "b.parquet", docs[40:120])
    write_jsonl_ids(root / "c.jsonl", [])
    write_jsonl_ids(root / "d.jsonl", docs[120:200])
    write_parquet_ids(root / "e.parquet", docs[200:])
    return root


def same_stats(a: Path, b: Path) -> None:
    """Every file but config.json (and the record, which holds its sha256) byte for byte (meta.json
    included: it records no shard plan)."""
    names = sorted(p.name for p in a.iterdir() if p.is_file() and p.name not in ("config.json", ".lock", MANIFEST))
    assert names == sorted(p.name for p in b.iterdir() if p.is_file() and p.name not in ("config.json", ".lock", MANIFEST))
    assert "meta.json" in names and "keys3.npy" in names
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), name


def plan(tmp: Path, corpus: Path, **kw) -> tuple[str, list[Shard]]:
    cfg = BuildConfig(out=str(tmp), **kw)
    return assign_shards(cfg.shard, cfg.num_proc, cfg.shard_by, DataConfig(data=str(corpus)))


def test_plan_cuts_by_files_and_tiles_them(tmp_path, corpus):
    assert plan(tmp_path, corpus, num_proc=2) == ("files", [Shard(0, 1, 0, 2, 5), Shard(0, 1, 2, 5, 5)])
    assert plan(tmp_path, corpus, num_proc=2, shard_by="documents") == ("documents", [Shard(0, 2), Shard(1, 2)])
    assert plan(tmp_path, corpus / "a.jsonl", num_proc=2)[0] == "documents"  # one file: by documents, as before
    assert plan(tmp_path, corpus, num_proc=2, shard="1/2") == ("files", [Shard(0, 1, 2, 3, 5), Shard(0, 1, 3, 5, 5)])
    with pytest.raises(UsageError, match="--max-tokens"):
        assign_shards(None, 1, "files", DataConfig(data=str(corpus), max_tokens=10))
    for files in range(1, 8):
        for tasks in range(1, 10):
            shards = [file_shard(s, tasks, files) for s in range(tasks)]
            check_tiling([s.record() for s in shards])  # every document of every file exactly once
            reads = [sum(s.first <= f < s.end for s in shards) for f in range(files)]
            assert max(reads) == -(-tasks // files)  # a file is read by ceil(T/F) tasks at most, not T


def test_a_task_reads_only_its_own_files(tmp_path, corpus):
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    (data / "e.parquet").write_text("not parquet")  # outside the group counted below
    job = make_job(BuildConfig(out=str(tmp_path / "s"), tokenizer=PYTHIA_TOKENIZER, vocab_size=VOCAB), DataConfig(data=str(data)))
    info = count_shard(job, Shard(0, 1, 0, 2, 5))
    assert info["done"] and info["tokens"] > 0
    record = json.loads((shard_dir(job.out, Shard(0, 1, 0, 2, 5)) / "job.json").read_text())
    assert record["shard"] == [0, 1] and record["files"] == [0, 2, 5]
    with pytest.raises(DataError, match="unreadable parquet"):
        count_shard(job, Shard(0, 1, 2, 5, 5))
    (data / "f.jsonl").write_text("")
    with pytest.raises(DataError, match="now has 6 data files, the job was planned on 5"):
        count_shard(job, Shard(0, 1, 0, 1, 5))  # a resumed shard must read the files it was planned on


@pytest.mark.parametrize("pattern, num_proc", [("*", 2), ("[ab]*", 3)])
def test_files_and_documents_give_the_same_bytes(tmp_path, corpus, pattern, num_proc):
    """2 tasks over 5 files: groups of whole files; 3 tasks over 2 files: the first file shared by
    two tasks (a residue of its documents each)."""
    data = str(corpus / pattern)
    by_docs = build_ids(tmp_path, data, "docs", VOCAB, num_proc=1, shard_by="documents", min_count=(2,))
    by_files = build_ids(tmp_path, data, "files", VOCAB, num_proc=num_proc, shard_by="files", min_count=(2,))
    same_stats(by_docs, by_files)
    cfg = json.loads((by_files / "config.json").read_text())
    assert cfg["sharding"]["shard_by"] == "files" and len(cfg["sharding"]["shards"]) == num_proc


def test_manual_file_shards_merge_and_must_tile(tmp_path, corpus):
    """--shard I/3 on three 'machines' (files 0, 1-2, 3-4), merged: the single build's bytes. One
    shard missing, or a shard cut by documents mixed in, is refused."""
    single = build_ids(tmp_path, str(corpus), "single", VOCAB, min_count=(2,), num_proc=1, shard_by="documents")
    parts = [build_ids(tmp_path, str(corpus), f"m{i}", VOCAB, shard=f"{i}/3", num_proc=p, memory_mb=4)
             for i, p in ((0, 1), (1, 1), (2, 1))]
    merged = tmp_path / "merged"
    merge([str(p) for p in parts], str(merged), (2,), num_proc=1, memory_mb=64)
    for name in ("counts1.npy", "keys2.npy", "counts2.npy", "keys3.npy", "counts3.npy"):
        assert filecmp.cmp(single / name, merged / name, shallow=False), name
    a, b = (json.loads((d / "meta.json").read_text()) for d in (single, merged))
    assert {k: v for k, v in a.items() if k != "data_files"} == {k: v for k, v in b.items() if k != "data_files"}
    with pytest.raises(UsageError, match=r"files 3\.\.4 missing"):
        merge([str(p) for p in parts[:2]], str(tmp_path / "short"), (2,), num_proc=1, memory_mb=64)
    docs = build_ids(tmp_path, str(corpus), "docs2", VOCAB, shard="2/3", shard_by="documents")
    with pytest.raises(UsageError, match="mix a cut by files with a cut by documents"):
        merge([str(parts[0]), str(parts[1]), str(docs)], str(tmp_path / "mixed"), (2,), num_proc=1, memory_mb=64)


def test_file_shard_resumes_from_its_runs(tmp_path, corpus):
    """Drop the later runs of a finished file shard: the rerun counts only what they held."""
    shard = Shard(0, 1, 1, 5, 5)
    job = make_job(BuildConfig(out=str(tmp_path / "s"), tokenizer=PYTHIA_TOKENIZER, vocab_size=VOCAB, memory_mb=4),
                   DataConfig(data=str(corpus)))
    job.checkpoint_seconds = 0.0  # a run per chunk: several runs from a small corpus
    whole = count_shard(job, shard)
    runs = list_runs(shard_dir(job.out, shard))
    assert len(runs) > 2
    for r in runs[len(runs) // 2:]:
        shutil.rmtree(r)
    seen: list[int] = []
    again = count_shard(job, shard, seen.append)
    assert again["tokens"] == whole["tokens"] and again["totals"] == whole["totals"]
    assert 0 < seen[0] < whole["tokens"]  # resumed from the runs left, not from the start
