"""LR groups (differential 4x, DynaMo LR_B / LR_M / LR_MB), schedule and loss combination."""

from __future__ import annotations

import math

import pytest
import torch
from .train_helpers import make_heads_dir, train_cfg

from multitoken.adapters.base import LossOutput
from multitoken.pipeline.train import optim
from multitoken.base.errors import UsageError
from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.pipeline.train.trainer_config import validate


@pytest.fixture(scope="module")
def heads_dir(tiny_llama_dir, tmp_path_factory):
    return make_heads_dir(tiny_llama_dir, tmp_path_factory.mktemp("h") / "heads", init="random")


def _model(tiny_llama_dir, heads_dir, lora: bool):
    from multitoken.pipeline.model.loading import BackboneConfig, LoraSpec, load_backbone
    from multitoken.pipeline.model.model import MultiTokenModel

    torch.manual_seed(0)
    bb = load_backbone(BackboneConfig(base=str(tiny_llama_dir)), lora=LoraSpec() if lora else None, trainable_lora=lora)
    return MultiTokenModel.from_pretrained(bb, heads_dir)


def _by_name(groups):
    return {g["name"]: g for g in groups}


def test_differential_head_lr(tiny_llama_dir, heads_dir):
    model = _model(tiny_llama_dir, heads_dir, lora=True)
    groups = _by_name(optim.param_groups(model, train_cfg(heads_dir, "o", mode="joint", lr=1e-4, head_lr_mult=4.0)))
    assert groups["lora"]["lr"] == 1e-4 and groups["heads_new"]["lr"] == pytest.approx(4e-4)
    assert {id(p) for p in groups["lora"]["params"]} == {id(p) for p in model.lora_parameters()}
    assert {id(p) for p in groups["heads_new"]["params"]} == {id(p) for p in model.head_parameters()}
    # Heads only: no LoRA group even when the backbone carries one.
    heads_only = _by_name(optim.param_groups(model, train_cfg(heads_dir, "o", mode="heads")))
    assert set(heads_only) == {"heads_new"}


def test_dynamo_rates(tiny_llama_dir, heads_dir, tmp_path):
    model = _model(tiny_llama_dir, heads_dir, lora=True)
    cfg = train_cfg(heads_dir, "o", mode="joint", lr_b=1e-5, lr_m=1e-3, lr_mb=1e-6, train_base_head=True)
    for p in model.base_head_parameters():
        p.requires_grad_(True)
    groups = _by_name(optim.param_groups(model, cfg))
    assert (groups["lora"]["lr"], groups["base_head"]["lr"], groups["heads_new"]["lr"]) == (1e-5, 1e-5, 1e-3)
    assert optim.stem_scale(cfg, backbone_trains=True) == pytest.approx(0.1)
    assert optim.stem_scale(cfg, backbone_trains=False) == 1.0
    copied = make_heads_dir(tiny_llama_dir, tmp_path / "copied", init="copy")
    groups = _by_name(optim.param_groups(_model(tiny_llama_dir, copied, lora=True), cfg))
    assert groups["heads_copied"]["lr"] == 1e-5 and "heads_new" not in groups  # DynaMo trains copies at LR_B


def test_lr_mb_scales_only_the_backbone_share_of_the_gradient(tiny_llama_dir, heads_dir):
    """One backward of the combined loss == LR_B-side grad g1 + (LR_MB/LR_B) * g_rest on LoRA,
    and the heads' own unscaled gradient."""
    model = _model(tiny_llama_dir, heads_dir, lora=True)
    cfg = train_cfg(heads_dir, "o", mode="joint", lr_b=1e-4, lr_m=1e-3, lr_mb=2.5e-5)
    groups = optim.param_groups(model, cfg)
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    lora, heads = model.lora_parameters(), model.head_parameters()

    def grads(loss_fn):
        model.zero_grad(set_to_none=True)
        loss_fn(model.compute_loss(ids)).backward()
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in lora + heads]

    g1 = grads(lambda out: out.per_head[0])
    g_rest = grads(lambda out: sum(out.per_head[1:]))
    scale = optim.stem_scale(cfg, True)
    model.zero_grad(set_to_none=True)
    optim.combine_losses(model.compute_loss(ids), cfg, scale).backward()
    optim.unscale_head_grads(groups, scale)
    for i, p in enumerate(lora):
        torch.testing.assert_close(p.grad, g1[i] + scale * g_rest[i], rtol=1e-4, atol=1e-7)
    for j, p in enumerate(heads):
        torch.testing.assert_close(p.grad, g_rest[len(lora) + j], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("head_type", ["replicated", "medusa"])
def test_skipping_the_frozen_head1_term_changes_no_gradient(tiny_llama_dir, tmp_path, head_type):
    """Heads only: head 1's loss is a constant, so training skips it (no unembedding for it)
    and every head gradient is bit-identical; with LoRA it carries gradient and stays."""
    heads_dir = make_heads_dir(tiny_llama_dir, tmp_path / "h", head_type=head_type)
    model = _model(tiny_llama_dir, heads_dir, lora=False)
    cfg = train_cfg(heads_dir, "o", mode="heads")
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(2))

    def grads(skip):
        model.zero_grad(set_to_none=True)
        out = model.compute_loss(ids, skip_constant=skip)
        optim.combine_losses(out, cfg, 1.0).backward()
        return out, [p.grad.clone() for p in model.head_parameters()]

    full, g_full = grads(False)
    skipped, g_skip = grads(True)
    assert full.per_head[0] is not None and skipped.per_head[0] is None
    assert "head1/loss" in full.metrics and "head1/loss" not in skipped.metrics and "head2/loss" in skipped.metrics
    assert all(torch.equal(a, b) for a, b in zip(g_full, g_skip))
    with torch.no_grad():  # evaluation scores every head
        assert model.compute_loss(ids, skip_constant=True).per_head[0] is not None
    lora_model = _model(tiny_llama_dir, heads_dir, lora=True)
    assert lora_model.compute_loss(ids, skip_constant=True).per_head[0].requires_grad


def test_rms_balance_gives_every_head_head1s_magnitude():
    losses = [torch.tensor(2.0, requires_grad=True), torch.tensor(4.0, requires_grad=True), torch.tensor(8.0, requires_grad=True)]
    out = LossOutput(per_head=losses, aux=torch.tensor(3.0, requires_grad=True))
    cfg = train_cfg("h", "o", loss_balance="rms", aux_weight=0.5)
    total = optim.combine_losses(out, cfg, scale=1.0)
    assert total.item() == pytest.approx(2.0 * 3 + 0.5 * 3.0)
    total.backward()
    assert [float(l.grad) for l in losses] == pytest.approx([1.0, 0.5, 0.25])  # w_i = L_1 / L_i, detached
    plain = optim.combine_losses(LossOutput(per_head=[l.detach() for l in losses]), train_cfg("h", "o", aux_weight=0.5), 1.0)
    assert float(plain) == pytest.approx(14.0)


def test_schedule_warms_up_then_anneals():
    cfg = train_cfg("h", "o", max_steps=110, lr_warmup_steps=10)
    factors = [optim.lr_factor(s, cfg) for s in range(110)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[10] == 1.0 and factors[60] == pytest.approx(0.5) and factors[109] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.99)))
    const = train_cfg("h", "o", schedule="constant", lr_warmup_steps=0)
    assert {optim.lr_factor(s, const) for s in range(50)} == {1.0}


@pytest.mark.parametrize("kw, match", [
    (dict(mode="warmup"), "head-warmup-steps"),
    (dict(head_warmup_steps=3), "only applies"),
    (dict(lr_b=1e-5), "as a set"),
    (dict(lr_b=1e-5, lr_m=1e-3, lr_mb=1e-6, head_lr_mult=4.0), "alternatives"),
    (dict(batch_size=0), "batch-size"),
    (dict(lr=0), "--lr"),
    (dict(train_base_head=True, backbone=BackboneConfig(base=None, dtype=None, quantization="4bit")), "float weights"),
])
def test_bad_flag_combinations(heads_dir, kw, match):
    with pytest.raises(UsageError, match=match):
        validate(train_cfg(heads_dir, "o", **kw))
