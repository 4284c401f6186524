"""Our attention implementation for transformers' models: SDPA, with a batch's one-token decoding
steps on bfloat16 CPU caches in one compiled op.

Registered under ``NAME`` in transformers' ``AttentionInterface`` (and SDPA's mask builder in its
``AttentionMaskInterface``), so a model set to it (``use``) calls it from every attention layer,
through its own forward or our lean one alike. Where a step is one query per row, bfloat16, on
the CPU, without dropout, with no mask or SDPA's boolean one, it runs kernels/decode_attention.cpp
(the query heads of a kv head share each key and value read); every other call is transformers'
``sdpa_attention_forward``, unchanged. The op's values are SDPA's within bfloat16 rounding, not
its bits: a model is set to it where its text is already the bfloat16 model's, such as the
recipe's bfloat16 distillation copy (recipe_data.bfloat16_copy).
"""

from __future__ import annotations

import torch

from multitoken.kernels import gemv_rows

NAME = "multitoken_sdpa"
SDPA_MASKED = ("sdpa", NAME)  # the implementations that take SDPA's boolean masks
_EXTRAS = ("sliding_window", "softcap", "s_aux", "position_bias", "cache")  # what the op does not take: SDPA's path then
_REGISTERED = [False]


def takes_sdpa_masks(config) -> bool:
    """Whether ``config``'s attention implementation reads SDPA's boolean masks (True = attend)."""
    return config._attn_implementation in SDPA_MASKED


def _op_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, dropout: float, kwargs: dict) -> bool:
    if (query.device.type != "cpu" or query.shape[2] != 1 or dropout != 0.0
            or any(kwargs.get(name) is not None for name in _EXTRAS)):
        return False
    if not all(t.dtype == torch.bfloat16 and t.stride(-1) == 1 for t in (query, key, value)):
        return False
    if key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1] or query.shape[-1] > 256:
        return False
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:] != (1, 1, key.shape[2])
                             or mask.shape[0] not in (1, query.shape[0])):
        return False
    return gemv_rows.library() is not None


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
              dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q [B, heads, T, d], k / v [B, kv heads, S, d] -> ([B, T, heads, d], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _op_applies(query, key, value, attention_mask, dropout, kwargs):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return gemv_rows.library().decode_attention(query, key, value, attention_mask, scale), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register() -> None:
    """``NAME`` in transformers' attention and mask interfaces (once per process)."""
    if _REGISTERED[0]:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _REGISTERED[0] = True


def use(model: torch.nn.Module) -> None:
    """Set ``model`` (a transformers model) to ``NAME``."""
    register()
    model.set_attn_implementation(NAME)
