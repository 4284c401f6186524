"""The trained heads shipped beside the embedded stories260K model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from multitoken.embedded import EMBEDDED_DIR

HEADS = EMBEDDED_DIR / "stories260K-heads"


@pytest.fixture(scope="module")
def model():
    from multitoken.pipeline.model.model import MultiTokenModel

    return MultiTokenModel.from_pretrained(None, HEADS)  # base named "embedded:stories260K" in the dir


def test_shipped_heads_are_small_and_name_the_packaged_base(model):
    record = json.loads((HEADS / "heads_config.json").read_text())
    assert record["base"] == "embedded:stories260K" and record["head_config"]["head_type"] == "replicated"
    assert model.n_future == 3
    assert (HEADS / "heads.safetensors").stat().st_size < 1_000_000


def test_shipped_heads_predict_fresh_samples_of_the_base(model, stories_dir, tmp_path):
    """Accuracy on new self-samples (another seed than the build's corpora): head 2 must be
    far better than chance, and head 1 is exactly the base model."""
    from multitoken.pipeline.train.distill import DistillConfig, distill
    from multitoken.pipeline.train.train import evaluate

    out = tmp_path / "fresh.jsonl"
    distill(model.backbone, DistillConfig(num_tokens=4 * 128, out=str(out), batch_size=4, max_new_tokens=128, seed=123, progress=False, format="ids"))
    flat = np.concatenate([json.loads(line)["input_ids"] for line in out.read_text().splitlines()])
    rows = flat[: 4 * 128].reshape(4, 128)  # [4, 128]
    metrics = evaluate(model, [rows])
    assert metrics["head2/top5"] > 0.35 and metrics["head3/top5"] > 0.2

    ids = torch.from_numpy(rows)
    with torch.no_grad():
        base = torch.log_softmax(model.backbone.model(ids).logits.float(), -1)  # [4, 128, V]
    head1 = model.head_logits(ids, last_only=False)[0]
    torch.testing.assert_close(head1, base, rtol=1e-4, atol=1e-4)


def test_shipped_heads_speed_up_greedy_speculative_decoding(model):
    """The heads were also trained on greedy text: greedy speculative decoding keeps the base
    output exactly and accepts well over one draft per forward (2.3 tokens/forward measured)."""
    from multitoken.decoding.config import DecodeConfig
    from multitoken.decoding.engine import generate

    tok = model.backbone.tokenizer
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=64, drafter="independent")
    tokens = forwards = 0
    for prompt in ("Once upon a time", "The little dog ran to the park and", "Lily and Ben were playing with a ball. Then"):
        ids = tok(prompt, return_tensors="pt").input_ids
        res = generate(model, ids, cfg)
        hf = model.backbone.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                                           pad_token_id=tok.eos_token_id)
        assert res.token_ids == hf[0, ids.shape[1]:].tolist()
        tokens, forwards = tokens + len(res.token_ids), forwards + res.trace.forward_passes - 1  # prefill excluded
    assert tokens / forwards > 2.0


def test_the_default_heads_follow_the_mode_on_the_fetched_smollm2(tmp_path, monkeypatch):
    """Without --heads, ``generate`` takes the heads shipped for its base: on the fetched SmolLM2
    the token-conditioned ones where drafts are verified, the replicated ones for DynaMo and
    ``ar``; the embedded base has one set for every mode; another base, none."""
    from multitoken import embedded
    from multitoken.decoding.config import DecodeConfig

    monkeypatch.setenv("MULTITOKEN_CACHE", str(tmp_path))
    smollm2 = embedded.fetched_dir(embedded.SMOLLM2)
    smollm2.mkdir(parents=True)  # where `multitoken fetch smollm2` converts it (only the path is read here)
    for mode, heads in (("speculative", embedded.SMOLLM2_CONDITIONED), ("typical", embedded.SMOLLM2_CONDITIONED),
                        ("dynamic", embedded.SMOLLM2_HEADS), ("ar", embedded.SMOLLM2_HEADS)):
        drafting = DecodeConfig(mode=mode).verifies
        assert embedded.shipped_heads(f"fetched:{embedded.SMOLLM2}", drafting) == str(heads)
        assert embedded.shipped_heads(embedded.default_base(), drafting) == str(HEADS)
    assert embedded.shipped_heads(str(tmp_path), True) is None
    assert embedded.shipped_heads(f"fetched:{embedded.SMOLLM2}") == str(embedded.SMOLLM2_HEADS)  # DynaMo's


def test_the_shipped_stats_follow_the_base(tmp_path, monkeypatch):
    """Each base takes the stats of its own tokenizer; another base takes none."""
    from multitoken import embedded

    monkeypatch.setenv("MULTITOKEN_CACHE", str(tmp_path))
    embedded.fetched_dir(embedded.SMOLLM2).mkdir(parents=True)
    assert embedded.shipped_stats(embedded.default_base()) == str(embedded.EMBEDDED_STATS)
    assert embedded.shipped_stats(f"fetched:{embedded.SMOLLM2}") == str(embedded.SMOLLM2_STATS)
    assert embedded.shipped_stats(str(tmp_path)) is None
