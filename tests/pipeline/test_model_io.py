"""Heads dir format: exact round trip for every head type, no base weights saved, LoRA in
peft's own files, and clear errors for a different base, corrupt files and unknown types."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from multitoken.adapters.registry import make_config, registered_heads
from multitoken.pipeline.model.loading import BackboneConfig, LoraSpec, load_backbone
from multitoken.base.errors import CheckpointError, MismatchError, UsageError
from multitoken.pipeline.model.model import MultiTokenModel

SMALL = {"cp": {"rank": 2}}


def _attach(backbone, head_type, seed=0):
    torch.manual_seed(seed)
    model = MultiTokenModel.attach(backbone, make_config(head_type, n_future=3, **SMALL.get(head_type, {})))
    with torch.no_grad():  # move every head weight off its initial value: a real round trip
        for p in model.heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def backbone(tiny_model_dir):
    return load_backbone(BackboneConfig(base=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 500, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("head_type", registered_heads())
def test_round_trip_is_exact(backbone, ids, tmp_path, head_type):
    model = _attach(backbone, head_type)
    model.save_heads(tmp_path / "heads")
    loaded = MultiTokenModel.from_pretrained(backbone.name, tmp_path / "heads")
    assert loaded.config == model.config
    # in eval mode, as transformers' from_pretrained: head layers then take the lean layer forward
    assert not loaded.training and not any(m.training for m in loaded.modules())
    for a, b in zip(model.head_logits(ids, last_only=False), loaded.head_logits(ids, last_only=False)):
        assert torch.equal(a, b)
    # Onto an already loaded backbone too (no second load of the base).
    again = MultiTokenModel.from_pretrained(backbone, tmp_path / "heads")
    for k, v in model.heads.state_dict().items():
        assert torch.equal(again.heads.state_dict()[k], v)


@pytest.mark.parametrize("head_type", registered_heads())
def test_saved_dir_holds_only_head_tensors(backbone, tmp_path, head_type):
    model = _attach(backbone, head_type)
    out = model.save_heads(tmp_path / "heads")
    assert sorted(p.name for p in out.iterdir()) == ["heads.safetensors", "heads_config.json", "multitoken_manifest.json"]
    saved = load_file(out / "heads.safetensors")
    assert set(saved) == set(model.heads.state_dict())
    n_saved = sum(t.numel() for t in saved.values())
    buffers = sum(b.numel() for n, b in model.heads.named_buffers() if n in saved)  # eagle3's d2t / t2d maps
    assert n_saved == sum(p.numel() for p in model.heads.parameters()) + buffers
    base_numel = sum(p.numel() for p in backbone.model.parameters())
    assert n_saved < base_numel or head_type == "cp"  # sanity: heads are not a copy of the base
    base_names = {n for n, _ in backbone.model.named_parameters()}
    assert not set(saved) & base_names
    record = json.loads((out / "heads_config.json").read_text())
    assert record["head_config"]["head_type"] == head_type
    assert record["model_type"] == backbone.model_type and record["base"] == backbone.name
    assert record["shapes"] == {k: list(v.shape) for k, v in saved.items()}
    assert record["multitoken_version"] and record["base_fingerprint"]["num_layers"] == backbone.num_layers


def test_other_base_is_refused(backbone, tiny_model_dir, tmp_path):
    import shutil

    torch.manual_seed(123)  # same architecture and shapes, different weights
    type(backbone.causal_lm)(backbone.config).save_pretrained(tmp_path / "other")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / f, tmp_path / "other" / f)
    out = _attach(backbone, "replicated").save_heads(tmp_path / "heads")
    with pytest.raises(MismatchError, match="trained on"):
        MultiTokenModel.from_pretrained(str(tmp_path / "other"), out)


def test_corrupt_truncated_missing_and_unknown(backbone, tmp_path):
    out = _attach(backbone, "medusa").save_heads(tmp_path / "heads")
    tensors = out / "heads.safetensors"
    good = tensors.read_bytes()
    tensors.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(CheckpointError, match="checksum"):
        MultiTokenModel.from_pretrained(backbone, out)
    tensors.write_bytes(b"\x00" * len(good))  # same size, garbage
    with pytest.raises(CheckpointError, match="checksum"):
        MultiTokenModel.from_pretrained(backbone, out)
    tensors.unlink()
    with pytest.raises(CheckpointError, match="no heads.safetensors"):
        MultiTokenModel.from_pretrained(backbone, out)
    tensors.write_bytes(good)
    config = out / "heads_config.json"
    record = json.loads(config.read_text())
    config.write_text(json.dumps({**record, "head_config": {**record["head_config"], "head_type": "bogus"}}))
    with pytest.raises(CheckpointError, match="unknown head type 'bogus'") as err:
        MultiTokenModel.from_pretrained(backbone, out)
    assert "replicated" in str(err.value) and "cp" in str(err.value)
    config.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        MultiTokenModel.from_pretrained(backbone, out)
    config.unlink()
    with pytest.raises(CheckpointError, match="no heads_config.json"):
        MultiTokenModel.from_pretrained(backbone, out)


def test_valid_safetensors_with_wrong_tensors_is_refused(backbone, tmp_path):
    import hashlib

    from safetensors.torch import save

    out = _attach(backbone, "medusa").save_heads(tmp_path / "heads")
    blob = save({"blocks.0.0.linear.weight": torch.zeros(3, 3)})
    (out / "heads.safetensors").write_bytes(blob)
    record = json.loads((out / "heads_config.json").read_text())
    record.update(heads_sha256=hashlib.sha256(blob).hexdigest(), shapes={"blocks.0.0.linear.weight": [3, 3]})
    (out / "heads_config.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="do not fit"):
        MultiTokenModel.from_pretrained(backbone, out)


def test_lora_is_saved_in_peft_format(tiny_model_dir, ids, tmp_path):
    bb = load_backbone(BackboneConfig(base=str(tiny_model_dir)), lora=LoraSpec(r=2), trainable_lora=True)
    model = _attach(bb, "replicated")
    with torch.no_grad():
        for p in model.lora_parameters():
            p.add_(torch.randn_like(p) * 0.1)  # a LoRA that changes the base path
    out = model.save_heads(tmp_path / "heads")
    assert (out / "lora" / "adapter_config.json").is_file()
    assert not any("lora" in k for k in load_file(out / "heads.safetensors"))
    loaded = MultiTokenModel.from_pretrained(str(tiny_model_dir), out)
    assert loaded.has_lora
    for a, b in zip(model.head_logits(ids, last_only=False), loaded.head_logits(ids, last_only=False)):
        torch.testing.assert_close(a, b)
    with pytest.raises(UsageError, match="LoRA"):
        MultiTokenModel.from_pretrained(load_backbone(BackboneConfig(base=str(tiny_model_dir))), out)


def test_trained_final_layer_is_saved_and_restored(tiny_model_dir, ids, tmp_path):
    bb = load_backbone(BackboneConfig(base=str(tiny_model_dir)))
    model = _attach(bb, "replicated")
    for p in model.base_head_parameters():  # DynaMo trains head 1 at LR_B
        p.requires_grad_(True)
    with torch.no_grad():
        bb.layers[-1].parameters().__next__().add_(0.1)
    out = model.save_heads(tmp_path / "heads")
    assert any(k.startswith("base_head.final_layer.") for k in load_file(out / "heads.safetensors"))
    loaded = MultiTokenModel.from_pretrained(str(tiny_model_dir), out)
    assert torch.equal(model.head_logits(ids)[0], loaded.head_logits(ids)[0])


def test_save_never_leaves_temporaries(backbone, tmp_path):
    out = _attach(backbone, "replicated").save_heads(tmp_path / "heads")
    _attach(backbone, "replicated", seed=1).save_heads(out)  # overwrite in place
    assert sorted(p.name for p in out.iterdir()) == ["heads.safetensors", "heads_config.json", "multitoken_manifest.json"]


@pytest.mark.parametrize("damage", ["nested", "dtype"])
def test_a_heads_config_nested_past_the_recursion_limit_or_of_an_unknown_dtype_is_one_line(tmp_path, damage):
    import shutil

    from multitoken.embedded import EMBEDDED_HEADS
    from multitoken.pipeline.model.heads_io import read_heads_config

    heads = tmp_path / "heads"
    shutil.copytree(EMBEDDED_HEADS, heads)
    if damage == "nested":
        (heads / "heads_config.json").write_text("[" * 200_000 + "]" * 200_000)
        expected = "is not valid JSON"
    else:
        record = json.loads((heads / "heads_config.json").read_text())
        (heads / "heads_config.json").write_text(json.dumps({**record, "dtype": "banana"}))
        expected = "dtype must be one of float32, float16, bfloat16"
    with pytest.raises(CheckpointError, match=expected):
        read_heads_config(heads)
