"""A batch's one-token attention on bfloat16 caches (kernels/decode_attention.cpp, the
``decode_attention`` op): the float64 softmax of the same bf16 inputs within one bf16 rounding, a
row's bits fixed by the slots it sees whatever the rows beside it and the threads, masked slots
never read into the sums."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from multitoken.kernels import gemv_rows

from .conftest import needs_kernels

pytestmark = needs_kernels()
B, Q_HEADS, SLOTS, CAP = 5, 6, 37, 48  # 37 slots: a partial block of 16; capacity 48: strided views


def _inputs(d: int, kv: int, seed: int = 0):
    """q [B, heads, 1, d] as the layer's view of [B, 1, heads, d]; k, v the filled views of buffers."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, Q_HEADS, d, generator=gen).bfloat16().transpose(1, 2)
    k = (torch.randn(B, kv, CAP, d, generator=gen) * 2).bfloat16()[:, :, :SLOTS]
    v = torch.randn(B, kv, CAP, d, generator=gen).bfloat16()[:, :, :SLOTS]
    return q, k, v


def _exact(q, k, v, mask, scale):  # [B, 1, heads, d] float64
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=scale,
                                          enable_gqa=True).transpose(1, 2)


def _within_one_rounding(got: torch.Tensor, exact: torch.Tensor, v: torch.Tensor) -> bool:
    """One rounding to bf16 moves a value by at most 2^-8 of it (8 significant bits); the float32
    sums before it by a few ulps of the values (2^-24 each, over at most 64 features or slots),
    bounded here by 2^-16 of the largest value."""
    bound = 2.0 ** -8 * exact.abs() + 2.0 ** -16 * float(v.abs().max())
    return bool(((got.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("d", [64, 48, 8])  # 64: the AVX512 blocks; 48 and 8: the lane loops
@pytest.mark.parametrize("kv", [3, 6])  # two query heads per kv head, and none shared
def test_it_is_the_exact_softmax_within_one_bf16_rounding(d, kv):
    q, k, v = _inputs(d, kv)
    op = gemv_rows.library().decode_attention
    per_row = torch.rand(B, 1, 1, SLOTS, generator=torch.Generator().manual_seed(1)) > 0.4
    per_row[..., 0] = True
    for mask in (None, per_row, per_row[:1]):  # none, a row each, one for every row
        got = op(q, k, v, mask, 0.3)
        assert got.shape == (B, 1, Q_HEADS, d) and got.dtype == torch.bfloat16 and got.is_contiguous()
        assert _within_one_rounding(got, _exact(q, k, v, mask, 0.3), v), mask is None
        assert not _within_one_rounding(got, _exact(q, k, v[:, :, list(range(1, SLOTS)) + [0]], mask, 0.3), v)


@pytest.mark.parametrize("d", [64, 8])
def test_a_rows_bits_are_its_own_whatever_the_rows_beside_it_and_the_threads(d):
    q, k, v = _inputs(d, 3)
    op = gemv_rows.library().decode_attention
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(q, k, v, None, 0.3)
        torch.set_num_threads(2)
        assert torch.equal(op(q, k, v, None, 0.3), one)
    finally:
        torch.set_num_threads(before)
    for b in (0, 3):
        assert torch.equal(op(q[b:b + 1], k[b:b + 1], v[b:b + 1], None, 0.3), one[b:b + 1]), b


def test_masked_slots_are_never_read_and_a_row_that_sees_none_is_nan():
    q, k, v = _inputs(64, 3)
    op = gemv_rows.library().decode_attention
    mask = torch.ones(B, 1, 1, SLOTS, dtype=torch.bool)
    mask[:, ..., 5:9] = False
    mask[4] = False
    got = op(q, k, v, mask, 0.3)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[:, :, 5:9], poisoned_v[:, :, 5:9] = float("nan"), float("inf")
    again = op(q, poisoned_k, poisoned_v, mask, 0.3)
    assert torch.equal(again[:4], got[:4]) and not got[:4].isnan().any()
    assert got[4].isnan().all()


def test_bad_arguments_are_refused():
    q, k, v = _inputs(64, 3)
    op = gemv_rows.library().decode_attention
    with pytest.raises(RuntimeError, match="q must be"):
        op(q.float(), k, v, None, 0.3)
    with pytest.raises(RuntimeError, match="q must be"):
        op(torch.cat([q, q], 2), k, v, None, 0.3)  # two queries a row
    with pytest.raises(RuntimeError, match="keys and values"):
        op(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1), None, 0.3)  # 4 kv heads do not divide 6
    with pytest.raises(RuntimeError, match="keys and values"):
        op(q, k, v.float(), None, 0.3)
    with pytest.raises(RuntimeError, match="the mask"):
        op(q, k, v, torch.ones(B, 1, 1, SLOTS - 1, dtype=torch.bool), 0.3)
    with pytest.raises(RuntimeError, match="the mask"):
        op(q, k, v, torch.zeros(B, 1, 1, SLOTS), 0.3)
