"""``multitoken distill``: batched self-sampling into jsonl, atomically."""

from __future__ import annotations

import json

import pytest

from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.cli import main
from multitoken.base.data import DataConfig, iter_documents
from multitoken.pipeline.train.distill import DistillConfig, distill
from multitoken.base.errors import UsageError


@pytest.fixture(scope="module")
def stories(stories_dir):
    return load_backbone(BackboneConfig(base=str(stories_dir)))


def test_distill_writes_exactly_the_requested_tokens(stories, tmp_path):
    out = tmp_path / "d.jsonl"
    summary = distill(stories, DistillConfig(num_tokens=300, out=str(out), batch_size=4, max_new_tokens=64, progress=False))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["tokens"] == 300 == sum(len(r["input_ids"]) for r in rows)
    assert all(set(r) == {"input_ids", "text"} for r in rows)
    assert all(max(r["input_ids"]) < stories.vocab_size for r in rows)
    assert stories.tokenizer.decode(rows[0]["input_ids"], skip_special_tokens=True) == rows[0]["text"]
    # The corpus reads back through the ordinary data reader (ids column preferred).
    docs = list(iter_documents(DataConfig(data=str(out)), stories.tokenizer))
    assert [d.tolist() for _, d in docs] == [r["input_ids"] for r in rows]


def test_distill_is_seeded(stories, tmp_path):
    cfg = dict(num_tokens=100, batch_size=2, max_new_tokens=50, progress=False, format="ids")
    a, b, c = (tmp_path / f"{k}.jsonl" for k in "abc")
    distill(stories, DistillConfig(out=str(a), seed=1, **cfg))
    distill(stories, DistillConfig(out=str(b), seed=1, **cfg))
    distill(stories, DistillConfig(out=str(c), seed=2, **cfg))
    assert a.read_text() == b.read_text() != c.read_text()


def test_failure_leaves_existing_file_untouched(stories, tmp_path, monkeypatch):
    out = tmp_path / "d.jsonl"
    out.write_text("old\n")
    import multitoken.pipeline.train.distill as mod

    calls = {"n": 0}
    real = mod.sample_batch

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("boom")
        return real(*a, **k)

    monkeypatch.setattr(mod, "sample_batch", flaky)
    with pytest.raises(RuntimeError):
        distill(stories, DistillConfig(num_tokens=1000, out=str(out), batch_size=2, max_new_tokens=20, progress=False))
    assert out.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["d.jsonl"]  # no temp file left behind


def test_cli_distill_and_errors(stories_dir, tmp_path, capsys):
    out = tmp_path / "d.jsonl"
    assert main(["distill", "--num-tokens", "40", "--out", str(out), "--max-new-tokens", "20",
                 "--batch-size", "2", "--no-progress", "--base", str(stories_dir)]) == 0
    assert out.is_file() and (tmp_path / "d.jsonl.config.json").is_file()
    assert main(["distill", "--num-tokens", "0", "--out", str(out)]) == 2
    assert "--num-tokens must be > 0" in capsys.readouterr().err
    assert main(["distill", "--out", str(out)]) == 2
    assert "no --num-tokens given" in capsys.readouterr().err
    assert main(["distill", "--num-tokens", "5", "--out", str(out), "--max-new-tokens", "5000",
                 "--base", str(stories_dir)]) == 2
    assert main(["distill", "--num-tokens", "5", "--out", str(tmp_path / "x.jsonl"), "--base", str(tmp_path / "nope")]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_greedy_after_continues_with_argmax(stories, tmp_path):
    """Past a sampled prefix of at most ``greedy_after`` tokens, every token is the base's argmax."""
    import torch

    out = tmp_path / "g.jsonl"
    distill(stories, DistillConfig(num_tokens=400, out=str(out), batch_size=4, max_new_tokens=40, greedy_after=20,
                                   format="ids", seed=3, progress=False))
    bos = stories.tokenizer.bos_token_id
    rows = [json.loads(line)["input_ids"] for line in out.read_text().splitlines()]
    sampled_lengths = set()
    for ids in rows:
        seq = torch.tensor([[bos] + ids])
        with torch.no_grad():
            argmax = stories.model(seq).logits[0, :-1].argmax(-1).tolist()  # prediction for seq[1:]
        off = [i for i, (a, t) in enumerate(zip(argmax, ids)) if a != t]
        assert not off or off[-1] < 20, f"a non-argmax token at {off[-1]} past the sampled prefix"
        sampled_lengths.add(off[-1] + 1 if off else 0)
    assert len(sampled_lengths) > 1, sampled_lengths  # the prefix length varies between batches
    with pytest.raises(UsageError, match="greedy-after"):
        distill(stories, DistillConfig(num_tokens=10, out=str(out), max_new_tokens=40, greedy_after=40, progress=False))


def test_progress_off_a_terminal_is_whole_lines(tmp_path):
    """stderr piped (a log, CI): the bar is written as whole lines, no carriage-return redraws."""
    import subprocess
    import sys

    # two batches of 2 x 10 tokens (the defaults would sample 32 x 256 for a 40-token file)
    done = subprocess.run([sys.executable, "-m", "multitoken.pipeline.cli", "distill", "--num-tokens", "40",
                           "--batch-size", "2", "--max-new-tokens", "10", "--out", str(tmp_path / "d.jsonl")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "\r" not in done.stderr and "distill: 100%" in done.stderr
    bar = [line for line in done.stderr.splitlines() if "%" in line]
    assert len(bar) >= 2 and all(line.startswith("distill:") for line in bar), bar
