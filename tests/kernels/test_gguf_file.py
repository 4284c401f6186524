"""Codes read from a GGUF file (kernels/gguf_file.py): for every weight a GGUF's Q4_1 / Q8_0
tensor dequantizes to (rows in the file's order or permuted, as transformers permutes llama's q / k)
they are the very codes ``find_codes`` recovers from the floats, so the packed tensors are
bit-identical; any other weight gets None, and cpu_linear then searches its floats."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from multitoken.kernels import cpu_linear, gguf_codes, gguf_file
from multitoken.kernels.cpu_linear import ROWS
from multitoken.kernels.formats import QK, Format

gguf = pytest.importorskip("gguf", reason="GGUF files need the [gguf] extra")
pytestmark = pytest.mark.skipif(not cpu_linear.grids_on(),
                                reason="needs the compiled rows kernel (an x86-64 CPU and a C++ compiler with OpenMP)")
T = gguf.GGMLQuantizationType


def _float(n: int, k: int, seed: int) -> np.ndarray:
    gen = np.random.default_rng(seed)
    w = (gen.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[:, 3] *= 30  # outliers: blocks of different ranges
    return w


def _alike_rows(n: int, k: int) -> np.ndarray:
    """Rows in pairs with the same first block (and two rows the same throughout)."""
    w = _float(n, k, 3)
    w[1::2, :QK] = w[0::2, :QK]
    w[5] = w[4]
    return w


# name -> (float values quantized into the file, type): transformers dequantizes such a file to
# exactly the float32 weights gguf.quants.dequantize gives.
TENSORS = {
    "blk.0.attn_q.weight": (_float(64, 96, 0), T.Q4_1),
    "blk.0.attn_k.weight": (_float(64, 96, 1), T.Q4_1),  # same shape: told apart by its values
    "blk.0.ffn_down.weight": (_alike_rows(40, 128), T.Q4_1),
    "token_embd.weight": (_float(300, 64, 2), T.Q8_0),
    "blk.0.attn_norm.weight": (np.ones(96, np.float32), T.F32),  # not codes: no entry
}


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(50)])  # metadata is skipped, arrays too
    for name, (values, kind) in TENSORS.items():
        data = values if kind == T.F32 else gguf.quants.quantize(values, kind)
        writer.add_tensor(name, data, raw_dtype=kind)  # shape: from the blocks
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _dequantized(name: str) -> torch.Tensor:
    values, kind = TENSORS[name]
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(values, kind), kind).copy())


def test_tensor_infos_are_gguf_readers(gguf_path):
    reader = gguf.GGUFReader(str(gguf_path))
    start, infos = gguf_file.tensor_infos(np.memmap(gguf_path, dtype=np.uint8, mode="r"))
    assert start == reader.data_offset
    assert infos == [([int(d) for d in t.shape], int(t.tensor_type), int(t.data_offset) - reader.data_offset)
                     for t in reader.tensors]


@pytest.mark.parametrize("name", [n for n, (_, kind) in TENSORS.items() if kind != T.F32])
@pytest.mark.parametrize("permuted", [False, True])
def test_codes_from_the_file_are_the_codes_found_in_the_floats(gguf_path, name, permuted):
    weight = _dequantized(name)
    if permuted:  # rows reordered, as transformers' reverse permutation of llama's q / k
        weight = weight[torch.randperm(len(weight), generator=torch.Generator().manual_seed(1))].contiguous()
    read, found = gguf_file.GGUFCodes(gguf_path)(weight), gguf_codes.find_codes(weight)
    assert read is not None and read[0] == found[0] == Format[TENSORS[name][1].name]
    assert torch.equal(gguf_codes.pack(*read), gguf_codes.pack(*found))


def test_other_weights_get_none(gguf_path):
    codes = gguf_file.GGUFCodes(gguf_path)
    weight = _dequantized("blk.0.attn_q.weight")
    off = weight.clone()
    off.view(torch.int32)[5, 7] += 1  # one weight one ulp away: not the file's
    assert codes(off) is None
    assert codes(torch.from_numpy(_float(64, 96, 0))) is None  # the floats before quantization
    assert codes(weight[:, :64].contiguous()) is None  # another shape
    assert codes(weight.double()) is None and codes(weight.bfloat16()) is None


def test_no_file_no_codes(tmp_path):
    assert gguf_file.codes_of(None) is None and gguf_file.codes_of(tmp_path / "absent.gguf") is None
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF" + b"\xff" * 60)  # a header that lists more than the file holds
    assert gguf_file.codes_of(damaged)(_dequantized("blk.0.attn_q.weight")) is None


def test_packing_reads_the_codes_and_searches_only_the_others(gguf_path, monkeypatch):
    """cpu_linear takes a weight's codes from the file without searching its floats; a weight not
    in the file (float32 values) is searched and keeps float32 blocks."""
    in_file, other = nn.Linear(96, 64, bias=False), nn.Linear(64, 96, bias=False)
    with torch.no_grad():
        in_file.weight.copy_(_dequantized("blk.0.attn_k.weight"))
        other.weight.copy_(torch.from_numpy(_float(96, 64, 9)))
    expected = gguf_codes.pack(*gguf_codes.find_codes(in_file.weight.detach()))
    searched = []
    real = gguf_codes.codes_in
    monkeypatch.setattr(gguf_codes, "codes_in", lambda w, kind: searched.append(tuple(w.shape)) or real(w, kind))
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 0)
    seq = nn.Sequential(in_file, other)
    x = torch.randn(3, 96)
    plain = seq(x)
    assert cpu_linear.prepare(seq, ROWS, gguf_file.codes_of(gguf_path)) == 2
    assert seq[0].format == "q4_1" and torch.equal(seq[0].packed, expected)
    assert seq[1].format == "f32" and len(searched) == len(cpu_linear.CODES)  # only the other one searched
    assert torch.allclose(seq(x), plain, rtol=1e-4, atol=1e-4)  # the same weights (bit for bit: the packed codes above)
