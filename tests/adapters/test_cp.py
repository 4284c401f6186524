"""CP experts (the CP-heads paper): the loss equals the joint likelihood by brute-force enumeration on a
tiny vocabulary, the conditionals (eqs. 11-13) equal enumerated conditionals, rank 1 equals
independent heads, and the eq. 10 / surrogate balancing losses behave as written."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch

from multitoken.adapters.base import shifted_targets
from multitoken.adapters.registry import make_config
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.model.model import MultiTokenModel

VOCAB = 6


@pytest.fixture(scope="module")
def tiny_vocab_backbone(tmp_path_factory, stories_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_vocab")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories_dir / f, out / f)  # load_backbone needs a tokenizer; ids stay < VOCAB
    return load_backbone(BackboneConfig(base=str(out)))


def _cp(backbone, rank, n=3, std=0.5):
    torch.manual_seed(1)
    model = MultiTokenModel.attach(backbone, make_config("cp", n_future=n, rank=rank, init_std=std))
    with torch.no_grad():  # non-trivial mixture weights, so experts really differ in weight
        model.heads.mixture.weight.normal_(0, 1.0)
    return model


def _joint_table(heads, e):
    """Brute force: A[v1, v2, v3] = sum_a w_a prod_s P_s(v_s | a), every V^3 cell # e [H]."""
    w = heads.log_mixture(e).exp().double()  # [r]
    table = torch.zeros((VOCAB,) * heads.n_future, dtype=torch.float64)
    for a in range(heads.rank):
        probs = [heads.expert_log_probs(s, a, e).exp().double() for s in range(heads.n_future)]
        for cell in itertools.product(range(VOCAB), repeat=heads.n_future):
            table[cell] += w[a] * torch.prod(torch.stack([probs[s][v] for s, v in enumerate(cell)]))
    return table


def test_cp_loss_equals_brute_force_joint_likelihood(tiny_vocab_backbone):
    model = _cp(tiny_vocab_backbone, rank=3)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.compute_loss(ids)
        feats = model.features(ids)
        nll = []
        for b, t in itertools.product(range(2), range(7 - 3)):  # positions with 3 future tokens
            table = _joint_table(model.heads, feats.base[b, t])
            assert table.sum().item() == pytest.approx(1.0, abs=1e-6)  # a probability tensor
            nll.append(-table[tuple(ids[b, t + 1:t + 4].tolist())].log())
    expected = torch.stack(nll).mean()
    assert torch.stack(out.per_head).sum().double().item() == pytest.approx(expected.item(), rel=1e-5)
    assert out.metrics["cp/joint_nll"] == pytest.approx(expected.item(), rel=1e-5)


def test_conditionals_match_enumeration(tiny_vocab_backbone):
    model = _cp(tiny_vocab_backbone, rank=3)
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        e = model.features(ids).base[0, 2]  # [H]
        table = _joint_table(model.heads, e)
        x1, x2 = 4, 1
        p2 = table[x1].sum(-1) / table[x1].sum()  # P(x2 | x1), eq. 12
        p3 = table[x1, x2] / table[x1, x2].sum()  # P(x3 | x1, x2), eq. 13
        got2 = model.heads.conditional_log_probs(e[None], torch.tensor([[x1]]))[0].exp()
        got3 = model.heads.conditional_log_probs(e[None], torch.tensor([[x1, x2]]))[0].exp()
        marginal1 = model.heads.conditional_log_probs(e[None], torch.zeros(1, 0, dtype=torch.long))[0].exp()
    torch.testing.assert_close(got2.double(), p2, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got3.double(), p3, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(marginal1.double(), table.sum((1, 2)), rtol=1e-5, atol=1e-7)  # eq. 11


def test_rank_one_is_independent_heads(tiny_vocab_backbone):
    model = _cp(tiny_vocab_backbone, rank=1)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        out = model.compute_loss(ids)
        e = model.features(ids).base
        keep = shifted_targets(ids, valid, 3) != -100  # the positions the joint loss covers
        for s in range(3):
            tgt = shifted_targets(ids, valid, s + 1)[keep]
            independent = torch.nn.functional.nll_loss(model.heads.expert_log_probs(s, 0, e[keep]), tgt)
            torch.testing.assert_close(out.per_head[s], independent)
            # With one expert the first token tells nothing: conditionals are the marginals.
            cond = model.heads.conditional_log_probs(e[0, :1], ids[:1, 1:1 + s])
            torch.testing.assert_close(cond, model.heads.expert_log_probs(s, 0, e[0, :1]))
    assert out.aux.item() == 0.0 and out.metrics["cp/aux_eq10"] == 0.0


def test_balancing_losses(tiny_vocab_backbone):
    model = _cp(tiny_vocab_backbone, rank=2)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.heads.mixture.weight.zero_()
        model.heads.mixture.bias.copy_(torch.tensor([5.0, -5.0]))  # every token prefers expert 1
    out = model.compute_loss(ids)
    assert out.metrics["cp/aux_eq10"] == pytest.approx(0.5)  # (1 - 1/2)^2 + (0 - 1/2)^2
    assert out.metrics["cp/max_expert_share"] == 1.0
    assert 0 < out.aux.item() < 0.5 and out.aux.requires_grad
    out.aux.backward()
    assert model.heads.mixture.bias.grad[0] > 0  # gradient pushes expert 1's weight down


def test_eval_metrics_report_head_accuracy(tiny_vocab_backbone):
    model = _cp(tiny_vocab_backbone, rank=2).eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model.compute_loss(ids)
        base = tiny_vocab_backbone.model(ids).logits[:, :-3].argmax(-1)  # positions with 3 targets
    for s in (1, 2, 3):
        assert 0.0 <= out.metrics[f"head{s}/top1"] <= out.metrics[f"head{s}/top5"] <= 1.0
    expected = (base == ids[:, 1:-2]).float().mean().item()
    assert out.metrics["head1/top1"] == pytest.approx(expected)  # head 1 is scored as the base model


def test_rank_is_bounded():
    from multitoken.adapters.cp import MAX_RANK
    from multitoken.adapters.registry import make_config
    from multitoken.base.errors import UsageError

    with pytest.raises(UsageError, match=r"rank must be in \[1, 256\], got 1000000"):
        make_config("cp", n_future=3, rank=1_000_000)
    assert make_config("cp", n_future=3, rank=MAX_RANK).rank == MAX_RANK
