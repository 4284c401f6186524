"""EAGLE-3 drafter heads: the training-time test is the drafting it trains for, the draft
vocabulary maps, and training on the base's own predictions."""

from __future__ import annotations

import pytest
import torch

from multitoken.adapters.eagle3 import default_aux_layers
from multitoken.base.errors import UsageError
from multitoken.pipeline.model.model import MultiTokenModel

from .conftest import random_ids, small_config


def _model(backbone, n_future: int = 4, **options) -> MultiTokenModel:
    torch.manual_seed(0)
    model = MultiTokenModel.attach(backbone, small_config("eagle3", n_future=n_future, **options))
    with torch.no_grad():  # a drafter far from its start, so that each step's argmax differs by position
        for p in model.heads.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def test_aux_layers_default_to_eagle3s_and_are_recorded(tiny_backbone):
    assert default_aux_layers(30) == [2, 15, 27]  # SmolLM2-135M: vLLM's and llama.cpp's defaults
    assert default_aux_layers(3) == [1, 1, 2]  # inside the trunk's states of a 3-layer base
    model = _model(tiny_backbone)
    assert model.config.aux_layers == default_aux_layers(tiny_backbone.num_layers)
    with pytest.raises(UsageError, match="aux_layers"):
        MultiTokenModel.attach(tiny_backbone, small_config("eagle3", aux_layers=[1, 2, tiny_backbone.num_layers]))
    with pytest.raises(UsageError, match="three layer ids"):
        small_config("eagle3", aux_layers=[1, 2])


def test_training_time_test_is_drafting_from_a_cache(tiny_backbone):
    """Head i+1 at position t (all positions at once, the training-time test's attention) equals
    a greedy chain drafted at t through the drafter's KV cache: step 1 over the prefix 0..t with
    the fused states, then one slot per step at positions t+1, t+2, ..."""
    model = _model(tiny_backbone)
    heads = model.heads
    ids = random_ids(tiny_backbone, batch=2, length=9, seed=5)
    with torch.no_grad():
        feats = model.features(ids)
        together = [heads.log_probs(i, feats) for i in range(1, model.n_future)]  # [B, T, V] each
        fused = heads.fuse(feats.layer_states)  # [B, T, H]
        for t in (0, 4, 8):
            cache = heads.new_cache()
            pos = torch.arange(t + 1).expand(2, -1)
            logits, out = heads.step(fused[:, :t + 1], feats.next_ids[:, :t + 1], cache, pos)
            logits, out = logits[:, -1:], out[:, -1:]
            for i in range(1, model.n_future):
                torch.testing.assert_close(heads.target_log_probs(logits)[:, 0], together[i - 1][:, t])
                token = heads.to_target(logits.argmax(-1))  # [B, 1]
                logits, out = heads.step(out, token, cache, torch.full((2, 1), t + i))
            assert cache.length == t + model.n_future  # the prefix, then one slot per later step


def test_left_padded_rows_equal_rows_alone(tiny_backbone):
    model = _model(tiny_backbone)
    ids = random_ids(tiny_backbone, batch=2, length=10, seed=6)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    together = model.head_logits(ids, mask, last_only=False)
    alone = model.head_logits(ids[:1, 3:], last_only=False)
    for a, b in zip(together[1:], alone[1:]):
        torch.testing.assert_close(a[:1, 3:], b)


def test_draft_vocabulary_maps(tiny_backbone):
    size = 40
    model = _model(tiny_backbone, draft_vocab_size=size)
    heads = model.heads
    chosen = torch.arange(1, 2 * size, 2).flip(0)  # odd ids, any order
    heads.set_draft_vocab(chosen)
    ids = chosen.sort().values
    assert torch.equal(heads.to_target(torch.arange(size)), ids)  # draft ids ascend with target ids
    assert heads.d2t.dtype == torch.long and torch.equal(heads.d2t, ids - torch.arange(size))
    assert heads.t2d.shape == (tiny_backbone.vocab_size,) and torch.equal(heads.t2d.nonzero().squeeze(-1), ids)
    torch.testing.assert_close(heads.draft_head.weight, tiny_backbone.unembedding.weight[ids])
    lp = model.head_logits(random_ids(tiny_backbone), last_only=False)[1]
    assert torch.isinf(lp[..., ~heads.t2d]).all() and torch.isfinite(lp[..., heads.t2d]).all()
    with pytest.raises(UsageError, match="distinct ids"):
        heads.set_draft_vocab(torch.arange(size - 1))


def test_reduced_vocabulary_round_trips(tiny_backbone, tmp_path):
    model = _model(tiny_backbone, draft_vocab_size=32)
    model.heads.set_draft_vocab(torch.arange(3, 99, 3))
    model.save_heads(tmp_path / "h")
    loaded = MultiTokenModel.from_pretrained(tiny_backbone, tmp_path / "h")
    assert loaded.config == model.config and loaded.config.draft_vocab_size == 32
    for k, v in model.heads.state_dict().items():
        assert torch.equal(loaded.heads.state_dict()[k], v), k
    ids = random_ids(tiny_backbone)
    for a, b in zip(model.head_logits(ids, last_only=False), loaded.head_logits(ids, last_only=False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("targets", ["distill", "argmax"])
def test_training_learns_the_bases_next_tokens(tiny_llama_dir, targets):
    """A few AdamW steps on one batch of a tiny Llama: every draft step's loss falls, and each
    step's top-1 agreement with the base's own argmax there ends far above chance (1 / 512)."""
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone

    backbone = load_backbone(BackboneConfig(base=str(tiny_llama_dir)))
    torch.manual_seed(0)
    model = MultiTokenModel.attach(backbone, small_config("eagle3", n_future=3, targets=targets))
    ids = random_ids(backbone, batch=4, length=24, seed=7)
    opt = torch.optim.AdamW(model.head_parameters(), lr=3e-3)
    model.train()
    first = model.compute_loss(ids, skip_constant=True)
    for _ in range(40):
        out = model.compute_loss(ids, skip_constant=True)
        assert out.per_head[0] is None  # the frozen base is not scored under autograd
        opt.zero_grad()
        out.total.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        last = model.compute_loss(ids)
    for h in (2, 3):
        assert last.metrics[f"head{h}/loss"] < 0.7 * first.metrics[f"head{h}/loss"]
        assert last.metrics[f"head{h}/top1"] > max(0.2, first.metrics[f"head{h}/top1"] + 0.1)


def test_a_draft_step_has_no_hidden_state_for_the_base_unembedding(tiny_backbone):
    """A draft step is scored by the drafter's own lm_head: ``hidden`` says so in one line
    (decoding drafts through ``step``: tests/decoding/test_eagle3.py)."""
    model = _model(tiny_backbone, n_future=3)
    with pytest.raises(UsageError, match="own draft_head"):
        model.heads.hidden(1, model.features(random_ids(tiny_backbone)))


def test_uncounted_distillation_targets_skip_the_whole_vocabulary(tiny_backbone):
    """Distillation targets with hits not counted: no argmax, the unembedding's draft rows alone
    (its whole-vocabulary forward never runs), and the same log-distribution over the draft
    vocabulary, bit for bit, as when the argmax is taken; argmax targets always take it."""
    from multitoken.adapters.unembed import hits_counted

    model = _model(tiny_backbone, draft_vocab_size=40)
    model.heads.set_draft_vocab(torch.arange(2, 82, 2))
    ids = random_ids(tiny_backbone, seed=3)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[0, :2] = False
    base = tiny_backbone.final_norm(tiny_backbone.run_trunk(ids).hidden)  # [B, T, H]
    calls = []
    hook = tiny_backbone.unembedding.register_forward_hook(lambda *_: calls.append(1))
    try:
        runs = {}
        for on in (True, False):
            with hits_counted(on):
                runs[on] = model.heads._base_targets(base, valid, chunk=5)
            runs[on] = (*runs[on], len(calls))
            calls.clear()
        model.heads.config.targets = "argmax"
        with hits_counted(False):
            argmax = model.heads._base_targets(base, valid, chunk=5)
    finally:
        hook.remove()
    (where1, best1, logq1, n1), (where0, best0, logq0, n0) = runs[True], runs[False]
    assert n1 > 0 and n0 == 0 and best0 is None and torch.equal(where0, where1) and torch.equal(logq0, logq1)
    full = tiny_backbone.logits(base[valid])
    assert torch.equal(best1, full.argmax(-1)) and torch.equal(argmax[1], best1)
    torch.testing.assert_close(logq1, torch.log_softmax(full[:, model.heads.to_target(torch.arange(40))], -1))
