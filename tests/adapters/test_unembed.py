"""The fused frozen-unembedding log-prob: same values and gradients as plain autograd, for
any chunking, and a checkpointed fallback when the unembedding is trainable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multitoken.adapters.unembed import softmax_less_onehot, target_log_probs


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


def _softmax_reference(logits: torch.Tensor, target: torch.Tensor):
    logp = torch.log_softmax(logits.double(), -1)
    less = logp.exp()
    less[torch.arange(len(target)), target] -= 1
    return logp.gather(-1, target[:, None]).squeeze(-1), less


@pytest.mark.parametrize("rows", [1, 3, 4, 9, 100])
def test_the_softmax_in_blocks_is_the_whole_chunks(rows):
    """Any block size gives the softmax of the whole chunk (float64 reference): log p[target] to
    float32's rounding, p - onehot in float32 written over the logits."""
    torch.manual_seed(2)
    logits = torch.randn(9, 5000) * 6  # a spread like trained logits': p from ~1 to underflow
    target = torch.randint(0, 5000, (9,))
    ref_logp, ref_less = _softmax_reference(logits, target)
    work = logits.clone()
    logp, less = softmax_less_onehot(work, target, torch.float32, rows)
    assert less.data_ptr() == work.data_ptr()  # in place: no [C, V] copy
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=1e-5)  # |log p| <~ 60, float32 steps of ~4e-6
    torch.testing.assert_close(less.double(), ref_less, rtol=1e-6, atol=1e-9)


def test_bf16_logits_get_the_float32_softmax_rounded_once_to_bf16():
    """bf16 logits (autocast): the softmax is float32's, and p - onehot is rounded to bf16 once,
    so each value is within half a bf16 step (2^-8 relative) and float32's error of the exact
    one, written over the logits; log p[target] keeps float32's precision."""
    torch.manual_seed(3)
    logits = (torch.randn(7, 5000) * 6).bfloat16()
    target = torch.randint(0, 5000, (7,))
    ref_logp, ref_less = _softmax_reference(logits.float(), target)
    work = logits.clone()
    logp, less = softmax_less_onehot(work, target, torch.bfloat16, 4)
    assert less.dtype == torch.bfloat16 and less.data_ptr() == work.data_ptr()
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(less.double(), ref_less, rtol=2 ** -8 + 1e-6, atol=1e-30)
    _, widened = softmax_less_onehot(logits.clone(), target, torch.float32, 4)  # a float32 weight's gradient
    torch.testing.assert_close(widened.double(), ref_less, rtol=1e-6, atol=1e-9)


def test_an_empty_chunk_gives_empty_results():
    logp, less = softmax_less_onehot(torch.empty(0, 7), torch.empty(0, dtype=torch.long), torch.float32, 4)
    assert logp.shape == (0,) and less.shape == (0, 7)
