"""Interrupted builds: kill -9 mid-count then rerun gives the uninterrupted counts; bad partials fail clearly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from .stats_helpers import PYTHIA_TOKENIZER, arrays_equal, build_ids, write_jsonl_ids, zipf_docs

from multitoken.base.errors import CheckpointError, UsageError

VOCAB = 5000


def _cli(out: Path, data: Path, num_proc: int) -> list[str]:
    return [sys.executable, "-m", "multitoken.pipeline.cli", "stats", "build", "--data", str(data), "--out", str(out),
            "--tokenizer", PYTHIA_TOKENIZER, "--vocab-size", str(VOCAB), "--memory-mb", "4", "--num-proc", str(num_proc),
            "--min-count", "2"]


def _runs(out: Path) -> list[Path]:
    return sorted(out.glob("partials/shard-*/run-*"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("resume")
    return write_jsonl_ids(tmp / "ids.jsonl", zipf_docs(800, vocab=VOCAB, max_len=800, seed=7))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> Path:
    return build_ids(tmp_path_factory.mktemp("ref"), str(corpus), "reference", VOCAB, memory_mb=64, min_count=(2,))


@pytest.mark.parametrize("num_proc,kill_after_runs", [pytest.param(1, 2, marks=pytest.mark.slow),
                                                         pytest.param(2, 3, marks=pytest.mark.heavy)])
def test_sigkill_then_rerun_equals_uninterrupted(tmp_path, corpus, reference, num_proc, kill_after_runs):
    out = tmp_path / "killed"
    proc = subprocess.Popen(_cli(out, corpus, num_proc), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(_runs(out)) < kill_after_runs and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the build finished before it could be killed: make the corpus larger"
    os.killpg(proc.pid, signal.SIGKILL)  # the whole group: workers die too, mid-write or not
    proc.wait()
    assert not (out / "meta.json").exists() and _runs(out)
    done = subprocess.run(_cli(out, corpus, num_proc), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    arrays_equal(reference, out, 3)
    assert not (out / "partials").exists()


def test_rerun_of_finished_build_is_a_no_op(tmp_path, corpus, reference):
    stamp = (reference / "keys3.npy").stat().st_mtime_ns
    build_ids(reference.parent, str(corpus), "reference", VOCAB, memory_mb=64, min_count=(2,))
    assert (reference / "keys3.npy").stat().st_mtime_ns == stamp


def _partial_build(tmp_path: Path, corpus: Path) -> Path:
    out = build_ids(tmp_path, str(corpus), "part", VOCAB, memory_mb=4, shard="0/1", num_proc=1)
    assert not (out / "meta.json").exists()  # --shard counts only; merging comes later
    return out


def test_truncated_partial_is_a_clear_error(tmp_path, corpus):
    out = _partial_build(tmp_path, corpus)
    victim = _runs(out)[0] / "k3.npy"
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="truncated|unreadable"):
        build_ids(tmp_path, str(corpus), "part", VOCAB, memory_mb=4, shard="0/1")


def test_garbled_partial_info_is_a_clear_error(tmp_path, corpus):
    out = _partial_build(tmp_path, corpus)
    (_runs(out)[-1] / "info.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable partial"):
        build_ids(tmp_path, str(corpus), "part", VOCAB, memory_mb=4, shard="0/1")


def test_rerun_with_other_options_is_refused(tmp_path, corpus):
    _partial_build(tmp_path, corpus)
    with pytest.raises(UsageError, match="different job"):
        build_ids(tmp_path, str(corpus), "part", VOCAB, memory_mb=4, shard="0/1", order=2)
    with pytest.raises(UsageError, match="other --num-proc"):
        build_ids(tmp_path, str(corpus), "part", VOCAB, memory_mb=4, num_proc=2)


def test_unfinished_runs_are_resumed_not_recounted(tmp_path, corpus, reference):
    """Delete the final runs of a finished shard: the rerun recounts only what they held."""
    from multitoken.base.data import DataConfig
    from multitoken.stats.job import BuildConfig, make_job
    from multitoken.stats.shard import count_shard

    out = _partial_build(tmp_path, corpus)
    runs = _runs(out)
    assert len(runs) > 3
    import shutil

    for r in runs[len(runs) // 2:]:
        shutil.rmtree(r)
    job = make_job(BuildConfig(out=str(out), tokenizer=PYTHIA_TOKENIZER, vocab_size=VOCAB, memory_mb=4, shard="0/1"), DataConfig(data=str(corpus)))
    seen = []
    info = count_shard(job, (0, 1), seen.append)
    assert info["done"]
    assert seen[0] > 0 and sum(seen[1:]) < seen[0] + sum(seen[1:])  # resumed from a non-zero position
    from multitoken.stats.job import write_stats

    merged = tmp_path / "merged"
    write_stats(merged, [out / "partials" / "shard-00000-of-00001"], [1, 2, 2], 1, 64 << 20, log=lambda *_: None)
    arrays_equal(reference, merged, 3)


def test_rerun_with_other_min_count_reprunes_kept_partials(tmp_path):
    """A finished dir rebuilt with another --min-count is re-merged from its kept partials."""
    corpus = write_jsonl_ids(tmp_path / "ids.jsonl", zipf_docs(150, VOCAB, 60, seed=7))
    kept = build_ids(tmp_path, str(corpus), "kept", VOCAB, min_count=(1,), keep_partials=True)
    build_ids(tmp_path, str(corpus), "kept", VOCAB, min_count=(3,), keep_partials=True)
    fresh = build_ids(tmp_path, str(corpus), "fresh", VOCAB, min_count=(3,))
    arrays_equal(kept, fresh, 3)
    assert json.loads((kept / "meta.json").read_text())["min_counts"] == {"1": 1, "2": 3, "3": 3}


def test_rerun_with_other_min_count_without_partials_refuses(tmp_path):
    """Without partials the pruned counts cannot be re-pruned: a clear error, the dir left intact."""
    corpus = write_jsonl_ids(tmp_path / "ids.jsonl", zipf_docs(150, VOCAB, 60, seed=7))
    out = build_ids(tmp_path, str(corpus), "done", VOCAB, min_count=(2,))
    before = (out / "meta.json").read_text()
    with pytest.raises(UsageError, match="--min-count 1,2,2") as err:
        build_ids(tmp_path, str(corpus), "done", VOCAB, min_count=(5,))
    assert "--keep-partials" in err.value.fix
    assert (out / "meta.json").read_text() == before
    build_ids(tmp_path, str(corpus), "done", VOCAB, min_count=(2,))  # the same value still reads as complete
