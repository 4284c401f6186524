"""Bad-input cases, part 2 (part 1: ``bad_output_cases.py``), and ``CASES``, the table
``test_bad_inputs.py`` runs: each ``CASES[name](world, d)`` damages an input or
points an option somewhere it must not write, and returns the command line with what it must
print, its exit code and the user's files that must stay byte-identical (``Case``)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np

from multitoken.pipeline.cli import main

from .bad_output_cases import OUTPUT_CASES, Case, _del, _edit_json, _note, _set, _train
from .bad_trust_cases import TRUST_CASES, TRUST_TABLE
from .bad_weight_cases import WEIGHT_CASES, _Planted, _position, _state


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
        # the world's own run (--max-steps 1): --resume continues only the run that made the checkpoint
        return Case(_train(w, out, "--resume", "--max-steps", "1"), 1, message, [out / "heads_config.json", out / "train_metrics.json"])
    return case


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


# Corpora: stats build and train read them the same way (pipeline/data.py) ---------------------
def _corpus(d: Path, name: str, raw: bytes) -> Path:
    path = d / name
    path.write_bytes(raw)
    return path


def _stats_build(w, d, name: str, raw: bytes, message: str) -> Case:
    data = _corpus(d, name, raw)
    return Case(["stats", "build", "--data", data, "--out", d / "S"], 1, message, [data, _note(d / "notes.txt")])


def _train_on(w, d, name: str, raw: bytes, message: str) -> Case:
    data = _corpus(d, name, raw)
    args = ["train", "--heads", w["heads"], "--data", data, "--out", d / "out", "--max-steps", "1", "--seq-len", "16",
            "--batch-size", "1", "--eval-batches", "1", "--no-progress"]
    return Case(args, 1, message, [data, _note(d / "notes.txt")])


def _zst(raw: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(raw)


STORY = b"".join(json.dumps({"text": f"Once upon a time there was a cat number {i}."}).encode() + b"\n" for i in range(200))


def stats_build_txt_not_utf8(w, d):
    return _stats_build(w, d, "latin1.txt", "caf\u00e9 au lait\n".encode("latin-1"), "latin1.txt: not UTF-8 text (byte 0xe9")


def stats_build_jsonl_not_utf8(w, d):
    return _stats_build(w, d, "c.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "c.jsonl:2: not UTF-8 text")


def train_txt_not_utf8(w, d):
    return _train_on(w, d, "latin1.txt", b"na\xefve story\n", "latin1.txt: not UTF-8 text (byte 0xef")


def train_jsonl_not_utf8(w, d):
    return _train_on(w, d, "c.jsonl", b'{"text": "\xff\xfe"}\n', "c.jsonl:1: not UTF-8 text (byte 0xff")


def stats_build_jsonl_line_is_a_number(w, d):
    return _stats_build(w, d, "c.jsonl", b'{"text": "ok"}\n5\n', "c.jsonl:2: holds a JSON number, not an object")


def stats_build_text_is_a_number(w, d):
    return _stats_build(w, d, "c.jsonl", b'{"text": 12345}\n', "column 'text' holds a JSON number, not text")


def stats_build_text_is_a_list_of_strings(w, d):  # was counted as token ids
    return _stats_build(w, d, "c.jsonl", b'{"text": ["a", "b"]}\n', "column 'text' holds a list of strings, not one text")


def train_text_is_a_list_of_strings(w, d):
    return _train_on(w, d, "c.jsonl", b'{"text": ["Once", "upon"]}\n', "column 'text' holds a list of strings")


def stats_build_ragged_input_ids(w, d):
    return _stats_build(w, d, "c.jsonl", b'{"input_ids": [[1, 2], [3]]}\n', "flat list of integers (e.g. [464, 3290, 13]), got a nested or mixed list")


def train_ragged_input_ids(w, d):
    return _train_on(w, d, "c.jsonl", b'{"input_ids": [5, [6, 7], 8]}\n', "token-id column must hold a flat list of integers")


def stats_build_truncated_zst(w, d):  # was "holds no rows"
    whole = _zst(STORY)
    return _stats_build(w, d, "c.jsonl.zst", whole[: len(whole) // 2], "truncated or corrupt zstd file")


def train_truncated_zst(w, d):
    whole = _zst(STORY)
    return _train_on(w, d, "c.jsonl.zst", whole[:-8], "truncated or corrupt zstd file")


def stats_build_mistyped_data_path(w, d):  # was 24 s of Hub retries, then "not a local path"
    return Case(["stats", "build", "--data", "copus.jsonl", "--out", d / "S"], 1, "data path 'copus.jsonl' not found",
                [_note(d / "notes.txt")], cwd=d)


def stats_build_name_neither_file_nor_reachable_dataset(w, d):  # a suffix typo: read as a Hub id; no retries, no dir left
    return Case(["stats", "build", "--data", "corpus.jsnl", "--out", d / "S"], 1, "'corpus.jsnl' is not a local path",
                [_note(d / "notes.txt")], cwd=d)


def train_mistyped_data_path(w, d):
    args = _train(w, d / "out")
    args[args.index("--data") + 1] = str(d / "nowhere" / "corpus.jsonl")
    return Case(args, 1, "not found: no such file or directory", [_note(d / "notes.txt")])


# Sweep prompts files -----------------------------------------------------------------------------
def _sweep_prompts(w, d, name: str, raw: bytes | None, message: str) -> Case:
    prompts = _corpus(d, name, raw) if raw is not None else Path(name)
    notes = _note(d / "notes.txt")
    return Case(["sweep", "--prompts", prompts, "--out", d / "sw", "--seeds", "1", "--max-new-tokens", "2"], 1, message,
                [notes] + ([prompts] if raw is not None else []))


def sweep_prompts_line_not_json(w, d):
    return _sweep_prompts(w, d, "p.jsonl", b'{"prompt": "Once"}\n{prompt: Once}\n', "p.jsonl:2: not valid JSON")


def sweep_prompts_line_is_a_list(w, d):
    return _sweep_prompts(w, d, "p.jsonl", b"[1]\n", "p.jsonl:1: holds a JSON list, not an object")


def sweep_prompts_not_utf8(w, d):
    return _sweep_prompts(w, d, "p.txt", b"Once upon a \xe9t\xe9\n", "is not UTF-8 text")


def sweep_prompts_dev_null(w, d):  # was "not found"
    return _sweep_prompts(w, d, "/dev/null", None, "'/dev/null' is not a regular file")


def sweep_prompts_empty(w, d):
    return _sweep_prompts(w, d, "p.txt", b"\n  \n", "holds no prompt (it is empty)")


# Option ranges: refused before any model loads ----------------------------------------------
def _gen(*extra) -> list:
    return ["generate", "Once upon a time", "--max-new-tokens", "2", *extra]


def _option_case(args, message, code=2):
    """``args`` with placeholders: ``@heads`` / ``@corpus`` the world's inputs, ``@out...`` a
    path in the case's own dir."""
    def case(w, d):
        def resolve(a):
            if not str(a).startswith("@"):
                return a
            return d / a[1:] if a.startswith("@out") else w[a[1:]]
        return Case([resolve(a) for a in args], code, message, [_note(d / "notes.txt")], cwd=d)
    return case


def generate_dynamic_top_k_past_opencv_channels(w, d):  # opencv 5 blurs <= 128 channels: was cv2.error
    return Case(_gen("--mode", "dynamic", "--top-k", "130", "--verbose"), 0, "tokens per step")


def generate_five_heads_past_the_stats_order(w, d):  # was "rebuild with --order 5" (3 is the maximum)
    assert main(["attach", "--n", "5", "--out", str(d / "h5")]) == 0
    return Case(_gen("--heads", d / "h5", "--mode", "dynamic"), 0, "stats count at most order 3: pass --n 3")


def generate_five_heads_grid_too_large(w, d):  # 50^5 cells: was 30 s and 4.1 GB for 10 tokens
    assert main(["attach", "--n", "5", "--out", str(d / "h5")]) == 0
    return Case(_gen("--heads", d / "h5", "--mode", "dynamic", "--stats", "none"), 2,
                "--top-k 50 and n = 5 tokens per step builds a 50^5 grid")


CASES = {f.__name__: f for f in [
    *OUTPUT_CASES,
    meta_not_utf8, stats_keys_file_empty, stats_counts_are_nan_floats, stats_keys_unsorted,
    *WEIGHT_CASES, *TRUST_CASES, merge_corrupt_job_json, convert_empty_tokenizer,
    stats_build_txt_not_utf8, stats_build_jsonl_not_utf8, train_txt_not_utf8, train_jsonl_not_utf8,
    stats_build_jsonl_line_is_a_number, stats_build_text_is_a_number, stats_build_text_is_a_list_of_strings,
    train_text_is_a_list_of_strings, stats_build_ragged_input_ids, train_ragged_input_ids, stats_build_truncated_zst,
    train_truncated_zst, stats_build_mistyped_data_path, stats_build_name_neither_file_nor_reachable_dataset,
    train_mistyped_data_path,
    sweep_prompts_line_not_json, sweep_prompts_line_is_a_list, sweep_prompts_not_utf8, sweep_prompts_dev_null,
    sweep_prompts_empty,
    generate_dynamic_top_k_past_opencv_channels, generate_five_heads_past_the_stats_order, generate_five_heads_grid_too_large,
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
    "resume_position_text": _resume_case(_position(doc="12"), "position.doc must be an integer >= 0, got '12'"),
    "resume_position_float": _resume_case(_position(offset=3.5), "position.offset must be an integer >= 0"),
    # step 0: a run still to finish reads its data from the position (a finished one reads nothing)
    "resume_position_beyond_the_corpus": _resume_case(_position(doc=10**9, offset=10**12, step=0), "lies beyond the data read"),
    "resume_offset_beyond_its_document": _resume_case(_position(offset=10**12, step=0), "lies beyond the data read"),
    "resume_step_beyond_max_steps": _resume_case(_state(_set("step", 10**18)), "is past --max-steps 1"),
    # option ranges (nan / inf are refused by every float option's parser)
    "generate_seed_negative": _option_case(_gen("--seed", "-1"), "--seed must be in [0, 2**63 - 1], got -1"),
    "generate_seed_huge": _option_case(_gen("--seed", str(2**64)), "--seed must be in [0, 2**63 - 1]"),
    "train_seed_negative": _option_case(["train", "--heads", "@heads", "--data", "@corpus", "--out", "@out", "--seed", "-5"],
                                        "--seed must be in [0, 2**63 - 1], got -5"),
    "distill_seed_huge": _option_case(["distill", "--num-tokens", "10", "--out", "@out.jsonl", "--seed", str(2**63)],
                                      "--seed must be in [0, 2**63 - 1]"),
    "train_lr_inf": _option_case(["train", "--heads", "@heads", "--data", "@corpus", "--out", "@out", "--lr", "inf"],
                                 "argument --lr: 'inf' is not a finite number"),
    "train_lr_nan": _option_case(["train", "--heads", "@heads", "--data", "@corpus", "--out", "@out", "--lr", "nan"],
                                 "argument --lr: 'nan' is not a finite number"),
    "generate_repetition_penalty_nan": _option_case(_gen("--repetition-penalty", "nan"),
                                                    "argument --repetition-penalty: 'nan' is not a finite number"),
    "generate_temperature_inf": _option_case(_gen("--temperature", "inf"), "argument --temperature: 'inf' is not a finite number"),
    "generate_blur_kernel_negative": _option_case(_gen("--mode", "dynamic", "--blur-kernel", "-3"),
                                                  "--blur-kernel must be 0 or 1 (no blur) or an odd number >= 3, got -3"),
    "generate_threads_negative": _option_case(_gen("--threads", "-5"), "--threads must be >= 0, got -5"),
    "eval_threads_negative": _option_case(["eval", "--data", "@corpus", "--out", "@out", "--threads", "-5"],
                                          "--threads must be >= 0, got -5"),
    "eval_dynamic_tokens_zero": _option_case(["eval", "--data", "@corpus", "--out", "@out", "--dynamic-tokens", "0"],
                                             "--dynamic-tokens must be >= 1, got 0"),
    "eval_top_p_nan": _option_case(["eval", "--data", "@corpus", "--out", "@out", "--top-p", "nan"],
                                   "argument --top-p: 'nan' is not a finite number"),
    "sweep_eps_b_tiny_step": _option_case(["sweep", "--out", "@out", "--eps-b", "0:1:1e-12"],
                                          "gives 1,000,000,000,001 values, more than 1,001"),
    "sweep_eps_b_inf_range": _option_case(["sweep", "--out", "@out", "--eps-b", "0:inf:0.1"], "three finite numbers"),
    "sweep_temperature_nan": _option_case(["sweep", "--out", "@out", "--temperature", "nan"], "'nan' is not a finite number"),
    "sweep_seed_count_zero": _option_case(["sweep", "--out", "@out", "--seeds", "0"], "--seeds must be in [1, 1000], got 0"),
    "sweep_max_new_tokens_zero": _option_case(["sweep", "--out", "@out", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    "attach_n_100": _option_case(["attach", "--n", "100", "--out", "@out"], "heads predict at most 16 tokens per forward pass"),
    "attach_float_option_nan": _option_case(["attach", "--head", "cp", "--init-std", "nan", "--out", "@out"],
                                            "argument --init-std: 'nan' is not a finite number"),
    "generate_dynamic_top_k_512": _option_case(_gen("--mode", "dynamic", "--top-k", "512"),
                                               "--top-k 512 and n = 3 tokens per step builds a 512^3 grid"),
    "train_lr_huge": _option_case(["train", "--heads", "@heads", "--data", "@corpus", "--out", "@out", "--lr", "1e30"],
                                  "--lr must be in [1e-10, 10]"),
    "train_lr_times_decay": _option_case(["train", "--heads", "@heads", "--data", "@corpus", "--out", "@out", "--lr", "5",
                                          "--weight-decay", "0.5"], "x --weight-decay 0.5 must be < 1"),
    "train_dynamo_rate_tiny": _option_case(["train", "--heads", "@heads", "--data", "@corpus", "--out", "@out", "--lr-b", "1e-300",
                                            "--lr-m", "1e-3", "--lr-mb", "1e-3"], "--lr-b must be in [1e-10, 10]"),
    "generate_alpha_c_huge": _option_case(_gen("--mode", "dynamic", "--alpha-c", "1e300"), "--alpha-c must be in [0, 64]"),
    "generate_alpha_c_past_the_stats": _option_case(_gen("--mode", "dynamic", "--alpha-c", "20"), "--alpha-c 20 overflows float32 with these stats"),
    "generate_threads_past_the_cores": _option_case(_gen("--threads", "10000"), "warning: --threads 10000 is more than the", code=0),
    "export_eagle3": _option_case(["export", "--format", "eagle3", "--heads", "@heads", "--out", "@out"],
                                  "--format eagle3 exports eagle3 heads; "),
    "export_replicated_heads": _option_case(["export", "--heads", "@heads", "--out", "@out"], "holds replicated heads"),
    "distill_temperature_inf": _option_case(["distill", "--num-tokens", "10", "--out", "@out.jsonl", "--temperature", "inf"],
                                            "'inf' is not a finite number"),
})
CASES.update(TRUST_TABLE)
