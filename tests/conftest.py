"""Shared test fixtures: tiny models built locally from configs, and the shared fixtures dir.

``../shared/fixtures`` (override with MULTITOKEN_FIXTURES) sits beside the repository on
every machine that runs the suite, CI included; a missing fixture is an error, not a skip.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
ASSETS = Path(__file__).resolve().parent / "assets"
PYTHIA_TOKENIZER = ASSETS / "pythia_tokenizer"
FIXTURES = Path(os.environ.get("MULTITOKEN_FIXTURES", REPO.parent / "shared" / "fixtures"))


def fixture_path(*parts: str) -> Path:
    path = FIXTURES.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"shared fixture {path} is missing: clone ../shared beside the repo or set MULTITOKEN_FIXTURES")
    return path


def build_tiny_neox(out: Path, *, layers: int = 3, hidden: int = 32, seed: int = 0) -> Path:
    """A random GPT-NeoX with pythia's layout (parallel residual, partial rotary) and tokenizer."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(
        vocab_size=50304, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=4 * hidden, max_position_embeddings=512, rotary_pct=0.25,
        use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )
    GPTNeoXForCausalLM(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(PYTHIA_TOKENIZER / f, out / f)
    return out


def build_tiny_llama(out: Path, *, layers: int = 3, hidden: int = 32, seed: int = 0) -> Path:
    """A random Llama (GQA) with the stories260K tokenizer (vocab 512)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from multitoken.embedded import DEFAULT_BASE

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_BASE / f, out / f)
    return out


def readme_block(needle: str) -> str:
    """The README's python block that contains ``needle``, as written."""
    import re

    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    return next(b for b in blocks if needle in b)


def rank_odd_tokens(model, heads_dir: Path, size: int) -> list[int]:
    """Give ``model`` a heads dir whose token ranking (draft_vocab.json) puts the odd ids first,
    lowest first; returns the ``size`` ids its drafts then score."""
    import json

    from multitoken.pipeline.model.draft_vocab import DRAFT_VOCAB_FILE, ranking_record

    v = model.backbone.vocab_size
    counts = torch.tensor([(v - i) if i % 2 else 0 for i in range(v)])
    (heads_dir / DRAFT_VOCAB_FILE).write_text(json.dumps(ranking_record(counts, size, "test")))
    model.heads_dir = str(heads_dir)
    return [i for i in range(v) if i % 2][:size]


@pytest.fixture(scope="session")
def tiny_neox_dir(tmp_path_factory) -> Path:
    return build_tiny_neox(tmp_path_factory.mktemp("tiny_neox"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


# The width of the tiny models that quantized tests load. bitsandbytes' 4-bit kernel on CPUs with
# AVX512-BF16 needs out_features % 32 == 0 and in_features % 64 == 0 for every Linear
# (pipeline/model/quantization.py); 32-wide models fit only the other kernels. At 64 every Linear of
# both architectures fits: 64, 32 (GQA k/v), 192 and 256 (MLP) outputs on 64, 192, 256 inputs.
QUANTIZABLE_HIDDEN = 64


@pytest.fixture(scope="session")
def tiny_neox_q_dir(tmp_path_factory) -> Path:
    """``tiny_neox_dir`` at a width every 4-bit and 8-bit CPU kernel takes."""
    return build_tiny_neox(tmp_path_factory.mktemp("tiny_neox_q"), hidden=QUANTIZABLE_HIDDEN)


@pytest.fixture(scope="session")
def tiny_llama_q_dir(tmp_path_factory) -> Path:
    """``tiny_llama_dir`` at a width every 4-bit and 8-bit CPU kernel takes."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama_q"), hidden=QUANTIZABLE_HIDDEN)


@pytest.fixture(scope="session", params=["gpt_neox", "llama"])
def tiny_model_dir(request, tiny_neox_dir, tiny_llama_dir) -> Path:
    """Both architectures, for tests that must hold for each."""
    return {"gpt_neox": tiny_neox_dir, "llama": tiny_llama_dir}[request.param]


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    """Random 3-token replicated heads on the tiny Llama (eval, PPL_d and sweep tests)."""
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
    from multitoken.pipeline.model.model import MultiTokenModel

    torch.manual_seed(0)
    bb = load_backbone(BackboneConfig(base=str(tiny_llama_dir)))
    return MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 3, "init": "random"})


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    from multitoken.embedded import DEFAULT_BASE

    return DEFAULT_BASE


@pytest.fixture(scope="session")
def pythia_mini_dir() -> Path:
    return fixture_path("pythia-mini")


@pytest.fixture(scope="session", autouse=True)
def packed_tiny_linears():
    """The suite's tiny models are below the weight count the CPU packs from by default
    (``cpu_linear.MIN_WEIGHTS``): every layer is packed here, so decoding tests run the packed
    kernels (subprocesses of the CLI tests keep the default)."""
    from multitoken.kernels import cpu_linear

    before, cpu_linear.MIN_WEIGHTS = cpu_linear.MIN_WEIGHTS, 0
    yield
    cpu_linear.MIN_WEIGHTS = before


@pytest.fixture(scope="session", autouse=True)
def packed_weights_apart(tmp_path_factory):
    """The packed weights the suite's models cache (kernels/pack_cache.py) go to a folder of the
    session's, so the user's cache keeps its own entries (subprocesses use $MULTITOKEN_CACHE's)."""
    from multitoken.kernels import pack_cache

    folder = tmp_path_factory.mktemp("packed")
    before, pack_cache.folder = pack_cache.folder, lambda: folder
    yield
    pack_cache.folder = before
