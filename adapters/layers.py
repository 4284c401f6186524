"""New decoder layers of the backbone's own class, for layer-replica heads (replicated, whs).

A head layer is always a fresh module built from the backbone config (never ``[layer] * n``,
never a deepcopy of a quantized or LoRA-wrapped layer): copies take the final layer's dense
weights (dequantized when the backbone is 4/8-bit, LoRA's base weights when wrapped).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import head_dtype

INITS = ("copy", "random")


def new_layer_like_final(backbone, init: str) -> nn.Module:
    """A trainable decoder layer of the final layer's class, copy- or randomly initialised."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    final = backbone.layers[-1]
    layer = type(final)(backbone.config, backbone.num_layers - 1)  # same layer index: same layer type/role
    if init == "copy":
        _copy_dense_weights(layer, final)
    else:
        for module in layer.modules():
            backbone.causal_lm._init_weights(module)  # the model's own initialisation scheme
    return layer.to(device=backbone.device, dtype=head_dtype(backbone))


def _copy_dense_weights(dst: nn.Module, src: nn.Module) -> None:
    with torch.no_grad():
        for name, module in dst.named_modules():
            own = dict(module.named_parameters(recurse=False))
            if not own:
                continue
            source = src.get_submodule(name) if name else src
            source = getattr(source, "base_layer", source)  # peft LoRA wrapper -> the wrapped layer
            for pname, param in own.items():
                param.copy_(_dense(source, pname).to(param.dtype).reshape(param.shape))


def _dense(module: nn.Module, pname: str) -> torch.Tensor:
    """A parameter as a dense tensor, dequantizing bitsandbytes weights without touching the
    module (peft's helper re-assigns the weight on CPU, which drops the 8-bit scales)."""
    tensor = getattr(module, pname)
    kind = type(tensor).__name__
    if pname == "weight" and kind == "Params4bit":
        import bitsandbytes as bnb

        return bnb.functional.dequantize_4bit(tensor.data, tensor.quant_state).detach().cpu()
    if pname == "weight" and kind == "Int8Params":
        import bitsandbytes as bnb

        scales = tensor.SCB if tensor.SCB is not None else module.state.SCB  # per-row absmax
        return bnb.functional.int8_vectorwise_dequant(tensor.data, scales).detach().cpu()
    return tensor.detach().cpu()
