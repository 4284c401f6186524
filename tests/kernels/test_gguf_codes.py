"""GGUF codes (kernels/gguf_codes.py): weights on a Q4_1 / Q8_0 grid (a GGUF base, dequantized)
are found, kept as their codes and decoded by the compiled GEMV to logits bit-identical to the
float32 blocks'; anything off the grid keeps the float32 blocks; greedy decoding on a grid model
equals transformers' stock output. (The format table's tests, over every format: test_format_table.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multitoken.kernels import cpu_features, cpu_linear, formats, gemv_rows, gguf_codes
from multitoken.kernels.cpu_linear import ROWS, PackedLinear
from multitoken.kernels.formats import QK
from multitoken.kernels.gguf_codes import BF16, F16, Q4, Q8

from .conftest import build_tied_llama
from .test_cpu_linear import _model
from .test_gemv_rows import assert_greedy_equals_stock

pytestmark = pytest.mark.skipif(not cpu_linear.grids_on(),
                                reason="needs the compiled rows kernel (an x86-64 CPU and a C++ compiler with OpenMP)")


# The int16 prefilter's instructions (argmax_prefilter.cpp), as the capability probe the kernel's build
# follows reports them (MULTITOKEN_CPU_FEATURES=avx2 or avx512 turns them off); else it declines.
VNNI = cpu_features.features().vnni


def test_the_build_has_the_screen_where_the_probe_says():
    """The kernel was compiled for what the probe reports: its lanes and its screen."""
    assert gguf_codes.prefilter_built() == VNNI and gemv_rows.lanes() == cpu_features.features().lanes()


def on_q4(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] quantized to Q4_1 and dequantized as GGUF readers do: d q + m in float32."""
    b = w.float().reshape(w.shape[0], -1, QK)
    m = b.amin(-1, keepdim=True).half().float()
    d = ((b.amax(-1, keepdim=True) - m) / 15).half().float()
    q = torch.round((b - m) / torch.where(d > 0, d, 1.0)).clamp(0, 15) + 0.0
    return (q * d + m).reshape(w.shape)


def on_q8(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] quantized to Q8_0 and dequantized: d q in float32."""
    b = w.float().reshape(w.shape[0], -1, QK)
    d = (b.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.round(b / torch.where(d > 0, d, 1.0)).clamp(-127, 127) + 0.0  # integer codes: no -0.0
    return (q * d).reshape(w.shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[:, 3] *= 30  # outliers: blocks of different ranges
    w[7, :QK] = 0.25  # a constant block (d = 0 on Q4_1)
    return w


GRIDS = [(Q4, on_q4, 5 / 8), (Q8, on_q8, 34 / 32), (BF16, lambda w: w.bfloat16().float(), 2), (F16, lambda w: w.half().float(), 2)]


@pytest.mark.parametrize("kind, grid, size", GRIDS, ids=["q4_1", "q8_0", "bf16", "f16"])
def test_grid_codes_give_the_float_blocks_logits_bit_for_bit(kind, grid, size):
    w = grid(_weight(1000, 96, 0))  # 1000: a partial last column block
    found = gguf_codes.find_codes(w)
    assert found is not None and found[0] == kind
    packed = gguf_codes.pack(*found)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-1000 // gemv_rows.lanes()) * gemv_rows.lanes() * 96 * size
    assert torch.equal(_bits(gguf_codes.dense(packed, kind, 1000)), _bits(w))
    blocked = gemv_rows.block_weight(w)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 12, 13, gemv_rows.MAX_ROWS):
        x = torch.randn(rows, 96, generator=gen)
        got = gguf_codes.linear(x, packed, kind, 1000, None)
        assert torch.equal(_bits(got), _bits(gemv_rows.linear(x, blocked, 1000, None))), rows
    # one row over an even count of column blocks, the last partial (AVX2 Q4 rows: in pairs)
    n = 1000 - gemv_rows.lanes()
    x = torch.randn(1, 96, generator=gen)
    got = gguf_codes.linear(x, gguf_codes.pack(*gguf_codes.find_codes(w[:n])), kind, n, None)
    assert torch.equal(_bits(got), _bits(gemv_rows.linear(x, gemv_rows.block_weight(w[:n]), n, None)))
    bias = torch.randn(1000, generator=gen)
    assert torch.equal(_bits(gguf_codes.linear(x, packed, kind, 1000, bias)), _bits(gemv_rows.linear(x, blocked, 1000, bias)))
    x = torch.randn(2 * gemv_rows.MAX_ROWS + 3, 96, generator=gen)  # a prompt's pass: 64 rows per call
    assert torch.equal(_bits(gguf_codes.linear(x, packed, kind, 1000, None)[-3:]),
                       _bits(gemv_rows.linear(x[-3:], blocked, 1000, None)))


def test_weights_off_every_grid_keep_float_blocks(monkeypatch):
    monkeypatch.setattr(gguf_codes, "CHUNK_ROWS", 64)
    w = _weight(200, 64, 2)
    assert gguf_codes.find_codes(w) is None  # plain float32
    assert gguf_codes.find_codes(on_q4(w)[:, :40].contiguous()) is None  # Q4_1 values, K not a multiple of 32
    near = w.bfloat16().float()
    near[150, 5] = torch.nextafter(near[150, 5], torch.tensor(1.0))  # one float32 value past the first 64 rows
    assert gguf_codes.find_codes(near) is None
    late = on_q4(w)
    late[150, 5] = torch.nextafter(late[150, 5], torch.tensor(1.0))  # one weight off, past the first chunk
    assert gguf_codes.find_codes(late) is None
    mixed = on_q4(w)
    mixed[100:] = on_q8(w[100:])  # Q8_0 past the first chunk: one grid throughout, or none
    assert gguf_codes.find_codes(mixed) is None


def test_a_packed_grid_layer_round_trips_and_answers_argmax():
    layer = nn.Linear(96, 3000, bias=False)
    with torch.no_grad():
        layer.weight.copy_(on_q8(_weight(3000, 96, 4)))
    stock = layer.weight.detach().clone()
    seq = nn.Sequential(layer)
    assert cpu_linear.pack(seq, ROWS) == 1
    packed = seq[0]
    assert packed.format == "q8_0" and packed.packed.dtype == torch.uint8 and "packed (q8_0)" in repr(packed)
    assert torch.equal(_bits(packed.weight), _bits(stock))
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(5))
    assert torch.equal(packed.argmax(x), packed(x).argmax(-1))
    assert ('l1' in packed.scratch) == VNNI  # the int16 prefilter's bound, made on first use, only where it runs
    assert cpu_linear.unpack(seq) == 1 and torch.equal(_bits(seq[0].weight), _bits(stock))


def _near_tied_q8(n: int, k: int, seed: int) -> torch.Tensor:
    """A Q8_0 weight whose outputs 100..399 lie within an ulp-sized step of output 7 (each one
    code moved by one, or a block's d by one float16 step) and whose last output repeats 7."""
    gen = torch.Generator().manual_seed(seed)
    b = _weight(n, k, seed).reshape(n, -1, QK)
    d = (b.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.round(b / d).clamp(-127, 127)
    q[100:400], d[100:400] = q[7], d[7]
    rows = torch.arange(100, 400)
    at = (rows, torch.randint(0, k // QK, (300,), generator=gen), torch.randint(0, QK, (300,), generator=gen))
    q[at] += (torch.randint(0, 2, (300,), generator=gen) * 2 - 1) * (q[at].abs() < 120)  # each block keeps its +-127
    d[rows[::7], 0] = torch.nextafter(d[rows[::7], 0].half(), torch.tensor(1.0, dtype=torch.float16)).float()
    q[n - 1], d[n - 1] = q[7], d[7]
    return (q * d).reshape(n, k) + 0.0


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 13, gemv_rows.MAX_ROWS])
def test_the_int16_screen_gives_the_codes_argmax_exactly(rows):
    """grid_argmax equals the argmax of grid_linear's logits (the first on ties), on random codes
    and on near-ties that only the exact recount can settle; where the build has no AVX512-VNNI
    it declines (None) and callers take the logits' argmax."""
    k, n = 96, 3001  # 3001: a partial last column block
    for seed, w in enumerate((on_q8(_weight(n, k, 9)), _near_tied_q8(n, k, 10))):
        found = gguf_codes.find_codes(w)
        assert found is not None and found[0] == Q8
        packed = gguf_codes.pack(*found)
        l1 = gguf_codes.l1_norms(packed, n)
        assert bool((l1.double() >= w.double().abs().sum(1)).all())  # rounded up
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + seed))
        x[:, 3] *= 20  # a wide range: the int16 grid's step follows the largest entry
        x[0] = w[7] * 10  # aimed at the near-tied outputs
        got = gguf_codes.q8_argmax(x, packed, n, l1)
        if not VNNI:
            assert got is None
            continue
        logits = gguf_codes.linear(x, packed, Q8, n, None)
        assert torch.equal(got, logits.argmax(-1)), seed
        if seed == 1:
            assert int(got[0]) in (7, *range(100, 400), n - 1) and int(got[0]) != n - 1  # a duplicate never beats the first
    bad = x.clone()
    bad[0, 5] = float("nan")
    assert gguf_codes.q8_argmax(bad, packed, n, l1) is None


def test_rows_f32_keeps_float32_blocks_for_measuring_and_prepare_switches_between_them():
    layer = nn.Linear(96, 3000, bias=False)
    with torch.no_grad():
        layer.weight.copy_(on_q4(_weight(3000, 96, 6)))
    seq = nn.Sequential(layer)
    x = torch.randn(3, 96)
    assert cpu_linear.pack(seq, cpu_linear.ROWS_F32) == 1 and seq[0].format == "f32" and seq[0].packed.dtype == torch.float32
    f32 = seq(x)
    assert cpu_linear.prepare(seq, ROWS) == 1 and seq[0].format == "q4_1"  # the same codes found again
    assert torch.equal(seq(x), f32)  # the codes decode to the float32 values: the same logits, bit for bit
    assert cpu_linear.prepare(seq, cpu_linear.ROWS_F32) == 1 and seq[0].format == "f32"


@pytest.fixture(scope="module")
def grid_llama_dir(tmp_path_factory):
    """A tiny tied Llama as a Q4_1 GGUF base loads: every linear on Q4_1, the embedding on Q8_0."""
    @torch.no_grad()
    def on_grids(model):
        for module in model.modules():
            if isinstance(module, nn.Linear) and module is not model.lm_head:
                module.weight.copy_(on_q4(module.weight))
        model.model.embed_tokens.weight.copy_(on_q8(model.model.embed_tokens.weight))

    return build_tied_llama(tmp_path_factory.mktemp("grid_llama"), on_grids)


def test_greedy_on_grid_codes_equals_transformers_stock(grid_llama_dir, monkeypatch):
    """Every linear packed (the tiny layers too) as its grid's codes: greedy ``ar``, chains and
    trees give transformers' stock greedy text on the dequantized float32 model."""
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 0)
    model = _model(grid_llama_dir, cpu_linear=ROWS)
    bb = model.backbone
    assert_greedy_equals_stock(model)
    grids = {m.format for m in bb.model.modules() if isinstance(m, PackedLinear)}
    assert grids == {"q4_1", "q8_0"} and bb.unembedding.format == "q8_0"


def test_an_unknown_format_is_an_error_in_python_and_in_the_kernel():
    """formats.py's enum is the one list: Python refuses a value outside it, and so does the
    compiled op (its TORCH_CHECK), before any memory is read as logits."""
    packed = gguf_codes.pack(*gguf_codes.find_codes(on_q8(_weight(32, 64, 5))))
    x = torch.randn(2, 64)
    unknown = max(formats.Format) + 1
    with pytest.raises(ValueError, match=f"unknown weight format {unknown}"):
        formats.parse(unknown)
    for value in (unknown, -1, unknown + 7):
        with pytest.raises(RuntimeError, match=f"unknown weight format {value}"):
            gemv_rows.library().gemv(x, packed, value, 32, None)
    assert torch.equal(gemv_rows.library().gemv(x, packed, formats.Format.Q8_0, 32, None),
                       gguf_codes.linear(x, packed, Q8, 32, None))  # the enum's value is the kernel's
