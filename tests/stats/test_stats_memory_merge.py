"""Memory bound, shard-by-shard builds merged later, and the CLI's clear errors."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

import pytest

from multitoken.base.data import DataConfig
from multitoken.base.errors import UsageError
from multitoken.stats.job import BuildConfig, make_job, merge, write_stats
from multitoken.stats.sharding import check_coverage
from multitoken.stats.shard import count_shard, list_runs, shard_dir

from .stats_helpers import PYTHIA_TOKENIZER, arrays_equal, build_ids, write_jsonl_ids, zipf_docs

VOCAB = 50000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mem")
    return write_jsonl_ids(tmp / "ids.jsonl", zipf_docs(600, vocab=VOCAB, max_len=1500, seed=5))


def test_counting_and_merging_stay_under_the_memory_bound(tmp_path, corpus):
    bound_mb = 8
    cfg = BuildConfig(out=str(tmp_path / "s"), tokenizer=PYTHIA_TOKENIZER, vocab_size=VOCAB, memory_mb=bound_mb)
    job = make_job(cfg, DataConfig(data=str(corpus)))
    tracemalloc.start()
    try:
        info = count_shard(job, (0, 1))
        _, count_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        write_stats(tmp_path / "s", [shard_dir(job.out, (0, 1))], [1, 1, 1], 1, job.memory_bytes, log=lambda *_: None)
        _, merge_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info["tokens"] > 300_000
    assert len(list_runs(shard_dir(job.out, (0, 1)))) > 3, "the bound must force spills to disk"
    assert count_peak < bound_mb << 20, f"counting peaked at {count_peak / 2**20:.1f} MiB"
    assert merge_peak < bound_mb << 20, f"merging peaked at {merge_peak / 2**20:.1f} MiB"


def test_shards_on_two_machines_merge_to_the_single_build(tmp_path, corpus):
    single = build_ids(tmp_path, str(corpus), "single", VOCAB, min_count=(2,))
    a = build_ids(tmp_path, str(corpus), "machine_a", VOCAB, shard="0/2")
    b = build_ids(tmp_path, str(corpus), "machine_b", VOCAB, shard="1/2", num_proc=2)  # sub-shards 1/4, 3/4
    merged = tmp_path / "merged"
    merge([str(a), str(b)], str(merged), (2,), num_proc=2, memory_mb=4)
    arrays_equal(single, merged, 3)
    with pytest.raises(UsageError, match="do not cover"):
        merge([str(a)], str(tmp_path / "half"), (2,), num_proc=1, memory_mb=64)


def test_coverage_check():
    check_coverage([(0, 2), (1, 4), (3, 4)])
    with pytest.raises(UsageError, match="counted twice"):
        check_coverage([(0, 2), (0, 4), (1, 2)])
    with pytest.raises(UsageError, match="missing"):
        check_coverage([(0, 3), (1, 3)])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "multitoken.pipeline.cli", "stats", *args], capture_output=True, text=True, timeout=300)


def test_cli_build_info_and_errors(tmp_path, corpus, capsys):
    from ..conftest import fixture_path

    from multitoken.pipeline.cli import main

    out = tmp_path / "cli"
    r = _cli("build", "--data", str(fixture_path("pile_dummy")), "--tokenizer", PYTHIA_TOKENIZER, "--out", str(out), "--min-count", "1")
    assert r.returncode == 0, r.stderr
    assert main(["stats", "info", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "order 3" in shown and "tokens" in shown
    common = ["--data", str(corpus), "--tokenizer", PYTHIA_TOKENIZER]
    assert main(["stats", "build", *common, "--order", "4", "--out", str(tmp_path / "x")]) == 2
    assert "order 4 is not supported" in capsys.readouterr().err
    assert main(["stats", "build", *common, "--column", "text", "--out", str(tmp_path / "y")]) == 1
    assert "column 'text' not found" in capsys.readouterr().err
    assert main(["stats", "build", *common, "--vocab-size", "10", "--out", str(tmp_path / "z")]) == 1
    assert "outside the vocabulary" in capsys.readouterr().err
    assert main(["stats", "info", str(tmp_path / "y")]) == 1
    assert "not a stats dir" in capsys.readouterr().err


def test_empty_corpus_is_a_clear_error(tmp_path):
    from multitoken.base.errors import DataError

    data = write_jsonl_ids(tmp_path / "empty.jsonl", [[], []])
    with pytest.raises(DataError, match="no tokens"):
        build_ids(tmp_path, str(data), "e", 10)
    (tmp_path / "none.jsonl").write_text("")
    with pytest.raises(DataError, match="no rows"):
        build_ids(tmp_path, str(tmp_path / "none.jsonl"), "n", 10)
