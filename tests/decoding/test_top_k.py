"""Sampling's cut (decoding/sampling.py ``top_k_rows``): each row's k largest logits, largest first,
equal values by lower index first, NaNs first: the same values and ids from the kernels' op, from
torch's ops where the kernels are not built, and from a device's stable sort; and the target a
sampler draws from is built on it."""

from __future__ import annotations

import pytest
import torch

from multitoken.decoding import sampling
from multitoken.kernels import gemv_rows


def _rows(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, vocab, generator=gen) * 3
    x[1] = (x[1] * 2).round() / 2  # ties at and across the cut
    x[2] = torch.arange(vocab) % 4  # every value tied many times
    x[3, ::3] = float("-inf")
    x[4] = 0.0
    x[4, ::2] = -0.0  # equal to +0
    x[5, vocab // 3] = float("nan")
    return x.to(dtype)


def _stable(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sort(x, dim=-1, descending=True, stable=True)
    return s.values[..., :k], s.indices[..., :k]


def _same(a, b) -> bool:
    return torch.equal(a[1], b[1]) and torch.equal(a[0].float().nan_to_num(0.0), b[0].float().nan_to_num(0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab,k", [(50, 10), (4096, 50), (49152, 50)])
def test_the_cut_is_a_stable_sorts_first_k_with_kernels_or_without(dtype, vocab, k, monkeypatch):
    x = _rows(vocab, dtype)
    want = _stable(x, k)
    assert _same(sampling.top_k_rows(x, k), want)  # the kernels' op where built (float16: torch's ops)
    monkeypatch.setattr(gemv_rows, "library", lambda: None)
    assert _same(sampling.top_k_rows(x, k), want)  # torch's ops
    assert _same(sampling.top_k_rows(x[:5], k), _stable(x[:5], k))  # no NaN: the topk-and-fill path


def test_a_sampled_target_reads_the_cut():
    x = _rows(4096, torch.bfloat16)[:5]
    ids, probs = sampling.top_probs(x, 0.7, 50)
    assert torch.equal(ids, _stable(x, 50)[1])
    assert torch.allclose(probs, torch.softmax(_stable(x, 50)[0].float() / 0.7, dim=-1))
    samplers = [sampling.Sampler(False, 0.7, 50, seed=s) for s in range(5)]
    alone = [sampling.Sampler(False, 0.7, 50, seed=s) for s in range(5)]
    rows = sampling.sample_rows(samplers, x)  # one cut for all rows, each row's own draw
    assert rows.tolist() == [s.sample(x[r]).item() for r, s in enumerate(alone)]
