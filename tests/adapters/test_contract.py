"""Contract every registered head type meets, on both architectures."""

from __future__ import annotations

import math

import torch

from multitoken.pipeline.model.model import LossOutput, MultiTokenModel

from .conftest import random_ids, small_config


def _model(backbone, head_type, **options):
    torch.manual_seed(0)
    return MultiTokenModel.attach(backbone, small_config(head_type, **options))


def test_head_logits_shapes(tiny_backbone, head_type):
    model = _model(tiny_backbone, head_type)
    ids = random_ids(tiny_backbone)
    full = model.head_logits(ids, last_only=False)
    last = model.head_logits(ids)
    assert len(full) == len(last) == 3
    for f, l in zip(full, last):
        assert f.shape == (2, 12, tiny_backbone.vocab_size)
        assert l.shape == (2, 1, tiny_backbone.vocab_size)
        torch.testing.assert_close(f[:, -1:], l)
        torch.testing.assert_close(f.exp().sum(-1), torch.ones(2, 12))  # proper distributions


def test_head1_is_the_base_model(tiny_backbone, head_type):
    model = _model(tiny_backbone, head_type)
    ids = random_ids(tiny_backbone, seed=1)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding must not change the contract
    with torch.no_grad():
        ref = torch.log_softmax(tiny_backbone.model(ids, attention_mask=mask).logits.float(), -1)
    head1 = model.head_logits(ids, mask, last_only=False)[0]
    assert torch.equal(head1, ref)


def test_compute_loss_contract(tiny_backbone, head_type):
    model = _model(tiny_backbone, head_type)
    model.train()
    ids = random_ids(tiny_backbone, seed=2)
    out = model.compute_loss(ids)
    assert isinstance(out, LossOutput)
    assert len(out.per_head) == 3
    assert all(l.dim() == 0 and math.isfinite(l.item()) for l in out.per_head)
    # Head 1 with a frozen backbone is the base model's own next-token loss, without autograd.
    with torch.no_grad():
        logits = tiny_backbone.model(ids).logits.float()
    base_ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    if head_type != "cp":  # cp's first entry is its own eq. 11 marginal (tested in test_cp)
        torch.testing.assert_close(out.per_head[0], base_ce)
    # Only head weights receive gradients; the frozen backbone is untouched.
    loss = out.total + (out.aux if out.aux is not None else 0)
    loss.backward()
    grads = [p.grad for p in model.head_parameters()]
    assert grads and all(g is not None for g in grads)
    assert all(p.grad is None for p in tiny_backbone.model.parameters())
    assert "head2/loss" in out.metrics


def test_features_run_without_autograd_when_frozen(tiny_backbone, head_type):
    model = _model(tiny_backbone, head_type)
    feats = model.features(random_ids(tiny_backbone))
    assert not feats.trunk.requires_grad and not feats.base.requires_grad


def test_heads_do_not_own_base_weights(tiny_backbone, head_type):
    model = _model(tiny_backbone, head_type)
    base_ids = {id(p) for p in tiny_backbone.model.parameters()}
    assert not any(id(p) in base_ids for p in model.heads.parameters())
    assert all(not p.requires_grad for p in model.base_head_parameters())
    assert {id(p) for p in model.base_head_parameters()} <= base_ids
    groups = model.head_parameter_groups()
    assert len(groups["copied"]) + len(groups["new"]) == len(model.head_parameters())


def test_long_sequences_are_chunked(tiny_backbone, head_type):
    model = _model(tiny_backbone, head_type)
    ids = random_ids(tiny_backbone, length=20, seed=3)
    whole = model.compute_loss(ids)
    model.loss_chunk = 7  # odd chunk size: the loss must not depend on chunking
    chunked = model.compute_loss(ids)
    for a, b in zip(whole.per_head, chunked.per_head):
        torch.testing.assert_close(a, b)


def test_padding_is_ignored_by_the_loss(tiny_backbone, head_type):
    model = _model(tiny_backbone, head_type)
    ids = random_ids(tiny_backbone, batch=1, length=12, seed=4)
    mask = torch.ones_like(ids)
    mask[:, 8:] = 0  # right padding: the last 4 tokens are not data
    padded = model.compute_loss(ids, mask)
    alone = model.compute_loss(ids[:, :8])
    for a, b in zip(padded.per_head, alone.per_head):
        torch.testing.assert_close(a, b)


def test_declared_capabilities_match_the_methods(tiny_backbone, head_type):
    """``hidden`` takes ``cache=``, and sequential drafting is declared on the class exactly when
    the head has ``conditional_log_probs`` (what decoding's CP drafter calls)."""
    import inspect

    heads = _model(tiny_backbone, head_type).heads
    assert "cache" in inspect.signature(type(heads).hidden).parameters
    assert type(heads).supports_sequential_drafts == hasattr(heads, "conditional_log_probs")
    assert type(heads).supports_sequential_drafts == (head_type == "cp")


def test_uncounted_hits_leave_losses_and_gradients_as_they_are(tiny_backbone, head_type):
    """``hits_counted(False)`` (a trainer's unlogged steps) drops the top-1 / top-5 rates from the
    metrics and nothing else: the same losses, bit for bit, and the same head gradients; in
    training and in eval mode."""
    from multitoken.adapters.unembed import hits_counted

    ids = random_ids(tiny_backbone, seed=5)
    for train in (True, False):
        runs = []
        for on in (True, False):
            model = _model(tiny_backbone, head_type)
            model.train(train)
            with hits_counted(on):
                out = model.compute_loss(ids)
                (out.total + (out.aux if out.aux is not None else 0)).backward()
            runs.append((out, [p.grad for p in model.head_parameters()]))
        (counted, g1), (uncounted, g2) = runs
        rates = {k for k in counted.metrics if k.endswith(("/top1", "/top5"))}
        assert "head2/top1" in rates or (head_type == "cp" and train)  # cp rates its heads in eval only
        assert not rates & set(uncounted.metrics)
        assert set(counted.metrics) - rates == set(uncounted.metrics)
        assert all(torch.equal(a, b) for a, b in zip(counted.per_head, uncounted.per_head))
        assert all(torch.equal(a, b) for a, b in zip(g1, g2))
