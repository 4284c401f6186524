"""Bad and careless inputs against every writing command and every reader, as subprocesses.

Each case of ``CASES`` damages an input or points ``--out`` somewhere it must not write, runs
``python -m multitoken.pipeline.cli ...`` and asserts: the exit code, one clean message (the
expected words, no ``Traceback``), and that every sentinel file (the user's own, beside or
inside the destination) is byte-identical afterwards. The inputs (a heads dir, a stats dir, a
corpus, partial counts of a sharded build, a finished train run) are made once per module,
from the embedded stories260K assets.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from multitoken.pipeline.cli import main
from multitoken.pipeline.embedded import EMBEDDED_HEADS, EMBEDDED_STATS

from conftest import fixture_path


def run_cli(*args, cwd=None, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "multitoken.pipeline.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def phrase_corpus(path: Path, docs: int = 40) -> Path:
    rng = np.random.default_rng(0)
    lines = [json.dumps({"input_ids": rng.integers(3, 500, size=int(rng.integers(20, 60))).tolist()}) for _ in range(docs)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("world")
    w = {"heads": Path(shutil.copytree(EMBEDDED_HEADS, root / "heads")),
         "stats": Path(shutil.copytree(EMBEDDED_STATS, root / "stats")),
         "corpus": phrase_corpus(root / "corpus.jsonl")}
    # partial counts of a sharded order-2 build (merged later by `stats merge`)
    assert main(["stats", "build", "--data", str(w["corpus"]), "--out", str(root / "sharded"), "--order", "2", "--shard", "0/1"]) == 0
    w["sharded"] = root / "sharded"
    # a finished one-step train run and its checkpoint
    assert main(["train", "--heads", str(w["heads"]), "--data", str(w["corpus"]), "--out", str(root / "trained"),
                 "--max-steps", "1", "--seq-len", "16", "--batch-size", "1", "--eval-batches", "1", "--no-progress"]) == 0
    w["trained"] = root / "trained"
    w["bin"], w["tok"] = fixture_path("stories260K", "stories260K.bin"), fixture_path("stories260K", "tok512.model")
    return w


@dataclass
class Case:
    args: list
    code: int
    message: str
    sentinels: list[Path] = field(default_factory=list)
    cwd: Path | None = None
    env: dict | None = None


def _note(path: Path, text: str = "the user's own notes\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _train(w, out, *extra):
    return ["train", "--heads", w["heads"], "--data", w["corpus"], "--out", out, "--max-steps", "2",
            "--seq-len", "16", "--batch-size", "1", "--eval-batches", "1", "--no-progress", *extra]


def _edit_json(path: Path, edit) -> None:
    value = json.loads(path.read_text())
    value = edit(value)
    path.write_text(json.dumps(value))


def _set(key, value):
    def edit(d):
        d[key] = value
        return d
    return edit


def _del(key):
    def edit(d):
        d.pop(key)
        return d
    return edit


# Data lost (each exited 0 and destroyed the user's files before) ------------------------------
def train_into_folder_with_other_files(w, d):
    notes, sub = _note(d / "x" / "notes.txt"), _note(d / "x" / "sub" / "f.txt")
    return Case(_train(w, d / "x"), 2, "does not hold a heads dir", [notes, sub])


def train_into_current_dir(w, d):
    return Case(_train(w, "."), 2, "is the current directory", [_note(d / "notes.txt")], cwd=d)


def train_into_folder_holding_the_inputs(w, d):
    heads = Path(shutil.copytree(w["heads"], d / "W" / "heads"))
    corpus = Path(shutil.copy(w["corpus"], d / "W" / "c.jsonl"))
    args = ["train", "--heads", heads, "--data", corpus, "--out", d / "W", "--max-steps", "1"]
    return Case(args, 2, "is a parent of the input", [corpus, heads / "heads_config.json", heads / "heads.safetensors"])


def train_into_its_own_input(w, d):
    heads = Path(shutil.copytree(w["heads"], d / "h"))
    args = ["train", "--heads", heads, "--data", w["corpus"], "--out", heads, "--max-steps", "1", "--overwrite"]
    return Case(args, 2, "is the input", [heads / "heads_config.json", heads / "heads.safetensors"])


def train_into_home(w, d):
    return Case(_train(w, "~"), 2, "is your home directory", [_note(d / "notes.txt")], env={**os.environ, "HOME": str(d)})


def train_checkpoints_into_a_foreign_folder(w, d):
    notes = _note(d / "ck" / "notes.txt")
    return Case(_train(w, d / "out", "--checkpoint-dir", d / "ck"), 2, "does not hold training checkpoints", [notes])


def stats_build_over_other_content(w, d):
    config = _note(d / "U" / "config.json", '{"mine": true}\n')
    mine = _note(d / "U" / "partials" / "mine.txt")
    return Case(["stats", "build", "--data", w["corpus"], "--out", d / "U"], 2, "does not hold a stats dir", [config, mine])


def stats_build_over_a_corrupt_stats_dir(w, d):
    meta = _note(d / "S" / "meta.json", "{not json")
    return Case(["stats", "build", "--data", w["corpus"], "--out", d / "S"], 2, "holds a damaged stats dir", [meta])


def stats_merge_over_a_finished_stats_dir(w, d):
    s = Path(shutil.copytree(w["stats"], d / "S"))
    notes = _note(s / "notes.txt")
    return Case(["stats", "merge", w["sharded"], "--out", s], 2, "already holds a stats dir",
                [notes, s / "meta.json", s / "keys3.npy", s / "counts2.npy"])


def distill_over_an_existing_file(w, d):
    notes = _note(d / "NOTES.md")
    return Case(["distill", "--num-tokens", "10", "--out", notes], 2, "exists", [notes])


def distill_overwrite_a_file_we_did_not_write(w, d):
    notes = _note(d / "NOTES.md")
    return Case(["distill", "--num-tokens", "10", "--out", notes, "--overwrite"], 2, "not a corpus written by multitoken distill", [notes])


def attach_into_folder_with_other_files(w, d):
    notes = _note(d / "x" / "notes.txt")
    return Case(["attach", "--out", d / "x", "--overwrite"], 2, "does not hold a heads dir", [notes])


def convert_into_folder_with_other_files(w, d):
    notes = _note(d / "x" / "notes.txt")
    return Case(["convert-llama2c", w["bin"], "--tokenizer", w["tok"], "--out", d / "x"], 2, "does not hold a converted model", [notes])


def eval_out_is_a_file(w, d):
    f = _note(d / "report.txt")
    return Case(["eval", "--heads", w["heads"], "--data", w["corpus"], "--out", f], 2, "is an existing file", [f])


def sweep_out_under_a_file(w, d):
    f = _note(d / "file")
    return Case(["sweep", "--out", d / "file" / "sub"], 2, "is a file, not a directory", [f])


def eval_out_not_writable(w, d):
    return Case(["eval", "--heads", w["heads"], "--data", w["corpus"], "--out", "/sys/multitoken-bad-input-test"], 2, "cannot write to /sys")


def sweep_out_holds_a_sweep(w, d):
    out = d / "sw"
    sweep = _note(out / "sweep.json", "{}\n")
    return Case(["sweep", "--out", out], 2, "already holds a sweep", [sweep])


def stats_build_out_is_a_file(w, d):
    f = _note(d / "S")
    return Case(["stats", "build", "--data", w["corpus"], "--out", f], 2, "is an existing file", [f])


def stats_merge_out_not_writable(w, d):
    return Case(["stats", "merge", w["sharded"], "--out", "/sys/multitoken-bad-input-test"], 2, "cannot write to /sys")


def distill_out_not_writable(w, d):
    return Case(["distill", "--num-tokens", "10", "--out", "/sys/multitoken-bad-input-test.jsonl"], 2, "cannot write to /sys")


def attach_out_is_a_file(w, d):
    f = _note(d / "heads")
    return Case(["attach", "--out", f], 2, "is an existing file", [f])


# Damaged stats dirs ---------------------------------------------------------------------------
def _stats(w, d, damage) -> Path:
    s = Path(shutil.copytree(w["stats"], d / "S"))
    damage(s)
    return s


def _meta_case(edit, message):
    def case(w, d):
        s = _stats(w, d, lambda s: _edit_json(s / "meta.json", edit))
        return Case(["stats", "info", s], 1, message)
    case.__name__ = f"meta_{message}"
    return case


def meta_not_utf8(w, d):
    s = _stats(w, d, lambda s: (s / "meta.json").write_bytes(b'{"format_version": 1, "x": "\xff\xfe"}'))
    return Case(["stats", "info", s], 1, "not valid JSON")


def stats_keys_file_empty(w, d):
    s = _stats(w, d, lambda s: (s / "keys2.npy").write_bytes(b""))
    return Case(["stats", "info", s], 1, "keys2.npy: missing or unreadable")


def stats_counts_are_nan_floats(w, d):
    def damage(s):
        n = np.load(s / "counts2.npy").size
        np.save(s / "counts2.npy", np.full(n, np.nan))
    return Case(["stats", "info", _stats(w, d, damage)], 1, "counts2.npy: holds")


def stats_keys_unsorted(w, d):
    def damage(s):
        keys = np.load(s / "keys2.npy")
        np.save(s / "keys2.npy", keys[::-1].copy())
    s = _stats(w, d, damage)
    return Case(["generate", "Once upon a time", "--mode", "dynamic", "--stats", s, "--max-new-tokens", "4"], 1, "not sorted")


# Damaged heads dirs ---------------------------------------------------------------------------
def _heads_case(edit, message, raw: bytes | None = None):
    def case(w, d):
        h = Path(shutil.copytree(w["heads"], d / "H"))
        if raw is not None:
            (h / "heads_config.json").write_bytes(raw)
        else:
            _edit_json(h / "heads_config.json", edit)
        return Case(["generate", "Once", "--heads", h, "--max-new-tokens", "2"], 1, message)
    return case


# Damaged train checkpoints (resume) -------------------------------------------------------------
def _resume_case(damage, message):
    def case(w, d):
        out = Path(shutil.copytree(w["trained"], d / "trained"))
        ckpt = Path(shutil.copytree(w["trained"].with_name("trained.checkpoints"), d / "trained.checkpoints"))
        damage(ckpt / "step-00000001", d)
        return Case(_train(w, out, "--resume"), 1, message, [out / "heads_config.json", out / "train_metrics.json"])
    return case


class _Planted:
    def __init__(self, flag: str):
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def _truncate(step, d):
    f = step / "trainable.safetensors"
    f.write_bytes(f.read_bytes()[:100])


def _state_list(step, d):
    (step / "state.json").write_text("[]")


def _pickle_payload(step, d):
    (step / "optimizer.pt").write_bytes(pickle.dumps({"state": _Planted(str(d / "PWNED"))}))


# Merge partials, llama2.c ----------------------------------------------------------------------
def merge_corrupt_job_json(w, d):
    p = Path(shutil.copytree(w["sharded"], d / "p"))
    for job in (p / "partials").glob("shard-*/job.json"):
        job.write_text("{")
    return Case(["stats", "merge", p, "--out", d / "new"], 1, "job.json: missing or not valid JSON")


def convert_empty_tokenizer(w, d):
    empty = d / "empty.model"
    empty.write_bytes(b"")
    return Case(["convert-llama2c", w["bin"], "--tokenizer", empty, "--out", d / "new"], 1, "is empty")


CASES = {f.__name__: f for f in [
    train_into_folder_with_other_files, train_into_current_dir, train_into_folder_holding_the_inputs,
    train_into_its_own_input, train_into_home, train_checkpoints_into_a_foreign_folder,
    stats_build_over_other_content, stats_build_over_a_corrupt_stats_dir, stats_merge_over_a_finished_stats_dir,
    distill_over_an_existing_file, distill_overwrite_a_file_we_did_not_write, attach_into_folder_with_other_files,
    convert_into_folder_with_other_files, eval_out_is_a_file, sweep_out_under_a_file, eval_out_not_writable,
    sweep_out_holds_a_sweep, stats_build_out_is_a_file, stats_merge_out_not_writable, distill_out_not_writable,
    attach_out_is_a_file,
    meta_not_utf8, stats_keys_file_empty, stats_counts_are_nan_floats, stats_keys_unsorted,
    merge_corrupt_job_json, convert_empty_tokenizer,
]}
CASES.update({
    "meta_missing_vocab_size": _meta_case(_del("vocab_size"), "lacks vocab_size"),
    "meta_vocab_size_text": _meta_case(_set("vocab_size", "512"), "vocab_size must be"),
    "meta_not_an_object": _meta_case(lambda m: 5, "not an object"),
    "meta_orders_1_to_5": _meta_case(_set("orders", [1, 2, 3, 4, 5]), "orders must be [1, ..., N] with N <= 3"),
    "meta_zero_totals": _meta_case(_set("ngram_totals", {"1": 0, "2": 0, "3": 0}), "ngram_totals must map"),
    "meta_distinct_lies": _meta_case(lambda m: {**m, "distinct": {**m["distinct"], "2": m["distinct"]["2"] + 1}}, "keys2.npy: holds"),
    "heads_format_version_text": _heads_case(_set("format_version", "1"), "format_version must be an integer"),
    "heads_format_version_null": _heads_case(_set("format_version", None), "format_version must be an integer"),
    "heads_config_is_5": _heads_case(None, "holds a JSON int, not an object", raw=b"5"),
    "heads_config_not_utf8": _heads_case(None, "is not valid JSON", raw=b'{"format_version": "\xff"}'),
    "heads_fingerprint_text": _heads_case(_set("base_fingerprint", "abc"), "base_fingerprint must be an object"),
    "heads_lora_outside": _heads_case(_set("lora", "../../../etc"), "points outside the heads dir"),
    "resume_truncated_weights": _resume_case(_truncate, "trainable.safetensors is missing, truncated"),
    "resume_state_is_a_list": _resume_case(_state_list, "state.json holds a JSON list, not an object"),
    "resume_pickle_payload": _resume_case(_pickle_payload, "refused to load it"),
})


def _snapshot(paths: list[Path]) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in paths}


TEST = "test_bad_input_ends_in_one_clean_line"


@pytest.fixture(scope="module")
def outcomes(world, request, tmp_path_factory) -> dict:
    """Every selected case, damaged one by one, then run side by side (each is a separate
    process that mostly waits on imports): {name: (case, its dir, sentinels before, result)}."""
    names = [item.callspec.params["name"] for item in request.session.items
             if getattr(item, "originalname", None) == TEST and item.module.__name__ == request.module.__name__]
    prepared = {}
    for name in names:
        d = tmp_path_factory.mktemp(name)
        case = CASES[name](world, d)
        prepared[name] = (case, d, _snapshot(case.sentinels))
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 1))) as pool:
        futures = {n: pool.submit(run_cli, *c.args, cwd=c.cwd, env=c.env) for n, (c, _, _) in prepared.items()}
        return {n: (*prepared[n], f.result()) for n, f in futures.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_ends_in_one_clean_line(outcomes, name):
    case, d, before, result = outcomes[name]
    err = result.stderr
    assert "Traceback" not in err, err
    assert result.returncode == case.code, err
    assert case.message in err, err
    assert _snapshot(case.sentinels) == before  # nothing of the user's lost or changed
    assert not (d / "PWNED").exists()  # no planted code ran
    leftovers = [p for p in d.rglob("*") if ".tmp-" in p.name or p.name == ".lock" or ".multitoken-probe" in p.name]
    assert leftovers == []
