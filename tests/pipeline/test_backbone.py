"""Backbone loading: generic access to hidden states, layers, norm and unembedding."""

from __future__ import annotations

import json

import pytest
import torch

from multitoken.pipeline.model.backbone import ARCHITECTURES, fingerprints_match
from multitoken.pipeline.model.loading import BackboneConfig, LoraSpec, load_backbone
from multitoken.base.tokenizer import tokenizer_fingerprint
from multitoken.base.errors import CheckpointError, UnsupportedModelError, UsageError


def test_generic_access_reproduces_the_model(tiny_model_dir):
    bb = load_backbone(BackboneConfig(base=str(tiny_model_dir)))
    ids = torch.randint(0, 500, (2, 9))
    with torch.no_grad():
        ref = bb.model(ids).logits  # [B, T, V]
        hs = bb.hidden_states(ids)  # L+1 x [B, T, H]
        assert len(hs) == bb.num_layers + 1 and bb.num_layers == len(bb.layers)
        assert torch.equal(bb.logits(hs[-1]), ref)
        # the final layer run by hand from the penultimate output gives the same logits
        pos = torch.arange(9)[None]
        pe = bb.rotary_emb(hs[-2], position_ids=pos)
        out = bb.layers[-1](hs[-2], attention_mask=None, position_ids=pos, position_embeddings=pe)
        torch.testing.assert_close(bb.logits(bb.final_norm(out)), ref, rtol=1e-5, atol=1e-5)
    assert bb.vocab_size == ref.shape[-1] and bb.model_type in ARCHITECTURES
    assert not any(p.requires_grad for p in bb.model.parameters())


def test_embedded_default_is_used_without_arguments(stories_dir, tmp_path):
    from multitoken.embedded import portable_base

    bb = load_backbone()
    assert bb.name == str(stories_dir) and bb.model_type == "llama" and bb.vocab_size == 512
    assert load_backbone(BackboneConfig(base="embedded:stories260K")).name == str(stories_dir)
    assert portable_base(str(stories_dir)) == "embedded:stories260K"  # what heads dirs record
    assert portable_base(str(tmp_path)) == str(tmp_path)


def test_lora_wraps_with_qkv_targets_and_starts_as_identity(tiny_model_dir):
    base = load_backbone(BackboneConfig(base=str(tiny_model_dir)))
    bb = load_backbone(BackboneConfig(base=str(tiny_model_dir)), lora=LoraSpec(r=4), trainable_lora=True)
    trainable = [n for n, p in bb.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    targets = set(ARCHITECTURES[bb.model_type].lora_targets)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == targets
    ids = torch.randint(0, 500, (1, 6))
    with torch.no_grad():  # LoRA B is zero-initialised: same function until trained
        torch.testing.assert_close(bb.model(ids).logits, base.model(ids).logits)
    assert len(bb.layers) == base.num_layers  # generic access sees through the peft wrapper


def test_saved_lora_adapter_loads(tmp_path, tiny_llama_dir):
    bb = load_backbone(BackboneConfig(base=str(tiny_llama_dir)), lora=LoraSpec(r=2), trainable_lora=True)
    with torch.no_grad():
        for n, p in bb.model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    bb.model.save_pretrained(tmp_path / "lora")
    again = load_backbone(BackboneConfig(base=str(tiny_llama_dir)), lora_adapter=str(tmp_path / "lora"))
    ids = torch.randint(0, 500, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(again.model(ids).logits, bb.model(ids).logits)
    with pytest.raises(CheckpointError, match="adapter_config.json"):
        load_backbone(BackboneConfig(base=str(tiny_llama_dir)), lora_adapter=str(tmp_path))


def test_dtype_and_fingerprint(tiny_neox_dir, tiny_llama_dir):
    f32 = load_backbone(BackboneConfig(base=str(tiny_neox_dir)))
    bf16 = load_backbone(BackboneConfig(base=str(tiny_neox_dir), dtype="bfloat16"))
    assert bf16.embeddings.weight.dtype == torch.bfloat16
    assert fingerprints_match(f32.fingerprint(), bf16.fingerprint())
    other = load_backbone(BackboneConfig(base=str(tiny_llama_dir)))
    assert not fingerprints_match(f32.fingerprint(), other.fingerprint())
    fp = json.loads(json.dumps(f32.fingerprint()))  # survives a JSON round trip
    assert fingerprints_match(fp, f32.fingerprint())


def test_tokenizer_fingerprint_tells_tokenizers_apart(tiny_neox_dir, pythia_mini_dir, stories_dir):
    from multitoken.base.tokenizer import load_tokenizer

    neox = tokenizer_fingerprint(load_tokenizer(str(tiny_neox_dir)))
    assert neox == tokenizer_fingerprint(load_tokenizer(str(pythia_mini_dir)))
    assert neox != tokenizer_fingerprint(load_tokenizer(str(stories_dir)))


def test_unsupported_model_type_lists_supported(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="(?s)'gpt2' is not supported.*gpt_neox, llama"):
        load_backbone(BackboneConfig(base=str(tmp_path)))


def test_missing_or_broken_checkpoints(tmp_path, tiny_neox_dir):
    with pytest.raises(CheckpointError, match="nope. not found: no such directory"):
        load_backbone(BackboneConfig(base=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="could not load"):
        load_backbone(BackboneConfig(base=str(tmp_path / "empty")))
    with pytest.raises(UsageError, match="unknown quantization"):
        load_backbone(BackboneConfig(base=str(tiny_neox_dir), quantization="3bit"))
    with pytest.raises(UsageError, match="unknown dtype"):
        load_backbone(BackboneConfig(base=str(tiny_neox_dir), dtype="float8"))


def test_our_model_load_is_quiet_and_leaves_the_callers_logging_as_it_was(capfd):
    """The library silences transformers' "Loading weights" bar inside its own load only: no
    global switch on import, the caller's progress-bar and verbosity settings restored after."""
    from transformers.utils import logging as hf_logging

    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone

    hf_logging.enable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    try:
        load_backbone(BackboneConfig(threads=1))
        assert "Loading weights" not in capfd.readouterr().err
        assert hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() == hf_logging.WARNING
    finally:
        hf_logging.set_verbosity(verbosity)
