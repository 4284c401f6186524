"""``multitoken attach``: creates a loadable untrained heads dir; bad input ends in a clear
message (no traceback) and never touches an existing heads dir."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from multitoken.pipeline.cli import main
from multitoken.pipeline.model.model import MultiTokenModel


def _snapshot(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_attach_creates_a_loadable_heads_dir(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "heads"
    code = main(["attach", "--base", str(tiny_model_dir), "--head", "cp", "--n", "2", "--rank", "2", "--out", str(out)])
    assert code == 0
    assert "attached cp heads (n=2" in capsys.readouterr().out
    resolved = json.loads((out / "attach_config.json").read_text())
    assert resolved["command"] == "attach" and resolved["CPConfig"]["rank"] == 2
    model = MultiTokenModel.from_pretrained(None, out)  # the base recorded in the heads dir
    assert model.backbone.name == str(tiny_model_dir)
    assert model.config.head_type == "cp" and model.config.rank == 2 and model.n_future == 2


def test_head_options_and_defaults(tiny_model_dir, tmp_path):
    out = tmp_path / "whs"
    assert main(["attach", "--base", str(tiny_model_dir), "--head", "whs", "--init", "random",
                 "--all-heads", "--out", str(out)]) == 0
    config = json.loads((out / "heads_config.json").read_text())["head_config"]
    assert config == {"head_type": "whs", "n_future": 3, "init": "random", "temperature": 0.1,
                      "init_weight": 0.1, "all_heads": True}


def test_bad_input_is_a_clear_error_and_keeps_the_dir(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "heads"
    assert main(["attach", "--base", str(tiny_model_dir), "--head", "medusa", "--out", str(out)]) == 0
    before = _snapshot(out)
    capsys.readouterr()
    # An option of another head type.
    assert main(["attach", "--base", str(tiny_model_dir), "--head", "medusa", "--rank", "2",
                 "--out", str(out), "--overwrite"]) == 2
    assert "rank" in capsys.readouterr().err
    # Existing heads without --overwrite.
    assert main(["attach", "--base", str(tiny_model_dir), "--head", "replicated", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    # A base that does not exist.
    assert main(["attach", "--base", str(tmp_path / "nope"), "--out", str(out), "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err
    # Bad values.
    assert main(["attach", "--base", str(tiny_model_dir), "--head", "cp", "--rank", "0", "--out", str(out), "--overwrite"]) == 2
    assert main(["attach", "--base", str(tiny_model_dir), "--n", "0", "--out", str(out), "--overwrite"]) == 2
    assert _snapshot(out) == before
    # A file where the directory should be.
    (tmp_path / "file").write_text("x")
    assert main(["attach", "--base", str(tiny_model_dir), "--out", str(tmp_path / "file")]) == 2
    with pytest.raises(SystemExit) as exit_:
        main(["attach", "--head", "bogus", "--out", str(out)])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_overwrite_replaces_heads(tiny_model_dir, tmp_path):
    out = tmp_path / "heads"
    assert main(["attach", "--base", str(tiny_model_dir), "--head", "medusa", "--out", str(out)]) == 0
    assert main(["attach", "--base", str(tiny_model_dir), "--head", "replicated", "--n", "2",
                 "--out", str(out), "--overwrite"]) == 0
    assert MultiTokenModel.from_pretrained(str(tiny_model_dir), out).config.head_type == "replicated"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_console_entry_point_reports_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "multitoken.pipeline.cli", "attach", "--base",
                           str(tmp_path / "missing"), "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "multitoken attach: error:" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()
