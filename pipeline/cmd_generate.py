"""``multitoken generate``: sample a continuation of a prompt from the base model.

For now this is plain one-token-per-step sampling through transformers' ``generate``; the
multi-token decoding modes plug in here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from .backbone import BackboneConfig


@dataclass
class GenerateConfig:
    prompt: str = field(default="", metadata={"positional": True, "help": "text to continue"})
    max_new_tokens: int = field(default=128, metadata={"help": "tokens to generate"})
    temperature: float = field(default=0.7, metadata={"help": "sampling temperature (> 0)"})
    top_k: int = field(default=50, metadata={"help": "sample among the k most likely tokens"})
    greedy: bool = field(default=False, metadata={"help": "argmax decoding instead of sampling"})
    seed: int = field(default=0, metadata={"help": "random seed"})


def validate(cfg: GenerateConfig, vocab_size: int, context: int, prompt_len: int) -> None:
    from .errors import UsageError

    if not cfg.greedy and cfg.temperature <= 0:
        raise UsageError(f"temperature must be > 0 when sampling, got {cfg.temperature}", "pass --greedy for argmax decoding")
    if not 1 <= cfg.top_k <= vocab_size:
        raise UsageError(f"--top-k must be in [1, {vocab_size}] (the vocabulary size), got {cfg.top_k}")
    if cfg.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    if prompt_len + cfg.max_new_tokens > context:
        raise UsageError(
            f"prompt ({prompt_len} tokens) + --max-new-tokens ({cfg.max_new_tokens}) exceeds the model's context of {context}",
            "shorten the prompt or lower --max-new-tokens",
        )


def register(sub) -> None:
    from .cliargs import add_dataclass_args

    p = sub.add_parser("generate", help="generate text from a prompt (default: the embedded model)")
    add_dataclass_args(p, GenerateConfig)
    add_dataclass_args(p, BackboneConfig)
    p.set_defaults(func=run)


def run(args) -> None:
    import torch
    from transformers import TextStreamer

    from .backbone import load_backbone
    from .cliargs import dataclass_from_args
    from .errors import UsageError

    cfg = dataclass_from_args(GenerateConfig, args)
    if not cfg.prompt.strip():
        raise UsageError("the prompt is empty", 'pass the text to continue, e.g. multitoken generate "Once upon a time"')
    backbone = load_backbone(dataclass_from_args(BackboneConfig, args))
    tok = backbone.tokenizer
    ids = tok(cfg.prompt, return_tensors="pt").input_ids.to(backbone.device)
    validate(cfg, backbone.vocab_size, backbone.config.max_position_embeddings, ids.shape[1])
    torch.manual_seed(cfg.seed)
    streamer = TextStreamer(tok, skip_special_tokens=True)
    sample = {} if cfg.greedy else {"temperature": cfg.temperature, "top_k": cfg.top_k}
    with torch.inference_mode():
        backbone.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.max_new_tokens,
            do_sample=not cfg.greedy, streamer=streamer, pad_token_id=tok.eos_token_id, **sample,
        )
    sys.stdout.flush()
