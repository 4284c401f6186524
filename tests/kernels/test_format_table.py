"""Every entry of the weight-format table (kernels/format_table.py) against its plain reference:
pack holds exactly the weights of its format and refuses others, the packed weight decodes back
bit for bit, the fast linear lies within float32 rounding of the float64 reference (an inexact
entry: within its int8 grid's error too), the compiled formats give each row the same bits whatever
the row count (and the exact narrow ones the float32 blocks' bits), and the fast argmax is the
logits' argmax."""

from __future__ import annotations

import pytest
import torch

from multitoken.kernels import cpu_linear, formats, gemv_rows
from multitoken.kernels.format_table import CODES, FORMATS

from .conftest import needs_kernels
from .test_gguf_codes import _weight, on_q4, on_q8

N, K = 1000, 96  # 1000: a partial last column block
VALUES = {  # a weight whose values are exactly the format's
    "f32": lambda w: w, "q4_1": on_q4, "q4_1_q8": on_q4, "q8_0": on_q8, "q8_0_q8": on_q8,
    "bf16": lambda w: w.bfloat16().float(), "f16": lambda w: w.half().float(), "onednn": lambda w: w,
}
COMPILED = [name for name, spec in FORMATS.items() if spec.code is not None]  # oneDNN's rows: test_cpu_linear.py
WITH_ARGMAX = [name for name, spec in FORMATS.items() if spec.argmax is not None]  # the others: callers take the logits'


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A float32 chain of K fused multiply-adds (and the bias) vs exact: gamma_K sum |x w| + |b| u."""
    gamma = (K + 2) * 2.0 ** -24 / (1 - (K + 2) * 2.0 ** -24)
    extra = 0 if bias is None else bias.abs().double() * 2.0 ** -23
    return gamma * (x.abs().double() @ w.abs().double().T) + extra


def _grid_error(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An inexact entry's int8 rows (gemv_int8.cpp): each input within half its chunk's step
    max|x| / 127 of its value, so a logit within sum over chunks of that half step times sum |w|."""
    steps = x.abs().reshape(x.shape[0], -1, formats.QK).amax(-1).double() / 127  # [M, K / QK]
    return (steps.repeat_interleave(formats.QK, 1) / 2) @ w.abs().double().T


@pytest.fixture(params=list(FORMATS))
def fmt(request):
    name = request.param
    if FORMATS[name].code is None:
        if not cpu_linear.usable():
            pytest.skip("this torch build has no usable oneDNN packed linear")
    elif not gemv_rows.required() and not gemv_rows.available():
        pytest.skip(needs_kernels().kwargs["reason"])
    return name


def test_the_compiled_formats_are_the_enum():
    """One source of truth: the table's compiled entries are formats.Format, each exactly once."""
    codes = [spec.code for spec in FORMATS.values() if spec.code is not None]
    assert sorted(codes) == sorted(formats.Format) and len(set(codes)) == len(codes)
    assert all(FORMATS[name].code.name.lower() == name for name in (*CODES, "f32"))


def test_pack_holds_its_formats_weights_exactly(fmt):
    spec = FORMATS[fmt]
    w = VALUES[fmt](_weight(N, K, 0))
    packed = spec.pack(w)
    assert packed is not None
    assert torch.equal(_bits(spec.dense(packed, N)), _bits(w))  # the plain reference decode: no arithmetic lost
    if fmt not in ("f32", "onednn"):  # plain float32 values are no narrow format's
        assert spec.pack(_weight(N, K, 1)) is None


@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_within_rounding_of_the_reference(fmt, bias):
    spec = FORMATS[fmt]
    w = VALUES[fmt](_weight(N, K, 0))
    packed = spec.pack(w)
    gen = torch.Generator().manual_seed(2)
    b = torch.randn(N, generator=gen) if bias else None
    for rows in (1, 3, 13, gemv_rows.MAX_ROWS):
        x = torch.randn(rows, K, generator=gen)
        got = spec.linear(x, packed, N, b)
        assert got.shape == (rows, N) and got.dtype == torch.float32
        bound = _bound(x, w, b) if spec.exact else 2 * _bound(x, w, b) + _grid_error(x, w) * (1 + 1e-6)
        assert bool(((got.double() - spec.reference(x, packed, N, b)).abs() <= bound).all()), rows


@pytest.mark.parametrize("fmt", COMPILED, indirect=True)
def test_compiled_rows_do_not_depend_on_the_row_count(fmt):
    """The exactness contract: a row alone, in any batch up to MAX_ROWS, 2-D or 3-D, the same bits;
    an exact narrow format's bits are the float32 blocks' of the same values."""
    spec = FORMATS[fmt]
    w = VALUES[fmt](_weight(N, K, 0))
    packed, blocks = spec.pack(w), FORMATS["f32"].pack(w)
    x = torch.randn(gemv_rows.MAX_ROWS, K, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([spec.linear(x[i:i + 1], packed, N, None) for i in range(len(x))])
    assert torch.equal(_bits(alone), _bits(FORMATS["f32"].linear(x, blocks, N, None))) or not spec.exact
    for rows in (2, 5, 12, 13, 33, gemv_rows.MAX_ROWS):
        assert torch.equal(_bits(spec.linear(x[:rows], packed, N, None)), _bits(alone[:rows])), rows
        assert torch.equal(_bits(spec.linear(x[None, :rows], packed, N, None)[0]), _bits(alone[:rows])), rows


@pytest.fixture
def restore_threads(request):
    """torch's thread count as it was before the test, whatever the test set."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", COMPILED, indirect=True)
def test_threads_give_every_output_the_one_thread_bits(fmt, restore_threads):
    """The kernels split a call's column blocks over torch's (OpenMP) threads, each output's chain
    in one thread: one row or many, two or three threads (uneven shares, a partial last block), the
    one-thread bits; so are the argmax's."""
    spec = FORMATS[fmt]
    packed = spec.pack(VALUES[fmt](_weight(N, K, 0)))
    x = torch.randn(gemv_rows.MAX_ROWS, K, generator=torch.Generator().manual_seed(4))
    x[:, 5] *= 20  # a clear best for the argmax, whose screens' work is threaded too
    outputs = {}
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        scratch = {}
        outputs[threads] = [(spec.linear(x[:rows], packed, N, None), spec.argmax and spec.argmax(x[:rows], packed, N, scratch))
                            for rows in (1, 3, 13, gemv_rows.MAX_ROWS)]
    for threads in (2, 3):
        for (one, one_best), (many, best) in zip(outputs[1], outputs[threads]):
            assert torch.equal(_bits(many), _bits(one)), (threads, len(one))
            assert (best is None and one_best is None) or torch.equal(best, one_best), (threads, len(one))


@pytest.mark.parametrize("fmt", WITH_ARGMAX, indirect=True)
def test_argmax_is_the_logits_argmax(fmt):
    spec = FORMATS[fmt]
    w = VALUES[fmt](_weight(N, K, 0))
    packed, scratch = spec.pack(w), {}
    for rows in (1, 6, 13):
        x = torch.randn(2, rows, K, generator=torch.Generator().manual_seed(rows))
        x[..., 3] *= 20
        got = spec.argmax(x, packed, N, scratch)
        assert got is not None and torch.equal(got, spec.linear(x, packed, N, None).argmax(-1)), rows
    assert spec.argmax(torch.randn(3, K, dtype=torch.float64), packed, N, scratch) is None  # not a float32 row: declines


@pytest.mark.parametrize("fmt", COMPILED, indirect=True)
def test_an_unknown_format_is_refused_before_any_kernel_runs(fmt):
    """The C++ op checks every call's dtype, layout, shapes and format (TORCH_CHECK)."""
    spec = FORMATS[fmt]
    packed = spec.pack(VALUES[fmt](_weight(N, K, 0)))
    ops, x = gemv_rows.library(), torch.randn(2, K)
    with pytest.raises(RuntimeError, match="unknown weight format 99"):
        ops.gemv(x, packed, 99, N, None)
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.gemv(x.double(), packed, spec.code, N, None)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        ops.gemv(torch.randn(K, 2).T, packed, spec.code, N, None)
    with pytest.raises(RuntimeError, match="the packed weight must be"):
        ops.gemv(x, packed, spec.code, N + 64, None)  # another n: another block count
    with pytest.raises(RuntimeError, match="bias"):
        ops.gemv(x, packed, spec.code, N, torch.randn(N - 1))
    if fmt != "f32":  # the same bytes read as another format: its layout does not fit them
        with pytest.raises(RuntimeError, match="the packed weight must be"):
            ops.gemv(x, packed, formats.Format.F32, N, None)
