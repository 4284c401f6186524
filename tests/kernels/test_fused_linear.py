"""Fused linears (kernels/fused_linear.py): one call over several packed parts gives each part's
outputs bit for bit, for every compiled format, with and without biases, partial last blocks,
any row count; the parts keep their own weights and outputs; what cannot be fused is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from multitoken.kernels import cpu_linear, gemv_rows
from multitoken.kernels.cpu_linear import PackedLinear
from multitoken.kernels.format_table import FORMATS
from multitoken.kernels.fused_linear import FusedLinear, fusable

from .conftest import needs_kernels
from .test_format_table import COMPILED, VALUES, _bits
from .test_gguf_codes import _weight

pytestmark = needs_kernels()
K = 96
SIZES = (1000, 40, 64)  # partial last blocks (1000, 40) and a whole one, in the middle and at the end


def _part(fmt: str, n: int, seed: int, bias: bool) -> PackedLinear:
    stock = nn.Linear(K, n, bias=bias).requires_grad_(False)
    stock.weight.data = VALUES[fmt](_weight(n, K, seed))
    if bias:
        stock.bias.data = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    spec = FORMATS[fmt]
    return PackedLinear(stock, spec.pack(stock.weight.detach()), False, spec, cpu_linear.ROWS)


@pytest.mark.parametrize("fmt", COMPILED)
@pytest.mark.parametrize("bias", [(False, False, False), (True, False, True)])
def test_fused_outputs_are_each_parts_bits(fmt, bias):
    parts = [_part(fmt, n, seed, b) for seed, (n, b) in enumerate(zip(SIZES, bias))]
    gen = torch.Generator().manual_seed(7)
    inputs = [torch.randn(rows, K, generator=gen) for rows in (1, 3, 13, gemv_rows.MAX_ROWS, gemv_rows.MAX_ROWS + 5)]
    inputs.append(torch.randn(2, 5, K, generator=gen))  # [B, T, K], as a step's hidden states
    alone = [[part(x) for part in parts] for x in inputs]  # before fusing: each part's own weight
    fused = FusedLinear(parts, ("a", "b", "c"))
    assert fused.packed.shape[0] == sum(-(-n // gemv_rows.lanes()) for n in SIZES)
    for x, want in zip(inputs, alone):
        got = fused(x)
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            assert torch.equal(_bits(g), _bits(w)), (fmt, x.shape)
        for part, w in zip(parts, want):  # a part alone still reads its own weight (a view of the fused one)
            assert torch.equal(_bits(part(x)), _bits(w))


@pytest.mark.parametrize("fmt", COMPILED)
def test_parts_share_the_fused_weight_and_unpack_exactly(fmt):
    parts = [_part(fmt, n, seed, False) for seed, n in enumerate(SIZES)]
    weights = [p.dense_weight().clone() for p in parts]
    fused = FusedLinear(parts, ("a", "b", "c"))
    for part, w in zip(parts, weights):
        assert part.packed.untyped_storage().data_ptr() == fused.packed.untyped_storage().data_ptr()
        assert torch.equal(_bits(part.unpacked().weight), _bits(w))
        assert torch.equal(_bits(copy.deepcopy(part).dense_weight()), _bits(w))


def test_what_cannot_be_fused_is_refused():
    q4, q8 = _part("q4_1", 64, 0, False), _part("q8_0", 64, 1, False)
    assert fusable([q4, _part("q4_1", 40, 2, False)])
    assert not fusable([q4])  # one part: nothing to save
    assert not fusable([q4, q8])  # two formats: two kernels
    assert not fusable([q4, nn.Linear(K, 64)])  # a stock layer
    wide = nn.Linear(2 * K, 64).requires_grad_(False)
    wide.weight.data = VALUES["q4_1"](_weight(64, 2 * K, 3))
    spec = FORMATS["q4_1"]
    assert not fusable([q4, PackedLinear(wide, spec.pack(wide.weight.detach()), False, spec, cpu_linear.ROWS)])
    with pytest.raises(ValueError, match="two or more compiled-format"):
        FusedLinear([q4, q8], ("a", "b"))


def test_current_says_when_the_parts_were_swapped():
    parts = [_part("q4_1", n, seed, False) for seed, n in enumerate(SIZES)]
    fused = FusedLinear(parts, ("a", "b", "c"))
    assert fused.current(tuple(parts))
    assert not fused.current((parts[0], parts[1], _part("q4_1", 64, 5, False)))
