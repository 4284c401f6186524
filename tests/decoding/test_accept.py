"""Acceptance rules on synthetic distributions: Leviathan's rule emits exactly the target
distribution whatever the drafts' q, greedy keeps argmax matches, typical thresholds entropy."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from multitoken.decoding.rules import greedy_accept, speculative_accept, typical_accept
from multitoken.decoding.sampling import Sampler, processed_probs


def test_every_emitted_token_follows_the_target_for_any_draft_distribution():
    """Each emitted position j (among the runs that emit it: drafts 0..j-1 accepted, which their
    own tokens decide) follows the target p[j], the accepted drafts and the resampled token alike."""
    g = torch.Generator().manual_seed(0)
    v, runs = 5, 6000
    p = torch.softmax(torch.randn(3, v, generator=g) * 1.5, -1)  # targets after positions 0..2
    q = torch.softmax(torch.randn(2, v, generator=g) * 1.5, -1)  # the drafts' distributions
    sampler = Sampler(greedy=False, temperature=1.0, top_k=0, seed=1)
    emitted, lengths = [Counter() for _ in range(3)], Counter()
    for _ in range(runs):
        drafts = torch.multinomial(q, 1, generator=sampler.gen).reshape(-1)
        verdict = speculative_accept(drafts, q, p, sampler)
        lengths[verdict.accepted] += 1
        for j, token in enumerate(drafts[:verdict.accepted].tolist() + [verdict.next_token]):
            emitted[j][int(token)] += 1
    assert set(lengths) == {0, 1, 2}
    for j in range(3):
        n = sum(emitted[j].values())
        assert n == sum(c for k, c in lengths.items() if k >= j) and n > 500  # every run emits positions 0..accepted
        expected = p[j].double() / p[j].double().sum() * n
        assert chisquare([emitted[j][i] for i in range(v)], expected.numpy()).pvalue > 1e-3, j


def test_identical_draft_and_target_accepts_everything():
    p = torch.softmax(torch.randn(3, 7), -1)
    sampler = Sampler(greedy=False, temperature=1.0, top_k=0)
    for _ in range(50):
        drafts = torch.multinomial(p[:2], 1, generator=sampler.gen).reshape(-1)
        assert speculative_accept(drafts, p[:2], p, sampler).accepted == 2


def test_greedy_keeps_the_matching_prefix_then_the_argmax():
    p = torch.eye(4)[[2, 0, 3]] * 0.9 + 0.025  # argmax 2, 0, 3
    sampler = Sampler(greedy=True, temperature=1.0, top_k=0)
    assert greedy_accept(torch.tensor([2, 0]), None, p, sampler).host() == (2, 3)
    assert greedy_accept(torch.tensor([2, 1]), None, p, sampler).host() == (1, 0)
    assert greedy_accept(torch.tensor([1, 0]), None, p, sampler).host() == (0, 2)


def test_typical_acceptance_threshold():
    sharp = torch.tensor([0.97, 0.01, 0.01, 0.01])  # low entropy: bound = min(eps, delta e^-H) = eps
    flat = torch.full((4,), 0.25)  # H = log 4: bound = min(0.09, 0.3 / 4) = 0.075
    sampler = Sampler(greedy=True, temperature=1.0, top_k=0)
    p = torch.stack([flat, sharp, sharp])
    # 0.25 > 0.075 accepted; then token 1 has p = 0.01 < 0.09 rejected; next = argmax of row 1
    assert typical_accept(torch.tensor([3, 1]), None, p, sampler).host() == (1, 0)
    assert typical_accept(torch.tensor([3, 0]), None, p, sampler).accepted == 2


@pytest.mark.parametrize("top_k", [0, 2])
def test_processed_probs_temperature_and_top_k(top_k):
    logp = torch.log_softmax(torch.tensor([1.0, 2.0, 0.5, -1.0]), -1)
    got = processed_probs(logp, 0.5, top_k)
    ref = torch.softmax(logp / 0.5, -1)
    if top_k:
        ref = torch.where(torch.isin(torch.arange(4), torch.tensor([0, 1])), ref, 0.0)
        ref = ref / ref.sum()
    torch.testing.assert_close(got, ref)


def test_typical_rule_reads_the_whole_vocabulary_distribution():
    """Medusa's rule: p and H of softmax(logits / T) over the whole vocabulary (``rule_probs``),
    while the token after the kept drafts comes from the (top-k) target."""
    target = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 2)  # top-2: H = log 2, bound = min(0.09, 0.15)
    rule = torch.tensor([[0.05, 0.05, 0.45, 0.45]])  # whole vocabulary: draft 1 has p = 0.05
    sampler = Sampler(greedy=False, temperature=1.0, top_k=2, seed=0)
    assert typical_accept(torch.tensor([1]), None, target, sampler).accepted == 1
    verdict = typical_accept(torch.tensor([1]), None, target, sampler, rule_probs=rule)
    assert verdict.accepted == 0 and verdict.next_token in (0, 1)
