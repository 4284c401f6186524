"""The host top-k against torch.topk: the same values and ids in the same order wherever torch's
answer is determined by the values, and a refusal (None) where it is not (ties, NaN)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multitoken.decoding import sampling as candidates
from multitoken.decoding.dynamo import exact_topk


def rows(seed: int, m: int, v: int) -> torch.Tensor:
    """Log-distributions leaning to a few tokens, as heads give (plus plain noise rows)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.log1p(torch.rand(v, generator=gen) * 1000)
    return torch.stack([torch.log_softmax(base * (i % 2) + 2.0 * torch.randn(v, generator=gen), -1) for i in range(m)])


@pytest.mark.parametrize("v,k", [(50277, 50), (512, 50), (1000, 7), (204, 50), (103, 1)])
def test_equals_torch_topk(v, k):
    for seed in range(5):
        x = rows(seed, 3, v)
        ref_vals, ref_ids = torch.topk(x, k, dim=-1)
        got = exact_topk(x.numpy(), k, min_vocab=0)
        assert got is not None
        assert np.array_equal(got[0], ref_vals.numpy()) and np.array_equal(got[1], ref_ids.numpy())


def test_refuses_what_torch_decides_by_its_sort():
    x = rows(0, 2, 5000).numpy()  # past MIN_VOCAB
    top = np.argsort(-x[1])
    tie = x.copy()
    tie[1, top[50]] = tie[1, top[49]]  # the k-th and (k+1)-th values equal: which one is torch's pick
    assert exact_topk(tie, 50) is None
    tie = x.copy()
    tie[0, top[3]] = tie[0, np.argsort(-x[0])[0]]  # equal values inside the top k: their order
    assert exact_topk(tie, 50) is None
    for at in (7, 4999):  # inside the blocks and in the tail past them: torch ranks NaN first
        nan = x.copy()
        nan[1, at] = np.nan
        assert exact_topk(nan, 50) is None
    assert exact_topk(x[:, :203], 50, min_vocab=0) is None  # k >= V / 4: blocks too narrow to bound with
    assert exact_topk(x[:, :4095], 50) is None  # torch's own top-k is cheaper on small vocabularies
    assert exact_topk(x, 50) is not None


def test_head_candidates_are_torchs_on_either_path(monkeypatch):
    x = rows(3, 3, 5000)
    x[2, 17] = x[2, int(torch.argmax(x[2]))]  # one row with a tie at the top: torch's path
    assert exact_topk(x[:2].numpy(), 50) is not None and exact_topk(x.numpy(), 50) is None
    fast = candidates.head_candidates(x[:2], 50, 0.7)
    tied = candidates.head_candidates(x, 50, 0.7)
    monkeypatch.setattr(candidates, "exact_topk", lambda *a: None)
    ref = candidates.head_candidates(x, 50, 0.7)
    for got in (fast, tied):
        for c, r in zip(got, ref):
            assert c.ids.dtype == r.ids.dtype and c.probs.dtype == r.probs.dtype
            assert np.array_equal(c.ids, r.ids) and np.array_equal(c.probs, r.probs)
