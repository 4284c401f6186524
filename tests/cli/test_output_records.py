"""Outputs are owned by record: replacing one is all or nothing, only the files its record lists
are ever replaced or removed, and one lock per output refuses a second writer.

The property test fills a destination with random files of the user's bearing the names our
commands write (beside an earlier output of ours, or alone) and checks that the guard every
command runs first (``prepare_output``) and the publish every command ends with
(``publish.staged_output``) never change one of them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from multitoken.base.atomic import output_lock
from multitoken.base.errors import MultitokenError
from multitoken.base.manifest import MANIFEST, sidecar
from multitoken.base.outputs import KINDS, prepare_output
from multitoken.base.publish import staged_output

from .cli_helpers import phrase_corpus, run_cli

hypothesis = pytest.importorskip("hypothesis", reason="the ownership property test needs hypothesis (test extras)")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _tree(root: Path) -> dict[str, bytes | str | None]:
    """Every entry under ``root``: a file's bytes, a symlink's target, None for a folder."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else None if p.is_dir() else p.read_bytes()
    return out


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name or ".old-" in p.name or ".aside-" in p.name or p.name.endswith(".lock")]


# All or nothing ---------------------------------------------------------------------------------
def test_attach_overwrite_that_cannot_replace_a_file_leaves_every_old_byte(tmp_path, monkeypatch, capsys):
    from multitoken.pipeline.cli import main

    out = tmp_path / "H"
    assert main(["attach", "--out", str(out), "--n", "3"]) == 0
    (out / "notes.txt").write_text("mine")
    before = _tree(out)
    real_rename = os.rename

    def refuse_heads(src, dst, *a, **k):  # the old heads.safetensors cannot be moved (as if chattr +i)
        if Path(src) == out / "heads.safetensors":
            raise PermissionError(1, "Operation not permitted", str(src))
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", refuse_heads)
    capsys.readouterr()
    code = main(["attach", "--out", str(out), "--overwrite", "--n", "2"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert err.startswith("multitoken attach: error: could not replace the output in") and "the old output is unchanged" in err
    assert len(err.strip().splitlines()) == 2  # the problem, then its fix
    assert _tree(out) == before
    assert _leftovers(tmp_path) == []


def test_a_failure_while_moving_the_new_files_in_puts_the_old_ones_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    with staged_output(out, "eval", "test", marker="report.json") as stage:
        for name in ("report.json", "eval_config.json", "logit_lens.png"):
            (stage / name).write_text(f"old {name}")
    before = _tree(out)
    real_rename = os.rename

    def fail_last_new(src, dst, *a, **k):
        if Path(dst) == out / "report.json" and ".tmp-" in str(src):  # the marker, moved in last but the record
            raise OSError(28, "No space left on device", str(dst))
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", fail_last_new)
    with pytest.raises(MultitokenError, match="the old output is unchanged"), staged_output(out, "eval", "test", marker="report.json") as stage:
        for name in ("report.json", "eval_config.json"):
            (stage / name).write_text(f"new {name}")
    assert _tree(out) == before and _leftovers(tmp_path) == []


# Locks ------------------------------------------------------------------------------------------
def test_a_second_train_into_the_same_out_is_refused_naming_the_first(tmp_path):
    from multitoken.embedded import EMBEDDED_HEADS

    corpus = phrase_corpus(tmp_path / "c.jsonl")
    args = ["train", "--heads", EMBEDDED_HEADS, "--data", corpus, "--max-steps", "1", "--seq-len", "16",
            "--batch-size", "1", "--eval-batches", "1", "--no-progress"]
    with output_lock(tmp_path / "out", "test"):  # run A, still training
        refused = run_cli(*args, "--out", tmp_path / "out")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"another process (pid {os.getpid()}: " in refused.stderr and f"is writing {tmp_path / 'out'}" in refused.stderr
    with output_lock(tmp_path / "b.checkpoints", "test"):  # run A holds only the checkpoint folder
        refused = run_cli(*args, "--out", tmp_path / "b")
    assert refused.returncode == 2 and "b.checkpoints (training checkpoints)" in refused.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]  # neither wrote anything
    done = run_cli(*args, "--out", tmp_path / "out")  # released on every exit path: the lock is free again
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert record["command"] == "train" and "heads.safetensors" in record["files"]
    assert _leftovers(tmp_path) == []


def test_the_lock_names_the_holders_command(tmp_path):
    lock = tmp_path / ".out.lock"
    with output_lock(tmp_path / "out", "test"):
        pid, command = lock.read_text().splitlines()
    assert pid == str(os.getpid()) and command and not lock.exists()


# Single-file outputs ----------------------------------------------------------------------------
def test_distill_replaces_only_a_corpus_its_record_lists(tmp_path):
    out = tmp_path / "c.jsonl"
    args = ["distill", "--num-tokens", "8", "--batch-size", "2", "--out", out]
    assert run_cli(*args).returncode == 0
    record = json.loads(sidecar(out).read_text())
    assert record["kind"] == "corpus" and sorted(record["files"]) == ["c.jsonl", "c.jsonl.config.json"]
    assert record["files"]["c.jsonl"]["size"] == out.stat().st_size
    again = run_cli(*args)
    assert again.returncode == 2 and "pass --overwrite" in again.stderr
    assert run_cli(*args, "--seed", "1", "--overwrite").returncode == 0
    out.write_text('{"input_ids": [1, 2]}\n')  # the user's own corpus now, under our name
    changed = _tree(tmp_path)
    refused = run_cli(*args, "--overwrite")
    assert refused.returncode == 2 and "is not the file multitoken distill wrote" in refused.stderr
    assert _tree(tmp_path) == changed and _leftovers(tmp_path) == []


# Property: no command touches a file its record does not list ----------------------------------
NAMES = {kind: [n.replace("[0-9]", "7").replace("*", "00000001") for n in spec.names]
         for kind, spec in KINDS.items() if spec.names}
SETTINGS = settings(max_examples=100, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@st.composite
def destinations(draw):
    kind = draw(st.sampled_from(sorted(NAMES)))
    names = NAMES[kind]
    ours = draw(st.lists(st.sampled_from(names), unique=True, max_size=3))  # an earlier output of ours
    users = draw(st.lists(st.sampled_from([*names, MANIFEST, "notes.txt"]), unique=True, min_size=1, max_size=4))
    shapes = draw(st.lists(st.sampled_from(["file", "folder", "symlink"]), min_size=len(users), max_size=len(users)))
    new = draw(st.lists(st.sampled_from(names), unique=True, min_size=1, max_size=4))
    guarded = draw(st.booleans())  # False: the library path (e.g. save_heads), where publish alone guards
    return kind, ours, list(zip(users, shapes)), new, draw(st.booleans()), guarded


def _plant(path: Path, shape: str, outside: Path) -> None:
    if shape == "file":
        path.write_bytes(os.urandom(16))
    elif shape == "folder":
        path.mkdir()
        (path / "job.json").write_text('{"mine": true}')  # what our clean-up would look for
    else:
        path.symlink_to(outside)


@given(case=destinations())
@SETTINGS
def test_no_command_touches_a_file_its_record_does_not_list(tmp_path_factory, case):
    kind, ours, users, new, overwrite, guarded = case
    root = tmp_path_factory.mktemp("dest")
    out, outside = root / "out", root / "outside"
    outside.mkdir()
    (outside / "shard.txt").write_text("another job's")
    if ours:
        with staged_output(out, kind, "earlier") as stage:
            for name in ours:
                (stage / name).write_text(f"ours {name}")
    out.mkdir(exist_ok=True)
    planted = []
    for name, shape in users:
        target = out / name
        if os.path.lexists(target):  # ours already: the user replaces it (a changed file is not ours any more)
            if name == MANIFEST or not target.is_file():
                continue
            target.unlink()
        _plant(target, shape, outside)
        planted.append(name)
    before = {k: v for k, v in _tree(out).items() if Path(k).parts[0] in planted}
    outside_before = _tree(outside)
    try:
        if guarded:
            prepare_output(str(out), kind, overwrite=overwrite, resume=kind in ("stats-work", "checkpoints"))
        with staged_output(out, kind, "test") as stage:
            for name in new:
                (stage / name).write_text(f"new {name}")
        event("published")
    except MultitokenError:
        event("refused")  # fine, as long as nothing of the user's changed
    after = _tree(out)
    assert {k: after.get(k, "gone") for k in before} == before
    assert _tree(outside) == outside_before
    assert _leftovers(root) == []
