"""A loaded causal LM and the pieces multi-token heads need, generically.

Architectures differ only in a few names, kept in ``ARCHITECTURES`` (one row per
``model_type``); everything else goes through standard transformers interfaces
(``output_hidden_states``, ``get_output_embeddings()``, ``base_model_prefix``). Loading one
from a checkpoint (``BackboneConfig``, ``load_backbone``): ``loading.py``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from dataclasses import dataclass, field

import torch
from torch import nn

from multitoken.base.errors import UnsupportedModelError, UsageError
from multitoken.pipeline.model.attention import SDPA_MASKED, takes_sdpa_masks
from multitoken.pipeline.model.lean_layers import LeanLayers


@dataclass(frozen=True)
class ArchSpec:
    """The per-architecture names that no generic transformers interface exposes."""

    final_norm: str  # attribute of the decoder stack
    cache_kwarg: str  # keyword a decoder layer takes its KV cache by
    lora_targets: tuple[str, ...]  # default LoRA target modules (q/k/v, as in Mehra et al.)


ARCHITECTURES: dict[str, ArchSpec] = {
    "gpt_neox": ArchSpec("final_layer_norm", "layer_past", ("query_key_value",)),
    "llama": ArchSpec("norm", "past_key_values", ("q_proj", "k_proj", "v_proj")),
}

def check_supported(model_type: str) -> ArchSpec:
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported",
            f"use a checkpoint of a supported type: {', '.join(sorted(ARCHITECTURES))}",
        )
    return ARCHITECTURES[model_type]


GQA_SETTING = "TRANSFORMERS_SDPA_FORCE_GQA"  # read by transformers' sdpa_attention_forward at every call
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@contextlib.contextmanager
def _env(name: str, value: str):
    """``os.environ[name] = value`` for the scope, then as it was."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


@dataclass
class LayerContext:
    """What every decoder layer of one forward pass shares besides its hidden states."""

    mask: torch.Tensor | None  # None = plain causal (SDPA's is_causal path)
    position_ids: torch.Tensor  # [1, T]
    position_embeddings: tuple[torch.Tensor, torch.Tensor]  # rotary (cos, sin)
    # what a lean layer forward derives from the above once per pass, for every layer (lean_layers.py)
    derived: dict = field(default_factory=dict)


@dataclass
class TrunkOutput:
    hidden: torch.Tensor  # [B, T, H] output of the last trunk layer (not normalised)
    layer_states: tuple[torch.Tensor, ...]  # each trunk layer's output, when collected
    ctx: LayerContext


class Backbone:
    """A loaded causal LM plus generic access to its decoder stack.

    ``model`` is what runs (possibly a peft ``PeftModel``); ``causal_lm`` the transformers
    model inside it. Hidden states follow transformers' convention: ``L + 1`` tensors, the
    embeddings first, then each layer's output (the last one after the final norm).
    """

    def __init__(self, model: nn.Module, tokenizer, name: str, config):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.load_config = config  # the BackboneConfig it was loaded with (loading.py)
        self.causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.config = self.causal_lm.config
        self.model_type = self.config.model_type
        self.spec = check_supported(self.model_type)
        self.decoder = getattr(self.causal_lm, self.causal_lm.base_model_prefix)
        # Linear layers a quantized load kept in float: no kernel of the device takes their
        # shape (name -> (out_features, in_features)); see pipeline/model/quantization.py.
        self.float_layers: dict[str, tuple[int, int]] = {}
        # sha256 of the GGUF file the weights came from (loaded directly, or converted by
        # `multitoken fetch`): the base's identity beyond what the embedding probe shows.
        self.source_sha256: str | None = None
        # That GGUF file where it is on disk: its Q4_1 / Q8_0 codes are packed as read (kernels/gguf_file.py).
        self.source_gguf: Path | None = None
        # A layer's forward with fewer calls where it gives the layer's bits (lean_layers.py)
        self.lean = LeanLayers(self.model_type, self.config)

    # Generic access ---------------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @property
    def final_norm(self) -> nn.Module:
        return getattr(self.decoder, self.spec.final_norm)

    @property
    def rotary_emb(self) -> nn.Module:
        return self.decoder.rotary_emb

    @property
    def embeddings(self) -> nn.Module:
        return self.causal_lm.get_input_embeddings()

    @property
    def unembedding(self) -> nn.Module:
        return self.causal_lm.get_output_embeddings()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        head = self.unembedding  # a Linear's rows; a packed one's weight would be unpacked to be read
        return getattr(head, "out_features", None) or head.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.embeddings.weight.device

    @property
    def is_quantized(self) -> bool:
        return self.load_config.quantization is not None

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """All ``L + 1`` hidden states for ``input_ids`` # L+1 x [B, T, H]."""
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return out.hidden_states

    def logits(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        """Unembed an already-normalised hidden state # [..., H] -> [..., V]."""
        return self.unembedding(normed_hidden)

    # Running decoder layers by hand --------------------------------------------------------
    # Heads run layers of the same class as the backbone's (head 1 IS its final layer), so the
    # backbone exposes the decoder's own per-forward inputs (mask, positions, rotary) and a
    # generic way to call one layer. This mirrors the decoder's forward, never patches it.
    def layer_context(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None
    ) -> "LayerContext":
        """Mask and positions for ``hidden`` [B, T, H] (T new tokens after ``cache``'s)."""
        from transformers.masking_utils import create_causal_mask

        past = cache.get_seq_length() if cache is not None else 0
        position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + past).unsqueeze(0)  # [1, T]
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
            past_key_values=cache, position_ids=position_ids,
        )
        rotary = self.rotary_emb(hidden, position_ids=position_ids)
        return LayerContext(mask=mask, position_ids=position_ids, position_embeddings=rotary)

    def explicit_context(self, hidden: torch.Tensor, attend: torch.Tensor, position_ids: torch.Tensor) -> "LayerContext":
        """A context from an explicit mask and positions (tree verification: a node sees the
        context and its ancestors, at position past + depth). ``attend`` [T, S] bool, True =
        query t sees key s (S = cached + T keys); ``position_ids`` [1, T]. SDPA takes the
        boolean mask as it is, eager attention an additive one (0 / dtype minimum); other
        kernels take no arbitrary mask through the layer's interface."""
        kind = self.config._attn_implementation
        if kind in SDPA_MASKED:
            mask = attend[None, None]  # [1, 1, T, S]
        elif kind == "eager":
            mask = torch.zeros(attend.shape, dtype=hidden.dtype, device=hidden.device)
            mask = mask.masked_fill_(~attend, torch.finfo(hidden.dtype).min)[None, None]
        else:
            raise UsageError(f"tree verification needs sdpa or eager attention, this model runs {kind!r}",
                             "load the model with attn_implementation='sdpa', or decode with --tree chain")
        rotary = self.rotary_emb(hidden, position_ids=position_ids)
        return LayerContext(mask=mask, position_ids=position_ids, position_embeddings=rotary)

    def masked_gqa(self, ctx: "LayerContext", device: torch.device):
        """A scope for running layers under ``ctx``: on the CPU, a masked (multi-token) pass of a
        grouped-query model asks transformers' SDPA path for torch's ``enable_gqa`` through its
        ``TRANSFORMERS_SDPA_FORCE_GQA`` setting, instead of ``repeat_kv`` copying every layer's
        whole KV cache each pass (it takes ``enable_gqa`` unasked only without a mask). Same
        values (the heads read the same keys), without a copy whose cost grows with the context.
        Not on accelerators (a mask with GQA sends CUDA's SDPA to its math kernel) nor before
        torch 2.5 (no ``enable_gqa``)."""
        kv = getattr(self.config, "num_key_value_heads", None)
        if (ctx.mask is None or device.type != "cpu" or not _SDPA_GQA or kv is None
                or kv == self.config.num_attention_heads or not takes_sdpa_masks(self.config)):
            return contextlib.nullcontext()
        return _env(GQA_SETTING, "1")

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, ctx: "LayerContext", cache=None) -> torch.Tensor:
        """One decoder layer # [B, T, H] -> [B, T, H]; ``cache`` is that layer's KV cache, if any.
        Without autograd a layer of a family in ``lean_layers.LEAN`` runs its lean forward (the
        same bits, fewer calls)."""
        if (plan := self.lean.plan(layer, ctx)) is not None:
            return self.lean.run(plan, hidden, ctx, cache)
        kwargs = {self.spec.cache_kwarg: cache, "use_cache": cache is not None}
        out = layer(
            hidden, attention_mask=ctx.mask, position_ids=ctx.position_ids,
            position_embeddings=ctx.position_embeddings, **kwargs,
        )
        return out[0] if isinstance(out, tuple) else out

    def run_trunk(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        num_layers: int | None = None, collect: bool = False, cache=None,
    ) -> "TrunkOutput":
        """Embeddings then the first ``num_layers`` layers (default: all but the last).

        Returns the trunk output (un-normalised), every layer's output when ``collect``, and
        the layer context so heads can run further layers on the same positions.
        """
        num_layers = self.num_layers - 1 if num_layers is None else num_layers
        hidden = self.embeddings(input_ids)  # [B, T, H]
        ctx = self.layer_context(hidden, attention_mask, cache)
        states = []
        for layer in self.layers[:num_layers]:
            hidden = self.run_layer(layer, hidden, ctx, cache)
            if collect:
                states.append(hidden)
        return TrunkOutput(hidden=hidden, layer_states=tuple(states), ctx=ctx)

    def fingerprint(self) -> dict:
        """Identifies the base weights, robustly to dtype and quantization (embeddings are
        never quantized): shapes plus a probe of embedding rows spread over the vocabulary."""
        emb = self.embeddings.weight.detach()
        rows = torch.linspace(0, emb.shape[0] - 1, 8).long()
        probe = emb[rows.to(emb.device), :8].float().flatten().cpu()
        return {
            "model_type": self.model_type,
            "vocab_size": int(emb.shape[0]),
            "hidden_size": int(self.hidden_size),
            "num_layers": int(self.num_layers),
            "embedding_probe": [round(float(x), 6) for x in probe],
            **({"source_sha256": self.source_sha256} if self.source_sha256 else {}),
        }


def fingerprints_match(a: dict, b: dict, rtol: float = 2e-2) -> bool:
    """Equal shapes and embedding probes equal up to half-precision rounding."""
    keys = ("model_type", "vocab_size", "hidden_size", "num_layers")
    if any(a.get(k) != b.get(k) for k in keys):
        return False
    if a.get("source_sha256") and b.get("source_sha256") and a["source_sha256"] != b["source_sha256"]:
        return False  # two different GGUF files (say two quantizations of one model)
    pa, pb = torch.tensor(a["embedding_probe"]), torch.tensor(b["embedding_probe"])
    if pa.shape != pb.shape:
        return False
    scale = max(float(pa.abs().max()), 1e-6)
    return bool((pa - pb).abs().max() <= rtol * scale)
