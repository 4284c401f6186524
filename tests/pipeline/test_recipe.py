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
from multitoken.pipeline.model.draft_vocab import ranked_ids, read_ranking
from multitoken.pipeline.model.export_eagle3 import read_eagle3
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.pipeline.train import recipe_data
from multitoken.pipeline.train.recipe import HEAD_TYPES

from ..conftest import fixture_path as fixture

REPO = Path(__file__).resolve().parents[2]
TYPES = ("replicated", "medusa", "conditioned", "eagle3")
DRAFT_VOCAB = 200  # of stories260K's 512: eagle3's lm_head scores these


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
                 "--warmup", "2", "--epochs", "1", "--threads", "1", "--draft-vocab", str(DRAFT_VOCAB), *extra])


@pytest.fixture(scope="module")
def built(texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("build") / "out"
    assert build(texts, out) == 0
    return out


def test_every_head_type_is_a_heads_dir_measured_on_held_out_text(built):
    assert HEAD_TYPES == TYPES  # the default build makes every type, the eagle3 drafter included
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


def test_the_eagle3_drafter_drafts_over_the_ranking_is_scored_as_drafting_and_exports(built, tmp_path):
    """Its lm_head scores the ranking's first --draft-vocab tokens; rank_accuracy.json's top-1 of
    draft step s counts the positions t where a greedy chain drafted from the drafter's KV cache
    (step 1 fed token t+1, each later step its own previous draft) guesses token t+s+1."""
    from multitoken.decoding.trees import MAX_RANKS
    from multitoken.pipeline.train.recipe_train import rank_accuracy

    heads_dir = built / "heads-eagle3"
    model = MultiTokenModel.from_pretrained(BackboneConfig(cpu_linear="stock"), str(heads_dir))
    heads, V = model.heads, model.backbone.vocab_size
    want = ranked_ids(read_ranking(heads_dir, V), DRAFT_VOCAB, V).sort().values
    assert heads.draft_head.out_features == DRAFT_VOCAB and torch.equal(heads.t2d.nonzero().squeeze(-1), want)
    held = recipe_data.read_shards(built / "distill" / "heldout")
    acc = rank_accuracy(model.backbone, model, held, 32, "float32", MAX_RANKS)
    hits, counts = [0] * (model.n_future - 1), [0] * (model.n_future - 1)
    with torch.no_grad():
        for ids, valid in zip(held["ids"], held["valid"]):
            ids, T = ids[None].long(), ids.shape[0]
            feats = model.features(ids)
            fused = heads.fuse(feats.layer_states)
            for t in range(T - 2):
                cache = heads.new_cache()
                logits, out = heads.step(fused[:, :t + 1], feats.next_ids[:, :t + 1], cache, torch.arange(t + 1)[None])
                logits, out = logits[:, -1:], out[:, -1:]
                for s in range(1, min(model.n_future, T - t - 1)):  # step s guesses token t+s+1
                    token = heads.to_target(logits.argmax(-1))  # [1, 1]
                    if valid[t] and valid[t + s + 1]:
                        counts[s - 1] += 1
                        hits[s - 1] += int(token.item() == ids[0, t + s + 1])
                    logits, out = heads.step(out, token, cache, torch.full((1, 1), t + s))
    assert counts == acc["counts"] and hits == [r[0] for r in acc["ranks"]]
    written = json.loads((heads_dir / "rank_accuracy.json").read_text())["rank_accuracy"]
    assert [row[0] for row in written] == [h / c for h, c in zip(hits, counts)]
    assert main(["export", "--format", "eagle3", "--heads", str(heads_dir), "--out", str(tmp_path / "e3")]) == 0
    config, tensors = read_eagle3(tmp_path / "e3")
    assert config["draft_vocab_size"] == DRAFT_VOCAB and torch.equal(tensors["d2t"], heads.d2t)
    assert torch.equal(tensors["lm_head.weight"], heads.draft_head.weight)


def test_continuations_are_the_bases_greedy_text(built):
    """A greedy shard row is the base's own greedy continuation of its prompt (transformers')."""
    from multitoken.pipeline.model.loading import load_backbone

    bb = load_backbone(BackboneConfig(cpu_linear="stock"))
    held = recipe_data.read_shards(built / "distill" / "heldout")
    row = held["ids"][:1]
    want = bb.model.generate(row[:, :8], attention_mask=torch.ones_like(row[:, :8]), do_sample=False,
                             max_new_tokens=12, pad_token_id=bb.tokenizer.eos_token_id)
    assert torch.equal(row, want)  # stories260K's stories end with BOS, not EOS: no row ends early
    assert not held["valid"][:, :7].any() and held["valid"][:, 7:].all()  # targets: the base's text only
    report = json.loads((built / "report" / "build_report.json").read_text())
    assert report["stages"]["distill"]["train"]["engine"] == "multitoken"  # our engine by default


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
    assert build(texts, out, "--distill-engine", "transformers") != 0  # its sampled rows draw otherwise
    assert "holds a build with another distill_engine" in capsys.readouterr().err
    assert build(texts, out, "--distill-dtype", "float32") != 0  # auto's text may be bf16's
    assert "holds a build with another distill_dtype" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert build(texts, foreign) != 0
    assert "not empty" in capsys.readouterr().err and (foreign / "notes.txt").read_text() == "mine"


@pytest.mark.heavy
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
        parts = sorted(out.glob(f"heads-{kind}.*.safetensors"))  # in bfloat16 but eagle3's id maps, each under 16 MiB
        tensors = {k: v for p in parts for k, v in load_file(str(p)).items()}
        assert parts and all(p.stat().st_size < 16 << 20 for p in parts)
        assert all(t.dtype == (torch.bfloat16 if k not in ("d2t", "t2d") else tensors[k].dtype) for k, t in tensors.items())
        assert kind != "eagle3" or (tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool)
    import tarfile

    with tarfile.open(out / "build.tar.gz") as tar:
        names = tar.getnames()
    assert "./report/build_report.json" in names and "./heads-conditioned/rank_accuracy.json" in names


@pytest.mark.heavy
def test_two_processes_under_torchrun_train_the_heads_one_process_does(texts, tmp_path):
    """Two gloo ranks sharing each step's 8 rows end with the heads of one process running the
    same rows as two micro-batches: gradients (g0 + g1) / 2 either way, bit for bit."""
    args = ["build-heads", "--data", str(texts[0]), "--heldout", str(texts[1]), "--tokens", "480",
            "--heldout-prompts", "4", "--prompt-len", "8", "--new-tokens", "12", "--distill-batch", "8",
            "--shard-rows", "8", "--batch-rows", "8", "--warmup", "2", "--threads", "1", "--heads", "conditioned", "medusa", "eagle3"]
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
    for kind in ("conditioned", "medusa", "eagle3"):
        a = load_file(str(tmp_path / "two" / f"heads-{kind}" / "heads.safetensors"))
        b = load_file(str(tmp_path / "one" / f"heads-{kind}" / "heads.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), kind
    report = json.loads((tmp_path / "two" / "report" / "build_report.json").read_text())
    assert report["processes"] == 2 and report["stages"]["train"]["steps"] == 40 // 8


def test_a_time_budget_is_planned_from_the_pace_after_the_first_steps(monkeypatch):
    """Slow first steps (CUDA's warm-up, lazy kernels) must not shorten the plan: it is cut at
    the pace since step 5, and re-cut every 100 steps from the pace since the last cut."""
    from multitoken.pipeline.train import recipe_train as rtrain

    clock = {"now": 0.0}
    monkeypatch.setattr(rtrain.time, "time", lambda: clock["now"])
    total, mark, budget = 1000, (0.0, 0), 20.0
    for step in range(1, 1001):
        clock["now"] += 1.0 if step <= 5 else (0.1 if step <= 20 else 0.05)
        total, mark = rtrain._fit(step, mark, 0.0, budget, 1000, total, rtrain.Ranks())
        if step == 20:
            assert abs(total - (20 + (budget - 6.5) / 0.1)) <= 1  # the first 5 s of warm-up not taken as the pace
        if step >= total:
            break
    assert abs(total - (100 + (budget - (6.5 + 80 * 0.05)) / 0.05)) <= 1 and abs(clock["now"] - budget) < 0.1


def test_a_build_recorded_before_distill_dtype_existed_resumes_as_float32(tmp_path):
    """A build whose record predates ``--distill-dtype`` distilled in float32: resuming it with
    ``--distill-dtype float32`` (and its recorded batch) is the same build; auto is another."""
    import dataclasses
    import json

    from multitoken.base.config_io import resolved_config_text
    from multitoken.base.errors import UsageError
    from multitoken.pipeline.cli.cmd_build_heads import CONFIG, _same_build
    from multitoken.pipeline.model.loading import BackboneConfig
    from multitoken.pipeline.train.recipe import RecipeConfig

    cfg, bb = RecipeConfig(data=("a.txt",), heldout=("b.txt",), out=str(tmp_path), distill_batch=64), BackboneConfig()
    record = json.loads(resolved_config_text("build-heads", cfg, bb))
    del record["RecipeConfig"]["distill_dtype"]
    (tmp_path / CONFIG).parent.mkdir()
    (tmp_path / CONFIG).write_text(json.dumps(record))
    _same_build(tmp_path, dataclasses.replace(cfg, distill_dtype="float32"), bb)
    with pytest.raises(UsageError, match="another distill_dtype"):
        _same_build(tmp_path, cfg, bb)
