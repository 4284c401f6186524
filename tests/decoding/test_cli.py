"""``multitoken generate``: modes from the command line, JSON output, clear errors."""

from __future__ import annotations

import json

import pytest

from multitoken.pipeline.cli import main

from .conftest import attach


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory, stories_dir):
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone

    out = tmp_path_factory.mktemp("heads") / "medusa"
    attach(load_backbone(BackboneConfig(base=str(stories_dir))), "medusa", n_future=3).save_heads(out)
    return out


def run_json(capsys, *argv) -> dict:
    assert main(["generate", "Once upon a time", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("mode", ["ar", "speculative", "dynamic", "typical"])
def test_every_mode_runs_from_the_cli(capsys, heads_dir, mode):
    out = run_json(capsys, "--heads", str(heads_dir), "--mode", mode, "--max-new-tokens", "10", "--eps-b", "0.0")
    assert len(out["token_ids"]) == 10 and out["text"]
    trace = out["trace"]
    assert trace["forward_passes"] >= 1 and trace["tokens_per_forward"] == pytest.approx(10 / trace["forward_passes"], abs=1e-3)
    assert out["config"]["DecodeConfig"]["mode"] == mode
    if mode == "dynamic":
        assert trace["orders"] == {"3": 4}  # eps_b = 0: three tokens every step (the last one truncated)


def test_greedy_speculative_cli_equals_ar(capsys, heads_dir):
    spec = run_json(capsys, "--heads", str(heads_dir), "--greedy", "--max-new-tokens", "16")
    ar = run_json(capsys, "--heads", str(heads_dir), "--greedy", "--mode", "ar", "--max-new-tokens", "16")
    assert spec["token_ids"] == ar["token_ids"]


def test_streams_text_and_prints_the_trace(capsys, heads_dir):
    assert main(["generate", "Once upon a time", "--heads", str(heads_dir), "--greedy", "--max-new-tokens", "8"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("Once upon a time,") and "tokens/forward" in cap.err


@pytest.mark.parametrize("argv, message", [
    (["--n", "4"], "--n 4 needs 4 heads"),
    (["--mode", "dynamic", "--top-k", "600"], "--top-k must be in [1, 512]"),
    (["--eps-b", "-0.1"], "--eps-b must be in [0, 1]"),
    (["--temperature", "-1"], "temperature must be > 0"),
])
def test_bad_settings_fail_clearly(capsys, heads_dir, argv, message):
    assert main(["generate", "Once upon a time", "--heads", str(heads_dir), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_prompt_longer_than_the_context(capsys):
    assert main(["generate", "Once upon a time " * 200, "--max-new-tokens", "1"]) == 2
    assert "the model's context is 512" in capsys.readouterr().err


def test_stats_of_another_tokenizer_are_refused(capsys, tmp_path, heads_dir):
    from multitoken.stats.format import FORMAT_VERSION, META_NAME

    meta = {"format_version": FORMAT_VERSION, "tokenizer": {"name": "pythia", "fingerprint": "0" * 64}, "vocab_size": 50304,
            "orders": [1, 2, 3], "total_tokens": 1, "ngram_totals": {"1": 1, "2": 1, "3": 1}, "distinct": {"1": 1, "2": 1, "3": 1},
            "count_dtypes": {"1": "uint64", "2": "uint32", "3": "uint32"}, "min_counts": {"1": 1, "2": 1, "3": 1}}
    (tmp_path / META_NAME).write_text(json.dumps(meta))
    assert main(["generate", "Once upon a time", "--heads", str(heads_dir), "--mode", "dynamic", "--stats", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "tokenizer" in err and "fix:" in err


def test_ar_applies_the_repetition_penalty_from_the_cli(capsys, heads_dir):
    """The issue's case: ``generate --mode ar --repetition-penalty 100`` gave the 1.0 text."""
    runs = {pen: run_json(capsys, "--heads", str(heads_dir), "--mode", "ar", "--max-new-tokens", "40",
                          "--repetition-penalty", pen, "--no-stop-at-eos") for pen in ("1", "100")}
    assert runs["1"]["text"] != runs["100"]["text"]
    assert runs["1"]["trace"]["repetition_penalty"] == 1.0 and runs["100"]["trace"]["repetition_penalty"] == 100.0
    assert run_json(capsys, "--heads", str(heads_dir), "--max-new-tokens", "2")["trace"]["repetition_penalty"] == 1.1
    assert run_json(capsys, "--heads", str(heads_dir), "--max-new-tokens", "2", "--greedy")["trace"]["repetition_penalty"] == 1.0


def test_prompts_file_in_batches_equals_one_at_a_time(tmp_path, heads_dir):
    """``--prompts --batch-size 2`` (ragged prompts, sampled, rows finishing apart) writes what
    ``--batch-size 1`` writes, token for token; the file is replaced only with --overwrite."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe little dog ran to the big red\nShe\n")
    out = tmp_path / "gen.jsonl"
    common = ["generate", "--prompts", str(prompts), "--out", str(out), "--heads", str(heads_dir),
              "--max-new-tokens", "12", "--seed", "3", "--mode", "speculative"]
    assert main([*common, "--batch-size", "2"]) == 0
    batched = [json.loads(line) for line in out.read_text().splitlines()]
    assert main([*common, "--batch-size", "1"]) == 2  # exists: refused
    assert main([*common, "--batch-size", "1", "--overwrite"]) == 0
    single = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in batched] == ["Once upon a time", "The little dog ran to the big red", "She"]
    assert [r["token_ids"] for r in batched] == [r["token_ids"] for r in single]
    assert batched[0]["trace"]["batch_size"] == 2 and single[0]["trace"]["batch_size"] == 1
    assert json.loads((tmp_path / "gen.jsonl.config.json").read_text())["command"] == "generate"


def test_prompts_file_flags_are_checked(tmp_path, heads_dir):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Once\n")
    foreign = tmp_path / "notes.jsonl"
    foreign.write_text('{"mine": 1}\n')
    base = ["generate", "--prompts", str(prompts), "--heads", str(heads_dir)]
    assert main([*base]) == 2  # no --out
    assert main([*base, "--out", str(tmp_path / "o.jsonl"), "--batch-size", "0"]) == 2
    assert main([*base, "--out", str(foreign), "--overwrite"]) == 2  # never replaces a file it did not write
    assert foreign.read_text() == '{"mine": 1}\n'


@pytest.mark.parametrize("mode", ["ar", "dynamic", "speculative"])
def test_a_missing_stats_dir_is_refused_in_every_mode(capsys, tmp_path, mode):
    assert main(["generate", "Once upon a time", "--mode", mode, "--stats", str(tmp_path / "nope"), "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "is not a stats dir" in err and "fix:" in err and "Traceback" not in err


def test_tree_nodes_without_a_tree_is_refused(capsys):
    assert main(["generate", "Once upon a time", "--tree-nodes", "8", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "--tree static|dynamic" in err and "Traceback" not in err


def test_packaged_heads_and_stats_are_named_by_embedded_name(capsys):
    """``--heads`` / ``--stats embedded:NAME``: the folders the package ships, wherever it is
    installed; the same run as their paths."""
    from multitoken.embedded import EMBEDDED_HEADS, EMBEDDED_STATS

    by_name = run_json(capsys, "--heads", "embedded:stories260K-heads", "--stats", "embedded:stories260K-stats",
                       "--mode", "dynamic", "--eps-b", "0", "--seed", "3", "--max-new-tokens", "9")
    by_path = run_json(capsys, "--heads", str(EMBEDDED_HEADS), "--stats", str(EMBEDDED_STATS),
                       "--mode", "dynamic", "--eps-b", "0", "--seed", "3", "--max-new-tokens", "9")
    assert by_name["token_ids"] == by_path["token_ids"] and by_name["trace"]["orders"] == {"3": 3}
    recorded = by_name["config"]["GenerateConfig"]  # the resolved folders, as with paths
    assert (recorded["heads"], recorded["stats"]) == (str(EMBEDDED_HEADS), str(EMBEDDED_STATS))


@pytest.mark.parametrize("flag", ["--heads", "--stats"])
def test_an_unknown_embedded_name_is_refused_with_the_names_there_are(capsys, flag):
    assert main(["generate", "Once upon a time", flag, "embedded:nope", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} embedded:nope: the package ships no folder" in err and "embedded:stories260K-heads" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2  # the problem and its fix
