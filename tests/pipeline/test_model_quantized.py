"""Heads on a 4/8-bit backbone: head 1 is still the (quantized) base exactly, copy-initialised
layer heads start from the dequantized final layer, heads train in float, and saved heads load
onto a quantized base."""

from __future__ import annotations

import pytest
import torch

from multitoken.adapters.registry import make_config
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.pipeline.model.quantization import packed_cpu_4bit

# How far head 2 (a float copy of the final layer) may sit from head 1 (that layer quantized), in
# log-probabilities. Both use the same dequantized weights, so only the kernels' arithmetic
# differs. 8-bit quantizes the activations too, hence 0.05. A 4-bit kernel that dequantizes to
# float32 and multiplies in float32 differs from the float copy by float32 rounding: 1e-5 absolute
# on log-probs of magnitude ~11 (vocab 50k) is ~40 ulps. bitsandbytes' packed kernel on CPUs with
# AVX512-BF16 rounds each Linear's inputs, block scales and outputs to bfloat16 (8 significant
# bits, unit roundoff 2^-9; accumulation stays float32): each Linear output carries <= 3 x 2^-9
# relative error, and the log-probs, dominated by the log-partition term, inherit a relative error
# of that order, bounded here by one bfloat16 epsilon 2^-8 (observed: 2.3e-4 relative).
BF16_EPS = 2.0**-8


def _head_tolerance(quantization: str) -> dict:
    if quantization == "8bit":
        return {"atol": 0.05, "rtol": 0.0}
    if packed_cpu_4bit("cpu"):
        return {"atol": 0.0, "rtol": BF16_EPS}
    return {"atol": 1e-5, "rtol": 0.0}


@pytest.mark.parametrize("arch,quantization", [("llama", "8bit"), ("gpt_neox", "4bit")])
def test_replicated_heads_on_quantized_backbone(request, tmp_path, arch, quantization):
    # One architecture per quantization keeps this fast; both are covered. Models of a width that
    # every CPU kernel takes (conftest.QUANTIZABLE_HIDDEN), so that all Linear layers quantize.
    tiny_model_dir = request.getfixturevalue({"llama": "tiny_llama_q_dir", "gpt_neox": "tiny_neox_q_dir"}[arch])
    bb = load_backbone(BackboneConfig(base=str(tiny_model_dir), quantization=quantization))
    assert bb.float_layers == {}
    model = MultiTokenModel.attach(bb, make_config("replicated", n_future=2))
    if quantization == "4bit":  # the copy is the dequantized final layer, bit for bit
        import bitsandbytes as bnb

        head_layer = dict(model.heads.layers[0].named_modules())
        for name, module in bb.layers[-1].named_modules():
            if type(module).__name__ == "Linear4bit":
                dense = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
                assert torch.equal(head_layer[name].weight, dense), name
    ids = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = torch.log_softmax(bb.model(ids).logits.float(), -1)
    head1, head2 = model.head_logits(ids, last_only=False)
    assert torch.equal(head1, base)
    torch.testing.assert_close(head2, head1, **_head_tolerance(quantization))
    assert all(p.dtype == torch.float32 for p in model.head_parameters())
    out = model.compute_loss(ids)
    out.total.backward()
    assert all(p.grad is not None for p in model.head_parameters())
    model.save_heads(tmp_path / "heads")
    loaded = MultiTokenModel.from_pretrained(str(tiny_model_dir), tmp_path / "heads", quantization=quantization)
    assert loaded.backbone.is_quantized
    assert torch.equal(loaded.head_logits(ids)[1], model.head_logits(ids)[1])
