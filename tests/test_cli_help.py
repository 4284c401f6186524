"""Every subcommand's --help reads in plain words; value lists take one syntax; --threads
reaches every command that runs a model; dependencies' noise stays off the console."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from multitoken.pipeline.cli import COMMANDS, build_parser

CONFIG_CLASSES = ("GenerateConfig", "DecodeConfig", "BackboneConfig", "AttachConfig", "ConvertLlama2cConfig", "TrainConfig",
                  "DataConfig", "DistillConfig", "EvalConfig", "SweepConfig", "BuildConfig", "MergeConfig", "InfoConfig")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def all_parsers() -> dict[str, argparse.ArgumentParser]:
    """'generate', 'stats build', ... -> its fully built parser."""
    found = {}
    for name in COMMANDS:
        parser = _subparsers(build_parser(name))[name]
        found[name] = parser
        found.update({f"{name} {sub}": p for sub, p in _subparsers(parser).items()})
    return found


PARSERS = all_parsers()


def test_every_command_and_subcommand_is_walked():
    assert {"generate", "train", "eval", "sweep", "distill", "attach", "convert-llama2c",
            "stats build", "stats merge", "stats info"} <= set(PARSERS)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_reads_in_plain_words(name):
    parser = PARSERS[name]
    text = parser.format_help()
    assert parser.description and len(parser.description) > 20, "no description"
    titles = [g.title for g in parser._action_groups]
    assert not [t for t in titles if t in CONFIG_CLASSES or re.fullmatch(r"[A-Z]\w*Config", t or "")], titles
    flat = " ".join(text.split())  # argparse wraps lines
    assert "(default: )" not in flat and "(default: None)" not in flat and "default None" not in flat
    assert not re.search(r"\(default: \(", flat), "a tuple repr as a default"
    assert not re.search(r"default:? \(\d", flat) and "default: ()" not in flat
    assert not re.search(r"seeds? 00\d", flat, re.I), "a paper named by its seed file"
    assert "/embedded/" not in flat, "an install path as a default"
    assert not re.search(r"required[^()]*\) \(default", flat), "a required input with a default"
    for action in parser._actions:  # required inputs show no default at all
        if action.default in ("", None, ()) and action.help:
            assert "(default: )" not in action.help and "(default: None)" not in action.help


def test_value_lists_take_spaces_and_ranges():
    from multitoken.pipeline.cli.args import dataclass_from_args
    from multitoken.pipeline.eval.evaluate import EvalConfig
    from multitoken.pipeline.eval.sweep import SweepConfig
    from multitoken.stats.job import BuildConfig

    for name, cls in (("eval", EvalConfig), ("sweep", SweepConfig)):
        parser = build_parser(name)
        for argv, want in ((["--eps-b", "0", "0.5", "1"], (0.0, 0.5, 1.0)),
                           (["--eps-b", "0:1:0.25"], (0.0, 0.25, 0.5, 0.75, 1.0)),
                           (["--eps-b", "0.1", "0.5:0.6:0.1"], (0.1, 0.5, 0.6))):
            args = parser.parse_args([name, *argv])
            assert dataclass_from_args(cls, args).eps_b == pytest.approx(want), (name, argv)
    args = build_parser("stats").parse_args(["stats", "build", "--min-count", "1", "2:3:1"])
    assert dataclass_from_args(BuildConfig, args).min_count == (1, 2, 3)
    assert " ".join(PARSERS["sweep"].format_help().split()).count("(default: 0:1:0.1)") == 1
    assert "(default: 0 0.25 0.5 0.75 1)" in " ".join(PARSERS["eval"].format_help().split())


@pytest.mark.parametrize("token", ["0,0.5", "1:0:0.1", "a", "0:1"])
def test_bad_value_lists_are_usage_errors(token, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser("sweep").parse_args(["sweep", "--eps-b", token])
    assert exit_.value.code == 2 and "--eps-b" in capsys.readouterr().err


def test_threads_on_every_command_that_runs_a_model():
    from multitoken.base.threads import THREADS_BATCHES, THREADS_ONE_SEQUENCE

    want = {"generate": THREADS_ONE_SEQUENCE, "sweep": THREADS_ONE_SEQUENCE,
            "train": THREADS_BATCHES, "eval": THREADS_BATCHES, "distill": THREADS_BATCHES, "attach": THREADS_BATCHES,
            "build-heads": THREADS_BATCHES}
    for name, default in want.items():
        parser = build_parser(name)
        help_ = " ".join(PARSERS[name].format_help().split())  # one rule, said in every command's help
        assert "(generate, sweep) default to 1, those that run batches (train, eval, distill, attach, build-heads) to 0" in help_, name
        assert parser.parse_args([name, "x"] if name == "generate" else [name]).threads == default, name
        assert parser.parse_args([name, "--threads", "3"] + (["x"] if name == "generate" else [])).threads == 3


def test_generate_json_is_one_clean_line():
    r = subprocess.run([sys.executable, "-m", "multitoken.pipeline.cli", "generate", "Once upon a time", "--json",
                        "--max-new-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["token_ids"]
    assert "Loading weights" not in r.stderr and "Warning" not in r.stderr and "%|" not in r.stderr, r.stderr


@pytest.mark.parametrize("argv, says", [
    (["generate", "--prompt", "Hi"], "positional argument"),  # no prefix match: --prompts would ask for --out
    (["generate", "--max-new", "3", "Hi"], "did you mean --max-new-tokens?"),
    (["generate", "Hi", "there"], "unexpected argument 'there'"),
    (["stats", "build", "--outt", "x"], "did you mean --out"),
])
def test_unknown_flags_are_one_usage_error_with_a_fix(argv, says, capsys):
    from multitoken.pipeline.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "error: " in err and "fix: " in err and says in err, err


def _documented_commands():
    """(file, command, flag) for every ``multitoken COMMAND --flag`` the docs, README and Makefile show."""
    root = Path(__file__).resolve().parents[1]
    for path in [root / "README.md", root / "Makefile", root / "CONTRIBUTING.md", *sorted((root / "docs").glob("*.md"))]:
        text = path.read_text().replace("\\\n", " ")
        for m in re.finditer(r"(?:^|[`\s/])multitoken ((?:stats )?[a-z]+)([^`\n]*)", text):
            rest = re.split(r"&&|\||;", m.group(2))[0]  # one command, not what a shell line chains after it
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
                yield path.name, m.group(1), flag


def test_documented_commands_use_flags_that_exist():
    """Flags are matched whole (no prefixes), so a doc's abbreviation or a renamed flag would fail a user."""
    documented = list(_documented_commands())
    assert len(documented) > 50
    wrong = [(f, c, flag) for f, c, flag in documented
             if c in PARSERS and flag not in {s for a in PARSERS[c]._actions for s in a.option_strings}]
    assert not wrong, wrong
