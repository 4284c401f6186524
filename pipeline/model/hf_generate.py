"""Decoding with multi-token heads from plain transformers code.

``with_heads(HEADS_DIR)`` returns a decoding method for transformers' own ``generate``::

    model = AutoModelForCausalLM.from_pretrained(BASE)
    out = model.generate(ids, max_new_tokens=64, do_sample=False,
                         custom_generate=with_heads("heads-dir", tree="static"))

transformers prepares the inputs and the generation config as usual and then calls the method
in place of its own sampling loop (a callable ``custom_generate`` runs no remote code, so no
``trust_remote_code``); the method decodes with the heads (``decoding.generate``, every row of a
batch on its own) and returns the sequences as ``generate`` does: the prompts followed by the new
tokens, padded with the pad token. Greedy (``do_sample=False``) output is transformers' greedy
output token for token. Sampling reads ``temperature``, ``top_k`` and ``repetition_penalty``
(DynaMo's form: the probability of a token already in the context divided by it) from the
generation config; other logits processors have no counterpart and are refused. The heads are
loaded once per model object; the model's linears stay as the caller built them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from multitoken.base.errors import UsageError
from multitoken.base.tokenizer import load_tokenizer
from multitoken.decoding.engine import generate_batch, prompt_rows
from multitoken.decoding.config import DecodeConfig
from multitoken.pipeline.model.assets import load_stats
from multitoken.pipeline.model.backbone import Backbone, BackboneConfig
from multitoken.pipeline.model.cpu_linear import STOCK
from multitoken.pipeline.model.model import MultiTokenModel

# transformers' processors that the generation config's sampling fields create and that the
# method applies itself; any other processor (or a user's own) has no counterpart here.
HANDLED = {"TemperatureLogitsWarper", "TopKLogitsWarper", "RepetitionPenaltyLogitsProcessor"}


def with_heads(heads: str, stats: str | None = None, **decode) -> callable:
    """A ``custom_generate`` method decoding with the heads in ``heads`` (and co-occurrence
    ``stats`` for DynaMo / joint drafts); ``decode``: other ``DecodeConfig`` fields (mode,
    tree, tree_nodes, eps_b, ...)."""
    if not (Path(heads) / "heads_config.json").is_file():
        raise UsageError(f"{heads!r} is not a heads dir (no heads_config.json)",
                         "pass a directory made by `multitoken attach` / `multitoken train`, or a shipped one")
    loaded: dict[int, tuple] = {}

    def multitoken_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                            synced_gpus=False, streamer=None, **model_kwargs) -> torch.LongTensor:
        if id(model) not in loaded:
            loaded[id(model)] = _attach(model, heads, stats)
        mt, table = loaded[id(model)]
        extra = sorted({type(p).__name__ for p in logits_processor} - HANDLED)
        if extra:
            raise UsageError(f"with_heads cannot apply {', '.join(extra)}",
                             "drop those generation options, or decode with transformers' own generate")
        cfg = _decode_config(generation_config, decode, input_ids.shape[1])
        rows = prompt_rows(input_ids, model_kwargs.get("attention_mask"))
        results = generate_batch(mt, rows, cfg, table=table)
        return _sequences(input_ids, [r.token_ids for r in results], generation_config)

    return multitoken_generate


def _attach(model, heads: str, stats: str | None):
    """The heads on ``model`` itself (its weights checked against the heads' base)."""
    name = str(model.config._name_or_path)
    dtype = str(model.dtype).removeprefix("torch.")
    backbone = Backbone(model, load_tokenizer(name), name,
                        BackboneConfig(base=name, dtype=dtype, device=str(model.device), cpu_linear=STOCK))
    mt = MultiTokenModel.from_pretrained(backbone, heads)
    return mt, load_stats(stats, backbone.tokenizer)


def _decode_config(gc, decode: dict, prompt_len: int) -> DecodeConfig:
    new = gc.max_new_tokens if gc.max_new_tokens is not None else (gc.max_length or prompt_len + 20) - prompt_len
    fields = dict(max_new_tokens=new, greedy=not gc.do_sample)
    if gc.do_sample:
        fields.update(temperature=gc.temperature or 1.0, top_k=gc.top_k or 50,
                      repetition_penalty=gc.repetition_penalty or 1.0)
    cfg = DecodeConfig(**{"mode": "speculative", **fields, **decode}).resolved()
    cfg.validate()
    return cfg


def _sequences(input_ids: torch.Tensor, new: list[list[int]], gc) -> torch.LongTensor:
    """The prompts as given (their padding kept) then each row's new tokens, right-padded."""
    pad = gc.pad_token_id if gc.pad_token_id is not None else (gc.eos_token_id if isinstance(gc.eos_token_id, int) else 0)
    width = max(len(t) for t in new)
    tail = torch.full((input_ids.shape[0], width), int(pad), dtype=input_ids.dtype, device=input_ids.device)
    for i, tokens in enumerate(new):
        tail[i, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, tail], dim=1)  # [B, T + new]
