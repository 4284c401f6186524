"""Heads on a 4/8-bit backbone: head 1 is still the (quantized) base exactly, copy-initialised
layer heads start from the dequantized final layer, heads train in float, and saved heads load
onto a quantized base."""

from __future__ import annotations

import pytest
import torch

from multitoken.adapters.registry import make_config
from multitoken.pipeline.backbone import BackboneConfig, load_backbone
from multitoken.pipeline.model import MultiTokenModel


@pytest.mark.parametrize("arch,quantization,tol", [("llama", "8bit", 0.05), ("gpt_neox", "4bit", 1e-5)])
def test_replicated_heads_on_quantized_backbone(request, tmp_path, arch, quantization, tol):
    # One architecture per quantization keeps this fast; both are covered.
    tiny_model_dir = request.getfixturevalue({"llama": "tiny_llama_dir", "gpt_neox": "tiny_neox_dir"}[arch])
    bb = load_backbone(BackboneConfig(base=str(tiny_model_dir), quantization=quantization))
    model = MultiTokenModel.attach(bb, make_config("replicated", n_future=2))
    ids = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = torch.log_softmax(bb.model(ids).logits.float(), -1)
    head1, head2 = model.head_logits(ids, last_only=False)
    assert torch.equal(head1, base)
    # 4-bit matmuls dequantize exactly; 8-bit ones quantize activations, hence the tolerance.
    torch.testing.assert_close(head2, head1, atol=tol, rtol=0)
    assert all(p.dtype == torch.float32 for p in model.head_parameters())
    out = model.compute_loss(ids)
    out.total.backward()
    assert all(p.grad is not None for p in model.head_parameters())
    model.save_heads(tmp_path / "heads")
    loaded = MultiTokenModel.from_pretrained(str(tiny_model_dir), tmp_path / "heads", quantization=quantization)
    assert loaded.backbone.is_quantized
    assert torch.equal(loaded.head_logits(ids)[1], model.head_logits(ids)[1])
