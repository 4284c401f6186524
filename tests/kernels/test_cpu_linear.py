"""Prepacked CPU linears (kernels/cpu_linear.py): values against F.linear within fp32
(bf16) rounding, rows independent of the row count, the fallback, the option, devices left
alone, memory replaced, and training / LoRA / greedy decoding around them."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.kernels import cpu_features, cpu_linear, format_table, host_memory
from multitoken.pipeline.model.loading import BackboneConfig, LoraSpec, load_backbone
from multitoken.kernels.cpu_linear import PackedLinear
from multitoken.pipeline.model.model import MultiTokenModel


pytestmark = pytest.mark.skipif(not cpu_linear.usable(), reason="this torch build has no usable oneDNN packed linear")
DTYPES = [torch.float32, torch.bfloat16]
BF16 = cpu_features.features().onednn_bf16  # the capability probe the code asks: oneDNN's bf16 linear runs here


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear takes ``dtype`` on this CPU (bf16: else F.linear, said once)."""
    return dtype == torch.float32 or BF16


def _layers(n: int, k: int, dtype: torch.dtype, bias: bool = True, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(k, n, bias=bias)).to(dtype).requires_grad_(False)


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Two summation orders of K products plus a bias differ by at most (K + 1) * eps * the sum
    of the terms' magnitudes, eps of the accumulation (fp32, or bf16 as a loose upper bound
    for kernels accumulating in bf16) # [M, N]."""
    eps = torch.finfo(x.dtype).eps
    mags = x.abs().float() @ w.abs().float().T + (0 if b is None else b.abs().float())
    return (x.shape[-1] + 1) * eps * mags


def _packed(seq: nn.Sequential) -> PackedLinear:
    assert cpu_linear.pack(seq) == 1
    return seq[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(96, 64), (512, 32), (64, 200)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_equals_f_linear_within_rounding(dtype, shape, bias):
    """Where oneDNN runs ``dtype`` the layer is packed; elsewhere (bf16 without AVX512) it stays
    a stock ``nn.Linear``: F.linear's values either way."""
    seq = _layers(*shape, dtype, bias)
    w, b = seq[0].weight.clone(), None if seq[0].bias is None else seq[0].bias.clone()
    assert cpu_linear.pack(seq) == packs(dtype)
    layer = seq[0]
    assert type(layer) is (PackedLinear if packs(dtype) else nn.Linear)
    for rows in (1, 3, 16):
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
        got, ref = layer(x), F.linear(x, w, b)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert bool(((got.float() - ref.float()).abs() <= _bound(x, w, b)).all())
    assert torch.equal(layer.weight, w)  # the plain layout read back exactly


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(96, 64), (2048, 64), (64, 200)])
def test_fp32_rows_do_not_depend_on_the_row_count(shape, threads):
    """A row's fp32 result is bit-identical whether it comes alone or with 1..15 others (2-D or
    3-D input): a verification step computes the very logits a one-token step would."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer = _packed(_layers(*shape, torch.float32))
        x = torch.randn(16, shape[1], generator=torch.Generator().manual_seed(1))
        alone = torch.cat([layer(x[i:i + 1]) for i in range(16)])  # [16, N]
        for rows in range(1, 17):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows
            assert torch.equal(layer(x[None, :rows]), alone[None, :rows]), rows
    finally:
        torch.set_num_threads(before)


def test_bf16_rows_agree_across_row_counts_within_rounding():
    """bf16 rows are not bit-identical across row counts everywhere (CPUs without AVX512-BF16
    block the rows differently), only within the rounding bound; where oneDNN has no bf16
    (no AVX512) the layer stays stock and F.linear's rows are held to the same bound."""
    seq = _layers(2048, 64, torch.bfloat16)
    w, b = seq[0].weight.clone(), seq[0].bias.clone()
    assert cpu_linear.pack(seq) == BF16
    layer = seq[0]
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(16)]).float()
    for rows in range(2, 17):
        assert bool(((layer(x[:rows]).float() - alone[:rows]).abs() <= 2 * _bound(x[:rows], w, b)).all())


def test_bf16_packs_where_onednn_runs_it_else_falls_back_once_said(monkeypatch, capsys):
    """The probe's answer decides: oneDNN's layout where it runs bf16; elsewhere every bf16 layer
    stays stock after one line on stderr naming the missing feature (float32 still packs)."""
    monkeypatch.setitem(cpu_linear._STATE, "usable", {})
    monkeypatch.setitem(cpu_linear._STATE, "warned", False)
    first, second, fp32 = _layers(96, 64, torch.bfloat16), _layers(96, 64, torch.bfloat16, seed=1), _layers(96, 64, torch.float32)
    assert cpu_linear.pack(first) == cpu_linear.pack(second) == BF16 and cpu_linear.pack(fp32) == 1
    assert cpu_linear.usable(torch.bfloat16) == BF16
    err = capsys.readouterr().err
    if BF16:
        assert first[0].layout == cpu_linear.ONEDNN and err == ""
        return
    assert type(first[0]) is nn.Linear and type(second[0]) is nn.Linear and first[0].weight.numel() == 96 * 64
    assert err.splitlines() == [
        "multitoken: the oneDNN packed linear is unavailable in torch.bfloat16 "
        f"({cpu_features.features().lacks('onednn_bf16')}); CPU linears fall back to F.linear"]
    assert "AVX512 (BW, VL, DQ) or AVX-NE-CONVERT" in err


def test_a_failing_op_falls_back_to_f_linear_once_said(monkeypatch, capsys):
    seq = _layers(96, 64, torch.float32)
    w, b = seq[0].weight.clone(), seq[0].bias.clone()
    layer = _packed(seq)
    monkeypatch.setitem(cpu_linear._STATE, "warned", False)

    def broken(*args):
        raise RuntimeError("no kernel")
    monkeypatch.setattr(layer, "spec", dataclasses.replace(layer.spec, linear=broken))
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), F.linear(x, w, b)) and torch.equal(layer(x), F.linear(x, w, b))
    assert capsys.readouterr().err.count("fall back to F.linear") == 1


def test_an_unusable_op_packs_nothing(monkeypatch, capsys):
    monkeypatch.setitem(cpu_linear._STATE, "usable", {})
    monkeypatch.setitem(cpu_linear._STATE, "warned", False)
    onednn = format_table.FORMATS[cpu_linear.ONEDNN]
    missing = dataclasses.replace(onednn, pack=lambda w: (_ for _ in ()).throw(RuntimeError("missing op")))
    monkeypatch.setitem(format_table.FORMATS, cpu_linear.ONEDNN, missing)
    seq = _layers(96, 64, torch.float32)
    assert cpu_linear.pack(seq) == 0 and type(seq[0]) is nn.Linear and seq[0].weight.numel() == 96 * 64
    assert "fall back to F.linear" in capsys.readouterr().err


def test_by_default_only_layers_bigger_than_a_call_are_packed(monkeypatch):
    """oneDNN's per-call overhead outweighs reading a small weight: those stay stock."""
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 100_000)  # the library's default (the suite packs all)
    small, big = _layers(96, 64, torch.float32), _layers(2048, 64, torch.float32)
    assert cpu_linear.pack(small) == 0 and type(small[0]) is nn.Linear
    assert cpu_linear.pack(big) == 1 and type(big[0]) is PackedLinear


def test_meta_and_other_dtypes_are_left_alone():
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(64, 96))
    half = _layers(96, 64, torch.float16)
    assert cpu_linear.pack(meta) == 0 and cpu_linear.pack(half) == 0
    assert type(meta[0]) is nn.Linear and type(half[0]) is nn.Linear


def test_gradients_flow_to_the_input_of_a_frozen_packed_layer():
    seq = _layers(96, 64, torch.float32)
    w, b = seq[0].weight.clone(), seq[0].bias.clone()
    layer = _packed(seq)
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).square().sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    F.linear(x_ref, w, b).square().sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)


def _model(base, **config) -> MultiTokenModel:
    torch.manual_seed(0)
    bb = load_backbone(BackboneConfig(base=str(base), **config))
    return MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 3, "init": "random"}).eval()


def _linears(model) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, PackedLinear))}


def test_decoding_packs_every_linear_and_replaces_the_dense_weights(tiny_llama_dir):
    model = _model(tiny_llama_dir)
    stock = {n: m.weight.detach().clone() for n, m in model.named_modules() if type(m) is nn.Linear}
    params = {id(p) for p in model.parameters()}
    model.new_caches()
    assert PackedLinear not in set(_linears(model).values())  # caches change no linear: the setting is applied apart
    assert model.prepare_linears() == len(stock)
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert model.prepare_linears() == len(stock) and all(model.get_submodule(n) is m for n, m in packed.items())  # kept
    assert set(_linears(model).values()) == {PackedLinear} and len(_linears(model)) == len(stock)
    for name, m in model.named_modules():
        if isinstance(m, PackedLinear):
            assert not m.shared and m.stock.weight.numel() == 0 and torch.equal(m.weight, stock[name])
    assert sum(p.numel() for p in model.parameters()) < sum(w.numel() for w in stock.values())  # dense copies gone
    model.train(True)  # training gets the stock modules back: same Parameter objects, same values
    assert set(_linears(model).values()) == {nn.Linear} and {id(p) for p in model.parameters()} == params
    assert all(torch.equal(m.weight, stock[n]) for n, m in model.named_modules() if type(m) is nn.Linear)


def test_a_tied_unembedding_keeps_the_embedding_dense_and_decodes_as_transformers(tied_llama_dir):
    model = _model(tied_llama_dir)
    bb = model.backbone
    emb = bb.embeddings.weight.detach().clone()
    ids = bb.tokenizer("Once upon a time", return_tensors="pt").input_ids

    def hf():
        return bb.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                 pad_token_id=bb.tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
    ref = hf()  # stock kernels
    got = {mode: generate(model, ids, DecodeConfig(mode=mode, greedy=True, max_new_tokens=20)).token_ids
           for mode in ("ar", "speculative")}
    assert isinstance(bb.unembedding, PackedLinear) and bb.unembedding.shared
    assert torch.equal(bb.embeddings.weight, emb) and bb.embeddings.weight.data_ptr() == bb.unembedding.stock.weight.data_ptr()
    maps = host_memory.file_maps()  # nothing left in a map of the checkpoint file: the packed copies replace it
    assert not any(a <= p.data_ptr() < b for p in model.parameters() for a, b in maps)
    assert got["ar"] == ref and got["speculative"] == ref and hf() == ref  # transformers on the packed kernels too
    copied = copy.deepcopy(model)
    assert generate(copied, ids, DecodeConfig(mode="ar", greedy=True, max_new_tokens=20)).token_ids == ref


def test_the_option_off_keeps_stock_modules(tiny_llama_dir):
    model = _model(tiny_llama_dir, cpu_linear="stock")
    assert model.prepare_linears() == 0 and set(_linears(model).values()) == {nn.Linear}
    model.backbone.load_config.cpu_linear = "packed"
    assert model.prepare_linears() == len(_linears(model))
    model.backbone.load_config.cpu_linear = "stock"
    assert model.prepare_linears() == 0 and set(_linears(model).values()) == {nn.Linear}


def test_lora_layers_stay_stock_and_train_after_decoding(tiny_llama_dir):
    bb = load_backbone(BackboneConfig(base=str(tiny_llama_dir)), lora=LoraSpec(r=2), trainable_lora=True)
    model = MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 2, "init": "random"}).eval()
    generate(model, [1, 5, 9], DecodeConfig(mode="speculative", greedy=True, n=2, max_new_tokens=6))
    kinds = _linears(model)
    assert all(t is nn.Linear for n, t in kinds.items() if "lora_" in n or "base_layer" in n)
    assert any(t is PackedLinear for n, t in kinds.items() if "o_proj" in n)
    model.train(True)
    assert not any(t.is_inference() for t in [*model.parameters(), *model.buffers()])  # packing ran outside inference mode
    out = model.compute_loss(torch.tensor([[1, 5, 9, 4, 7, 3]]))
    sum(h for h in out.per_head if h is not None).backward()
    assert all(p.grad is not None for p in model.lora_parameters() if p.requires_grad)


def test_heads_loaded_onto_a_decoded_backbone_are_built_stock_then_packed(tiny_llama_dir, tmp_path):
    """A backbone a decoding run packed: copy-initialised heads still copy its dense weights, and
    heads loaded from disk get packed by the next decoding run."""
    first = _model(tiny_llama_dir)
    first.prepare_linears()
    final = {n: m.weight.clone() for n, m in first.backbone.layers[-1].named_modules() if isinstance(m, PackedLinear)}
    copied = MultiTokenModel.attach(first.backbone, {"head_type": "replicated", "n_future": 2, "init": "copy"})
    layer = copied.heads.layers[0]
    assert final and all(type(layer.get_submodule(n)) is nn.Linear and torch.equal(layer.get_submodule(n).weight, w)
                         for n, w in final.items())
    medusa = MultiTokenModel.attach(first.backbone, {"head_type": "medusa", "n_future": 3})
    medusa.save_heads(tmp_path / "heads")
    loaded = MultiTokenModel.from_pretrained(first.backbone, tmp_path / "heads").eval()
    assert not any(isinstance(m, PackedLinear) for m in loaded.heads.modules())
    generate(loaded, [1, 5, 9], DecodeConfig(mode="speculative", greedy=True, max_new_tokens=6))
    heads = [m for m in loaded.heads.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert heads and all(isinstance(m, PackedLinear) for m in heads)
    loaded.save_heads(tmp_path / "again")  # from the stock modules: every weight saved
    again = MultiTokenModel.from_pretrained(first.backbone, tmp_path / "again")
    saved = medusa.heads.state_dict()
    assert again.heads.state_dict().keys() == saved.keys()
    assert all(torch.equal(v, saved[k]) for k, v in again.heads.state_dict().items())
