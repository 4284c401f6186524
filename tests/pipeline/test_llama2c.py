"""llama2.c import: HF logits agree with an independent numpy forward written from the format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ..conftest import fixture_path
from multitoken.pipeline.cli import main
from multitoken.base.errors import CheckpointError
from multitoken.pipeline.sources.llama2c import HEADER_BYTES, convert_llama2c, read_llama2c


def _rmsnorm(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w


def numpy_forward(h, a, tokens: list[int]) -> np.ndarray:
    """run.c's forward in float64: interleaved-pair rotary from the file's freq_cis tables."""
    a = {k: v.astype(np.float64) for k, v in a.items()}
    T, hs, group = len(tokens), h.head_size, h.n_heads // h.n_kv_heads
    cos, sin = a["freq_cis_real"][:T], a["freq_cis_imag"][:T]  # [T, hs/2]

    def rope(x):  # [T, heads, hs], rotate pairs (2i, 2i+1)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
        return out

    x = a["token_embedding"][tokens]  # [T, d]
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(h.n_layers):
        xb = _rmsnorm(x, a["rms_att"][l])
        q = rope((xb @ a["wq"][l].T).reshape(T, h.n_heads, hs))
        k = rope((xb @ a["wk"][l].T).reshape(T, h.n_kv_heads, hs))
        v = (xb @ a["wv"][l].T).reshape(T, h.n_kv_heads, hs)
        heads = []
        for i in range(h.n_heads):
            s = q[:, i] @ k[:, i // group].T / np.sqrt(hs) + causal  # [T, T]
            p = np.exp(s - s.max(-1, keepdims=True))
            heads.append((p / p.sum(-1, keepdims=True)) @ v[:, i // group])
        x = x + np.concatenate(heads, -1) @ a["wo"][l].T
        xb = _rmsnorm(x, a["rms_ffn"][l])
        g = xb @ a["w1"][l].T
        x = x + ((g / (1 + np.exp(-g))) * (xb @ a["w3"][l].T)) @ a["w2"][l].T
    x = _rmsnorm(x, a["rms_final"])
    return x @ a["token_embedding" if h.shared_classifier else "wcls"].T  # [T, V]


@pytest.fixture(scope="module")
def stories_bin():
    return fixture_path("stories260K", "stories260K.bin"), fixture_path("stories260K", "tok512.model")


@pytest.fixture(scope="module")
def converted(stories_bin, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "stories260K"
    assert main(["convert-llama2c", str(stories_bin[0]), "--tokenizer", str(stories_bin[1]), "--out", str(out)]) == 0
    return out


def test_logits_match_numpy_reference(stories_bin, converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    header, arrays = read_llama2c(stories_bin[0])
    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    tokens = tok("Once upon a time, there was a little dog who liked to run.").input_ids
    assert tokens[0] == 1  # BOS, as llama2.c starts every sample
    with torch.no_grad():
        hf = model(torch.tensor([tokens])).logits[0].double().numpy()
    ref = numpy_forward(header, arrays, tokens)
    assert np.abs(hf - ref).max() < 1e-4


def test_greedy_text_is_fluent_and_matches_reference(stories_bin, converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    header, arrays = read_llama2c(stories_bin[0])
    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted)
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=24, do_sample=False)[0].tolist()
    seq = ids[0].tolist()
    for _ in range(24):  # independent greedy decode with the numpy forward
        seq.append(int(numpy_forward(header, arrays, seq)[-1].argmax()))
    assert out == seq
    text = tok.decode(out, skip_special_tokens=True)
    assert text.startswith("Once upon a time, there was a little girl named Lily.")


def test_shipped_embedded_model_equals_fresh_conversion(converted, stories_dir):
    from safetensors.numpy import load_file

    a, b = load_file(converted / "model.safetensors"), load_file(stories_dir / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert (stories_dir / "LICENSE").read_text().startswith("MIT License")


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda raw: raw[:10], "shorter than the 28-byte"),
        (lambda raw: np.array([64, 172, 5, 8, 4, 512, 0], "<i4").tobytes() + raw[HEADER_BYTES:], "impossible llama2.c header"),
        (lambda raw: np.array([64, 172, 5, 7, 4, 512, 512], "<i4").tobytes() + raw[HEADER_BYTES:], "inconsistent llama2.c header"),
        (lambda raw: raw[:-4], "does not match"),
        (lambda raw: raw + b"\0" * 8, "does not match"),
    ],
    ids=["short", "zero-seq-len", "heads-do-not-divide", "truncated", "padded"],
)
def test_malformed_input_is_a_clear_error(tmp_path, stories_bin, make, message):
    bad = _write(tmp_path / "bad.bin", make(stories_bin[0].read_bytes()))
    with pytest.raises(CheckpointError, match=message):
        read_llama2c(bad)


def test_cli_reports_errors_without_traceback(tmp_path, stories_bin, capsys):
    bad = _write(tmp_path / "bad.bin", b"\1\2\3")
    code = main(["convert-llama2c", str(bad), "--tokenizer", str(stories_bin[1]), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 1 and "shorter than" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    assert main(["convert-llama2c", str(stories_bin[0]), "--out", str(tmp_path / "o")]) == 2  # no --tokenizer


def test_wrong_tokenizer_file_and_nonempty_out(tmp_path, stories_bin):
    with pytest.raises(CheckpointError, match="SentencePiece"):
        convert_llama2c(stories_bin[0], fixture_path("stories260K", "tok512.bin"), tmp_path / "o")
    assert not (tmp_path / "o").exists()  # nothing half-written
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(CheckpointError, match="not empty"):
        convert_llama2c(stories_bin[0], stories_bin[1], tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "keep me"
