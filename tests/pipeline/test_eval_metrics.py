"""Metric primitives against hand-computed values on tiny hand-made distributions."""

import math

import pytest
import torch

from .eval_reference import target_logprobs, topk_hits

from multitoken.pipeline.eval import metrics as M


def _logp(rows):
    return torch.tensor(rows, dtype=torch.float64).log()[None]  # [1, T, V]


def test_target_logprobs_and_topk():
    # V = 3, T = 3; position t predicts token t + offset.
    logp = _logp([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    ids = torch.tensor([[0, 1, 2]])
    lp1 = target_logprobs(logp, ids, 1)  # p_0(x_1 = 1) = 0.3, p_1(x_2 = 2) = 0.3
    assert torch.allclose(lp1.exp(), torch.tensor([[0.3, 0.3]], dtype=torch.float64))
    lp2 = target_logprobs(logp, ids, 2)  # p_0(x_2 = 2) = 0.2
    assert torch.allclose(lp2.exp(), torch.tensor([[0.2]], dtype=torch.float64))
    hits = topk_hits(logp, ids, 1, ks=(1, 2))
    assert hits[1].tolist() == [[False, False]] and hits[2].tolist() == [[True, True]]
    assert M.perplexity(-float(lp1.sum()), 2) == pytest.approx(1 / 0.3)


def test_nucleus_cap_and_padding():
    probs = torch.tensor([[0.6, 0.3, 0.05, 0.05], [0.97, 0.01, 0.01, 0.01]])
    ids, p, size = M.nucleus(probs, top_p=0.9)
    # row 0 needs 0.6 + 0.3 = 0.9 (mass before the 3rd entry is 0.9, not < 0.9): 2 tokens
    assert size.tolist() == [2, 1]
    assert ids[0].tolist() == [0, 1] and p[1].tolist() == pytest.approx([0.97, 0.0])
    _, _, capped = M.nucleus(probs, top_p=0.999, max_size=3)
    assert capped.tolist() == [3, 3]


def test_kl_and_accept_length():
    p = torch.tensor([0.5, 0.5]).log()
    q = torch.tensor([0.25, 0.75]).log()
    assert float(M.kl_divergence(p, q)) == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3))
    assert M.expected_accept_length([0.5, 0.4]) == pytest.approx(1 + 0.5 + 0.2)
    assert M.expected_accept_length([]) == 1.0


def test_text_metrics_and_ci():
    toks = [1, 2, 1, 2, 1, 2]
    assert M.distinct_n(toks, 2) == pytest.approx(2 / 5)  # (1,2),(2,1) among 5 bigrams
    assert M.distinct_n(toks, 3) == pytest.approx(2 / 4)
    assert M.repetition_rate(toks, 4) == pytest.approx(1 - 2 / 3)
    assert M.repetition_rate([1, 2], 4) == 0.0
    ci = M.mean_ci([1.0, 2.0, 3.0])
    # t_{0.975, 2} = 4.302653; sd = 1; half width = 4.302653 / sqrt(3)
    assert ci["mean"] == 2.0 and ci["hi"] - 2.0 == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5)
