"""Import llama2.c's legacy ``.bin`` checkpoints as Hugging Face Llama checkpoints.

Format (llama2.c ``run.c``): a header of 7 int32 (dim, hidden_dim, n_layers, n_heads,
n_kv_heads, vocab_size, seq_len; a negative vocab_size means an unshared classifier), then
float32 tensors in a fixed order, each stored as ``nn.Linear.weight`` is (out, in).

llama2.c rotates interleaved pairs (2i, 2i+1) of each head; transformers rotates halves
(i, i + head_dim/2). Permuting the rows of wq and wk per head maps one onto the other.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from multitoken.base.errors import CheckpointError
from multitoken.base.outputs import CONVERTED
from multitoken.base.publish import staged_output

HEADER_INTS = 7
HEADER_BYTES = HEADER_INTS * 4
MAX_DIM = 1 << 20


@dataclass(frozen=True)
class Llama2cHeader:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_size

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The tensors in file order, with their shapes."""
        L, d, h, kv = self.n_layers, self.dim, self.hidden_dim, self.kv_dim
        shapes = [
            ("token_embedding", (self.vocab_size, d)),
            ("rms_att", (L, d)),
            ("wq", (L, d, d)),
            ("wk", (L, kv, d)),
            ("wv", (L, kv, d)),
            ("wo", (L, d, d)),
            ("rms_ffn", (L, d)),
            ("w1", (L, h, d)),
            ("w2", (L, d, h)),
            ("w3", (L, h, d)),
            ("rms_final", (d,)),
            ("freq_cis_real", (self.seq_len, self.head_size // 2)),
            ("freq_cis_imag", (self.seq_len, self.head_size // 2)),
        ]
        if not self.shared_classifier:
            shapes.append(("wcls", (self.vocab_size, d)))
        return shapes

    def expected_bytes(self) -> int:
        return HEADER_BYTES + 4 * sum(int(np.prod(s)) for _, s in self.tensor_shapes())


def _parse_header(raw: bytes, path: str) -> Llama2cHeader:
    ints = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4").tolist()
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = ints
    fix = "pass a llama2.c legacy-format .bin (as written by llama2.c export.py --version 0)"
    sizes = {"dim": dim, "hidden_dim": hidden, "n_layers": n_layers, "n_heads": n_heads,
             "n_kv_heads": n_kv, "vocab_size": abs(vocab), "seq_len": seq_len}
    bad = [f"{k}={v}" for k, v in sizes.items() if not 0 < v <= MAX_DIM]
    if bad:
        raise CheckpointError(f"{path}: impossible llama2.c header ({', '.join(bad)})", fix)
    if dim % n_heads or n_heads % n_kv or (dim // n_heads) % 2:
        raise CheckpointError(
            f"{path}: inconsistent llama2.c header (dim={dim}, n_heads={n_heads}, n_kv_heads={n_kv}): "
            "dim must split into an even head size and n_heads must be a multiple of n_kv_heads",
            fix,
        )
    return Llama2cHeader(dim, hidden, n_layers, n_heads, n_kv, abs(vocab), seq_len, vocab > 0)


def read_llama2c(path: str | Path) -> tuple[Llama2cHeader, dict[str, np.ndarray]]:
    """Parse a llama2.c legacy checkpoint into its header and float32 arrays (file layout)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no such file: {path}", "pass the path of a llama2.c .bin checkpoint")
    raw = path.read_bytes()
    if len(raw) < HEADER_BYTES:
        raise CheckpointError(
            f"{path}: file is {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte llama2.c header",
            "the file is truncated or not a llama2.c checkpoint",
        )
    header = _parse_header(raw, str(path))
    expected = header.expected_bytes()
    if len(raw) != expected:
        raise CheckpointError(
            f"{path}: size {len(raw)} bytes does not match {expected} bytes implied by its header {header}",
            "the file is truncated, padded, or in another llama2.c version (only the legacy v0 format is read)",
        )
    flat = np.frombuffer(raw, dtype="<f4", offset=HEADER_BYTES)
    arrays, pos = {}, 0
    for name, shape in header.tensor_shapes():
        n = int(np.prod(shape))
        arrays[name] = flat[pos : pos + n].reshape(shape)
        pos += n
    return header, arrays


def rotary_to_halves(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder output rows of a q/k projection from interleaved-pair to half-split rotary."""
    out_dim, in_dim = w.shape
    hs = out_dim // n_heads
    return w.reshape(n_heads, hs // 2, 2, in_dim).transpose(0, 2, 1, 3).reshape(out_dim, in_dim)


def hf_state_dict(header: Llama2cHeader, a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Map llama2.c arrays to ``LlamaForCausalLM`` parameter names."""
    sd = {"model.embed_tokens.weight": a["token_embedding"], "model.norm.weight": a["rms_final"]}
    for i in range(header.n_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = a["rms_att"][i]
        sd[p + "self_attn.q_proj.weight"] = rotary_to_halves(a["wq"][i], header.n_heads)
        sd[p + "self_attn.k_proj.weight"] = rotary_to_halves(a["wk"][i], header.n_kv_heads)
        sd[p + "self_attn.v_proj.weight"] = a["wv"][i]
        sd[p + "self_attn.o_proj.weight"] = a["wo"][i]
        sd[p + "post_attention_layernorm.weight"] = a["rms_ffn"][i]
        sd[p + "mlp.gate_proj.weight"] = a["w1"][i]
        sd[p + "mlp.down_proj.weight"] = a["w2"][i]
        sd[p + "mlp.up_proj.weight"] = a["w3"][i]
    sd["lm_head.weight"] = a["token_embedding"] if header.shared_classifier else a["wcls"]
    return sd


def llama_config(header: Llama2cHeader):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=header.vocab_size,
        hidden_size=header.dim,
        intermediate_size=header.hidden_dim,
        num_hidden_layers=header.n_layers,
        num_attention_heads=header.n_heads,
        num_key_value_heads=header.n_kv_heads,
        head_dim=header.head_size,
        max_position_embeddings=header.seq_len,
        rms_norm_eps=1e-5,  # run.c's rmsnorm epsilon
        hidden_act="silu",
        tie_word_embeddings=header.shared_classifier,
        bos_token_id=1,
        eos_token_id=2,
    )


def _convert_tokenizer(tokenizer_model: Path, out: Path, vocab_size: int) -> None:
    from transformers import LlamaTokenizer

    if not tokenizer_model.is_file():
        raise CheckpointError(f"no such tokenizer file: {tokenizer_model}", "pass llama2.c's SentencePiece .model file")
    if tokenizer_model.stat().st_size == 0:
        raise CheckpointError(f"tokenizer file {tokenizer_model} is empty", "pass llama2.c's SentencePiece .model file (e.g. tok512.model)")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(tokenizer_model, Path(tmp) / "tokenizer.model")
        try:
            tok = LlamaTokenizer.from_pretrained(tmp, add_bos_token=True, add_eos_token=False)
        except (OSError, ValueError, RuntimeError) as err:
            raise CheckpointError(
                f"could not read SentencePiece tokenizer {tokenizer_model}: {err}",
                "pass the SentencePiece .model file llama2.c trained (e.g. tok512.model), not tok512.bin",
            ) from err
    if not 0 < len(tok) <= vocab_size:
        raise CheckpointError(
            f"tokenizer {tokenizer_model} has {len(tok)} tokens, the model's vocabulary has {vocab_size}",
            "pass the SentencePiece .model file the checkpoint was trained with",
        )
    tok.save_pretrained(out)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def convert_llama2c(model_bin: str | Path, tokenizer_model: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write a Hugging Face Llama checkpoint (safetensors, config, tokenizer) to ``out``.

    The directory appears all or nothing: everything is staged first, then published with its
    record (``publish.staged_output``). An existing ``out`` must be empty, or ``overwrite`` be
    set (only the files an earlier conversion's record lists are replaced).
    """
    import torch
    from transformers import LlamaForCausalLM

    model_bin, tokenizer_model, out = Path(model_bin), Path(tokenizer_model), Path(out)
    header, arrays = read_llama2c(model_bin)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"output directory {out} exists and is not empty", "choose a new --out directory")
    with staged_output(out, CONVERTED.kind, "convert-llama2c", marker=CONVERTED.marker) as tmp:
        _convert_tokenizer(tokenizer_model, tmp, header.vocab_size)
        model = LlamaForCausalLM(llama_config(header))
        state = {k: torch.from_numpy(v.copy()) for k, v in hf_state_dict(header, arrays).items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if "rotary" not in m]:
            raise CheckpointError(f"internal mapping error: missing {missing}, unexpected {unexpected}")
        model.save_pretrained(tmp)
        record = {
            "source": {"model": model_bin.name, "model_sha256": _sha256(model_bin),
                       "tokenizer": tokenizer_model.name, "tokenizer_sha256": _sha256(tokenizer_model)},
            "header": asdict(header),
        }
        (tmp / "conversion.json").write_text(json.dumps(record, indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
    return out
