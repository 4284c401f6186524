"""``multitoken generate``: continue a prompt with multi-token decoding (``DecodeConfig`` modes).

With only a prompt it runs the embedded model with the embedded heads and stats (when shipped);
``--base/--heads/--stats`` choose others. Text streams to stdout as tokens become final and the
trace summary goes to stderr; ``--json`` prints one JSON object instead (token ids, text, trace,
resolved configs), for scripts. ``--prompts FILE --out FILE.jsonl`` decodes every prompt of a file
(one per line, or jsonl with ``prompt``/``text``), ``--batch-size`` rows at a time, and writes one
JSON object per prompt (prompt, token ids, text, trace) atomically, its settings beside it in
``FILE.jsonl.config.json``; each row is what the prompt alone gives with the same ``--seed``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from dataclasses import dataclass, field

from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.embedded import shipped_heads, shipped_stats
from multitoken.base.atomic import atomic_write_text
from multitoken.base.config_io import config_dict, save_resolved_config
from multitoken.base.errors import UsageError
from multitoken.base.outputs import CONFIG_SUFFIX, GENERATIONS, add_overwrite_flag, claim_file
from multitoken.base.publish import staged_file
from multitoken.pipeline.cli import add_command, base_from_heads
from multitoken.pipeline.cli.args import dataclass_from_args


@dataclass
class GenerateConfig:
    prompt: str = field(default="", metadata={"positional": True, "nargs": "?", "help": "text to continue (or --prompts FILE)"})
    heads: str | None = field(default=None, metadata={"help": "heads dir, or embedded:NAME for one the package ships (default: the heads shipped for the base: the embedded ones; for the fetched SmolLM2 its token-conditioned heads in speculative / typical mode, its replicated heads otherwise)"})
    stats: str | None = field(default=None, metadata={"help": "co-occurrence stats dir (or embedded:NAME) for dynamic masking (default: the embedded stats with the embedded base)"})
    json: bool = field(default=False, metadata={"help": "print one JSON object (token_ids, text, trace) instead of streaming"})
    verbose: bool = field(default=False, metadata={"help": "the summary on stderr also shows the decoding's internals: accepted drafts, tokens per step and back-offs, how grids were built, rows per unembedding call (--json always holds them)"})
    prompts: str | None = field(default=None, metadata={"help": "prompts file (one per line, or jsonl with 'prompt'/'text'): decode them all, writing --out"})
    batch_size: int = field(default=8, metadata={"help": "with --prompts: rows decoded together (1: one at a time, the same tokens)"})
    out: str | None = field(default=None, metadata={"help": "with --prompts: the jsonl file written (one object per prompt)"})


def register(sub) -> None:
    from multitoken.decoding.config import DecodeConfig  # lazy: torch

    parser = add_command(sub, "generate", GenerateConfig, DecodeConfig, BackboneConfig, run=run)
    add_overwrite_flag(parser)
    base_from_heads(parser)


def _load(cfg: GenerateConfig, base_cfg: BackboneConfig, drafting: bool):
    """(model, heads dir or None): ``--heads`` on ``--base`` or the base recorded with them;
    without ``--heads``, the heads shipped for the base, its drafting ones where the mode verifies
    drafts (``shipped_heads``), else the base alone."""
    from multitoken.pipeline.sources.assets import load_base_only, load_model  # lazy: torch

    heads = cfg.heads or shipped_heads(base_cfg.base, drafting)
    if heads is None:
        return load_base_only(base_cfg), None
    return load_model(heads, **dataclasses.asdict(base_cfg))


def _table(cfg: GenerateConfig, decode, stats: str | None, tokenizer):
    """The co-occurrence table decoding reads (None in ar mode, which reads none). A ``--stats``
    given is opened and checked in every mode, so a wrong path fails the same way whatever the mode."""
    from multitoken.pipeline.sources.assets import load_stats  # lazy: torch

    table = load_stats(stats, tokenizer) if decode.mode != "ar" or cfg.stats else None
    return table if decode.mode != "ar" else None


def _note_order_cap(decode, model, table) -> None:
    """One line on stderr when the stats' order caps the heads read (recorded in the trace too)."""
    from multitoken.decoding.plan import resolve  # lazy: torch

    cap = resolve(decode, model, table).stats_cap  # the engine's own plan
    if cap:
        from multitoken.stats.format import MAX_ORDER  # lazy: numpy, only when a cap applies

        want = decode.order(model.n_future)
        if cap < MAX_ORDER:
            more = f"more tokens per step need stats built with --order {min(want, MAX_ORDER)}"
            more += f"; stats count at most order {MAX_ORDER}" if want > MAX_ORDER else ""
        else:
            more = f"stats count at most order {MAX_ORDER}: pass --n {cap} to skip this note"
        print(f"note: the stats hold n-grams up to order {cap}: reading the first {cap} of the {want} heads ({more})",
              file=sys.stderr)


class _Streamer:
    """Prints the prompt, then the continuation's text as it becomes stable (``TextStream``: the
    prompt's boundary, multi-byte characters and word-start spaces come out as decoded whole)."""

    def __init__(self, tokenizer, prompt: str, prompt_ids: list[int]):
        from multitoken.decoding.text import TextStream  # lazy: the decoding package imports torch

        self.stream = TextStream(tokenizer, prompt_ids)
        self.prompt = prompt  # printed with the first tokens: the start-up's status line shows until then

    def _text(self, text: str) -> str:
        text, self.prompt = self.prompt + text, ""
        return text

    def __call__(self, tokens: list[int]) -> None:
        print(self._text(self.stream.push(tokens)), end="", flush=True)

    def finish(self) -> None:
        print(self._text(self.stream.finish()), flush=True)


def run(args) -> None:
    from multitoken.decoding.config import DecodeConfig, check_context, stats_order_cap  # lazy: torch
    from multitoken.decoding.engine import generate  # lazy: torch

    from multitoken.pipeline.sources.assets import backbone_config  # lazy: torch

    cfg = dataclass_from_args(GenerateConfig, args)
    cfg.prompt = cfg.prompt or ""  # optional positional: None when --prompts is used
    decode = dataclass_from_args(DecodeConfig, args)
    base_cfg = dataclass_from_args(BackboneConfig, args, base=None)
    if cfg.prompts or cfg.out:
        return run_file(args, cfg, decode, base_cfg)
    if not cfg.prompt.strip():
        raise UsageError("the prompt is empty", 'pass the text to continue, e.g. multitoken generate "Once upon a time"')
    decode.validate()  # the flags alone, before a model loads; the model's bounds below
    fields = {k: v for k, v in dataclasses.asdict(base_cfg).items() if k != "base"}
    base_cfg = backbone_config(cfg.heads, args.base, **fields)  # --base, else --heads' own, else the default
    model, heads = _load(cfg, base_cfg, decode.verifies)
    stats = cfg.stats or shipped_stats(base_cfg.base)
    table = _table(cfg, decode, stats, model.backbone.tokenizer)  # dynamic masking, joint drafts
    decode.validate(vocab_size=model.backbone.vocab_size, n_heads=model.n_future,  # dynamic: k^n, n capped by the stats
                    max_order=stats_order_cap(decode, model.n_future, table, False))
    model.draft_unembedding(decode.speculation.draft_vocab)  # a missing token ranking fails here, before any output
    _note_order_cap(decode, model, table)
    tok = model.backbone.tokenizer
    ids = tok(cfg.prompt, return_tensors="pt").input_ids
    check_context(ids.shape[1], decode.max_new_tokens, model.backbone.config.max_position_embeddings)
    if heads is None and not cfg.json:
        print("note: no heads (pass --heads DIR): decoding one token per forward pass", file=sys.stderr)
    streamer = None if cfg.json else _Streamer(tok, cfg.prompt, ids[0].tolist())
    result = generate(model, ids, decode, table=table, on_tokens=streamer)
    if cfg.json:
        record = result.as_dict()
        record.update(heads=heads, stats=stats, config=config_dict(cfg, decode, base_cfg))
        print(json.dumps(record))
    else:
        streamer.finish()
        print(result.trace.summary(verbose=cfg.verbose), file=sys.stderr)


def _check_file_flags(cfg: GenerateConfig) -> None:
    if cfg.prompt and cfg.prompts:
        raise UsageError("both a prompt and --prompts were given", "pass the text to continue, or --prompts FILE, not both")
    if not cfg.prompts:  # a prompt with --out: --out writes the generations of a prompts file
        raise UsageError("--out needs --prompts FILE (it writes one jsonl row per prompt of that file)",
                         "drop --out to stream this prompt's text, or put the prompt in a file and pass --prompts FILE")
    if not cfg.out:
        raise UsageError("--prompts needs --out FILE.jsonl", "pass where to write the generations")
    if cfg.json:
        raise UsageError("--json prints one prompt's result", "drop --json: --prompts always writes jsonl to --out")
    if cfg.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {cfg.batch_size}")


def run_file(args, cfg: GenerateConfig, decode, base_cfg: BackboneConfig) -> None:
    """Every prompt of ``--prompts``, ``--batch-size`` at a time, to ``--out`` (jsonl)."""
    from multitoken.pipeline.eval.sweep import read_prompts  # lazy: the eval package imports torch
    from multitoken.pipeline.sources.assets import backbone_config  # lazy: torch

    _check_file_flags(cfg)
    decode.validate()
    texts = read_prompts(cfg.prompts)
    fields = {k: v for k, v in dataclasses.asdict(base_cfg).items() if k != "base"}
    base_cfg = backbone_config(cfg.heads, args.base, **fields)
    with claim_file(cfg.out, "generate", overwrite=args.overwrite, inputs=(cfg.prompts, base_cfg.base)):
        _generate_file(cfg, decode, base_cfg, texts)


def _generate_file(cfg: GenerateConfig, decode, base_cfg: BackboneConfig, texts: list[str]) -> None:
    from multitoken.decoding.engine import generate_batch  # lazy: torch
    from multitoken.decoding.config import check_context, stats_order_cap  # lazy: torch

    model, heads = _load(cfg, base_cfg, decode.verifies)
    stats = cfg.stats or shipped_stats(base_cfg.base)
    table = _table(cfg, decode, stats, model.backbone.tokenizer)  # dynamic masking, joint drafts
    decode.validate(vocab_size=model.backbone.vocab_size, n_heads=model.n_future,
                    max_order=stats_order_cap(decode, model.n_future, table, False))
    model.draft_unembedding(decode.speculation.draft_vocab)  # a missing token ranking fails here, before any output
    _note_order_cap(decode, model, table)
    tok = model.backbone.tokenizer
    ids = [tok(t)["input_ids"] for t in texts]
    for i, row in enumerate(ids, 1):
        if not row:
            raise UsageError(f"prompt {i} of {cfg.prompts} has no tokens", "remove it or give it some text")
        check_context(len(row), decode.max_new_tokens, model.backbone.config.max_position_embeddings)
    lines = []
    for start in range(0, len(ids), cfg.batch_size):
        chunk = ids[start:start + cfg.batch_size]
        for k, result in enumerate(generate_batch(model, chunk, decode, table=table)):
            lines.append(json.dumps({"prompt": texts[start + k], **result.as_dict()}))
        print(f"{min(start + cfg.batch_size, len(ids))}/{len(ids)} prompts", file=sys.stderr)
    name = Path(cfg.out).name
    with staged_file(cfg.out, GENERATIONS.kind, "generate") as stage:  # all or nothing, recorded
        atomic_write_text(stage / name, "\n".join(lines) + "\n")
        save_resolved_config(stage / (name + CONFIG_SUFFIX), "generate", cfg, decode, base_cfg, extra={"heads": heads, "stats": stats})

