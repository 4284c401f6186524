"""The fused frozen-unembedding log-prob: same values and gradients as plain autograd, for
any chunking, and a checkpointed fallback when the unembedding is trainable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multitoken.adapters.unembed import target_log_probs


def _reference(unembed, h, target):
    logp = torch.log_softmax(unembed(h).float(), -1).gather(-1, target[:, None]).squeeze(-1)
    top = unembed(h).topk(5, -1).indices == target[:, None]
    return logp, torch.tensor([top[:, 0].sum(), top.any(-1).sum()])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_values_and_gradients_match_autograd(bias, chunk):
    torch.manual_seed(0)
    unembed = nn.Linear(8, 40, bias=bias).requires_grad_(False)
    h = torch.randn(23, 8, requires_grad=True)
    target = torch.randint(0, 40, (23,))
    weights = torch.randn(23)  # a per-token upstream gradient, as CP's logsumexp produces
    logp, hits = target_log_probs(unembed, h, target, chunk)
    (logp * weights).sum().backward()
    fused_grad = h.grad.clone()
    h.grad = None
    ref_logp, ref_hits = _reference(unembed, h, target)
    (ref_logp * weights).sum().backward()
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(fused_grad, h.grad)
    assert torch.equal(hits, ref_hits)


def test_trainable_unembedding_gets_gradients():
    torch.manual_seed(1)
    unembed = nn.Linear(8, 40, bias=False)
    h = torch.randn(10, 8, requires_grad=True)
    target = torch.randint(0, 40, (10,))
    logp, _ = target_log_probs(unembed, h, target, 4)
    logp.sum().backward()
    ref = unembed.weight.grad.clone()
    unembed.weight.grad = None
    _reference(unembed, h, target)[0].sum().backward()
    torch.testing.assert_close(ref, unembed.weight.grad)


def test_without_grad_no_graph_is_built():
    unembed = nn.Linear(8, 40).requires_grad_(False)
    h = torch.randn(5, 8, requires_grad=True)
    with torch.no_grad():
        logp, _ = target_log_probs(unembed, h, torch.zeros(5, dtype=torch.long), 2)
    assert not logp.requires_grad
