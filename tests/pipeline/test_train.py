"""``pipeline.train``: heads-only and joint LoRA training, warm-up, resume, output atomicity."""

from __future__ import annotations

import json

import pytest
import torch
from .train_helpers import head_state, load_trained, make_heads_dir, train_cfg

from multitoken.pipeline.train import train as train_mod
from multitoken.adapters.registry import registered_heads
from multitoken.base.data import DataConfig
from multitoken.base.errors import DataError
from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.pipeline.train.train import train


def _base_weights(model) -> dict[str, torch.Tensor]:
    """Base weights by their plain transformers names (peft's wrapping names stripped)."""
    named = model.backbone.causal_lm.named_parameters()
    return {k.replace(".base_layer", ""): v.detach().clone() for k, v in named if "lora_" not in k}


def test_heads_only_training_lowers_the_loss_and_leaves_the_base_alone(stories_dir, corpus, tmp_path):
    out = tmp_path / "trained"
    heads_dir = make_heads_dir(stories_dir, tmp_path / "untrained")
    before = load_trained(stories_dir, heads_dir)
    summary = train(train_cfg(heads_dir, out, max_steps=20, eval_every=5), DataConfig(data=str(corpus)))
    history = json.loads((out / "train_metrics.json").read_text())
    assert [h["step"] for h in history] == [5, 10, 15, 20]
    # Heads 2 and 3 learn the phrase structure; head 1 (the frozen base path) does not move.
    first, last = history[0], history[-1]
    assert last["head2/loss"] < first["head2/loss"] - 1.0
    assert last["head3/loss"] < first["head3/loss"] - 1.0
    assert last["head1/loss"] == pytest.approx(first["head1/loss"], abs=1e-5)
    assert summary["eval"]["head2/top5"] == last["head2/top5"]
    after = load_trained(stories_dir, out)
    for k, v in _base_weights(before).items():
        torch.testing.assert_close(_base_weights(after)[k], v, rtol=0, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(head_state(before).values(), head_state(after).values()))
    resolved = json.loads((out / "train_config.json").read_text())
    assert resolved["command"] == "train" and resolved["TrainConfig"]["max_steps"] == 20
    assert resolved["DataConfig"]["data"] == str(corpus)


def test_backbone_pass_runs_without_autograd_in_heads_mode(tiny_llama_dir, heads_dir, corpus, tmp_path, monkeypatch):
    seen = []
    from multitoken.pipeline.model.model import MultiTokenModel

    real = MultiTokenModel.features

    def spy(self, *a, **k):
        feats = real(self, *a, **k)
        seen.append((feats.trunk.requires_grad, feats.base.requires_grad))
        return feats

    monkeypatch.setattr(MultiTokenModel, "features", spy)
    train(train_cfg(heads_dir, tmp_path / "o", max_steps=2), DataConfig(data=str(corpus)))
    assert seen and not any(a or b for a, b in seen)


def test_joint_lora_trains_only_lora_and_heads(tiny_llama_dir, heads_dir, corpus, tmp_path):
    out = tmp_path / "joint"
    before = load_trained(tiny_llama_dir, heads_dir)
    train(train_cfg(heads_dir, out, mode="joint", max_steps=4, lr=1e-2), DataConfig(data=str(corpus)))
    assert (out / "lora" / "adapter_config.json").is_file()
    after = load_trained(tiny_llama_dir, out)
    assert after.has_lora
    base_after = _base_weights(after)
    assert base_after.keys() == _base_weights(before).keys()
    for k, v in _base_weights(before).items():
        torch.testing.assert_close(base_after[k], v, rtol=0, atol=0)
    # LoRA B starts at zero (peft), so any non-zero B means the adapter trained.
    lora_b = [p for n, p in after.base_model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)
    assert any(not torch.equal(a, b) for a, b in zip(head_state(before).values(), head_state(after).values()))


def test_warmup_trains_heads_first_then_lora(heads_dir, corpus, tmp_path, monkeypatch):
    phases = []
    real = train_mod.train_step

    def spy(runner, optimizer, rows, cfg, step):
        lora = runner.model.lora_parameters()
        phases.append((step, all(p.requires_grad for p in lora), [p.detach().clone() for p in lora]))
        return real(runner, optimizer, rows, cfg, step)

    monkeypatch.setattr(train_mod, "train_step", spy)
    train(train_cfg(heads_dir, tmp_path / "w", mode="warmup", head_warmup_steps=3, max_steps=5), DataConfig(data=str(corpus)))
    assert [(s, trains) for s, trains, _ in phases] == [(0, False), (1, False), (2, False), (3, True), (4, True)]
    # LoRA weights stay at their initial values during warm-up and move afterwards.
    init = phases[0][2]
    assert all(torch.equal(a, b) for a, b in zip(init, phases[3][2]))
    assert any(not torch.equal(a, b) for a, b in zip(init, phases[4][2]))


@pytest.mark.parametrize("mode", ["heads", "warmup"])
def test_resume_reproduces_an_uninterrupted_run(tiny_llama_dir, heads_dir, corpus, tmp_path, monkeypatch, mode):
    data = DataConfig(data=str(corpus))
    kw = dict(max_steps=6, save_every=3, grad_accum=2, batch_size=2, loss_balance="rms", eval_every=2,
              mode=mode, head_warmup_steps=2 if mode == "warmup" else 0)
    train(train_cfg(heads_dir, tmp_path / "a", **kw), data)

    real, calls = train_mod.train_step, []

    def dies_after_four(*a, **k):
        calls.append(1)
        if len(calls) == 5:  # killed during step 5, after the step-3 checkpoint
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(train_mod, "train_step", dies_after_four)
    with pytest.raises(KeyboardInterrupt):
        train(train_cfg(heads_dir, tmp_path / "b", **kw), data)
    assert not (tmp_path / "b").exists()  # no output before the run completes
    monkeypatch.setattr(train_mod, "train_step", real)
    train(train_cfg(heads_dir, tmp_path / "b", resume=True, **kw), data)

    a, b = load_trained(tiny_llama_dir, tmp_path / "a"), load_trained(tiny_llama_dir, tmp_path / "b")
    for (ka, va), (kb, vb) in zip(head_state(a).items(), head_state(b).items()):
        assert ka == kb and torch.equal(va, vb), ka
    if mode == "warmup":
        for (na, pa), (nb, pb) in zip(a.base_model.named_parameters(), b.base_model.named_parameters()):
            assert na == nb and torch.equal(pa, pb), na
    ma = json.loads((tmp_path / "a" / "train_metrics.json").read_text())
    mb = json.loads((tmp_path / "b" / "train_metrics.json").read_text())
    assert ma == mb  # same evaluations at the same steps, the resumed half included


def test_time_based_checkpoints_come_first_and_resume(tiny_llama_dir, heads_dir, corpus, tmp_path, monkeypatch):
    from multitoken.pipeline.train.checkpoint import list_checkpoints

    data = DataConfig(data=str(corpus))
    # the step-based checkpoint would come at step 500; a tiny time interval saves after every step
    kw = dict(max_steps=4, save_every=500, save_every_minutes=1e-7, eval_every=2)
    train(train_cfg(heads_dir, tmp_path / "a", **kw), data)
    real, calls = train_mod.train_step, []

    def dies_in_step_three(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(train_mod, "train_step", dies_in_step_three)
    with pytest.raises(KeyboardInterrupt):
        train(train_cfg(heads_dir, tmp_path / "b", **kw), data)
    assert [p.name for p in list_checkpoints(tmp_path / "b.checkpoints")] == ["step-00000001", "step-00000002"]
    monkeypatch.setattr(train_mod, "train_step", real)
    train(train_cfg(heads_dir, tmp_path / "b", resume=True, **kw), data)
    a, b = load_trained(tiny_llama_dir, tmp_path / "a"), load_trained(tiny_llama_dir, tmp_path / "b")
    for (ka, va), (kb, vb) in zip(head_state(a).items(), head_state(b).items()):
        assert ka == kb and torch.equal(va, vb), ka
    assert (json.loads((tmp_path / "a" / "train_metrics.json").read_text())
            == json.loads((tmp_path / "b" / "train_metrics.json").read_text()))


def test_no_time_based_checkpoint_when_off(heads_dir, corpus, tmp_path):
    from multitoken.pipeline.train.checkpoint import list_checkpoints

    train(train_cfg(heads_dir, tmp_path / "o", max_steps=3, save_every=500, save_every_minutes=0), DataConfig(data=str(corpus)))
    assert [p.name for p in list_checkpoints(tmp_path / "o.checkpoints")] == ["step-00000003"]  # the final one only


def test_existing_checkpoints_need_resume(heads_dir, corpus, tmp_path):
    from multitoken.base.errors import UsageError

    data = DataConfig(data=str(corpus))
    train(train_cfg(heads_dir, tmp_path / "o", max_steps=1), data)
    with pytest.raises(UsageError, match="--resume"):
        train(train_cfg(heads_dir, tmp_path / "o", max_steps=1), data)
    with pytest.raises(UsageError, match="other data settings"):
        train(train_cfg(heads_dir, tmp_path / "o", max_steps=2, seq_len=16, resume=True), data)


def test_failed_run_never_touches_an_existing_heads_dir(tiny_llama_dir, heads_dir, corpus, tmp_path, monkeypatch):
    out = tmp_path / "out"
    train(train_cfg(heads_dir, out, max_steps=1), DataConfig(data=str(corpus)))
    snapshot = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 99999]}\n')
    with pytest.raises(DataError):
        train(train_cfg(heads_dir, out, max_steps=1, checkpoint_dir=str(tmp_path / "c1")), DataConfig(data=str(bad)))

    from multitoken.pipeline.model import heads_io

    def broken_write(model, d, **kwargs):  # fails half-way through writing the staged heads dir
        (d / "heads.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(heads_io, "write_heads", broken_write)
    with pytest.raises(OSError, match="disk full"):
        train(train_cfg(heads_dir, out, max_steps=1, checkpoint_dir=str(tmp_path / "c2")), DataConfig(data=str(corpus)))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == snapshot
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("quantization", ["8bit", "4bit"])
def test_heads_train_on_a_quantized_backbone(tiny_llama_q_dir, corpus, tmp_path, quantization):
    from multitoken.pipeline.model.model import MultiTokenModel

    heads_dir = make_heads_dir(tiny_llama_q_dir, tmp_path / "heads")  # a width every CPU kernel takes
    out = tmp_path / "q"
    bb = BackboneConfig(base=None, dtype=None, quantization=quantization)  # base and dtype: the heads dir's
    train(train_cfg(heads_dir, out, max_steps=2, backbone=bb), DataConfig(data=str(corpus)))
    before = load_trained(tiny_llama_q_dir, heads_dir)
    after = MultiTokenModel.from_pretrained(str(tiny_llama_q_dir), out, quantization=quantization)
    assert after.backbone.is_quantized
    assert any(not torch.equal(a, b) for a, b in zip(head_state(before).values(), head_state(after).values()))
    assert all(v.dtype == torch.float32 for v in head_state(after).values())  # heads stay in full precision


@pytest.mark.parametrize("head_type", registered_heads())
def test_every_head_type_trains(tiny_llama_dir, corpus, tmp_path, head_type, monkeypatch):
    """Two steps per registered type; CP's aux balancing loss enters with its weight."""
    from multitoken.pipeline.train import optim

    heads = make_heads_dir(tiny_llama_dir, tmp_path / "h", head_type=head_type, **({"rank": 2} if head_type == "cp" else {}))
    seen_aux = []
    real = optim.combine_losses

    def spy(out, cfg, scale):
        seen_aux.append(out.aux is not None)
        return real(out, cfg, scale)

    monkeypatch.setattr(optim, "combine_losses", spy)
    train(train_cfg(heads, tmp_path / "o", max_steps=2, aux_weight=0.1), DataConfig(data=str(corpus)))
    before, after = load_trained(tiny_llama_dir, heads), load_trained(tiny_llama_dir, tmp_path / "o")
    assert any(not torch.equal(a, b) for a, b in zip(head_state(before).values(), head_state(after).values()))
    assert all(seen_aux) == (head_type == "cp") and seen_aux


def test_dynamo_run_trains_head1_and_keeps_it(tiny_llama_dir, heads_dir, corpus, tmp_path):
    """DynaMo rates with head 1's final layer trained at LR_B: the trained layer is saved, and
    continuing without --train-base-head is refused rather than silently dropping it."""
    from multitoken.base.errors import UsageError

    data = DataConfig(data=str(corpus))
    dynamo = dict(mode="joint", lr_b=1e-3, lr_m=1e-2, lr_mb=1e-4, train_base_head=True, max_steps=2)
    train(train_cfg(heads_dir, tmp_path / "d", **dynamo), data)
    record = json.loads((tmp_path / "d" / "heads_config.json").read_text())
    assert any(k.startswith("base_head.final_layer.") for k in record["shapes"])
    before, after = load_trained(tiny_llama_dir, heads_dir), load_trained(tiny_llama_dir, tmp_path / "d")
    changed = [k for k, v in _base_weights(before).items() if not torch.equal(v, _base_weights(after)[k])]
    assert changed and all(k.startswith(("model.layers.2.", "model.norm.")) for k in changed)  # only the final layer + norm
    with pytest.raises(UsageError, match="--train-base-head"):
        train(train_cfg(tmp_path / "d", tmp_path / "e", max_steps=1), data)
    train(train_cfg(tmp_path / "d", tmp_path / "e", max_steps=1, train_base_head=True), data)


def test_training_stops_at_the_first_non_finite_weight_and_keeps_the_last_good_checkpoint(
        tiny_llama_dir, heads_dir, corpus, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from multitoken.base.errors import DivergedError
    from multitoken.pipeline.train.checkpoint import list_checkpoints

    real, calls = train_mod.train_step, []

    def poisons_step_three(runner, optimizer, *a, **k):
        metrics = real(runner, optimizer, *a, **k)
        calls.append(1)
        if len(calls) == 3:  # what an overflowing update does: the weights turn NaN, the loss is still finite
            with torch.no_grad():
                optimizer.param_groups[-1]["params"][0].fill_(float("nan"))
        return metrics

    monkeypatch.setattr(train_mod, "train_step", poisons_step_three)
    with pytest.raises(DivergedError, match=r"training diverged at step 3: heads\..* holds \d[\d,]* non-finite values") as err:
        train(train_cfg(heads_dir, tmp_path / "o", max_steps=5, save_every=1, save_every_minutes=0), DataConfig(data=str(corpus)))
    assert "the last good checkpoint is kept" in str(err.value) and "lower --lr" in err.value.fix
    assert len(calls) == 3 and not (tmp_path / "o").exists()  # no heads written from NaN weights
    kept = list_checkpoints(tmp_path / "o.checkpoints")
    assert [p.name for p in kept] == ["step-00000001", "step-00000002"]
    assert all(torch.isfinite(v).all() for v in load_file(str(kept[-1] / "trainable.safetensors")).values())


def test_non_finite_heads_are_never_written(tiny_llama_dir, heads_dir, tmp_path):
    from multitoken.base.errors import CheckpointError

    model = load_trained(tiny_llama_dir, heads_dir)
    with torch.no_grad():
        next(model.heads.parameters()).fill_(float("inf"))
    with pytest.raises(CheckpointError, match="the heads to write: .* non-finite values"):
        model.save_heads(tmp_path / "h")
    assert not (tmp_path / "h").exists()


def test_training_ranks_the_data_tokens_beside_the_heads(stories_dir, corpus, tmp_path):
    """draft_vocab.json: every token of the data counted, most frequent first; --draft-vocab 0
    writes none."""
    import numpy as np

    from multitoken.pipeline.model.draft_vocab import DRAFT_VOCAB_FILE, read_ranking

    heads_dir = make_heads_dir(stories_dir, tmp_path / "untrained")
    train(train_cfg(heads_dir, tmp_path / "a", max_steps=2, draft_vocab=100), DataConfig(data=str(corpus)))
    record = read_ranking(tmp_path / "a")
    assert record["size"] == 100 and len(set(record["tokens"])) == len(record["tokens"])
    assert record["counts"] == sorted(record["counts"], reverse=True) and min(record["counts"]) > 0
    docs = [json.loads(line)["input_ids"] for line in corpus.read_text().splitlines() if line.strip()]
    counts = np.bincount(np.concatenate(docs))  # the packed stream adds separators and drops a partial last row
    separator = load_trained(stories_dir, heads_dir).backbone.tokenizer.eos_token_id
    ranked = [t for t in record["tokens"] if t != separator]
    assert ranked[0] == int(np.argmax(counts)) and set(ranked) <= set(np.flatnonzero(counts).tolist())
    assert len(ranked) > 0.9 * np.count_nonzero(counts)
    train(train_cfg(heads_dir, tmp_path / "b", max_steps=2, draft_vocab=0), DataConfig(data=str(corpus)))
    assert not (tmp_path / "b" / DRAFT_VOCAB_FILE).exists()


def test_resume_continues_only_the_run_that_made_the_checkpoint(heads_dir, corpus, tmp_path):
    """A checkpoint records the run's settings and data (pipeline/train/fingerprint.py): another
    --lr, --seed or --max-steps, or a corpus whose bytes changed, is refused by name; the same
    bytes under another file name are the same run."""
    from multitoken.base.errors import UsageError

    data = DataConfig(data=str(corpus))
    train(train_cfg(heads_dir, tmp_path / "o", max_steps=1, seq_len=16), data)
    for kw, message in [(dict(lr=1e-2), r"other settings: --lr 0\.005 \(now 0\.01\)"),
                        (dict(seed=3), r"--seed 0 \(now 3\)"),
                        (dict(max_steps=2), r"--max-steps 1 \(now 2\)")]:
        with pytest.raises(UsageError, match=message):
            train(train_cfg(heads_dir, tmp_path / "o", **{"max_steps": 1, "seq_len": 16, "resume": True, **kw}), data)
    changed = tmp_path / "changed.jsonl"
    changed.write_bytes(corpus.read_bytes() + b'{"input_ids": [5, 6, 7]}\n')
    with pytest.raises(UsageError, match=r"other data: changed\.jsonl changed"):
        train(train_cfg(heads_dir, tmp_path / "o", max_steps=1, seq_len=16, resume=True), DataConfig(data=str(changed)))
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_bytes(corpus.read_bytes())
    summary = train(train_cfg(heads_dir, tmp_path / "o", max_steps=1, seq_len=16, resume=True), DataConfig(data=str(renamed)))
    assert summary["unchanged"] and summary["step"] == 1


def test_resume_of_a_finished_run_rewrites_nothing(heads_dir, corpus, tmp_path):
    data = DataConfig(data=str(corpus))
    train(train_cfg(heads_dir, tmp_path / "o", max_steps=2, seq_len=16), data)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}
    summary = train(train_cfg(heads_dir, tmp_path / "o", max_steps=2, seq_len=16, resume=True, eval_every=1), data)
    assert summary["unchanged"] and summary["eval"] and summary["step"] == 2
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(p for p in tmp_path.rglob("*") if p.is_file())} == before
