"""Output replacement keeps the user's files; locks, clean-up and workers of the stats job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from multitoken.base.atomic import output_lock
from multitoken.base.manifest import MANIFEST
from multitoken.base.errors import UsageError
from multitoken.base.outputs import prepare_output
from multitoken.base.publish import staged_output

from .cli_helpers import phrase_corpus, run_cli


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name or ".old-" in p.name or ".aside-" in p.name or p.name.endswith(".lock")]


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root`` with its bytes (None for a folder)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


# staged_output / prepare_output -------------------------------------------------------------
def test_publish_replaces_only_listed_files_and_removes_our_stale_ones(tmp_path):
    out = tmp_path / "out"
    with staged_output(out, "stats", "test", marker="meta.json") as stage:
        (stage / "keys2.npy").write_text("old2")
        (stage / "keys3.npy").write_text("old3")
        (stage / "sub").mkdir()
        (stage / "sub" / "a").write_text("old")
        (stage / "meta.json").write_text("old")
    (out / "notes.txt").write_text("mine")
    (out / "sub" / "mine.txt").write_text("mine too")  # the user's file inside our folder
    with staged_output(out, "stats", "test", marker="meta.json") as stage:
        (stage / "keys2.npy").write_text("new2")
        (stage / "sub").mkdir()
        (stage / "sub" / "b").write_text("new")
        (stage / "meta.json").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["keys2.npy", "meta.json", MANIFEST, "notes.txt", "sub"]
    assert (out / "keys2.npy").read_text() == "new2" and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (out / "sub").iterdir()) == ["b", "mine.txt"]
    assert sorted(json.loads((out / MANIFEST).read_text())["files"]) == ["keys2.npy", "meta.json", "sub/b"]
    assert _leftovers(tmp_path) == []


def test_a_failed_block_leaves_the_old_output_and_no_staging(tmp_path):
    out = tmp_path / "out"
    with staged_output(out, "stats", "test") as stage:
        (stage / "meta.json").write_text("old")
    before = _tree(out)
    with pytest.raises(KeyboardInterrupt), staged_output(out, "stats", "test") as stage:
        (stage / "meta.json").write_text("half")
        raise KeyboardInterrupt
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_new_output_dirs_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        with staged_output(tmp_path / "out", "eval", "test") as stage:
            (stage / "f").write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o750


def test_a_full_or_read_only_disk_fails_before_any_work(tmp_path, monkeypatch):
    import multitoken.base.outputs as outputs

    class Full:
        f_bavail, f_frsize = 3, 4096

    monkeypatch.setattr(outputs.os, "statvfs", lambda _p: Full())
    with pytest.raises(UsageError, match="no space left on the disk of --out"):
        prepare_output(str(tmp_path / "out"), "eval")
    monkeypatch.undo()

    def read_only(*_a, **_k):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(outputs.tempfile, "mkstemp", read_only)
    with pytest.raises(UsageError, match="cannot write to .*Read-only file system"):
        prepare_output(str(tmp_path / "out"), "eval")
    assert list(tmp_path.iterdir()) == []


# The stats job ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return phrase_corpus(tmp_path_factory.mktemp("c") / "corpus.jsonl")


def test_a_second_job_on_the_same_out_fails_at_once(corpus, tmp_path):
    out = tmp_path / "S"
    with output_lock(out, "test"):  # a first job holding the dir
        result = run_cli("stats", "build", "--data", corpus, "--out", out)
    assert result.returncode == 2 and f"another process (pid {os.getpid()}: " in result.stderr
    assert f"is writing {out} (a stats dir)" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # the lock went with its holder; the second job wrote nothing


def test_a_failed_build_leaves_no_lock_or_temp_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3, 4]}\n{"input_ids": [1, 99999, 3]}\n')
    out = tmp_path / "S"
    result = run_cli("stats", "build", "--data", bad, "--out", out, "--order", "2")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert _leftovers(tmp_path) == []


def test_merge_overwrite_replaces_only_our_arrays(corpus, tmp_path):
    from multitoken.pipeline.cli import main

    sharded, s = tmp_path / "sharded", tmp_path / "S"
    assert main(["stats", "build", "--data", str(corpus), "--out", str(sharded), "--order", "2", "--shard", "0/1"]) == 0
    assert main(["stats", "build", "--data", str(corpus), "--out", str(s), "--order", "3"]) == 0
    (s / "notes.txt").write_text("mine")
    result = run_cli("stats", "merge", sharded, "--out", s, "--overwrite")
    assert result.returncode == 0, result.stderr
    meta = json.loads((s / "meta.json").read_text())
    assert meta["orders"] == [1, 2]
    assert sorted(p.name for p in s.iterdir()) == ["config.json", "counts1.npy", "counts2.npy", "keys2.npy",
                                                   "meta.json", MANIFEST, "notes.txt"]  # keys3/counts3 of the old order gone
    assert (s / "notes.txt").read_text() == "mine"
    assert run_cli("stats", "info", s).returncode == 0
    assert _leftovers(tmp_path) == []


def test_an_interrupted_assembly_leaves_no_temp_file_and_reruns(corpus, tmp_path, monkeypatch):
    from multitoken.base.data import DataConfig
    from multitoken.stats import merge
    from multitoken.stats.job import BuildConfig, build

    real = merge.assemble

    def killed(parts, out, order):
        (out / f".keys{order}.npy.tmp-{os.getpid()}").write_bytes(b"half")  # what a kill mid-copy leaves
        raise KeyboardInterrupt

    monkeypatch.setattr(merge, "assemble", killed)
    cfg, data = BuildConfig(out=str(tmp_path / "S"), order=2), DataConfig(data=str(corpus))
    with pytest.raises(KeyboardInterrupt):
        build(cfg, data, log=lambda _m: None)
    assert not (tmp_path / "S" / "meta.json").exists() and _leftovers(tmp_path) == []
    monkeypatch.setattr(merge, "assemble", real)
    assert build(cfg, data, log=lambda _m: None) == tmp_path / "S"
    assert sorted(p.name for p in (tmp_path / "S").iterdir()) == ["config.json", "counts1.npy", "counts2.npy", "keys2.npy",
                                                                  "meta.json", MANIFEST]
    assert _leftovers(tmp_path) == []


def _children(pid: int) -> set[int]:
    try:
        return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc (Linux)")
def test_killing_the_parent_takes_its_workers_with_it(tmp_path):
    rng = np.random.default_rng(0)
    big = tmp_path / "big.jsonl"  # enough ids that two workers count for several seconds
    with open(big, "w") as fh:
        for _ in range(400):
            fh.write(json.dumps({"input_ids": rng.integers(3, 500, size=20000).tolist()}) + "\n")
    out, orphans = tmp_path / "S", []
    proc = subprocess.Popen([sys.executable, "-m", "multitoken.pipeline.cli", "stats", "build", "--data", str(big),
                             "--out", str(out), "--num-proc", "2", "--order", "3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while len(list(out.glob("partials/shard-*/.lock"))) < 2:  # both workers are counting
            assert proc.poll() is None and time.monotonic() < deadline, "the workers never started counting"
            time.sleep(0.05)
        workers = _children(proc.pid)
        assert len(workers) >= 2
        orphans.extend(workers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30  # generous: the kernel signals them at once
        while any(_alive(w) for w in workers):
            assert time.monotonic() < deadline, "workers outlived their parent"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in orphans:  # should the test fail: end the workers it started, by pid
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_rerun_after_a_finished_train_changes_nothing(tmp_path):
    from multitoken.embedded import EMBEDDED_HEADS

    corpus = phrase_corpus(tmp_path / "c.jsonl")
    args = ["train", "--heads", EMBEDDED_HEADS, "--data", corpus, "--out", tmp_path / "t", "--max-steps", "2",
            "--seq-len", "16", "--batch-size", "1", "--eval-batches", "1", "--eval-every", "1", "--no-progress"]
    assert run_cli(*args).returncode == 0
    metrics = (tmp_path / "t" / "train_metrics.json").read_text()
    assert [e["step"] for e in json.loads(metrics)] == [1, 2]
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.parent != tmp_path)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}
    again = run_cli(*args, "--resume")
    assert again.returncode == 0, again.stderr
    assert "finished at step 2 (--max-steps 2): nothing to do, nothing rewritten" in again.stderr
    assert (tmp_path / "t" / "train_metrics.json").read_text() == metrics
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files} == before  # heads, record, checkpoints untouched
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.parent != tmp_path) == files
    assert _leftovers(tmp_path) == []


def test_train_overwrite_replaces_our_heads_and_keeps_the_users_files(tmp_path):
    from multitoken.embedded import EMBEDDED_HEADS

    out = tmp_path / "h"
    assert run_cli("attach", "--out", out, "--n", "2").returncode == 0
    (out / "notes.txt").write_text("mine")  # attach_config.json: a stale output of ours, gone after the new run
    old = (out / "heads.safetensors").read_bytes()
    args = ["train", "--heads", EMBEDDED_HEADS, "--data", phrase_corpus(tmp_path / "c.jsonl"), "--out", out,
            "--max-steps", "1", "--seq-len", "16", "--batch-size", "1", "--eval-batches", "1", "--no-progress", "--lr", "1e-2"]
    refused = run_cli(*args)
    assert refused.returncode == 2 and "pass --overwrite" in refused.stderr
    assert run_cli(*args, "--overwrite").returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["draft_vocab.json", "heads.safetensors", "heads_config.json", MANIFEST,
                                                     "notes.txt", "train_config.json", "train_metrics.json"]
    assert (out / "notes.txt").read_text() == "mine" and (out / "heads.safetensors").read_bytes() != old
    assert _leftovers(tmp_path) == []


def test_a_backup_left_by_a_killed_swap_is_put_back_when_it_is_the_only_copy(tmp_path):
    """swap_dir killed between renaming the old dir aside and the new one in: the next run
    restores the old one; an aside dir beside a finished swap, and dead staging, are removed.
    swap_entries' backups (files moved aside, e.g. a single-file output's) are only removed:
    they never become a directory in the output's place."""
    from multitoken.base.atomic import remove_stale_staging

    dead = 4194304 + 7  # above Linux's pid_max: no such process
    only = tmp_path / f".out.aside-{dead}-x1"
    only.mkdir()
    (only / "heads.safetensors").write_text("old")
    (tmp_path / f".out.tmp-{dead}-x2").mkdir()
    remove_stale_staging(tmp_path, "out")
    assert (tmp_path / "out" / "heads.safetensors").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (tmp_path / f".out.aside-{dead}-x3").mkdir()
    remove_stale_staging(tmp_path, "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (tmp_path / "out" / "heads.safetensors").exists()
    files = tmp_path / f".result.jsonl.old-{dead}-x4"
    files.mkdir()
    (files / "result.jsonl").write_text("old")
    remove_stale_staging(tmp_path, "result.jsonl")
    assert not (tmp_path / "result.jsonl").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
