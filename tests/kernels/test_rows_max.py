"""Each row's first maximum (kernels/rows_max.cpp, the ``rows_max_index`` op; greedy decoding's
argmax of the base's logits): ``x.max(-1).indices`` exactly, ties, signed zeros, infinities,
NaNs and partial vectors included, on one thread or two. Each row's k largest (``rows_topk``,
sampling's cut): a stable descending sort's first k, values and indices."""

from __future__ import annotations

import pytest
import torch

from multitoken.kernels import gemv_rows
from multitoken.pipeline.runtime.step_output import _first_max

from .conftest import needs_kernels

pytestmark = needs_kernels()


def _hard_rows(vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows [12, vocab] that tell apart any rule but torch's."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(12, vocab, generator=gen) * 3).to(dtype)
    x[1] = x[1].round()  # many ties for the top
    x[2] = float("-inf")
    x[3, vocab // 2:] = float("nan")  # the first NaN wins
    x[4] = 0.0
    x[5] = x[5, :1].expand(vocab)  # all equal: the first
    x[6, -1] = float("inf")  # the top in the last, partial vector
    if vocab > 2:
        x[4, 1] = -0.0  # equal to +0: the first still
        x[7, 0], x[7, 2] = float("nan"), float("nan")
        x[8, vocab - 2:] = x[8].max() + 1  # a tie across two lanes of the last vector
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 2, 15, 16, 17, 1000, 49152])
def test_each_rows_first_maximum_is_maxs_index(dtype, vocab):
    x = _hard_rows(vocab, dtype)
    op = gemv_rows.library().rows_max_index
    assert torch.equal(op(x), x.max(-1).indices)
    assert torch.equal(op(x.reshape(3, 4, vocab)), x.reshape(3, 4, vocab).max(-1).indices)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(op(x), x.max(-1).indices)
    finally:
        torch.set_num_threads(before)


def test_steps_take_it_where_it_applies_and_max_elsewhere():
    x = _hard_rows(300, torch.bfloat16)
    assert torch.equal(_first_max(x), x.max(-1).indices)
    assert torch.equal(_first_max(x.t().contiguous().t()), x.max(-1).indices)  # not contiguous: max's own
    assert torch.equal(_first_max(x.half()), x.half().max(-1).indices)  # float16: max's own
    assert _first_max(x[:0]).shape == (0,)


def test_bad_arguments_are_refused():
    op = gemv_rows.library().rows_max_index
    with pytest.raises(RuntimeError, match="rows_max_index"):
        op(torch.zeros(3, 4).half())
    with pytest.raises(RuntimeError, match="rows_max_index"):
        op(torch.zeros(3, 0))
    with pytest.raises(RuntimeError, match="rows_max_index"):
        op(torch.zeros(4, 3).t())


def _sorted_first(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sort(x, dim=-1, descending=True, stable=True)  # NaN first; equal values in index order
    return s.values[..., :k], s.indices[..., :k]


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[1], b[1]) and torch.equal(a[0].isnan(), b[0].isnan()) and torch.equal(
        a[0].nan_to_num(0.0), b[0].nan_to_num(0.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab,k", [(1, 1), (17, 3), (100, 100), (1000, 7), (4096, 300), (49152, 50), (49152, 1)])
def test_each_rows_top_k_is_a_stable_sorts_first_k(dtype, vocab, k):
    x = torch.cat([_hard_rows(vocab, dtype), (torch.arange(vocab, dtype=torch.float32) % 5).to(dtype)[None],
                   torch.arange(vocab, dtype=torch.float32).to(dtype)[None]])  # small ties everywhere; ascending
    op = gemv_rows.library().rows_topk
    assert _same(op(x, k), _sorted_first(x, k))
    r = x.reshape(2, 7, vocab)
    assert _same(op(r, k), _sorted_first(r, k))
    fine = ~x.isnan().any(-1)  # where no NaN: topk's very values (its ties' order aside)
    assert torch.equal(op(x[fine], k)[0], torch.topk(x[fine], k).values)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert _same(op(x, k), _sorted_first(x, k))
    finally:
        torch.set_num_threads(before)


def test_top_k_refuses_what_it_cannot_take():
    op = gemv_rows.library().rows_topk
    for bad, k in ((torch.zeros(3, 4).half(), 2), (torch.zeros(3, 4), 0), (torch.zeros(3, 4), 5),
                   (torch.zeros(4, 3).t(), 1), (torch.zeros(3, 0), 1)):
        with pytest.raises(RuntimeError, match="rows_topk"):
            op(bad, k)
    assert op(torch.zeros(0, 9), 2)[1].shape == (0, 2)
