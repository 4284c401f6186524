"""The compiled multi-row GEMV (kernels/gemv_rows.py, ``--cpu-linear rows``): values
against F.linear within fp32 rounding, rows bit-identical whatever the row count and threads,
the exact round trip of its blocks, the mode switches, its build cache, the fallback without a
compiler, and greedy decoding on it equal to transformers' stock output."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multitoken.base.errors import UsageError
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.kernels import cpu_features, cpu_linear, gemv_rows
from multitoken.pipeline.runtime import unembed_costs
from multitoken.kernels.cpu_linear import ONEDNN, ROWS, PackedLinear

from .conftest import needs_kernels
from .test_cpu_linear import BF16, _bound, _layers, _model

pytestmark = needs_kernels()


def _rows(seq: nn.Sequential) -> PackedLinear:
    assert cpu_linear.pack(seq, ROWS) == 1 and seq[0].layout == ROWS
    return seq[0]


@pytest.mark.parametrize("shape", [(96, 64), (40, 200), (2048, 64)])  # 96 and 40: a partial last block
@pytest.mark.parametrize("bias", [True, False])
def test_rows_equal_f_linear_within_rounding(shape, bias):
    seq = _layers(*shape, torch.float32, bias)
    w, b = seq[0].weight.clone(), None if seq[0].bias is None else seq[0].bias.clone()
    layer = _rows(seq)
    for rows in (1, 3, 16, gemv_rows.MAX_ROWS, gemv_rows.MAX_ROWS + 6):  # the last: a prompt's batched matmul
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
        got, ref = layer(x), F.linear(x, w, b)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert bool(((got - ref).abs() <= _bound(x, w, b)).all()), rows
    assert torch.equal(layer.weight, w) and torch.equal(gemv_rows.dense_weight(layer.packed, shape[0]), w)
    assert layer.packed.shape == (-(-shape[0] // gemv_rows.lanes()), shape[1], gemv_rows.lanes())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_is_bit_identical_whatever_the_rows_and_threads(threads):
    """Each output is one chain of fused multiply-adds in input order: alone, in any of 1..64
    rows (2-D or 3-D input), on one thread or two, the same bits."""
    layer = _rows(_layers(200, 96, torch.float32))  # 7 blocks: uneven shares on two threads
    x = torch.randn(gemv_rows.MAX_ROWS, 96, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])  # [64, N] on this process's threads
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 3, 7, 8, 9, 16, 33, 64):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows
            assert torch.equal(layer(x[None, :rows]), alone[None, :rows]), rows
    finally:
        torch.set_num_threads(before)


def test_modes_switch_layouts_and_bf16_stays_onednn():
    """float32 takes the kernel's layout under ``rows``; bf16 keeps oneDNN's where oneDNN runs
    bf16 (the probe's answer), else stays stock (F.linear)."""
    seq = nn.Sequential(_layers(96, 64, torch.float32)[0], _layers(96, 64, torch.bfloat16, seed=1)[0])
    w = seq[0].weight.clone()
    bf16 = ONEDNN if BF16 else None
    assert cpu_linear.prepare(seq, ROWS) == 1 + BF16
    assert [cpu_linear.format_of(m) for m in seq] == ["f32", bf16]  # the kernel is float32 only
    assert cpu_linear.prepare(seq, cpu_linear.PACKED) == 1 + BF16 and [cpu_linear.format_of(m) for m in seq] == [ONEDNN, bf16]
    assert cpu_linear.prepare(seq, ROWS) == 1 + BF16 and seq[0].layout == ROWS and torch.equal(seq[0].weight, w)
    copied = copy.deepcopy(seq)
    x = torch.randn(5, 64)
    assert copied[0].layout == ROWS and torch.equal(copied[0](x), seq[0](x))
    assert cpu_linear.prepare(seq, cpu_linear.STOCK) == 0 and type(seq[0]) is nn.Linear and torch.equal(seq[0].weight, w)


def test_gradients_go_through_f_linear():
    seq = _layers(96, 64, torch.float32)
    w, b = seq[0].weight.clone(), seq[0].bias.clone()
    layer = _rows(seq)
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).sum().backward()
    assert torch.allclose(x.grad, w.sum(0).expand(3, -1), atol=1e-5)  # through F.linear on the dense weight
    assert torch.equal(layer.bias, b) and bool(((layer(x.detach()) - F.linear(x.detach(), w, b)).abs() <= _bound(x.detach(), w, b)).all())


def test_without_a_compiler_rows_falls_back_to_onednn_once_said(monkeypatch, capsys):
    """Outside CI (``MULTITOKEN_REQUIRE_KERNELS`` unset) a machine without a compiler decodes on oneDNN."""
    monkeypatch.delenv(gemv_rows.REQUIRE, raising=False)
    monkeypatch.setattr(gemv_rows, "_STATE", {"loaded": False, "lib": None, "why": None})
    monkeypatch.setitem(cpu_linear._STATE, "usable", {})
    monkeypatch.setattr(gemv_rows, "_compiler", lambda: None)
    seq = _layers(96, 64, torch.float32)
    assert cpu_linear.pack(seq, ROWS) == 1 and seq[0].layout == ONEDNN
    assert cpu_linear.pack(_layers(96, 64, torch.float32), ROWS) == 1
    err = capsys.readouterr().err
    assert err.count("rows kernel is unavailable") == 1 and "no C++ compiler found" in err


@pytest.mark.heavy  # two more compiles (native, avx2) into a fresh cache
def test_the_build_is_cached_per_machine_and_reused(tmp_path):
    """The first process compiles into $MULTITOKEN_CACHE/kernels/KEY/, the next loads that file;
    a build forced by ``MULTITOKEN_CPU_FEATURES`` goes to another key (the native one is kept)."""
    code = ("from multitoken.kernels import gemv_rows as r; import sys; "
            "sys.exit(0 if r.library() is not None else 1)")
    env = {**os.environ, "MULTITOKEN_CACHE": str(tmp_path), cpu_features.ENV: "native"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    built = list((tmp_path / "kernels").glob("*/multitoken_*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    assert built[0].stat().st_mtime_ns == stamp and len(list((tmp_path / "kernels").rglob("*"))) == 3  # dir, .so, .sha256: no temp left
    subprocess.run([sys.executable, "-c", code], env={**env, cpu_features.ENV: "avx2"}, check=True, timeout=300)
    assert len(list((tmp_path / "kernels").glob("*/multitoken_*.so"))) == 2  # a forced build has a key of its own


ISA_CHECK = """
import sys, torch
from multitoken.kernels import cpu_features, gemv_rows as rk
features = cpu_features.features()
assert features.level == sys.argv[1], features
assert rk.library() is not None, rk._STATE["why"]
assert rk.lanes() == features.lanes() and bool(rk.library().prefilter_built()) == features.vnni, features
gen = torch.Generator().manual_seed(0)
w = torch.randn(1000, 96, generator=gen) * 0.1
w[9] = w[2]
blocked = rk.block_weight(w)
screen = rk.screen_weight(blocked)
for m in (1, 3, 4, 5, 13, 64):
    x = torch.randn(m, 96, generator=gen)
    x[:, 1] *= 40
    logits = rk.linear(x, blocked, 1000, None)
    assert bool(((logits - x @ w.T).abs() <= 97 * 2.0 ** -23 * (x.abs() @ w.abs().T)).all()), m
    assert torch.equal(rk.argmax(x, blocked, screen, 1000)[0], logits.argmax(-1)), m
    approx = rk.screened(x, screen, 1000)
    assert bool(((approx - logits).abs() <= x.abs().sum(1, keepdim=True) * screen["err"][:1000]).all()), m
from multitoken.kernels import gguf_codes
assert gguf_codes.probe()  # Q4_1 / Q8_0 codes: the float blocks' logits bit for bit
d = (torch.rand(40, 2, 1, generator=gen) / 64).half().float()
q = torch.randint(-127, 128, (40, 2, 32), generator=gen).float()
q[..., 0] = 127  # each block's largest code: d is found from it
found = gguf_codes.find_codes((q * d).reshape(40, 64))
packed = gguf_codes.pack(*found)
assert gguf_codes.q8_argmax(torch.randn(3, 64), packed, 40, gguf_codes.l1_norms(packed, 40)) is None  # no VNNI: declines
for d in (64, 8):  # the batch's one-token attention on bf16 caches: the exact softmax within one bf16 rounding
    q, k, v = (torch.randn(3, heads, slots, d, generator=gen).bfloat16() for heads, slots in ((6, 1), (2, 21), (2, 21)))
    got = rk.library().decode_attention(q, k, v, None, 0.3).double()
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.3, enable_gqa=True).transpose(1, 2)
    assert bool(((got - exact).abs() <= 2.0 ** -8 * exact.abs() + 2.0 ** -16 * float(v.abs().max())).all()), d
logits = torch.randn(5, 1001, generator=gen).bfloat16()
logits[1, 500:] = float("nan")
logits[2] = logits[2].round()
for x in (logits, logits.float()):  # each row's first maximum: max's indices
    assert torch.equal(rk.library().rows_max_index(x), x.max(-1).indices)
torch.save(int8_activations(), sys.argv[2])  # Q4_1 and Q8_0 codes against int8 rows: the parent compares them with its build's
print(" ".join(rk._flags()), rk.lanes())
"""
INT8_ACTIVATIONS = """
def int8_activations():
    import torch
    from multitoken.kernels.format_table import FORMATS
    gen = torch.Generator().manual_seed(5)
    d = (torch.rand(70, 4, 1, generator=gen) / 64).half().float()
    m = -(torch.rand(70, 4, 1, generator=gen) / 8).half().float()
    q4 = torch.randint(0, 16, (70, 4, 32), generator=gen).float()
    q4[..., :2] = torch.tensor([0.0, 15.0])
    q8 = torch.randint(-127, 128, (70, 4, 32), generator=gen).float()
    q8[..., 0] = 127.0
    out = []
    for name, w in (("q4_1_q8", q4 * d + m), ("q8_0_q8", q8 * d)):
        spec = FORMATS[name]
        packed = spec.pack(w.reshape(70, 128))
        out += [spec.linear(torch.randn(rows, 128, generator=gen), packed, 70, None) for rows in (1, 5, 13)]
    return out
"""


@pytest.mark.heavy  # one compile per instruction set
@pytest.mark.parametrize("level, flags", [("avx512", "-mno-avx512vnni"), ("avx2", "-mno-avx512f"), ("plain", "-mno-avx2")])
def test_the_kernel_built_for_smaller_cpus_agrees(tmp_path, level, flags):
    """The builds ``MULTITOKEN_CPU_FEATURES`` asks for (AVX512 without VNNI, AVX2, plain loops),
    built here with those instruction sets turned off, each into a cache entry of its own: the
    probe says what the build has (lanes, no screen), logits within fp32 rounding, the screen's
    argmax the exact one, grid codes decoded to the float blocks' logits, the bf16 decoding
    attention within one bf16 rounding of the exact one, each row's first maximum max's."""
    env = {**os.environ, "MULTITOKEN_CACHE": str(tmp_path), cpu_features.ENV: level}
    code, saved = INT8_ACTIVATIONS + ISA_CHECK, tmp_path / "int8.pt"
    done = subprocess.run([sys.executable, "-c", code, level, str(saved)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert flags in done.stdout.split()
    wide = level == "avx512" and "avx512f" in cpu_features.cpu_flags().split()
    assert done.stdout.split()[-1] == ("32" if wide else "16")  # 16 lanes without AVX512
    # int8 rows: exact integers on every build, so the same bits wherever the fold's multiply-adds
    # fuse (AVX2, AVX512: FMA); the plain build rounds their products apart, a few ulps off
    namespace: dict = {}
    exec(INT8_ACTIVATIONS, namespace)
    for theirs, ours in zip(torch.load(saved, weights_only=True), namespace["int8_activations"]()):
        if level == "plain":
            assert torch.allclose(theirs, ours, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(theirs, ours)


def assert_greedy_equals_stock(model) -> None:
    """Greedy ``ar``, chain and dynamic tree give transformers' stock greedy text (20 tokens)."""
    bb = model.backbone
    ids = bb.tokenizer("Once upon a time", return_tensors="pt").input_ids
    ref = bb.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                            pad_token_id=bb.tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
    for extra in (dict(mode="ar"), dict(mode="speculative"), dict(mode="speculative", tree="dynamic", tree_nodes="6")):
        assert generate(model, ids, DecodeConfig(greedy=True, max_new_tokens=20, **extra)).token_ids == ref, extra


def test_greedy_on_the_rows_kernel_equals_transformers_stock(tied_llama_dir):
    """Every linear on the kernel (a tied unembedding keeps its dense embedding): greedy ``ar``,
    chains and trees give transformers' stock greedy text."""
    model = _model(tied_llama_dir, cpu_linear=ROWS)
    bb = model.backbone
    assert_greedy_equals_stock(model)
    layouts = {m.layout for m in model.modules() if isinstance(m, PackedLinear)}
    assert layouts == {ROWS} and bb.unembedding.shared
    assert "screen" in bb.unembedding.scratch  # greedy read the argmax screen, not the logits


# The argmax screen (gemv_rows.rows_argmax) ----------------------------------------------------
def _screened(w: torch.Tensor):
    blocked = gemv_rows.block_weight(w)
    return blocked, gemv_rows.screen_weight(blocked)


def _hidden(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows like a final hidden state: one massive feature (SmolLM2's reaches ~44 of a norm of 44)."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, 5] *= 40
    return x


@pytest.mark.parametrize("shape", [(1000, 96), (4133, 64)])  # 4133: a partial last block
def test_screened_logits_stay_within_their_bound(shape):
    """The int8 logits differ from the exact kernel's by at most |x|_1 * err per output, on
    weights of wide range (tiny, zero and large rows)."""
    n, k = shape
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-6, 1, n)[:, None]
    w[3] = 0
    blocked, screen = _screened(w)
    for rows in (1, 3, 12, 13, gemv_rows.MAX_ROWS):  # 12: one full register block; 13: one more row
        x = _hidden(rows, k, rows)
        approx = gemv_rows.screened(x, screen, n)
        exact = gemv_rows.linear(x, blocked, n, None)
        assert bool(((approx - exact).abs() <= x.abs().sum(1, keepdim=True) * screen["err"][:n]).all()), rows
    assert screen["q"].dtype == torch.int8 and screen["q"].shape == blocked.shape


@pytest.mark.parametrize("rows", [1, 2, 3, 9, 12, 16, gemv_rows.MAX_ROWS])
def test_screened_argmax_is_the_exact_kernels(rows):
    """Random weights, and near-ties: outputs that differ from the best by a few ulps in exact
    arithmetic (many outputs computed exactly, decided by the kernel's own rounding) and exact
    duplicates (the first index wins, as torch.argmax's)."""
    k = 96
    gen = torch.Generator().manual_seed(rows)
    plain = torch.randn(3000, k, generator=gen) * 0.1
    near = plain.clone()
    near[100:400] = near[7] * (1 + torch.randn(300, 1, generator=gen) * 1e-7)  # 300 rows within ~1e-7 of row 7
    near[2999] = near[7]  # an exact duplicate, after it
    for w in (plain, near):
        blocked, screen = _screened(w)
        x = _hidden(rows, k, rows)
        x[0] = near[7] * 10  # a row aimed at the near-tied outputs
        got, picked = gemv_rows.argmax(x, blocked, screen, 3000)
        assert torch.equal(got, gemv_rows.linear(x, blocked, 3000, None).argmax(-1))
        assert rows <= picked < rows * 3000
    assert picked > 100  # the near-ties were settled by exact chains, not by the screen


def test_screen_declines_what_it_cannot_settle():
    blocked, screen = _screened(torch.randn(500, 64))
    assert gemv_rows.argmax(torch.randn(gemv_rows.MAX_ROWS + 1, 64), blocked, screen, 500) is None
    bad = torch.randn(2, 64)
    bad[1, 3] = float("nan")
    assert gemv_rows.argmax(bad, blocked, screen, 500) is None


def test_packed_linear_argmax_only_where_it_is_exact():
    """The rows layout without a bias screens (and equals the logits' argmax, 2-D and 3-D); a
    bias or oneDNN's layout answers None (the caller takes the logits)."""
    layer = _rows(_layers(3000, 96, torch.float32, bias=False))
    x = _hidden(6, 96, 0).reshape(2, 3, 96)
    assert "screen" not in layer.scratch
    assert torch.equal(layer.argmax(x), layer(x).argmax(-1)) and layer.scratch["screen"]["q"].dtype == torch.int8
    assert layer.argmax(x[0]).shape == (3,)
    assert _rows(_layers(3000, 96, torch.float32, bias=True)).argmax(x) is None
    seq = _layers(3000, 96, torch.float32, bias=False)
    assert cpu_linear.pack(seq) == 1 and seq[0].argmax(x) is None


def _screen_plan(monkeypatch, screen_s: float) -> None:
    """Every unembedding's plan: the logits 1 s for any row count, the argmax screen ``screen_s``."""
    plan = unembed_costs.UnembedCosts(lambda rows: {r: {unembed_costs.LINEAR: 1.0, unembed_costs.ARGMAX: screen_s} for r in rows})
    monkeypatch.setattr(unembed_costs, "PINNED", plan)


def test_the_plan_screens_where_the_screen_is_cheaper():
    """``screens`` compares the screen with the cheapest logits form; ``form`` and ``cost`` never
    take the screen for a logits form; nothing measured (an accelerator) or no screen: screen."""
    table = {3: {"linear": 2.0, "transposed": 1.5, "argmax": 1.0}, 9: {"linear": 2.0, "argmax": 2.5}, 12: {"linear": 2.0}}
    plan = unembed_costs.UnembedCosts(lambda rows: {r: table[r] for r in rows})
    assert plan.screens(3) and not plan.screens(9) and plan.screens(12)
    assert (plan.form(3), plan.cost(3), plan.form(9), plan.cost(9)) == ("transposed", 1.5, "linear", 2.0)
    assert unembed_costs.UnembedCosts().screens(9)


def test_the_measured_plan_times_a_screen_beside_the_logits():
    """A packed rows-kernel unembedding's plan holds the screen's time per row count (its
    first measurement builds the screen); a plain Linear's has none (it has no screen)."""
    layer = _rows(_layers(3000, 96, torch.float32, bias=False))
    x = _hidden(9, 96, 0)
    plan = unembed_costs.costs_for(layer, x)
    plan.screens(9)
    assert set(plan.table[9]) == {unembed_costs.LINEAR, unembed_costs.ARGMAX} and "screen" in layer.scratch
    plain = unembed_costs.costs_for(nn.Linear(96, 3000, bias=False), x)
    assert plain.screens(9) and unembed_costs.ARGMAX not in plain.table[9]  # nothing to weigh: the caller finds no screen


@pytest.mark.parametrize("kernel, screen_s", [(ROWS, 0.5), (ROWS, 2.0), (cpu_linear.STOCK, 0.5)])
def test_a_steps_base_argmax_is_its_logits_argmax(tied_llama_dir, kernel, screen_s, monkeypatch):
    """``StepOutput.base_argmax`` screens on the rows kernel where its plan finds the screen
    cheaper (no logits made) and takes the logits' argmax elsewhere; the same tokens either way,
    over a prompt's last row and a 5-token step."""
    _screen_plan(monkeypatch, screen_s)
    model = _model(tied_llama_dir, cpu_linear=kernel)
    model.prepare_linears()
    caches = model.new_caches()
    ids = torch.randint(0, model.backbone.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for new, first in ((ids, 11), (ids[:, :5], 0)):
            out = model.step(new, caches, read_from=first)
            best = out.base_argmax()
            assert (out._logits is None) == (kernel == ROWS and screen_s < 1) and best.shape == (1, new.shape[1] - first)
            assert torch.equal(best, out.base_logits().argmax(-1))


def test_greedy_drafts_argmax_is_their_logits_argmax(tied_llama_dir, monkeypatch):
    """The layer heads' argmax at the anchor, screened on the rows kernel, over the whole
    vocabulary and over a draft vocabulary (token ids, the first on ties as the logits give)."""
    from multitoken.pipeline.model.draft_vocab import DraftUnembedding

    _screen_plan(monkeypatch, 0.5)
    model = _model(tied_llama_dir, cpu_linear=ROWS)
    model.prepare_linears()
    bb = model.backbone
    ids = torch.randint(0, bb.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out = model.step(ids, model.new_caches(), read_from=8)
        for i in sorted(out.hiddens):
            got = out.anchor_head_argmax(i, (8,))
            assert out._head_argmax[(8,)] is not None  # screened, no logits made
            assert torch.equal(got, out.anchor_head_logits(i, (8,)).argmax(-1))
        draft = DraftUnembedding(bb.unembedding, torch.arange(0, bb.vocab_size, 3), bb.vocab_size)
        assert cpu_linear.pack(draft, ROWS) == 1
        rows = out.hiddens[sorted(out.hiddens)[0]]  # [1, 9, H]
        assert torch.equal(draft.argmax(rows), draft(rows).argmax(-1))


FAILED_BUILD = """
import sys
from pathlib import Path
from multitoken.kernels import gemv_rows
lib = gemv_rows.cached_library(sys.argv[1])
try:
    gemv_rows._build(sys.argv[1])
except RuntimeError as err:
    print(err)
print(lib.parent.exists())
"""


def test_a_failed_build_leaves_no_kernel_folder(tmp_path):
    """A compiler that fails: one RuntimeError line (the fallback's notice quotes it), and the
    key's folder it made is gone again (in a process of its own: this one holds the ops)."""
    fake = tmp_path / "broken-c++"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'broken 1.0'; exit 0; fi\necho 'boom: no' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "MULTITOKEN_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", FAILED_BUILD, str(fake)], env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines() == ["broken-c++ failed: boom: no", "False"], done.stdout + done.stderr[-2000:]
    assert (tmp_path / "cache" / "kernels").is_dir()


def test_required_kernels_turn_the_fallback_into_an_error(monkeypatch):
    """``MULTITOKEN_REQUIRE_KERNELS=1`` (CI): no compiler is an error naming the fix, not a
    fallback; the tests' skip mark then skips nothing."""
    monkeypatch.setattr(gemv_rows, "_STATE", {"loaded": False, "lib": None, "why": None})
    monkeypatch.setattr(gemv_rows, "_compiler", lambda: None)
    monkeypatch.setenv(gemv_rows.REQUIRE, "1")
    with pytest.raises(UsageError, match="no C\\+\\+ compiler found") as err:
        gemv_rows.library()
    assert gemv_rows.REQUIRE in err.value.fix
    assert not needs_kernels().args[0]  # the skip condition: False


def test_the_skip_mark_compiles_nothing(tmp_path):
    """Collecting the kernel tests builds nothing: the mark asks for a compiler, not a build."""
    code = "from multitoken.kernels import gemv_rows; print(gemv_rows.available())"
    env = {**os.environ, "MULTITOKEN_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == "True" and not (tmp_path / "kernels").exists()


def test_the_build_finds_the_ninja_dependency_without_an_activated_venv(monkeypatch):
    """torch's build runs `ninja` by name: the ninja package's binary is put first on PATH while it
    runs (a venv's bin folder is not on PATH unless activated), and PATH and CXX come back after."""
    import ninja

    monkeypatch.setenv("PATH", "/nowhere")
    monkeypatch.delenv("CXX", raising=False)
    with gemv_rows._cxx("/usr/bin/g++"):
        assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR
        assert (Path(ninja.BIN_DIR) / "ninja").is_file()
        assert os.environ["CXX"] == "/usr/bin/g++"
    assert os.environ["PATH"] == "/nowhere" and "CXX" not in os.environ
