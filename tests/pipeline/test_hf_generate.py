"""``with_heads``: multi-token decoding from transformers' own ``generate`` (custom_generate)."""

from __future__ import annotations

import pytest
import torch

from multitoken.base.errors import UsageError
from multitoken.pipeline.model.backbone import BackboneConfig, load_backbone
from multitoken.pipeline.model.hf_generate import with_heads
from multitoken.pipeline.model.model import MultiTokenModel


@pytest.fixture(scope="module")
def heads_and_model(tiny_llama_dir, tmp_path_factory):
    """Replicated heads (perturbed copies) saved for the tiny Llama, and a plain transformers
    model object of that checkpoint."""
    from transformers import AutoModelForCausalLM

    backbone = load_backbone(BackboneConfig(base=str(tiny_llama_dir)))
    torch.manual_seed(0)
    heads = MultiTokenModel.attach(backbone, {"head_type": "replicated", "n_future": 3, "init": "copy"})
    with torch.no_grad():
        for p in heads.heads.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    out = tmp_path_factory.mktemp("hf_generate") / "heads"
    heads.save_heads(out)
    return out, AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()


def test_greedy_through_transformers_generate_equals_its_own(heads_and_model):
    heads, model = heads_and_model
    ids = torch.tensor([[1, 45, 230, 17, 99]])
    plain = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=2)
    for tree in ("chain", "static"):
        ours = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=2,
                              custom_generate=with_heads(str(heads), tree=tree))
        assert ours.tolist() == plain.tolist(), tree


def test_a_padded_batch_keeps_each_rows_prompt_and_output(heads_and_model):
    heads, model = heads_and_model
    rows = [[1, 45, 230, 17, 99], [1, 300, 12]]
    ids = torch.tensor([rows[0], [0, 0] + rows[1]])  # left padded, as transformers' batches are
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=2,
                          custom_generate=with_heads(str(heads)))
    assert ours[:, :5].tolist() == ids.tolist()
    for i, row in enumerate(rows):
        alone = model.generate(torch.tensor([row]), max_new_tokens=12, do_sample=False, pad_token_id=2)
        assert ours[i, 5:].tolist()[:12] == alone[0, len(row):].tolist()


def test_options_without_a_counterpart_are_refused(heads_and_model, tmp_path):
    heads, model = heads_and_model
    ids = torch.tensor([[1, 45, 230]])
    with pytest.raises(UsageError, match="NoRepeatNGram"):
        model.generate(ids, max_new_tokens=4, do_sample=False, no_repeat_ngram_size=2, pad_token_id=2,
                       custom_generate=with_heads(str(heads)))
    with pytest.raises(UsageError, match="not a heads dir"):
        with_heads(str(tmp_path))
