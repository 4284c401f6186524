"""Attention one row at a time (kernels/row_attention.cpp, the ``row_attention`` op; the row ops'
attention on the int8 setting): SDPA's values within float32 rounding, and a row's bits fixed by the
keys it sees, in slot order, whatever the rows beside it, the masked slots between them and threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from multitoken.kernels import gemv_rows

from .conftest import needs_kernels

pytestmark = needs_kernels()
PAST, CAP = 37, 64  # 37 + rows: partial 16-slot groups


def _cache(d: int, kv: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, kv, CAP, d, generator=gen), torch.randn(1, kv, CAP, d, generator=gen),
            torch.randn(9, 9, d, generator=gen))  # keys, values, 9 rows of 9 query heads


@pytest.mark.parametrize("d", [64, 8])  # 64: the 16-slot sums; 8: the lane loops
def test_it_is_sdpa_within_rounding(d):
    k, v, q = _cache(d)
    for rows in (1, 4):
        mask = None if rows == 1 else torch.ones(1, 1, rows, PAST + rows, dtype=torch.bool).tril(PAST)
        got = gemv_rows.library().row_attention(q[:rows].contiguous(), k, v, PAST, mask, 0.3)
        ref = F.scaled_dot_product_attention(q[:rows].transpose(0, 1)[None], k[:, :, :PAST + rows], v[:, :, :PAST + rows],
                                             attn_mask=mask, scale=0.3, enable_gqa=True)
        assert torch.allclose(got, ref.transpose(1, 2).reshape(1, rows, -1), rtol=1e-5, atol=4 * 2.0 ** -23 * float(v.abs().max())), rows  # a few ulps of the values


@pytest.mark.parametrize("d", [64, 8])
def test_a_rows_bits_are_a_one_row_steps_that_sees_the_same_slots(d, monkeypatch):
    """A chain's row t is the one-row step after PAST + t slots; a tree's row is the one-row step
    over its ancestors moved next to the past (what the cache holds once its path is kept); on one
    thread or two."""
    k, v, q = _cache(d)
    op = gemv_rows.library().row_attention
    alone = [op(q[t:t + 1].contiguous(), k, v, PAST + t, None, 0.3) for t in range(9)]
    causal = torch.ones(1, 1, 9, PAST + 9, dtype=torch.bool).tril(PAST)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            chain = op(q.contiguous(), k, v, PAST, causal, 0.3)
            assert torch.equal(chain[0], torch.cat([a[0] for a in alone])), threads
    finally:
        torch.set_num_threads(before)
    # a tree of 4 rows: 0; 1 under 0; 2 under 0; 3 under 1
    tree = torch.ones(1, 1, 4, PAST + 4, dtype=torch.bool)
    tree[..., PAST:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    rows = op(q[:4].contiguous(), k, v, PAST, tree, 0.3)
    for row, path in ((2, [0, 2]), (3, [0, 1, 3])):
        kept_k, kept_v = k.clone(), v.clone()
        kept_k[:, :, PAST:PAST + len(path)] = k[:, :, [PAST + p for p in path]]
        kept_v[:, :, PAST:PAST + len(path)] = v[:, :, [PAST + p for p in path]]
        one = op(q[row:row + 1].contiguous(), kept_k, kept_v, PAST + len(path) - 1, None, 0.3)
        assert torch.equal(rows[0, row], one[0, 0]), row


def test_bad_arguments_are_refused():
    k, v, q = _cache(64)
    op = gemv_rows.library().row_attention
    with pytest.raises(RuntimeError, match="bool mask"):
        op(q[:2].contiguous(), k, v, PAST, None, 0.3)
    with pytest.raises(RuntimeError, match="cache buffers"):
        op(q[:1].contiguous(), k, v, CAP, None, 0.3)
    with pytest.raises(RuntimeError, match="q must be"):
        op(q[:1].double(), k, v, PAST, None, 0.3)
