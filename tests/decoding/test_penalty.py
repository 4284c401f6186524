"""DynaMo's repetition penalty in every mode: its default (1.1 sampling, 1 greedy), greedy argmax
of the penalised logits, and sampled distributions (ar, speculative, dynamic at eps_b = 1) equal
to the hand-computed penalised target on an enumerable vocabulary (chi-square)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.decoding.proposal import Drafts
from multitoken.decoding.sampling import Sampler, sample_rows, top_probs

from .conftest import attach
from .test_exactness import merge_small_cells

PROMPT = [0, 3]  # tokens 0 and 3 are "seen" from the start
SETTINGS = {"temperature": 0.9, "top_k": 3, "repetition_penalty": 3.0}


def test_default_penalty_is_dynamos_when_sampling_and_off_when_greedy():
    assert DecodeConfig().sampling.repetition_penalty is None
    assert DecodeConfig().sampling.penalty == 1.1 and DecodeConfig(greedy=True).sampling.penalty == 1.0
    assert DecodeConfig(greedy=True, repetition_penalty=2.0).sampling.penalty == 2.0
    assert DecodeConfig(repetition_penalty=1.0).resolved().sampling.repetition_penalty == 1.0
    assert DecodeConfig(greedy=True).resolved().sampling.repetition_penalty == 1.0


@pytest.mark.parametrize("greedy,expected", [(False, 1.1), (True, 1.0)])
def test_trace_records_the_penalty_in_force(tiny_backbones, greedy, expected):
    model = attach(tiny_backbones["llama"], "medusa")
    res = generate(model, [1, 5, 9], DecodeConfig(mode="ar", greedy=greedy, max_new_tokens=3))
    assert res.trace.repetition_penalty == expected and res.as_dict()["trace"]["repetition_penalty"] == expected


@pytest.fixture(scope="module")
def stories_model(stories_dir):
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone

    return attach(load_backbone(BackboneConfig(base=str(stories_dir))), "medusa", n_future=1)


@pytest.mark.parametrize("greedy", [False, True])
def test_ar_with_penalty_100_differs_from_penalty_1(stories_model, greedy):
    """The issue's case: ``--mode ar --repetition-penalty 100`` used to give the 1.0 text."""
    ids = stories_model.backbone.tokenizer("Once upon a time", return_tensors="pt").input_ids
    runs = {pen: generate(stories_model, ids, DecodeConfig(mode="ar", greedy=greedy, max_new_tokens=40, repetition_penalty=pen,
                                                           stop_at_eos=False, seed=2)).token_ids for pen in (1.0, 100.0)}
    assert runs[1.0] != runs[100.0]
    # a 100x penalty: the text repeats its own tokens less
    assert len(set(runs[100.0])) > len(set(runs[1.0]))


def test_greedy_with_a_penalty_is_the_argmax_of_penalised_logits(tiny_backbones):
    bb = tiny_backbones["llama"]
    model = attach(bb, "medusa")
    cfg = DecodeConfig(mode="ar", greedy=True, max_new_tokens=12, repetition_penalty=4.0, stop_at_eos=False)
    got = generate(model, [1, 5, 9], cfg).token_ids
    ids = [1, 5, 9]
    for _ in range(12):  # step by step with a full forward: logits - log(4) on every seen token
        with torch.no_grad():
            logits = bb.model(torch.tensor([ids])).logits[0, -1].double()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[ids] = True
        ids.append(int((logits - np.log(4.0) * seen).argmax()))
    assert got == ids[3:]


def test_speculative_and_dynamic_greedy_with_a_penalty_equal_ar(tiny_backbones):
    model = attach(tiny_backbones["llama"], "medusa", n_future=3)
    base = dict(greedy=True, max_new_tokens=20, repetition_penalty=3.0, stop_at_eos=False)
    ar = generate(model, [1, 5, 9], DecodeConfig(mode="ar", **base)).token_ids
    assert generate(model, [1, 5, 9], DecodeConfig(mode="speculative", drafter="independent", **base)).token_ids == ar


def test_ar_sampling_reads_no_full_vocabulary_distribution(tiny_backbones, monkeypatch):
    """ar draws from the top-k of the raw logits: no log-softmax over the vocabulary per step."""
    from multitoken.pipeline.runtime.step_output import StepOutput

    model = attach(tiny_backbones["llama"], "medusa")
    ref = generate(model, [1, 5, 9], DecodeConfig(mode="ar", max_new_tokens=10, seed=4)).token_ids

    def refuse(self):
        raise AssertionError("ar sampling computed the base log-softmax over the vocabulary")

    monkeypatch.setattr(StepOutput, "base_log_probs", refuse)
    assert generate(model, [1, 5, 9], DecodeConfig(mode="ar", max_new_tokens=10, seed=4)).token_ids == ref  # seeded


def test_top_probs_is_k_sized_and_penalises_seen_candidates():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    seen = torch.tensor([True, False, True, False, False])
    ids, probs = top_probs(logits, 0.5, 3, seen, 2.0)
    assert ids.tolist() == [0, 1, 2] and probs.shape == (3,)
    ref = torch.softmax(logits[:3] / 0.5, -1) * torch.tensor([0.5, 1.0, 0.5])
    torch.testing.assert_close(probs, ref / ref.sum())


# -- sampled distributions on a 4-token vocabulary ---------------------------------------------

def hand_target(logits: torch.Tensor, context: list[int], temperature: float, top_k: int, penalty: float) -> np.ndarray:
    """DynaMo's processing written out: softmax(logits / T) over the top-k, the probability of each
    token of ``context`` divided by ``penalty``, renormalised # [V] -> [V]."""
    x = logits.double().numpy()
    keep = np.argsort(-x)[:top_k]
    p = np.zeros_like(x)
    p[keep] = np.exp(x[keep] / temperature - (x[keep] / temperature).max())
    p /= p.sum()
    p[list(set(context))] /= penalty
    return p / p.sum()


def exact_sequences(backbone, prompt: list[int], length: int, **s) -> np.ndarray:
    """p(x1..x_length | prompt) under the penalised target, every sequence # -> [V] * length."""
    v = backbone.vocab_size
    out = np.zeros([v] * length)
    for seq in itertools.product(range(v), repeat=length):
        prob = 1.0
        for i in range(length):
            ctx = prompt + list(seq[:i])
            with torch.no_grad():
                logits = backbone.model(torch.tensor([ctx])).logits[0, -1]
            prob *= hand_target(logits, ctx, s["temperature"], s["top_k"], s["repetition_penalty"])[seq[i]]
        out[seq] = prob
    return out


def sample_counts(model, runs: int, length: int, **kwargs) -> np.ndarray:
    v = model.backbone.vocab_size
    counts = np.zeros([v] * length)
    decode = {k: kwargs.pop(k) for k in list(kwargs) if k in DecodeConfig.settings()}
    for seed in range(runs):
        cfg = DecodeConfig(max_new_tokens=length, seed=seed, stop_at_eos=False, **SETTINGS, **decode)
        counts[tuple(generate(model, PROMPT, cfg, **kwargs).token_ids)] += 1
    return counts


def assert_follows(counts: np.ndarray, exact: np.ndarray) -> None:
    obs, exp = merge_small_cells(torch.tensor(counts.ravel()), torch.tensor(exact.ravel() * counts.sum()))
    assert chisquare(obs, exp).pvalue > 1e-3, (counts, exact * counts.sum())


@pytest.fixture(scope="module")
def exact2(small_vocab_backbone):
    return exact_sequences(small_vocab_backbone, PROMPT, 2, **SETTINGS)


def test_hand_target_differs_from_unpenalised(small_vocab_backbone, exact2):
    """The test is sensitive: without the penalty the pair distribution is far from this one."""
    plain = exact_sequences(small_vocab_backbone, PROMPT, 2, **{**SETTINGS, "repetition_penalty": 1.0})
    assert np.abs(plain - exact2).sum() > 0.2


def test_ar_sampling_follows_the_penalised_target(small_vocab_backbone, exact2):
    model = attach(small_vocab_backbone, "medusa", n_future=2)
    assert_follows(sample_counts(model, 500, 2, mode="ar"), exact2)


def test_dynamic_at_eps_b_one_follows_the_same_target_as_ar(small_vocab_backbone, exact2):
    model = attach(small_vocab_backbone, "medusa", n_future=2)
    counts = sample_counts(model, 500, 2, mode="dynamic", eps_b=1.0)
    assert_follows(counts, exact2)


def repeating(heads, first, g, row, run):
    """Drafts that often repeat ``first`` and each other (token 2 is likely on every row): the
    penalty's context of a verification row must include the drafts before it."""
    q = torch.tensor([0.05, 0.05, 0.85, 0.05]).expand(g, 4).clone()
    q[:, first] += 0.3
    q /= q.sum(-1, keepdim=True)
    return Drafts(torch.multinomial(q, 1, generator=row.sampler.gen).reshape(-1), q)


@pytest.mark.parametrize("drafter", ["heads", "repeating"])
def test_speculative_sampling_follows_the_penalised_target(small_vocab_backbone, drafter):
    model = attach(small_vocab_backbone, "medusa", n_future=3)
    with torch.no_grad():  # heads clearly different from the base: q != p, partial acceptance
        for block in model.heads.blocks:
            block[0].linear.weight.normal_(0, 1.0)
    exact = exact_sequences(small_vocab_backbone, PROMPT, 3, **SETTINGS)
    runs, counts, repeats = 900, np.zeros([4] * 3), 0
    for seed in range(runs):
        cfg = DecodeConfig(mode="speculative", drafter="independent", max_new_tokens=3, n=3, seed=seed, stop_at_eos=False,
                           **SETTINGS)
        res = generate(model, PROMPT, cfg, drafter=repeating if drafter == "repeating" else None)
        counts[tuple(res.token_ids)] += 1
        repeats += res.token_ids[1] == res.token_ids[2]
    assert_follows(counts, exact)
    if drafter == "repeating":
        assert repeats > 30, "the case of a draft repeating an earlier one must occur"


def test_sampler_draft_q_is_the_distribution_drawn_from():
    sampler = Sampler(False, 0.7, 2, seed=0, penalty=2.0)
    logits = torch.tensor([1.0, 0.8, -3.0])
    seen = torch.tensor([True, False, False])
    draws = [sampler.draft(logits, seen) for _ in range(2000)]
    q = draws[0][1]
    p = torch.softmax(logits[:2] / 0.7, -1) * torch.tensor([0.5, 1.0])
    torch.testing.assert_close(q, torch.cat([p / p.sum(), torch.zeros(1)]))
    counts = np.bincount([t for t, _ in draws], minlength=3)
    assert counts[2] == 0 and chisquare(counts[:2], q[:2].numpy() * 2000).pvalue > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k,penalty", [(50, 1.0), (50, 1.3), (0, 1.0), (0, 1.3)])
def test_rows_sampled_at_once_are_each_rows_own_draws(dtype, top_k, penalty):
    """``sample_rows`` over [R, V] draws, token for token and step after step, what each row's own
    sampler draws from its row alone (its generator advanced alike), top-k cut or not, penalised
    or not, in either dtype; rows with other settings are drawn one by one, as alone."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(12, 3000, generator=g) * 3).to(dtype)  # [R, V]
    logits[:, :5] = logits[:, :1]  # ties at the top
    seen = torch.rand(12, 3000, generator=g) < 0.1
    def samplers():
        return [Sampler(False, 0.7, top_k, seed=r, penalty=penalty) for r in range(12)]
    alone, together = samplers(), samplers()
    for _ in range(3):
        one = [s.sample(logits[r], seen[r]) for r, s in enumerate(alone)]
        assert sample_rows(together, logits, seen).tolist() == [int(t) for t in one]
    mixed = samplers()[:11] + [Sampler(False, 1.0, 7, seed=11, penalty=penalty)]
    assert sample_rows(mixed, logits, seen).tolist() == [int(t) for t in (
        [s.sample(logits[r], seen[r]) for r, s in enumerate(samplers()[:11])]
        + [Sampler(False, 1.0, 7, seed=11, penalty=penalty).sample(logits[11], seen[11])])]


def test_typical_mode_passes_its_rule_the_whole_vocabulary_rows(tiny_backbones):
    from multitoken.decoding.rules import typical_rule

    model = attach(tiny_backbones["llama"], "medusa", n_future=3)
    rule, seen = typical_rule(0.09, 0.3), []

    def spy(d, q, p, s, rule_probs=None):
        seen.append((d.numel(), p, rule_probs))
        return rule(d, q, p, s, rule_probs=rule_probs)

    spy.wants_rule_probs = True
    generate(model, [1, 5, 9], DecodeConfig(mode="typical", top_k=5, max_new_tokens=12, stop_at_eos=False), acceptor=spy)
    assert seen
    for g, p, full in seen:
        assert p.shape[0] == g + 1 and full.shape == (g, p.shape[1])
        assert ((p > 0).sum(-1) <= 5).all() and (full > 0).all()  # top-k target vs whole-vocabulary rule
        torch.testing.assert_close(full.sum(-1), torch.ones(g))
