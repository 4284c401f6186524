"""``multitoken build-heads``: the recipe from a base to heads dirs, at tiny scale on the CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from multitoken.pipeline.cli import main
from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.pipeline.train import recipe_data

from ..conftest import fixture_path as fixture

REPO = Path(__file__).resolve().parents[2]
TYPES = ("replicated", "medusa", "conditioned")


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Training text (the start of the Shakespeare fixture) and held-out text (wikitext-2 test)."""
    root = tmp_path_factory.mktemp("texts")
    (root / "train.txt").write_text(fixture("tinyshakespeare", "input.txt").read_text()[:12000])
    held = [line for line in fixture("wikitext2_tokens", "test.txt").read_text().splitlines() if len(line) > 200][:12]
    (root / "held.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in held) + "\n")
    return root / "train.txt", root / "held.jsonl"


def build(texts, out, *extra) -> int:
    return main(["build-heads", "--data", str(texts[0]), "--heldout", str(texts[1]), "--out", str(out),
                 "--tokens", "1200", "--heldout-prompts", "6", "--prompt-len", "8", "--prompt-stride", "5",
                 "--new-tokens", "12", "--distill-batch", "16", "--shard-rows", "40", "--batch-rows", "8",
                 "--warmup", "2", "--epochs", "1", "--threads", "1", *extra])


@pytest.fixture(scope="module")
def built(texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("build") / "out"
    assert build(texts, out) == 0
    return out


def test_every_head_type_is_a_heads_dir_measured_on_held_out_text(built):
    report = json.loads((built / "report" / "build_report.json").read_text())
    assert report["text"]["train_rows"] == 100 and report["text"]["heldout_rows"] == 6  # 1200 / 12 rows
    for kind in TYPES:
        model = MultiTokenModel.from_pretrained(BackboneConfig(cpu_linear="stock"), str(built / f"heads-{kind}"))
        assert model.config.head_type == kind and model.n_future == 3
        held = report["heldout"][kind]
        # head 1 is the base: on its own greedy continuations (float32) its argmax is the text
        assert held["head1/top1"] == 1.0 and held["positions"] > 0
        ranks = json.loads((built / f"heads-{kind}" / "rank_accuracy.json").read_text())
        assert len(ranks["rank_accuracy"]) == 2 and all(0 <= sum(r) <= 1 + 1e-6 for r in ranks["rank_accuracy"])
        assert (built / f"heads-{kind}" / "draft_vocab.json").is_file() == (kind != "medusa")
    trained = json.loads((built / "heads-conditioned" / "train_metrics.json").read_text())
    assert trained["train"]["steps"] == 100 // 8  # one epoch of 8-row steps


def test_continuations_are_the_bases_greedy_text(built):
    """A greedy shard row is the base's own greedy continuation of its prompt (transformers')."""
    from multitoken.pipeline.model.loading import load_backbone

    bb = load_backbone(BackboneConfig(cpu_linear="stock"))
    held = recipe_data.read_shards(built / "distill" / "heldout")
    row = held["ids"][:1]
    want = bb.model.generate(row[:, :8], attention_mask=torch.ones_like(row[:, :8]), do_sample=False,
                             max_new_tokens=12, min_new_tokens=12, pad_token_id=bb.tokenizer.eos_token_id)
    assert torch.equal(row, want)
    assert not held["valid"][:, :7].any() and held["valid"][:, 7:].all()  # targets: the base's text only


def test_a_resumed_build_redoes_only_what_is_missing_and_gets_the_same_heads(built, texts, tmp_path):
    out = tmp_path / "again"
    shutil.copytree(built, out)
    shard = out / "distill" / "train" / "shard-00001.safetensors"
    before = {k: load_file(str(built / f"heads-{k}" / "heads.safetensors")) for k in TYPES}
    shard.unlink()  # as a kill -9 during that shard leaves it
    for kind in TYPES:
        shutil.rmtree(out / f"heads-{kind}")
    assert build(texts, out) == 0
    redone, first = load_file(str(shard)), load_file(str(built / "distill" / "train" / shard.name))
    assert redone.keys() == first.keys() and all(torch.equal(redone[k], first[k]) for k in first)  # same seeds
    for kind in TYPES:
        after = load_file(str(out / f"heads-{kind}" / "heads.safetensors"))
        assert all(torch.equal(before[kind][k], after[k]) for k in after)


def test_a_resume_with_other_settings_or_a_foreign_folder_is_refused(built, texts, tmp_path, capsys):
    out = tmp_path / "other"
    shutil.copytree(built, out)
    assert build(texts, out, "--seed", "5") != 0
    assert "holds a build with another seed" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert build(texts, foreign) != 0
    assert "not empty" in capsys.readouterr().err and (foreign / "notes.txt").read_text() == "mine"


def test_the_gpu_script_runs_the_recipe_on_the_cpu(texts, tmp_path):
    """scripts/gpu/build_heads.sh, the one call a GPU machine runs, in its smoke mode here."""
    payload = tmp_path / "payload"
    (payload / "train").mkdir(parents=True)
    (payload / "heldout").mkdir()
    shutil.copy(texts[0], payload / "train" / "a.txt")
    (payload / "heldout" / "b.txt").write_text(json.loads(texts[1].read_text().splitlines()[0])["text"])
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PY": sys.executable, "DEVICE": "cpu", "COMPUTE": "float32", "SMOKE_TOKENS": "500", "HELDOUT": "4", "TRAIN_S": "2",
           "WORK": str(tmp_path / "work")}
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu" / "build_heads.sh"), str(payload), str(out), "smoke"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for kind in TYPES:
        tensors = load_file(str(out / f"heads-{kind}.safetensors"))
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
        assert (out / f"heads-{kind}.safetensors").stat().st_size < 16 << 20
    import tarfile

    with tarfile.open(out / "build.tar.gz") as tar:
        names = tar.getnames()
    assert "./report/build_report.json" in names and "./heads-conditioned/rank_accuracy.json" in names


def test_two_processes_under_torchrun_train_the_heads_one_process_does(texts, tmp_path):
    """Two gloo ranks sharing each step's 8 rows end with the heads of one process running the
    same rows as two micro-batches: gradients (g0 + g1) / 2 either way, bit for bit."""
    args = ["build-heads", "--data", str(texts[0]), "--heldout", str(texts[1]), "--tokens", "480",
            "--heldout-prompts", "4", "--prompt-len", "8", "--new-tokens", "12", "--distill-batch", "8",
            "--shard-rows", "8", "--batch-rows", "8", "--warmup", "2", "--threads", "1", "--heads", "conditioned", "medusa"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "multitoken.pipeline.cli"]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                           "multitoken.pipeline.cli", *args, "--out", str(tmp_path / "two")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    done = subprocess.run([*cli, *args, "--micro-batches", "2", "--out", str(tmp_path / "one")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    shards = sorted(p.name for p in (tmp_path / "two" / "distill" / "train").iterdir())
    assert len(shards) == 5 and shards == sorted(p.name for p in (tmp_path / "one" / "distill" / "train").iterdir())
    for kind in ("conditioned", "medusa"):
        a = load_file(str(tmp_path / "two" / f"heads-{kind}" / "heads.safetensors"))
        b = load_file(str(tmp_path / "one" / f"heads-{kind}" / "heads.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), kind
    report = json.loads((tmp_path / "two" / "report" / "build_report.json").read_text())
    assert report["processes"] == 2 and report["stages"]["train"]["steps"] == 40 // 8
