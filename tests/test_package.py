"""Install layout: four code folders under one import root, a console script, CLI basics."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.metadata import distribution

import pytest

from multitoken.pipeline.cli import main


def test_one_import_root(tmp_path):
    """From a neutral directory, the packages import as multitoken.* and not at the top level."""
    probe = (
        "import importlib.util as u; "
        "print([u.find_spec('multitoken.' + p) is not None for p in ('adapters', 'pipeline', 'stats', 'decoding')]); "
        "print([u.find_spec(p) is None for p in ('adapters', 'pipeline', 'stats', 'decoding')]); "
        "import importlib; "  # regular packages: each __init__.py runs (no namespace fallback)
        "print([importlib.import_module('multitoken.' + p).__file__.endswith('__init__.py') "
        "for p in ('adapters', 'pipeline', 'stats', 'decoding')])"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:3] == ["[True, True, True, True]"] * 3
    assert distribution("multitoken").read_text("top_level.txt").split() == ["multitoken"]


def test_console_script_lists_subcommands():
    exe = shutil.which("multitoken") or str(__import__("pathlib").Path(sys.executable).parent / "multitoken")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout
    from multitoken.pipeline.cli import COMMANDS

    for cmd in COMMANDS:
        assert cmd in out


def test_help_imports_no_torch():
    """Only the chosen command's module is imported: --help and usage errors stay instant."""
    probe = ("import sys\nfrom multitoken.pipeline.cli import main\n"
             "for argv in (['--help'], ['no-such-command']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


def test_each_command_has_its_own_help():
    from multitoken.pipeline.cli import COMMANDS

    for cmd in COMMANDS:
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0


def test_bad_usage_exits_2_without_traceback(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2
    assert main(["generate", "   "]) == 2
    err = capsys.readouterr().err
    assert "the prompt is empty" in err and "fix:" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temperature", "0"], "temperature must be > 0"),
        (["--mode", "dynamic", "--top-k", "0"], "--top-k must be >= 1, got 0"),  # before the model loads: no vocab yet
        (["--top-k", "513"], "--top-k must be in [1, 512]"),
        (["--eps-b", "1.5"], "--eps-b must be in [0, 1]"),
        (["--max-new-tokens", "600"], "exceeds the model's context of 512"),
    ],
)
def test_generate_rejects_bad_settings(capsys, argv, message):
    assert main(["generate", "Once upon a time", *argv]) == 2
    assert message in capsys.readouterr().err


def test_generate_streams_a_story(capsys):
    assert main(["generate", "Once upon a time", "--greedy", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.startswith("Once upon a time, there was a little girl")


def test_public_names_where_users_look(tmp_path):
    """The names the README uses import from the package roots, from any directory; the base
    floor and the pipeline package import without torch (lazy exports)."""
    probe = (
        "import sys\n"
        "import multitoken.pipeline, multitoken.base.errors, multitoken.base.config_io\n"
        "print('torch' in sys.modules)\n"
        "import multitoken.adapters as a\n"
        "from multitoken.stats import CooccurrenceTable\n"
        "from multitoken.decoding import generate, DecodeConfig\n"
        "from multitoken.pipeline import load_backbone, MultiTokenModel, load_model, BackboneConfig\n"
        "print(a.registered_heads(), sorted(a.registry._REGISTRY))\n"
        "print(CooccurrenceTable.__module__, generate.__module__, MultiTokenModel.__module__, load_model.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "False"
    heads = ["conditioned", "cp", "eagle3", "medusa", "replicated", "whs"]
    assert lines[1] == str(heads) + " " + str(heads)
    assert lines[2].split() == ["multitoken.stats.table", "multitoken.decoding.engine",  # generate: one prompt or a batch
                                "multitoken.pipeline.model.model", "multitoken.pipeline.sources.assets"]
