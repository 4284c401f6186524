"""Q4_1 and Q8_0 codes read against int8 activations (kernels/gemv_int8.cpp, ``--cpu-linear rows-q8``): the
kernel is its documented arithmetic (the rows' int8 grid exactly, then integer dot products and one
float fold per chunk), its rows do not depend on the row count, zero and non-finite rows, and greedy
decoding on it: speculative chains and trees give its own ``ar`` text token for token."""

from __future__ import annotations

import pytest
import torch

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.kernels import cpu_linear, gguf_codes
from multitoken.kernels.cpu_linear import ROWS_Q8, PackedLinear
from multitoken.kernels.format_table import FORMATS
from multitoken.kernels.formats import QK, Format

from .conftest import needs_kernels
from .test_format_table import _grid_error
from .test_gguf_codes import _weight, on_q4, on_q8

pytestmark = needs_kernels()
N, K = 200, 160  # a partial last column block; 5 chunks
U = 2.0 ** -24  # float32's unit roundoff


def _grid(x: torch.Tensor):
    """The rows' int8 grid as gemv_int8.cpp defines it, in float32 # [M, K] -> q [M, C, QK], d, s [M, C]."""
    b = x.reshape(x.shape[0], -1, QK)
    a = b.abs().amax(-1)  # [M, C]
    inv = torch.where(a > 0, torch.tensor(127.0) / a, torch.tensor(0.0))
    q = torch.round(b * inv[..., None])  # ties to even, as the kernel's nearbyint
    d = a / 127
    return q, d, d * q.sum(-1)


def _fields(packed: torch.Tensor, n: int, kind: Format):
    """The pack's d, m [N, C] (Q8_0: m 0) and codes [N, C, QK] per output."""
    d, m, q = gguf_codes._fields(packed, kind)  # [B, C, L], [B, C, QK, L]
    per_out = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1])[:n]  # noqa: E731
    return per_out(d), per_out(m), q.permute(0, 3, 1, 2).reshape(-1, q.shape[1], QK)[:n]


def _definition(x: torch.Tensor, packed: torch.Tensor, n: int, kind: Format):
    """The fold's exact value (float64) and its rounding bound: per chunk, isum (exact) times the
    float32 product d_w d, plus m_w s (Q4_1); 2 roundings per chunk (4 where products round apart)."""
    q, d, s = _grid(x)
    dw, mw, qw = _fields(packed, n, kind)
    isum = torch.einsum("mci,nci->mnc", q.double(), qw.double())  # [M, N, C], exact integers
    scale = (dw[None] * d[:, None]).double()  # [M, N, C]: the float32 product, as the kernel's
    terms = torch.stack([isum * scale, (mw[None] * s[:, None].double())], -1)  # exact in float64
    steps = 4 * q.shape[1] + 2
    return terms.sum((-1, -2)), steps * U / (1 - steps * U) * terms.abs().sum((-1, -2))


KINDS = {"q4_1_q8": (on_q4, Format.Q4_1, "q4_1"), "q8_0_q8": (on_q8, Format.Q8_0, "q8_0")}


def _packed(fmt: str = "q4_1_q8", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = KINDS[fmt][0](_weight(N, K, seed))
    return w, FORMATS[fmt].pack(w)


@pytest.mark.parametrize("fmt", list(KINDS))
def test_the_kernel_is_its_arithmetic_and_within_the_grids_error(fmt):
    w, packed = _packed(fmt)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(13, K, generator=gen)
    x[:, 7] *= 50  # an outlier: its chunk's grid is coarse
    x[2, QK:2 * QK] = 0.0  # a zero chunk: d = s = 0
    x[3, :4] = torch.tensor([0.5, -0.5, 1.5, 127.0])  # x inv = 0.5, -0.5, 1.5: ties go to even
    got = FORMATS[fmt].linear(x, packed, N, None)
    exact, bound = _definition(x, packed, N, KINDS[fmt][1])
    assert bool(((got.double() - exact).abs() <= bound).all())
    # its error against the exact product: the grid's half step d / 2 per input, over sum |w|
    ref = x.double() @ w.double().T
    assert bool(((got.double() - ref).abs() <= _grid_error(x, w) * (1 + 1e-6) + 2 * bound).all())
    assert not torch.equal(got, FORMATS[KINDS[fmt][2]].linear(x, packed, N, None))  # another kernel than the exact one


@pytest.mark.parametrize("fmt", list(KINDS))
def test_zero_and_non_finite_rows(fmt):
    _, packed = _packed(fmt)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(2))
    x[0] = 0.0
    x[2, 100] = float("inf")
    x[3, 5] = float("nan")
    b = torch.randn(N, generator=torch.Generator().manual_seed(3))
    got = FORMATS[fmt].linear(x, packed, N, b)
    assert torch.equal(got[0], b)  # nothing but the bias
    assert bool(got[1].isfinite().all()) and bool(got[2:].isnan().all())
    assert torch.equal(got[1:2], FORMATS[fmt].linear(x[1:2], packed, N, b))


def _model(base: str):
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
    from multitoken.pipeline.model.model import MultiTokenModel

    bb = load_backbone(BackboneConfig(base=base, cpu_linear=ROWS_Q8))
    torch.manual_seed(0)
    model = MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 3, "init": "copy"})
    model.prepare_linears()
    return model


def test_speculative_greedy_on_int8_activations_is_its_own_ar(tiny_llama_q_dir, tmp_path):
    """The setting is not exact (not transformers' text), but it is one arithmetic per row: greedy
    chains and dynamic trees, whose steps verify several rows, give its one-row ``ar`` tokens."""
    from ..pipeline.test_lean_layers import _on_q4_grid

    model = _model(str(_on_q4_grid(tiny_llama_q_dir, tmp_path)))
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert "q4_1_q8" in {m.format for m in packed} and all(m.mode == ROWS_Q8 for m in packed)
    ids = model.backbone.tokenizer("Once upon a time", return_tensors="pt").input_ids
    ar = generate(model, ids, DecodeConfig(greedy=True, max_new_tokens=24, mode="ar")).token_ids
    for extra in (dict(mode="speculative"), dict(mode="speculative", tree="dynamic", tree_nodes="6")):
        assert generate(model, ids, DecodeConfig(greedy=True, max_new_tokens=24, **extra)).token_ids == ar, extra
    assert cpu_linear.prepare(model, cpu_linear.ROWS, None) and "q4_1_q8" not in {
        m.format for m in model.modules() if isinstance(m, PackedLinear)}  # back to the exact kernel


TREE_ATTEND = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
TREE_OFFSETS = torch.tensor([0, 1, 1, 2])


def _steps(model, ids: torch.Tensor, rows: list[list[int]], **kw) -> list[torch.Tensor]:
    """The base features of the rows of one step over ``ids`` [1, T] after a 9-token prompt, and of
    one-token steps along each path in ``rows`` (lists of positions in ``ids``)."""
    prompt = torch.arange(3, 12)[None]
    with torch.no_grad():
        caches = model.new_caches()
        model.step(prompt, caches)
        step = model.step(ids, caches, **kw).feats.base[0]  # [T, H]
        alone = []
        for path in rows:
            caches = model.new_caches()
            model.step(prompt, caches)
            alone.append(torch.cat([model.step(ids[:, i:i + 1], caches).feats.base[0] for i in path]))
    return [step, *alone]


def test_a_chains_and_a_trees_rows_are_one_token_steps_bits(tiny_llama_q_dir, tmp_path):
    """What makes chains and trees equal ``ar`` here: the row op's per-row attention
    (row_attention.cpp) gives a row of a multi-row step the one-token step's bits (SDPA's would differ
    by an ulp, and an ulp can cross an int8 grid step)."""
    from ..pipeline.test_lean_layers import _on_q4_grid

    model = _model(str(_on_q4_grid(tiny_llama_q_dir, tmp_path)))
    ids = torch.tensor([[40, 41, 42, 43]])
    step, alone = _steps(model, ids[:, :3], [[0, 1, 2]])
    assert torch.equal(step, alone)
    step, *paths = _steps(model, ids, [[0, 1, 3], [0, 2]], attend=TREE_ATTEND, offsets=TREE_OFFSETS)
    assert torch.equal(step[[0, 1, 3]], paths[0]) and torch.equal(step[[0, 2]], paths[1])


def test_the_per_row_attention_is_sdpas_within_rounding(tiny_llama_q_dir, monkeypatch):
    """On exact float32 weights (``rows``), the per-row attention forced in place of SDPA: every
    feature within float32 rounding of SDPA's run."""
    from multitoken.pipeline.model import lean_rows
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
    from multitoken.pipeline.model.model import MultiTokenModel

    def run(attention: int):
        bb = load_backbone(BackboneConfig(base=str(tiny_llama_q_dir), cpu_linear=cpu_linear.ROWS))
        torch.manual_seed(0)
        model = MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 3, "init": "copy"})
        model.prepare_linears()
        out = _steps(model, torch.tensor([[40, 41, 42, 43]]), [[0, 1, 3]], attend=TREE_ATTEND, offsets=TREE_OFFSETS)
        assert set(bb.lean.stack.sizes[::19]) == {attention}  # every layer's row op ran with it
        return out

    sdpa = run(lean_rows.SDPA)
    monkeypatch.setattr(lean_rows, "SDPA", lean_rows.PER_ROW)
    for a, b in zip(sdpa, run(lean_rows.PER_ROW)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
