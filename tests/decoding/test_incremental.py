"""``MultiTokenModel.step`` with explicit caches == a full recompute, for every head type, both
architectures, float and quantized backbones; cropping forgets exactly the rejected positions."""

from __future__ import annotations

import pytest
import torch

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.loop import generate
from multitoken.pipeline.model.backbone import BackboneConfig, load_backbone

from .conftest import attach


def incremental_log_probs(model, ids: torch.Tensor, cuts: list[int]) -> list[torch.Tensor]:
    """Per-head log-probs at every position, fed in chunks, with a rejected detour cropped."""
    caches, pieces = model.new_caches(), []
    bounds = [0, *cuts, ids.shape[1]]
    for a, b in zip(bounds[:-1], bounds[1:]):
        model.step(torch.tensor([[7, 11, 13]]), caches)  # drafts that get rejected...
        caches.crop(3)  # ...and forgotten
        out = model.step(ids[:, a:b], caches)
        pieces.append(torch.stack([torch.stack([out.head_log_probs(i, p)[0] for p in range(b - a)])
                                   for i in range(model.n_future)]))  # [n, T_chunk, V]
    assert caches.length == ids.shape[1]
    return torch.cat(pieces, 1)  # [n, T, V]


def test_step_with_caches_equals_full_recompute(tiny_backbones, arch, head_type):
    model = attach(tiny_backbones[arch], head_type)
    ids = torch.randint(0, 500, (1, 11), generator=torch.Generator().manual_seed(1))
    full = torch.stack([lp[0] for lp in model.head_logits(ids, last_only=False)])  # [n, T, V]
    got = incremental_log_probs(model, ids, [5, 6, 9])
    torch.testing.assert_close(got, full, atol=1e-4, rtol=1e-4)


def test_read_from_keeps_only_later_positions(tiny_backbones, head_type):
    """A prompt's pass unembeds only the rows decoding reads; those rows are unchanged."""
    model = attach(tiny_backbones["llama"], head_type)
    ids = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(3))
    full = model.step(ids, model.new_caches())
    part = model.step(ids, model.new_caches(), read_from=6)
    assert part.base_logits().shape[1] == 3
    for i in range(model.n_future):
        for p in (6, 8):
            torch.testing.assert_close(part.head_log_probs(i, p), full.head_log_probs(i, p), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not kept"):
        part.head_log_probs(0, 5)


def test_head_layers_get_their_own_caches(tiny_backbones):
    model = attach(tiny_backbones["llama"], "replicated", n_future=3)
    caches = model.new_caches()
    assert len(caches.heads) == 2
    model.step(torch.tensor([[1, 2, 3, 4]]), caches)
    last = model.backbone.num_layers - 1  # head layers are replicas of the final layer, same slot
    assert all(c.layers[last].keys.shape[-2] == 4 for c in caches.heads)
    assert caches.backbone.get_seq_length() == 4


@pytest.mark.parametrize("arch,quantization", [("llama", "8bit"), ("gpt_neox", "4bit")])
def test_quantized_backbone_decodes_like_its_own_generate(tiny_neox_q_dir, tiny_llama_q_dir, arch, quantization):
    base = {"llama": tiny_llama_q_dir, "gpt_neox": tiny_neox_q_dir}[arch]  # widths every CPU kernel takes
    bb = load_backbone(BackboneConfig(base=str(base), quantization=quantization))
    model = attach(bb, "replicated")
    ids = bb.tokenizer("Once upon a time", return_tensors="pt").input_ids
    ref = bb.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                            pad_token_id=bb.tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
    for mode in ("ar", "speculative"):
        assert generate(model, ids, DecodeConfig(mode=mode, greedy=True, max_new_tokens=12)).token_ids == ref
    res = generate(model, ids, DecodeConfig(mode="dynamic", eps_b=0.0, max_new_tokens=12))
    assert len(res.token_ids) == 12
