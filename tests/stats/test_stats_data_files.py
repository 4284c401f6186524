"""``stats build`` on a local folder with splits: the split's files only, each content once,
and the files listed on stderr, in config.json and in meta.json."""

from __future__ import annotations

import json
import subprocess
import sys

from .stats_helpers import PYTHIA_TOKENIZER

from ..conftest import fixture_path
from multitoken.base.tokenizer import load_tokenizer
from multitoken.pipeline.cli import main


def _tokens(*names: str) -> int:
    tok = load_tokenizer(PYTHIA_TOKENIZER)
    texts = [json.loads(line)["text"] for n in names for line in open(fixture_path("pile_dummy", n))]
    return sum(len(tok(t, add_special_tokens=False).input_ids) for t in texts)


def test_build_reads_the_train_split_once_and_lists_it(tmp_path):
    out = tmp_path / "stats"
    r = subprocess.run([sys.executable, "-m", "multitoken.pipeline.cli", "stats", "build", "--data", str(fixture_path("pile_dummy")),
                        "--tokenizer", PYTHIA_TOKENIZER, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    zst, plain = str(fixture_path("pile_dummy", "train_00.jsonl.zst")), str(fixture_path("pile_dummy", "train_00.jsonl"))
    assert "data: split 'train': reading 1 file" in r.stderr and f"  {zst}" in r.stderr
    assert f"data: skipped {plain} (same content as {zst})" in r.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["data_files"] == [zst] and json.loads((out / "config.json").read_text())["data_files"] == [zst]
    assert meta["total_tokens"] == _tokens("train_00.jsonl")  # once, not twice, and no val/test


def test_build_of_another_split_and_a_refused_one(tmp_path, capsys):
    out = tmp_path / "test-stats"
    common = ["--tokenizer", PYTHIA_TOKENIZER, "--order", "2"]
    assert main(["stats", "build", "--data", str(fixture_path("pile_dummy")), "--split", "test", *common, "--out", str(out)]) == 0
    assert json.loads((out / "meta.json").read_text())["total_tokens"] == _tokens("test.jsonl")
    capsys.readouterr()
    one_file = str(fixture_path("pile_dummy", "val.jsonl"))
    assert main(["stats", "build", "--data", one_file, "--split", "test", *common, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--split test" in err and "no splits" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()
