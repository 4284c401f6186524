"""``multitoken attach``: create an untrained heads dir for a base model.

Head options come from the registered head configs (one flag per config field; a flag that
does not apply to the chosen ``--head`` is an error). Everything is validated and the base is
loaded before anything is written, and the writes are atomic, so a failed attach never
damages an existing directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field

from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.base.config_io import resolved_config_text
from multitoken.base.errors import UsageError
from multitoken.base.outputs import claim_output
from multitoken.pipeline.cli import add_command, threads_for_batches
from multitoken.pipeline.cli.args import add_flag, dataclass_from_args, plain

RESOLVED_CONFIG = "attach_config.json"
_SKIP = ("head_type", "n_future")  # set by --head and --n


@dataclass
class AttachConfig:
    head: str = field(default="replicated", metadata={"help": "head type"})
    n: int = field(default=3, metadata={"help": "tokens predicted per forward pass (head 1 = the base model)"})
    out: str | None = field(default=None, metadata={"help": "heads directory to create"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing output of this command in --out (only the files its record lists; others stay)"})


def register(sub) -> None:
    from multitoken.adapters.registry import registered_heads  # lazy: torch

    p = add_command(sub, "attach", AttachConfig, BackboneConfig, run=run)
    threads_for_batches(p)  # copies and initialises layers: not one sequence's decoding
    for action in p._actions:  # the head names are only known once the registry is loaded
        if action.dest == "head":
            action.choices = registered_heads()
    _add_head_options(p)


def _add_head_options(parser: argparse.ArgumentParser) -> None:
    """One flag per head-config field across all registered types (absent unless given)."""
    from multitoken.adapters.registry import get_head, registered_heads  # lazy: torch

    group = parser.add_argument_group("head options (each applies to the head types listed)")
    owners: dict[str, list[str]] = {}
    fields: dict[str, tuple] = {}
    for name in registered_heads():
        cls = get_head(name).config_cls
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in _SKIP:
                owners.setdefault(f.name, []).append(name)
                fields.setdefault(f.name, (f, hints[f.name]))
    for fname, (f, tp) in fields.items():
        help_ = f"{f.metadata.get('help', '')} [{', '.join(owners[fname])}; default {f.metadata.get('default_help', plain(f.default))}]"
        meta = {**f.metadata, "help": help_, "metavar": fname.upper()}
        add_flag(group, fname, tp, meta, argparse.SUPPRESS, dest=f"head_{fname}")


def head_options(args) -> dict:
    return {k[len("head_"):]: v for k, v in vars(args).items() if k.startswith("head_")}


def run(args) -> None:
    from multitoken.adapters.registry import make_config  # lazy: torch

    from multitoken.pipeline.model.loading import load_backbone  # lazy: torch
    from multitoken.pipeline.model.model import MultiTokenModel  # lazy: torch

    cfg = dataclass_from_args(AttachConfig, args)
    backbone_config = dataclass_from_args(BackboneConfig, args)
    with claim_output(cfg.out, "heads", overwrite=cfg.overwrite, inputs=(backbone_config.base,)) as out:
        head_config = make_config(cfg.head, n_future=cfg.n, **head_options(args))
        model = MultiTokenModel.attach(load_backbone(backbone_config), head_config)
        n_params = sum(p.numel() for p in model.head_parameters())
        if n_params == 0:  # before anything is written
            raise UsageError(f"--head {cfg.head} --n {cfg.n} gives heads with 0 trainable parameters (head 1 is the "
                             "base model's own next token): nothing to train, and decoding them is plain decoding",
                             "pass --n 2 or more")
        extra = {RESOLVED_CONFIG: resolved_config_text("attach", cfg, backbone_config, head_config)}
        model.save_heads(out, extra=extra, command="attach")
    print(f"attached {cfg.head} heads (n={cfg.n}, {n_params:,} trainable parameters) to {backbone_config.base} -> {out}")
