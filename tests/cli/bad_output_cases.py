"""Bad-input cases, part 1: ``Case`` and the destinations a writing command must refuse
(``--out`` over the user's files, a file, an input, home, an unwritable place). Part 2, the
damaged inputs and option ranges, and the whole table ``CASES``: ``bad_input_cases.py``."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

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


def stats_build_work_dir_with_other_files(w, d):
    mine = _note(d / "W" / "merge-notes.txt")
    parts = _note(d / "W" / "merge-parts" / "mine.txt")
    return Case(["stats", "build", "--data", w["corpus"], "--out", d / "S", "--work-dir", d / "W"], 2,
                "--work-dir", [mine, parts])


def stats_build_over_a_corrupt_stats_dir(w, d):
    meta = _note(d / "S" / "meta.json", "{not json")
    return Case(["stats", "build", "--data", w["corpus"], "--out", d / "S"], 2, "holds a stats dir with no record of its files", [meta])


def stats_merge_over_a_finished_stats_dir(w, d):
    s = Path(shutil.copytree(w["built"], d / "S"))
    notes = _note(s / "notes.txt")
    return Case(["stats", "merge", w["sharded"], "--out", s], 2, "already holds a stats dir",
                [notes, s / "meta.json", s / "keys2.npy", s / "counts2.npy"])


def stats_merge_over_a_stats_dir_of_an_older_multitoken(w, d):
    s = Path(shutil.copytree(w["stats"], d / "S"))  # the embedded stats: no record of its files
    return Case(["stats", "merge", w["sharded"], "--out", s, "--overwrite"], 2, "move it away or delete it",
                [s / "meta.json", s / "keys3.npy", s / "counts2.npy"])


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
    return Case(["sweep", "--out", out, "--overwrite"], 2, "holds a sweep with no record of its files", [sweep])


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


# Names are not ownership: only a record of the files makes a destination ours -----------------
def attach_over_a_users_train_config(w, d):
    mine = _note(d / "x" / "train_config.json", '{"my": "settings"}\n')
    return Case(["attach", "--out", d / "x", "--n", "2", "--overwrite"], 2, "does not hold a heads dir", [mine])


def attach_over_a_users_lora_folder(w, d):
    mine = _note(d / "x" / "lora" / "adapter_config.json", '{"mine": true}\n')
    return Case(["attach", "--out", d / "x", "--n", "2"], 2, "does not hold a heads dir", [mine])


def stats_build_over_arrays_named_like_ours(w, d):
    keys, counts = _note(d / "S" / "keys9.npy", "user data\n"), _note(d / "S" / "counts4.npy", "user data\n")
    return Case(["stats", "build", "--data", w["corpus"], "--out", d / "S", "--overwrite"], 2, "does not hold a stats dir",
                [keys, counts])


def stats_build_work_dir_holding_a_users_merge_parts(w, d):
    parts = _note(d / "W" / "merge-parts" / "o2-part-00000.npy", "user data\n")
    return Case(["stats", "build", "--data", w["corpus"], "--out", d / "S", "--work-dir", d / "W", "--order", "2"], 2,
                "--work-dir", [parts])


def stats_overwrite_through_a_symlinked_partials(w, d):
    s = Path(shutil.copytree(w["built"], d / "S"))
    shard = d / "elsewhere" / "shard-00000-of-00001"
    job, counts = _note(shard / "job.json", '{"another": "job"}\n'), _note(shard / "run-000000" / "k2.npy", "counts\n")
    (s / "partials").symlink_to(d / "elsewhere")
    return Case(["stats", "build", "--data", w["corpus"], "--out", s, "--order", "2", "--overwrite"], 2,
                "partials, which multitoken has no record of writing", [job, counts, s / "meta.json", s / "keys2.npy"])


def eval_over_a_users_logit_lens(w, d):
    png = _note(d / "E" / "logit_lens.png", "my plot\n")
    return Case(["eval", "--heads", w["heads"], "--data", w["corpus"], "--out", d / "E", "--overwrite"], 2,
                "does not hold an eval report", [png])


def sweep_over_a_users_csv(w, d):
    csv = _note(d / "SW" / "sweep.csv", "a,b\n1,2\n")
    return Case(["sweep", "--out", d / "SW", "--overwrite"], 2, "does not hold a sweep", [csv])


def distill_overwrite_a_corpus_it_did_not_write(w, d):
    corpus = _note(d / "c.jsonl", '{"input_ids": [1, 2, 3]}\n')
    return Case(["distill", "--num-tokens", "10", "--out", corpus, "--overwrite"], 2,
                "not a corpus written by multitoken distill", [corpus])


def generate_overwrite_generations_it_did_not_write(w, d):
    prompts, gen = _note(d / "p.txt", "Once\n"), _note(d / "g.jsonl", '{"prompt": "a", "token_ids": [1], "text": "b"}\n')
    return Case(["generate", "--prompts", prompts, "--out", gen, "--overwrite", "--max-new-tokens", "2"], 2,
                "not generations written by multitoken generate", [gen])


def train_into_a_heads_dir_of_an_older_multitoken(w, d):
    h = Path(shutil.copytree(w["heads"], d / "h"))  # the embedded heads: no record of their files
    return Case(_train(w, h, "--overwrite"), 2, "holds a heads dir with no record of its files",
                [h / "heads.safetensors", h / "heads_config.json"])


# Damaged stats dirs ---------------------------------------------------------------------------


OUTPUT_CASES = [
    train_into_folder_with_other_files,
    train_into_current_dir,
    train_into_folder_holding_the_inputs,
    train_into_its_own_input,
    train_into_home,
    train_checkpoints_into_a_foreign_folder,
    stats_build_over_other_content,
    stats_build_work_dir_with_other_files,
    stats_build_over_a_corrupt_stats_dir,
    stats_merge_over_a_finished_stats_dir,
    distill_over_an_existing_file,
    distill_overwrite_a_file_we_did_not_write,
    attach_into_folder_with_other_files,
    convert_into_folder_with_other_files,
    eval_out_is_a_file,
    sweep_out_under_a_file,
    eval_out_not_writable,
    sweep_out_holds_a_sweep,
    stats_build_out_is_a_file,
    stats_merge_out_not_writable,
    distill_out_not_writable,
    attach_out_is_a_file,
    stats_merge_over_a_stats_dir_of_an_older_multitoken,
    attach_over_a_users_train_config,
    attach_over_a_users_lora_folder,
    stats_build_over_arrays_named_like_ours,
    stats_build_work_dir_holding_a_users_merge_parts,
    stats_overwrite_through_a_symlinked_partials,
    eval_over_a_users_logit_lens,
    sweep_over_a_users_csv,
    distill_overwrite_a_corpus_it_did_not_write,
    generate_overwrite_generations_it_did_not_write,
    train_into_a_heads_dir_of_an_older_multitoken,
]
