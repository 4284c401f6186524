"""Self-distillation: sample a training corpus from the base model itself.

For bases whose training data is not at hand, heads can be trained on the base model's own
samples (as Medusa does): the heads then learn what the base would say next, which is what
they must predict at decoding time anyway. Samples start from the BOS token, are drawn in
batches with transformers' ``generate`` and written one document per jsonl line (token ids
and/or text), atomically: the output file appears only once it is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from multitoken.base.progress import progress_bar
from multitoken.base.atomic import atomic_open
from multitoken.base.errors import UsageError

FORMATS = ("both", "ids", "text")


@dataclass
class DistillConfig:
    """Drives ``multitoken distill``."""

    num_tokens: int | None = field(default=None, metadata={"help": "tokens to sample in total (required, > 0)"})
    out: str | None = field(default=None, metadata={"help": "output .jsonl file (written atomically)"})
    batch_size: int = field(default=32, metadata={"help": "samples drawn in parallel"})
    max_new_tokens: int = field(default=256, metadata={"help": "longest sample, in tokens (a sample also ends at EOS)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (> 0); 1 samples the base distribution"})
    top_k: int = field(default=0, metadata={"help": "sample among the k most likely tokens (0: whole vocabulary)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (1: off)"})
    greedy_after: int = field(default=-1, metadata={"help": (
        "sample a prefix of 0..N tokens (drawn per batch), then continue with argmax: the text greedy "
        "speculative decoding verifies, for heads serving it (-1: sample throughout)")})
    format: str = field(default="both", metadata={"help": "what each line holds: input_ids, text, or both", "choices": FORMATS})
    seed: int = field(default=0, metadata={"help": "random seed"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})


def validate(cfg: DistillConfig, context: int) -> None:
    if cfg.num_tokens is None:
        raise UsageError("no --num-tokens given", "pass --num-tokens N, the tokens to sample in total")
    if cfg.num_tokens <= 0:
        raise UsageError(f"--num-tokens must be > 0, got {cfg.num_tokens}")
    if not cfg.out:
        raise UsageError("no output file given", "pass --out FILE.jsonl")
    if Path(cfg.out).is_dir():
        raise UsageError(f"--out {cfg.out!r} is a directory", "pass a file path ending in .jsonl")
    if cfg.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {cfg.batch_size}")
    if not 1 <= cfg.max_new_tokens < context:
        raise UsageError(f"--max-new-tokens must be in [1, {context - 1}] (the model's context minus the BOS token), got {cfg.max_new_tokens}")
    if not 0 < cfg.temperature < float("inf"):  # nan fails too
        raise UsageError(f"--temperature must be a finite number > 0, got {cfg.temperature}")
    if not 0 <= cfg.seed <= 2**63 - 1:
        raise UsageError(f"--seed must be in [0, 2**63 - 1], got {cfg.seed}", "pass a non-negative seed, e.g. --seed 0")
    if cfg.greedy_after < -1 or cfg.greedy_after >= cfg.max_new_tokens:
        raise UsageError(f"--greedy-after must be -1 (off) or in [0, {cfg.max_new_tokens - 1}] (below --max-new-tokens), got {cfg.greedy_after}")
    if cfg.top_k < 0 or not 0 < cfg.top_p <= 1:
        raise UsageError(f"--top-k must be >= 0 and --top-p in (0, 1], got {cfg.top_k} and {cfg.top_p}")


def _start_token(tokenizer) -> int:
    for tok_id in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tok_id is not None:
            return int(tok_id)
    raise UsageError("the tokenizer has neither a BOS nor an EOS token to start samples from")


def sample_batch(backbone, cfg: DistillConfig, batch: int) -> list[list[int]]:
    """``batch`` samples from the start token, each cut at its first EOS (EOS excluded). With
    ``greedy_after`` >= 0 only a prefix is sampled; argmax decoding continues it."""
    tok = backbone.tokenizer
    eos = tok.eos_token_id
    out = torch.full((batch, 1), _start_token(tok), dtype=torch.long, device=backbone.device)  # [B, 1]
    sampled = cfg.max_new_tokens
    if cfg.greedy_after >= 0:
        sampled = int(torch.randint(0, cfg.greedy_after + 1, ()))
    if sampled:
        out = _generate(backbone, cfg, out, sampled, do_sample=True)
    if sampled < cfg.max_new_tokens:
        # rows that ended during the sampled prefix are cut at their EOS below anyway
        out = _generate(backbone, cfg, out, cfg.max_new_tokens - sampled, do_sample=False)
    samples = []
    for row in out[:, 1:].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos)]
        samples.append(row)
    return samples


def _generate(backbone, cfg: DistillConfig, ids: torch.Tensor, new: int, do_sample: bool) -> torch.Tensor:
    eos = backbone.tokenizer.eos_token_id
    options = dict(temperature=cfg.temperature, top_k=cfg.top_k or None, top_p=cfg.top_p) if do_sample else {}
    with torch.inference_mode():
        return backbone.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=do_sample, max_new_tokens=new,
            pad_token_id=eos if eos is not None else 0, eos_token_id=eos, **options,
        )  # [B, len + new]


def distill(backbone, cfg: DistillConfig) -> dict:
    """Sample ``cfg.num_tokens`` tokens into ``cfg.out``; returns a small summary."""

    validate(cfg, backbone.config.max_position_embeddings)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    written = docs = 0
    bar = progress_bar(total=cfg.num_tokens, unit="tok", desc="distill", disable=not cfg.progress)
    try:
        with atomic_open(out, "w") as fh:
            while written < cfg.num_tokens:
                for ids in sample_batch(backbone, cfg, cfg.batch_size):
                    ids = ids[: cfg.num_tokens - written]
                    if not ids:
                        continue
                    fh.write(json.dumps(_row(backbone.tokenizer, ids, cfg.format)) + "\n")
                    written += len(ids)
                    docs += 1
                    bar.update(len(ids))
                    if written >= cfg.num_tokens:
                        break
    finally:
        bar.close()
    return {"out": str(out), "tokens": written, "documents": docs}


def _row(tokenizer, ids: list[int], fmt: str) -> dict:
    row: dict = {}
    if fmt in ("both", "ids"):
        row["input_ids"] = ids
    if fmt in ("both", "text"):
        row["text"] = tokenizer.decode(ids, skip_special_tokens=True)
    return row
