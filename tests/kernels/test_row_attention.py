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


def test_the_vector_paths_are_the_lane_loops_bit_for_bit():
    """Head sizes the vector paths take (a multiple of the lanes) give, zero-padded from one they
    do not, the lane loops' bits: padding adds exact zeros to each lane and leaves the other
    features' sums alone. Scales up to 40 put scores below exp's -87 cut and near its subnormal
    range; 300 past slots, several vectors of exps per head. (The AVX512 build sums 16 slots'
    lanes at once in another fixed order than its lane loops; `make test-avx2` runs this.)"""
    if gemv_rows.lanes() != 16:
        pytest.skip("checks the 8-lane (AVX2) build's vectors against its loops; this build has 16-lane vectors")
    lanes = 8
    gen = torch.Generator().manual_seed(3)
    op = gemv_rows.library().row_attention
    for d in (lanes - 4, 2 * lanes - 4):  # the lane loops, then the same features padded to the vectors' size
        pad = d + 4
        k, v = (torch.randn(1, 3, 320, d, generator=gen) * 3 for _ in range(2))
        q = torch.randn(4, 9, d, generator=gen)
        wide = [torch.nn.functional.pad(t, (0, 4)).contiguous() for t in (k, v, q)]
        mask = torch.ones(1, 1, 4, 304, dtype=torch.bool).tril(300)
        for scale in (0.3, 5.0, 40.0):
            for rows, m in ((1, None), (4, mask)):
                got = op(q[:rows].contiguous(), k, v, 300, m, scale).reshape(rows, 9, d)
                ref = op(wide[2][:rows].contiguous(), wide[0], wide[1], 300, m, scale).reshape(rows, 9, pad)
                assert torch.equal(got, ref[..., :d]), (d, scale, rows)
