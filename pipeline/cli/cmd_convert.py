"""``multitoken convert-llama2c``: import a llama2.c checkpoint as a Hugging Face Llama."""

from __future__ import annotations

from dataclasses import dataclass, field

from multitoken.base.errors import UsageError
from multitoken.base.outputs import add_overwrite_flag, claim_output
from multitoken.pipeline.cli import add_command
from multitoken.pipeline.cli.args import dataclass_from_args
from multitoken.pipeline.sources.llama2c import convert_llama2c


@dataclass
class ConvertLlama2cConfig:
    model: str = field(default="", metadata={"positional": True, "help": "llama2.c legacy .bin checkpoint"})
    tokenizer: str | None = field(default=None, metadata={"help": "its SentencePiece tokenizer (.model)"})
    out: str | None = field(default=None, metadata={"help": "output directory (must not exist or be empty)"})


def register(sub) -> None:
    add_overwrite_flag(add_command(sub, "convert-llama2c", ConvertLlama2cConfig, run=run))


def run(args) -> None:
    cfg = dataclass_from_args(ConvertLlama2cConfig, args)
    with claim_output(cfg.out, "convert", overwrite=args.overwrite, inputs=(cfg.model, cfg.tokenizer)):
        if cfg.tokenizer is None:
            raise UsageError("convert-llama2c needs --tokenizer", "e.g. --tokenizer tok512.model --out my-model/")
        out = convert_llama2c(cfg.model, cfg.tokenizer, cfg.out, overwrite=args.overwrite)
    print(f"wrote Hugging Face Llama checkpoint to {out}")
